"""s/step of one-step off-policy GRPO (--trainer.async-steps 1) vs the synchronous loop (0), whole runs alternated.

Each run is `recipes/grpo.py`'s main() for --warmup + --steps steps; its s/step is the median of the recipe's own
`timing/step` over the timed steps (the step timer covers waiting for the batch, scoring, reference and old
log-prob passes, and the update; with k=1 `gen` is the wait for the worker's batch). The medians of the gen,
ref and update phases are printed beside it, and each workload ends with the roofline (bench/common.py's
metrics_roofline: FLOPs from the logged mean lengths, % of a matmul ceiling sampled after every run). Runs
alternate k=0, k=1, k=0, k=1, ... so that load from other jobs on a shared machine hits both alike; the reported
s/step of an arm is the median over its runs. Workloads:

    random     bench/vs_trl.py's random-weight 4.3M Llama: 16 prompts x 8 samples, every response 32 tokens
    embedded   the embedded default run: 32 prompts x 8 samples, <= 8 tokens, the tiny 0.56M model

Both keep GRPO's defaults otherwise (KL to the reference, coefficient 0.001: with k=1 the reference pass runs
in the generation worker; one optimizer step per batch). Prints the machine's load average before and after.

    python bench/async.py                           # both workloads, 2 runs per arm, ~6 min on 2 shared cores
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

WORKLOADS = {
    "random": dict(prompts=16, n=8, max_new_tokens=32),
    "embedded": dict(prompts=32, n=8, max_new_tokens=8),
}


def one_run(grpo, workload: str, k: int, steps: int, out: Path, model: str, backend: str = "local") -> list[dict]:
    """One run of the recipe; the timing/ metrics of each step."""
    import json

    w = WORKLOADS[workload]
    cfg = grpo.Config()
    cfg.model.path = model
    cfg.data.train_batch_size = cfg.actor.ppo_mini_batch_size = w["prompts"]
    cfg.rollout.n, cfg.data.max_response_length = w["n"], w["max_new_tokens"]
    cfg.data.val_files = []  # no validation: only the steps are timed
    cfg.trainer.total_training_steps, cfg.trainer.async_steps = steps, k
    cfg.trainer.backend, cfg.trainer.n_workers = backend, 1  # ray: one FSDP worker (+ the generation actor with k >= 1)
    cfg.trainer.default_local_dir, cfg.trainer.val_before_train, cfg.trainer.save_freq = str(out), False, 10**9
    with common.quiet():
        grpo.main(cfg)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    keep = ("timing/", "prompt_length/mean", "response_length/mean", "perf/throughput")
    return [{k: v for k, v in r.items() if k.startswith(keep)} for r in rows if r["step"] > 0]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", default="random,embedded", help="comma-separated: random, embedded")
    p.add_argument("--steps", type=int, default=8, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=2, help="untimed first steps per run (k=1's first step cannot overlap)")
    p.add_argument("--reps", type=int, default=2, help="runs per arm, alternated")
    p.add_argument("--k", type=int, default=1, help="the asynchronous arm's --trainer.async-steps")
    p.add_argument("--backend", default="local", choices=["local", "ray"], help="--trainer.backend (ray: 1 FSDP worker, 1 CPU each)")
    args = p.parse_args()
    if args.backend == "ray":
        from rlkit.ray_group import init_ray

        init_ray(num_cpus=2)  # the trainer's bundle + the generation actor's
    common.set_threads(1)
    from transformers import AutoConfig

    grpo = common.load_recipe("grpo")
    print(f"load average before: {os.getloadavg()} on {os.cpu_count()} cores")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for workload in args.workloads.split(","):
            model = common.resolve_model("random" if workload == "random" else "embedded", tmp, 256, 4)
            times = {0: [], args.k: []}
            timed = {0: [], args.k: []}  # the timed steps' metric rows, for the roofline
            w = WORKLOADS[workload]
            config = AutoConfig.from_pretrained(model)
            ceiling = common.Ceiling(config, decode_rows=w["prompts"] * w["n"])  # sampled after every run, 1 thread
            for rep in range(args.reps):
                for k in (0, args.k):
                    start = time.perf_counter()
                    rows = one_run(grpo, workload, k, args.warmup + args.steps, tmp / f"{workload}-{k}-{rep}", model, args.backend)
                    steps = rows[args.warmup :]
                    run_s = statistics.median(s["timing/step"] for s in steps)
                    times[k].append(run_s)
                    timed[k] += steps
                    ceiling.sample(
                        common.mean_groups(w["prompts"], w["n"], steps[0]["prompt_length/mean"], steps[0]["response_length/mean"])
                    )
                    phases = ", ".join(
                        f"{p} {statistics.median(s.get('timing/' + p, 0.0) for s in steps):.3f}" for p in ("gen", "ref", "update")
                    )
                    print(
                        f"{workload} k={k} run {rep + 1}: {run_s:.3f} s/step (median of {args.steps}; {phases}), "
                        f"run {time.perf_counter() - start:.0f} s"
                    )
            s0, s1 = statistics.median(times[0]), statistics.median(times[args.k])
            print(f"== {workload}: k=0 {s0:.3f} s/step | k={args.k} {s1:.3f} s/step | ratio {s1 / s0:.2f}x (target <= 0.7x)")
            # with k >= 1 the gen timer is the wait for the worker's batch (generation overlaps): no rate for it
            sides = {"k=0": timed[0], f"k={args.k}": [{**r, "timing/gen": 0.0} for r in timed[args.k]]}
            print(common.metrics_roofline(config, sides, w["n"], ceiling, phases=("gen", "ref", "old_log_prob", "update")))
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
