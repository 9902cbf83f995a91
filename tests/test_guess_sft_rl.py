"""scripts/guess_sft_rl.py (issue #39's SFT -> RL pipeline), shrunk onto the embedded tiny-guess model.

One pipeline run (data, 1 SFT step, 2 RL steps validating every step), then a rerun of the RL stage alone with
--skip-sft into its own --rl-out folder: the rerun starts from the same SFT checkpoint, so its step-0 held-out
score (greedy, the same held-out games) equals the first run's, and the first run's files are left as they were.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SMALL = [
    "--model", "rlkit/assets/tiny-guess", "--traces", "16", "--sft-steps", "1", "--rl-prompts", "2", "--rollout-n", "2",
    "--val", "4", "--threads", "1", "--max-prompt-length", "24", "--max-response-length", "100",
]  # fmt: skip


def pipeline(out: Path, *args: str) -> dict:
    cmd = [sys.executable, "scripts/guess_sft_rl.py", "--out", str(out), *SMALL, *args]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return done


def test_pipeline_then_an_rl_rerun_from_the_same_sft_checkpoint(tmp_path):
    pipeline(tmp_path, "--rl-steps", "2", "--val-every", "1")
    first = json.loads((tmp_path / "rl" / "timings.json").read_text())
    assert [s for s, _ in first["held_out"]] == [0, 1, 2]  # --val-every 1: before the first step and after each
    assert set(first["timings"]) == {"data", "sft", "rl", "total"} and first["timings"]["data"]["traces"] == 16
    assert [s for s, _ in first["train_score"]] == [1, 2]
    sft_ckpt = tmp_path / "sft" / "checkpoints" / "global_step_1" / "hf"
    assert sft_ckpt.is_dir()
    before = {p: p.stat().st_mtime_ns for p in (tmp_path / "rl").rglob("*") if p.is_file()}

    pipeline(tmp_path, "--skip-sft", "--rl-steps", "1", "--val-every", "0", "--rl-out", "rerun")
    rerun = json.loads((tmp_path / "rerun" / "timings.json").read_text())
    assert "sft" not in rerun["timings"]  # the SFT stage did not run again
    assert [s for s, _ in rerun["held_out"]] == [0, 1]  # --val-every 0: before the first step and after the last
    assert rerun["held_out"][0][1] == first["held_out"][0][1]  # the same SFT model on the same held-out games, greedy
    assert json.loads((tmp_path / "rerun" / "config.json").read_text())["model"]["path"] == str(sft_ckpt.resolve())
    assert {p: p.stat().st_mtime_ns for p in (tmp_path / "rl").rglob("*") if p.is_file()} == before  # untouched


@pytest.mark.parametrize(
    "args, phrase",
    [
        (["--rl-out", "../escaped"], "--rl-out '../escaped': give a plain folder name under --out"),
        (["--rl-out", "sft"], "--rl-out 'sft': give a plain folder name under --out other than 'sft'"),
        (["--skip-sft"], "--skip-sft: no SFT checkpoint at "),
        (["--traces", "0"], "--traces 0: must be at least 1"),  # was a ZeroDivisionError after the data was written
        (["--midpoint-share", "nan"], "--midpoint-share nan: a share of turns, in [0, 1]"),
    ],
)
def test_bad_arguments_are_one_line_before_anything_is_written(tmp_path, args, phrase):
    out = tmp_path / "out"
    cmd = [sys.executable, "scripts/guess_sft_rl.py", "--out", str(out), *SMALL, *args]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and phrase in done.stderr.strip().splitlines()[-1], done.stderr[-2000:]
    assert not out.exists() and not (tmp_path / "escaped").exists()  # no data written, no SFT started
