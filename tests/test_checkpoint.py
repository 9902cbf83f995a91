import json
import random

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from rlkit import checkpoint as ckpt
from rlkit.config import ActorConfig, ModelConfig

CONFIG = {
    "actor": {"lr": 1e-6, "clip_ratio": 0.2},
    "trainer": {"total_training_steps": 10, "seed": 1},
    "data": {"train_files": ["a.parquet"]},
}


def tiny_hf(folder):
    folder.mkdir()
    (folder / "model.txt").write_text("weights")


def save(root, step, keep=2, save_hf=tiny_hf):
    return ckpt.save(
        root,
        step,
        {"policy": {"w": torch.full((2,), float(step))}, "loader": {"epoch": 0, "position": step}},
        CONFIG,
        save_hf=save_hf,
        keep=keep,
    )


def test_save_layout_and_latest(tmp_path):
    path = save(tmp_path, 5)
    assert path == tmp_path / "global_step_5"
    assert sorted(p.name for p in path.iterdir()) == ["config.json", "hf", "state.pt"]
    assert (path / "hf" / "model.txt").read_text() == "weights"
    assert json.loads((path / "config.json").read_text()) == CONFIG
    assert (tmp_path / "latest").read_text() == "5"
    assert ckpt.list_checkpoints(tmp_path) == [5]
    state, config = ckpt.load(path)
    assert state["step"] == 5 and state["loader"] == {"epoch": 0, "position": 5}
    assert torch.equal(state["policy"]["w"], torch.full((2,), 5.0))
    assert config == CONFIG
    assert not list(tmp_path.glob(".tmp-*")) and not (tmp_path / "latest.tmp").exists()


def test_parts_are_written_by_their_owners_into_the_checkpoint_and_a_failing_part_leaves_none(tmp_path):
    def policy_part(folder):  # what a worker group does: write its own folder (one file per shard with FSDP2)
        folder.mkdir()
        for rank in range(2):
            torch.save({"shard": rank}, folder / f"shard{rank}.pt")

    path = ckpt.save(tmp_path, 3, {"loader": {}}, CONFIG, parts={"policy": policy_part})
    assert sorted(p.name for p in (path / "policy").iterdir()) == ["shard0.pt", "shard1.pt"]

    def crashing_part(folder):
        folder.mkdir()
        (folder / "half").write_text("x")
        raise RuntimeError("a worker died mid-save")

    with pytest.raises(RuntimeError, match="mid-save"):
        ckpt.save(tmp_path, 4, {"loader": {}}, CONFIG, parts={"policy": crashing_part})
    assert ckpt.list_checkpoints(tmp_path) == [3] and (tmp_path / "latest").read_text() == "3"
    assert ckpt.find_resume_path("auto", tmp_path) == path  # resume takes the last good one
    ckpt.save(tmp_path, 5, {"loader": {}}, CONFIG, parts={"policy": policy_part}, keep=0)
    assert not list(tmp_path.glob(".tmp-*"))  # the next save cleans up the half-written folder


def test_keep_last_k(tmp_path):
    for step in (1, 2, 3):
        save(tmp_path, step, keep=2)
    assert ckpt.list_checkpoints(tmp_path) == [2, 3]
    assert not (tmp_path / "global_step_1").exists()
    assert (tmp_path / "latest").read_text() == "3"
    for step in (4, 5):
        save(tmp_path, step, keep=0)  # 0 keeps everything
    assert ckpt.list_checkpoints(tmp_path) == [2, 3, 4, 5]


def test_pruning_never_removes_the_checkpoint_just_written(tmp_path):
    save(tmp_path, 10, keep=0)
    save(tmp_path, 20, keep=0)
    path = save(tmp_path, 12, keep=1)  # e.g. after resuming from an explicit older checkpoint
    assert path.is_dir() and ckpt.list_checkpoints(tmp_path) == [12]
    assert ckpt.find_resume_path("auto", tmp_path) == path
    save(tmp_path, 20, keep=0)
    save(tmp_path, 15, keep=2)
    assert ckpt.list_checkpoints(tmp_path) == [15, 20]


def test_resaving_a_step_replaces_it(tmp_path):
    save(tmp_path, 3)
    ckpt.save(tmp_path, 3, {"policy": {"w": torch.zeros(1)}}, CONFIG)
    assert ckpt.list_checkpoints(tmp_path) == [3]
    assert not (tmp_path / "global_step_3" / "hf").exists()
    assert torch.equal(ckpt.load(tmp_path / "global_step_3")[0]["policy"]["w"], torch.zeros(1))


def test_list_checkpoints_ignores_incomplete_and_foreign_folders(tmp_path):
    assert ckpt.list_checkpoints(tmp_path / "missing") == []
    save(tmp_path, 2)
    (tmp_path / "global_step_7").mkdir()  # no state.pt
    (tmp_path / "global_step_x").mkdir()
    (tmp_path / "global_step_x" / "state.pt").write_text("")
    (tmp_path / ".tmp-global_step_9").mkdir()
    assert ckpt.list_checkpoints(tmp_path) == [2]


