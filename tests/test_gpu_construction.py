"""The GPU path made correct by construction (issue #23), checked on CPU: each test fails on the code before the fix.

Megatron's device placement, RNG seeding and grad norm; the token-budget micro-batch count agreed across ranks; flash-attn
chosen only if it imports, and packing kept with it (varlen); merged LoRA that keeps its delta and the adapter path under
FSDP; HF rollout log-probs without per-step full-vocabulary logits; log-prob + entropy passes within 2.6 U at a real
vocabulary; a bf16 KV cache under autocast; the packing mask built from segment ids.
"""

import os
import sys

import pytest
import torch
from test_packing import P, make_batch

from rlkit import algos, demos, packing
from rlkit.config import ActorConfig, DataConfig, DataSystem, ModelConfig, ModelSystem, RolloutConfig, RolloutSystem
from rlkit.engine import TorchEngine, load_tokenizer
from rlkit.protocol import DataProto
from rlkit.ray_group import free_port


def _spawn(target, n: int = 2, *args, timeout: float = 240):
    """Run target(rank, port, queue, *args) in n spawned gloo processes; their queue items, sorted. Processes that have
    not answered within `timeout` seconds (a hang in a collective) are killed and the test fails."""
    import queue

    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    out, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_guarded, args=(target, r, port, out, *args)) for r in range(n)]
    for p in procs:
        p.start()
    try:
        results = sorted((out.get(timeout=timeout) for _ in procs), key=lambda x: x[0])
    except queue.Empty:
        results = None
    for p in procs:
        p.join(timeout=60 if results else 1)
        if p.is_alive():
            p.kill()
    assert results is not None, f"the {n} processes did not all answer within {timeout} s (a hang)"
    failed = [r for r in results if len(r) == 3 and r[1] == "error"]
    assert not failed, failed[0][2]
    return results


def _guarded(target, rank, port, out, *args):
    """target in a child process; its traceback goes to the queue (the test fails at once, not at the queue's timeout)."""
    try:
        target(rank, port, out, *args)
    except BaseException:
        import traceback

        out.put((rank, "error", traceback.format_exc()))


def _join(rank: int, port: int, world: int = 2):
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)


# ----------------------------------------------------------------------------- a. Megatron on CUDA


def test_megatron_hands_the_rollout_and_optimizer_tensors_on_the_engine_device_and_seeds_its_rng(monkeypatch):
    """On a non-default device (meta, standing in for cuda:0), every tensor the Megatron worker gives HFRollout and AdamW
    is on the engine's device, and Megatron's RNG tracker is seeded with the worker's seed (its attention's fork() needs it)."""
    pytest.importorskip("megatron.core")
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    from rlkit.megatron_workers import MegatronActorRolloutRefWorker

    seeds = []
    real = tensor_parallel.model_parallel_cuda_manual_seed
    monkeypatch.setattr(tensor_parallel, "model_parallel_cuda_manual_seed", lambda s, **kw: seeds.append(s) or real(s, **kw))
    try:
        w = MegatronActorRolloutRefWorker(
            ModelConfig(),
            ActorConfig(use_kl_loss=False),
            RolloutConfig(),
            DataConfig(),
            device="meta",
            seed=5,
            rank=0,
            world_size=1,
            master_addr="127.0.0.1",
            master_port=free_port(),
        )
        dev = w.engine.device
        assert dev.type == "meta"
        assert w.rollout.device == dev and {p.device for p in w.rollout.model.parameters()} == {dev}  # HFRollout's ids meet its weights
        assert {p.device for g in w.engine.optimizer.param_groups for p in g["params"]} == {dev}
        assert seeds == [5]
    finally:
        ps.destroy_model_parallel()
        if dist.is_initialized():
            dist.destroy_process_group()


def test_megatron_grad_norm_stays_on_the_gradients_device(monkeypatch):
    """clip_grad_norm on meta gradients (CUDA's stand-in): the norm is built on their device, no CPU scalar mixed in."""
    pytest.importorskip("megatron.core")
    from rlkit import megatron_workers
    from rlkit.megatron_workers import MegatronEngine

    class OneProcess:  # the collectives of a group of one
        ReduceOp = torch.distributed.ReduceOp

        @staticmethod
        def get_world_size(group=None):
            return 1

        @staticmethod
        def all_reduce(t, op=None, group=None):
            return None

    monkeypatch.setattr(megatron_workers, "dist", OneProcess)
    eng = object.__new__(MegatronEngine)
    eng.device, eng.dp_group, eng.tp_group = torch.device("meta"), None, None
    params = [torch.nn.Parameter(torch.empty(3, 4, device="meta")) for _ in range(2)]
    params[0].tensor_model_parallel = True  # one sharded, one replicated weight
    for p in params:
        p.grad = torch.empty_like(p)
    norm = eng.clip_grad_norm(params, 1.0)
    assert norm.device.type == "meta" and norm.shape == ()


