"""No checkpoint load runs code, and a damaged checkpoint is refused before anything reads it.

Each load path gets a file holding a `__reduce__` payload that would create a marker file: the path must raise a
one-line user error and the marker must not exist. DCP's `.metadata` (a pickle torch.distributed.checkpoint writes
and its reader pickle.loads) and its non-tensor "bytes" items (the optimizer's lr, betas, ...: its default planner
torch.loads them with weights_only=False), the Megatron engine's per-rank files, `python -m rlkit.checkpoint convert`,
the explicit `--trainer.resume PATH` check (bit flips that torch.load reads silently) and the digests' trust rule (a
sharded checkpoint without its digests.json is refused). Disk full: the one-line error on a
real full filesystem (a 1 MiB tmpfs when this process may mount one) and on the exact exceptions torch and
safetensors raise there.
"""

import errno
import gc
import io
import json
import pathlib
import pickle
import shutil
import struct
import subprocess
import sys
import types
import zipfile

import pytest
import torch

from rlkit import checkpoint as ckpt
from rlkit.errors import ConfigError, RunFailed, UserError

CONFIG = {"trainer": {"seed": 1}}


class Boom:
    """Unpickling this writes `marker`: the stand-in for any code a tampered checkpoint could run."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return pathlib.Path.write_text, (pathlib.Path(self.marker), "ran")


def one_line_user_error(info) -> str:
    msg = str(info.value)
    assert isinstance(info.value, UserError) and "\n" not in msg
    return msg


# -- torch.distributed.checkpoint's .metadata ----------------------------------------------------------------------
def trained(lr=1e-3):
    """A model and its AdamW after one step, and their state as the FSDP workers hand it to DCP."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    model(torch.ones(1, 4)).sum().backward()
    optimizer.step()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return model, {"model": model_sd, "optimizer": optim_sd}


def dcp_part(folder):
    """A part written as the FSDP workers write theirs: DCP shards + .metadata, and extra_state.pt (here in one process).
    The optimizer's param_groups (lr, betas, ...) are DCP's non-tensor "bytes" items, pickled into the shard."""
    import torch.distributed.checkpoint as dcp

    model, state = trained()
    folder.mkdir()
    dcp.save(state, checkpoint_id=str(folder), no_dist=True)
    torch.save({"scheduler": {"last_epoch": 1}, "updates": 1}, folder / "extra_state.pt")
    return model


def tamper_metadata(folder, marker):
    """Re-pickle `folder/.metadata` with a payload riding on it (the test trusts its own file to read it)."""
    meta = pickle.loads((folder / ".metadata").read_bytes())
    meta.planner_data = {"x": Boom(marker)}
    (folder / ".metadata").write_bytes(pickle.dumps(meta))


def tamper_bytes_item(folder, marker, fqn="optimizer.param_groups.0.lr"):
    """Point DCP's non-tensor item `fqn` at a payload appended to its shard, and re-pickle `.metadata` to say so."""
    from torch.distributed.checkpoint.metadata import MetadataIndex

    meta = pickle.loads((folder / ".metadata").read_bytes())
    payload = io.BytesIO()
    torch.save(Boom(marker), payload)
    info = meta.storage_data[MetadataIndex(fqn)]
    shard = folder / info.relative_path
    info.offset, info.length = shard.stat().st_size, len(payload.getvalue())
    with open(shard, "ab") as f:
        f.write(payload.getvalue())
    (folder / ".metadata").write_bytes(pickle.dumps(meta))


def refresh_digests(path):
    """As a tamperer would: digests.json sits in the checkpoint, so it can be recomputed (only the safe loads stand)."""
    (path / ckpt.DIGESTS).write_text(json.dumps(ckpt._digests(path)))


