"""The embedded environment demo: guess-the-number (rlkit.envs.GuessEnv) with "higher" / "lower" replies.

`python recipes/grpo_tools.py --agent.env guess` runs it on 2 CPU cores with no network, from (in `rlkit/assets/`):

- `guess/train.parquet`, `guess/val.parquet`: "Guess my number, 1 to 15." with the secret as ground_truth,
  data_source "rlkit/env" (the env gives the reward: 1 for finding the secret within --agent.max-turns 4
  guesses). The secrets are split: 10 for training, the other 5 held out for validation.
- `tiny-guess/`: a ~0.5M-parameter Llama-shaped model warm-started by a short supervised pass on games played by a
  mixed strategy: at each turn the midpoint of the range the replies leave (binary search, `--midpoint-share` 30 %
  of the turns) or its lowest number (a linear scan, the rest). Greedy, it scans (finds 4 of the 15 secrets);
  sampled, it wins 38 % of games (measured); binary search wins every one: RL can learn to bisect.

The supervised games are built token in / token out, like the rollouts (the reply segments come from
`rlkit.agent.tool_suffix_ids`, masked). Rebuild everything, deterministically, with::

    python scripts/assets/tiny_guess.py        # 300 SFT steps: 3.5 min of CPU (17 min on 2 shared cores)
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script: rlkit and scripts.assets of this checkout

from rlkit.demos import GUESS_DATA, GUESS_MODEL  # noqa: E402
from scripts.assets import common  # noqa: E402

LO, HI, MAX_GUESSES = 1, 15, 4
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def guess_row(secret: int, split: str, index: int, lo: int = LO, hi: int = HI) -> dict:
    return {
        "data_source": "rlkit/env",
        "prompt": [{"role": "user", "content": f"Guess my number, {lo} to {hi}."}],
        "ability": "game",
        "reward_model": {"style": "env", "ground_truth": str(secret)},
        "extra_info": {"split": split, "index": index, "lo": lo, "hi": hi},
    }


def secrets(seed: int = 0, n_val: int = 5) -> tuple[list[int], list[int]]:
    """The secrets LO..HI, shuffled with `seed`, split into (train, held-out val)."""
    s = list(range(LO, HI + 1))
    random.Random(seed).shuffle(s)
    return sorted(s[n_val:]), sorted(s[:n_val])


def play(secret: int, midpoint_share: float, rng: random.Random, lo: int = LO, hi: int = HI) -> list[int]:
    """The guesses of one game of the mixed strategy (module docstring) on [lo, hi], at most MAX_GUESSES."""
    guesses = []
    while len(guesses) < MAX_GUESSES:
        g = (lo + hi) // 2 if rng.random() < midpoint_share else lo
        guesses.append(g)
        if g == secret:
            break
        lo, hi = (g + 1, hi) if g < secret else (lo, g - 1)
    return guesses


def trace(secret: int, guesses: list[int]) -> list[dict]:
    """One game as a conversation with the GuessEnv's own replies: its first observation, then each guess (the
    assistant's, trained by recipes/sft.py) and the env's reply (masked), as the turn loop renders an episode."""
    from rlkit.envs import GuessEnv

    parquet = guess_row(secret, "", 0)
    row = {"prompt": parquet["prompt"], "ground_truth": str(secret), "extra_info": parquet["extra_info"]}  # as the turn loop has it
    env = GuessEnv()
    conv = list(env.reset(row))
    for k, g in enumerate(guesses):
        conv.append({"role": "assistant", "content": str(g)})
        obs, _, done = env.step(str(g))
        if done or k == len(guesses) - 1:  # found, or the last guess allowed
            break
        conv += obs
    return conv


def build(
    steps: int = 300,
    midpoint_share: float = 0.3,
    games: int = 4000,
    seed: int = 0,
    out_dir: Path = GUESS_MODEL,
    data_dir: Path = GUESS_DATA,
) -> Path:
    """Write the task parquet files and train + save the guessing model."""
    import datasets
    import torch

    torch.manual_seed(seed)
    train, val = secrets(seed)
    rng = random.Random(seed)
    data_dir = Path(data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    rows = [guess_row(rng.choice(train), "train", i) for i in range(2048)]
    datasets.Dataset.from_list(rows).to_parquet(str(data_dir / "train.parquet"))
    datasets.Dataset.from_list([guess_row(s, "val", i) for i, s in enumerate(val)]).to_parquet(str(data_dir / "val.parquet"))
    corpus = [
        f"Guess my number, {LO} to {HI}. higher: {a} to {b} lower: {a} to {b} a number please" for a in range(LO, HI + 1) for b in (a, HI)
    ]
    tok = common.build_tokenizer(corpus + ["user assistant system"])
    tok.chat_template = CHAT_TEMPLATE
    model = common.build_model(len(tok), tok.pad_token_id, tok.eos_token_id, seed=seed)
    convs = [trace(s, play(s, midpoint_share, rng)) for s in (rng.choice(train) for _ in range(games))]
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    # the supervised pass is recipes/sft.py (lr 2e-3, warm-up 50, batch 64)
    model = common.warm_start(
        model, tok, common.sft_traces(convs, steps, 64, seed), steps, lr=2e-3, warmup=50, seed=seed, max_response_length=128
    )
    return common.save_asset(
        model,
        tok,
        out_dir,
        f"rlkit's embedded guess-the-number model: {sum(p.numel() for p in model.parameters()):,} parameters, {steps} SFT steps on "
        f"{games} games of {LO}..{HI}, {midpoint_share:.0%} of the turns bisecting, the rest scanning up (seed {seed}). "
        "Rebuild with `python scripts/assets/tiny_guess.py`.\n",
    )


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300, help="SFT steps")
    ap.add_argument("--midpoint-share", type=float, default=0.3, help="share of the supervised turns that bisect")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=GUESS_MODEL)
    args = ap.parse_args()
    common.set_threads()
    print(json.dumps({"saved": str(build(args.steps, args.midpoint_share, seed=args.seed, out_dir=args.out))}))
