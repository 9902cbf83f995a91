"""s/step of one-step off-policy GRPO (--trainer.async-steps 1) vs the synchronous loop (0), whole runs alternated;
with --arms also in-flight weight updates (keep_kv, reprefill: k = 1 + --trainer.swap-every 1) and the queue of groups.

Each run is `recipes/grpo.py`'s main() for --warmup + --steps steps; its s/step is the median of the recipe's own
`timing/step` over the timed steps (the step timer covers waiting for the batch, scoring, reference and old
log-prob passes, and the update; with k=1 `gen` is the wait for the worker's batch). The medians of the gen,
ref and update phases are printed beside it, and each workload ends with the roofline (bench/common.py's
metrics_roofline: FLOPs from the logged mean lengths, % of a matmul ceiling sampled after every run). Runs
alternate the arms (sync, k1, sync, k1, ...) so that load from other jobs on a shared machine hits both alike; the reported
s/step of an arm is the median over its runs. Workloads:

    random     bench/vs_trl.py's random-weight 4.3M Llama: 16 prompts x 8 samples, every response 32 tokens
    embedded   the embedded default run: 32 prompts x 8 samples, <= 8 tokens, the tiny 0.56M model
    long       the random 4.3M model, 4 prompts x 4 samples, every response 128 tokens: 16 rows decode a token in
               ~12 ms against 128 rows' ~31 ms (per-step overhead), while the update shrinks with the rows, so
               generation outlasts the update and in-flight weight updates (keep_kv, reprefill) swap mid-generation

All keep GRPO's defaults otherwise (KL to the reference, coefficient 0.001: with k=1 the reference pass runs
in the generation worker; one optimizer step per batch). Prints the machine's load average before and after.
Per asynchronous arm also: its step time over its own update phase (1.00x: generation fully hidden behind the update)
and the mean async/version_span (a sample's newest minus oldest token version, averaged: > 0 when weights changed
mid-generation; 0 when the worker finishes each batch before the trainer's update ends) and token staleness.

    python bench/async.py                           # both workloads, 2 runs per arm, ~6 min on 2 shared cores
    python bench/async.py --workloads long --arms sync,k1,keep_kv,reprefill     # swaps happen
    python bench/async.py --workloads random --arms k1,keep_kv,reprefill --lora-rank 8 --reps 1
    python bench/async.py --workloads random --reps 3 --steps 10
    python bench/async.py --workloads random --backend ray    # the trainer is one FSDP worker, the generator a Ray actor
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from stream import ARMS  # noqa: E402  (name: --trainer flags; sync, k1, keep_kv, reprefill, queue)

WORKLOADS = {
    "random": dict(prompts=16, n=8, max_new_tokens=32),
    "embedded": dict(prompts=32, n=8, max_new_tokens=8),
    "long": dict(prompts=4, n=4, max_new_tokens=128),  # the random model; few rows decode slowly per token: gen > update
}


def one_run(grpo, workload: str, flags: dict, steps: int, out: Path, model: str, backend="local", max_new_tokens=0, lora=0) -> list[dict]:
    """One run of the recipe with these --trainer flags; the timing/ and async/ metrics of each step."""
    import json

    from rlkit.config import set_flags

    w = WORKLOADS[workload]
    cfg = grpo.Config()
    cfg.model.path, cfg.model.lora_rank = model, lora
    cfg.data.train_batch_size = cfg.actor.ppo_mini_batch_size = w["prompts"]
    cfg.rollout.n, cfg.data.max_response_length = w["n"], max_new_tokens or w["max_new_tokens"]
    cfg.system.data.val_files = []  # no validation: only the steps are timed
    cfg.trainer.total_training_steps = steps
    set_flags(cfg, {f"trainer.{k}": v for k, v in flags.items()})  # --trainer.async-steps ... (cfg.system.async_rollout)
    cfg.system.scale_out.backend, cfg.system.scale_out.n_workers = backend, 1  # ray: one FSDP worker (+ the generation actor with k >= 1)
    cfg.system.trainer.default_local_dir, cfg.system.trainer.val_before_train, cfg.system.trainer.save_freq = str(out), False, 10**9
    with common.quiet():
        grpo.main(cfg)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    keep = ("timing/", "async/", "prompt_length/mean", "response_length/mean", "perf/throughput")
    return [{k: v for k, v in r.items() if k.startswith(keep)} for r in rows if r["step"] > 0]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", default="random,embedded", help="comma-separated: random, embedded, long")
    p.add_argument("--steps", type=int, default=8, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=2, help="untimed first steps per run (k=1's first step cannot overlap)")
    p.add_argument("--reps", type=int, default=2, help="runs per arm, alternated")
    p.add_argument("--arms", default="sync,k1", help=f"comma-separated, the first is the baseline: {', '.join(ARMS)}")
    p.add_argument("--k", type=int, default=1, help="--trainer.async-steps of the asynchronous arms")
    p.add_argument("--lora-rank", type=int, default=0, help="--model.lora-rank (a cheaper update: the regime where generation outlasts it)")
    p.add_argument("--max-new-tokens", type=int, default=0, help="response length (every response runs to it; 0: the workload's)")
    p.add_argument("--backend", default="local", choices=["local", "ray"], help="--trainer.backend (ray: 1 FSDP worker, 1 CPU each)")
    args = p.parse_args()
    workloads, arms = common.names(p, "--workloads", args.workloads, WORKLOADS), common.names(p, "--arms", args.arms, ARMS)
    if args.backend == "ray":
        from rlkit.ray_group import init_ray

        init_ray(num_cpus=2)  # the trainer's bundle + the generation actor's
    common.set_threads(1)
    from transformers import AutoConfig

    grpo = common.load_recipe("grpo")
    print(f"load average before: {os.getloadavg()} on {os.cpu_count()} cores")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for workload in workloads:
            model = common.resolve_model("embedded" if workload == "embedded" else "random", tmp, 256, 4)
            flags = {a: {k: (args.k if k == "async_steps" and v else v) for k, v in ARMS[a].items()} for a in arms}
            times, timed = {a: [] for a in arms}, {a: [] for a in arms}  # s/step per run; the timed steps' rows (roofline)
            w = WORKLOADS[workload]
            config = AutoConfig.from_pretrained(model)
            ceiling = common.Ceiling(config, decode_rows=w["prompts"] * w["n"])  # sampled after every run, 1 thread
            for rep in range(args.reps):
                for arm in arms:
                    start = time.perf_counter()
                    out = tmp / f"{workload}-{arm}-{rep}"
                    rows = one_run(
                        grpo, workload, flags[arm], args.warmup + args.steps, out, model, args.backend, args.max_new_tokens, args.lora_rank
                    )
                    steps = rows[args.warmup :]
                    run_s = statistics.median(s["timing/step"] for s in steps)
                    times[arm].append(run_s)
                    timed[arm] += steps
                    ceiling.sample(
                        common.mean_groups(w["prompts"], w["n"], steps[0]["prompt_length/mean"], steps[0]["response_length/mean"])
                    )
                    phases = ", ".join(
                        f"{p} {statistics.median(s.get('timing/' + p, 0.0) for s in steps):.3f}" for p in ("gen", "ref", "update")
                    )
                    print(
                        f"{workload} {arm} run {rep + 1}: {run_s:.3f} s/step (median of {args.steps}; {phases}), "
                        f"run {time.perf_counter() - start:.0f} s",
                        flush=True,
                    )
            base = statistics.median(times[arms[0]])
            for arm in arms:
                s_arm = statistics.median(times[arm])
                line = f"== {workload} {arm}: {s_arm:.3f} s/step | {s_arm / base:.2f}x {arms[0]}"
                if flags[arm].get("async_steps"):
                    update = statistics.median(r["timing/update"] for r in timed[arm])
                    line += f" | {s_arm / update:.2f}x its own update phase ({update:.3f} s; 1.00x: generation fully hidden)"
                if any("async/version_span" in r for r in timed[arm]):
                    span = statistics.mean(r.get("async/version_span", 0.0) for r in timed[arm])
                    stale = statistics.mean(r.get("async/token_staleness_mean", 0.0) for r in timed[arm])
                    line += f" | version span {span:.3f}, token staleness {stale:.2f}"
                print(line)
            # with k >= 1 the gen timer is the wait for the worker's batch (generation overlaps): no rate for it
            sides = {a: [{**r, "timing/gen": 0.0} if flags[a].get("async_steps") else r for r in timed[a]] for a in arms}
            print(common.metrics_roofline(config, sides, w["n"], ceiling, phases=("gen", "ref", "old_log_prob", "update")))
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
