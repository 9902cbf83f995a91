"""GPU memory per phase, predicted on CPU: the model behind docs/gpu.md's "what fits where" table.

    python bench/gpu_memory.py                      # the table (GiB) for Qwen2.5-0.5B / 1.5B / 7B-shaped configs
    python bench/gpu_memory.py --write-docs         # regenerate the table between the markers in docs/gpu.md
    python bench/gpu_memory.py --model 1.5B --lora  # one setup, phase by phase

No download: the configs are written here from the published sizes, and every model is built on the `meta` device
(exact parameter counts, LoRA adapter counts, KV bytes per token). What is traced and what is arithmetic:

- one decoder layer's forward + backward under autocast, on fake tensors (torch._subclasses.FakeTensorMode) with
  a dispatch mode that counts the bytes of live tensor storages (LiveBytes): the activations a checkpointed layer
  recomputes, and what every layer keeps without checkpointing. FakeTensorMode runs the real modules without
  allocating (a 7B layer at 4k tokens costs nothing), and LiveBytes counts what each op would hold, views and
  in-place ops once. torch.distributed._tools.mem_tracker.MemTracker also runs under FakeTensorMode with this
  torch (2.13) and splits memory by module and kind (parameters, gradients, activations, optimizer state); it is a
  private API whose peak includes the tracked modules' weights, while one number per pass, above the weights, on
  real and fake tensors alike, is all this needs: LiveBytes is that, in 30 lines.
- the logits term of each pass (the largest at a 152k vocabulary), in U = one float32 copy of the logits read
  (positions read x V x 4 bytes): constants per engine code path (LOGITS), derived from the code below and checked
  on CPU against the engine itself by tests/test_gpu_memory.py (LiveBytes on real tensors, V = 151,936, +-30 %).
- arithmetic for what no pass shows: float32 masters and AdamW moments, autocast's bf16 weight copies, the frozen
  reference, the HF generation KV cache, vLLM's share of the GPU, the async worker's own copy.

Not counted (say so beside any comparison): the CUDA context (~0.5 GiB per process), allocator fragmentation
(10-20 %), NCCL buffers. Treat every number as +-30 %.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import re
import sys
import weakref
from functools import cache
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "gpu.md"
BEGIN, END = "<!-- gpu_memory.py table: begin -->", "<!-- gpu_memory.py table: end -->"
GiB = 2**30
CHUNK = 2**27  # algos.LOGITS_CHUNK_BYTES_CUDA: the chunked log-sum-exp's float32 buffers on a GPU, 128 MiB each
CHUNK_CPU = 2**24  # algos.LOGITS_CHUNK_BYTES: 16 MiB on CPU (measure_pass's device)

# Qwen2.5-*-Instruct config.json sizes (hidden, MLP, layers, heads, KV heads, vocabulary, tied embeddings)
QWEN25 = {
    "0.5B": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2),
    "1.5B": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2),
    "7B": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4),
}
VOCAB = {"0.5B": 151936, "1.5B": 151936, "7B": 152064}
TIED = {"0.5B": True, "1.5B": True, "7B": False}

# The logits term of one pass: (a, b, f, k) -> a x U + b x the logits in the compute dtype (U x bytes / 4) + f x U in
# 16-bit compute only + k x CHUNK, with U = one float32 copy of the logits read (positions read x V x 4 bytes).
#  "chunked" (algos.token_logprob_entropy, one log-sum-exp, chunked over positions): the model's logits in the compute
#     dtype are the only vocabulary-wide tensor of a no-gradient pass (+ float32 chunks: z - m, exp, the entropy's
#     product); with gradient the backward adds their gradient in the same dtype (+ chunks: log p, p, g). The same
#     with or without the entropy. bf16 compute: 0.5 U without gradient, 1 U with it; float32 (CPU): 1 U, 2 U.
#  "float32-copy" (the engine before it; kept to check the model on that code): out.float() (a float32 copy in 16-bit
#     compute), then logsumexp (no temporary on CPU, whose kernel is fused; CUDA's may hold one more U), the entropy's
#     clamp_min, softmax and product (3 U), and in the backward the float32 gradients of each: measured on CPU
#     4 U (update) and 7.9 U (update with the entropy in the loss) at float32, the figures issue #23 quotes for CUDA.
LOGITS = {
    "chunked": {
        ("log_prob", False): (0, 1, 0, 2),
        ("log_prob", True): (0, 1, 0, 3),
        ("update", False): (0, 2, 0, 3),
        ("update", True): (0, 2, 0, 3),
    },
    # the Megatron engine's vocab-parallel log-softmax (rlkit/megatron_workers.py, vocab_parallel_logprobs): the logits
    # read in float32, masked, exp, and with the entropy the p * z product, each a float32 copy; measured on CPU at T = 1
    # (LiveBytes, 8 x 48 positions x V = 151,936): 4.0 / 6.0 U without gradient, 4.0 / 8.0 U with it (plain / entropy),
    # float32 and bf16 alike (the bf16 logits are freed before the peak)
    "megatron": {
        ("log_prob", False): (4, 0, 0, 0),
        ("log_prob", True): (6, 0, 0, 0),
        ("update", False): (4, 0, 0, 0),
        ("update", True): (8, 0, 0, 0),
    },
    "float32-copy": {
        ("log_prob", False): (0, 1, 1, 0),
        ("log_prob", True): (3, 1, 1, 0),
        ("update", False): (3, 1, 0.5, 0),
        ("update", True): (7, 1, 0.5, 0),
    },
}


def engine_code() -> str:
    """Which log-prob code the installed rlkit engine runs: the chunked log-sum-exp pass, or the float32 copy before it."""
    from rlkit import algos

    return "chunked" if hasattr(algos, "token_logprob_entropy") else "float32-copy"


class LiveBytes(TorchDispatchMode):
    """Counts the bytes of tensor storages created inside it while they live: `peak` and `now` (views, in-place
    ops and outputs sharing a storage count once). Works on real tensors (CPU peaks) and fake ones (FakeTensorMode).
    Storages created before entering (weights, inputs) are not counted: peaks are above the starting point."""

    def __init__(self):
        super().__init__()
        self.now = self.peak = 0
        self.live: dict[int, weakref.finalize] = {}

    def _free(self, key: int, n: int) -> None:
        self.now -= n
        self.live.pop(key, None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                key = id(storage)
                if key not in self.live:
                    n = storage.nbytes()
                    self.now += n
                    self.peak = max(self.peak, self.now)
                    self.live[key] = weakref.finalize(storage, self._free, key, n)
        return out


def qwen_config(name: str, **over):
    """A Qwen2.5-shaped transformers config, built locally."""
    from transformers import Qwen2Config

    cfg = Qwen2Config(**QWEN25[name], vocab_size=VOCAB[name], tie_word_embeddings=TIED[name], **over)
    cfg._attn_implementation = "sdpa"
    return cfg


@cache
def counts(name: str, lora_rank: int = 16) -> dict:
    """Parameter counts from the model built on the meta device: total, LoRA adapters (all linear layers but the head),
    the embedding, and the KV cache's elements per token."""
    from transformers import Qwen2ForCausalLM

    cfg = qwen_config(name)
    with torch.device("meta"):
        model = Qwen2ForCausalLM(cfg)
    n = sum(p.numel() for p in model.parameters())
    lora = sum(lora_rank * (m.in_features + m.out_features) for m in model.model.modules() if isinstance(m, torch.nn.Linear))
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    kv = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim  # K and V per token
    return dict(n=n, lora=lora, vocab=cfg.vocab_size, kv=kv, layers=cfg.num_hidden_layers, hidden=cfg.hidden_size)


