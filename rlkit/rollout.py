"""Rollout adapter `hf`: sample responses on the training model, KV-cached and batched, with transformers' `generate`
(`--rollout.hf-impl generate`) or with rlkit's own decoding loop around the model's forward (`fast`, the default):
the same forward passes, the same sampling ops in the same order, so the same tokens for the same seed, bit for bit,
without `generate`'s per-token bookkeeping, and with the KV cache in one buffer allocated for the whole response
(GrowingLayer) instead of concatenated every step (docs/performance.md, "Generation").

Input: a DataProto of left-padded prompts (input_ids, attention_mask, position_ids).
Output: the same rows with the prompt and response laid side by side, the layout every later
step uses::

    prompts        (B, P)   left-padded prompt ids
    responses      (B, R)   generated ids, right-padded
    response_mask  (B, R)   1 for generated tokens up to and including the first EOS
    input_ids      (B, P+R) prompts ++ responses;  attention_mask, position_ids to match
"""

from __future__ import annotations

import functools
import inspect
import warnings
from contextlib import nullcontext

import torch

from rlkit.algos import logprobs_from_logits
from rlkit.errors import ConfigError
from rlkit.packing import group_starts
from rlkit.protocol import DataProto


def eos_ids(model, tokenizer) -> list[int]:
    """Every token that ends a response: the generation config's EOS ids plus the tokenizer's."""
    ids = model.generation_config.eos_token_id
    ids = [] if ids is None else ([ids] if isinstance(ids, int) else list(ids))
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    return ids


def response_mask(responses: torch.Tensor, eos: list[int]) -> torch.Tensor:
    """1 for tokens up to and including the first EOS of each row; a row without EOS is all 1."""
    is_eos = torch.isin(responses, torch.tensor(eos, device=responses.device))
    after_eos = (is_eos.cumsum(-1) - is_eos.long()) > 0
    return (~after_eos).long()


def assemble(prompts: DataProto, responses: torch.Tensor, eos: list[int], pad_id: int) -> DataProto:
    """Lay prompts and responses side by side (see module docstring); pads after EOS become pad_id."""
    mask = response_mask(responses, eos)
    responses = torch.where(mask.bool(), responses, torch.full_like(responses, pad_id))
    attn = torch.cat([prompts["attention_mask"], mask], dim=1)
    out = prompts.select(tensor_keys=[])
    out["prompts"] = prompts["input_ids"]
    out["responses"] = responses
    out["response_mask"] = mask
    out["input_ids"] = torch.cat([prompts["input_ids"], responses], dim=1)
    out["attention_mask"] = attn
    out["position_ids"] = (attn.cumsum(-1) - 1).clamp(min=0)
    return out


# A hub model's generation_config.json may carry sampling defaults (Qwen2.5: repetition_penalty 1.05) that
# generate() would apply; switch them off so responses come from softmax(logits / T), what the log-probs score.
NEUTRAL_SAMPLING = dict(repetition_penalty=1.0, min_p=None, typical_p=1.0, no_repeat_ngram_size=0)


class SampledLogProbs:
    """A logits processor that keeps log softmax(z / T)[y] of each sampled token y, one decoding step at a time.

    generate() calls it with step t's scores (the raw logits: rlkit's processors are off, NEUTRAL_SAMPLING, and
    temperature/top-k/top-p come after it) and the ids so far, whose last column is step t-1's sample. It holds
    one step's (B, V) scores, never the (steps, B, V) stack that output_logits builds; `finish` scores the last
    sample. Same values as log_softmax over the stacked logits, step by step.
    """

    def __init__(self, temperature: float):
        self.t = temperature if temperature > 0 else 1.0
        self.prev: torch.Tensor | None = None  # (B, V) float32: the last step's logits / T
        self.steps: list[torch.Tensor] = []  # (B,) per step

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.prev is not None:
            self.steps.append(logprobs_from_logits(self.prev, input_ids[:, -1]))
        self.prev = scores.float() / self.t
        return scores

    def finish(self, sequences: torch.Tensor) -> torch.Tensor:
        """(B, steps) log-probs of the generated tokens (sequences ends with the last sample)."""
        if self.prev is not None:
            self.steps.append(logprobs_from_logits(self.prev, sequences[:, -1]))
            self.prev = None
        return torch.stack(self.steps, dim=1) if self.steps else torch.zeros(len(sequences), 0)