def test_dcp_metadata_reads_back_with_the_restricted_unpickler(tmp_path):
    import torch.distributed.checkpoint as dcp

    model = dcp_part(tmp_path / "policy")
    meta = ckpt.read_dcp_metadata(tmp_path / "policy" / ".metadata")
    assert meta.state_dict_metadata["model.weight"].size == torch.Size([3, 4])
    state = {"model": {k: torch.zeros_like(v) for k, v in model.state_dict().items()}}
    dcp.load(state, storage_reader=ckpt.dcp_reader(tmp_path / "policy"), no_dist=True)
    assert torch.equal(state["model"]["weight"], model.weight.detach())
    _, state = trained(lr=0.5)  # another lr, another step: dcp_load puts back the saved ones, the bytes items too
    ckpt.dcp_load(state, tmp_path / "policy", no_dist=True)
    group = state["optimizer"]["param_groups"][0]
    assert group["lr"] == 1e-3 and group["betas"] == (0.9, 0.999) and group["params"] == ["weight", "bias"]
    assert torch.equal(state["model"]["weight"], model.weight.detach())


def test_a_payload_in_a_dcp_bytes_item_is_refused_without_running_it(tmp_path):
    import torch.distributed.checkpoint as dcp

    dcp_part(tmp_path / "policy")
    marker = tmp_path / "ran.txt"
    tamper_bytes_item(tmp_path / "policy", marker)
    for load in (lambda: ckpt.dcp_load(trained()[1], tmp_path / "policy", no_dist=True), lambda: ckpt.check_dcp_items(tmp_path / "policy")):
        with pytest.raises(ConfigError) as info:
            load()
        msg = one_line_user_error(info)
        assert f"{tmp_path / 'policy'}: the item optimizer.param_groups.0.lr holds more than tensors and plain values" in msg
        assert "another checkpoint" in msg and not marker.exists()
    dcp.load(trained()[1], checkpoint_id=str(tmp_path / "policy"), no_dist=True)  # torch's default planner: the payload is live
    assert marker.read_text() == "ran"


