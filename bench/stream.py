"""Held-out accuracy against wall-clock seconds: synchronous GRPO vs one-step-off (k = 1) vs in-flight weight updates
(k = 1, --trainer.swap-every C, keep_kv and reprefill) vs the queue of groups (k = 1, 2 workers, --trainer.queue-groups 4),
on the embedded task, whole runs alternated in one process.

Each arm is `recipes/grpo.py`'s default embedded run (the tiny 0.56M model, 32 prompts x 8 samples) for --steps steps,
validating on --val-prompts held-out prompts every --test-freq steps. Wall-clock at a validation = the sum of the
recipe's own `timing/step` up to that step (validation itself and the model load are left out: the same for every
arm). The issue's goal: reach the synchronous run's final accuracy in <= 0.6x its wall time, no loss in final accuracy.
Also printed per arm: mean async/staleness, async/token_staleness_mean and async/version_span (how often weights
changed inside a generation). Arms run in the order given, each rep once, so load from other jobs hits them alike.

    python bench/stream.py                                   # 4 arms, 1 rep, 60 steps: ~6 min on 2 shared cores
    python bench/stream.py --arms sync,keep_kv --steps 30 --reps 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

ARMS = {  # name: --trainer flags (set by flag name: config.set_flags)
    "sync": dict(async_steps=0),
    "k1": dict(async_steps=1),
    "keep_kv": dict(async_steps=1, swap_every=1, swap_mode="keep_kv"),
    "reprefill": dict(async_steps=1, swap_every=1, swap_mode="reprefill"),
    "queue": dict(async_steps=1, async_workers=2, queue_groups=4),  # the queue of groups, 2 workers pulling 4 prompts a job
}


def one_run(grpo, arm: str, steps: int, test_freq: int, val_prompts: int, seed: int, out: Path, swap_every: int, max_len=0) -> list[dict]:
    from rlkit.config import set_flags

    cfg = grpo.Config()
    cfg.system.data.val_max_samples = val_prompts
    if max_len:
        cfg.data.max_response_length = max_len
    cfg.trainer.total_training_steps, cfg.system.trainer.test_freq, cfg.trainer.seed = steps, test_freq, seed
    cfg.system.trainer.default_local_dir, cfg.system.trainer.save_freq = str(out), 10**9
    set_flags(cfg, {f"trainer.{k}": swap_every if k == "swap_every" else v for k, v in ARMS[arm].items()})  # cfg.system.async_rollout
    with common.quiet():
        grpo.main(cfg)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def curve(rows: list[dict]) -> list[tuple[int, float, float]]:
    """(step, wall-clock s = sum of timing/step so far, val/acc) at each validation."""
    out, wall = [], 0.0
    for r in rows:
        wall += r.get("timing/step", 0.0)
        if "val/acc" in r:
            out.append((r["step"], wall, r["val/acc"]))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arms", default="sync,k1,keep_kv,reprefill", help=f"comma-separated: {', '.join(ARMS)}")
    p.add_argument("--max-response-length", type=int, default=0, help="--data.max-response-length (0: the recipe's default)")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--test-freq", type=int, default=10)
    p.add_argument("--val-prompts", type=int, default=128)
    p.add_argument("--reps", type=int, default=1, help="repetitions, rep r with seed --seed + r")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--swap-every", type=int, default=1, help="--trainer.swap-every of the in-flight arms (embedded responses: <= 8 tokens)")
    args = p.parse_args()
    arms = common.names(p, "--arms", args.arms, ARMS)
    common.set_threads(1)
    grpo = common.load_recipe("grpo")
    print(f"load average before: {os.getloadavg()} on {os.cpu_count()} cores")
    curves = {a: [] for a in arms}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.reps):
            for arm in arms:
                rows = one_run(
                    grpo,
                    arm,
                    args.steps,
                    args.test_freq,
                    args.val_prompts,
                    args.seed + rep,
                    Path(tmp) / f"{arm}-{rep}",
                    args.swap_every,
                    args.max_response_length,
                )
                c = curve(rows)
                curves[arm].append(c)
                steps = [r for r in rows if r["step"] > 0]
                extra = ""
                if "async/staleness" in steps[-1]:

                    def mean(k, steps=steps):
                        return statistics.mean(r.get(k, 0.0) for r in steps)

                    extra = f" | staleness {mean('async/staleness'):.2f}"
                    if "async/version_span" in steps[-1]:
                        extra += (
                            f", token staleness {mean('async/token_staleness_mean'):.2f}, version span {mean('async/version_span'):.3f}"
                        )
                print(f"{arm} rep {rep + 1}: " + ", ".join(f"step {s} {w:.1f}s acc {a:.3f}" for s, w, a in c) + extra, flush=True)
    sync = curves.get("sync")
    for arm in arms:
        final = statistics.mean(c[-1][2] for c in curves[arm])
        wall = statistics.mean(c[-1][1] for c in curves[arm])
        line = f"== {arm}: final acc {final:.3f} at {wall:.1f} s"
        if sync and arm != "sync":
            target, sync_wall = statistics.mean(c[-1][2] for c in sync), statistics.mean(c[-1][1] for c in sync)
            reached = [min((w for s, w, a in c if s > 0 and a >= target), default=None) for c in curves[arm]]  # trained
            if all(r is not None for r in reached):
                ratio = statistics.mean(reached) / sync_wall
                met = ratio <= 0.6 and final >= target
                line += (
                    f" | reaches sync's final {target:.3f} at {ratio:.2f}x sync's wall time, final {final - target:+.3f} vs sync "
                    f"({'met' if met else 'not met'}: goal <= 0.6x, no loss)"
                )
            else:
                line += f" | never reaches sync's final {target:.3f} (not met)"
        print(line)
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