def test_crash_mid_save_leaves_previous_checkpoint(tmp_path):
    save(tmp_path, 1)

    def crash(folder):
        folder.mkdir()
        (folder / "partial").write_text("half")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        save(tmp_path, 2, save_hf=crash)
    assert not (tmp_path / "global_step_2").exists()
    assert ckpt.list_checkpoints(tmp_path) == [1]
    assert ckpt.find_resume_path("auto", tmp_path) == tmp_path / "global_step_1"
    assert (tmp_path / "latest").read_text() == "1"
    assert list(tmp_path.glob(".tmp-*"))  # the leftover ...
    save(tmp_path, 2)
    assert not list(tmp_path.glob(".tmp-*"))  # ... is removed by the next successful save
    assert ckpt.list_checkpoints(tmp_path) == [1, 2]
    assert not (tmp_path / "global_step_2" / "hf" / "partial").exists()


def test_find_resume_path(tmp_path):
    assert ckpt.find_resume_path("disable", tmp_path) is None
    assert ckpt.find_resume_path("auto", tmp_path) is None
    assert ckpt.find_resume_path("auto", tmp_path / "does-not-exist") is None
    save(tmp_path, 4)
    save(tmp_path, 8)
    assert ckpt.find_resume_path("disable", tmp_path) is None
    assert ckpt.find_resume_path("auto", tmp_path) == tmp_path / "global_step_8"
    assert ckpt.find_resume_path(str(tmp_path / "global_step_4"), tmp_path) == tmp_path / "global_step_4"
    bad = tmp_path / "global_step_99"
    with pytest.raises(FileNotFoundError) as e:
        ckpt.find_resume_path(str(bad), tmp_path)
    msg = str(e.value)
    assert "--trainer.resume" in msg and str(bad) in msg and "not a checkpoint folder" in msg and "auto" in msg


def draws():
    return random.random(), np.random.rand(3).tolist(), torch.rand(3).tolist()


def test_load_restores_rng(tmp_path):
    random.seed(0), np.random.seed(0), torch.manual_seed(0)
    path = save(tmp_path, 1)
    first = draws()
    draws()  # move on further
    ckpt.load(path)
    assert draws() == first


def test_check_config():
    ckpt.check_config(CONFIG, json.loads(json.dumps(CONFIG)))
    changed = json.loads(json.dumps(CONFIG))
    changed["actor"]["lr"] = 3e-6
    with pytest.raises(ValueError) as e:
        ckpt.check_config(CONFIG, changed)
    msg = str(e.value)
    assert "actor.lr: saved 1e-06, now 3e-06" in msg
    assert "clip_ratio" not in msg
    resumable = json.loads(json.dumps(CONFIG))
    resumable["trainer"]["total_training_steps"] = 20
    assert "trainer.total_training_steps" in ckpt.RESUMABLE_CHANGES
    ckpt.check_config(CONFIG, resumable)
    added = json.loads(json.dumps(CONFIG))
    added["actor"]["new_knob"] = 1
    with pytest.raises(ValueError, match=r"actor\.new_knob: saved None, now 1"):
        ckpt.check_config(CONFIG, added)


def test_check_config_accepts_the_saved_json_of_a_dataclass_config(tmp_path):
    import dataclasses

    cfg = {"model": dataclasses.asdict(ModelConfig()), "actor": dataclasses.asdict(ActorConfig())}
    ckpt.save(tmp_path, 1, {}, cfg)
    _, saved = ckpt.load(tmp_path / "global_step_1")
    ckpt.check_config(saved, cfg)