# ----------------------------------------------------------------------------- b. token budget under FSDP: no hang


def _packed_tokens(mb) -> int:
    """A micro-batch's cost: its real tokens in the packed layout, each run of rows with one prompt paying it once."""
    ids, attn = mb["input_ids"], mb["attention_mask"]
    new_prompt = [i == 0 or not torch.equal(ids[i, :P], ids[i - 1, :P]) for i in range(len(mb))]
    return int(attn[:, P:].sum()) + sum(int(attn[i, :P].sum()) for i in range(len(mb)) if new_prompt[i])


def _budget_counts(rank: int, port: int, out):
    _join(rank, port)
    import torch.distributed as dist

    eng = object.__new__(TorchEngine)  # micro_batches needs only the layout settings
    eng.max_tokens, eng.remove_padding, eng.share_prompt = 20, True, True
    batch = make_batch(50, seed=rank)  # 9 rows (3 prompts x 3) on each rank
    if rank == 1:  # rank 1's responses are 1 token: its rows fit in fewer micro-batches
        batch["attention_mask"][:, P + 1 :] = 0
    spans = packing.split_by_tokens(batch["input_ids"], batch["attention_mask"], P, True, 20)
    mbs = eng.micro_batches(batch, 0)
    at = sum(len(mb) for mb in mbs)
    bounds = [_packed_tokens(mb) for mb in mbs]
    out.put((rank, len(spans), len(mbs), at, max(bounds)))
    dist.destroy_process_group()


def test_token_budget_micro_batch_count_is_agreed_across_ranks():
    (r0, own0, n0, rows0, cost0), (r1, own1, n1, rows1, cost1) = _spawn(_budget_counts)
    assert own0 != own1  # on their own the ranks would run different numbers of passes (the hang)
    assert n0 == n1 == max(own0, own1)  # agreed: the largest count
    assert rows0 == rows1 == 9  # every row in exactly one micro-batch
    assert max(cost0, cost1) <= 20  # and each still within the budget


def test_split_to_count_keeps_rows_in_order_and_within_the_budget():
    b = make_batch(50)
    costs = packing.row_costs(b["input_ids"], b["attention_mask"], P, True)
    spans = packing.split_by_tokens(b["input_ids"], b["attention_mask"], P, True, 20)
    for count in range(len(spans), len(b) + 1):
        got = packing.split_to_count(spans, costs, count)
        assert len(got) == count and got[0][0] == 0 and got[-1][1] == len(b)
        assert all(a < c and c == d for (a, c), (d, _) in zip(got, got[1:] + [(got[-1][1], None)]))
        assert max(packing.span_cost(costs, a, c) for a, c in got) <= max(
            20, max(packing.span_cost(costs, i, i + 1) for i in range(len(b)))
        )
    with pytest.raises(RuntimeError):
        packing.split_to_count(spans, costs, len(b) + 1)


# ----------------------------------------------------------------------------- c. LoRA sync keeps the delta


def test_merged_lora_is_merged_in_float32_and_cast_once(tmp_path):
    """bf16 base, a delta ~4e-4 |W|: hf_weights yields float32 W + dW, and the folder sync writes bf16(W + dW) exactly
    (one rounding), not bf16(W + bf16(dW)) summed in bf16."""
    from safetensors.torch import load_file

    from rlkit.vllm_rollout import VLLMRollout, hf_weights

    eng = TorchEngine(ModelConfig(lora_rank=4), ActorConfig(), device="cpu", model_sys=ModelSystem(dtype="bfloat16"))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for n, p in eng.model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 1e-4)
    base = eng.model.get_base_model()
    name = "model.layers.0.self_attn.q_proj"
    layer = base.get_submodule(name)
    w = layer.base_layer.weight.detach()
    dw = layer.get_delta_weight("default").detach().float()
    assert w.dtype == torch.bfloat16 and 1e-5 < (dw.abs().mean() / w.float().abs().mean()) < 1e-2
    got = dict(hf_weights(eng.model))[name + ".weight"]
    assert got.dtype == torch.float32
    assert torch.equal(got, w.float() + dw)  # the delta whole, before vLLM's one cast

    class Folder:  # an engine in another process: reads the folder the sync writes
        def collective_rpc(self, method, kwargs):
            self.state = load_file(os.path.join(kwargs["weights_path"], "model.safetensors"))

        def reset_prefix_cache(self):
            pass

    r = object.__new__(VLLMRollout)
    r.llm, r.sleep_mode, r.sleeping, r.syncs, r.lora_request, r.model, r.dtype = Folder(), False, set(), 0, None, eng.model, torch.bfloat16
    r.vlm = False
    r._worker = lambda: None
    r.sync_weights()
    synced = r.llm.state[name + ".weight"]
    assert synced.dtype == torch.bfloat16 and torch.equal(synced, (w.float() + dw).to(torch.bfloat16))
    # the tied output embedding is written too (vLLM's reload wants it): it shares the input one's storage, which
    # a dedupe on data_ptr took for a duplicate and left out
    assert torch.equal(r.llm.state["lm_head.weight"], r.llm.state["model.embed_tokens.weight"])


