"""Calculator traces for SFT and the prompts for RL: 3-digit x 2-digit multiplication with a Hermes tool call.

    python scripts/make_tool_traces.py --model smollm2-135m-instruct --out data/mult_tool --traces 256
    python recipes/sft.py --model smollm2-135m-instruct --messages-key messages \\
        --data.train-files data/mult_tool/sft.parquet --data.val-files data/mult_tool/val.parquet
    python recipes/grpo_tools.py --model <the SFT run>/checkpoints/global_step_N/hf \\
        --data.train-files data/mult_tool/train.parquet --data.val-files data/mult_tool/val.parquet

Writes three parquet files, from disjoint problems (seeded):
- sft.parquet: `messages` conversations [system, user, assistant <tool_call>, tool result, assistant "=<product>"],
  the system message being exactly what rlkit offers the tools with at RL time (rlkit.tools.render_prompt: for a
  chat template that ignores `tools=`, DEFAULT_TOOL_PROMPT), so SFT trains the very text the turn loop produces;
- train.parquet, val.parquet: verl rows (prompt, reward_model.ground_truth) scored by the tool demo's scorer
  (`rlkit/demos.py` mult_score: the answer after the tool call must be "=<product>").
tests/test_tool_traces.py checks that a trace renders token for token as the turn loop renders the same turns.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # rlkit and scripts.assets of this checkout

from rlkit import tools  # noqa: E402
from scripts.assets import tiny_calc  # noqa: E402


def problems(seed: int, n: int) -> list[tuple[int, int]]:
    """n distinct (a, b), 100 <= a <= 999, 10 <= b <= 99, drawn with `seed`."""
    rng, out = random.Random(seed), {}
    while len(out) < n:
        out[(rng.randint(100, 999), rng.randint(10, 99))] = None
    return list(out)


def system_message(tok) -> dict:
    """The system message that offers the calculator as rlkit.tools.render_prompt does for a template that ignores
    `tools=` (DEFAULT_TOOL_PROMPT with the schema)."""
    schemas = tools.Tools([tools.calculator]).schemas
    probe = [{"role": "user", "content": "x"}]
    plain = tok.apply_chat_template(probe, add_generation_prompt=True, tokenize=False)
    if tok.apply_chat_template(probe, tools=schemas, add_generation_prompt=True, tokenize=False) != plain:
        raise SystemExit(f"{tok.name_or_path}'s chat template renders tools itself: these traces are for templates that do not")
    return {"role": "system", "content": tools.DEFAULT_TOOL_PROMPT.format(tools="\n".join(json.dumps(s) for s in schemas))}


def trace(system: dict, a: int, b: int) -> list[dict]:
    """One conversation: the question, the calculator call, its result, the answer in the scorer's format."""
    row = tiny_calc.mult_row(a, b, "", 0)
    return [
        system,
        *row["prompt"],
        {"role": "assistant", "content": tiny_calc.call_text(a, b)},
        {"role": "tool", "name": "calculator", "content": str(a * b)},
        {"role": "assistant", "content": f"={a * b}"},
    ]


def write(rows: list[dict], path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)


def main(argv=None) -> dict[str, Path]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct", help="whose chat template the traces are rendered for")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--traces", type=int, default=256, help="SFT conversations")
    p.add_argument("--train-size", type=int, default=512, help="RL prompts")
    p.add_argument("--val-size", type=int, default=64, help="held-out prompts")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    for flag, value in (("--traces", a.traces), ("--train-size", a.train_size), ("--val-size", a.val_size)):
        if value < 1:
            p.error(f"{flag} {value}: must be at least 1")
    from rlkit.engine import load_tokenizer
    from rlkit.models import resolve_model_path

    tok = load_tokenizer(resolve_model_path(a.model))
    system = system_message(tok)
    pairs = problems(a.seed, a.traces + a.train_size + a.val_size)
    sft, train, val = pairs[: a.traces], pairs[a.traces : a.traces + a.train_size], pairs[a.traces + a.train_size :]
    out = Path(a.out)
    paths = {"sft": out / "sft.parquet", "train": out / "train.parquet", "val": out / "val.parquet"}
    write([{"messages": trace(system, x, y)} for x, y in sft], paths["sft"])
    write([tiny_calc.mult_row(x, y, "train", i) for i, (x, y) in enumerate(train)], paths["train"])
    write([tiny_calc.mult_row(x, y, "test", i) for i, (x, y) in enumerate(val)], paths["val"])
    for name, path in paths.items():
        print(f"{name}: {path}")
    return paths


if __name__ == "__main__":
    main()