def cast_cache(dtype: torch.dtype | None, config):
    """A KV cache that stores keys and values in `dtype` (None: transformers' own cache, made by generate).

    Under autocast over float32 masters the projections come out in bf16 but RoPE's float32 cos/sin promote the
    keys to float32: the cache would hold float32, twice the memory of the compute dtype, for no gain (attention
    runs in the compute dtype under autocast)."""
    if dtype is None:
        return None
    from transformers import DynamicCache

    class CastCache(DynamicCache):
        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            return super().update(key_states.to(dtype), value_states.to(dtype), layer_idx, *args, **kwargs)

    return CastCache(config=config)


def cache_arg(model) -> str:
    """The forward's keyword (and output key) for the KV cache: `cache` from transformers 5.24 on, where
    `past_key_values` warns that it is deprecated; `past_key_values` before."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # a PEFT model's forward takes **kwargs
    return "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"


@functools.cache
def growing_layer_class():
    """GrowingLayer: a KV-cache layer (transformers' DynamicLayer, imported lazily as everywhere in rlkit) whose keys and
    values live in one (B, heads, capacity, head_dim) buffer allocated at its first update; each update writes its
    positions in place and returns a view of the filled part.

    DynamicLayer concatenates instead, copying the whole cache at every decoding step (O(L^2) bytes over a response;
    for the 4.3M model at 128 rows that copy was ~40 % of generation, docs/performance.md). The views hold the same
    numbers in the same layout per (row, head), so attention computes the same bits. dtype: the buffer's (None: the
    first keys'), as CastCache keeps the compute dtype under autocast."""
    from transformers.cache_utils import DynamicLayer

    class GrowingLayer(DynamicLayer):
        def __init__(self, capacity: int, dtype: torch.dtype | None = None):
            super().__init__()
            self.capacity, self.cast, self.length = capacity, dtype, 0

        def lazy_initialization(self, key_states, value_states):
            self.dtype, self.device = self.cast or key_states.dtype, key_states.device
            k, v = key_states.shape, value_states.shape
            self.key_buf = key_states.new_empty((k[0], k[1], self.capacity, k[3]), dtype=self.dtype)
            self.value_buf = value_states.new_empty((v[0], v[1], self.capacity, v[3]), dtype=self.dtype)
            self.keys, self.values = self.key_buf[:, :, :0], self.value_buf[:, :, :0]
            self.is_initialized = True

        def update(self, key_states, value_states, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            start, end = self.length, self.length + key_states.shape[-2]
            if end > self.capacity:
                raise RuntimeError(f"GrowingLayer: {end} positions exceed the capacity {self.capacity}")
            self.key_buf[:, :, start:end] = key_states  # cast to the buffer's dtype by the copy
            self.value_buf[:, :, start:end] = value_states
            self.length = end
            self.keys, self.values = self.key_buf[:, :, :end], self.value_buf[:, :, :end]
            return self.keys, self.values

        def get_seq_length(self) -> int:
            return self.length

        def batch_repeat_interleave(self, repeats: int) -> None:
            """Each row's filled positions repeated `repeats` times, consecutively (a group's shared prompt)."""
            if self.is_initialized:
                for name in ("key_buf", "value_buf"):
                    old = getattr(self, name)
                    new = old.new_empty((old.shape[0] * repeats, *old.shape[1:]))
                    new[:, :, : self.length] = old[:, :, : self.length].repeat_interleave(repeats, dim=0)
                    setattr(self, name, new)
                self.keys, self.values = self.key_buf[:, :, : self.length], self.value_buf[:, :, : self.length]

        def batch_select_indices(self, indices: torch.Tensor) -> None:
            """Keep only the rows `indices` (in that order): new buffers of len(indices) rows, the filled positions copied
            (the decoding loop dropping finished rows, `decode(drop_finished=...)`)."""
            if self.is_initialized:
                for name in ("key_buf", "value_buf"):
                    old = getattr(self, name)
                    new = old.new_empty((len(indices), *old.shape[1:]))
                    new[:, :, : self.length] = old[indices, :, : self.length]
                    setattr(self, name, new)
                self.keys, self.values = self.key_buf[:, :, : self.length], self.value_buf[:, :, : self.length]

    return GrowingLayer


def growing_cache(config, capacity: int, dtype: torch.dtype | None = None):
    """A DynamicCache whose layers are GrowingLayers of `capacity` positions, or None when the model's cache has other
    layer kinds (sliding-window, linear attention, ...), which keep transformers' own layers (and `generate`)."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    cache = DynamicCache(config=config)
    if not cache.layers or any(type(layer) is not DynamicLayer for layer in cache.layers):
        return None
    layer = growing_layer_class()
    cache.layers = [layer(capacity, dtype) for _ in cache.layers]
    return cache


# generation_config fields whose non-default values make `generate` add a logits processor or a stopping criterion that the
# fast loop does not apply (a hub model's generation_config.json may set them): with any of them set, hf-impl fast falls
# back to generate (a warning, once). temperature/top-k/top-p and NEUTRAL_SAMPLING's are applied or neutral.
GENERATE_ONLY_FIELDS = (
    "min_length", "min_new_tokens", "bad_words_ids", "sequence_bias", "suppress_tokens", "begin_suppress_tokens",
    "forced_bos_token_id", "forced_eos_token_id", "epsilon_cutoff", "eta_cutoff", "encoder_repetition_penalty",
    "exponential_decay_length_penalty", "renormalize_logits", "remove_invalid_values", "guidance_scale",
    "watermarking_config", "top_h", "length_penalty", "max_time", "stop_strings", "num_beams", "diversity_penalty",
    "force_words_ids", "constraints", "penalty_alpha", "low_memory", "prefill_chunk_size",
)  # fmt: skip


def generate_only_options(generation_config) -> list[str]:
    """The GENERATE_ONLY_FIELDS this generation config sets to something other than transformers' default."""
    from transformers import GenerationConfig

    default = GenerationConfig()
    return [f for f in GENERATE_ONLY_FIELDS if getattr(generation_config, f, None) != getattr(default, f, None)]


def generation_rows(config, prompt_len: int, response_len: int, dtype: torch.dtype, budget_bytes: float) -> int:
    """Rows per HF generate call that fit in `budget_bytes` (at least 1), from the model config:

        rows = budget // per_row,  per_row = (P + R) * kv + P * act + V * (b + 12)
        kv  = 2 * layers * kv_heads * head_dim * b          # a token's keys and values, every layer
        act = (3 * intermediate + 4 * hidden) * b           # a prompt token's largest layer activations in the prefill
        V * (b + 12)                                        # a decoding step's logits: compute dtype, float32 scores,
                                                            #   logits / T (SampledLogProbs) and the sampling softmax
    b = bytes of `dtype` (the KV cache's, the compute dtype). The prefill term counts every row's prompt (no sharing:
    validation, n = 1), so with groups of n sharing a prompt it is pessimistic by n.
    Qwen2.5-0.5B in bf16 at P = R = 512: kv 12 KiB, per_row 31.8 MiB: 644 rows in 20 GiB (tests/test_gpu_construction.py).
    """
    config = text_config(config)  # a VLM (Qwen2-VL) keeps the language model's sizes in text_config
    b = torch.empty((), dtype=dtype).element_size()
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv = 2 * config.num_hidden_layers * (getattr(config, "num_key_value_heads", None) or heads) * head_dim * b
    act = (3 * (getattr(config, "intermediate_size", None) or 4 * config.hidden_size) + 4 * config.hidden_size) * b
    per_row = (prompt_len + response_len) * kv + prompt_len * act + config.vocab_size * (b + 12)
    return max(1, int(budget_bytes // per_row))


def text_config(config):
    """The language model's config: `config` itself, or a VLM's text_config (transformers' get_text_config)."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def free_device_memory(device: torch.device) -> int:
    """Bytes this process can still allocate on a CUDA device: the driver's free memory plus the blocks torch's caching
    allocator holds unused."""
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


# decode(drop_finished=...) keeps at least this many rows: a decoding step's matmuls on 1-3 rows (M < 4) round differently
# from the same rows in a larger batch on an AVX2 CPU (torch 2.13: logits off by ~2e-6; 4 rows and more: equal; on an
# AVX-512 CPU a log-prob in a few hundred still differs by ~5e-7, rounding only: tests/test_stream_decode.py).
DROP_MIN_ROWS = 4


class HFRollout:
    """Generation with `model.generate` on the training model itself (no second copy)."""

    def __init__(self, model, tokenizer, device, autocast=None, kv_dtype: torch.dtype | None = None, impl: str = "fast"):
        """autocast: a function returning the context to generate in (the engine's: bf16 compute over float32 masters).
        kv_dtype: the KV cache's dtype (the compute dtype under autocast; None: the model's).
        impl: "fast" (rlkit's decoding loop, `decode`) or "generate" (transformers' generate); --rollout.hf-impl."""
        if impl not in ("fast", "generate"):
            raise ConfigError(f"--rollout.hf-impl {impl!r}: choose fast or generate")
        self.model, self.tokenizer, self.device = model, tokenizer, device
        self.autocast = autocast or nullcontext
        self.kv_dtype = kv_dtype
        self.impl = impl
        self.eos = eos_ids(model, tokenizer)
        self._warned = False
        from rlkit import vlm

        self.vlm = vlm.is_vlm(model.config)  # images: M-RoPE positions from the model, vision tokens banned
        self.banned = vlm.vision_token_ids(model.config) if self.vlm else []
        self.cache_arg = cache_arg(model)

    def fast_loop_applies(self, capacity: int):
        """A GrowingLayer cache of `capacity` positions when the fast loop can stand in for generate (impl fast, plain
        full-attention layers, no generation-config option only generate applies), else None (a warning, once, says why)."""
        if self.impl != "fast":
            return None
        extra = generate_only_options(self.model.generation_config)
        base = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model  # a peft model's own
        if "logits_to_keep" not in inspect.signature(base.forward).parameters:
            extra.append("(forward takes no logits_to_keep)")
        cache = None if extra else growing_cache(self.model.config, capacity, self.kv_dtype)
        if cache is None and not self._warned:
            self._warned = True
            why = f"its generation_config sets {extra}" if extra else "its KV cache has layers other than full attention"
            warnings.warn(f"--rollout.hf-impl fast: {type(self.model).__name__}: {why}; generating with generate", stacklevel=3)
        return cache

    def shared_prefill(self, ids: torch.Tensor, mask: torch.Tensor, cache=None):
        """One prefill per group of n rows with the same prompt (batch.repeat(n, interleave=True)), or None.

        Runs the distinct prompts but their last token through the model and repeats the KV cache n times;
        generate() then processes only the last prompt token of every row, against that cache, and samples
        with all its options as usual. None (generate prefills every row) when the rows are not groups of
        equal size n >= 2, or the model returns no cache that can be repeated. cache: the (empty) cache to prefill into
        (default: transformers' DynamicCache in kv_dtype).
        """
        starts = group_starts(ids, mask, share=True)
        n = len(ids) // len(starts)
        if n < 2 or ids.shape[1] < 2 or starts != list(range(0, len(ids), n)):
            return None
        head, head_mask = ids[::n, :-1], mask[::n, :-1]
        out = self.model(
            input_ids=head,
            attention_mask=head_mask,
            position_ids=(head_mask.cumsum(-1) - 1).clamp(min=0),
            use_cache=True,
            logits_to_keep=1,
            **{self.cache_arg: cache if cache is not None else cast_cache(self.kv_dtype, self.model.config)},
        )
        cache = out.get(self.cache_arg)
        if not hasattr(cache, "batch_repeat_interleave"):
            if not self._warned:
                self._warned = True
                warnings.warn(
                    f"{type(self.model).__name__}: no repeatable KV cache, every row of a group prefills its prompt", stacklevel=2
                )
            return None
        cache.batch_repeat_interleave(n)
        return cache

    @torch.no_grad()
    def generate(
        self,
        prompts: DataProto,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        micro_batch_size: int | None = None,
        return_log_probs: bool = False,
        drop_finished: float | None = None,
        swap_every: int = 0,
        on_new_weights=None,
        swap_mode: str = "keep_kv",
        version: int = 0,
        record_routing: bool = False,
    ) -> DataProto:
        """Sample one response per row (repeat the prompts first for n samples). temperature 0 = greedy.

        return_log_probs: also return `rollout_log_probs` (B, R), log softmax(logits / temperature) of
        each sampled token from the raw logits of generation (0 after EOS), as the trainer computes them,
        recorded step by step (SampledLogProbs: one step's (B, V), not every step's).
        drop_finished, swap_every, on_new_weights, swap_mode, version: the fast loop's (`decode`): finished rows leave
        the batch; new weights polled every swap_every tokens. With on_new_weights the batch also holds
        `token_version` (B, R) long: the version of the weights that sampled each token (`version` until the first
        swap; -1 after EOS), and a swap in one micro-batch carries over to the next.
        record_routing (an MoE model, R3: docs/moe.md): also return `routed_experts` (B, P+R, layers, k) int16, the
        experts each token's forward used in this decode (the prefill's columns, then one per step; -1 at padding and
        at the last sampled token, never fed back). Not with drop_finished (moe.RouterReplay.routing refuses it).
        """
        if on_new_weights is not None:
            if swap_mode not in ("keep_kv", "reprefill"):
                raise ConfigError(f"swap_mode {swap_mode!r}: choose keep_kv or reprefill")
            if not swap_every or swap_every < 1:
                raise ConfigError(f"swap_every {swap_every!r}: on_new_weights needs swap_every >= 1 (tokens between polls)")
        if drop_finished is not None and not 0 < drop_finished <= 1:
            raise ConfigError(f"drop_finished {drop_finished!r}: a fraction in (0, 1] of the batch (or None: off)")
        outs = []
        chunks = prompts.split(micro_batch_size) if micro_batch_size else [prompts]
        for chunk in chunks:
            ids = chunk["input_ids"].to(self.device)
            mask = chunk["attention_mask"].to(self.device)
            rec = None
            if record_routing:
                from rlkit.moe import RouterReplay

                rec = RouterReplay(self.model, "record")
            with self.autocast(), rec if rec is not None else nullcontext():
                cache = None if self.vlm else self.fast_loop_applies(ids.shape[1] + max_new_tokens)  # VLM: generate
                if cache is not None:
                    resp, lp, ver, version = self.decode(
                        ids, mask, cache, max_new_tokens, temperature, top_p, top_k, return_log_probs,
                        drop_finished, swap_every, on_new_weights, swap_mode, version,
                    )  # fmt: skip
                elif on_new_weights is not None:
                    raise ConfigError(
                        f"on_new_weights: {type(self.model).__name__} generates with generate (see the warning); only the fast loop swaps weights"
                    )
                else:
                    resp, lp = self.hf_generate(ids, mask, max_new_tokens, temperature, top_p, top_k, return_log_probs, chunk)
            piece = assemble(chunk, resp, self.eos, self.tokenizer.pad_token_id)
            if rec is not None:
                routing = rec.routing(rows=len(piece), length=piece["input_ids"].shape[1]).to(torch.int16)
                piece["routed_experts"] = routing.masked_fill(~piece["attention_mask"].bool()[:, :, None, None], -1)
            if lp is not None:
                piece["rollout_log_probs"] = lp * piece["response_mask"]
            if on_new_weights is not None:
                piece["token_version"] = torch.where(piece["response_mask"].bool(), ver, -1)
            outs.append(piece)
        return DataProto.concat(outs)

    def hf_generate(self, ids, mask, max_new_tokens, temperature, top_p, top_k, return_log_probs, chunk=None):
        """One batch through transformers' generate (each group's prompt prefilled once): responses (B, R) on the CPU,
        padded with pad after the last step, and the sampled tokens' log-probs (B, R) or None. A vision-language
        model gets its rows' images (`chunk`) and the vision tokens banned, and no shared prefill (M-RoPE positions)."""
        kwargs = dict(
            do_sample=temperature > 0,
            max_new_tokens=max_new_tokens,
            eos_token_id=self.eos,
            pad_token_id=self.tokenizer.pad_token_id,
            **NEUTRAL_SAMPLING,
        )
        if temperature > 0:
            kwargs.update(temperature=temperature, top_p=top_p, top_k=top_k or None)
        else:
            kwargs.update(temperature=None, top_p=None, top_k=None)
        record = SampledLogProbs(temperature) if return_log_probs else None
        if record is not None:
            from transformers import LogitsProcessorList

            kwargs["logits_processor"] = LogitsProcessorList([record])
        if self.vlm:  # the rows' own images; no response may contain a vision token (rlkit/vlm.py)
            from rlkit import vlm

            kwargs.update(vlm.model_inputs(chunk, ids, self.model.config, self.device), suppress_tokens=self.banned)
        cache = None if self.vlm else self.shared_prefill(ids, mask)  # a VLM: 1-D prefill positions would be wrong
        if cache is None:
            cache = cast_cache(self.kv_dtype, self.model.config)
        out = self.model.generate(input_ids=ids, attention_mask=mask, **{self.cache_arg: cache}, return_dict_in_generate=True, **kwargs)
        resp = out.sequences[:, ids.shape[1] :].cpu()
        width = resp.shape[1]
        if width < max_new_tokens:  # every row stopped early: pad to a fixed width
            pad = torch.full((len(resp), max_new_tokens - width), self.tokenizer.pad_token_id, dtype=resp.dtype)
            resp = torch.cat([resp, pad], dim=1)
        lp = None
        if record is not None:
            lp = torch.zeros(len(resp), max_new_tokens)
            lp[:, :width] = record.finish(out.sequences).cpu()
        return resp, lp

    def decode(
        self, ids, mask, cache, max_new_tokens, temperature, top_p, top_k, return_log_probs,
        drop_finished: float | None = None, swap_every: int = 0, on_new_weights=None, swap_mode: str = "keep_kv", version: int = 0,
    ):  # fmt: skip
        """generate's sampling loop (transformers 5.x `GenerationMixin._sample`) written out for rlkit's case, the same
        ops in the same order, so the same tokens for the same seed (tests/test_fast_generation.py):

            logits = forward(last tokens)[:, -1] in float32          # the prompt (or its last token) first, then 1 per step
            greedy: y = argmax(logits);  sampled: y ~ softmax(top_p(top_k(logits / T)))   # transformers' warpers; multinomial
            y = pad on rows already ended;  a row ends at its first EOS;  stop when all have, or after R steps

        The KV cache is `cache` (growing_cache: written in place, no per-step copy) and each group's prompt is prefilled
        once (shared_prefill). Returns responses (B, R) on the CPU, padded with pad, log softmax(logits / T)[y] (B, R)
        of each sampled token (SampledLogProbs' values) or None, the policy version that sampled each token (B, R) and
        the version after the last step.

        drop_finished (a fraction, or None: off): once the ended rows are at least this fraction of the rows still in
        the batch, they leave it (KV cache rows, tokens, positions, mask, sampling state), so later steps run on live
        rows only; results go back to each row's original place. torch.multinomial(p, 1) is argmax(p / q) with
        q ~ Exp(1) drawn for the whole (rows, V) tensor, so with rows dropped the loop draws q for all B rows as before
        and takes the live rows' lines: every row gets the random numbers it got in the full batch, and the generator
        ends in the same state. Tokens and log-probs are then bit-identical wherever the forward computes a row the
        same bits whatever the batch size (an AVX2 CPU); where a kernel chosen by row count rounds otherwise (an
        AVX-512 CPU: ~5e-7 on a log-prob; a GPU GEMM), log-probs differ by rounding and a token only at a near-tie.

        swap_every / on_new_weights / swap_mode (in-flight weight updates, issue #37): before sampling token t, for
        t = C, 2C, ... (C = swap_every), on_new_weights() returns None (keep going) or (version, weights): weights, a
        state dict loaded into the model in place or a callable(model) that loads them; then "keep_kv" (PipelineRL)
        continues on the KV cache computed so far, "reprefill" (partial rollout) recomputes the cache of prompt + the
        tokens so far under the new weights first. Each token's version is the one of the weights that sampled it."""
        from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

        (B, P), R, pad = ids.shape, max_new_tokens, self.tokenizer.pad_token_id
        warpers = LogitsProcessorList()  # generate's order: temperature, top-k, top-p (each only when it acts)
        if temperature > 0 and temperature != 1.0:
            warpers.append(TemperatureLogitsWarper(temperature))
        if temperature > 0 and top_k:
            warpers.append(TopKLogitsWarper(top_k=top_k, min_tokens_to_keep=1))
        if temperature > 0 and top_p < 1.0:
            warpers.append(TopPLogitsWarper(top_p=top_p, min_tokens_to_keep=1))
        attn = torch.ones(B, P + R, dtype=mask.dtype, device=mask.device)  # (B, P+R): the prompt's mask, then 1 per step
        attn[:, :P] = mask
        pos = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)  # (B, P) generate's position ids
        shared = self.shared_prefill(ids, mask, cache)
        tokens, pos = (ids[:, -1:], pos[:, -1:]) if shared is not None else (ids, pos)
        cache = shared if shared is not None else cache
        eos = torch.tensor(self.eos, dtype=ids.dtype, device=ids.device)
        responses = torch.full((B, R), pad, dtype=ids.dtype, device=ids.device)  # (B, R)
        log_probs = torch.zeros(B, R, device=ids.device) if return_log_probs else None
        versions = torch.full((B, R), version, dtype=torch.long)  # (B, R) on the CPU: a step's version is one number
        t_lp = temperature if temperature > 0 else 1.0
        unfinished = torch.ones(B, dtype=torch.bool, device=ids.device)
        rows = None  # the original index of each row in the batch once rows have been dropped (None: all B, in order)
        for t in range(R):
            if on_new_weights is not None and swap_every and t and t % swap_every == 0:
                got = on_new_weights()
                if got is not None:
                    version, weights = got
                    load_weights(self.model, weights)
                    versions[:, t:] = version
                    if swap_mode == "reprefill":  # the prompt + tokens so far, as a prompt of P + t, under the new weights
                        cache = growing_cache(self.model.config, P + R, self.kv_dtype)
                        at = attn[:, : P + t]
                        tokens = torch.cat([ids if rows is None else ids[rows], (responses if rows is None else responses[rows])[:, :t]], 1)
                        pos = (at.long().cumsum(-1) - 1).masked_fill(at == 0, 0)
            out = self.model(
                input_ids=tokens,
                attention_mask=attn[:, : P + t],
                position_ids=pos,
                **{self.cache_arg: cache},
                use_cache=True,
                logits_to_keep=1,
            )
            logits = out.logits[:, -1].to(copy=True, dtype=torch.float32)  # (B, V)
            del out
            if temperature > 0:
                probs = torch.softmax(warpers(tokens, logits), dim=-1)
                if rows is None:
                    y = torch.multinomial(probs, num_samples=1).squeeze(1)
                else:  # multinomial's own draw for all B rows (argmax(p / q), q ~ Exp(1)), the live rows' lines
                    q = torch.empty((B, probs.shape[1]), dtype=probs.dtype, device=probs.device).exponential_(1)
                    y = torch.argmax(probs / q[rows], dim=-1)
            else:
                y = torch.argmax(logits, dim=-1)
            y = torch.where(unfinished, y, pad)  # (B,)
            if rows is None:
                responses[:, t] = y
            else:
                responses[rows, t] = y
            if log_probs is not None:
                lp = logprobs_from_logits(logits / t_lp, y)
                if rows is None:
                    log_probs[:, t] = lp
                else:
                    log_probs[rows, t] = lp
            unfinished &= ~torch.isin(y, eos)
            if not unfinished.any():
                break
            tokens, pos = y[:, None], pos[:, -1:] + 1
            if drop_finished is not None and len(unfinished) > DROP_MIN_ROWS:
                ended = int((~unfinished).sum())
                if ended and ended >= drop_finished * len(unfinished):
                    keep = unfinished.nonzero().squeeze(1)
                    if len(keep) < DROP_MIN_ROWS:  # ended rows fill the batch up to DROP_MIN_ROWS (they sample pad)
                        keep = torch.cat([keep, (~unfinished).nonzero().squeeze(1)[: DROP_MIN_ROWS - len(keep)]]).sort().values
                    rows = keep if rows is None else rows[keep]
                    cache.batch_select_indices(keep)
                    tokens, pos, attn, unfinished = tokens[keep], pos[keep], attn[keep], unfinished[keep]
        return responses.cpu(), None if log_probs is None else log_probs.cpu(), versions, version


def load_weights(model, weights) -> None:
    """Load `weights` into `model` in place: a callable(model) loads them itself; a state dict is copied into the
    parameters and buffers it names (keys of model.state_dict(); a key the model lacks is an error)."""
    if callable(weights):
        weights(model)
        return
    unexpected = model.load_state_dict(weights, strict=False).unexpected_keys
    if unexpected:
        raise ConfigError(
            f"on_new_weights: {len(unexpected)} weights the model does not have ({unexpected[:3]}...): pass model.state_dict()'s keys"
        )
