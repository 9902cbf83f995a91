"""The benches' list flags (--arms, --workloads, --sides, --credits, --workers, --seeds): an unknown name or a bad number
is one argparse line naming the valid ones, given before any model is built or timed (the 'load average' line, where a
bench prints one, comes after its arguments). These were KeyErrors, ValueErrors, or silently the default arm."""

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
        ("mismatch.py", ["--arms", "hf,nope"], "--arms: unknown 'nope'; choose from hf, vllm, hf-bf16, hf-T1.1"),
        ("real_model.py", ["--sides", "hf,x"], "--sides: unknown 'x'; choose from trl, hf, vllm"),
        ("turn_credit.py", ["--credits", "nope"], "--credits: unknown 'nope'; choose from outcome, return_to_go, step_group"),
        ("turn_credit.py", ["--seeds", "0,x"], "argument --seeds: '0,x': comma-separated whole numbers"),
        ("scaling.py", ["--workers", "a"], "argument --workers: 'a': comma-separated whole numbers"),
        ("scaling.py", ["--workers", "0,2"], "--workers: Ray worker counts are >= 1"),
    ],
)
def test_unknown_names_are_one_line_before_any_run(script, args, phrase):
    done = subprocess.run([sys.executable, f"bench/{script}", *args], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    assert phrase in done.stderr.strip().splitlines()[-1] and "Traceback" not in done.stderr
    assert "load average" not in done.stdout  # refused before the first run


def test_the_credit_list_is_the_recipes():
    """bench/turn_credit.py's CREDITS mirrors grpo_tools.py's --turn-credit Literal (a new credit must reach the bench)."""
    import typing

    sys.path.insert(0, str(ROOT / "bench"))
    import common
    import turn_credit

    hint = typing.get_type_hints(common.load_recipe("grpo_tools").Config)["turn_credit"]
    assert turn_credit.CREDITS == typing.get_args(hint)


def test_a_model_that_is_not_a_folder_is_one_line(tmp_path):
    sys.path.insert(0, str(ROOT / "bench"))
    import common

    with pytest.raises(SystemExit, match="model '/no/such': not 'embedded', 'random' or a model folder with a config.json"):
        common.resolve_model("/no/such", tmp_path, 8, 1)
