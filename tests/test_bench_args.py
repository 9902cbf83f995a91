"""bench/async.py and bench/stream.py: an unknown arm or workload is one argparse line naming the valid ones, given before
any model is built or timed (the 'load average before' line is the first thing a run prints after its arguments)."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "script, args, phrase",
    [
        ("async.py", ["--arms", "sync,nope"], "--arms: unknown 'nope'; choose from sync, k1, keep_kv, reprefill, queue"),
        ("async.py", ["--workloads", "long,x"], "--workloads: unknown 'x'; choose from random, embedded, long"),
        ("async.py", ["--arms", ","], "--arms: no name given; choose from sync, k1"),
        ("stream.py", ["--arms", "bad"], "--arms: unknown 'bad'; choose from sync, k1, keep_kv, reprefill, queue"),
    ],
)
def test_unknown_names_are_one_line_before_any_run(script, args, phrase):
    done = subprocess.run([sys.executable, f"bench/{script}", *args], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    assert phrase in done.stderr.strip().splitlines()[-1] and "Traceback" not in done.stderr
    assert "load average" not in done.stdout  # refused before the first run