def _fsdp_adapter(rank: int, port: int, out, folder):
    _join(rank, port)
    import torch.distributed as dist
    from peft import PeftModel

    from rlkit.fsdp_workers import shard
    from rlkit.vllm_rollout import adapter_state, lora_adapter_plan

    torch.manual_seed(0)
    eng = TorchEngine(ModelConfig(lora_rank=4), None, device="cpu", wrap=shard)
    with torch.no_grad():
        for n, p in eng.model.named_parameters():
            if "lora_B" in n:
                p.fill_(1e-4)  # a DTensor: each process fills its shard
    plan = lora_adapter_plan(eng.model, True)
    state = adapter_state(eng.model)  # a collective
    whole = {k: v.clone() for k, v in state.items()}
    if rank == 0:
        eng.model.save_pretrained(folder, state_dict=state)
    dist.barrier()
    back = {}
    if rank == 0:
        from transformers import AutoModelForCausalLM

        loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(demos.ARITH_MODEL), folder)
        back = {k: v.detach().clone() for k, v in loaded.named_parameters() if "lora_" in k}
    out.put(
        (
            rank,
            plan,
            {k: (tuple(v.shape), float(v.abs().sum())) for k, v in whole.items()},
            {k: float(v.abs().sum()) for k, v in back.items()},
        )
    )
    dist.destroy_process_group()


def test_fsdp_lora_goes_to_vllm_as_the_adapter_gathered_whole(tmp_path):
    """Under FSDP the adapter is no longer forced into a bf16 merge: lora_adapter_plan accepts the sharded model, and
    adapter_state gathers each LoRA weight whole, which peft saves and loads back unchanged."""
    (_, plan0, whole0, back), (_, plan1, whole1, _) = _spawn(_fsdp_adapter, 2, str(tmp_path / "adapter"))
    assert plan0 == plan1 == (8, None)  # rank 4 -> vLLM's max_lora_rank 8, no reason to merge
    assert whole0 == whole1 and whole0
    full_b = {k: v for k, v in whole0.items() if "lora_B" in k}
    for shape, total in full_b.values():
        assert total == pytest.approx(1e-4 * torch.Size(shape).numel(), rel=1e-3)  # whole, not one process's shard
    assert set(back) == set(whole0) and all(back[k] == pytest.approx(whole0[k][1], rel=1e-6) for k in back)


# ----------------------------------------------------------------------------- d. flash-attn


def _fake_flash_attn(root, body: str):
    pkg = root / "flash_attn"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(body)
    return str(root)


@pytest.mark.parametrize(
    "body, want",
    [
        ("raise ImportError('flash_attn_2_cuda.so: undefined symbol: _ZN3c10')", "sdpa"),  # an ABI-mismatched wheel
        ("", "sdpa"),  # no kernel symbol
        ("def flash_attn_varlen_func(*a, **k):\n    pass\n", "flash_attention_2"),
    ],
    ids=["broken", "no-kernel", "works"],
)
def test_flash_attn_is_chosen_only_when_it_imports(tmp_path, monkeypatch, body, want):
    from rlkit.engine import resolve_attn_implementation

    monkeypatch.syspath_prepend(_fake_flash_attn(tmp_path, body))
    monkeypatch.delitem(sys.modules, "flash_attn", raising=False)
    with pytest.warns(UserWarning, match="flash-attn is installed but unusable") if want == "sdpa" else _no_warning():
        assert resolve_attn_implementation("auto", torch.device("cuda")) == want
    assert resolve_attn_implementation("auto", torch.device("cpu")) == "sdpa"


