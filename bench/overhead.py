"""rlkit's GRPO step against a bare torch loop doing the same compute, alternated in one process.

The bare loop (written here, ~40 lines, in `BareGRPO`) is what the step costs with no library at all: on the
same prompts it calls `model.generate` with rlkit's sampling settings, decodes and scores with the same reward
function, runs a reference forward (frozen copy) and an old-log-prob forward without gradients, then one
forward+backward of the same GRPO loss (clipped surrogate + k3 KL, token-mean) and a grad-clipped AdamW step.
Both sides start from the same weights and are seeded identically before generating, so they sample the same
responses for as long as their weights agree (they do the same updates; the generated-token counts printed
show whether the work stayed identical).

    python bench/overhead.py                         # embedded model, 32 prompts x 8, 8 tokens, 6 timed pairs
    python bench/overhead.py --model random --max-new-tokens 32 --prompts 16

Prints the median seconds per step of each side, the ratio rlkit/bare (target <= 1.15x), and where each
side's time goes (rlkit's own timing/* metrics: gen, reward, ref, old_log_prob, update), then the roofline
(bench/common.py: each phase's FLOPs, GFLOP/s and % of a matmul ceiling sampled after every step).
"""

from __future__ import annotations

import argparse
import copy
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

PHASES = ["gen", "reward", "ref", "old_log_prob", "update"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="embedded", help="'embedded', 'random' (random-weight Llama, --hidden/--layers) or a model folder")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--beta", type=float, default=0.001)
    p.add_argument("--steps", type=int, default=6, help="timed steps per side")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument(
        "--variants",
        default="",
        metavar="A,B",
        help="also time rlkit with prototyped optimisations: comma-separated from skip_old_lp, logits_to_keep, prefix, all (= skip_old_lp+prefix); see docs/performance.md",
    )
    p.add_argument("--seed", type=int, default=1)
    return p.parse_args(argv)


class BareGRPO:
    """The same GRPO step as plain torch + transformers, no rlkit engine/worker/DataProto."""

    def __init__(self, model, tokenizer, eos: list[int], reward_fn, prompts_loader, n, max_new_tokens, lr, beta):
        import torch

        self.model, self.tok, self.eos, self.reward_fn, self.loader = model.eval(), tokenizer, eos, reward_fn, prompts_loader
        self.ref = copy.deepcopy(model).requires_grad_(False)
        self.opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
        self.n, self.max_new_tokens, self.beta = n, max_new_tokens, beta

    def step(self) -> dict:
        import torch
        import torch.nn.functional as F

        t, n = {}, self.n
        t0 = common.now()
        b = self.loader.next_batch()
        ids = b["input_ids"].repeat_interleave(n, 0)
        pmask = b["attention_mask"].repeat_interleave(n, 0)
        ground_truth = [g for g in b["ground_truth"] for _ in range(n)]
        sources = [s for s in b["data_source"] for _ in range(n)]
        extra = [e for e in b["extra_info"] for _ in range(n)]

        s = common.now()
        with torch.no_grad():
            seq = self.model.generate(
                input_ids=ids,
                attention_mask=pmask,
                do_sample=True,
                max_new_tokens=self.max_new_tokens,
                eos_token_id=self.eos,
                pad_token_id=self.tok.pad_token_id,
                temperature=1.0,
                top_p=1.0,
                top_k=None,
                repetition_penalty=1.0,
                min_p=None,
                typical_p=1.0,
                no_repeat_ngram_size=0,
            )
        P = ids.shape[1]
        resp = seq[:, P:]
        is_eos = torch.isin(resp, torch.tensor(self.eos))
        rmask = ((is_eos.cumsum(-1) - is_eos.long()) == 0).long()
        t["gen"] = common.now() - s

        s = common.now()
        texts = self.tok.batch_decode(resp.masked_fill(rmask == 0, self.tok.pad_token_id), skip_special_tokens=True)
        scores, _ = self.reward_fn(sources, texts, ground_truth, extra)
        g = scores.view(-1, n)
        adv = ((g - g.mean(1, keepdim=True)) / (g.std(1, keepdim=True) + 1e-6)).view(-1, 1)
        t["reward"] = common.now() - s

        attn = torch.cat([pmask, rmask], 1)
        pos = (attn.cumsum(-1) - 1).clamp(min=0)
        m = rmask.float()

        def logprobs(model):
            logits = model(input_ids=seq, attention_mask=attn, position_ids=pos, use_cache=False).logits[:, P - 1 : -1].float()
            return torch.gather(F.log_softmax(logits, -1), -1, resp.unsqueeze(-1)).squeeze(-1)

        s = common.now()
        with torch.no_grad():
            ref = logprobs(self.ref)
        t["ref"] = common.now() - s
        s = common.now()
        with torch.no_grad():
            old = logprobs(self.model)
        t["old_log_prob"] = common.now() - s

        s = common.now()
        self.opt.zero_grad(set_to_none=True)
        logp = logprobs(self.model)
        ratio = torch.exp(logp - old)
        pg = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.2))
        kl = (torch.exp(ref - logp) - (ref - logp) - 1).clamp(-10, 10)
        loss = ((pg + self.beta * kl) * m).sum() / m.sum().clamp(min=1)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        t["update"] = common.now() - s
        t["step"] = common.now() - t0
        t["gen_tokens"] = int(rmask.sum())
        return t