@cache
def layer_bytes(name: str, tokens: int, dtype: str, grad: bool) -> int:
    """Peak bytes of one decoder layer's forward (+ backward) at `tokens` positions, traced on fake tensors: its
    activations, autocast's copies of its weights, and (backward) its weight gradients. dtype: the compute dtype;
    "bfloat16" over float32 weights runs under autocast (the engine's float32 masters)."""
    return layer_peak(qwen_config(name), tokens, dtype, grad, fake=True)


def layer_peak(cfg, tokens: int, dtype: str, grad: bool, fake: bool = True) -> int:
    """layer_bytes for any Qwen2 config; fake=False runs it on real CPU tensors (the check that tracing is faithful)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer, Qwen2RotaryEmbedding

    with FakeTensorMode() if fake else contextlib.nullcontext():
        torch.manual_seed(0)
        layer, rotary = Qwen2DecoderLayer(cfg, 0), Qwen2RotaryEmbedding(cfg)
        x = torch.randn(1, tokens, cfg.hidden_size, requires_grad=grad)  # the residual stream: float32 under autocast
        pos = torch.arange(tokens)[None]
        cos_sin = rotary(x, pos)
        counter = LiveBytes()
        auto = torch.autocast("cpu", dtype=torch.bfloat16) if dtype == "bfloat16" else torch.autocast("cpu", enabled=False)
        with counter, auto, torch.set_grad_enabled(grad):
            y = layer(x, attention_mask=None, position_ids=pos, position_embeddings=cos_sin)
            y = y[0] if isinstance(y, tuple) else y
            if grad:
                y.float().sum().backward()
    return counter.peak


def activation_bytes(cfg, tokens: int, dtype: str, residual: int, grad: bool, layer: int | None = None) -> float:
    """Activations of a pass at `tokens` positions with gradient checkpointing: one residual-stream tensor per layer
    kept (`residual` bytes per value: 4 under autocast over float32 masters, else the weights' dtype) and one layer's
    forward (+ backward) at a time, traced on fake tensors (layer_peak; `layer` = its precomputed value)."""
    one = layer if layer is not None else layer_peak(cfg, tokens, dtype, grad)
    return (cfg.num_hidden_layers * tokens * cfg.hidden_size * residual if grad else 0) + one


@dataclasses.dataclass(frozen=True)
class Setup:
    """One run's flags, as docs/gpu.md documents them (defaults: its settings)."""

    model: str = "0.5B"
    lora: bool = False  # --model.lora-rank 16 (all linear layers) vs full parameters
    rollout: str = "hf"  # --rollout.name
    async_: bool = False  # --trainer.async-steps 1 on the same GPU
    entropy: bool = False  # --actor.entropy-coeff > 0 (the entropy enters the loss: its gradient)
    micro: int = 8  # --actor.ppo-micro-batch-size (rows); the log-prob passes use the same
    n: int = 8  # --rollout.n (one prompt shared by n rows: packed once)
    prompt: int = 512
    response: int = 512
    gen_rows: int = 64  # --rollout.micro-batch-size: rows per HF generate call
    kl: bool = True  # --actor.use-kl-loss: a frozen reference copy (full parameters)
    tp: int = 1  # --trainer.engine megatron --trainer.tp-size (bf16 over float32 shards, recompute, padded rows, vocab-parallel logits)
    gpu_util: float = 0.5  # --rollout.gpu-memory-utilization
    code: str = "chunked"  # LOGITS key
    first_step: bool = False  # step 1's generation and log-prob passes: AdamW's moments are not allocated yet (lazily, at the first step)


def logits_bytes(
    s: Setup, phase: str, compute: int, positions: int, vocab: int, code: str | None = None, chunk: int | None = None
) -> float:
    """The logits term of a pass: LOGITS' (a, b, f, k) at `positions` read x `vocab` (this GPU's share); `chunk`: the
    chunked passes' buffer size (a GPU's by default)."""
    a, b, f, k = LOGITS[code or s.code][(phase, s.entropy)]
    u = positions * vocab * 4
    return a * u + b * u * compute / 4 + (f * u if compute < 4 else 0) + k * min(chunk or CHUNK, u)  # a chunk is at most the logits


def predict(s: Setup, gpu_gb: float) -> dict:
    """Bytes per phase on one GPU of `gpu_gb` GB: held (all run), update, log_prob, gen, vllm (its share), and peak."""
    c = counts(s.model)
    n, tp = c["n"], s.tp
    megatron = tp > 1
    full = not s.lora
    compute = 2  # bf16 compute (the Megatron engine too: float32 shards under autocast)
    groups = math.ceil(s.micro / s.n)
    if megatron:  # padded rows (prompt + response each), the LM head on the response positions, vocabulary split tp
        # ways; its vocab-parallel log-softmax on float32 copies: LOGITS["megatron"]
        tokens, read, vocab, code = s.micro * (s.prompt + s.response), s.micro * s.response, c["vocab"] / tp, "megatron"
    else:  # packed: each group's prompt once; the head on the positions read
        tokens, read, vocab, code = groups * s.prompt + s.micro * s.response, s.micro * s.response, c["vocab"], s.code
    if full:
        weights = (4 * n + 8 * n) / tp  # float32 masters + AdamW's two moments
        ref = 2 * n / tp if s.kl and not s.async_ else 0  # bf16; with async the worker runs the reference pass, not the trainer
        grads = 4 * n / tp
        casts = 2 * n / tp  # autocast's bf16 copies of the weights (this GPU's shards), inside a pass
        hf_copy = 2 * n if megatron else 0  # the Megatron engine's full bf16 HF copy for generation and export
    else:
        weights, ref, grads, casts, hf_copy = 2 * n + 12 * c["lora"], 0, 4 * c["lora"], 0, 0
    held = weights + ref + hf_copy
    before = held - (8 * n / tp if full else 8 * c["lora"]) if s.first_step else held  # what the passes before the first step see
    # the residual stream: float32 under autocast over float32 masters; bf16 with a LoRA base, and in Megatron (its
    # bias-dropout-add casts the residual to the layer's output dtype), where every tensor-parallel rank keeps all of it
    residual = 2 if s.lora or megatron else 4
    cfg = qwen_config(s.model)
    kept = cfg.num_hidden_layers * tokens * cfg.hidden_size * residual  # one residual per layer: checkpointing / recompute
    acts_update = kept + layer_bytes(s.model, tokens, "bfloat16", True) / tp  # one layer's heads and MLP columns split tp ways
    acts_lp = layer_bytes(s.model, tokens, "bfloat16", False) / tp
    update = held + grads + casts + acts_update + logits_bytes(s, "update", compute, read, vocab, code)
    log_prob = before + casts + acts_lp + logits_bytes(s, "log_prob", compute, read, vocab, code)
    kv_bytes = 2  # the KV cache in the compute dtype (bf16) under autocast
    # Megatron generates on its bf16 HF copy (no autocast copies, the full vocabulary)
    gen_casts, gen_vocab = (0, c["vocab"]) if megatron else (casts, vocab)
    gen = before + gen_casts + s.gen_rows * (s.prompt + s.response) * c["kv"] * kv_bytes + 3 * s.gen_rows * gen_vocab * 4
    vllm = s.gpu_util * gpu_gb * 1e9 if s.rollout == "vllm" else 0
    if s.rollout == "vllm":  # vLLM sleeps during the passes: its share counts only beside what stays while it generates
        gen = held + vllm
    peak = max(update, log_prob, gen)
    worker = 0
    if s.async_:  # the generation process beside the trainer: its own bf16 model (+ reference), generating meanwhile
        own = 2 * n + (2 * n if s.kl and full else 0) + (12 * c["lora"] if s.lora else 0)
        w_gen = own + (vllm if s.rollout == "vllm" else s.gen_rows * (s.prompt + s.response) * c["kv"] * kv_bytes)
        # its reference pass runs with its vLLM engine awake (a generation-only worker does not sleep it between passes)
        w_ref = own + vllm + logits_bytes(s, "log_prob", compute, read, vocab, code) + acts_lp if s.kl and full else own
        worker = max(w_gen, w_ref)
        peak = max(update, log_prob) + worker  # they run at the same time
    return dict(held=held, update=update, log_prob=log_prob, gen=gen, vllm=vllm, worker=worker, peak=peak)


# -- the check at small scale: the engine's real passes on CPU, measured with LiveBytes -----------------------------
def tiny_model(folder: Path, vocab: int = 151936, hidden: int = 16) -> str:
    """A random-weight Qwen2 with a real vocabulary and a tiny body (the logits dominate), with the embedded tokenizer."""
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from rlkit import demos

    if not (folder / "config.json").exists():
        tok = AutoTokenizer.from_pretrained(demos.ARITH_MODEL)
        shape = dict(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
        config = Qwen2Config(**shape, vocab_size=vocab, tie_word_embeddings=True, pad_token_id=tok.pad_token_id)
        torch.manual_seed(0)
        Qwen2ForCausalLM(config).save_pretrained(folder)
        tok.save_pretrained(folder)
    return str(folder)


def measure_pass(
    path: str,
    phase: str,
    entropy: bool,
    rows: int = 8,
    prompt: int = 8,
    response: int = 48,
    dtype: str = "float32",
    device: str = "cpu",
    megatron: bool = False,
):
    """(measured, predicted) peak bytes of one engine pass above the weights (CPU: LiveBytes; CUDA:
    torch.cuda.max_memory_allocated above what was allocated before): phase "log_prob"
    (compute_log_prob, no gradient) or "update" (forward + loss + backward of one micro-batch, the entropy in the loss
    with `entropy`). One group of `rows` full-length responses to one prompt. dtype "bfloat16": the engine's float32
    masters under CPU autocast. megatron: the Megatron engine at T = 1 (the caller has initialised torch.distributed
    and Megatron's parallel state), against LOGITS["megatron"]."""
    from rlkit.config import ActorConfig, ModelConfig, ModelSystem
    from rlkit.engine import TorchEngine
    from rlkit.protocol import DataProto
    from rlkit.rollout import assemble

    engine_class = TorchEngine
    if megatron:
        from rlkit.megatron_workers import MegatronEngine as engine_class
    engine = engine_class(ModelConfig(path=path), ActorConfig(use_kl_loss=False), device=device, model_sys=ModelSystem(dtype=dtype))
    vocab = engine.hf_config.vocab_size if megatron else engine.model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 250, (1, prompt), generator=g).expand(rows, prompt)  # one prompt shared by the group
    prompts = DataProto.from_dict(
        tensors={
            "input_ids": ids,
            "attention_mask": torch.ones(rows, prompt, dtype=torch.long),
            "position_ids": torch.arange(prompt).expand(rows, prompt),
        }
    )
    batch = assemble(prompts, torch.randint(3, 250, (rows, response), generator=g), [], 0)
    cuda = engine.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    counter = LiveBytes() if not cuda else contextlib.nullcontext()
    if phase == "log_prob":
        with counter:
            engine.compute_log_prob(batch, 1.0, rows, with_entropy=entropy)
    else:
        with counter:
            logp, ent = engine.forward(engine.model, batch, 1.0, entropy)
            mask = batch["response_mask"].to(logp.device)
            loss = -(logp * mask).sum() / mask.sum() - (0.01 * (ent * mask).sum() / mask.sum() if entropy else 0)
            loss.backward()
    measured = torch.cuda.max_memory_allocated() - base if cuda else counter.peak
    compute = torch.finfo(engine.dtype).bits // 8
    setup = Setup(entropy=entropy)
    code = "megatron" if megatron else engine_code()
    predicted = logits_bytes(setup, phase, compute, rows * response, vocab, code, CHUNK if cuda else CHUNK_CPU)
    if phase == "update":
        predicted += 4 * sum(p.numel() for p in engine.model.parameters())  # the weights' float32 gradients
    return measured, predicted


# -- Ulysses sequence parallelism (--trainer.sp-size S, rlkit/ulysses.py): the longest row per GPU ------------------
SP_BEGIN, SP_END = "<!-- gpu_memory.py sp table: begin -->", "<!-- gpu_memory.py sp table: end -->"
SP_GPUS, SP_TRACE = 8, 8192  # one node of 8 GPUs (FSDP over all 8, D = 8 / S replicas); the layer traced at 8192 positions


@cache
def layer_kept_and_peak(name: str, tokens: int) -> tuple[int, int]:
    """One decoder layer at `tokens` positions under bf16 autocast over float32 weights, traced on fake tensors: the
    bytes its forward leaves for the backward (no gradient checkpointing: every layer keeps them) and its forward +
    backward peak."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer, Qwen2RotaryEmbedding

    cfg = qwen_config(name)
    with FakeTensorMode():
        layer, rotary = Qwen2DecoderLayer(cfg, 0), Qwen2RotaryEmbedding(cfg)
        x = torch.randn(1, tokens, cfg.hidden_size, requires_grad=True)
        pos = torch.arange(tokens)[None]
        cos_sin = rotary(x, pos)
        counter = LiveBytes()
        with counter, torch.autocast("cpu", dtype=torch.bfloat16):
            y = layer(x, attention_mask=None, position_ids=pos, position_embeddings=cos_sin)
            y = y[0] if isinstance(y, tuple) else y
            kept = counter.now
            y.float().sum().backward()
    return kept, counter.peak


def sp_predict(model: str, length: int, sp: int, gpus: int = SP_GPUS) -> dict:
    """Bytes per GPU of one update micro-batch of ONE row of `length` tokens (half prompt, half response) with
    --trainer.sp-size `sp` on `gpus` GPUs: what the SP path runs (padded rows, sdpa, no gradient checkpointing), full
    parameters, bf16 compute over float32 masters, a frozen reference. Per GPU:

    - FSDP over all `gpus`: masters + AdamW (16 n), the reference (2 n), / gpus; the bf16 layer being run and the next
      (prefetched) gathered, and the embedding and head (gathered for the whole pass);
    - activations of L / S positions (every layer's saved tensors, traced per position at SP_TRACE, and one layer's
      backward above them): 1/S of the one-rank ones;
    - the logits of the L / S positions of the shard (sp_token_logprobs computes the head on the whole shard; at S = 1
      the engine's padded pass reads only the response's L / 2): LOGITS["chunked"];
    - the all-to-all buffers of one layer: q, k, v stacked (H + 2 H_kv r heads) and the output (H heads), sent and
      received, in bf16, at L / S positions."""
    c, cfg = counts(model), qwen_config(model)
    n, layers, hidden = c["n"], c["layers"], c["hidden"]
    heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = hidden // heads
    held = (16 * n + 2 * n) / gpus
    embed = c["vocab"] * hidden * (1 if TIED[model] else 2)
    per_layer = (n - embed) / layers
    gathered = 2 * (2 * per_layer) + 2 * embed  # bf16: two layers and the embedding/head
    grads = 4 * n / gpus
    tokens = length / sp
    kept, peak = (b / SP_TRACE for b in layer_kept_and_peak(model, SP_TRACE))
    acts = tokens * ((layers - 1) * kept + peak)
    r = sp // math.gcd(kv, sp)
    a2a = 2 * tokens * (heads + 2 * kv * r) * head_dim * 2 + 2 * tokens * heads * head_dim * 2 if sp > 1 else 0
    read = tokens if sp > 1 else length / 2
    logits = logits_bytes(Setup(model=model), "update", 2, read, c["vocab"])
    update = held + grads + gathered + acts + a2a + logits
    return dict(held=held, gathered=gathered, grads=grads, acts=acts, a2a=a2a, logits=logits, update=update)


def sp_fits(model: str, length: int, sp: int, gpu_gb: float = 80) -> bool:
    """fits()'s rule: 1.15 x the update's bytes + 0.5 GiB of CUDA context within the card."""
    return sp_predict(model, length, sp)["update"] * 1.15 + 0.5 * GiB <= gpu_gb * 1e9


def sp_longest(model: str, sp: int, gpu_gb: float = 80, step: int = 1024) -> int | None:
    """The longest row (a multiple of `step`) whose update fits (0: none; None: S does not divide the model's attention
    heads, which preflight refuses); bytes grow with the length, so bisect."""
    if qwen_config(model).num_attention_heads % sp:
        return None
    lo, hi = 0, 1
    while sp_fits(model, hi * step, sp, gpu_gb):
        lo, hi = hi, 2 * hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if sp_fits(model, mid * step, sp, gpu_gb) else (lo, mid)
    return lo * step


def sp_table() -> str:
    """docs/gpu.md's sequence-parallel table: the longest row per model and S on 8 x 80 GB."""
    sizes = (1, 2, 4, 8)
    head = "| model | " + " | ".join(f"S = {s}" for s in sizes) + " |\n| --- | " + " | ".join("---:" for _ in sizes) + " |"
    lines = [head]
    for m in QWEN25:
        cells = [sp_longest(m, s) for s in sizes]
        heads = qwen_config(m).num_attention_heads
        lines.append(f"| {m} | " + " | ".join(f"refused ({heads} heads)" if c is None else f"{c // 1024}k" for c in cells) + " |")
    return "\n".join(lines)


def setups() -> list[Setup]:
    """The documented rows: 0.5B / 1.5B / 7B x full / LoRA x HF / vLLM x sync / async, then Megatron TP 2."""
    rows = [
        Setup(model=m, lora=lora, rollout=r, async_=a)
        for m in QWEN25
        for lora in (False, True)
        for r in ("hf", "vllm")
        for a in (False, True)
    ]
    return rows + [Setup(model=m, tp=2) for m in QWEN25]


def table() -> str:
    """The markdown table docs/gpu.md carries (GiB); update peak with / without an entropy bonus."""
    head = (
        "| model | training | rollout | async | held all run | update peak | update peak, entropy bonus | log-prob pass | "
        "generation | 24 GB peak | 80 GB peak |\n| --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
    )
    lines = [head]
    for s in setups():
        p, ent = predict(s, 24), predict(dataclasses.replace(s, entropy=True), 24)
        training = f"full, Megatron TP {s.tp} (per GPU)" if s.tp > 1 else ("LoRA 16" if s.lora else "full")
        gen_txt = f"{p['gen'] / GiB:.1f}" if s.rollout == "hf" else f"{(p['gen'] - p['vllm']) / GiB:.1f} + vLLM share"
        cards = " | ".join(f"{worst_peak(s, gb) / GiB:.1f} {'yes' if fits(s, gb) else '**no**'}" for gb in (24, 80))
        lines.append(
            f"| {s.model} | {training} | {s.rollout} | {'yes' if s.async_ else 'no'} | {p['held'] / GiB:.1f} | "
            f"{p['update'] / GiB:.1f} | {ent['update'] / GiB:.1f} | {p['log_prob'] / GiB:.1f} | {gen_txt} | {cards} |"
        )
    return "\n".join(lines)


def worst_peak(s: Setup, gpu_gb: float) -> float:
    """The setup's peak bytes on a card of gpu_gb GB, with or without an entropy bonus, whichever is larger."""
    return max(predict(s, gpu_gb)["peak"], predict(dataclasses.replace(s, entropy=True), gpu_gb)["peak"])


def fits(s: Setup, gpu_gb: float) -> bool:
    """Whether 1.15 x the peak (fragmentation) + 0.5 GiB of CUDA context per process fits a card of gpu_gb GB."""
    return worst_peak(s, gpu_gb) * 1.15 + 0.5 * GiB * (2 if s.async_ else 1) <= gpu_gb * 1e9


def doc_block() -> str:
    return f"{BEGIN}\n{table()}\n{END}"


def sp_doc_block() -> str:
    return f"{SP_BEGIN}\n{sp_table()}\n{SP_END}"


def write_docs(path: Path = DOC) -> None:
    text = path.read_text()
    for begin, end, block in ((BEGIN, END, doc_block), (SP_BEGIN, SP_END, sp_doc_block)):
        if begin not in text or end not in text:
            raise SystemExit(f"{path}: no {begin} ... {end} markers")
        new = block()
        text = re.sub(re.escape(begin) + ".*?" + re.escape(end), lambda _, new=new: new, text, flags=re.S)
    path.write_text(text)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--write-docs", action="store_true", help=f"regenerate the table in {DOC.relative_to(ROOT)}")
    p.add_argument("--model", choices=list(QWEN25), help="one setup, phase by phase")
    p.add_argument("--lora", action="store_true")
    p.add_argument("--rollout", default="hf", choices=["hf", "vllm"])
    p.add_argument("--async", dest="async_", action="store_true")
    p.add_argument("--entropy", action="store_true")
    p.add_argument("--micro", type=int, default=8)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--gpu-gb", type=float, default=24)
    args = p.parse_args()
    if args.write_docs:
        write_docs()
        print(f"wrote the table into {DOC}")
        return 0
    if args.model:
        s = Setup(
            model=args.model, lora=args.lora, rollout=args.rollout, async_=args.async_, entropy=args.entropy, micro=args.micro, tp=args.tp
        )
        for k, v in predict(s, args.gpu_gb).items():
            print(f"{k:10s} {v / GiB:8.2f} GiB")
        return 0
    print(table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
