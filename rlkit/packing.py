"""Padding-free forward passes: sequences packed into rows, each group's shared prompt computed once.

The padded layout runs every row as prompt ++ response, left-padded prompts and right-padded responses:
a micro-batch of b rows costs b * (P + R) positions, however short most responses are, and GRPO's n rows
of a group compute the same prompt n times. The packed layout keeps only real tokens (attention_mask = 1):

    segment   a prompt's tokens once, then the tokens of each of its responses:  p p p | r1 r1 | r2 r2 r2 | ...
              (consecutive rows with the same prompt form one segment: batch.repeat(n, interleave=True))
    row       segments laid end to end, first-fit into rows as long as the longest segment

and one 4D boolean attention mask says who sees whom: a token attends to the earlier tokens of its own
segment that are its prompt or its own response, never another response nor another segment. Position ids
are each sequence's own (`position_ids`), so every response token sees exactly the keys and positions it
sees in the padded layout: the same log-probs up to float summation order (tests/test_packing.py).
The gradient of the shared prompt is the sum over its n responses, as in the padded layout.

Cost per segment: P + sum_i R_i positions instead of n * (P + max R). Attention runs on the dense
(row length)^2 mask, a row being no longer than the longest segment, so it never costs more than the
padded layout's rows do. The mask is not shipped: `pack` returns each position's segment and sub-sequence
ids (rows, C), and `block_mask` builds the (rows, C, C) mask from them with four tensor ops on the device
that runs the model (no host loop, no host-to-device copy of C^2 booleans).

flash_attention_2 takes no 4D mask. It takes packed sequences instead ("varlen": one row, position ids
restarting at 0 where a sequence starts, no attention mask): `pack(..., share=False, one_row=True)` lays
every prompt ++ response out once, end to end, in one row, and transformers' flash-attention path cuts it
at the position-id restarts (sdpa and eager do the same from the position ids, so the layout is tested on
CPU). A shared prompt cannot be expressed that way, so flash-attention packs without sharing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Packed:
    """A micro-batch in the packed layout (see the module docstring); K = positions whose logits are read."""

    input_ids: torch.Tensor  # (rows, C)
    position_ids: torch.Tensor  # (rows, C)
    segment_ids: torch.Tensor  # (rows, C) the segment of each position, -1 = padding
    sub_ids: torch.Tensor  # (rows, C) 0 = the segment's prompt, k = its k-th response
    read: torch.Tensor  # (K,) positions (in the row) of the logits read, sorted: the model's logits_to_keep
    src_row: torch.Tensor  # (T,) for each response token read: its packed row
    src_k: torch.Tensor  # (T,) ... the index into `read` of the position predicting it
    dst_row: torch.Tensor  # (T,) ... its row in the batch
    dst_col: torch.Tensor  # (T,) ... its column in responses
    labels: torch.Tensor  # (T,) ... the token
    origin: torch.Tensor | None = None  # (rows, C) each position's flat index b * L + column in the input, -1 = padding
    place: torch.Tensor | None = None  # (b, L) each input position's flat index row * C + column in the packed rows, -1 = none

    @property
    def num_positions(self) -> int:
        return self.input_ids.numel()

    @property
    def attention_mask(self) -> torch.Tensor:
        """(rows, 1, C, C) bool, True = attend: block_mask on the ids' device."""
        return block_mask(self.segment_ids, self.sub_ids)[:, None]


def block_mask(seg: torch.Tensor, sub: torch.Tensor) -> torch.Tensor:
    """Who sees whom, (rows, C) ids -> (rows, C, C) bool on their device: query i sees key j iff

        seg_i = seg_j >= 0  and  j <= i  and  (sub_j = 0 or sub_j = sub_i)      (or i = j: padding sees itself)

    i.e. the earlier tokens of its own segment that are the prompt or its own response.
    """
    idx = torch.arange(seg.shape[-1], device=seg.device)
    causal = idx[None, :] <= idx[:, None]  # (C, C) key <= query
    same_seg = (seg[:, :, None] == seg[:, None, :]) & (seg[:, :, None] >= 0)  # (rows, C, C)
    same_sub = (sub[:, None, :] == 0) | (sub[:, :, None] == sub[:, None, :])
    return (causal & same_seg & same_sub) | (idx[None, :] == idx[:, None])  # the diagonal: no empty softmax row


def group_starts(prompts: torch.Tensor, prompt_mask: torch.Tensor, share: bool) -> list[int]:
    """Indices of the rows that start a segment: every row, or with share the first of each run of equal prompts."""
    if not share or len(prompts) < 2:
        return list(range(len(prompts)))
    same = (prompts[1:] == prompts[:-1]).all(-1) & (prompt_mask[1:] == prompt_mask[:-1]).all(-1)  # (b-1,)
    return [0] + [i + 1 for i in range(len(same)) if not same[i]]


