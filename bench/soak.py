"""Soak: N steps of the embedded default GRPO run (recipes/grpo.py's own main), watching resident memory.

RSS (VmRSS from /proc/self/status) is read after the model and data are loaded (start), every --every steps
(after the step's logging and checkpointing), and after the run has finished. Growth is called bounded when the
second half of the run adds less than --tolerance-mib (RSS after the first half already includes the
allocator's steady-state pools, the optimizer's state and the first checkpoint's buffers).

    python bench/soak.py                       # 200 steps, ~3-5 minutes on 2 shared cores
    python bench/soak.py --steps 50 --every 10
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--every", type=int, default=50, help="read RSS every this many steps")
    p.add_argument("--val-samples", type=int, default=64, help="validation prompts, once at the end (0 = no validation)")
    p.add_argument("--save-freq", type=int, default=0, help="checkpoint every this many steps (0 = only at the end, the recipe's default)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--tolerance-mib", type=float, default=32.0, help="largest RSS growth over the second half still called bounded")
    p.add_argument("--out", default=None, help="output folder, kept (default: a temporary folder, removed at the end)")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    common.set_threads(args.threads)
    import torch

    from rlkit import recipe

    grpo = common.load_recipe("grpo")
    cfg = grpo.Config()
    cfg.trainer.total_training_steps = args.steps
    cfg.system.trainer.test_freq = 0
    cfg.system.trainer.val_before_train = False
    cfg.system.trainer.save_freq = args.save_freq
    cfg.system.trainer.num_threads = args.threads
    cfg.system.trainer.logger = []
    cfg.system.trainer.default_local_dir = args.out or tempfile.mkdtemp(prefix="rlkit-soak-")
    if args.val_samples > 0:
        cfg.system.data.val_max_samples = args.val_samples
    else:
        cfg.system.data.val_files = []

    readings: list[tuple[str, float]] = []
    original_init, original_end = recipe.Run.__init__, recipe.Run.end_of_step

    def init(self, *a, **kw):  # the model, data and optimizer are built: the starting point
        original_init(self, *a, **kw)
        readings.append(("start", rss_mib()))

    def end_of_step(self, step, *a, **kw):
        original_end(self, step, *a, **kw)
        if step % args.every == 0 or step == args.steps:
            readings.append((f"step {step}", rss_mib()))
            print(f"[soak] step {step}: RSS {readings[-1][1]:.1f} MiB", flush=True)

    recipe.Run.__init__, recipe.Run.end_of_step = init, end_of_step
    start = common.now()
    try:
        with common.quiet():
            grpo.main(cfg)
    finally:
        recipe.Run.__init__, recipe.Run.end_of_step = original_init, original_end
    readings.append(("end", rss_mib()))
    elapsed = common.now() - start

    print(
        f"\nsoak: {args.steps} steps of recipes/grpo.py (embedded default), {torch.get_num_threads()} thread(s), "
        f"{elapsed:.0f} s in all" + (f", output {args.out}" if args.out else "")
    )
    base = readings[0][1]
    for name, mib in readings:
        print(f"  {name:>10}: RSS {mib:8.1f} MiB  ({mib - base:+7.1f} vs start)")
    marks = [(n, m) for n, m in readings if n.startswith("step ")]
    half = [m for n, m in marks if int(n.split()[1]) >= args.steps // 2]
    growth = (marks[-1][1] - half[0]) if len(half) >= 2 else (readings[-1][1] - readings[0][1])
    peak = recipe.max_rss_gb() * 1024
    bounded = growth <= args.tolerance_mib
    print(
        f"growth over the second half: {growth:+.1f} MiB; peak RSS {peak:.1f} MiB -> "
        f"{'BOUNDED' if bounded else 'GROWING'} (tolerance {args.tolerance_mib:.0f} MiB)"
    )
    if not args.out:
        shutil.rmtree(cfg.system.trainer.default_local_dir, ignore_errors=True)
    return {"readings": readings, "growth_second_half_mib": growth, "bounded": bounded}


if __name__ == "__main__":
    main()
