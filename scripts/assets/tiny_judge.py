"""The embedded judge demo: a tiny model trained to answer "is this response correct? y/n" gives GRPO its reward.

    python scripts/assets/tiny_judge.py                     # build rlkit/assets/tiny-judge (~30 min on 2 busy CPU cores)
    python recipes/grpo.py --reward.custom-fn rlkit.demos:judge_score

`tiny-judge/` is the embedded task's tokenizer and a ~0.5M-parameter model trained by recipes/sft.py to answer "y" or
"n" after (reference, response) of the embedded addition task (scripts/assets/tiny_arith.py): half the examples right, half
wrong, mostly of the reference's length (KINDS: a digit substituted, two swapped, +-1/+-10, the policy's own sampled
mistakes), so that it must compare the digits; JUDGE_TEMPLATE right-aligns both numbers so equal place values sit at a
fixed distance. `build` measures its held-out accuracy per kind (held_out_accuracy). `judge_score` (rlkit/demos.py) is
rlkit.judge.Judge on it in mode "p_yes" (the reward is P(y)), a @batched("batch") reward function; it also reports
the exact scorer's verdict as "acc" (so reward/acc and val/acc measure what the policy really learned while the
judge's P(y) is what it is trained on). docs/judge.md.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script: rlkit and scripts.assets of this checkout

from rlkit.demos import ARITH_MODEL, JUDGE_MODEL, JUDGE_TEMPLATE, NO, YES  # noqa: E402
from rlkit.judge import Judge  # noqa: E402
from scripts.assets import common, tiny_arith  # noqa: E402

KINDS = ("substitution", "swap", "near", "policy", "length")
"""How a wrong response is wrong: substitution (one digit replaced, same length), swap (two different digits
exchanged, same length), near (the answer +-1 or +-10), policy (a wrong answer the embedded model itself sampled),
length (a digit missing or extra, another number, empty). The first four are mostly of the reference's length: a
judge must compare the digits to tell them from the right answer."""
WEIGHTS = (0.3, 0.15, 0.2, 0.2, 0.15)  # the share of each kind among the wrong training examples


def substitute(s: str, rng: random.Random) -> str:
    """`s` with one digit replaced by another (no leading zero)."""
    i = rng.randrange(len(s))
    digits = [d for d in "0123456789" if d != s[i] and not (i == 0 and d == "0" and len(s) > 1)]
    return s[:i] + rng.choice(digits) + s[i + 1 :]


def wrong_answer(answer: int, rng: random.Random, kind: str | None = None, sampled: list[str] = ()) -> str:
    """A wrong response of `kind` (KINDS; None: drawn by WEIGHTS) to a problem whose answer is `answer`; `sampled`:
    the policy's wrong answers to this problem (kind "policy"; without one, a substitution)."""
    s = str(answer)
    kind = kind or rng.choices(KINDS, WEIGHTS)[0]
    if kind == "swap":
        pos = [(i, j) for i in range(len(s)) for j in range(i + 1, len(s)) if s[i] != s[j] and (i or s[j] != "0")]
        if pos:
            i, j = rng.choice(pos)
            return s[:i] + s[j] + s[i + 1 : j] + s[i] + s[j + 1 :]
    if kind == "near":
        return str(rng.choice([d for d in (answer - 10, answer - 1, answer + 1, answer + 10) if d >= 0]))
    if kind == "policy" and sampled:
        return rng.choice(list(sampled))
    if kind == "length":
        form = rng.randrange(4)
        if form == 0:
            return s[:-1] if len(s) > 1 else s + s  # a digit missing
        if form == 1:
            return s + str(rng.randrange(10))  # a digit extra
        if form == 2:
            return ""
        other = rng.randrange(199)
        return str(other if other != answer else other + 1)
    return substitute(s, rng)  # substitution, and the fallback of swap (no two different digits) and policy


def policy_mistakes(pairs, samples: int = 4, seed: int = 0) -> dict:
    """{(a, b): the distinct wrong answers among `samples` of the embedded policy's at temperature 1}."""
    prompts = [tiny_arith.arith_row(a, b, "", 0)["prompt"] for a, b in pairs]
    answers = tiny_arith.sample_answers(prompts, samples, seed)
    return {(a, b): sorted({x.strip() for x in xs} - {str(a + b)}) for (a, b), xs in zip(pairs, answers)}


def prompt(a: int, b: int, response: str) -> str:
    return JUDGE_TEMPLATE.format(question=f"What is {a}+{b}?", reference=str(a + b), response=response)


