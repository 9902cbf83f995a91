"""The shared prompt's attention, GSM8K-shaped: the dense block mask (one sdpa call per packed row) against split
attention (one sdpa call per sequence, rlkit/packing.py), in the engine's own passes, alternated in one process;
--flex adds FlexAttention (torch.compile'd, block-sparse) at the attention-op level, forward only: torch 2.13 has
no FlexAttention backward on CPU.

    python bench/attention.py                  # random Llama 4.3M (h 256 x 4 layers), 2 prompts of 200 x 8 responses of 20-300
    python bench/attention.py --flex           # + FlexAttention forward vs sdpa with the dense mask, one layer's shapes

Prints per arm the median seconds of a log-prob pass (no gradient) and of a forward + backward (the update's work),
and the attention pairs each layout computes against those the tokens need; then the roofline (bench/common.py:
"ref" the log-prob pass, "update" forward + backward, % of a matmul ceiling sampled after every round).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402


def gsm8k_batch(prompts: int, n: int, prompt_tokens: int, lo: int, hi: int, vocab: int, seed: int):
    """prompts x n rows in the rollout's layout: each prompt prompt_tokens random tokens (no padding), responses of
    lengths uniform in [lo, hi], right-padded; advantages random."""
    import torch

    from rlkit.protocol import DataProto

    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(prompts):
        prompt = torch.randint(3, vocab, (prompt_tokens,), generator=g)
        for _ in range(n):
            r = int(torch.randint(lo, hi + 1, (1,), generator=g))
            resp = torch.cat([torch.randint(3, vocab, (r,), generator=g), torch.zeros(hi - r, dtype=torch.long)])
            rows.append((torch.cat([prompt, resp]), torch.cat([torch.ones(prompt_tokens + r), torch.zeros(hi - r)]).long()))
    ids, attn = torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows])
    return DataProto.from_dict(
        {
            "prompts": ids[:, :prompt_tokens],
            "responses": ids[:, prompt_tokens:],
            "response_mask": attn[:, prompt_tokens:],
            "input_ids": ids,
            "attention_mask": attn,
            "position_ids": (attn.cumsum(-1) - 1).clamp(min=0),
            "advantages": torch.randn(len(ids), hi, generator=g),
        }
    )


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--prompts", type=int, default=2)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=200)
    p.add_argument("--min-new-tokens", type=int, default=20)
    p.add_argument("--max-new-tokens", type=int, default=300)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--flex", action="store_true", help="also FlexAttention's forward at the op level (compiles: ~1-2 min)")
    args = p.parse_args(argv)
    common.set_threads(args.threads)
    import torch

    from rlkit import packing
    from rlkit.config import ActorConfig, ModelConfig, ModelSystem
    from rlkit.engine import TorchEngine

    work = Path(tempfile.mkdtemp(prefix="rlkit-attn-"))
    path = common.make_random_model(work / "m", args.hidden, args.layers, sampled_eos=True)
    with common.quiet():
        eng = TorchEngine(ModelConfig(path=path), ActorConfig(lr=1e-4), device="cpu", model_sys=ModelSystem(attn_implementation="sdpa"))
    b = gsm8k_batch(args.prompts, args.n, args.prompt_tokens, args.min_new_tokens, args.max_new_tokens, eng.model.config.vocab_size, 0)
    pk = packing.pack(b["input_ids"], b["attention_mask"], b["position_ids"], args.prompt_tokens, share=True)
    dense_pairs = pk.input_ids.shape[0] * pk.input_ids.shape[1] ** 2
    groups = common.groups_of(
        [args.prompt_tokens] * len(b), b["attention_mask"][:, args.prompt_tokens :].sum(-1).tolist(), [i // args.n for i in range(len(b))]
    )
    needed = sum(common.group_counts(pr, rs)[2] for pr, rs in groups)
    print(
        f"{len(b)} rows, packed into {pk.input_ids.shape[0]} rows of {pk.input_ids.shape[1]}; attention pairs per layer: "
        f"dense mask {dense_pairs / 1e6:.2f}M, needed {needed / 1e6:.2f}M ({dense_pairs / needed:.1f}x); {torch.get_num_threads()} thread(s)"
    )

    def logprob():
        eng.compute_log_prob(b, 1.0, len(b))

    def fwd_bwd():
        logp, _ = eng.forward(eng.model, b, 1.0, False)
        (logp * b["advantages"] * b["response_mask"]).sum().backward()
        eng.model.zero_grad(set_to_none=True)

    times = {(arm, what): [] for arm in ("mask", "split") for what in ("log-prob pass", "forward+backward")}
    ceiling = common.Ceiling(eng.model.config, decode_rows=0)  # the passes' matmul ceiling, sampled every round
    for r in range(args.rounds + 1):  # round 0: warm-up
        for arm in ("mask", "split"):
            eng.split_attention = arm == "split"
            for what, fn in (("log-prob pass", logprob), ("forward+backward", fwd_bwd)):
                t = common.now()
                fn()
                if r:
                    times[(arm, what)].append(common.now() - t)
        if r:
            ceiling.sample(groups)
    rows = [[arm, what, f"{common.median(v):.3f}", f"{min(v):.3f}"] for (arm, what), v in times.items()]
    print(common.fmt_table(rows, ["attention", "pass", "median s", "min s"]))
    for what in ("log-prob pass", "forward+backward"):
        ratio = common.median([s / m for s, m in zip(times[("split", what)], times[("mask", what)])])
        print(f"{what}: split / mask = {ratio:.2f}x (median of per-round ratios)")
    # roofline: the log-prob pass is a forward ("ref"), forward + backward the update's 3x (no optimizer step here)
    sides = {
        arm: [{"ref": a, "update": b} for a, b in zip(times[(arm, "log-prob pass")], times[(arm, "forward+backward")])]
        for arm in ("mask", "split")
    }
    print(common.roofline_table(eng.model.config, [groups] * args.rounds, sides, ceiling))
    if args.flex:
        flex(pk, eng.model.config, args.rounds)


def flex(pk, config, rounds: int):
    """FlexAttention forward (compiled) vs sdpa with the dense mask, one layer's q/k/v shapes of the packed rows."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    from rlkit import packing

    seg, sub = pk.segment_ids, pk.sub_ids
    rows, C = seg.shape
    heads = config.num_attention_heads
    d = config.hidden_size // heads
    dense = packing.block_mask(seg, sub)[:, None]

    def mask_mod(b, h, q, kv):  # packing.block_mask's rule
        same = (seg[b, q] == seg[b, kv]) & (seg[b, q] >= 0) & ((sub[b, kv] == 0) | (sub[b, kv] == sub[b, q]))
        return ((kv <= q) & same) | (q == kv)

    t = common.now()
    bm = create_block_mask(mask_mod, rows, None, C, C, device="cpu")
    print(f"FlexAttention: create_block_mask {common.now() - t:.2f}s, {bm.sparsity():.0f}% of the blocks skipped")
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(rows, heads, C, d, generator=g) for _ in range(3))
    compiled = torch.compile(flex_attention)
    t = common.now()
    with torch.no_grad():
        out = compiled(q, k, v, block_mask=bm)
    print(
        f"first call (compiles) {common.now() - t:.1f}s; max |flex - sdpa mask| {(out - F.scaled_dot_product_attention(q, k, v, attn_mask=dense)).abs().max():.1e}"
    )
    times = {"sdpa, dense mask": [], "flex, compiled": []}
    with torch.no_grad():
        for _ in range(rounds):
            for name, fn in (
                ("sdpa, dense mask", lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=dense)),
                ("flex, compiled", lambda: compiled(q, k, v, block_mask=bm)),
            ):
                t = common.now()
                fn()
                times[name].append(common.now() - t)
    print(", ".join(f"{k} {common.median(v) * 1e3:.1f} ms" for k, v in times.items()) + " per layer forward (median)")
    qg = q.clone().requires_grad_()
    try:
        compiled(qg, k, v, block_mask=bm).sum().backward()
        print("FlexAttention backward: ran")
    except Exception as e:  # noqa: BLE001 -- torch 2.13 raises NotImplementedError on CPU
        print(f"FlexAttention backward: {type(e).__name__}: {str(e).splitlines()[0][:120]}")


if __name__ == "__main__":
    main()
