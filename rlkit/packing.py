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
padded layout's rows do. flash_attention_2 takes no 4D mask: the engine keeps the padded layout there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Packed:
    """A micro-batch in the packed layout (see the module docstring); K = positions whose logits are read."""

    input_ids: torch.Tensor  # (rows, C)
    position_ids: torch.Tensor  # (rows, C)
    attention_mask: torch.Tensor  # (rows, 1, C, C) bool, True = attend
    read: torch.Tensor  # (K,) positions (in the row) of the logits read, sorted: the model's logits_to_keep
    src_row: torch.Tensor  # (T,) for each response token read: its packed row
    src_k: torch.Tensor  # (T,) ... the index into `read` of the position predicting it
    dst_row: torch.Tensor  # (T,) ... its row in the batch
    dst_col: torch.Tensor  # (T,) ... its column in responses
    labels: torch.Tensor  # (T,) ... the token

    @property
    def num_positions(self) -> int:
        return self.input_ids.numel()


def group_starts(prompts: torch.Tensor, prompt_mask: torch.Tensor, share: bool) -> list[int]:
    """Indices of the rows that start a segment: every row, or with share the first of each run of equal prompts."""
    if not share or len(prompts) < 2:
        return list(range(len(prompts)))
    same = (prompts[1:] == prompts[:-1]).all(-1) & (prompt_mask[1:] == prompt_mask[:-1]).all(-1)  # (b-1,)
    return [0] + [i + 1 for i in range(len(same)) if not same[i]]


def segment_tokens(mask_row: torch.Tensor) -> torch.Tensor:
    """Column indices where a row holds a token (attention_mask = 1)."""
    return mask_row.nonzero().squeeze(-1)


def pack(input_ids, attention_mask, position_ids, prompt_len: int, share: bool = True, pad_id: int = 0) -> Packed:
    """The packed layout of one micro-batch (CPU tensors (b, P+R) in the rollout's layout)."""
    b = len(input_ids)
    starts = group_starts(input_ids[:, :prompt_len], attention_mask[:, :prompt_len], share) + [b]
    segments = []  # per segment: (ids, pos, sub) lists and the reads: (position in segment, batch row, response column)
    for g in range(len(starts) - 1):
        rows = range(starts[g], starts[g + 1])
        first = rows[0]
        pcols = segment_tokens(attention_mask[first, :prompt_len])
        ids = [input_ids[first, pcols]]
        pos = [position_ids[first, pcols]]
        sub = [torch.zeros(len(pcols), dtype=torch.long)]  # 0 = the prompt, k = the k-th response of the segment
        reads = []
        n_tok = len(pcols)
        for k, r in enumerate(rows, start=1):
            rcols = segment_tokens(attention_mask[r, prompt_len:])
            ids.append(input_ids[r, prompt_len + rcols])
            pos.append(position_ids[r, prompt_len + rcols])
            sub.append(torch.full((len(rcols),), k, dtype=torch.long))
            # response token j is predicted at the position before it: the prompt's last token, then token j-1
            before = torch.arange(n_tok - 1, n_tok - 1 + len(rcols))
            before[0:1] = len(pcols) - 1
            reads.append((before, torch.full((len(rcols),), r), rcols))
            n_tok += len(rcols)
        segments.append((torch.cat(ids), torch.cat(pos), torch.cat(sub), reads))
    # first-fit decreasing into rows of the longest segment's length
    cap = max(len(s[0]) for s in segments)
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
    src_row, src_pos, dst_row, dst_col = [], [], [], []
    for j, members in enumerate(bins):
        at = 0
        for i in members:
            s_ids, s_pos, s_sub, reads = segments[i]
            L = len(s_ids)
            ids[j, at : at + L], pos[j, at : at + L], sub[j, at : at + L], seg[j, at : at + L] = s_ids, s_pos, s_sub, i
            for before, r, c in reads:
                src_row.append(torch.full_like(before, j))
                src_pos.append(before + at)
                dst_row.append(r)
                dst_col.append(c)
            at += L
    src_row, src_pos, dst_row, dst_col = (torch.cat(x).long() for x in (src_row, src_pos, dst_row, dst_col))
    # who sees whom: same segment, not later, and the key is the prompt or the query's own response
    idx = torch.arange(cap)
    causal = idx[None, :] <= idx[:, None]  # (C, C) key <= query
    same_seg = (seg[:, :, None] == seg[:, None, :]) & (seg[:, :, None] >= 0)  # (rows, C, C)
    same_sub = (sub[:, None, :] == 0) | (sub[:, :, None] == sub[:, None, :])
    mask = (causal & same_seg & same_sub) | torch.eye(cap, dtype=torch.bool)  # padding sees itself: no empty softmax row
    read, src_k = torch.unique(src_pos, sorted=True, return_inverse=True)
    labels = input_ids[dst_row, prompt_len + dst_col]
    return Packed(ids, pos, mask[:, None], read, src_row, src_k, dst_row, dst_col, labels)


def split_by_tokens(input_ids, attention_mask, prompt_len: int, share: bool, budget: int) -> list[tuple[int, int]]:
    """Consecutive [start, end) row ranges, each costing at most `budget` packed positions (a row over it goes alone).

    A row costs its response tokens, plus its prompt tokens when it starts a segment (a new prompt, or the first
    row of a micro-batch): what it adds to the packed layout.
    """
    resp = attention_mask[:, prompt_len:].sum(-1).tolist()
    prompt = attention_mask[:, :prompt_len].sum(-1).tolist()
    starts = set(group_starts(input_ids[:, :prompt_len], attention_mask[:, :prompt_len], share))
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