def examples(pairs, rng: random.Random, mistakes: dict) -> list[list[dict]]:
    """One conversation per (a, b): the judge's prompt (TEMPLATE) for a right or a wrong response, and its verdict
    (YES / NO) as the assistant's answer: recipes/sft.py trains the verdict and its end-of-turn token."""
    out = []
    for a, b in pairs:
        right = rng.random() < 0.5
        response = str(a + b) if right else wrong_answer(a + b, rng, sampled=mistakes.get((a, b), ()))
        out.append([{"role": "user", "content": prompt(a, b, response)}, {"role": "assistant", "content": YES if right else NO}])
    return out


def held_out_accuracy(judge: Judge, pairs, seed: int = 1, mistakes: dict | None = None) -> dict:
    """The judge's verdict accuracy (P(y) > 0.5 on right responses, < 0.5 on wrong ones) on `pairs`, one right
    response and one wrong response of each kind per problem; a kind's wrong responses that equal the answer (none by
    construction) or are missing (policy, where the policy sampled no mistake) are left out. Returns
    {"right": acc, kind: acc, ..., "wrong": mean over the wrong ones, "same_length": over wrong ones of the answer's
    length, "all": right and wrong weighted equally}."""
    rng = random.Random(seed)
    mistakes = mistakes or {}
    rows = []  # (a, b, response, kind)
    for a, b in pairs:
        rows.append((a, b, str(a + b), "right"))
        for kind in KINDS:
            if kind != "policy" or mistakes.get((a, b)):
                rows.append((a, b, wrong_answer(a + b, rng, kind, mistakes.get((a, b), ())), kind))
    p = judge.score([f"What is {a}+{b}?" for a, b, *_ in rows], [r for *_, r, _ in rows], [a + b for a, b, *_ in rows])
    hits: dict[str, list[bool]] = {}
    for q, (a, b, r, kind) in zip(p, rows):
        ok = (q > 0.5) == (kind == "right")
        hits.setdefault(kind, []).append(ok)
        if kind != "right":
            hits.setdefault("wrong", []).append(ok)
            if len(r) == len(str(a + b)):
                hits.setdefault("same_length", []).append(ok)
    out = {k: round(sum(v) / len(v), 4) for k, v in hits.items()}
    out["all"] = round((out["right"] + out["wrong"]) / 2, 4)
    out["counts"] = {k: len(v) for k, v in hits.items()}
    return out


def build(steps: int = 1200, seed: int = 0, out_dir: Path = JUDGE_MODEL, hidden: int = 128, lr: float = 1e-3, wd: float = 0.1) -> dict:
    """Train + save the judge; returns its held-out accuracy by kind of response (held_out_accuracy)."""
    import torch
    from transformers import AutoTokenizer

    torch.manual_seed(seed)
    tok = AutoTokenizer.from_pretrained(ARITH_MODEL)
    train, val = tiny_arith.arith_problems(0)  # the task's own split: the judge never trains on a held-out problem
    mistakes = policy_mistakes(train[:3000] + val, seed=seed)  # the policy kind on 3,000 of the train problems
    rng = random.Random(seed)
    model = common.build_model(len(tok), tok.pad_token_id, tok.eos_token_id, hidden=hidden, seed=seed)
    # the supervised pass is recipes/sft.py (warm-up 50, batch 64)
    convs = examples(common.sft_traces(train, steps, 64, seed), rng, mistakes)
    model = common.warm_start(model, tok, convs, steps, lr=lr, warmup=50, seed=seed, weight_decay=wd)
    out_dir = common.save_asset(model, tok, out_dir)
    acc = held_out_accuracy(Judge(str(out_dir), JUDGE_TEMPLATE, yes=YES, no=NO, batch_size=256), val, seed + 1, mistakes)
    (out_dir / "README.md").write_text(
        f"rlkit's embedded judge: {sum(x.numel() for x in model.parameters()):,} parameters (hidden {hidden}), {steps} SFT "
        f"steps (lr {lr}, weight decay {wd}) answering y/n to (reference, response) of the embedded addition task (seed {seed}). "
        f"Held-out verdict accuracy on the task's 512 held-out problems, by kind of response: {json.dumps(acc)}. "
        "Rebuild with `python scripts/assets/tiny_judge.py`.\n"
    )
    return {"saved": str(out_dir), "held_out": acc}


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=1200, help="SFT steps")
    ap.add_argument("--hidden", type=int, default=128, help="the model's width")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--wd", type=float, default=0.1, help="AdamW weight decay")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=JUDGE_MODEL)
    args = ap.parse_args()
    common.set_threads()
    print(json.dumps(build(args.steps, args.seed, args.out, args.hidden, args.lr, args.wd)))