def test_a_payload_in_dcp_metadata_is_refused_without_running_it(tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    model = dcp_part(tmp_path / "policy")
    marker = tmp_path / "ran.txt"
    tamper_metadata(tmp_path / "policy", marker)
    with pytest.raises(ConfigError) as info:
        ckpt.read_dcp_metadata(tmp_path / "policy" / ".metadata")
    msg = one_line_user_error(info)
    assert str(tmp_path / "policy" / ".metadata") in msg and "pathlib.Path.write_text" in msg and "another checkpoint" in msg
    state = {"model": {k: torch.zeros_like(v) for k, v in model.state_dict().items()}}
    with pytest.raises((ConfigError, CheckpointException)):  # DCP wraps a reader's error
        dcp.load(state, storage_reader=ckpt.dcp_reader(tmp_path / "policy"), no_dist=True)
    with pytest.raises(ConfigError) as info:  # what the FSDP workers call: the one line
        ckpt.dcp_load(state, tmp_path / "policy", no_dist=True)
    assert str(tmp_path / "policy" / ".metadata") in one_line_user_error(info) and not marker.exists()
    dcp.FileSystemReader(str(tmp_path / "policy")).read_metadata()  # torch's own reader: the payload is live
    assert marker.read_text() == "ran"


def test_a_ray_fsdp_worker_refuses_a_payload_in_its_checkpoints_metadata_or_bytes_items(tmp_path):
    pytest.importorskip("ray")
    from test_grpo_recipe import load_recipe, small_config

    from rlkit.placement import build_policy
    from rlkit.ray_group import init_ray

    cfg = small_config(load_recipe("grpo"), tmp_path)
    cfg.system.scale_out.backend, cfg.system.scale_out.n_workers = "ray", 1
    marker = tmp_path / "ran.txt"
    init_ray(num_cpus=2)
    try:
        group = build_policy(cfg)
        try:
            group.save_checkpoint(tmp_path / "policy")
            group.load_checkpoint(tmp_path / "policy")  # an intact one loads
            shutil.copytree(tmp_path / "policy", tmp_path / "policy2")
            tamper_metadata(tmp_path / "policy", marker)
            with pytest.raises(ConfigError) as info:
                group.load_checkpoint(tmp_path / "policy")
            tamper_bytes_item(tmp_path / "policy2", marker)  # the optimizer's lr: the worker's dcp.load read it unpickled
            with pytest.raises(ConfigError) as info2:
                group.load_checkpoint(tmp_path / "policy2")
        finally:
            group.close()
    finally:
        import ray

        ray.shutdown()
    assert str(tmp_path / "policy" / ".metadata") in one_line_user_error(info) and not marker.exists()
    assert "the item optimizer.param_groups.0.lr holds more than tensors" in one_line_user_error(info2)


@pytest.mark.parametrize("resume", ["explicit", "auto"])
@pytest.mark.parametrize("where", [".metadata", "bytes item"])
def test_resume_refuses_a_checkpoint_whose_dcp_part_holds_a_payload(tmp_path, caplog, resume, where):
    marker = tmp_path / "ran.txt"
    root = tmp_path / "checkpoints"
    ckpt.save(root, 1, {"loader": {}}, CONFIG, parts={"policy": dcp_part})
    ckpt.save(root, 2, {"loader": {}}, CONFIG, parts={"policy": dcp_part})
    (tamper_metadata if where == ".metadata" else tamper_bytes_item)(root / "global_step_2" / "policy", marker)
    refresh_digests(root / "global_step_2")
    named = "global_step_2/policy/.metadata" if where == ".metadata" else "global_step_2/policy: the item optimizer.param_groups.0.lr"
    if resume == "auto":
        with caplog.at_level("WARNING"):
            assert ckpt.find_resume_path("auto", root) == root / "global_step_1"
        assert named in caplog.text
    else:
        with pytest.raises(ConfigError) as info:
            ckpt.find_resume_path(str(root / "global_step_2"), root)
        msg = one_line_user_error(info)
        assert msg.startswith(f"--trainer.resume {root / 'global_step_2'}: ") and named in msg and "left as is" in msg
    assert not marker.exists() and (root / "global_step_2/policy/.metadata").is_file()


class TorchSave:
    """Unpickling this calls torch.save("ran", marker): a torch function writing the marker file."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return torch.save, ("ran", self.marker)


@pytest.mark.parametrize("module", ["torch", "torch.serialization"])
def test_dcp_metadata_naming_a_torch_function_is_refused(tmp_path, module):
    """From torch the unpickler builds dtypes, memory formats and Size only: not torch.save (nor any other function)."""
    dcp_part(tmp_path / "policy")
    marker = tmp_path / "ran.txt"
    meta = pickle.loads((tmp_path / "policy" / ".metadata").read_bytes())
    meta.planner_data = {"x": TorchSave(marker)}
    data = pickle.dumps(meta, protocol=2)  # GLOBAL opcodes as text: name torch.save as `module`.save
    (tmp_path / "policy" / ".metadata").write_bytes(data.replace(b"ctorch.serialization\nsave\n", f"c{module}\nsave\n".encode()))
    with pytest.raises(ConfigError) as info:
        ckpt.read_dcp_metadata(tmp_path / "policy" / ".metadata")
    assert f"it names {module}.save," in one_line_user_error(info) and not marker.exists()


def test_a_bit_flip_in_a_dcp_shard_is_caught_by_its_digest_explicit_or_auto(tmp_path, caplog):
    root = tmp_path / "checkpoints"
    for step in (1, 2):
        ckpt.save(root, step, {"loader": {}}, CONFIG, parts={"policy": dcp_part})
    assert set(json.loads((root / "global_step_2" / ckpt.DIGESTS).read_text())) == {"policy/.metadata", "policy/__0_0.distcp"}
    shard = root / "global_step_2/policy/__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    with pytest.raises(ConfigError) as info:
        ckpt.find_resume_path(str(root / "global_step_2"), root)
    assert str(shard) in one_line_user_error(info) and "sha256" in str(info.value)
    with caplog.at_level("WARNING"):
        assert ckpt.find_resume_path("auto", root) == root / "global_step_1"
    assert shard.read_bytes() == bytes(data)  # refused, not repaired or removed


# -- explicit --trainer.resume PATH: the same checks as auto ---------------------------------------------------
def flip_a_tensor_bit(file):
    """Flip one bit inside a tensor record of a torch.save zip: torch.load reads it back silently, the CRC does not match."""
    with zipfile.ZipFile(file) as z:
        info = next(i for i in z.infolist() if "/data/" in i.filename and i.file_size >= 64)
    data = bytearray(file.read_bytes())
    name_len, extra_len = struct.unpack_from("<HH", data, info.header_offset + 26)  # the zip local header's lengths
    data[info.header_offset + 30 + name_len + extra_len + info.file_size // 2] ^= 0x10
    file.write_bytes(bytes(data))
    return bytes(data)


@pytest.mark.parametrize("damaged", ["state.pt", "policy/state.pt"])
def test_explicit_resume_refuses_a_bit_flipped_state_file_naming_it(tmp_path, damaged):
    parts = {"policy": lambda f: f.mkdir() or torch.save({"model": {"w": torch.arange(256.0)}}, f / "state.pt")}
    ckpt.save(tmp_path, 1, {"loader": {}, "w": torch.arange(256.0)}, CONFIG, parts=parts)
    file = tmp_path / "global_step_1" / damaged
    flipped = flip_a_tensor_bit(file)
    torch.load(file, weights_only=True)  # what made it silent: torch.load does not check the CRC
    with pytest.raises(ConfigError) as info:
        ckpt.find_resume_path(str(tmp_path / "global_step_1"), tmp_path)
    msg = one_line_user_error(info)
    assert f"cannot read {file}: its record" in msg and "fails its CRC" in msg and "resume from another checkpoint" in msg
    assert file.read_bytes() == flipped and ckpt.list_checkpoints(tmp_path) == [1]  # the user's checkpoint is left alone
    assert ckpt.find_resume_path("auto", tmp_path) is None  # auto agrees: nothing intact to resume from


@pytest.mark.parametrize("change", ["deleted", "emptied"])
def test_a_sharded_checkpoint_without_its_digests_is_refused_until_convert_records_them(tmp_path, caplog, change):
    """The trust rule: digests.json catches damage, not tampering (it sits in the folder it describes), so deleting it or
    an entry must not turn the check off: every DCP file must be listed; `convert` records missing digests on request."""
    path = ckpt.save(tmp_path, 1, {"loader": {}}, CONFIG, parts={"policy": dcp_part})
    if change == "deleted":
        (path / ckpt.DIGESTS).unlink()
    else:
        (path / ckpt.DIGESTS).write_text("{}")
    with pytest.raises(UserError) as info:
        ckpt.find_resume_path(str(path), tmp_path)
    msg = one_line_user_error(info)
    if change == "deleted":
        assert f"{path / ckpt.DIGESTS} is missing" in msg and f"python -m rlkit.checkpoint convert {path}" in msg
    else:
        assert f"{path / 'policy/.metadata'} is not listed in {path / ckpt.DIGESTS}" in msg
    with caplog.at_level("WARNING"):
        assert ckpt.find_resume_path("auto", tmp_path) is None
    assert ckpt.DIGESTS in caplog.text
    if change == "deleted":
        out = subprocess.run([sys.executable, "-m", "rlkit.checkpoint", "convert", str(path)], capture_output=True, text=True)
        assert out.returncode == 0 and str(path / ckpt.DIGESTS) in out.stdout, out.stderr  # what the line says to run
        assert ckpt.find_resume_path(str(path), tmp_path) == path


@pytest.mark.parametrize("damage", ["config.json cut short", "config.json missing", "shard missing"])
def test_explicit_resume_names_a_damaged_or_missing_file_in_one_line(tmp_path, damage):
    path = ckpt.save(tmp_path, 1, {"loader": {}}, CONFIG, parts={"policy": dcp_part})
    file = path / ("policy/__0_0.distcp" if damage == "shard missing" else "config.json")
    if damage == "config.json cut short":
        file.write_text(file.read_text()[:5])
    else:
        file.unlink()
    with pytest.raises(UserError) as info:
        ckpt.find_resume_path(str(path), tmp_path)
    assert str(file) in one_line_user_error(info) and "resume from another checkpoint" in str(info.value)


# -- Megatron engine's per-rank files ------------------------------------------------------------------------------
def megatron_worker(tmp_path, loaded):
    from rlkit.megatron_workers import MegatronActorRolloutRefWorker

    worker = object.__new__(MegatronActorRolloutRefWorker)  # its load path only: no process group, no model
    worker.rank, worker.world_size, worker.engine = 0, 1, types.SimpleNamespace(tp=1)
    worker.load_state_dict = loaded.append
    return worker


def test_megatron_checkpoint_loads_weights_only_and_refuses_a_payload(tmp_path):
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    state = {"model": dict(model.state_dict()), "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}
    torch.save({**state, "updates": 1, "world_size": 1, "tp_size": 1}, tmp_path / "rank0.pt")  # as save_checkpoint writes it
    loaded = []
    megatron_worker(tmp_path, loaded).load_checkpoint(tmp_path)
    assert torch.equal(loaded[0]["model"]["weight"], model.weight) and loaded[0]["updates"] == 1

    marker = tmp_path / "ran.txt"
    torch.save({**state, "updates": Boom(marker), "world_size": 1, "tp_size": 1}, tmp_path / "rank0.pt")
    with pytest.raises(ConfigError) as info:
        megatron_worker(tmp_path, loaded).load_checkpoint(tmp_path)
    assert str(tmp_path / "rank0.pt") in one_line_user_error(info) and "python -m rlkit.checkpoint convert" in str(info.value)
    assert not marker.exists() and len(loaded) == 1


# -- python -m rlkit.checkpoint convert ------------------------------------------------------------------------
def test_convert_refuses_a_payload_without_trust_this_file_and_changes_nothing(tmp_path):
    path = ckpt.save(tmp_path, 1, {"loader": {}}, CONFIG)
    marker = tmp_path / "ran.txt"
    torch.save({"step": 1, "rng": ckpt.rng_state(), "loader": {}, "evil": Boom(marker)}, path / "state.pt")
    before = (path / "state.pt").read_bytes()
    with pytest.raises(ConfigError) as info:
        ckpt.convert(path)
    msg = one_line_user_error(info)
    assert str(path / "state.pt") in msg and f"python -m rlkit.checkpoint convert --trust-this-file {path}" in msg
    out = subprocess.run([sys.executable, "-m", "rlkit.checkpoint", "convert", str(path)], capture_output=True, text=True)
    assert out.returncode == 1 and out.stderr.startswith("rlkit: error: ") and out.stderr.count("\n") == 1, out.stderr
    assert not marker.exists() and (path / "state.pt").read_bytes() == before and not list(path.glob("*.tmp"))
    help_text = subprocess.run([sys.executable, "-m", "rlkit.checkpoint", "convert", "-h"], capture_output=True, text=True).stdout
    assert "--trust-this-file" in help_text and "RUNS" in help_text


def test_convert_with_trust_this_file_loads_what_the_safe_path_refuses(tmp_path):
    import numpy as np

    path = ckpt.save(tmp_path, 1, {"loader": {}}, CONFIG)
    state = torch.load(path / "state.pt", weights_only=True)
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state["rng"]["numpy"] = (name, keys, pos, has_gauss, np.float64(cached))  # a numpy scalar: not in the safe allow-list
    torch.save(state, path / "state.pt")
    with pytest.raises(ConfigError, match="--trust-this-file"):
        ckpt.convert(path)
    out = subprocess.run(
        [sys.executable, "-m", "rlkit.checkpoint", "convert", "--trust-this-file", str(path)], capture_output=True, text=True
    )
    assert out.returncode == 0 and "converted 1 file" in out.stdout, out.stderr
    assert ckpt.load(path)[0]["rng"]["numpy"][1] == keys.tolist()  # now weights_only-loadable, the RNG state intact


# -- disk full -------------------------------------------------------------------------------------------------
@pytest.fixture
def tiny_disk(tmp_path):
    """A 1 MiB tmpfs at tmp_path/disk when this process may mount one (root), else skip: a real ENOSPC."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if (
        shutil.which("mount") is None
        or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk)], capture_output=True).returncode
    ):
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        yield disk
    finally:
        gc.collect()  # a failed torch.save's writer (held by the exception's frames) keeps its file open until collected
        if subprocess.run(["umount", str(disk)]).returncode:
            subprocess.run(["umount", "-l", str(disk)], check=True)