def segment_tokens(mask_row: torch.Tensor) -> torch.Tensor:
    """Column indices where a row holds a token (attention_mask = 1)."""
    return mask_row.nonzero().squeeze(-1)


def pack(input_ids, attention_mask, position_ids, prompt_len: int, share: bool = True, pad_id: int = 0, one_row: bool = False) -> Packed:
    """The packed layout of one micro-batch (CPU tensors (b, P+R) in the rollout's layout).

    one_row: every segment in a single row (the varlen layout of flash-attention), else rows as long as the longest segment.
    """
    b, width = input_ids.shape
    starts = group_starts(input_ids[:, :prompt_len], attention_mask[:, :prompt_len], share) + [b]
    segments = []  # per segment: (ids, pos, sub) lists and the reads: (position in segment, batch row, response column)
    for g in range(len(starts) - 1):
        rows = range(starts[g], starts[g + 1])
        first = rows[0]
        pcols = segment_tokens(attention_mask[first, :prompt_len])
        src = [first * width + pcols]  # each token's flat index in the input: the prompt's from the group's first row
        ids = [input_ids[first, pcols]]
        pos = [position_ids[first, pcols]]
        sub = [torch.zeros(len(pcols), dtype=torch.long)]  # 0 = the prompt, k = the k-th response of the segment
        reads = []
        n_tok = len(pcols)
        for k, r in enumerate(rows, start=1):
            rcols = segment_tokens(attention_mask[r, prompt_len:])
            ids.append(input_ids[r, prompt_len + rcols])
            src.append(r * width + prompt_len + rcols)
            pos.append(position_ids[r, prompt_len + rcols])
            sub.append(torch.full((len(rcols),), k, dtype=torch.long))
            # response token j is predicted at the position before it: the prompt's last token, then token j-1
            before = torch.arange(n_tok - 1, n_tok - 1 + len(rcols))
            before[0:1] = len(pcols) - 1
            reads.append((before, torch.full((len(rcols),), r), rcols))
            n_tok += len(rcols)
        segments.append((torch.cat(ids), torch.cat(pos), torch.cat(sub), reads, torch.cat(src), (first, rows[-1] + 1, pcols)))
    # first-fit decreasing into rows of the longest segment's length
    cap = sum(len(s[0]) for s in segments) if one_row else max(len(s[0]) for s in segments)
    order = sorted(range(len(segments)), key=lambda i: -len(segments[i][0]))
    bins: list[list[int]] = []
    fill: list[int] = []
    for i in order:
        need = len(segments[i][0])
        j = next((j for j in range(len(bins)) if fill[j] + need <= cap), None)
        if j is None:
            bins.append([]), fill.append(0)
            j = len(bins) - 1
        bins[j].append(i)
        fill[j] += need
    n_rows = len(bins)
    ids = torch.full((n_rows, cap), pad_id, dtype=input_ids.dtype)
    pos = torch.zeros(n_rows, cap, dtype=position_ids.dtype)
    seg = torch.full((n_rows, cap), -1, dtype=torch.long)  # -1 = padding
    sub = torch.zeros(n_rows, cap, dtype=torch.long)
    origin = torch.full((n_rows, cap), -1, dtype=torch.long)
    src_row, src_pos, dst_row, dst_col = [], [], [], []
    for j, members in enumerate(bins):
        at = 0
        for i in members:
            s_ids, s_pos, s_sub, reads, s_src, _ = segments[i]
            L = len(s_ids)
            ids[j, at : at + L], pos[j, at : at + L], sub[j, at : at + L], seg[j, at : at + L] = s_ids, s_pos, s_sub, i
            origin[j, at : at + L] = s_src
            for before, r, c in reads:
                src_row.append(torch.full_like(before, j))
                src_pos.append(before + at)
                dst_row.append(r)
                dst_col.append(c)
            at += L
    src_row, src_pos, dst_row, dst_col = (torch.cat(x).long() for x in (src_row, src_pos, dst_row, dst_col))
    read, src_k = torch.unique(src_pos, sorted=True, return_inverse=True)
    labels = input_ids[dst_row, prompt_len + dst_col]
    place = torch.full((b * width,), -1, dtype=torch.long)
    real = origin.reshape(-1) >= 0
    place[origin.reshape(-1)[real]] = real.nonzero().squeeze(-1)
    place = place.view(b, width)
    for *_, (first, end, pcols) in segments:  # a shared prompt's other rows read the first row's positions
        place[first + 1 : end, pcols] = place[first, pcols]
    return Packed(ids, pos, seg, sub, read, src_row, src_k, dst_row, dst_col, labels, origin, place)


