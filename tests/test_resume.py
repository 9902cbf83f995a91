"""A run killed with SIGKILL and resumed with --trainer.resume auto matches an uninterrupted run, bit for bit."""

import os
import signal
import subprocess
import sys
import time

import datasets
import torch
from safetensors.torch import load_file
from test_grpo_recipe import ROOT, _comparable, read_jsonl, run_cli

from rlkit import demos


def _args(tmp_path, out):
    train = tmp_path / "train16.parquet"
    if not train.exists():
        ds = datasets.load_dataset("parquet", data_files=str(demos.ARITH_DATA / "train.parquet"), split="train")
        ds.select(range(16)).to_parquet(str(train))
    # 16 prompts / 8 per step = 2 steps per epoch: steps 3 and 5 start a new epoch
    return [
        "--data.train-files",
        str(train),
        "--data.val-files",
        "--data.train-batch-size",
        "8",
        "--actor.ppo-mini-batch-size",
        "4",
        "--rollout.n",
        "4",
        "--trainer.total-training-steps",
        "6",
        "--trainer.save-freq",
        "1",
        "--trainer.max-ckpt-to-keep",
        "10",
        "--trainer.default-local-dir",
        str(out),
    ]


def _kill_when(path, proc, timeout=120):
    start = time.time()
    while not path.exists():
        assert proc.poll() is None, "the run ended before it could be killed"
        assert time.time() - start < timeout
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()


def test_sigkill_at_an_epoch_boundary_then_resume_matches_an_uninterrupted_run(tmp_path):
    full, part = tmp_path / "full", tmp_path / "part"
    assert run_cli(*_args(tmp_path, full)).returncode == 0

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "recipes/grpo.py"), *_args(tmp_path, part)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    _kill_when(part / "checkpoints" / "global_step_2", proc)  # the end of epoch 0
    done_before = len(list((part / "checkpoints").glob("global_step_*")))
    assert done_before < 6, "killed too late to test anything"

    out = run_cli(*_args(tmp_path, part), "--trainer.resume", "auto")
    assert out.returncode == 0, out.stderr[-3000:]

    a, b = read_jsonl(full / "metrics.jsonl"), read_jsonl(part / "metrics.jsonl")
    assert [r["step"] for r in b] == [1, 2, 3, 4, 5, 6]
    assert [r["training/epoch"] for r in b] == [0, 0, 1, 1, 2, 2]
    assert _comparable(a) == _comparable(b)
    wa = load_file(full / "checkpoints/global_step_6/hf/model.safetensors")
    wb = load_file(part / "checkpoints/global_step_6/hf/model.safetensors")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_resume_refuses_a_changed_config_and_keeps_the_checkpoint(tmp_path):
    out_dir = tmp_path / "run"
    args = _args(tmp_path, out_dir)
    args[args.index("--trainer.total-training-steps") + 1] = "1"
    assert run_cli(*args).returncode == 0
    out = run_cli(*args, "--trainer.resume", "auto", "--actor.lr", "0.5")
    assert out.returncode == 1
    assert "actor.lr" in out.stderr and "cannot resume" in out.stderr
    assert (out_dir / "checkpoints/global_step_1/state.pt").is_file()


def test_resuming_from_an_older_step_moves_later_checkpoints_aside_and_cuts_the_metrics(tmp_path):
    from test_grpo_recipe import load_recipe, small_config

    grpo = load_recipe("grpo")
    out = tmp_path / "run"
    grpo.main(small_config(grpo, out, steps=4, max_ckpt_to_keep=5, val_before_train=False, test_freq=0))
    ckpts = out / "checkpoints"
    assert [r["step"] for r in read_jsonl(out / "metrics.jsonl")] == [1, 2, 3, 4]
    first_four = (ckpts / "global_step_4" / "hf" / "model.safetensors").read_bytes()

    branch = small_config(grpo, out, steps=3, max_ckpt_to_keep=5, val_before_train=False, test_freq=0)
    branch.system.trainer.resume = str(ckpts / "global_step_2")
    branch.trainer.total_training_steps = 3
    grpo.main(branch)
    aside = list(ckpts.glob("abandoned-*"))
    assert len(aside) == 1 and sorted(p.name for p in aside[0].iterdir()) == ["global_step_4"]
    assert (aside[0] / "global_step_4" / "hf" / "model.safetensors").read_bytes() == first_four  # moved, untouched
    assert sorted(p.name for p in ckpts.glob("global_step_*")) == ["global_step_2", "global_step_3"]
    assert (ckpts / "latest").read_text() == "3"
    assert [r["step"] for r in read_jsonl(out / "metrics.jsonl")] == [1, 2, 3]  # the old step 3 and 4 rows are gone
