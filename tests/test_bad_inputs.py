"""The failures a new user still hits (issue #10, part 4): each ends with one line naming the flag or file and the fix.

Most cases stop in `loop.preflight`, before the model loads. docs/errors.md lists every case with its message.
"""

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_grpo_recipe import ROOT, _row, _write_parquet, load_recipe

from rlkit import checkpoint
from rlkit.errors import UserError

FIXTURE = ROOT / "tests" / "fixtures" / "my_reward.py"


def tiny(grpo, tmp_path, **data):
    cfg = grpo.Config()
    cfg.data.train_files = [_write_parquet(tmp_path / "train.parquet", [_row() for _ in range(8)])]
    cfg.data.val_files = []
    cfg.data.train_batch_size = cfg.actor.ppo_mini_batch_size = 4
    cfg.rollout.n = 2
    cfg.trainer.total_training_steps = 1
    cfg.trainer.val_before_train = False
    cfg.trainer.default_local_dir = str(tmp_path / "out")
    for k, v in data.items():
        setattr(cfg.data, k, v)
    return cfg


def corrupt_checkpoint(cfg, tmp_path):
    """A checkpoint of exactly this run whose policy/state.pt is garbage."""

    def garbage(folder):
        folder.mkdir()
        (folder / "state.pt").write_bytes(b"PK\x03\x04 garbage")

    path = checkpoint.save(
        tmp_path / "ckpt", 1, {"loader": {"epoch": 0, "position": 1}}, dataclasses.asdict(cfg), parts={"policy": garbage}
    )
    cfg.trainer.resume = str(path)
    return str(path / "policy" / "state.pt")