def pack_like(p: Packed, x: torch.Tensor, fill: int = -1) -> torch.Tensor:
    """A per-token tensor x (b, L, ...) in the input's layout laid out like p.input_ids: (rows, C, ...), `fill` at padding.
    A shared prompt's positions take the group's first row's values (the tokens the packed row holds)."""
    flat = x.reshape(-1, *x.shape[2:])
    out = flat.new_full((p.origin.numel(), *x.shape[2:]), fill)
    real = p.origin.reshape(-1) >= 0
    out[real] = flat[p.origin.reshape(-1)[real]]
    return out.view(*p.origin.shape, *x.shape[2:])


def unpack_like(p: Packed, y: torch.Tensor, fill: int = -1) -> torch.Tensor:
    """The inverse of pack_like: y (rows, C, ...) in the packed layout -> (b, L, ...) in the input's, `fill` where the
    input has no token; every row of a shared prompt gets the prompt's values."""
    flat = y.reshape(-1, *y.shape[2:])
    out = flat.new_full((p.place.numel(), *y.shape[2:]), fill)
    real = p.place.reshape(-1) >= 0
    out[real] = flat[p.place.reshape(-1)[real]]
    return out.view(*p.place.shape, *y.shape[2:])


def row_costs(input_ids, attention_mask, prompt_len: int, share: bool) -> tuple[list[int], list[int], set[int]]:
    """(response tokens, prompt tokens, rows that start a segment) of every row: what split_by_tokens charges."""
    resp = attention_mask[:, prompt_len:].sum(-1).tolist()
    prompt = attention_mask[:, :prompt_len].sum(-1).tolist()
    starts = set(group_starts(input_ids[:, :prompt_len], attention_mask[:, :prompt_len], share))
    return resp, prompt, starts


def span_cost(costs, a: int, b: int) -> int:
    """Packed positions of rows [a, b): their responses, plus the prompt of every row that starts a segment (or the span)."""
    resp, prompt, starts = costs
    return sum(resp[i] + (prompt[i] if i in starts or i == a else 0) for i in range(a, b))


def split_by_tokens(input_ids, attention_mask, prompt_len: int, share: bool, budget: int) -> list[tuple[int, int]]:
    """Consecutive [start, end) row ranges, each costing at most `budget` packed positions (a row over it goes alone).

    A row costs its response tokens, plus its prompt tokens when it starts a segment (a new prompt, or the first
    row of a micro-batch): what it adds to the packed layout.
    """
    resp, prompt, starts = row_costs(input_ids, attention_mask, prompt_len, share)
    out, start, total = [], 0, 0
    for i in range(len(resp)):
        cost = resp[i] + (prompt[i] if i in starts or i == start else 0)
        if total + cost > budget and i > start:
            out.append((start, i))
            start, total = i, 0
            cost = resp[i] + prompt[i]
        total += cost
    if start < len(resp):
        out.append((start, len(resp)))
    return out


def split_to_count(spans: list[tuple[int, int]], costs, count: int) -> list[tuple[int, int]]:
    """The same rows in exactly `count` consecutive spans (len(spans) <= count <= rows): the costliest span of 2+ rows
    is cut where its two halves cost the most alike, until there are `count`. Cutting never makes a span costlier
    (the second half pays its prompt again, which the whole span paid once), so every span stays within the budget
    split_by_tokens kept. Data-parallel processes run the same number of micro-batches this way (engine.micro_batches).
    """
    spans = list(spans)
    if count > spans[-1][1] - spans[0][0]:
        raise RuntimeError(f"{count} micro-batches asked of {spans[-1][1] - spans[0][0]} rows")
    while len(spans) < count:
        j = max((j for j, (a, b) in enumerate(spans) if b - a > 1), key=lambda j: span_cost(costs, *spans[j]))
        a, b = spans[j]
        cut = min(range(a + 1, b), key=lambda c: abs(span_cost(costs, a, c) - span_cost(costs, c, b)))
        spans[j : j + 1] = [(a, cut), (cut, b)]
    return spans


# ---------------------------------------------------------------------------
# Split attention: the block mask's attention, computed per sequence (only the pairs it allows)
# ---------------------------------------------------------------------------
#
# The dense block mask costs (row length)^2 query-key pairs per layer: a group of a P-token prompt and n responses
# of R tokens pays (P + nR)^2, where its tokens need P^2/2 + n (PR + R^2/2) (P = 200, R = 160, n = 8: 2.2M pairs
# against 0.6M). Split attention runs the same attention as one sdpa call per sequence instead: the prompt causal
# against itself, each response against [its prompt, itself causal], padding against itself; outputs laid back in
# the row's order. Same result as the mask to float rounding, with gradients (unlike FlexAttention on CPU, which has
# no backward in torch 2.13), any device. The engine passes it as a transformers attention function
# (SPLIT_ATTENTION) with the layout in a keyword argument; other calls (generation) go to sdpa unchanged.

