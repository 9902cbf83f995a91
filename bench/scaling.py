"""Seconds per GRPO step of the same recipe on the local backend and on Ray with 1, 2, ... FSDP2 workers.

Each arm runs `recipes/grpo.py` in a subprocess for --steps steps (no validation, no checkpoint but the
final one) and reports the median of its `timing/step` (and per-phase) metrics over the steps after
--warmup. Arms are run round-robin --rounds times (local, ray x1, ray x2, local, ...) so that load from
other jobs hits all alike; the ratio to the local backend is printed per arm, then the roofline
(bench/common.py's metrics_roofline: FLOPs from the logged mean lengths, % of a matmul ceiling measured after
the runs on this process's threads).

    python bench/scaling.py                                  # embedded model, local vs ray x1 vs ray x2
    python bench/scaling.py --workers 1,2,4,8 --device cuda --extra "--model Qwen/Qwen2.5-0.5B-Instruct"

On one CPU machine more workers cannot be faster (they share the cores and add gloo collectives): the
point there is the overhead of the Ray/FSDP2 path. On a GPU node each worker has its own GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import common  # noqa: E402

PHASES = ["gen", "reward", "ref", "update"]


def run_arm(workers: int, args, out: Path) -> list[dict]:
    """One run of the recipe; its metric rows after warm-up. workers 0 = local backend."""
    cmd = [
        sys.executable,
        str(ROOT / "recipes/grpo.py"),
        "--trainer.total-training-steps",
        str(args.warmup + args.steps),
        "--trainer.no-val-before-train",
        "--trainer.test-freq",
        "0",
        "--data.val-files",
        "--trainer.device",
        args.device,
        "--trainer.default-local-dir",
        str(out),
        *shlex.split(args.extra),
    ]
    if workers:
        cmd += ["--trainer.backend", "ray", "--trainer.n-workers", str(workers), "--trainer.cpus-per-worker", str(args.cpus_per_worker)]
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode:
        sys.exit(f"arm with {workers or 'local'} workers failed:\n{done.stderr[-3000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["step"] > args.warmup]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=common.ints, default="1,2", help="comma-separated Ray worker counts to time against the local backend")
    p.add_argument("--steps", type=int, default=20, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps at the start of each run")
    p.add_argument("--rounds", type=int, default=2, help="runs per arm, round-robin")
    p.add_argument("--device", default="auto")
    p.add_argument("--cpus-per-worker", type=float, default=1)
    p.add_argument("--extra", default="", help='more recipe flags, e.g. "--model PATH --data.train-batch-size 64"')
    args = p.parse_args(argv)
    if 0 in args.workers:
        p.error("--workers: Ray worker counts are >= 1 (the local backend is always timed as the baseline)")
    arms = [0, *args.workers]
    rows: dict[int, list[dict]] = {a: [] for a in arms}
    with tempfile.TemporaryDirectory(prefix="rlkit-scaling-") as tmp:
        for r in range(args.rounds):
            for a in arms:
                rows[a] += run_arm(a, args, Path(tmp) / f"{a}-{r}")
                print(f"round {r + 1}/{args.rounds}: {'local' if a == 0 else f'ray x{a}'} done", file=sys.stderr)

    def med(a, key):
        vals = [row[key] for row in rows[a] if key in row]
        return statistics.median(vals) if vals else float("nan")

    base = med(0, "timing/step")
    roof = roofline(args, rows)
    print(f"{'arm':<10} {'s/step':>8} {'x local':>8} " + " ".join(f"{ph:>8}" for ph in PHASES) + f" {'tok/s':>10}")
    for a in arms:
        name = "local" if a == 0 else f"ray x{a}"
        step = med(a, "timing/step")
        phases = " ".join(f"{med(a, 'timing/' + ph):8.3f}" for ph in PHASES)
        print(f"{name:<10} {step:8.3f} {step / base:8.2f} {phases} {med(a, 'perf/throughput'):10.0f}")
    print("\n" + roof)


def roofline(args, rows: dict[int, list[dict]]) -> str:
    """common.metrics_roofline of every arm; the ceiling measured here, on this process's threads (the local arm's:
    a Ray arm with k workers has k x 1 thread, so its % can pass 100), after the runs."""
    import re

    from transformers import AutoConfig

    common.set_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    cfg = common.load_recipe("grpo").Config()
    found = re.search(r"--model(?:\.path)?[ =](\S+)", args.extra)
    n = re.search(r"--rollout\.n[ =](\d+)", args.extra)
    n = int(n.group(1)) if n else cfg.rollout.n
    config = AutoConfig.from_pretrained(found.group(1) if found else cfg.model.path)
    sides = {("local" if a == 0 else f"ray x{a}"): rs for a, rs in rows.items()}
    local = sides["local"][0]
    rows_per_step = round(local["perf/throughput"] * local["timing/step"] / (local["prompt_length/mean"] + local["response_length/mean"]))
    ceiling = common.Ceiling(config, decode_rows=rows_per_step)
    for r in sides["local"][:5]:
        ceiling.sample(common.mean_groups(max(rows_per_step // n, 1), n, r["prompt_length/mean"], r["response_length/mean"]))
    return common.metrics_roofline(config, sides, n, ceiling)


if __name__ == "__main__":
    main()
