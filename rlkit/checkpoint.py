"""Checkpoints that are never half-written, and resuming from the newest complete one.

Layout of `default_local_dir`::

    checkpoints/global_step_20/
        hf/              the policy as a Hugging Face folder (LoRA merged): from_pretrained loads it
        policy/          the policy's trainable weights, optimizer and scheduler, written by its workers:
                         state.pt (one process) or one shard per process (FSDP2, torch.distributed.checkpoint)
        critic/          the same for PPO's value model
        state.pt         the rest: RNG states, data-loader position, validation history, KL controller, ...
        config.json      the run's config, checked when resuming
        digests.json     sha256 of the parts' files that carry no CRC of their own (torch.distributed.checkpoint's), if any:
                         against damage, not tampering (see below)
    checkpoints/latest   the newest step, a text file

A checkpoint is written into a temporary folder next to its final place, its files and folders are
fsync'ed, and it is renamed only when complete (a rename is atomic on one filesystem), so a crash or a
full disk mid-save leaves at most a `.tmp-*` folder that resume ignores and the next save removes;
`latest` moves only after the rename.

No load runs code. Every .pt file is read with `torch.load(weights_only=True)`: a checkpoint holds tensors
and plain Python values only (the RNG states and the sampler's state too). The sharded checkpoints' `.metadata` (a
pickle that torch.distributed.checkpoint writes) is read by an unpickler that builds only DCP's metadata classes,
torch dtypes and paths; their tensors weights-only, as torch reads them, and their non-tensor items (the
optimizer's lr, betas, ..., which DCP's default planner reads with `weights_only=False`) weights-only too
(`dcp_load`). A state.pt written by rlkit before that is refused with the command that converts
it: `python -m rlkit.checkpoint convert FOLDER` (which itself unpickles nothing but an older rlkit's numpy
RNG state unless given `--trust-this-file`). The hf/ export is never read on resume (from_pretrained reads its
safetensors; transformers reads a .bin weights-only).

digests.json catches damage (a flipped bit, a file cut short), not tampering: it sits in the folder it describes, so
whoever can change a file can rewrite it. What makes a tampered checkpoint harmless is that no load runs code. So that
deleting it (or an entry) does not turn the check off, every DCP file of a part must be listed: a sharded checkpoint
without digests.json is refused, and `python -m rlkit.checkpoint convert FOLDER` records them for one written by an
rlkit before digests.json, or one you take as it is.

A checkpoint is checked before resuming, the same way for `--trainer.resume auto` and an explicit PATH:
every .pt file's zip CRCs, every other file of a part against digests.json, state.pt and config.json
parsed, each `.metadata` unpickled safely and each non-tensor item of its shards read weights-only (`verify`). `auto` skips a newest checkpoint that fails it (with
a warning naming the file); an explicit PATH is refused with one line naming the file. Neither deletes
or changes anything in the checkpoint.
Resuming from a step older than the folder's newest moves the later checkpoints into
`checkpoints/abandoned-<time>/` (and the tracker cuts metrics.jsonl back to the resume step), so two
branches of a run never mix in one folder.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import pickle
import random
import re
import shutil
import sys
import time
import warnings
import zipfile
from pathlib import Path

import numpy as np
import torch

from rlkit.errors import ConfigError, MissingFile, RunFailed, UserError

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
    "trainer.val_n",  # how many samples validation takes: what it measures, not the run
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
        f"Convert it once: python -m rlkit.checkpoint convert {file.parent}  ({detail})"
    )


class _DCPMetadataUnpickler(pickle.Unpickler):
    """pickle.Unpickler that builds only what torch.distributed.checkpoint writes into `.metadata` (its metadata
    dataclasses, torch.Size, dtypes, layouts, memory formats, paths) and refuses any other global: a tampered
    file cannot name a function to call (os.system, eval, ...), so unpickling it runs no code."""

    ALLOWED = {
        "torch.distributed.checkpoint.metadata": {
            "Metadata", "TensorStorageMetadata", "TensorProperties", "ChunkStorageMetadata",
            "BytesStorageMetadata", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING",
        },
        "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
        "torch": {"Size"},
        "torch.serialization": {"_get_layout"},  # torch.layout pickles as _get_layout("torch.strided"): a dict lookup
        "pathlib": {"Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath"},
        "pathlib._local": {"Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath"},
        "collections": {"OrderedDict"},
    }  # fmt: skip

    def find_class(self, module: str, name: str):
        if name in self.ALLOWED.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.memory_format)):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"it names {module}.{name}, which checkpoint metadata never holds")

    def persistent_load(self, pid):
        raise pickle.UnpicklingError("it holds a persistent id, which checkpoint metadata never holds")


def read_dcp_metadata(file: str | Path):
    """The torch.distributed.checkpoint Metadata in `file` (a `.metadata` pickle), unpickled without running code.
    A file naming anything else (tampered with, or not DCP's) fails with one line; a damaged one too."""
    file = Path(file)
    try:
        with open(file, "rb") as f:
            return _DCPMetadataUnpickler(f).load()
    except FileNotFoundError:
        raise
    except pickle.UnpicklingError as e:
        raise ConfigError(
            f"{file} is not torch.distributed.checkpoint metadata ({e}): it was tampered with or damaged, and loading it "
            "could run code, so it was not loaded. Resume from another checkpoint"
        ) from e
    except (EOFError, OSError, ValueError, TypeError, AttributeError, KeyError, IndexError) as e:
        raise ConfigError(f"cannot read {file}: corrupt or cut short ({type(e).__name__}); resume from another checkpoint") from e


def dcp_reader(folder: str | Path):
    """A torch.distributed.checkpoint FileSystemReader of `folder` whose metadata is read by read_dcp_metadata
    (torch's own reader calls pickle.load on it); pass it to dcp.load(state, storage_reader=...)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):  # torch 2.13's read_metadata with its pickle.load replaced
            metadata = read_dcp_metadata(self._get_metadata_path(kwargs.get("rank")))
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader(str(folder))


def dcp_load(state: dict, folder: str | Path, no_dist: bool = False) -> None:
    """dcp.load(state) from `folder` without running code: `.metadata` through read_dcp_metadata, the tensors
    weights-only (as torch reads them) and the non-tensor "bytes" items (the optimizer's lr, betas, ...) weights-only
    too, where DCP's DefaultLoadPlanner reads them with torch.load(weights_only=False). An item holding anything else
    fails with one line naming it; so does any error DCP wraps in its CheckpointException that is the user's to fix."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._traverse import set_element
    from torch.distributed.checkpoint.api import CheckpointException

    class SafePlanner(dcp.DefaultLoadPlanner):
        def load_bytes(self, read_item, value):  # torch 2.13's load_bytes with weights_only=True
            fqn = read_item.dest_index.fqn
            try:
                obj = torch.load(value, map_location="cpu", weights_only=True)
            except pickle.UnpicklingError as e:
                name = re.search(r"GLOBAL (\S+)", str(e))
                raise ConfigError(
                    f"{folder}: the item {fqn} holds more than tensors and plain values (it names {name[1] if name else '?'}): "
                    "it was tampered with, and loading it could run code, so it was not loaded. Resume from another checkpoint"
                ) from e
            except (RuntimeError, EOFError, zipfile.BadZipFile) as e:
                raise ConfigError(
                    f"cannot read {folder}: the item {fqn} is corrupt ({type(e).__name__}); resume from another checkpoint"
                ) from e
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[fqn], obj)
            else:
                self.state_dict[fqn] = obj

    read_dcp_metadata(Path(folder) / ".metadata")  # a tampered one fails here in one line (DCP turns it into an AssertionError)
    try:
        dcp.load(state, storage_reader=dcp_reader(folder), planner=SafePlanner(), no_dist=no_dist)
    except CheckpointException as e:  # each rank's error, wrapped: show the user's one line
        user = [f[0] for f in e.failures.values() if isinstance(f[0], UserError)]
        if user:
            raise user[0] from e
        raise


def check_dcp_items(folder: str | Path) -> None:
    """Read every non-tensor item of the DCP checkpoint in `folder` as dcp_load does (ConfigError naming one that
    holds more than plain values); the tensors are not read."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    meta = read_dcp_metadata(Path(folder) / ".metadata")
    items = {k: None for k, md in meta.state_dict_metadata.items() if isinstance(md, BytesStorageMetadata)}
    if items:
        with warnings.catch_warnings():  # "torch.distributed is disabled ...: assuming ... a single process": it is
            warnings.simplefilter("ignore")
            dcp_load(items, folder, no_dist=True)


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
        if digests := _digests(tmp):  # before hf/ is written
            (tmp / DIGESTS).write_text(json.dumps(digests, indent=1))
        if save_hf is not None:
            save_hf(tmp / "hf")
        _fsync_tree(tmp)
    except BaseException as e:  # BaseException: torch.distributed.checkpoint raises CheckpointException(BaseException)
        full = _disk_full(e, root)  # asked before the half-written folder frees its space
        if full or isinstance(e, OSError):
            shutil.rmtree(tmp, ignore_errors=True)
        if full:
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


DIGESTS = "digests.json"
_FULL_DISK = ("No space left on device", "os error 28", "Disk quota exceeded", "os error 122")


def _disk_full(e: BaseException, folder: Path) -> bool:
    """Did saving into `folder` fail for lack of space? Python's writes raise OSError(ENOSPC), safetensors a
    SafetensorError saying "os error 28", a worker's a RayTaskError holding that text, but torch.save a
    RuntimeError("[enforce fail at inline_container.cc] unexpected pos ...") that says nothing of the cause (DCP's
    shards too: torch.save inside its CheckpointException): for those the filesystem's free space decides (< 16 MiB)."""
    seen, chain = e, 0
    while seen is not None and chain < 16:
        if isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if any(text in str(seen) for text in _FULL_DISK):
            return True
        seen, chain = seen.__cause__ or seen.__context__, chain + 1
    if not isinstance(e, RuntimeError) and type(e).__name__ != "CheckpointException":  # a bug keeps its traceback
        return False
    try:
        return shutil.disk_usage(folder).free < 16 << 20
    except OSError:
        return False


def _sha256(file: Path) -> str:
    h = hashlib.sha256()
    with open(file, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def _digests(folder: Path) -> dict:
    """{relative path: sha256} of the parts' files (every subfolder but hf/) that carry no CRC of their own (all but the
    .pt zip files): torch.distributed.checkpoint's shards and `.metadata`, so a damaged one is caught before it is read."""
    parts = sorted(p for p in folder.iterdir() if p.is_dir() and p.name != "hf")
    files = [f for part in parts for f in sorted(part.rglob("*")) if f.is_file() and f.suffix != ".pt"]
    return {str(f.relative_to(folder)): _sha256(f) for f in files}


def list_checkpoints(ckpt_root: str | Path) -> list[int]:
    """Steps of the complete checkpoints under ckpt_root, ascending."""
    root = Path(ckpt_root)
    steps = []
    for p in root.glob(f"{PREFIX}*") if root.is_dir() else []:
        if (p / "state.pt").is_file() and p.name[len(PREFIX) :].isdigit():
            steps.append(int(p.name[len(PREFIX) :]))
    return sorted(steps)


def verify(path: str | Path) -> None:
    """Check that checkpoint folder `path` reads back, without loading anything that could run code: the zip CRCs
    of state.pt and of every part's .pt file (torch.load does not check them), digests.json (written at save time)
    against the other files of the parts (each listed, none missing), state.pt weights-only, config.json, each part's
    `.metadata` with read_dcp_metadata and its non-tensor items weights-only. Raises ConfigError/MissingFile naming the
    first file that fails; changes nothing."""
    path = Path(path)
    for file in [path / "state.pt", *sorted(path.glob("*/*.pt"))]:
        try:
            with zipfile.ZipFile(file) as z:
                bad = z.testzip()
        except FileNotFoundError as e:
            raise MissingFile(f"{file} is missing; resume from another checkpoint") from e
        except (zipfile.BadZipFile, EOFError, ValueError, OSError) as e:
            raise ConfigError(f"cannot read {file}: corrupt or cut short ({type(e).__name__}); resume from another checkpoint") from e
        if bad is not None:
            raise ConfigError(f"cannot read {file}: its record {bad} fails its CRC (the file is damaged); resume from another checkpoint")
    load_file(path / "state.pt")
    _read_json(path / "config.json")
    now = _digests(path)
    if now and not (path / DIGESTS).is_file():  # save writes it whenever a part has such files: deleted since
        raise MissingFile(
            f"{path / DIGESTS} is missing (rlkit writes it with every sharded checkpoint): resume from another checkpoint, or "
            f"if it was written by an older rlkit or you trust its files as they are, record them: python -m rlkit.checkpoint convert {path}"
        )
    digests = _read_json(path / DIGESTS) if (path / DIGESTS).is_file() else {}
    for name in sorted(set(digests) | set(now)):
        file = path / name
        if name not in now:
            raise MissingFile(f"{file} is missing (listed in {path / DIGESTS}); resume from another checkpoint")
        if name not in digests:
            raise ConfigError(
                f"{file} is not listed in {path / DIGESTS} (added or unlisted after the save); resume from another checkpoint"
            )
        if now[name] != digests[name]:
            raise ConfigError(
                f"cannot read {file}: its sha256 differs from the one {path / DIGESTS} recorded at save time (the file is damaged "
                "or was changed); resume from another checkpoint"
            )
    for meta in sorted(path.glob("*/.metadata")):
        check_dcp_items(meta.parent)  # .metadata unpickled safely, then every non-tensor item weights-only


def _read_json(file: Path) -> dict:
    try:
        data = json.loads(file.read_text())
    except FileNotFoundError as e:
        raise MissingFile(f"{file} is missing; resume from another checkpoint") from e
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read {file}: corrupt or cut short ({type(e).__name__}); resume from another checkpoint") from e
    if not isinstance(data, dict):
        raise ConfigError(f"cannot read {file}: not a JSON object; resume from another checkpoint")
    return data


def readable(path: str | Path) -> str | None:
    """None if checkpoint folder `path` passes `verify`; else why not (the first file that fails, and how)."""
    try:
        verify(path)
    except (ConfigError, OSError, ValueError) as e:
        return f"{e}"
    return None


def find_resume_path(resume: str, ckpt_root: str | Path) -> Path | None:
    """'disable' -> None; 'auto' -> newest checkpoint that passes `verify`, or None (each skipped one is named in a
    warning); anything else must be a checkpoint folder that passes `verify` (else ConfigError/MissingFile naming
    the file that fails)."""
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
    try:
        verify(path)
    except (ConfigError, MissingFile) as e:
        raise type(e)(f"--trainer.resume {resume}: {e} (the checkpoint was left as is)") from e
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


def _numpy_rng_globals() -> list:
    """What an older rlkit's numpy RNG state (a tuple holding a uint32 ndarray) needs in a weights_only load: numpy's
    array constructor and dtypes, which build arrays and nothing else (no global outside this list can be named)."""
    multiarray = getattr(np, "_core", None) or np.core  # numpy 2 / 1
    return [multiarray.multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype("uint32"))]


def convert(folder: str | Path, trust: bool = False) -> list[Path]:
    """Rewrite the .pt files of a checkpoint written by an older rlkit so that weights_only=True reads them (numpy
    RNG state -> plain values). Unpickles nothing but tensors, plain values and numpy arrays, unless `trust`: then a
    file needing more is loaded with weights_only=False, which runs whatever code the file names (only for files
    whose origin you trust). A file that cannot be converted is refused with one line and left as is. A sharded
    checkpoint without digests.json (an older rlkit's) gets one, recording its DCP files as they are."""
    converted = []
    for file in sorted(Path(folder).rglob("*.pt")):
        try:
            torch.load(file, map_location="cpu", weights_only=True)
            continue
        except pickle.UnpicklingError:
            pass
        try:
            with torch.serialization.safe_globals(_numpy_rng_globals()):
                state = torch.load(file, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as e:
            if not trust:
                raise ConfigError(
                    f"{file} holds objects other than tensors, plain values and an older rlkit's numpy RNG state "
                    f"({str(e).splitlines()[0][:160]}), and loading it would run whatever code they name: nothing was loaded "
                    f"or changed. Only if you trust where it came from: python -m rlkit.checkpoint convert --trust-this-file {folder}"
                ) from e
            state = torch.load(file, map_location="cpu", weights_only=False)
        rng = state.get("rng") if isinstance(state, dict) else None
        if isinstance(rng, dict) and isinstance(rng.get("numpy"), tuple):
            name, keys, pos, has_gauss, cached = rng["numpy"]
            rng["numpy"] = [name, np.asarray(keys).tolist(), int(pos), int(has_gauss), float(cached)]
        tmp = file.with_suffix(".pt.tmp")
        torch.save(state, tmp)
        try:
            torch.load(tmp, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as e:
            tmp.unlink()
            raise ConfigError(
                f"{file} holds objects an rlkit checkpoint never holds ({str(e).splitlines()[0][:160]}): it cannot be converted "
                "and was left as is"
            ) from e
        tmp.replace(file)
        converted.append(file)
    folder = Path(folder)
    if (folder / "state.pt").is_file() and not (folder / DIGESTS).is_file() and (digests := _digests(folder)):
        (folder / DIGESTS).write_text(json.dumps(digests, indent=1))  # an older rlkit's DCP checkpoint, or one the user trusts
        converted.append(folder / DIGESTS)
    return converted


def main(argv: list[str] | None = None) -> None:
    """python -m rlkit.checkpoint convert [--trust-this-file] FOLDER"""
    import argparse

    from rlkit.errors import UserError

    parser = argparse.ArgumentParser(
        prog="python -m rlkit.checkpoint", description="Rewrite an older rlkit checkpoint for weights-only loading."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    conv = sub.add_parser(
        "convert",
        help="rewrite FOLDER's .pt files so that torch.load(weights_only=True) reads them, and record the digests.json a sharded "
        "checkpoint lacks",
    )
    conv.add_argument("folder", help="a checkpoint folder (checkpoints/global_step_N)")
    conv.add_argument(
        "--trust-this-file",
        action="store_true",
        help="also load files that hold arbitrary pickled objects with torch.load(weights_only=False): this RUNS any code "
        "the files name (a tampered checkpoint can do anything you can), so pass it only for checkpoints you wrote "
        "yourself or whose origin you trust. Without it nothing but tensors, plain values and numpy arrays is unpickled.",
    )
    args = parser.parse_args(argv)
    try:
        done = convert(args.folder, trust=args.trust_this_file)
    except UserError as e:
        sys.exit(f"rlkit: error: {e}")
    print(f"converted {len(done)} file(s): {', '.join(map(str, done)) or 'none needed'}")


if __name__ == "__main__":
    main()