class _no_warning:
    def __enter__(self):
        import warnings

        self.ctx = warnings.catch_warnings()
        self.ctx.__enter__()
        warnings.simplefilter("error")

    def __exit__(self, *exc):
        return self.ctx.__exit__(*exc)


def test_flash_attention_keeps_packing_varlen_and_gives_the_padded_log_probs(monkeypatch):
    """With flash_attention_2 the passes stay padding-free: sequences end to end in one row, no mask, position ids
    restarting at 0 (what flash-attn's varlen path reads; sdpa reads the same layout on CPU), without a shared prompt."""
    from rlkit import engine as engine_mod

    real = engine_mod.load_model
    monkeypatch.setattr(engine_mod, "load_model", lambda *a: real(*a[:5], "sdpa"))  # CPU: the kernel sdpa, the layout flash's
    eng = TorchEngine(ModelConfig(), None, device="cpu", model_sys=ModelSystem(attn_implementation="flash_attention_2"))
    assert eng.remove_padding and eng.varlen and not eng.share_prompt
    seen = []
    hook = eng.model.register_forward_pre_hook(
        lambda m, a, kw: seen.append((kw["attention_mask"], kw["input_ids"].shape[0])), with_kwargs=True
    )
    batch = make_batch(eng.model.config.vocab_size)
    lp, ent = eng.compute_log_prob(batch, 0.7, len(batch), with_entropy=True)
    hook.remove()
    assert seen == [(None, 1)]  # one row, no mask
    eng.remove_padding, eng.varlen = False, False
    want_lp, want_ent = eng.compute_log_prob(batch, 0.7, len(batch), with_entropy=True)
    real_tokens = batch["attention_mask"][:, P:].bool()
    # float32, the same sums in another order: ~1e-6 per token (tests/test_packing.py's tolerance)
    assert (lp - want_lp)[real_tokens].abs().max() < 1e-4 and (ent - want_ent)[real_tokens].abs().max() < 1e-4


# ----------------------------------------------------------------------------- e. memory by construction


def test_token_logprob_entropy_equals_log_softmax_and_its_gradient(monkeypatch):
    monkeypatch.setattr(algos, "LOGITS_CHUNK_BYTES", 8 * 7 * 3)  # float64: 3 positions a chunk, 10 positions
    z = torch.randn(10, 7, dtype=torch.float64, requires_grad=True)
    z.data[2, 3] = float("-inf")  # a masked vocabulary entry: p = 0, no NaN
    pos, lab = torch.tensor([0, 0, 3, 9, 5, 5, 2]), torch.tensor([1, 2, 3, 4, 5, 6, 0])
    for t in (1.0, 0.7):
        lp, ent = algos.token_logprob_entropy(z, pos, lab, t, True)
        torch.testing.assert_close(lp, torch.log_softmax(z / t, -1)[pos, lab], rtol=0, atol=1e-12)
        torch.testing.assert_close(ent, algos.entropy_from_logits(z / t), rtol=0, atol=1e-12)
    zf = z.detach().clone().fill_diagonal_(0.0).requires_grad_()  # gradcheck on finite logits
    assert torch.autograd.gradcheck(lambda x: algos.token_logprob_entropy(x, pos, lab, 0.7, True), (zf,))
    assert torch.autograd.gradcheck(lambda x: algos.token_logprob_entropy(x, pos, lab, 1.0, False)[0], (zf,))
    lp, ent = algos.token_logprob_entropy(z, pos, lab, 1.0, True)
    (lp.sum() + ent.sum()).backward()
    assert torch.isfinite(z.grad).all() and (z.grad[2, 3] == 0)


QWEN_VOCAB = 151_936


