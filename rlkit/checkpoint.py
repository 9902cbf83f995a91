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

A checkpoint is written into a temporary folder next to its final place, its files and folders are
fsync'ed, and it is renamed only when complete (a rename is atomic on one filesystem), so a crash or a
full disk mid-save leaves at most a `.tmp-*` folder that resume ignores and the next save removes;
`latest` moves only after the rename.

Every file is read with `torch.load(weights_only=True)`: a checkpoint holds tensors and plain Python
values only (the RNG states too), so loading one cannot run code. A state.pt written by rlkit before that
is refused with the command that converts it: `python -m rlkit.checkpoint convert FOLDER` (only for
checkpoints you trust). `--trainer.resume auto` skips a newest checkpoint that does not read back.
Resuming from a step older than the folder's newest moves the later checkpoints into
`checkpoints/abandoned-<time>/` (and the tracker cuts metrics.jsonl back to the resume step), so two
branches of a run never mix in one folder.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import pickle
import random
import shutil
import sys
import time
import zipfile
from pathlib import Path

import numpy as np
import torch

from rlkit.errors import ConfigError, MissingFile, RunFailed

logger = logging.getLogger(__name__)

PREFIX = "global_step_"
# Config fields that may differ between the run that saved and the run that resumes. The output folder and the
# names may: `--trainer.resume PATH` into another folder starts a branch of the run from that checkpoint.
RESUMABLE_CHANGES = {
    "trainer.resume",
    "trainer.async_workers",  # how many processes generate: the sampling, not the run's settings
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
    """Python, numpy and torch (CPU and CUDA) random states, as tensors and plain values (weights_only-loadable)."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": [name, keys.tolist(), int(pos), int(has_gauss), float(cached)],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_initialized():  # else get_rng_state_all() would create a CUDA context on every visible GPU (the Ray driver)
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_initialized():
        torch.cuda.set_rng_state_all(state["cuda"])


def load_file(file: str | Path) -> dict:
    """torch.load(file, weights_only=True) on the CPU; a file that cannot be read that way fails with one line."""
    file = Path(file)
    try:
        state = torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise _older_format(file, str(e).splitlines()[0][:120]) from e
    except (RuntimeError, EOFError, OSError, zipfile.BadZipFile) as e:
        if isinstance(e, FileNotFoundError):
            raise
        raise ConfigError(f"cannot read {file}: corrupt or cut short ({type(e).__name__}); resume from another checkpoint") from e
    numpy_rng = state.get("rng", {}).get("numpy") if isinstance(state, dict) else None
    if numpy_rng is not None and not isinstance(numpy_rng, list):  # an older rlkit's tuple with an ndarray: read only
        raise _older_format(file, "numpy RNG state as an array")  # because a library allow-listed numpy for weights_only
    return state


def _older_format(file: Path, detail: str) -> ConfigError:
    return ConfigError(
        f"{file} holds more than tensors and plain values (written by an older rlkit?), and loading it could run code. "
        f"If you trust it, convert it once: python -m rlkit.checkpoint convert {file.parent}  ({detail})"
    )


def _fsync_tree(folder: Path) -> None:
    """fsync every file and folder under `folder`, then `folder` itself, so a rename after it publishes data on disk."""
    for dirpath, _, filenames in os.walk(folder, topdown=False):
        for name in filenames:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(dirpath))


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
    checkpoint directory must be on a filesystem they all see. A full disk ends the run with RunFailed
    naming the folder; the previous checkpoints and `latest` are untouched."""
    root = Path(ckpt_root)
    root.mkdir(parents=True, exist_ok=True)
    for stale in [*root.glob(".tmp-*"), *root.glob(".old-*")]:
        shutil.rmtree(stale, ignore_errors=True)
    final = root / f"{PREFIX}{step}"
    tmp = root / f".tmp-{PREFIX}{step}"
    try:
        tmp.mkdir()
        torch.save({**state, "step": step, "rng": rng_state()}, tmp / "state.pt")
        (tmp / "config.json").write_text(json.dumps(config, indent=2, default=str))
        for name, write in (parts or {}).items():
            write(tmp / name)
        if save_hf is not None:
            save_hf(tmp / "hf")
        _fsync_tree(tmp)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            kept = list_checkpoints(root)
            raise RunFailed(
                f"no space left on the device of {root} while saving step {step}: nothing was published, "
                f"{'the checkpoint of step ' + str(kept[-1]) + ' is kept' if kept else 'no earlier checkpoint exists'}. "
                "Free space, lower --trainer.max-ckpt-to-keep, or point --trainer.default-local-dir at a larger disk"
            ) from e
        raise
    old = root / f".old-{PREFIX}{step}"
    if final.exists():  # re-saving the same step (e.g. final save right after a periodic one): keep it until the swap
        final.rename(old)
    try:
        tmp.rename(final)
    except OSError:
        if old.exists():
            old.rename(final)  # put the earlier save of this step back
        raise
    _fsync_dir(root)
    shutil.rmtree(old, ignore_errors=True)
    (root / "latest.tmp").write_text(str(step))
    (root / "latest.tmp").replace(root / "latest")
    _fsync_dir(root)
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


def readable(path: str | Path) -> str | None:
    """None if checkpoint folder `path` reads back (state.pt, config.json, each part's state.pt zip records);
    else the first file that does not, and why."""
    path = Path(path)
    try:
        load_file(path / "state.pt")
        json.loads((path / "config.json").read_text())
        for part in sorted(path.glob("*/*.pt")):
            with zipfile.ZipFile(part) as z:
                bad = z.testzip()
            if bad is not None:
                raise zipfile.BadZipFile(f"record {bad} fails its CRC")
    except (ConfigError, OSError, ValueError, zipfile.BadZipFile) as e:
        return f"{e}"
    return None


def find_resume_path(resume: str, ckpt_root: str | Path) -> Path | None:
    """'disable' -> None; 'auto' -> newest checkpoint that reads back, or None (each skipped one is named in a
    warning); anything else must be a checkpoint folder."""
    if resume == "disable":
        return None
    if resume == "auto":
        for step in reversed(list_checkpoints(ckpt_root)):
            path = Path(ckpt_root) / f"{PREFIX}{step}"
            why = readable(path)
            if why is None:
                return path
            logger.warning("--trainer.resume auto: skipping %s, it does not read back: %s", path, why.splitlines()[0])
        return None
    path = Path(resume)
    if not (path / "state.pt").is_file():
        raise MissingFile(
            f"--trainer.resume {resume}: not a checkpoint folder (expected {path / 'state.pt'}); use 'auto' or a {PREFIX}N folder"
        )
    return path


def set_aside_later(ckpt_root: str | Path, step: int) -> Path | None:
    """Move the checkpoints after `step` into ckpt_root/abandoned-<time>/ and point `latest` at `step`, so a run resumed
    from an older step never mixes with the branch it left. Returns that folder (None when there was nothing to move)."""
    root = Path(ckpt_root)
    steps = [p.name[len(PREFIX) :] for p in root.glob(f"{PREFIX}*")]  # complete or not
    later = sorted(int(s) for s in steps if s.isdigit() and int(s) > step)
    if not later:
        return None
    aside = root / f"abandoned-{time.strftime('%Y%m%d-%H%M%S')}"
    aside.mkdir()
    for s in later:
        (root / f"{PREFIX}{s}").rename(aside / f"{PREFIX}{s}")
    (root / "latest.tmp").write_text(str(step))
    (root / "latest.tmp").replace(root / "latest")
    _fsync_dir(root)
    logger.warning("resuming at step %d: moved the later checkpoints %s into %s", step, later, aside)
    return aside


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
    state = load_file(path / "state.pt")  # on the CPU: resumable on another device
    set_rng_state(state["rng"])
    return state, json.loads((path / "config.json").read_text())


def convert(folder: str | Path) -> list[Path]:
    """Rewrite the .pt files of a checkpoint written by an older rlkit so that weights_only=True reads them (numpy
    RNG state -> plain values). Loads them with weights_only=False: run it only on checkpoints you trust."""
    import numpy

    converted = []
    for file in sorted(Path(folder).rglob("*.pt")):
        try:
            torch.load(file, map_location="cpu", weights_only=True)
            continue
        except pickle.UnpicklingError:
            pass
        state = torch.load(file, map_location="cpu", weights_only=False)
        rng = state.get("rng") if isinstance(state, dict) else None
        if rng is not None and isinstance(rng.get("numpy"), tuple):
            name, keys, pos, has_gauss, cached = rng["numpy"]
            rng["numpy"] = [name, numpy.asarray(keys).tolist(), int(pos), int(has_gauss), float(cached)]
        tmp = file.with_suffix(".pt.tmp")
        torch.save(state, tmp)
        torch.load(tmp, map_location="cpu", weights_only=True)  # fails here (file untouched) if something else needs pickle
        tmp.replace(file)
        converted.append(file)
    return converted


if __name__ == "__main__":  # python -m rlkit.checkpoint convert FOLDER
    if len(sys.argv) != 3 or sys.argv[1] != "convert":
        sys.exit("usage: python -m rlkit.checkpoint convert CHECKPOINT_FOLDER   (only for checkpoints you trust)")
    done = convert(sys.argv[2])
    print(f"converted {len(done)} file(s): {', '.join(map(str, done)) or 'none needed'}")
