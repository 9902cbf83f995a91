"""Rollout adapter `hf`: sample responses with transformers' `generate` (KV-cached, batched).

Input: a DataProto of left-padded prompts (input_ids, attention_mask, position_ids).
Output: the same rows with the prompt and response laid side by side, the layout every later
step uses::

    prompts        (B, P)   left-padded prompt ids
    responses      (B, R)   generated ids, right-padded
    response_mask  (B, R)   1 for generated tokens up to and including the first EOS
    input_ids      (B, P+R) prompts ++ responses;  attention_mask, position_ids to match
"""

from __future__ import annotations

import warnings
from contextlib import nullcontext

import torch

from rlkit.algos import logprobs_from_logits
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
    b = torch.empty((), dtype=dtype).element_size()
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv = 2 * config.num_hidden_layers * (getattr(config, "num_key_value_heads", None) or heads) * head_dim * b
    act = (3 * (getattr(config, "intermediate_size", None) or 4 * config.hidden_size) + 4 * config.hidden_size) * b
    per_row = (prompt_len + response_len) * kv + prompt_len * act + config.vocab_size * (b + 12)
    return max(1, int(budget_bytes // per_row))


def free_device_memory(device: torch.device) -> int:
    """Bytes this process can still allocate on a CUDA device: the driver's free memory plus the blocks torch's caching
    allocator holds unused."""
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


class HFRollout:
    """Generation with `model.generate` on the training model itself (no second copy)."""

    def __init__(self, model, tokenizer, device, autocast=None, kv_dtype: torch.dtype | None = None):
        """autocast: a function returning the context to generate in (the engine's: bf16 compute over float32 masters).
        kv_dtype: the KV cache's dtype (the compute dtype under autocast; None: the model's)."""
        self.model, self.tokenizer, self.device = model, tokenizer, device
        self.autocast = autocast or nullcontext
        self.kv_dtype = kv_dtype
        self.eos = eos_ids(model, tokenizer)
        self._warned = False
        from rlkit import vlm

        self.vlm = vlm.is_vlm(model.config)  # images: M-RoPE positions from the model, vision tokens banned
        self.banned = vlm.vision_token_ids(model.config) if self.vlm else []

    def shared_prefill(self, ids: torch.Tensor, mask: torch.Tensor):
        """One prefill per group of n rows with the same prompt (batch.repeat(n, interleave=True)), or None.

        Runs the distinct prompts but their last token through the model and repeats the KV cache n times;
        generate() then processes only the last prompt token of every row, against that cache, and samples
        with all its options as usual. None (generate prefills every row) when the rows are not groups of
        equal size n >= 2, or the model returns no cache that can be repeated.
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
            past_key_values=cast_cache(self.kv_dtype, self.model.config),
        )
        cache = out.past_key_values
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
    ) -> DataProto:
        """Sample one response per row (repeat the prompts first for n samples). temperature 0 = greedy.

        return_log_probs: also return `rollout_log_probs` (B, R), log softmax(logits / temperature) of
        each sampled token from the raw logits of generation (0 after EOS), as the trainer computes them,
        recorded step by step (SampledLogProbs: one step's (B, V), not every step's).
        """
        outs = []
        chunks = prompts.split(micro_batch_size) if micro_batch_size else [prompts]
        for chunk in chunks:
            ids = chunk["input_ids"].to(self.device)
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
            mask = chunk["attention_mask"].to(self.device)
            if self.vlm:  # the rows' own images; no response may contain a vision token (rlkit/vlm.py)
                from rlkit import vlm

                kwargs.update(vlm.model_inputs(chunk, ids, self.model.config, self.device), suppress_tokens=self.banned)
            record = SampledLogProbs(temperature) if return_log_probs else None
            if record is not None:
                from transformers import LogitsProcessorList

                kwargs["logits_processor"] = LogitsProcessorList([record])
            with self.autocast():
                cache = None if self.vlm else self.shared_prefill(ids, mask)  # a VLM: 1-D prefill positions would be wrong
                if cache is None:
                    cache = cast_cache(self.kv_dtype, self.model.config)
                out = self.model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, return_dict_in_generate=True, **kwargs)
            resp = out.sequences[:, ids.shape[1] :].cpu()
            width = resp.shape[1]
            if width < max_new_tokens:  # every row stopped early: pad to a fixed width
                pad = torch.full((len(resp), max_new_tokens - width), self.tokenizer.pad_token_id, dtype=resp.dtype)
                resp = torch.cat([resp, pad], dim=1)
            piece = assemble(chunk, resp, self.eos, self.tokenizer.pad_token_id)
            if record is not None:
                lp = torch.zeros(len(resp), max_new_tokens)
                lp[:, :width] = record.finish(out.sequences).cpu()
                piece["rollout_log_probs"] = lp * piece["response_mask"]
            outs.append(piece)
        return DataProto.concat(outs)