CASES = {
    # name: (change the config, phrases the message holds); a change may return extra phrases
    "string_prompts": (
        lambda c, t: setattr(c.data, "train_files", [_write_parquet(t / "s.parquet", [dict(_row(), prompt="What is 1+1?")] * 8)]),
        ["holds strings", '"role": "user"'],
    ),
    "max_prompt_length_0": (
        lambda c, t: (setattr(c.data, "max_prompt_length", 0), setattr(c.data, "truncation", "left")),
        ["--data.max-prompt-length 0", "at least 1"],
    ),
    "not_parquet": (
        lambda c, t: (t / "train.csv").write_text("a,b\n1,2\n") and setattr(c.data, "train_files", [str(t / "train.csv")]),
        ["train.csv is not a parquet file"],
    ),
    "empty_file": (
        lambda c, t: (t / "e.parquet").write_bytes(b"") or setattr(c.data, "train_files", [str(t / "e.parquet")]),
        ["e.parquet is not a parquet file"],
    ),
    "empty_dataset": (
        lambda c, t: setattr(c.data, "train_files", [_write_parquet(t / "none.parquet", [])]),
        ["none.parquet: the dataset is empty"],
    ),
    "long_val_prompt": (
        lambda c, t: setattr(c.data, "val_files", [_write_parquet(t / "val.parquet", [_row(), _row("What is " + "1+" * 300 + "1?")])]),
        ["row 1 of", "val.parquet", "--data.max-prompt-length", "--data.truncation"],
    ),
    "max_response_length_0": (lambda c, t: setattr(c.data, "max_response_length", 0), ["--data.max-response-length 0"]),
    "val_batch_size_0": (lambda c, t: setattr(c.data, "val_batch_size", 0), ["--data.val-batch-size 0"]),
    "val_n_0": (lambda c, t: setattr(c.trainer, "val_n", 0), ["--trainer.val-n 0", "at least 1"]),
    "negative_micro_batch": (lambda c, t: setattr(c.actor, "ppo_micro_batch_size", -2), ["--actor.ppo-micro-batch-size -2", "0 (auto)"]),
    "negative_log_prob_micro_batch": (
        lambda c, t: setattr(c.rollout, "log_prob_micro_batch_size", -1),
        ["--rollout.log-prob-micro-batch-size -1"],
    ),
    "lr_zero": (lambda c, t: setattr(c.actor, "lr", 0.0), ["--actor.lr 0.0", "learning rate"]),
    "lr_absurd": (lambda c, t: setattr(c.actor, "lr", 3.0), ["--actor.lr 3.0", "well below 1"]),
    "ppo_epochs_0": (lambda c, t: setattr(c.actor, "ppo_epochs", 0), ["--actor.ppo-epochs 0"]),
    "temperature_0": (
        lambda c, t: setattr(c.rollout, "temperature", 0.0),
        ["--rollout.temperature 0.0", "temperature > 0", "--rollout.val-temperature"],
    ),
    "reward_file_import_error": (
        lambda c, t: (
            (t / "bad_reward.py").write_text("import no_such_module_xyz\n") and setattr(c.reward, "custom_fn", f"{t}/bad_reward.py:score")
        ),
        ["the reward file", "bad_reward.py", "failed while importing", "no_such_module_xyz"],
    ),
    "null_ground_truth": (
        lambda c, t: setattr(
            c.data, "train_files", [_write_parquet(t / "n.parquet", [_row(answer=None if i in (2, 5) else "2") for i in range(8)])]
        ),
        ["n.parquet", "ground_truth is null in row(s) 2, 5"],
    ),
    "over_the_context": (
        lambda c, t: (
            setattr(c.data, "max_response_length", 64),
            setattr(c.data, "train_files", [_write_parquet(t / "c.parquet", [_row("What is " + "1+" * 40 + "1?")] * 8)]),
        ),
        ["+ --data.max-response-length 64", "over the model's context of 128", "max_position_embeddings"],
    ),
    "corrupt_policy_state": (corrupt_checkpoint, ["cannot read", "corrupt or cut short"]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input_stops_with_one_line_naming_flag_or_file(tmp_path, case):
    grpo = load_recipe("grpo")
    cfg = tiny(grpo, tmp_path)
    change, phrases = CASES[case]
    extra = change(cfg, tmp_path)
    phrases = phrases + ([extra] if isinstance(extra, str) else [])
    with pytest.raises(UserError) as info:
        grpo.main(cfg)
    message = str(info.value)
    assert "\n" not in message, message
    for phrase in phrases:
        assert phrase in message, (phrase, message)


def test_nan_policy_skip_stops_after_k_skipped_steps(tmp_path, monkeypatch):
    grpo = load_recipe("grpo")
    cfg = tiny(grpo, tmp_path)
    cfg.trainer.total_training_steps = 5
    cfg.actor.nan_policy, cfg.actor.max_skipped_steps = "skip", 2
    monkeypatch.setattr(grpo, "make_actor_loss", lambda cfg: lambda mb, logp, ent, norm: (logp.sum() * torch.nan, {}, {}))
    with pytest.raises(FloatingPointError, match=r"2 optimizer steps in a row skipped .*--actor.max-skipped-steps 2") as info:
        grpo.main(cfg)
    assert "\n" not in str(info.value)
    rows = (Path(cfg.trainer.default_local_dir) / "metrics.jsonl").read_text().splitlines()
    assert len(rows) == 1  # step 1 skipped and logged; step 2 skipped again and stopped the run


def test_a_scorer_calling_sys_exit_ends_the_cli_with_status_1_and_one_line(tmp_path):
    train = _write_parquet(tmp_path / "train.parquet", [_row() for _ in range(8)])
    args = ["--data.train-files", train, "--data.val-files", "--data.train-batch-size", "4", "--actor.ppo-mini-batch-size", "4"]
    args += ["--rollout.n", "2", "--trainer.total-training-steps", "1", "--trainer.default-local-dir", str(tmp_path / "out")]
    args += ["--reward.custom-fn", f"{FIXTURE}:exit_score"]
    out = subprocess.run([sys.executable, str(ROOT / "recipes" / "grpo.py"), *args], capture_output=True, text=True, timeout=300)
    assert out.returncode == 1, out.stderr[-2000:]
    err = out.stderr.split("rlkit: error:")[-1]
    assert "exit_score failed on sample 0" in err and "called sys.exit(0)" in err and "Traceback" not in out.stderr
