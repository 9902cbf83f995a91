"""The default run's assets: a tiny arithmetic task and a tiny model that half-knows it.

`python recipes/grpo.py` with no arguments must run on a 2-core CPU with no network and visibly
learn. So rlkit ships (in `rlkit/assets/`):

- `arith/train.parquet`, `arith/val.parquet`: two-digit addition ("What is 23+58?" -> "81") in the
  verl parquet format, train and held-out splits with disjoint problems;
- `tiny-arith/`: a ~0.5M-parameter Llama-shaped causal LM in the ordinary Hugging Face format
  (config.json, model.safetensors, tokenizer.json with a chat template), loaded by the same
  `from_pretrained` call that loads Qwen. It was trained by a short supervised pass on the
  train split, stopped early on purpose, so it answers about 30% of held-out problems (0.295,
  greedy) correctly: the headroom that RL then closes.

Everything is rebuilt (the supervised pass is recipes/sft.py, see common.run_sft) by::

    python scripts/assets/tiny_arith.py      # ~1 minute on 2 CPU cores

The step the pass stops at lies on the steep part of the learning curve, so float round-off (another CPU,
another torch) moves a rebuild's accuracy by tens of points: docs/sft.md has the measurements.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script: rlkit and scripts.assets of this checkout

from rlkit import evaluation  # noqa: E402
from rlkit.demos import ARITH_DATA, ARITH_MODEL, ARITH_SOURCE  # noqa: E402
from scripts.assets import common  # noqa: E402


def arith_problems(seed: int = 0, max_operand: int = 99, n_val: int = 512) -> tuple[list, list]:
    """All `a+b` with 0 <= a, b <= max_operand, shuffled with `seed`, split into (train, val)."""
    pairs = [(a, b) for a in range(max_operand + 1) for b in range(max_operand + 1)]
    random.Random(seed).shuffle(pairs)
    return pairs[n_val:], pairs[:n_val]


def arith_row(a: int, b: int, split: str, index: int) -> dict:
    """One verl-format row: data_source, prompt (chat messages), ability, reward_model, extra_info."""
    return {
        "data_source": ARITH_SOURCE,
        "prompt": [{"role": "user", "content": f"What is {a}+{b}?"}],
        "ability": "arithmetic",
        "reward_model": {"style": "rule", "ground_truth": str(a + b)},
        "extra_info": {"split": split, "index": index},
    }


def write_arith_parquet(out_dir: Path = ARITH_DATA, seed: int = 0) -> tuple[Path, Path]:
    """Write train.parquet and val.parquet of the embedded task; returns their paths."""
    return common.write_task_parquet(out_dir, *arith_problems(seed), arith_row)


def greedy_accuracy(model, tokenizer, pairs) -> float:
    """Fraction of `pairs` whose greedy answer is exactly a+b (the held-out metric of the default run)."""
    texts = evaluation.chat_texts(model, tokenizer, [arith_row(a, b, "", 0)["prompt"] for a, b in pairs], max_new_tokens=6)
    return sum(t.strip() == str(a + b) for (t,), (a, b) in zip(texts, pairs)) / len(pairs)


def sample_answers(prompts: list[list[dict]], n: int, seed: int, model_dir=ARITH_MODEL) -> list[list[str]]:
    """n responses per prompt from the embedded model at temperature 1, decoded as the RL loop decodes them."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    torch.manual_seed(seed)
    return evaluation.chat_texts(model, tok, prompts, n, temperature=1.0, max_new_tokens=8, batch_size=256)


def build(steps: int = 300, seed: int = 0, out_dir: Path = ARITH_MODEL, data_dir: Path = ARITH_DATA) -> Path:
    """Write the task parquet files, then warm-start a fresh model with recipes/sft.py and save it."""
    import torch

    torch.manual_seed(seed)
    write_arith_parquet(data_dir, seed)
    train, val = arith_problems(seed)
    corpus = [f"What is {a}+{b}? {a + b}" for a, b in train[:2000]] + ["user assistant"]
    tokenizer = common.build_tokenizer(corpus)
    model = common.build_model(len(tokenizer), tokenizer.pad_token_id, tokenizer.eos_token_id, seed=seed)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    convs = [
        arith_row(a, b, "", 0)["prompt"] + [{"role": "assistant", "content": str(a + b)}]
        for a, b in common.sft_traces(train, steps, 64, seed)
    ]
    model = common.warm_start(model, tokenizer, convs, steps, lr=1e-3, warmup=100, seed=seed)
    acc = greedy_accuracy(model, tokenizer, val)
    print(f"held-out greedy accuracy after {steps} SFT steps: {acc:.3f}")
    return common.save_asset(
        model,
        tokenizer,
        out_dir,
        f"rlkit's embedded starting checkpoint: {sum(p.numel() for p in model.parameters()):,} parameters, "
        f"{steps} SFT steps (recipes/sft.py) on two-digit addition (seed {seed}), held-out greedy accuracy {acc:.3f}. "
        "Rebuild with `python scripts/assets/tiny_arith.py`.\n",
    )


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300, help="SFT steps (fewer = weaker start)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=ARITH_MODEL)
    args = ap.parse_args()
    common.set_threads()
    print(json.dumps({"saved": str(build(args.steps, args.seed, args.out))}))
