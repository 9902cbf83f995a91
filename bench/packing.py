"""Padding-free passes at a real vocabulary: time and peak RSS of the log-prob pass and one update, per layout.

A random Qwen2-shaped model (vocabulary 151,936, small hidden size) and a GSM8K-shaped batch: P prompts of
~200 tokens x n = 8 responses of 20..300 tokens (uniform), no generation (the batch is synthetic, so every arm
gets exactly the same tokens). Each arm runs in its own process, so its peak RSS is its own:

    padded     the rollout's padded rows (--model.no-remove-padding): every prompt n times, every response to the longest
    unshared   packed real tokens, each row its own prompt (--model.no-share-prompt)
    packed     packed, each group's prompt once (the default)
    budget     packed, micro-batches of at most --budget positions (--actor.max-token-len-per-micro-batch)

Ends with the roofline (bench/common.py): the log-prob pass ("old_log_prob") and the update's FLOPs, GFLOP/s and %
of a matmul ceiling each arm's process measures right after its passes (the update's AdamW step is not counted).

    python bench/packing.py                 # all arms, alternated --rounds times
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

ARMS = ("padded", "unshared", "packed", "budget")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=2)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=151_936)
    p.add_argument("--micro-batch", type=int, default=4, help="rows per forward pass (--actor.ppo-micro-batch-size)")
    p.add_argument("--budget", type=int, default=1024, help="positions per micro-batch of the budget arm (instead of --micro-batch rows)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--arm", choices=ARMS, help="run one arm in this process (internal)")
    p.add_argument("--model-dir", help="internal")
    return p.parse_args(argv)


def make_model(out: Path, args) -> None:
    import shutil

    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from rlkit import demos

    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
    )
    Qwen2ForCausalLM(cfg).save_pretrained(out)
    for f in ("tokenizer.json", "tokenizer_config.json"):  # a tokenizer to load; the ids below are synthetic
        shutil.copy(demos.ARITH_MODEL / f, out / f)


def make_batch(args, pad_id: int = 0):
    import torch

    from rlkit.protocol import DataProto

    g = torch.Generator().manual_seed(0)
    plens = torch.randint(190, 211, (args.prompts,), generator=g).tolist()
    rlens = torch.randint(20, 301, (args.prompts * args.n,), generator=g).tolist()
    P, R = max(plens), max(rlens)
    ids, attn = [], []
    for i, plen in enumerate(plens):
        prompt = torch.randint(10, args.vocab, (plen,), generator=g)
        for j in range(args.n):
            rlen = rlens[i * args.n + j]
            resp = torch.randint(10, args.vocab, (rlen,), generator=g)
            ids.append(torch.cat([torch.full((P - plen,), pad_id), prompt, resp, torch.full((R - rlen,), pad_id)]))
            attn.append(torch.cat([torch.zeros(P - plen), torch.ones(plen + rlen), torch.zeros(R - rlen)]).long())
    ids, attn = torch.stack(ids), torch.stack(attn)
    return DataProto.from_dict(
        {
            "prompts": ids[:, :P],
            "responses": ids[:, P:],
            "response_mask": attn[:, P:],
            "input_ids": ids,
            "attention_mask": attn,
            "position_ids": (attn.cumsum(-1) - 1).clamp(min=0),
            "advantages": torch.randn(len(ids), R, generator=g) * attn[:, P:],
        }
    )


def rss_mib() -> float:
    return float(Path("/proc/self/statm").read_text().split()[1]) * 4096 / 2**20


def peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_arm(args) -> dict:
    import torch

    from rlkit import algos
    from rlkit.config import ActorConfig, ActorSystem, ModelConfig, ModelSystem
    from rlkit.engine import TorchEngine

    torch.set_num_threads(1)
    model_sys = ModelSystem(remove_padding=args.arm != "padded", share_prompt=args.arm != "unshared")
    update_sys = ActorSystem(max_token_len_per_micro_batch=args.budget if args.arm == "budget" else 0)
    eng = TorchEngine(ModelConfig(path=args.model_dir), ActorConfig(lr=1e-5), device="cpu", model_sys=model_sys, update_sys=update_sys)
    batch = make_batch(args)
    rows = len(batch)

    def loss_fn(mb, log_prob, entropy, norm):
        loss = algos.agg_loss(-log_prob * mb["advantages"], mb["response_mask"], "token-mean", norm=norm)
        return loss, {}, {}

    out = {"arm": args.arm, "start_rss": rss_mib()}
    t = time.perf_counter()
    lp, _ = eng.compute_log_prob(batch, 1.0, args.micro_batch)
    out["log_prob_s"], out["log_prob_peak"] = time.perf_counter() - t, peak_mib()
    t = time.perf_counter()
    eng.update(batch, loss_fn, rows, args.micro_batch)
    out["update_s"], out["update_peak"] = time.perf_counter() - t, peak_mib()
    out["lp_sum"] = float((lp * batch["response_mask"]).sum())
    # the roofline's ceiling, measured in this arm's process right after its passes (bench/common.py)
    P = batch["prompts"].shape[1]
    out["groups"] = common.groups_of(
        batch["attention_mask"][:, :P].sum(-1).tolist(), batch["response_mask"].sum(-1).tolist(), [i // args.n for i in range(rows)]
    )
    ceiling = common.Ceiling(eng.model.config, decode_rows=0)
    ceiling.sample(out["groups"])
    out["ceiling"], out["ceiling_rows"] = ceiling.passes[0], ceiling.pass_rows
    return out


def main(argv=None):
    args = parse_args(argv)
    if args.arm:
        print(json.dumps(run_arm(args)))
        return
    work = Path(tempfile.mkdtemp(prefix="rlkit-packing-"))
    make_model(work, args)
    res = {a: [] for a in ARMS}
    for _ in range(args.rounds):
        for arm in ARMS:  # alternated: the machine's load moves
            cmd = [sys.executable, __file__, "--arm", arm, "--model-dir", str(work)] + [
                f"--{k.replace('_', '-')}={getattr(args, k)}"
                for k in ("prompts", "n", "hidden", "layers", "vocab", "budget", "micro_batch")
            ]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
            res[arm].append(json.loads(out))
            print({k: v for k, v in res[arm][-1].items() if k != "groups"}, flush=True)
    print(
        f"\n{args.prompts} prompts x {args.n}, micro-batches of {args.micro_batch} rows (budget arm: {args.budget} positions), vocab {args.vocab}, hidden {args.hidden} x {args.layers} layers, 1 thread; medians of {args.rounds}"
    )
    print("| layout | log-prob pass s | update s | peak RSS MiB (log-prob, update) | response log-prob sum |")
    print("| --- | --- | --- | --- | --- |")
    for arm, rs in res.items():
        med = lambda k, rs=rs: sorted(r[k] for r in rs)[len(rs) // 2]  # noqa: E731
        print(
            f"| {arm} | {med('log_prob_s'):.2f} | {med('update_s'):.2f} | {med('log_prob_peak'):.0f}, {med('update_peak'):.0f} | {rs[0]['lp_sum']:.2f} |"
        )
    # roofline: the same tokens in every arm (one batch), so the same FLOPs; each arm's ceiling from its own process
    from transformers import AutoConfig

    ceiling = common.Ceiling(AutoConfig.from_pretrained(work), decode_rows=0)
    ceiling.passes = [r["ceiling"] for rs in res.values() for r in rs]
    ceiling.pass_rows = res[ARMS[0]][0]["ceiling_rows"]
    sides = {arm: [{"old_log_prob": r["log_prob_s"], "update": r["update_s"]} for r in rs] for arm, rs in res.items()}
    print(common.roofline_table(ceiling.config, [res[ARMS[0]][0]["groups"]] * args.rounds, sides, ceiling))


if __name__ == "__main__":
    main()
