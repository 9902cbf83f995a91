"""Ulysses sequence parallelism (issue #38 item 3; --trainer.sp-size, docs/scaling.md).

S ranks (the "SP group") each hold T/S consecutive positions of every row. Everything but attention is per
position, so each rank runs the embeddings, MLPs, norms and LM head on its own shard. Attention needs the whole
sequence, so around it each rank swaps its sequence shard for a head shard with one all_to_all:

    q, k, v on rank r: (B, T/S, H, D)  --all_to_all-->  (B, T, H/S, D)   heads [r H/S, (r+1) H/S), all positions
    ordinary causal attention over the whole sequence on those H/S heads
    output (B, T, H/S, D)              --all_to_all-->  (B, T/S, H, D)   back to the sequence shard

(one all_to_all_single for q, k, v stacked and one for the output: two per attention layer). Rotary embeddings
are per position, so each rank applies them on its shard with the shard's global position ids (`shard`).
GQA with H_kv < S KV heads (or S not dividing H_kv): each KV head is repeated r = S / gcd(H_kv, S) times
before the swap (`kv_repeats`), so H_kv r = lcm(H_kv, S) divides both S's share and H.

Next-token labels are rolled before the split (`roll_labels`), so the last position of rank r's shard carries
x at the first position of rank r+1's shard. Log-probs and entropy are per position: computed on the shard,
gathered along the sequence (`gather_seq`, whose backward keeps the rank's own slice of the gradient). A loss
computed identically on every rank from the gathered values then gives each rank the gradient of its own uses
of the weights, and their SUM over the SP group is the full gradient (tests/test_ulysses.py checks all of it
against S = 1).

Scope: causal rows with no padding mask (right padding after the real tokens is harmless: causal attention never
reads it; left-padded rollout rows are shifted left first, shift_left); packed rows and the shared-prompt layout are
not supported here (docs/scaling.md). Wired to --trainer.sp-size by rlkit/fsdp_workers.py and engine.forward_sp.
"""

from __future__ import annotations

import math
from contextlib import contextmanager

import torch
import torch.distributed as dist

from rlkit.errors import ConfigError

ULYSSES_ATTENTION = "rlkit_ulysses_sdpa"


def _a2a(x: torch.Tensor, group) -> torch.Tensor:
    """all_to_all_single on dim 0: chunk j of x goes to rank j; chunk i of the result came from rank i."""
    x = x.contiguous()
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    return out


