"""Tests for rlkit/tracking.py: metrics.jsonl, resume, the console line, wandb offline, the learning-curve PNG."""

import json
import time

import numpy as np
import pytest
import torch

from rlkit.tracking import Tracker, console_line, plot_learning_curve, read_metrics

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def fake_step(step: int) -> dict:
    return {
        "critic/score/mean": 0.2 + 0.01 * step,
        "critic/score/std": 0.4,
        "response_length/mean": 30.0 + step,
        "actor/kl_loss": 0.001 * step,
        "timing/step": 1.2,
    }


def test_logs_jsonl_config_and_png(tmp_path):
    out = tmp_path / "run"  # created by the Tracker
    tracker = Tracker(out, ["console"], config={"lr": 1e-6, "algo": "grpo"}, total_steps=3)
    for step in (1, 2, 3):
        tracker.log(step, fake_step(step) | ({"val/acc": 0.1 * step} if step != 2 else {}))
    png = tracker.finish()

    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[0]["critic/score/mean"] == pytest.approx(0.21)
    assert rows[2]["val/acc"] == pytest.approx(0.3) and "val/acc" not in rows[1]
    assert json.loads((out / "config.json").read_text()) == {"lr": 1e-6, "algo": "grpo"}

    assert png == out / "learning_curve.png"
    data = png.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 5_000
    import matplotlib.image

    h, w = matplotlib.image.imread(png).shape[:2]
    assert w > 2 * h  # two panels side by side


def test_tensor_and_numpy_values_become_floats(tmp_path):
    tracker = Tracker(tmp_path, [])
    tracker.log(1, {"a": torch.tensor(0.5), "b": np.float32(2.0), "c": 3})
    (row,) = read_metrics(tmp_path / "metrics.jsonl")
    assert row == {"step": 1, "a": 0.5, "b": 2.0, "c": 3.0}


def test_resume_drops_later_steps(tmp_path):
    tracker = Tracker(tmp_path, [])
    for step in range(1, 6):
        tracker.log(step, fake_step(step))
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "critic/sc')  # a crash mid-write leaves a half line

    resumed = Tracker(tmp_path, [], resume_step=3)
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2, 3]
    resumed.log(4, fake_step(4))
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2, 3, 4]


def test_fresh_run_starts_a_new_file(tmp_path):
    Tracker(tmp_path, []).log(1, {"x": 1.0})
    Tracker(tmp_path, []).log(1, {"x": 2.0})
    assert read_metrics(tmp_path / "metrics.jsonl") == [{"step": 1, "x": 2.0}]


def test_console_line(tmp_path, capsys):
    metrics = {
        "critic/score/mean": 0.41,
        "critic/score/std": 0.49,
        "val/acc": 0.62,
        "response_length/mean": 3.1,
        "actor/kl_loss": 0.0012,
        "actor/pg_clipfrac": 0.0,
        "actor/entropy": 0.81,
        "actor/grad_norm": 0.53,
        "timing/step": 1.2,
        "perf/throughput": 410.0,
        "not/watched": 7.0,
    }
    tracker = Tracker(tmp_path, ["console"], total_steps=10)
    tracker.log(1, metrics)
    tracker.message("validation before training: acc 0.23")
    tracker.finish()
    out = capsys.readouterr().out  # tqdm.write prints to stdout; the bar itself goes to stderr
    line = next(line for line in out.splitlines() if line.startswith("step 1"))
    assert "score 0.41±0.49" in line and "val/acc 0.62" in line
    for part in ("len 3.1", "kl 0.0012", "ent 0.81", "gnorm 0.53", "1.2s/step", "410 tok/s"):
        assert part in line
    assert "not/watched" not in line
    assert "validation before training: acc 0.23" in out
    assert console_line(5, {"critic/score/mean": 0.123456}) == "step 5 | score 0.1235"


def test_wandb_offline(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb_dir"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb_config"))
    out = tmp_path / "run"
    t0 = time.time()
    tracker = Tracker(out, ["wandb"], run_name="test", config={"lr": 1e-6})
    assert time.time() - t0 < 20, "wandb.init took too long"
    for step in (1, 2):
        tracker.log(step, fake_step(step))
    tracker.finish()
    runs = list((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and any(runs[0].glob("*.wandb"))
    assert len(read_metrics(out / "metrics.jsonl")) == 2


def test_wandb_without_key_goes_offline(tmp_path, monkeypatch, capsys):
    for var in ("WANDB_MODE", "WANDB_API_KEY"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb_config"))
    monkeypatch.setenv("NETRC", str(tmp_path / "no_netrc"))
    tracker = Tracker(tmp_path, ["wandb"])
    tracker.log(1, {"x": 1.0})
    tracker.finish()
    assert "offline" in capsys.readouterr().out
    assert list((tmp_path / "wandb").glob("offline-run-*"))


def test_unknown_logger(tmp_path):
    with pytest.raises(ValueError, match="console.*wandb"):
        Tracker(tmp_path, ["tensorboard"])


def test_plot_empty_and_single_line(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    png = plot_learning_curve(empty, tmp_path / "empty.png")
    assert png.read_bytes()[:8] == PNG_MAGIC
    assert plot_learning_curve(tmp_path / "missing.jsonl", tmp_path / "missing.png").exists()

    one = tmp_path / "one.jsonl"
    one.write_text(json.dumps({"step": 0, "val/acc": 0.23}) + "\n")
    assert plot_learning_curve(one, tmp_path / "one.png", title="t").read_bytes()[:8] == PNG_MAGIC


def test_rolling_mean_of_the_learning_curve():
    from rlkit.tracking import rolling_mean

    assert rolling_mean([0.0, 1.0, 1.0, 0.0, 1.0], 2) == [0.0, 0.5, 1.0, 0.5, 0.5]
    assert rolling_mean([3.0, 1.0], 10) == [3.0, 2.0]  # fewer values than the window: the mean so far
