"""Evaluation with n samples per prompt: mean@n, unbiased pass@k, maj@k (docs/eval.md).

A sample is *correct* when its score is full marks (score >= 1), as `val/acc` counts for a scorer that
reports no accuracy. Every estimator is computed per prompt and averaged over the prompts (each prompt
weighs the same). Used by `python scripts/eval.py` and by validation with `--trainer.val-n` > 1.
"""

from __future__ import annotations

import math
from collections import Counter

import torch

from rlkit.protocol import DataProto


def mean_at_n(correct: list[bool]) -> float:
    """mean@n = c / n: the share of a prompt's n samples that are correct."""
    return sum(map(bool, correct)) / len(correct)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one prompt with c correct of n samples (Chen et al. 2021):

        pass@k = 1 - C(n - c, k) / C(n, k) = 1 - prod_{i = n-c+1}^{n} (1 - k / i),   and exactly 1 when n - c < k

    (every subset of k samples then holds a correct one). The product never forms the binomials, which
    overflow a float for n in the hundreds. verl's bootstrap best@k draws with replacement and reports
    1 - (1 - c/n)^k instead, biased low: 1 correct of 4 gives pass@4 = 0.684 there, 1.0 here.
    """
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def majority(answers: list, correct: list[bool]) -> bool:
    """Whether the most frequent parsed answer of these samples is correct (None = no answer, never counted).

    A tie goes to the answer that appears first (the lowest sample index): deterministic, and independent of how
    the answers sort. The majority's correctness is that of its first sample. No answer at all: not correct.
    """
    counts = Counter(a for a in answers if a is not None)
    if not counts:
        return False
    top = max(counts.values())
    first = next(i for i, a in enumerate(answers) if a is not None and counts[a] == top)
    return bool(correct[first])


def maj_at_k(answers: list, correct: list[bool], k: int) -> float:
    """maj@k of one prompt: the majority vote of k samples is correct, averaged over the floor(n / k) disjoint blocks of
    k consecutive samples (0..k-1, k..2k-1, ...).

    Each block is k independent samples, so each block, and their mean, is an unbiased estimate of maj@k; the
    blocks use every sample (lower variance than the first k alone) at the cost of one vote per sample, where the
    exact average over all C(n, k) subsets costs C(n, k) votes. For k = n it is the usual maj@n of all samples.
    """
    n = len(answers)
    if not 1 <= k <= n:
        raise ValueError(f"maj@k needs 1 <= k <= n, got n={n}, k={k}")
    blocks = range(0, n - n % k, k)
    return sum(majority(answers[b : b + k], correct[b : b + k]) for b in blocks) / len(blocks)


def ks_for(n: int) -> list[int]:
    """The k reported for n samples: 1, 2, 4, ... <= n, and n itself."""
    ks = [2**i for i in range(n.bit_length()) if 2**i <= n]
    return ks if ks[-1] == n else ks + [n]


def estimates(correct: list[list[bool]], answers: list[list] | None = None) -> dict[str, float]:
    """mean@n, pass@k (k in ks_for(n)) and, with parsed answers, maj@k (k >= 2), each averaged over the prompts.

    correct: one list of n bools per prompt; answers: the same shape, a sample's parsed answer or None.
    Keys: "mean@16", "pass@1", "pass@2", ..., "maj@2", ...
    """
    n = len(correct[0])
    if any(len(c) != n for c in correct):
        raise ValueError("every prompt needs the same number of samples")
    out = {f"mean@{n}": sum(map(mean_at_n, correct)) / len(correct)}
    for k in ks_for(n):
        out[f"pass@{k}"] = sum(pass_at_k(n, sum(map(bool, c)), k) for c in correct) / len(correct)
    if answers is not None and any(a is not None for row in answers for a in row):
        for k in ks_for(n)[1:]:
            out[f"maj@{k}"] = sum(maj_at_k(a, c, k) for a, c in zip(answers, correct)) / len(correct)
    return out


# ----------------------------------------------------------------------------- sampling and scoring


def answer_reader(reward_fn, data_source):
    """The function that reads a response's parsed answer for `data_source` (a scorer's `answer` attribute, e.g.
    rewards.gsm8k_score's "#### <number>"), or None. A user's reader runs here only when its scorer does too (no
    sandbox): otherwise model text would reach user code outside the sandbox."""
    if reward_fn.model is not None and not reward_fn.use_function:
        return None  # a reward model alone: no parsed answer
    fn = reward_fn.scorer_for(data_source)
    read = getattr(fn, "answer", None)
    if read is None or (getattr(fn, "__module__", None) != "rlkit.rewards" and reward_fn.sandbox_spec(fn) is not None):
        return None
    return read


def sample(policy, prompts, reward_fn, batch_size: int, n: int, validate: bool, progress=None) -> tuple[list[dict], list[tuple[dict, int]]]:
    """Generate n samples for every prompt of a PromptSet, batch_size prompts (x n rows) per generate call, and score them.

    validate: sample at --rollout.val-temperature (True) or --rollout.temperature (False). progress: a tqdm bar,
    advanced by the samples of each batch. Returns one record per sample, in prompt order then sample order
    ({prompt_index, sample_index, response, score, correct, answer, ground_truth}), and the reward function's
    metrics of each batch with its row count (for recipe.mean_metrics-style averaging).
    """
    tok = policy.tokenizer
    records, batch_metrics, readers = [], [], {}  # readers: data_source -> answer_reader
    for start in range(0, len(prompts), batch_size):
        rows = list(range(start, min(start + batch_size, len(prompts))))
        out = policy.generate(prompts.batch(rows, tok.pad_token_id).repeat(n, interleave=True), validate=validate)  # (b*n, R)
        responses = decode(out, tok)
        scores, metrics = reward_fn(out["data_source"], responses, out["ground_truth"], out["extra_info"], prompts=out["raw_prompt"])
        batch_metrics.append((metrics, len(responses)))
        for j, (text, s) in enumerate(zip(responses, scores.tolist())):
            p, source = rows[j // n], out["data_source"][j]
            if source not in readers:
                readers[source] = answer_reader(reward_fn, source)
            read = readers[source]
            records.append(
                {
                    "prompt_index": p,
                    "sample_index": j % n,
                    "response": text,
                    "score": s,
                    "correct": s >= 1.0,
                    "answer": read(text) if read is not None else None,
                    "ground_truth": str(out["ground_truth"][j]),
                }
            )
        if progress is not None:
            progress.update(len(responses))
    return records, batch_metrics


def decode(batch: DataProto, tokenizer) -> list[str]:
    """The response text of every row (padding and EOS removed), as recipe.decode_responses."""
    ids = batch["responses"].masked_fill(batch["response_mask"] == 0, tokenizer.pad_token_id)
    return tokenizer.batch_decode(ids, skip_special_tokens=True)


def from_records(records: list[dict], n: int) -> dict[str, float]:
    """estimates() of the per-sample records (sample()'s, or the rows of an eval jsonl), grouped by prompt_index."""
    by_prompt: dict[int, list[dict]] = {}
    for r in records:
        by_prompt.setdefault(r["prompt_index"], []).append(r)
    groups = [sorted(g, key=lambda r: r["sample_index"]) for _, g in sorted(by_prompt.items())]
    if any(len(g) != n for g in groups):
        raise ValueError(f"expected {n} samples for every prompt")
    return estimates([[r["correct"] for r in g] for g in groups], [[r["answer"] for r in g] for g in groups])


def validate_n(policy, prompts, reward_fn, batch_size: int, n: int, val_temperature: float) -> dict[str, float]:
    """Validation with n samples per prompt (--trainer.val-n n > 1), at --rollout.val-temperature when it is > 0, else
    at --rollout.temperature (greedy samples would all be the same).

    Returns today's keys over all the samples (val/score: mean score, val/<key>: the scorer's own keys, val/acc: its
    accuracy, else the share of full marks) and val/mean@n, val/pass@k, val/maj@k (estimates)."""
    records, batches = sample(policy, prompts, reward_fn, batch_size, n, validate=val_temperature > 0)
    scores = torch.tensor([r["score"] for r in records])
    res = {"val/score": scores.mean().item()}
    for k in dict.fromkeys(k for m, _ in batches for k in m):
        pairs = [(m[k], rows) for m, rows in batches if k in m]
        res["val/" + k.split("/", 1)[-1]] = sum(v * rows for v, rows in pairs) / sum(rows for _, rows in pairs)
    res.setdefault("val/acc", (scores >= 1.0).float().mean().item())
    res.update({f"val/{k}": v for k, v in from_records(records, n).items()})
    return res


# ----------------------------------------------------------------------------- a model in memory (the asset builders)


def generate_texts(model, tokenizer, inputs: dict, n: int = 1, temperature: float = 0.0, max_new_tokens: int = 8, **generate_kwargs):
    """n responses per row of `inputs` (left-padded input_ids, attention_mask, and any image inputs) from a Hugging Face
    model in memory: greedy at temperature 0, else sampled at `temperature` over the whole vocabulary (top-k off), as
    the rollout samples; decoded without special tokens, as the loop decodes them. Returns one list of n texts per row.
    For the scripts that build and check the shipped demos (scripts/assets/), which have a model, not a policy."""
    sampling = dict(do_sample=True, temperature=temperature, top_k=0) if temperature > 0 else dict(do_sample=False)
    with torch.no_grad():
        out = model.generate(
            **inputs,
            **sampling,
            **generate_kwargs,
            max_new_tokens=max_new_tokens,
            num_return_sequences=n,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
    texts = tokenizer.batch_decode(out[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    return [texts[i * n : (i + 1) * n] for i in range(len(texts) // n)]


def chat_texts(model, tokenizer, prompts: list, n: int = 1, temperature: float = 0.0, max_new_tokens: int = 8, batch_size: int = 0):
    """generate_texts for chat prompts (lists of messages), rendered by the tokenizer's chat template and left-padded,
    batch_size prompts per generate call (0: all in one)."""
    tokenizer.padding_side = "left"
    out, size = [], batch_size or len(prompts)
    for s in range(0, len(prompts), size):
        texts = [tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=False) for p in prompts[s : s + size]]
        enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        out += generate_texts(model, tokenizer, dict(enc), n, temperature, max_new_tokens)
    return out