@pytest.mark.parametrize("writer", ["torch.save", "safetensors", "dcp"])
def test_a_real_full_disk_ends_with_the_documented_line_and_keeps_the_previous_checkpoint(tiny_disk, writer):
    from safetensors.torch import save_file

    ckpt.save(tiny_disk, 1, {"loader": {}}, CONFIG)
    big = torch.zeros(1 << 19)  # 2 MiB of float32 on a 1 MiB disk
    if writer == "torch.save":
        args = {"state": {"loader": {}, "w": big}}
    elif writer == "safetensors":  # the hf/ export
        args = {"state": {"loader": {}}, "save_hf": lambda f: f.mkdir() or save_file({"w": big}, str(f / "model.safetensors"))}
    else:  # an FSDP part: DCP raises its CheckpointException (a BaseException) holding the OSError

        def dcp_big(folder):
            import torch.distributed.checkpoint as dcp

            dcp.save({"w": big}, checkpoint_id=str(folder), no_dist=True)

        args = {"state": {"loader": {}}, "parts": {"policy": dcp_big}}
    with pytest.raises(RunFailed) as info:
        ckpt.save(tiny_disk, 2, config=CONFIG, **args)
    msg = one_line_user_error(info)
    assert msg.startswith(f"no space left on the device of {tiny_disk} while saving step 2") and "step 1 is kept" in msg
    assert not list(tiny_disk.glob(".tmp-*")) and ckpt.list_checkpoints(tiny_disk) == [1]
    assert (tiny_disk / "latest").read_text() == "1" and ckpt.find_resume_path("auto", tiny_disk) == tiny_disk / "global_step_1"


def test_the_exceptions_torch_and_safetensors_raise_on_a_full_disk_are_recognised(tmp_path, monkeypatch):
    from safetensors import SafetensorError

    # as measured on a full tmpfs: torch.save's says nothing of the cause (its context: basic_ios::clear), so free space decides
    torch_error = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: types.SimpleNamespace(total=1 << 20, used=1 << 20, free=0))
    assert ckpt._disk_full(torch_error, tmp_path)
    assert ckpt._disk_full(SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)"), tmp_path)
    assert ckpt._disk_full(OSError(errno.EDQUOT, "Disk quota exceeded"), tmp_path)
    assert not ckpt._disk_full(KeyError("policy"), tmp_path)  # a bug keeps its traceback even on a full disk
    monkeypatch.setattr(shutil, "disk_usage", lambda path: types.SimpleNamespace(total=1 << 40, used=0, free=1 << 40))
    assert not ckpt._disk_full(torch_error, tmp_path)  # the same RuntimeError with space left is a bug: traceback kept
