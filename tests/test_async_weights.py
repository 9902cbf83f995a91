"""The async weight hand-off (issue #23): without room in /dev/shm (Docker and Kubernetes default to 64 MB) the weights go
through a memory-mapped file; a worker that stores bf16 weights gets them in bf16 (half the bytes, bit-identical)."""

import tempfile
from pathlib import Path

import pytest
import torch
from test_grpo_recipe import load_recipe, read_jsonl, small_config

from rlkit import async_rollout
from rlkit.async_rollout import handoff_dtype, receive_weights, send_weights
from rlkit.config import ActorConfig, DataConfig, ModelConfig, ModelSystem, RolloutConfig, System
from rlkit.engine import TorchEngine, unpack_weights
from rlkit.workers import ActorRolloutRefWorker


def buffer(dtype=torch.float32, n=1000):
    return torch.randn(n, generator=torch.Generator().manual_seed(0)).to(dtype), [("w", (n,), 0)]


def test_weights_go_through_shared_memory_when_it_has_room(tmp_path, monkeypatch):
    monkeypatch.setattr(async_rollout, "shm_free_bytes", lambda: 2 * 4000)  # exactly twice the buffer: room
    flat, layout = buffer()
    payloads = send_weights(flat.clone(), layout, 3, [0, 1], str(tmp_path))
    assert [p[0] for p in payloads.values()] == ["shm", "shm"] and list(tmp_path.iterdir()) == []
    got, got_layout, version = receive_weights(payloads[1])
    assert got.is_shared() and torch.equal(got, flat) and (got_layout, version) == (layout, 3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weights_go_through_a_file_when_shared_memory_lacks_room(tmp_path, monkeypatch, dtype):
    """The failure it fixes: a 2 GB buffer in a 64 MB /dev/shm (SIGBUS, or 'No space left on device'); forced here by
    a free-space check that reports less than twice the buffer."""
    flat, layout = buffer(dtype)
    monkeypatch.setattr(async_rollout, "shm_free_bytes", lambda: 2 * flat.nbytes - 1)
    payloads = send_weights(flat.clone(), layout, 7, [0, 2], str(tmp_path))
    assert [p[0] for p in payloads.values()] == ["file", "file"]
    assert sorted(f.name[-3:] for f in tmp_path.iterdir()) == ["-w0", "-w2"]  # one link per worker, the original gone
    for w in (0, 2):
        got, got_layout, version = receive_weights(payloads[w])
        assert got.dtype == dtype and torch.equal(got, flat) and (got_layout, version) == (layout, 7)
    assert list(tmp_path.iterdir()) == []  # each worker removed its link: the bytes are freed


def test_bf16_hand_off_is_bit_identical_for_a_bf16_worker():
    """The generation worker's engine does not train: a full model is stored in the compute dtype, so bf16 weights sent
    are exactly what it kept of float32 ones (copy_ rounds to nearest-even, as .to(bfloat16) does)."""
    cfg, bf16 = ModelConfig(), ModelSystem(dtype="bfloat16")
    assert handoff_dtype(cfg, bf16, "cpu") == torch.bfloat16 and handoff_dtype(ModelConfig(), ModelSystem(), "cpu") == torch.float32
    assert handoff_dtype(ModelConfig(lora_rank=4), bf16, "cpu") == torch.float32  # peft's float32 adapters
    system = System(model=bf16)
    gen = ActorRolloutRefWorker(
        cfg, ActorConfig(), RolloutConfig(), DataConfig(), device="cpu", need_ref=False, trains=False, system=system
    )
    worker = gen.engine  # the generation worker's (async_rollout.Generator): no optimizer, no float32 masters
    assert {p.dtype for p in worker.model.parameters()} == {torch.bfloat16}
    trainer = ActorRolloutRefWorker(cfg, ActorConfig(use_kl_loss=False), RolloutConfig(), DataConfig(), device="cpu", system=system)
    assert trainer.engine.master_fp32
    with torch.no_grad():  # float32 masters off the bf16 grid, as after a few optimizer steps
        for p in trainer.engine.model.parameters():
            p.add_(torch.randn_like(p) * 1e-4)
    sent = {}
    for dtype in (torch.float32, torch.bfloat16):
        flat, layout = trainer.trainable_weights(dtype)
        assert flat.dtype == dtype
        unpack_weights(worker.model, flat, layout)
        sent[dtype] = [p.detach().clone() for p in worker.model.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(sent[torch.float32], sent[torch.bfloat16], strict=True))
    lora = TorchEngine(ModelConfig(lora_rank=4), None, "cpu", need_ref=False, model_sys=bf16)
    assert {p.dtype for n, p in lora.model.named_parameters() if "lora_" in n} == {torch.float32}


def test_one_step_off_run_through_the_file_fallback_equals_the_shared_memory_run(tmp_path, monkeypatch):
    """An async GRPO run whose weights go through files (no room in /dev/shm) trains exactly as the shared-memory run,
    and leaves no file behind."""
    grpo = load_recipe("grpo")
    rows = {}
    weight_dirs = lambda: set(Path(tempfile.gettempdir()).glob("rlkit-weights-*"))  # noqa: E731
    before = weight_dirs()  # (another run on this machine, or one killed earlier, may have its own)
    for name, free in (("shm", None), ("file", 0)):
        monkeypatch.setattr(async_rollout, "shm_free_bytes", lambda free=free: free)
        made = []

        def recording(*a, made=made, real=send_weights):
            made.append(real(*a))
            return made[-1]

        monkeypatch.setattr(async_rollout, "send_weights", recording)
        cfg = small_config(grpo, tmp_path / name, steps=3, save_freq=0, test_freq=0, val_before_train=False, async_steps=1)
        cfg.system.data.val_max_samples = 16
        grpo.main(cfg)
        assert {p[0] for payloads in made for p in payloads.values()} == {name}
        rows[name] = [
            {k: v for k, v in r.items() if not k.startswith(("timing/", "perf/", "async/wait"))}
            for r in read_jsonl(tmp_path / name / "metrics.jsonl")
        ]
        assert weight_dirs() <= before  # close() removed the folder this run made
    assert rows["file"] == rows["shm"]


@pytest.mark.parametrize("rollout", ["vllm", "hf"])
def test_the_trainer_returns_its_cached_cuda_blocks_before_a_vllm_worker_wakes(tmp_path, monkeypatch, rollout):
    """On one GPU the async worker's vLLM engine wakes on each hand-off and takes its KV cache back; the trainer (which
    otherwise keeps its caching allocator's unused blocks for ever) empties its cache first. CUDA emulated: the calls
    are recorded in order. An HF worker sizes its calls from a share of the free memory: the trainer keeps its cache."""
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    monkeypatch.setattr(async_rollout, "send_weights", lambda *a: calls.append("send") or {})

    class Policy:
        def trainable_weights(self, dtype=None):
            calls.append("pack")
            return buffer()

    r = object.__new__(async_rollout.Rollouts)
    r.actors, r.weights_dir, r.handoff_dtype, r.policy = [], str(tmp_path), None, Policy()
    r.worker_vllm = rollout == "vllm"
    r._pack_weights([0], 1)
    assert calls == (["empty_cache", "pack", "send"] if rollout == "vllm" else ["pack", "send"])