def main(argv=None):
    args = parse_args(argv)
    common.set_threads(args.threads)
    import torch

    from rlkit.data import PromptLoader
    from rlkit.rollout import eos_ids

    work = Path(tempfile.mkdtemp(prefix="rlkit-bench-"))
    model_path = common.resolve_model(args.model, work, args.hidden, args.layers)
    rl = {
        name: common.RlkitGRPO(
            model_path, args.prompts, args.n, args.max_new_tokens, args.lr, args.beta, args.threads, work / name, seed=args.seed, **kw
        )
        for name, kw in common.arms(args.variants).items()
    }
    first = rl["rlkit"]
    loader = PromptLoader(first.train.prompts, args.prompts, first.tok.pad_token_id, True, args.seed)  # same prompt order
    bare_model = copy.deepcopy(first.model)
    bare = BareGRPO(
        bare_model, first.tok, eos_ids(first.model, first.tok), first.reward_fn, loader, args.n, args.max_new_tokens, args.lr, args.beta
    )
    print(
        f"rlkit step vs bare torch loop, {torch.get_num_threads()} thread(s), model {model_path}\n"
        f"{args.prompts} prompts x {args.n} samples, <= {args.max_new_tokens} new tokens, lr {args.lr}, beta {args.beta}, "
        f"{args.warmup} warm-up + {args.steps} timed steps per side, alternated"
    )

    sides = {"bare": bare, **rl}
    res = {k: [] for k in sides}
    ceiling = common.Ceiling(first.model.config, decode_rows=args.prompts * args.n)
    for i in range(args.warmup + args.steps):
        for name, side in sides.items():  # bare, rlkit, [variants], bare, rlkit, ...
            torch.set_num_threads(args.threads)
            torch.manual_seed(args.seed * 1000 + i)  # same samples on both sides while their weights agree
            res[name].append(side.step())
        if i >= args.warmup:  # the matmul ceiling under the same load as the steps (common.Ceiling)
            ceiling.sample(res["rlkit"][-1]["groups"])
        print(
            f"step {i + 1}{' (warm-up)' if i < args.warmup else ''}: "
            + " | ".join(f"{k} {v[-1]['step']:.3f}s {v[-1]['gen_tokens']} tok" for k, v in res.items()),
            flush=True,
        )

    w = args.warmup
    med = {k: common.median([r["step"] for r in v[w:]]) for k, v in res.items()}
    paired = {k: common.median([a["step"] / b["step"] for a, b in zip(v[w:], res["bare"][w:])]) for k, v in res.items()}
    rows = []
    for k, v in res.items():
        rows.append(
            [
                k,
                f"{med[k]:.3f}",
                f"{med[k] / med['bare']:.2f}",
                f"{paired[k]:.2f}",
                f"{common.median([r['gen_tokens'] for r in v[w:]]):.0f}",
                *[f"{common.median([r[p] for r in v[w:]]):.3f}" for p in PHASES],
            ]
        )
    print()
    print(common.fmt_table(rows, ["side", "median s/step", "x bare", "paired", "gen tokens", *[f"{p} s" for p in PHASES]]))
    same = all(a["gen_tokens"] == b["gen_tokens"] for a, b in zip(res["bare"][w:], res["rlkit"][w:]))
    print(f"generated tokens {'identical on every timed step' if same else 'differ on some steps (weights drifted apart; see gen tokens)'}")
    # the roofline: FLOPs counted on rlkit's batches (the bare loop's are the same while the tokens are)
    timed = {k: [{p: r[p] for p in ("gen", "ref", "old_log_prob", "update")} for r in v[w:]] for k, v in res.items()}
    steps = [r["groups"] for r in res["rlkit"][w:]]
    print("\n" + common.roofline_table(first.model.config, steps, timed, ceiling, old_log_prob=res["rlkit"][w]["ran_old_log_prob"]))
    fastest = {k: min(r["step"] for r in v[w:]) for k, v in res.items()}
    print(
        f"\nrlkit / bare = {med['rlkit'] / med['bare']:.2f}x (ratio of medians; median of per-step ratios {paired['rlkit']:.2f}x; "
        f"ratio of fastest steps {fastest['rlkit'] / fastest['bare']:.2f}x; target <= 1.15x)"
    )
    shutil.rmtree(work, ignore_errors=True)
    return {"median": med, "results": res}


if __name__ == "__main__":
    main()
