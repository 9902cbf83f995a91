"""The embedded tool-use demo: two-digit multiplication, which a tiny model cannot do alone but can with a calculator.

`python recipes/grpo_tools.py` with no arguments runs on 2 CPU cores with no network. It uses
(in `rlkit/assets/`):

- `mult/train.parquet`, `mult/val.parquet`: "What is 23*58?" -> "1334" (operands 10..99), disjoint
  train and held-out problems, data_source `rlkit/mult`;
- `tiny-calc/`: a ~0.5M-parameter Llama-shaped model whose chat template renders the tools it is
  offered (one line, "Tools: calculator"). It was warm-started by a short supervised pass on a mix
  of two kinds of answers to the train problems: mostly a direct guess, "=1334" (wrong most of
  the time: it cannot multiply), and sometimes (`--tool-share`, 15 %) a calculator call,
  ``<tool_call>{"name": "calculator", "arguments": {"expression": "23*58"}}</tool_call>``, then the
  tool's result copied, "=1334". So it calls the tool some of the time, and RL can learn to call it always.

The supervised conversations are trained by `recipes/sft.py` (`scripts/assets/common.py` run_sft), which renders them
with the chat template and the offered tools, token for token as the turn loop renders a rollout's turns.
Rebuild everything with::

    python scripts/assets/tiny_calc.py        # ~2 minutes on 2 CPU cores
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script: rlkit and scripts.assets of this checkout

from rlkit.demos import CALC_MODEL, MULT_DATA, MULT_SOURCE  # noqa: E402
from scripts.assets import common  # noqa: E402

# ChatML plus the names of the offered tools in a first system turn (the template "supports tools").
CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools: {% for t in tools %}{{ t['function']['name'] if 'function' in t else t['name'] }}"
    "{% if not loop.last %}, {% endif %}{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def mult_problems(seed: int = 0, n_val: int = 512) -> tuple[list, list]:
    """All a*b with 10 <= a, b <= 99, shuffled with `seed`, split into (train, val)."""
    pairs = [(a, b) for a in range(10, 100) for b in range(10, 100)]
    random.Random(seed).shuffle(pairs)
    return pairs[n_val:], pairs[:n_val]


def mult_row(a: int, b: int, split: str, index: int) -> dict:
    return {
        "data_source": MULT_SOURCE,
        "prompt": [{"role": "user", "content": f"What is {a}*{b}?"}],
        "ability": "arithmetic",
        "reward_model": {"style": "rule", "ground_truth": str(a * b)},
        "extra_info": {"split": split, "index": index},
    }


def call_text(a: int, b: int) -> str:
    return "<tool_call>" + json.dumps({"name": "calculator", "arguments": {"expression": f"{a}*{b}"}}) + "</tool_call>"


def trace(a: int, b: int, use_tool: bool) -> list[dict]:
    """One supervised conversation: the question, then "=<product>", or a calculator call, its result and the answer
    (recipes/sft.py trains the assistant's turns and masks the tool result, as the turn loop's rollouts are masked)."""
    answer = {"role": "assistant", "content": f"={a * b}"}
    if not use_tool:
        return mult_row(a, b, "", 0)["prompt"] + [answer]
    call = {"role": "assistant", "content": call_text(a, b)}
    result = {"role": "tool", "name": "calculator", "content": str(a * b)}
    return mult_row(a, b, "", 0)["prompt"] + [call, result, answer]


def build(steps: int = 600, tool_share: float = 0.15, seed: int = 0, out_dir: Path = CALC_MODEL, data_dir: Path = MULT_DATA) -> Path:
    """Write the task parquet files, then warm-start a fresh tool model with recipes/sft.py and save it."""
    import torch

    torch.manual_seed(seed)
    train, val = mult_problems(seed)
    common.write_task_parquet(data_dir, train, val, mult_row)
    corpus = [f"What is {a}*{b}? ={a * b} {call_text(a, b)}" for a, b in train[:2000]] + ["user assistant system tool Tools: calculator"]
    tok = common.build_tokenizer(corpus)
    tok.chat_template = CHAT_TEMPLATE
    tok.add_tokens(["<tool_call>", "</tool_call>"])  # one token each, as in Qwen2.5 (not special: decode keeps them)
    model = common.build_model(len(tok), tok.pad_token_id, tok.eos_token_id, seed=seed)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    rng = random.Random(seed)
    convs = [trace(a, b, rng.random() < tool_share) for a, b in train]
    model = common.warm_start(
        model,
        tok,
        common.sft_traces(convs, steps, 64, seed),
        steps,
        lr=2e-3,
        warmup=50,
        seed=seed,
        tools="calculator",
        max_response_length=64,
    )
    return common.save_asset(
        model,
        tok,
        out_dir,
        f"rlkit's embedded tool-use model: {sum(p.numel() for p in model.parameters()):,} parameters, {steps} SFT steps "
        f"(recipes/sft.py) on two-digit multiplication, {tool_share:.0%} of the examples calling the calculator (seed {seed}). "
        "Rebuild with `python scripts/assets/tiny_calc.py`.\n",
    )


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=600, help="SFT steps")
    ap.add_argument("--tool-share", type=float, default=0.15, help="share of SFT examples that call the calculator")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=CALC_MODEL)
    args = ap.parse_args()
    common.set_threads()
    print(json.dumps({"saved": str(build(args.steps, args.tool_share, args.seed, args.out))}))