SPLIT_ATTENTION = "rlkit_split_sdpa"


@dataclass
class Spans:
    """Each packed row as runs of positions: ("prompt", start, end), ("response", start, end, prompt_start,
    prompt_end), ("pad", start, end), in order; masks[(R, P)] the (R, P + R) bool mask of a response of R tokens
    after a P-token prompt (prompt all visible, itself causal), built once per pass on the device."""

    rows: list[list[tuple]]
    masks: dict[tuple[int, int], torch.Tensor]


def spans(seg: torch.Tensor, sub: torch.Tensor, device) -> Spans:
    """The Spans of packed ids (rows, C) (host tensors): one run per (segment, sub-sequence) change."""
    out, masks = [], {}
    for s_row, u_row in zip(seg.tolist(), sub.tolist()):
        runs, start = [], 0
        for i in range(1, len(s_row) + 1):
            if i == len(s_row) or s_row[i] != s_row[start] or u_row[i] != u_row[start]:
                runs.append((s_row[start], u_row[start], start, i))
                start = i
        row, prompts = [], {}
        for s, u, a, b in runs:
            if s < 0:
                row.append(("pad", a, b))
            elif u == 0:
                row.append(("prompt", a, b))
                prompts[s] = (a, b)
            else:
                pa, pb = prompts.get(s, (a, a))
                row.append(("response", a, b, pa, pb))
                key = (b - a, pb - pa)
                if key not in masks:
                    r, p = key
                    masks[key] = torch.cat(
                        [torch.ones(r, p, dtype=torch.bool, device=device), torch.ones(r, r, dtype=torch.bool, device=device).tril()], 1
                    )
        out.append(row)
    return Spans(out, masks)


# auto: split when it saves this many attention FLOPs per sdpa call it makes. Measured (bench/vs_trl.py --variants mask,
# 1 thread): the GSM8K shape saves ~3e8 per call and split runs its passes in 0.6x the time; the random 4.3M model's
# 19-token prompts and 32-token responses save ~7e6 per call and split was slower (the calls' overhead, small sdpa).
SPLIT_MIN_FLOPS_PER_CALL = 3e7


def split_pays(runs: Spans, length: int, width: int) -> bool:
    """Whether split attention saves more than it costs: the dense mask's pairs (rows x length^2) minus those split
    computes, at 4 x width FLOPs a pair (q.k and the values, per layer), against SPLIT_MIN_FLOPS_PER_CALL per sdpa call
    it makes instead of one. Long responses (GSM8K-shaped) pay by far; groups of a few tokens do not."""
    pairs, calls = 0, 0
    for row in runs.rows:
        for run in row:
            n = run[2] - run[1]
            if run[0] == "prompt":
                pairs, calls = pairs + n * n, calls + 1
            elif run[0] == "response":
                pairs, calls = pairs + n * (n + run[4] - run[3]), calls + 1
    return (len(runs.rows) * length**2 - pairs) * 4 * width >= SPLIT_MIN_FLOPS_PER_CALL * calls


def split_attention(
    module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, rlkit_spans: Spans | None = None, **kwargs
):
    """A transformers attention function: query (B, H, C, D), key/value (B, Hkv, C, D) -> ((B, C, H, D), None).

    With rlkit_spans: the block mask's attention, one sdpa call per run (see above). Without: sdpa, unchanged."""
    from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

    if rlkit_spans is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    rows = []
    for b, runs in enumerate(rlkit_spans.rows):
        q, k, v = query[b : b + 1], key[b : b + 1], value[b : b + 1]  # (1, H, C, D)
        parts = []
        for run in runs:
            a, e = run[1], run[2]
            if run[0] == "pad":  # padding sees itself only: its own value
                parts.append(v[:, :, a:e])
            elif run[0] == "prompt":
                parts.append(sdpa(q[:, :, a:e], k[:, :, a:e], v[:, :, a:e], is_causal=True, dropout_p=dropout, scale=scaling))
            else:
                pa, pb = run[3], run[4]
                ks = torch.cat([k[:, :, pa:pb], k[:, :, a:e]], 2)
                vs = torch.cat([v[:, :, pa:pb], v[:, :, a:e]], 2)
                mask = rlkit_spans.masks[(e - a, pb - pa)]
                parts.append(sdpa(q[:, :, a:e], ks, vs, attn_mask=mask, dropout_p=dropout, scale=scaling))
        rows.append(torch.cat(parts, 2))
    return torch.cat(rows, 0).transpose(1, 2).contiguous(), None


def register_split_attention() -> None:
    """Register split_attention with transformers (attention function, and sdpa's mask for calls without spans)."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    AttentionInterface.register(SPLIT_ATTENTION, split_attention)
    AttentionMaskInterface.register(SPLIT_ATTENTION, sdpa_mask)
