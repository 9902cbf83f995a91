"""Write a reasoning-gym task as verl-format parquet (train + held-out val), the files every recipe reads.

    python scripts/make_reasoning_gym_parquet.py chain_sum --out data/chain_sum \
        --options min_terms=2,max_terms=2,max_digits=1 --train-size 1000 --val-size 200 --format number
    python recipes/grpo.py --data.train-files data/chain_sum/train.parquet --data.val-files data/chain_sum/val.parquet

The rows are exactly those `--data.task reasoning_gym:NAME` builds in memory (see rlkit/tasks.py), and
their data_source `reasoning_gym/NAME` is scored by the task's own verifier. Needs
`pip install reasoning-gym==0.1.25`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from rlkit import tasks


def write(rows: list[dict], path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)


def main(argv=None) -> dict[str, Path]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("task", help="reasoning-gym task name, e.g. chain_sum, basic_arithmetic, countdown")
    p.add_argument("--out", required=True, help="output folder (train.parquet and val.parquet are written there)")
    p.add_argument("--options", default="", help="the task's config options: key=value,key=value or JSON")
    p.add_argument("--train-size", type=int, default=1000)
    p.add_argument("--val-size", type=int, default=200, help="0 = no val.parquet")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--format", default="direct", choices=tasks.FORMATS, help="how the answer is asked for and read back (see rlkit/tasks.py)"
    )
    a = p.parse_args(argv)
    name = a.task[len(tasks.PREFIX) :] if a.task.startswith(tasks.PREFIX) else a.task
    train, val = tasks.train_val_rows(tasks.PREFIX + name, a.train_size, a.val_size, a.seed, a.options, a.format)
    out = Path(a.out)
    paths = {"train": out / "train.parquet"}
    write(train, paths["train"])
    if val:
        paths["val"] = out / "val.parquet"
        write(val, paths["val"])
    print(f"{name}: {len(train)} train rows -> {paths['train']}" + (f", {len(val)} val rows -> {paths['val']}" if val else ""))
    return paths


if __name__ == "__main__":
    main()