@pytest.fixture(scope="module")
def real_vocab_model(tmp_path_factory):
    """A 1-layer Qwen2 with hidden size 16 and Qwen's vocabulary: the logits dominate memory, as in a real model's LM head."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    path = tmp_path_factory.mktemp("real-vocab")
    c = Qwen2Config(
        vocab_size=QWEN_VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1
    )
    c.tie_word_embeddings = True
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(c).save_pretrained(path)
    load_tokenizer(str(demos.ARITH_MODEL)).save_pretrained(path)
    return str(path)


def long_batch(vocab: int, groups: int = 4, n: int = 2, p: int = 8, r: int = 32) -> DataProto:
    """groups x n rows: prompts of p tokens (one left-padded by 2), responses of r/2..r tokens, right-padded."""
    g = torch.Generator().manual_seed(0)
    ids, attn = torch.zeros(groups * n, p + r, dtype=torch.long), torch.zeros(groups * n, p + r, dtype=torch.long)
    for gi in range(groups):
        plen = p - 2 * (gi == 0)
        prompt = torch.randint(3, vocab, (plen,), generator=g)
        for j in range(n):
            row, rlen = gi * n + j, int(torch.randint(r // 2, r + 1, (1,), generator=g))
            ids[row, p - plen : p], attn[row, p - plen : p + rlen] = prompt, 1
            ids[row, p : p + rlen] = torch.randint(3, vocab, (rlen,), generator=g)
    return DataProto.from_dict(
        {
            "prompts": ids[:, :p],
            "responses": ids[:, p:],
            "response_mask": attn[:, p:].clone(),
            "input_ids": ids,
            "attention_mask": attn,
            "position_ids": (attn.cumsum(-1) - 1).clamp(min=0),
        }
    )


def _peak_bytes(fn) -> int:
    """Peak bytes of the tensors allocated while fn runs (torch's MemTracker: every tensor's storage, on CPU too)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    mt = MemTracker()
    with mt:
        fn()
    return mt.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]


@pytest.mark.parametrize("entropy", [False, True], ids=["log-prob", "log-prob+entropy"])
def test_log_prob_passes_peak_within_2_6_U_at_a_real_vocabulary(real_vocab_model, entropy):
    """U = one float32 copy of the logits read (positions x V x 4 bytes). The no-grad pass and the forward + backward of
    the update each peak at <= 2.6 U (measured: 1.3 U and 2.1-2.2 U; before: 2.1 / 5.1 U and 4.0 / 8.0 U without / with entropy).
    The tracker counts tensor storages (not the allocator's cache), so the numbers are the same on every CPU."""
    eng = TorchEngine(ModelConfig(path=real_vocab_model), ActorConfig(), device="cpu")
    batch = long_batch(QWEN_VOCAB)
    sizes = []
    hook = eng.model.lm_head.register_forward_hook(lambda m, i, o: sizes.append(o.numel()))
    eng.compute_log_prob(batch, 0.7, len(batch))
    hook.remove()
    U = max(sizes) * 4  # the logits the LM head computes (rows x positions read x V), as float32
    assert U > 100 * 2**20  # the logits dominate: the weights (2.4M x 4 bytes, and their gradient) are < 0.1 U

    def update_pass():
        lp, ent = eng.forward(eng.model, batch, 0.7, entropy)
        loss = -(lp.sum() + (0.01 * ent.sum() if entropy else 0))
        loss.backward()
        eng.model.zero_grad(set_to_none=True)

    no_grad = _peak_bytes(lambda: eng.compute_log_prob(batch, 0.7, len(batch), with_entropy=entropy))
    update = _peak_bytes(update_pass)
    assert no_grad <= 2.6 * U, no_grad / U
    assert update <= 2.6 * U, update / U