def _seq_to_head(x: torch.Tensor, group) -> torch.Tensor:
    """(B, T/S, H, D) sequence shard -> (B, T, H/S, D) head shard (this rank's heads, all positions)."""
    s = dist.get_world_size(group)
    b, t, h, d = x.shape
    x = x.reshape(b, t, s, h // s, d).permute(2, 0, 1, 3, 4)  # (S, B, T/S, H/S, D): chunk j = rank j's heads
    x = _a2a(x, group)  # (S, B, T/S, H/S, D): chunk i = rank i's positions of my heads
    return x.permute(1, 0, 2, 3, 4).reshape(b, s * t, h // s, d)


def _head_to_seq(x: torch.Tensor, group) -> torch.Tensor:
    """(B, T, H/S, D) head shard -> (B, T/S, H, D) sequence shard: the inverse of _seq_to_head."""
    s = dist.get_world_size(group)
    b, t, h, d = x.shape
    x = x.reshape(b, s, t // s, h, d).permute(1, 0, 2, 3, 4)  # (S, B, T/S, H/S, D): chunk j = rank j's positions
    x = _a2a(x, group)  # chunk i = my positions of rank i's heads
    return x.permute(1, 2, 0, 3, 4).reshape(b, t // s, s * h, d)


class SeqToHead(torch.autograd.Function):
    """_seq_to_head with autograd: an all_to_all is a permutation of the group's elements, so its backward is
    the inverse permutation (the inverse all_to_all, _head_to_seq) applied to the gradient."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _seq_to_head(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _head_to_seq(grad, ctx.group), None


class HeadToSeq(torch.autograd.Function):
    """_head_to_seq with autograd; backward: _seq_to_head."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _head_to_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _seq_to_head(grad, ctx.group), None


class GatherSeq(torch.autograd.Function):
    """(B, T/S, ...) shards -> (B, T, ...) on every rank; backward: this rank's slice of the gradient (each rank
    holds the same loss of the gathered tensor, so summing the slices over ranks would count it S times)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group, ctx.rank, ctx.n = group, dist.get_rank(group), x.shape[1]
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, 1)

    @staticmethod
    def backward(ctx, grad):
        return grad[:, ctx.rank * ctx.n : (ctx.rank + 1) * ctx.n].contiguous(), None


def gather_seq(x: torch.Tensor, group) -> torch.Tensor:
    """GatherSeq.apply: the per-position values of all S shards, in order, along dim 1."""
    return GatherSeq.apply(x, group)


def kv_repeats(num_heads: int, num_kv_heads: int, sp: int) -> int:
    """r, how many times each KV head is repeated before the swap so that S ranks each get whole KV heads:

    r = S / gcd(H_kv, S)   (H_kv r = lcm(H_kv, S); 1 when S divides H_kv). Needs S | H (each rank H/S query heads);
    then lcm(H_kv, S) | H and query head h still reads KV head h // (H / (H_kv r)) after the split."""
    if num_heads % sp:
        raise ConfigError(f"sequence parallel size {sp} must divide the model's {num_heads} attention heads: use a divisor of {num_heads}")
    return sp // math.gcd(num_kv_heads, sp)


def ulysses_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, ulysses_group=None, **kwargs):
    """A transformers attention function: query (B, H, T/S, D), key/value (B, H_kv, T/S, D) of this rank's
    positions -> ((B, T/S, H, D), None). Causal sdpa over all T positions on this rank's H/S heads; attention_mask
    is ignored (always None here: ulysses_mask)."""
    from transformers.integrations.sdpa_attention import repeat_kv

    if ulysses_group is None:  # no plain fallback: ulysses_mask dropped the padding mask a plain call would need
        raise ValueError("ulysses attention needs ulysses_group=...: call the model inside `ulysses(model)` through sp_token_logprobs")
    r = kv_repeats(query.shape[1], key.shape[1], dist.get_world_size(ulysses_group))
    if r > 1:
        key, value = repeat_kv(key, r), repeat_kv(value, r)  # (B, H_kv r, T/S, D), each head r times in a row
    s, hq, hk = dist.get_world_size(ulysses_group), query.shape[1], key.shape[1]
    b, _, t, d = query.shape
    # one all_to_all for q, k and v: the heads ordered as S blocks of (H/S query, H_kv r/S key, H_kv r/S value heads)
    blocks = torch.cat([z.transpose(1, 2).reshape(b, t, s, -1, d) for z in (query, key, value)], 3).reshape(b, t, -1, d)
    full = SeqToHead.apply(blocks, ulysses_group)  # (B, T, (H + 2 H_kv r) / S, D)
    q, k, v = full.split([hq // s, hk // s, hk // s], 2)
    q, k, v = (z.transpose(1, 2) for z in (q, k, v))  # (B, H/S, T, D), (B, H_kv r/S, T, D)
    if hq // hk > 1:  # GQA on the rank's heads: query head i reads KV head i // (H / (H_kv r))
        k, v = repeat_kv(k, hq // hk), repeat_kv(v, hq // hk)
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True, scale=scaling).transpose(1, 2)
    return HeadToSeq.apply(out.contiguous(), ulysses_group), None


def ulysses_mask(*args, **kwargs):
    """The mask function for ULYSSES_ATTENTION: none (ulysses_attention is causal over the gathered sequence)."""
    return None


def register() -> None:
    """Register ulysses_attention (and its mask function) with transformers under ULYSSES_ATTENTION."""
    from transformers import AttentionInterface, AttentionMaskInterface

    AttentionInterface.register(ULYSSES_ATTENTION, ulysses_attention)
    AttentionMaskInterface.register(ULYSSES_ATTENTION, ulysses_mask)


@contextmanager
def ulysses(model):
    """The model's attention set to ULYSSES_ATTENTION for the block (calls must pass ulysses_group=...)."""
    register()
    config = model.config
    before = config._attn_implementation
    config._attn_implementation = ULYSSES_ATTENTION
    try:
        yield
    finally:
        config._attn_implementation = before


def roll_labels(input_ids: torch.Tensor) -> torch.Tensor:
    """labels[:, t] = input_ids[:, t + 1] (B, T): rolled *before* the split, so every shard's last position has its
    label (the first token of the next shard). The last column wraps to input_ids[:, 0] and is no label: drop it."""
    return torch.roll(input_ids, -1, dims=1)


def pad_to_multiple(x: torch.Tensor, sp: int, value) -> torch.Tensor:
    """(B, T) -> (B, ceil(T/S) S), right-padded with value (causal attention never reads past a real token)."""
    extra = -x.shape[1] % sp
    return torch.nn.functional.pad(x, (0, extra), value=value) if extra else x


def shard(x: torch.Tensor, group) -> torch.Tensor:
    """This rank's T/S consecutive positions of x (B, T, ...): positions [r T/S, (r+1) T/S)."""
    s, r = dist.get_world_size(group), dist.get_rank(group)
    n = x.shape[1] // s
    return x[:, r * n : (r + 1) * n]


def sp_token_logprobs(model, input_ids: torch.Tensor, group, temperature: float = 1.0, with_entropy: bool = False, position_ids=None):
    """Per-token log-probs log p(x_{t+1} | x_<=t) (B, T-1), and entropy H_t (B, T-1) or None, of whole rows
    input_ids (B, T), computed with the sequence split over the SP group and gathered: equal to the one-process
    values (tests/test_ulysses.py). Every rank passes the same rows; each runs the model on its shard only.

    position_ids (B, T) default 0..T-1. Steps: pad T to a multiple of S; roll the labels; shard ids, positions and
    labels; forward with ulysses attention; log-probs on the shard (algos.token_logprob_entropy); gather_seq; drop
    the padding and the last (label-less) column."""
    from rlkit import algos

    b, t = input_ids.shape
    sp = dist.get_world_size(group)
    if position_ids is None:
        position_ids = torch.arange(t, device=input_ids.device).expand(b, t)
    ids = pad_to_multiple(input_ids, sp, 0)
    pos = pad_to_multiple(position_ids, sp, 0)
    labels = shard(roll_labels(ids), group)
    with ulysses(model):
        logits = model(input_ids=shard(ids, group), position_ids=shard(pos, group), use_cache=False, ulysses_group=group).logits
    n = logits.shape[1]
    flat = logits.reshape(b * n, -1)  # (B T/S, V)
    lp, ent = algos.token_logprob_entropy(flat, torch.arange(b * n, device=flat.device), labels.reshape(-1), temperature, with_entropy)
    lp = gather_seq(lp.view(b, n), group)[:, : t - 1]
    if not with_entropy:
        return lp, None
    return lp, gather_seq(ent.view(b, n), group)[:, : t - 1]


class ScaleGrad(torch.autograd.Function):
    """Identity forward; backward multiplies the gradient by `factor`."""

    @staticmethod
    def forward(ctx, x, factor):
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.factor, None


def shift_left(input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor):
    """Rows [pad.. tokens.. pad..] -> [tokens.. pad..]: each row moved left by its leading padding, position ids kept, so
    the padding is on the right where causal attention never reads it (ulysses_attention takes no padding mask).
    Returns (ids, positions, lead (B,)); a row whose tokens are not contiguous (padding inside) is refused."""
    b, t = input_ids.shape
    lead = (attention_mask.cumsum(1) == 0).sum(1)  # (B,) leading padding
    src = torch.arange(t, device=input_ids.device) + lead[:, None]
    inside = src < t
    src = src.clamp(max=t - 1)
    mask = attention_mask.gather(1, src) * inside
    if not torch.equal(mask.bool(), torch.arange(t, device=mask.device) < attention_mask.sum(1, keepdim=True)):
        raise ValueError("sequence parallelism needs each row's tokens contiguous (padding only before and after them)")
    ids = torch.where(inside, input_ids.gather(1, src), torch.zeros_like(input_ids))
    pos = torch.where(inside, position_ids.gather(1, src), torch.zeros_like(position_ids))
    return ids, pos, lead