# -- a real Hugging Face export ----------------------------------------------------------------
def logits_of(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.mark.parametrize("lora_rank", [0, 4])
def test_hf_export_loads_with_from_pretrained(tmp_path, lora_rank, monkeypatch):
    from peft.tuners.tuners_utils import BaseTuner

    from rlkit.engine import TorchEngine

    torch.manual_seed(0)
    engine = TorchEngine(ModelConfig(lora_rank=lora_rank), ActorConfig(), device="cpu")
    if lora_rank:  # lora_B starts at zero; perturb it so that merging changes the weights
        lora_b = [p for n, p in engine.model.named_parameters() if "lora_B" in n]
        assert lora_b
        with torch.no_grad():
            for p in lora_b:
                p.normal_(0, 0.05)
    ids = torch.tensor([engine.tokenizer("What is 12+34? 4", add_special_tokens=False)["input_ids"]])
    with monkeypatch.context() as m:  # LoRA merges layer by layer: no merged copy of the whole model (on a GPU: a second one there)
        m.setattr(BaseTuner, "merge_and_unload", lambda *a, **k: pytest.fail("the export merged a copy of the whole model"))
        path = ckpt.save(tmp_path, 1, engine.state_dict(), CONFIG, save_hf=engine.save_pretrained)
    exported = AutoModelForCausalLM.from_pretrained(path / "hf").eval()
    expected = logits_of(engine.model, ids)
    if lora_rank:
        base = AutoModelForCausalLM.from_pretrained(ModelConfig().path).eval()
        assert not torch.allclose(logits_of(base, ids), expected, atol=1e-3)  # the LoRA weights matter
        assert not any("lora" in k for k in exported.state_dict())
        torch.testing.assert_close(logits_of(exported, ids), expected, atol=1e-5, rtol=0)
    else:
        assert torch.equal(logits_of(exported, ids), expected)
    assert (path / "hf" / "tokenizer.json").is_file()


# ----------------------------------------------------------------------------- safe loading, fsync, auto, branches


def test_auto_picks_step_10_over_step_9(tmp_path):
    save(tmp_path, 9)
    save(tmp_path, 10)
    assert ckpt.find_resume_path("auto", tmp_path) == tmp_path / "global_step_10"


class Boom:
    """A pickle that runs code when loaded."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        import pathlib

        return pathlib.Path.write_text, (pathlib.Path(self.marker), "ran")


def test_a_checkpoint_with_a_pickle_in_it_is_refused_without_running_it(tmp_path):
    path = save(tmp_path, 1)
    marker = tmp_path / "ran.txt"
    torch.save({"step": 1, "rng": ckpt.rng_state(), "loader": {}, "evil": Boom(marker)}, path / "state.pt")
    with pytest.raises(ValueError, match=r"could run code.*python -m rlkit.checkpoint convert"):
        ckpt.load(path)
    assert not marker.exists()


def test_an_older_checkpoint_with_numpy_rng_fails_with_one_line_and_converts(tmp_path):
    np.random.seed(3)
    path = save(tmp_path, 1)
    state = torch.load(path / "state.pt", weights_only=True)
    state["rng"]["numpy"] = np.random.get_state()  # how rlkit stored it before: a tuple holding an ndarray
    torch.save(state, path / "state.pt")
    with pytest.raises(ValueError) as info:
        ckpt.load(path)
    assert "\n" not in str(info.value) and f"python -m rlkit.checkpoint convert {path}" in str(info.value)
    multiarray = getattr(np, "_core", None) or np.core  # numpy 2 / 1
    allowed = [multiarray.multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype("uint32"))]
    with torch.serialization.safe_globals(allowed), pytest.raises(ValueError, match="rlkit.checkpoint convert"):
        ckpt.load(path)  # still refused when a library has allow-listed numpy for weights_only loads
    expected = np.random.rand(3).tolist()
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "rlkit.checkpoint", "convert", str(path)], capture_output=True, text=True)
    assert out.returncode == 0 and "converted 1 file" in out.stdout, out.stderr
    ckpt.load(path)
    assert np.random.rand(3).tolist() == expected


def test_files_and_folders_are_fsynced_before_the_rename(tmp_path, monkeypatch):
    import os
    from pathlib import Path

    events = []
    real_fsync, real_rename = os.fsync, Path.rename
    monkeypatch.setattr(os, "fsync", lambda fd: events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"))) or real_fsync(fd))
    monkeypatch.setattr(Path, "rename", lambda self, target: events.append(("rename", str(self))) or real_rename(self, target))
    save(tmp_path, 3)
    renamed = events.index(("rename", str(tmp_path / ".tmp-global_step_3")))
    synced = {path for kind, path in events[:renamed] if kind == "fsync"}
    tmp = tmp_path / ".tmp-global_step_3"
    assert {str(tmp / "state.pt"), str(tmp / "config.json"), str(tmp / "hf" / "model.txt"), str(tmp / "hf"), str(tmp)} <= synced
    assert ("fsync", str(tmp_path)) in events[renamed:]  # the directory entry of the rename itself


def test_latest_is_untouched_when_the_atomic_rename_fails(tmp_path, monkeypatch):
    from pathlib import Path

    save(tmp_path, 1)
    save(tmp_path, 2)
    real_rename = Path.rename

    def failing(self, target):
        if self.name.startswith(".tmp-"):
            raise OSError("rename failed")
        return real_rename(self, target)

    monkeypatch.setattr(Path, "rename", failing)
    with pytest.raises(OSError, match="rename failed"):
        save(tmp_path, 2)  # re-saving a step must not lose the one already there either
    with pytest.raises(OSError, match="rename failed"):
        save(tmp_path, 3)
    assert (tmp_path / "latest").read_text() == "2"
    assert ckpt.list_checkpoints(tmp_path) == [1, 2]
    assert ckpt.load(tmp_path / "global_step_2")[0]["step"] == 2


def test_a_full_disk_names_the_folder_and_keeps_the_previous_checkpoint(tmp_path):
    import errno

    from rlkit.errors import RunFailed

    save(tmp_path, 1)

    def full(folder):
        folder.mkdir()
        (folder / "model.txt").write_text("half")
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(RunFailed) as info:
        save(tmp_path, 2, save_hf=full)
    msg = str(info.value)
    assert str(tmp_path) in msg and "step 1 is kept" in msg and "--trainer.default-local-dir" in msg
    assert ckpt.list_checkpoints(tmp_path) == [1] and (tmp_path / "latest").read_text() == "1"
    assert not list(tmp_path.glob(".tmp-*"))


@pytest.mark.parametrize("damaged", ["state.pt", "policy/state.pt", "config.json"])
def test_auto_skips_an_unreadable_newest_checkpoint_naming_it(tmp_path, caplog, damaged):
    parts = {"policy": lambda f: f.mkdir() or torch.save({"model": {"w": torch.ones(64)}}, f / "state.pt")}
    for step in (1, 2):
        ckpt.save(tmp_path, step, {"loader": {}}, CONFIG, keep=3, parts=parts)
    file = tmp_path / "global_step_2" / damaged
    file.write_bytes(file.read_bytes()[: len(file.read_bytes()) // 2])  # cut short, as by a crash or a full disk
    with caplog.at_level("WARNING"):
        assert ckpt.find_resume_path("auto", tmp_path) == tmp_path / "global_step_1"
    assert f"skipping {tmp_path / 'global_step_2'}" in caplog.text
    assert len([r for r in caplog.records if r.levelname == "WARNING"]) == 1


def test_a_corrupt_worker_state_is_named(tmp_path):
    from rlkit.workers import CheckpointFiles

    (tmp_path / "state.pt").write_bytes(b"PK\x03\x04 not really a zip")
    with pytest.raises(ValueError, match=f"cannot read {tmp_path / 'state.pt'}: corrupt or cut short"):
        type("Worker", (CheckpointFiles,), {"load_state_dict": lambda self, state: None})().load_checkpoint(tmp_path)


def test_resuming_from_an_older_step_moves_the_later_checkpoints_aside(tmp_path):
    for step in (2, 4, 6):
        save(tmp_path, step, keep=0)
    aside = ckpt.set_aside_later(tmp_path, 2)
    assert ckpt.list_checkpoints(tmp_path) == [2] and (tmp_path / "latest").read_text() == "2"
    assert aside.parent == tmp_path and sorted(p.name for p in aside.iterdir()) == ["global_step_4", "global_step_6"]
    assert ckpt.set_aside_later(tmp_path, 2) is None


@pytest.mark.parametrize("name", ["grpo", "ppo", "grpo_tools", "sft", "rm"])
def test_a_checkpoint_config_json_is_the_one_rlkit_wrote_before_the_system_sections(name):
    """config.json holds the options by flag name (recipe.Run: config.nested(config.flag_values(cfg))), not by where a
    field sits: moving --trainer.backend into cfg.system.scale_out left it config["trainer"]["backend"]. The fixture is
    each recipe's default config.json as rlkit wrote it before cfg.system existed (dataclasses.asdict of the old
    Config; install paths as {root}): identical, so a run saved then resumes now (checkpoint.check_config)."""
    from test_grpo_recipe import ROOT, load_recipe

    from rlkit import config

    fixture = (ROOT / "tests" / "fixtures" / "config_json_before_system_sections.json").read_text()
    before = json.loads(fixture.replace("{root}", str(ROOT)))[name]
    now = json.loads(json.dumps(config.nested(config.flag_values(load_recipe(name).Config())), default=str))
    assert ckpt.flatten(now) == ckpt.flatten(before)
    ckpt.check_config(before, now)  # resumable: no difference outside RESUMABLE_CHANGES either


def test_a_run_writes_config_json_by_flag_name(tmp_path):
    """What recipe.Run writes is that format: a one-step grpo run's config.json has exactly the old config.json's keys
    (config["trainer"]["backend"], no "system")."""
    from test_grpo_recipe import ROOT, load_recipe, small_config

    grpo = load_recipe("grpo")
    grpo.main(small_config(grpo, tmp_path, steps=1, num_threads=1, test_freq=0, val_before_train=False))
    saved = json.loads((tmp_path / "checkpoints" / "global_step_1" / "config.json").read_text())
    before = json.loads((ROOT / "tests" / "fixtures" / "config_json_before_system_sections.json").read_text())["grpo"]
    assert "system" not in saved and set(ckpt.flatten(saved)) == set(ckpt.flatten(before))
    assert saved["trainer"]["backend"] == "local" and saved["trainer"]["total_training_steps"] == 1
