"""rlkit/demos.py, the shipped demos as a run sees them: the generated demo tasks come from its table (rlkit.data names
none), the demo scorers answer for their data_source, and nothing under rlkit/ builds a demo or runs a recipe (the
builders are scripts/assets/)."""

import ast
from pathlib import Path

import transformers

from rlkit import data, demos
from rlkit.config import DataConfig, DataSystem
from rlkit.rewards import RewardFn

RLKIT = Path(__file__).resolve().parents[1] / "rlkit"


def test_a_generated_task_is_looked_up_in_the_demos_table(monkeypatch):
    """--data.task NAME generates its rows with demos.TASKS[NAME](split, train size, val size, seed)."""
    calls = []

    def columns(split, train_size, val_size, seed):
        calls.append((split, train_size, val_size, seed))
        n = val_size if split == "val" else train_size
        return {
            "data_source": ["rlkit/arith"] * n,
            "prompt": [[{"role": "user", "content": f"What is {i}+1?"}] for i in range(n)],
            "reward_model": [{"style": "rule", "ground_truth": str(i + 1)} for i in range(n)],
        }

    monkeypatch.setitem(demos.TASKS, "plus_one", columns)
    cfg, task = DataConfig(), DataSystem(task="plus_one", task_train_size=5, task_val_size=3, task_seed=7)
    tok = transformers.AutoTokenizer.from_pretrained(demos.ARITH_MODEL)
    val = data.build_prompts(task.val_files, tok, cfg, task)
    train = data.build_prompts(cfg.train_files, tok, cfg, task)
    assert calls == [("val", 5, 3, 7), ("train", 5, 3, 7)]
    assert (len(val), len(train)) == (3, 5) and list(val.ground_truth) == ["1", "2", "3"]
    # the shipped one: the colour codeword rows, disjoint sequences in train and val
    cols = data.task_columns(DataSystem(task="colour_codeword", task_train_size=4, task_val_size=2), "val")
    _, held_out = demos.sequences()
    assert [r["ground_truth"] for r in cols["reward_model"]] and all(r["ground_truth"] in held_out for r in cols["reward_model"])


def test_the_demo_scorers_answer_for_their_data_source():
    fn = RewardFn(sandbox="off")
    sources = [demos.MULT_SOURCE, demos.MULT_SOURCE, demos.COLOUR_SOURCE, demos.COLOUR_SOURCE]
    responses = ['<tool_call>{"name": "calculator"}</tool_call>=1334', "=1333", "RGB", "RGY"]
    scores, metrics = fn(sources, responses, ["1334", "1334", "RGB", "RGB"])
    assert scores.tolist() == [1.0, 0.0, 1.0, 0.0]
    assert metrics["reward/tool"] == 0.5 and metrics["reward/letters"] == (1 + 2 / 3) / 2  # each over the rows reporting it


def test_nothing_under_rlkit_builds_a_demo_or_runs_a_recipe():
    """A guard on the split: rlkit/ imports nothing from scripts/ (the builders) and names no recipe file in code (the
    old warm start ran recipes/sft.py by path from inside the package)."""
    for path in sorted(RLKIT.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                assert not any(a.name.split(".")[0] == "scripts" for a in node.names), f"{path.name} imports scripts"
            elif isinstance(node, ast.ImportFrom):
                assert (node.module or "").split(".")[0] != "scripts", f"{path.name} imports from scripts"
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                v = node.value
                assert v != "recipes" and not (v.startswith("recipes/") and v.endswith(".py")), f"{path.name}: {v!r}"


def test_the_default_run_is_the_arith_demo_and_config_imports_no_demo():
    """rlkit/config.py's defaults are the arith demo's model and files (demos.ARITH_*), named there from the assets
    folder: config does not import the demos (whose judge loads the engine, which imports config: a cycle,
    tests/test_style.py)."""
    from rlkit.config import ModelConfig

    assert ModelConfig().path == str(demos.ARITH_MODEL)
    assert DataConfig().train_files == [str(demos.ARITH_DATA / "train.parquet")]
    assert DataSystem().val_files == [str(demos.ARITH_DATA / "val.parquet")]
    tree = ast.parse((RLKIT / "config.py").read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("rlkit")}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names if a.name.startswith("rlkit")}
    assert "rlkit.demos" not in imported and imported <= {"rlkit.errors", "rlkit.algos"}, imported
