"""The shipped demos, as a run sees them: where their models and data are (`rlkit/assets/`), the scorers their runs
use, and the rows of the one generated demo task. Nothing here builds anything: the builders are scripts/assets/
(`python scripts/assets/tiny_arith.py` and its siblings rebuild a demo's model and data).

- arith (the default run): tiny-arith on two-digit addition, data_source rlkit/arith (scored by rewards.arith_score);
- tools (`recipes/grpo_tools.py`): tiny-calc on two-digit multiplication with a calculator, rlkit/mult (mult_score);
- guess (`recipes/grpo_tools.py --agent.env guess`): tiny-guess playing rlkit.envs.GuessEnv on the guess data;
- judge (`--reward.custom-fn rlkit.demos:judge_score`): tiny-judge says y/n to an addition answer (docs/judge.md);
- moe (`--model.path rlkit/assets/tiny-moe`): tiny-moe, a Qwen3-MoE, on the arith task (docs/moe.md);
- vlm (`--model embedded-vlm --data.task colour_codeword`): tiny-vlm reads coloured squares, rlkit/colour_codeword.
"""

from __future__ import annotations

import random
import re

from rlkit.config import ASSETS
from rlkit.judge import Judge, question_of
from rlkit.rewards import batched, register_scorer

ARITH_MODEL, ARITH_DATA, ARITH_SOURCE = ASSETS / "tiny-arith", ASSETS / "arith", "rlkit/arith"
CALC_MODEL, MULT_DATA, MULT_SOURCE = ASSETS / "tiny-calc", ASSETS / "mult", "rlkit/mult"
GUESS_MODEL, GUESS_DATA = ASSETS / "tiny-guess", ASSETS / "guess"
JUDGE_MODEL = ASSETS / "tiny-judge"
MOE_MODEL = ASSETS / "tiny-moe"  # a Qwen3-MoE (8 experts, top-2) warm-started on arith like tiny-arith (docs/moe.md)
VLM_MODEL, COLOUR_DATA, COLOUR_SOURCE = ASSETS / "tiny-vlm", ASSETS / "colours", "rlkit/colour_codeword"
PREFS_DATA = ASSETS / "arith-prefs"  # recipes/rm.py's pairs (scripts/rm_demo.py pairs)

MODELS = {"embedded-vlm": VLM_MODEL}
"""--model names of the shipped models (rlkit.models.resolve_model_path)"""


# ---------------------------------------------------------------------------------------------
# tools: multiplication with a calculator
# ---------------------------------------------------------------------------------------------
def final_answer(text: str) -> str:
    """The text after the last tool call, without the leading '='."""
    text = re.sub(r"<tool_call>.*?</tool_call>", "", text, flags=re.DOTALL).strip()
    return text[1:].strip() if text.startswith("=") else text


@register_scorer(MULT_SOURCE)
def mult_score(data_source, solution_str, ground_truth, extra_info=None) -> dict:
    """The tool demo: the final answer (after any tool call) must be '=<product>'; 'tool' says whether a call was made."""
    s = 1.0 if final_answer(solution_str) == str(ground_truth) else 0.0
    return {"score": s, "acc": s, "tool": float("<tool_call>" in solution_str)}


# ---------------------------------------------------------------------------------------------
# judge: a tiny model's P(y) is the reward
# ---------------------------------------------------------------------------------------------
JUDGE_TEMPLATE = "{reference:>4}\n{response:>4}"  # right-aligned: equal place values 5 tokens apart; no {question}
YES, NO = "y", "n"
_JUDGE = Judge(str(JUDGE_MODEL), JUDGE_TEMPLATE, yes=YES, no=NO, batch_size=64)  # loaded at its first call


@batched("batch")
def judge_score(data_sources, solution_strs, ground_truths, extra_infos, groups, prompts) -> list[dict]:
    """The reward is the tiny judge's P(y); "acc" is the exact scorer's verdict (rlkit/arith), for measurement only."""
    p = _JUDGE.score([question_of(q) for q in prompts], [s.strip() for s in solution_strs], ground_truths)
    return [{"score": x, "acc": float(s.strip() == str(t))} for x, s, t in zip(p, solution_strs, ground_truths)]


judge_score.in_process = True  # the judge model runs in the trainer; nothing parses text here


# ---------------------------------------------------------------------------------------------
# vlm: the colour codeword task, generated (--data.task colour_codeword) or read from colours/*.parquet
# ---------------------------------------------------------------------------------------------
SQUARE = 28  # pixels: patch 14 x merge 2, one image token per square
K = 3
COLOURS = {"R": (220, 30, 30), "G": (30, 200, 30), "B": (30, 30, 220), "Y": (230, 220, 30), "C": (30, 210, 220), "M": (210, 30, 210)}
QUESTION = "<image>Name the colours."


def sequences(k: int = K) -> tuple[list[str], list[str]]:
    """All colour sequences of length k, split (train, val): every 5th of a fixed shuffle is held out."""
    import itertools

    seqs = ["".join(s) for s in itertools.product(COLOURS, repeat=k)]
    random.Random(1234).shuffle(seqs)
    return [s for i, s in enumerate(seqs) if i % 5], [s for i, s in enumerate(seqs) if not i % 5]


def draw(seq: str, rng: random.Random, jitter: int = 40):
    """The image of a colour sequence: one SQUARE x SQUARE square per letter, left to right, each shade jittered."""
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (SQUARE * len(seq), SQUARE))
    d = ImageDraw.Draw(img)
    for i, letter in enumerate(seq):
        fill = tuple(min(255, max(0, c + rng.randint(-jitter, jitter))) for c in COLOURS[letter])
        d.rectangle([SQUARE * i, 0, SQUARE * (i + 1) - 1, SQUARE - 1], fill=fill)
    return img


def task_rows(size: int, seed: int, split: str) -> list[dict]:
    """`size` verl-format multimodal rows of split 'train' or 'val' (disjoint colour sequences), drawn with `seed`."""
    from rlkit.vlm import png_bytes

    train, val = sequences()
    pool = val if split == "val" else train
    rng = random.Random(f"{seed}-{split}")
    rows = []
    for i in range(size):
        seq = rng.choice(pool)
        rows.append(
            {
                "data_source": COLOUR_SOURCE,
                "prompt": [{"role": "user", "content": QUESTION}],
                "images": [{"bytes": png_bytes(draw(seq, rng))}],
                "ability": "vision",
                "reward_model": {"style": "rule", "ground_truth": seq},
                "extra_info": {"split": split, "index": i},
            }
        )
    return rows


def task_columns(split: str, train_size: int, val_size: int, seed: int) -> dict[str, list]:
    """The columns of `--data.task colour_codeword` for split 'train' or 'val' (as datasets.to_dict() gives them)."""
    rows = task_rows(val_size if split == "val" else train_size, seed, split)
    keys = ("data_source", "prompt", "images", "ability", "reward_model", "extra_info")
    return {k: [r[k] for r in rows] for k in keys}


@register_scorer(COLOUR_SOURCE)
def colour_score(data_source, solution_str, ground_truth, extra_info=None) -> dict:
    """Exact match of the stripped response with the letters; 'letters': the share of positions right."""
    s = solution_str.strip()
    right = sum(a == b for a, b in zip(s, ground_truth)) / len(ground_truth)
    score = float(s == ground_truth)
    return {"score": score, "acc": score, "letters": right}


TASKS = {"colour_codeword": task_columns}
"""--data.task names of the generated demo tasks -> task_columns(split, train_size, val_size, seed)"""
