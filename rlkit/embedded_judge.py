"""The embedded judge demo: a tiny model warm-started to answer "is this response correct? y/n" gives GRPO its reward.

    python -m rlkit.embedded_judge                     # build rlkit/assets/tiny-judge (minutes on 2 CPU cores)
    python recipes/grpo.py --reward.custom-fn rlkit.embedded_judge:judge_score

`tiny-judge/` is the embedded task's tokenizer and a ~0.5M-parameter model trained by a short supervised pass to
answer "y" or "n" after (question, reference, response) for the embedded addition task (rlkit/embedded.py): half
the examples correct, half wrong in the ways a policy is (near misses, swapped digits, a digit missing or extra,
other numbers, empty). `judge_score` is rlkit.judge.Judge on it in mode "p_yes" (the reward is P(y)), a
@batched("batch") reward function; it also reports the exact scorer's verdict as "acc" (so reward/acc and val/acc
measure what the policy really learned while the judge's P(y) is what it is trained on).
"""

from __future__ import annotations

import argparse
import json
import os
import random
from pathlib import Path

from rlkit import embedded
from rlkit.judge import Judge, question_of
from rlkit.rewards import batched

MODEL_DIR = embedded.ASSETS / "tiny-judge"
TEMPLATE = "{question}\n{reference}\n{response}"  # short: the embedded tokenizer knows arithmetic, not English
YES, NO = "y", "n"


def wrong_answer(answer: int, rng: random.Random) -> str:
    """A plausible wrong response to a problem whose answer is `answer`."""
    s = str(answer)
    kind = rng.randrange(6)
    if kind == 0:
        return str(max(answer + rng.choice([-10, -2, -1, 1, 2, 10]), 0))  # near miss
    if kind == 1 and len(s) > 1 and s[0] != s[-1]:
        return s[::-1]  # swapped digits
    if kind == 2:
        return s[:-1] if len(s) > 1 else s + s  # a digit missing
    if kind == 3:
        return s + str(rng.randrange(10))  # a digit extra
    if kind == 4:
        return ""
    other = rng.randrange(199)
    return str(other if other != answer else other + 1)


def examples(pairs, rng: random.Random) -> list[list[dict]]:
    """One conversation per (a, b): the judge's prompt (TEMPLATE) for a right or a wrong response, and its verdict
    (YES / NO) as the assistant's answer: recipes/sft.py trains the verdict and its end-of-turn token."""
    out = []
    for a, b in pairs:
        right = rng.random() < 0.5
        response = str(a + b) if right else wrong_answer(a + b, rng)
        text = TEMPLATE.format(question=f"What is {a}+{b}?", reference=a + b, response=response)
        out.append([{"role": "user", "content": text}, {"role": "assistant", "content": YES if right else NO}])
    return out


def build(steps: int = 400, seed: int = 0, out_dir: Path = MODEL_DIR) -> dict:
    """Train + save the judge; returns its accuracy (P(y) > 0.5 vs the truth) on held-out problems."""
    import torch
    from transformers import AutoTokenizer

    torch.manual_seed(seed)
    tok = AutoTokenizer.from_pretrained(embedded.MODEL_DIR)
    pairs = [(a, b) for a in range(100) for b in range(100)]
    rng = random.Random(seed)
    rng.shuffle(pairs)
    train, val = pairs[512:], pairs[:512]
    model = embedded.build_model(len(tok), tok.pad_token_id, tok.eos_token_id, seed=seed)
    # the supervised pass is recipes/sft.py (lr 2e-3, warm-up 50, batch 64)
    model = embedded.warm_start(
        model, tok, embedded.sft_traces(examples(train, rng), steps, 64, seed), steps, lr=2e-3, warmup=50, seed=seed
    )
    out_dir = embedded.save_asset(model, tok, out_dir)
    held_out = Judge(str(out_dir), TEMPLATE, yes=YES, no=NO)
    val_ex = [(a, b, rng.random() < 0.5) for a, b in val]
    responses = [str(a + b) if right else wrong_answer(a + b, rng) for a, b, right in val_ex]
    p = held_out.score([f"What is {a}+{b}?" for a, b, _ in val_ex], responses, [a + b for a, b, _ in val_ex])
    acc = sum((q > 0.5) == (r == str(a + b)) for q, r, (a, b, _) in zip(p, responses, val_ex)) / len(val_ex)
    (out_dir / "README.md").write_text(
        f"rlkit's embedded judge: {sum(x.numel() for x in model.parameters()):,} parameters, {steps} SFT steps answering y/n "
        f"to (question, reference, response) of the embedded addition task (seed {seed}); held-out verdict accuracy {acc:.3f}. "
        "Rebuild with `python -m rlkit.embedded_judge`.\n"
    )
    return {"saved": str(out_dir), "held_out_accuracy": acc}


_JUDGE = Judge(str(MODEL_DIR), TEMPLATE, yes=YES, no=NO, batch_size=64)  # loaded at its first call


@batched("batch")
def judge_score(data_sources, solution_strs, ground_truths, extra_infos, groups, prompts) -> list[dict]:
    """The reward is the tiny judge's P(y); "acc" is the exact scorer's verdict (rlkit/arith), for measurement only."""
    p = _JUDGE.score([question_of(q) for q in prompts], [s.strip() for s in solution_strs], ground_truths)
    return [{"score": x, "acc": float(s.strip() == str(t))} for x, s, t in zip(p, solution_strs, ground_truths)]


judge_score.in_process = True  # the judge model runs in the trainer; nothing parses text here


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=400, help="SFT steps")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=MODEL_DIR)
    args = ap.parse_args()
    import torch

    torch.set_num_threads(int(os.environ.get("RLKIT_THREADS", "1")))
    print(json.dumps(build(args.steps, args.seed, args.out)))
