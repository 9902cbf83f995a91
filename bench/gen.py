"""Generation throughput: transformers' generate vs rlkit's fast decoding loop (--rollout.hf-impl) vs vLLM, one process.

Each round runs every arm once on the same prompt batch (P prompts x n samples, the GRPO layout: each group's prompt
prefilled once), seeded the same, arms alternated (generate, fast, vllm, generate, ...) so load from other jobs hits
all alike. Prints per arm the median seconds per batch, generated tokens/s, and the median of per-round ratios to
generate; checks that fast sampled exactly generate's tokens; ends with the roofline (bench/common.py: each arm's FLOPs
on its own tokens, % of a matmul ceiling at the decode step's rows, sampled after every round). vLLM (the CPU build) runs in-process, eager, float32,
its own sampler (other tokens, same distribution). See bench/README.md and docs/performance.md.

    python bench/gen.py                                          # embedded, random 4.3M, SmolLM2-135M if installed
    python bench/gen.py --models random --prompts 16 --n 8 --max-new-tokens 32 --rounds 7

Arm `drop`: the fast loop with finished rows leaving the batch (`generate(drop_finished=--drop-finished)`); checked to
sample exactly fast's tokens. --eos-frac F makes a random F of the vocabulary end a response (a row ends at each step
with probability ~F: geometric, GSM8K-shaped lengths, most short, a few to the cap), the workload where dropping pays:

    python bench/gen.py --models random --arms fast,drop --eos-frac 0.05 --max-new-tokens 128 --rounds 5
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from pathlib import Path

import common

WORKLOADS = {  # model -> (prompts, n, max new tokens): the vs_trl.py workloads, and a SmolLM2 row
    "embedded": (32, 8, 8),
    "random": (16, 8, 32),
    "smollm2": (4, 4, 64),
}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="embedded,random,smollm2", help="comma-separated: embedded, random, smollm2, or a path")
    ap.add_argument(
        "--arms", default="generate,fast,vllm", help="comma-separated: generate, fast, drop (fast, finished rows dropped), vllm"
    )
    ap.add_argument("--prompts", type=int, default=0, help="prompts per batch (0: the model's workload, WORKLOADS)")
    ap.add_argument("--n", type=int, default=0, help="samples per prompt (0: the workload's)")
    ap.add_argument("--max-new-tokens", type=int, default=0, help="response cap (0: the workload's)")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds (after one untimed warm-up round)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--hidden", type=int, default=256, help="random model: hidden size")
    ap.add_argument("--layers", type=int, default=4, help="random model: layers")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eos-frac", type=float, default=0.0, help="a random fraction of the vocabulary ends responses (0: the model's EOS)")
    ap.add_argument("--drop-finished", type=float, default=0.25, help="arm drop: decode's drop_finished fraction")
    return ap.parse_args(argv)


def model_path(name: str, work: Path, args) -> str | None:
    if name == "smollm2":
        from rlkit.errors import MissingPackage
        from rlkit.models import resolve_model_path

        try:
            return resolve_model_path("smollm2-135m-instruct")
        except MissingPackage as e:
            print(f"smollm2 skipped: {e}")
            return None
    return common.resolve_model(name, work, args.hidden, args.layers)


def run_model(name: str, args, work: Path) -> dict | None:
    import torch
    from transformers import AutoModelForCausalLM

    from rlkit.config import DataConfig, DataSystem, RolloutSystem
    from rlkit.data import build_prompts
    from rlkit.engine import load_tokenizer
    from rlkit.rollout import HFRollout

    path = model_path(name, work, args)
    if path is None:
        return None
    P, n, R = WORKLOADS.get(name, WORKLOADS["smollm2"])
    P, n, R = args.prompts or P, args.n or n, args.max_new_tokens or R
    with common.quiet():
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        tok = load_tokenizer(path)
    data = DataConfig()
    prompts = build_prompts(data.train_files, tok, data, DataSystem(), max_samples=P)
    rows = prompts.batch(list(range(P)), tok.pad_token_id).repeat(n, interleave=True)
    arms, extra = {}, {}
    for arm in args.arms.split(","):
        if arm in ("generate", "fast", "drop"):
            arms[arm] = HFRollout(model, tok, torch.device("cpu"), impl="generate" if arm == "generate" else "fast")
            if arm == "drop":
                extra[arm] = dict(drop_finished=args.drop_finished)
        elif arm == "vllm":
            from rlkit.vllm_rollout import VLLMRollout, vllm_available

            if not vllm_available():
                print("vllm skipped: not installed")
                continue
            with common.quiet():
                arms[arm] = VLLMRollout(
                    model,
                    tok,
                    path,
                    torch.float32,
                    torch.device("cpu"),
                    RolloutSystem(name="vllm"),
                    rows["input_ids"].shape[1] + R,
                    seed=args.seed,
                )
            # the random model's EOS lies past its vocabulary (never sampled, bench/common.py), which vLLM refuses as a stop id
            arms[arm].eos = [e for e in arms[arm].eos if e < model.config.vocab_size]
            torch.set_num_threads(args.threads)
        else:
            raise SystemExit(f"unknown arm {arm!r}: generate, fast, drop, vllm")
    if args.eos_frac:  # every arm stops on the same random tokens
        g = torch.Generator().manual_seed(1234)
        stop = torch.randperm(model.config.vocab_size, generator=g)[: max(1, int(args.eos_frac * model.config.vocab_size))].tolist()
        for rollout in arms.values():
            rollout.eos = stop
    params = sum(p.numel() for p in model.parameters())
    print(
        f"\n== {name}: {params / 1e6:.2f}M params, {P} prompts x {n} samples, prompt width {rows['input_ids'].shape[1]}, <= {R} new tokens"
    )
    times = {k: [] for k in arms}
    tokens = {k: [] for k in arms}
    groups = {k: [] for k in arms}  # each timed round's groups [(P, [R_i])], per arm (vLLM samples its own tokens)
    ceiling = common.Ceiling(model.config, decode_rows=P * n, passes=False)
    prompt_lens = rows["attention_mask"].sum(-1).tolist()
    same, same_drop = [], []
    load = [os.getloadavg()[0]]
    for r in range(args.rounds + 1):
        out = {}
        for k, rollout in arms.items():
            torch.manual_seed(args.seed + r)
            start = common.now()
            out[k] = rollout.generate(rows, R, temperature=args.temperature, **extra.get(k, {}))
            if r:  # round 0 warms up
                times[k].append(common.now() - start)
                tokens[k].append(int(out[k]["response_mask"].sum()))
                groups[k].append(common.groups_of(prompt_lens, out[k]["response_mask"].sum(-1).tolist(), [i // n for i in range(P * n)]))
        if r:  # the matmul ceiling under the same load as the round's arms
            ceiling.sample(groups[next(iter(arms))][-1])
        if "generate" in out and "fast" in out:
            same.append(torch.equal(out["generate"]["responses"], out["fast"]["responses"]))
        if "fast" in out and "drop" in out:
            same_drop.append(torch.equal(out["fast"]["responses"], out["drop"]["responses"]))
        line = " | ".join(f"{k} {v[-1]:.3f}s {tokens[k][-1]} tok" for k, v in times.items()) if r else "warm-up"
        print(f"round {r}: {line}", flush=True)
    load.append(os.getloadavg()[0])
    base = "generate" if "generate" in arms else next(iter(arms))
    table = []
    for k in arms:
        tps = [t / s for t, s in zip(tokens[k], times[k])]
        paired = [s / b for s, b in zip(times[k], times[base])]
        table.append(
            [
                k,
                f"{common.median(times[k]):.3f}",
                f"{common.median(tokens[k]):.0f}",
                f"{common.median(tps):.0f}",
                f"{common.median(paired):.2f}",
            ]
        )
    print(common.fmt_table(table, ["arm", "median s/batch", "tokens/batch", "median tokens/s", f"median paired s / {base}"]))
    if same:
        print(f"fast sampled exactly generate's tokens: {sum(same)}/{len(same)} rounds")
    if same_drop:
        lengths = out["fast"]["response_mask"].sum(-1).float()
        print(
            f"drop sampled exactly fast's tokens: {sum(same_drop)}/{len(same_drop)} rounds; response lengths (last round):"
            f" mean {lengths.mean():.1f}, median {lengths.median():.0f}, max {lengths.max():.0f}, at the cap {int((lengths == R).sum())}/{len(lengths)}"
        )
    print(f"load average (1 min) at start / end: {load[0]:.2f} / {load[1]:.2f}, {args.threads} thread(s)")
    sides = {k: [{"gen": s} for s in times[k]] for k in arms}
    print(common.roofline_table(model.config, groups[base], sides, ceiling, side_steps=groups))
    for rollout in arms.values():
        if hasattr(rollout, "close"):
            rollout.close()
    return {"times": times, "tokens": tokens, "same": same, "same_drop": same_drop}


def main(argv=None):
    args = parse_args(argv)
    common.set_threads(args.threads)
    import torch
    import transformers

    print(f"generation throughput, torch {torch.__version__}, transformers {transformers.__version__}, {args.threads} thread(s)")
    work = Path(tempfile.mkdtemp(prefix="rlkit-bench-gen-"))
    try:
        return {name: run_model(name, args, work) for name in args.models.split(",")}
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
