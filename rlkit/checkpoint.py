"""Checkpoints that are never half-written, and resuming from the newest complete one.

Layout of `default_local_dir`::

    checkpoints/global_step_20/
        hf/              the policy as a Hugging Face folder (LoRA merged): from_pretrained loads it
        policy/          the policy's trainable weights, optimizer and scheduler, written by its workers:
                         state.pt (one process) or one shard per process (FSDP2, torch.distributed.checkpoint)
        critic/          the same for PPO's value model
        state.pt         the rest: RNG states, data-loader position, validation history, KL controller, ...
        config.json      the run's config, checked when resuming
    checkpoints/latest   the newest step, a text file

A checkpoint is written into a temporary folder next to its final place and renamed only when
complete (a rename is atomic on one filesystem), so a crash mid-save leaves at most a
`.tmp-*` folder that resume ignores and the next save removes.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import numpy as np
import torch

from rlkit.errors import ConfigError, MissingFile

PREFIX = "global_step_"
# Config fields that may differ between the run that saved and the run that resumes. The output folder and the
# names may: `--trainer.resume PATH` into another folder starts a branch of the run from that checkpoint.
RESUMABLE_CHANGES = {
    "trainer.resume",
    "trainer.total_epochs",
    "trainer.total_training_steps",
    "trainer.save_freq",
    "trainer.test_freq",
    "trainer.logger",
    "trainer.max_ckpt_to_keep",
    "trainer.device",
    "trainer.num_threads",
    "trainer.val_before_train",
    "data.val_files",
    "data.val_batch_size",
    "data.val_max_samples",
    "rollout.log_prob_micro_batch_size",
    "rollout.micro_batch_size",
    "rollout.gpu_memory_utilization",
    "model.gradient_checkpointing",
    "model.attn_implementation",
    "model.remove_padding",
    "model.share_prompt",
    "actor.max_token_len_per_micro_batch",
    "critic.max_token_len_per_micro_batch",
    "trainer.ray_address",
    "trainer.cpus_per_worker",
    "trainer.n_workers",
    "trainer.critic_workers",
    "trainer.reward_workers",
    "trainer.fsdp_offload",
    "trainer.default_local_dir",
    "trainer.experiment_name",
    "trainer.project_name",
}


def rng_state() -> dict:
    """Python, numpy and torch (CPU and CUDA) random states.

    CUDA's only where this process already uses CUDA: get_rng_state_all() would otherwise create a CUDA
    context on every visible GPU (the Ray driver, whose workers hold the GPUs)."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_initialized():
        torch.cuda.set_rng_state_all(state["cuda"])


def flatten(d: dict, prefix: str = "") -> dict:
    """{'a': {'b': 1}} -> {'a.b': 1}"""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def save(ckpt_root: str | Path, step: int, state: dict, config: dict, save_hf=None, keep: int = 2, parts: dict | None = None) -> Path:
    """Atomically write checkpoint `step` (state -> state.pt, save_hf(folder) -> hf/, parts[name](folder) -> name/),
    then prune to `keep`. The folders go to the workers that write them: with Ray on several nodes the
    checkpoint directory must be on a filesystem they all see."""
    root = Path(ckpt_root)
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(".tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    final = root / f"{PREFIX}{step}"
    tmp = root / f".tmp-{PREFIX}{step}"
    tmp.mkdir()
    torch.save({**state, "step": step, "rng": rng_state()}, tmp / "state.pt")
    (tmp / "config.json").write_text(json.dumps(config, indent=2, default=str))
    for name, write in (parts or {}).items():
        write(tmp / name)
    if save_hf is not None:
        save_hf(tmp / "hf")
    if final.exists():  # re-saving the same step (e.g. final save right after a periodic one)
        shutil.rmtree(final)
    tmp.rename(final)
    (root / "latest.tmp").write_text(str(step))
    (root / "latest.tmp").replace(root / "latest")
    if keep > 0:  # the oldest go; never the one just written (it may be older than others after a resume)
        others = [s for s in list_checkpoints(root) if s != step]
        for old in others[: max(len(others) - keep + 1, 0)]:
            shutil.rmtree(root / f"{PREFIX}{old}", ignore_errors=True)
    return final


def list_checkpoints(ckpt_root: str | Path) -> list[int]:
    """Steps of the complete checkpoints under ckpt_root, ascending."""
    root = Path(ckpt_root)
    steps = []
    for p in root.glob(f"{PREFIX}*") if root.is_dir() else []:
        if (p / "state.pt").is_file() and p.name[len(PREFIX) :].isdigit():
            steps.append(int(p.name[len(PREFIX) :]))
    return sorted(steps)


def find_resume_path(resume: str, ckpt_root: str | Path) -> Path | None:
    """'disable' -> None; 'auto' -> newest checkpoint or None; anything else must be a checkpoint folder."""
    if resume == "disable":
        return None
    if resume == "auto":
        steps = list_checkpoints(ckpt_root)
        return Path(ckpt_root) / f"{PREFIX}{steps[-1]}" if steps else None
    path = Path(resume)
    if not (path / "state.pt").is_file():
        raise MissingFile(
            f"--trainer.resume {resume}: not a checkpoint folder (expected {path / 'state.pt'}); use 'auto' or a {PREFIX}N folder"
        )
    return path


def check_config(saved: dict, current: dict) -> None:
    """Refuse to resume when settings that shape the run changed (the error lists them)."""
    a, b = flatten(saved), flatten(json.loads(json.dumps(current, default=str)))
    diff = [k for k in sorted(set(a) | set(b)) if k not in RESUMABLE_CHANGES and a.get(k) != b.get(k)]
    if diff:
        lines = "\n".join(f"  {k}: saved {a.get(k)!r}, now {b.get(k)!r}" for k in diff)
        raise ConfigError(
            f"cannot resume: the config differs from the checkpoint's in\n{lines}\n"
            "Resume with the same settings, or start a new run with another --trainer.experiment-name / --trainer.default-local-dir"
        )


def load(path: str | Path) -> tuple[dict, dict]:
    """(state, saved config) of a checkpoint folder; restores the RNG states."""
    path = Path(path)
    state = torch.load(path / "state.pt", map_location="cpu", weights_only=False)  # resumable on another device
    set_rng_state(state["rng"])
    return state, json.loads((path / "config.json").read_text())