def test_hf_rollout_log_probs_are_recorded_step_by_step_without_the_logits_stack(monkeypatch):
    from rlkit.data import build_prompts
    from rlkit.rollout import HFRollout

    eng = TorchEngine(ModelConfig(), None, device="cpu")
    rows = build_prompts(DataConfig().train_files, eng.tokenizer, DataConfig(), DataSystem(), max_samples=4).batch(
        [0, 1, 2, 3], eng.tokenizer.pad_token_id
    )
    rows = rows.repeat(2)  # groups of 2: the shared prefill path too
    seen = []
    generate = eng.model.generate
    monkeypatch.setattr(eng.model, "generate", lambda **kw: seen.append(kw) or generate(**kw))
    torch.manual_seed(0)
    got = HFRollout(eng.model, eng.tokenizer, eng.device, impl="generate").generate(rows, 12, temperature=0.8, return_log_probs=True)
    assert not any(kw.get("output_logits") or kw.get("output_scores") for kw in seen)  # no (steps, B, V) stack
    # what the old code computed: every step's logits stacked, then log_softmax(z / T)[y]
    torch.manual_seed(0)
    ids, mask = rows["input_ids"], rows["attention_mask"]
    rollout = HFRollout(eng.model, eng.tokenizer, eng.device)
    cache = rollout.shared_prefill(ids, mask)
    from rlkit.rollout import NEUTRAL_SAMPLING

    out = generate(
        input_ids=ids,
        attention_mask=mask,
        past_key_values=cache,
        return_dict_in_generate=True,
        output_logits=True,
        do_sample=True,
        max_new_tokens=12,
        temperature=0.8,
        top_p=1.0,
        top_k=None,
        eos_token_id=rollout.eos,
        pad_token_id=eng.tokenizer.pad_token_id,
        **NEUTRAL_SAMPLING,
    )
    width = len(out.logits)
    assert torch.equal(
        got["responses"][:, :width],
        torch.where(
            got["response_mask"][:, :width].bool(), out.sequences[:, -width:], 0 * out.sequences[:, -width:] + eng.tokenizer.pad_token_id
        ),
    )
    want = algos.logprobs_from_logits(torch.stack(out.logits, 1).float() / 0.8, out.sequences[:, -width:]) * got["response_mask"][:, :width]
    # the same float32 logits, log-softmax over V in another batch shape: a few float32 ulps of |log p| < 20
    torch.testing.assert_close(got["rollout_log_probs"][:, :width], want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("impl", ["fast", "generate"])
def test_hf_generation_kv_cache_is_in_the_compute_dtype_under_autocast(impl):
    from rlkit.workers import make_rollout

    eng = TorchEngine(ModelConfig(), ActorConfig(), device="cpu", model_sys=ModelSystem(dtype="bfloat16"))
    assert eng.master_fp32
    rollout = make_rollout(eng, RolloutSystem(hf_impl=impl), DataConfig(), str(demos.ARITH_MODEL), 0)
    caches = []  # the cache every forward of the generation reads and fills
    eng.model.register_forward_pre_hook(lambda m, a, kw: caches.append(kw["past_key_values"]), with_kwargs=True)
    ids = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
    prompts = DataProto.from_dict({"input_ids": ids, "attention_mask": torch.ones_like(ids), "position_ids": torch.arange(4).repeat(2, 1)})
    rollout.generate(prompts, 4, temperature=0)
    assert {layer.keys.dtype for layer in caches[0].layers} == {torch.bfloat16}  # not the float32 masters' dtype


# ----------------------------------------------------------------------------- f. the packing mask from segment ids


def _mask_by_hand(seg: torch.Tensor, sub: torch.Tensor) -> torch.Tensor:
    """The definition, one pair at a time: i sees j iff same segment, j <= i, and j is the prompt or i's own response."""
    rows, c = seg.shape
    m = torch.zeros(rows, c, c, dtype=torch.bool)
    for r in range(rows):
        for i in range(c):
            for j in range(c):
                same = seg[r, i] == seg[r, j] and seg[r, i] >= 0 and j <= i and (sub[r, j] == 0 or sub[r, j] == sub[r, i])
                m[r, i, j] = bool(same) or i == j
    return m


@pytest.mark.parametrize("share", [True, False])
def test_packing_mask_is_built_from_segment_ids(share):
    b = make_batch(50)
    p = packing.pack(b["input_ids"], b["attention_mask"], b["position_ids"], P, share)
    assert p.segment_ids.shape == p.input_ids.shape == p.sub_ids.shape  # (rows, C) ids travel, not a (rows, C, C) mask
    mask = packing.block_mask(p.segment_ids, p.sub_ids)
    assert torch.equal(mask, _mask_by_hand(p.segment_ids, p.sub_ids))
    assert torch.equal(p.attention_mask[:, 0], mask)


# -- HF generation rows per call from the KV cache they take ---------------------------------------------------------


def test_generation_rows_follow_the_kv_cache_of_a_qwen2_5_0_5b_shaped_model():
    """rollout.generation_rows on fixed numbers, by hand (Qwen2.5-0.5B: 24 layers, 2 KV heads of 64, hidden 896,
    intermediate 4864, V 151,936), bf16, P = R = 512: kv = 2*24*2*64*2 = 12,288 B a token; act = (3*4864 + 4*896)*2 =
    36,352 B a prompt token; logits 151,936 * 14 = 2,127,104 B; per row 1024*12,288 + 512*36,352 + 2,127,104 = 33,322,240 B."""
    from transformers import Qwen2Config

    from rlkit.rollout import generation_rows

    qwen = Qwen2Config(
        vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2
    )
    per_row = 1024 * 12288 + 512 * 36352 + 151936 * 14
    assert per_row == 33_322_240
    assert generation_rows(qwen, 512, 512, torch.bfloat16, 20 * 2**30) == 20 * 2**30 // per_row == 644  # 10x the old 64
    assert generation_rows(qwen, 512, 512, torch.bfloat16, 8 * 2**30) == 257  # a 24 GB GPU with a full fine-tune's state
    f32 = 1024 * 24576 + 512 * 72704 + 151936 * 16  # float32: kv and act double, logits V * (4 + 12)
    assert generation_rows(qwen, 512, 512, torch.float32, 20 * 2**30) == 20 * 2**30 // f32 == 331
    assert generation_rows(qwen, 2048, 2048, torch.bfloat16, 2**20) == 1  # never 0 rows


def test_hf_generation_rows_come_from_free_memory_on_cuda_and_stay_on_cpu(monkeypatch):
    """--rollout.micro-batch-size 0: on CPU the old rule (all rows for a tiny model, 64 for a real one); on CUDA the KV
    rule on this batch's prompt width + max response length in half the free memory; a set value wins everywhere."""
    from rlkit import workers
    from rlkit.data import build_prompts
    from rlkit.workers import ActorRolloutRefWorker

    data = DataConfig()
    worker = ActorRolloutRefWorker(ModelConfig(), ActorConfig(), RolloutConfig(), data, device="cpu")
    prompts = build_prompts(data.train_files, worker.tokenizer, data, DataSystem()).batch(list(range(4)), worker.tokenizer.pad_token_id)
    assert worker.generation_rows(prompts) is None  # CPU, tiny model: one call, as before
    asked = []
    monkeypatch.setattr(workers, "free_device_memory", lambda device: 40 * 2**30)
    monkeypatch.setattr(workers, "generation_rows", lambda config, p, r, dtype, budget: asked.append((p, r, dtype, budget)) or 123)
    worker.engine.device = torch.device("cuda")  # the decision only: nothing runs on the device
    assert worker.generation_rows(prompts) == 123
    assert asked == [(prompts["input_ids"].shape[1], data.max_response_length, torch.float32, 20 * 2**30)]
    worker.rollout_sys = RolloutSystem(micro_batch_size=16)
    worker.gen_micro_batch = 16
    assert worker.generation_rows(prompts) == 16 and len(asked) == 1


def test_flash_attn_is_not_chosen_for_float32_compute(tmp_path, monkeypatch):
    """N4 (issue #36): FlashAttention refuses float32 inputs, so with flash-attn importable, float32 compute on CUDA
    (--model.dtype float32; the Megatron engine's HF generation copy, float32 throughout) must get sdpa; bf16 and fp16
    get flash_attention_2."""
    from rlkit.engine import resolve_attn_implementation

    monkeypatch.syspath_prepend(_fake_flash_attn(tmp_path, "def flash_attn_varlen_func(*a, **k):\n    pass\n"))
    monkeypatch.delitem(sys.modules, "flash_attn", raising=False)
    cuda = torch.device("cuda")
    assert resolve_attn_implementation("auto", cuda, torch.float32) == "sdpa"
    assert resolve_attn_implementation("auto", cuda, torch.bfloat16) == "flash_attention_2"
    assert resolve_attn_implementation("auto", cuda, torch.float16) == "flash_attention_2"
    assert resolve_attn_implementation("flash_attention_2", cuda, torch.float32) == "flash_attention_2"  # as asked


# ----------------------------------------------------------------------------- d. FSDP: one model call per packed row, agreed


def _model_calls(rank: int, port: int, out):
    _join(rank, port)
    import torch.distributed as dist

    from rlkit.fsdp_workers import shard

    torch.manual_seed(0)
    eng = TorchEngine(ModelConfig(), None, device="cpu", wrap=shard)
    eng.share_prompt, eng.union_logits_bytes = False, 0 if rank == 0 else 2**28  # rank 0 alone: its packed rows one by one
    batch = make_batch(eng.model.config.vocab_size)
    batch = batch if rank == 0 else batch[:3]  # rank 1: fewer packed rows than rank 0's calls
    calls = []
    eng.model.register_forward_pre_hook(lambda m, a: calls.append(1))
    lp, _ = eng.forward(eng.model, batch, 1.0, False)
    lp.sum().backward()  # the backward gathers again, once per call
    out.put((rank, len(calls), lp.tolist()))
    dist.destroy_process_group()


def test_fsdp_ranks_agree_on_one_model_call_per_packed_row():
    """Each FSDP model call all-gathers every layer: a rank splitting its packed rows into one call each while the other
    makes one call would leave the ranks in different collectives (a hang). The split is agreed: same call counts."""
    (_, calls0, lp0), (_, calls1, lp1) = _spawn(_model_calls, 2, timeout=120)
    assert calls0 == calls1 > 1
    assert torch.allclose(torch.tensor(lp0[:3]), torch.tensor(lp1), atol=1e-5)  # the same rows' log-probs, whatever the split


# ----------------------------------------------------------------------------- e. whole weights into FSDP shards


def _fsdp_load_weights(rank: int, port: int, out):
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from rlkit.engine import pack_weights
    from rlkit.fsdp_workers import FSDPActorRolloutRefWorker

    os.environ["OMP_NUM_THREADS"] = "1"
    kw = dict(rank=rank, world_size=2, master_addr="127.0.0.1", master_port=port)
    w = FSDPActorRolloutRefWorker(ModelConfig(), ActorConfig(use_kl_loss=False), RolloutConfig(), DataConfig(), device="cpu", **kw)
    torch.manual_seed(1)
    flat, layout = pack_weights(AutoModelForCausalLM.from_config(w.engine.model.config).named_parameters())
    w.load_weights(flat, layout)  # what recipes/sft.py --init-from-scratch calls on every worker
    got = w.trainable_weights()  # gathered back from the shards (rank 0)
    out.put((rank, got is None or torch.equal(got[0], flat)))
    dist.destroy_process_group()


def test_fsdp_workers_load_whole_weights_into_their_shards():
    """load_weights on FSDP workers (the worker interface recipes/sft.py --init-from-scratch uses, on Ray too): each
    process keeps its shard of the given weights, and gathering them back gives them exactly."""
    assert [ok for _, ok in _spawn(_fsdp_load_weights, 2, timeout=180)] == [True, True]


# ----------------------------------------------------------------------------- f. full-weight FSDP -> vLLM sync


def _fsdp_folder_sync(rank: int, port: int, out):
    _join(rank, port)
    import torch.distributed as dist
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from rlkit import vllm_rollout
    from rlkit.fsdp_workers import shard

    eng = TorchEngine(ModelConfig(), None, device="cpu", wrap=shard)  # float32 masters; the embedded model ties its embeddings
    gathered, real = [], vllm_rollout._full
    vllm_rollout._full = lambda t: (gathered.append(t.dtype) if hasattr(t, "full_tensor") else None) or real(t)

    class Folder:  # an engine in another process (FSDP workers' vLLM): reads the folder the sync writes
        def collective_rpc(self, method, kwargs):
            self.state = load_file(os.path.join(kwargs["weights_path"], "model.safetensors"))

        def reset_prefix_cache(self):
            pass

    r = object.__new__(vllm_rollout.VLLMRollout)
    r.llm, r.sleep_mode, r.sleeping, r.syncs, r.lora_request, r.model, r.dtype = Folder(), False, set(), 0, None, eng.model, torch.bfloat16
    r.vlm, r._worker = False, lambda: None
    r.sync_weights()
    vllm_rollout._full = real
    whole = get_model_state_dict(eng.model, options=StateDictOptions(full_state_dict=True))
    whole.setdefault("lm_head.weight", whole["model.embed_tokens.weight"])  # tied: listed once here
    sent = r.llm.state
    wrong = [k for k in whole if not (k in sent and torch.equal(sent[k], whole[k].to(torch.bfloat16)))]
    out.put((rank, sorted(map(str, set(gathered))), sorted(set(sent) - set(whole)), wrong))
    dist.destroy_process_group()


def test_fsdp_full_weight_sync_gathers_bf16_shards():
    """The folder sync of FSDP workers (full fine-tuning, vLLM in a child process): each float32 shard is cast to vLLM's
    bf16 before its all-gather (half the traffic; it gathered float32), and the file holds every weight as bf16, the
    tied output embedding too (vLLM's reload fails a layer without its weight)."""
    for _, dtypes, extra, wrong in _spawn(_fsdp_folder_sync, 2, timeout=180):
        assert dtypes == ["torch.bfloat16"] and extra == [] and wrong == []


def test_fsdp_vllm_sync_gathers_tensor_by_tensor_without_unsharding_the_model(monkeypatch):
    """The FSDP workers' vLLM sync used to unshard every layer in bf16 first (_full_weights), then read state_dict(),
    which FSDP2 hands back sharded anyway: a whole bf16 copy of the model for nothing. The sync now goes straight to
    the tensor-by-tensor gathers (vllm_rollout.hf_weights / adapter_state; the Ray + vLLM test in test_vllm_rollout.py
    checks the engines follow every update, full and LoRA)."""
    from rlkit import workers
    from rlkit.fsdp_workers import FSDPActorRolloutRefWorker

    w = object.__new__(FSDPActorRolloutRefWorker)
    w.rollout_sys = RolloutSystem(name="vllm")
    monkeypatch.setattr(FSDPActorRolloutRefWorker, "_full_weights", lambda self: pytest.fail("the sync unsharded the model"))
    monkeypatch.setattr(workers.ActorRolloutRefWorker, "sync_rollout", lambda self: 0.25)
    assert w.sync_rollout() == 0.25
