"""End-to-end: the GRPO recipe on the embedded model, for a few steps."""

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rlkit import config, demos

ROOT = Path(__file__).resolve().parents[1]


def load_recipe(name: str):
    spec = importlib.util.spec_from_file_location(f"recipe_{name}", ROOT / "recipes" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # as an import would: the default run name is read from the Config's module file
    spec.loader.exec_module(mod)
    return mod


def small_config(recipe, out_dir, steps=3, **trainer):
    cfg = recipe.Config()
    cfg.data.train_batch_size = 8
    cfg.system.data.val_max_samples = 32
    if hasattr(cfg.actor, "ppo_mini_batch_size"):  # recipes/rm.py: one optimizer step per batch
        cfg.actor.ppo_mini_batch_size = 4
    cfg.system.actor.ppo_micro_batch_size = 16
    if hasattr(cfg, "rollout"):  # recipes/rm.py samples nothing
        cfg.rollout.n = 4
    cfg.trainer.total_training_steps = steps
    cfg.system.trainer.default_local_dir = str(out_dir)
    cfg.system.trainer.test_freq = 2
    cfg.system.trainer.save_freq = 2
    return config.set_flags(cfg, {f"trainer.{k}": v for k, v in trainer.items()})


def read_jsonl(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def test_grpo_runs_learns_parameters_writes_metrics_and_checkpoints(tmp_path):
    grpo = load_recipe("grpo")
    summary = grpo.main(small_config(grpo, tmp_path))

    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    for key in (
        "critic/score/mean",
        "critic/score/std",
        "actor/pg_loss",
        "actor/kl_loss",
        "actor/pg_clipfrac",
        "actor/entropy",
        "actor/grad_norm",
        "response_length/mean",
        "timing/gen",
        "timing/update",
        "perf/throughput",
    ):
        assert key in rows[1], key
    assert "val/acc" in rows[0] and "val/acc" in rows[2] and "val/acc" in rows[3]
    assert (tmp_path / "learning_curve.png").stat().st_size > 5000
    assert set(summary) >= {"val_acc_before", "val_acc_after"}

    ckpts = sorted(p.name for p in (tmp_path / "checkpoints").glob("global_step_*"))
    assert ckpts == ["global_step_2", "global_step_3"]
    before = load_file(demos.ARITH_MODEL / "model.safetensors")
    after = load_file(tmp_path / "checkpoints/global_step_3/hf/model.safetensors")
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert len(changed) == len(before), f"unchanged parameters: {set(before) - set(changed)}"


def _comparable(rows):
    return [{k: v for k, v in r.items() if not k.startswith(("timing/", "perf/"))} for r in rows]


def test_resume_continues_at_the_right_step_and_matches_an_uninterrupted_run(tmp_path):
    grpo = load_recipe("grpo")
    full = tmp_path / "full"
    grpo.main(small_config(grpo, full, steps=4))

    part = tmp_path / "part"
    grpo.main(small_config(grpo, part, steps=2))  # "interrupted" after step 2 (checkpoint at 2)
    grpo.main(small_config(grpo, part, steps=4, resume="auto"))

    a, b = read_jsonl(full / "metrics.jsonl"), read_jsonl(part / "metrics.jsonl")
    assert [r["step"] for r in b] == [0, 1, 2, 3, 4]
    # step 2 of the short run validated (its last step); the full run validated there too (test_freq 2)
    assert _comparable(a) == _comparable(b)
    wa = load_file(full / "checkpoints/global_step_4/hf/model.safetensors")
    wb = load_file(part / "checkpoints/global_step_4/hf/model.safetensors")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_existing_checkpoints_are_not_overwritten_without_resume(tmp_path):
    grpo = load_recipe("grpo")
    grpo.main(small_config(grpo, tmp_path, steps=2))
    with pytest.raises(FileExistsError, match="--trainer.resume auto"):
        grpo.main(small_config(grpo, tmp_path, steps=2))
    assert (tmp_path / "checkpoints/global_step_2/state.pt").is_file()
    # a checkpoint without the policy's folder (an older layout, or a folder removed by hand) is refused by name
    shutil.rmtree(tmp_path / "checkpoints/global_step_2/policy")
    with pytest.raises(ValueError, match="holds no policy/ folder"):
        grpo.main(small_config(grpo, tmp_path, steps=3, resume="auto"))


def test_lora_run_trains_only_the_adapter(tmp_path):
    grpo = load_recipe("grpo")
    cfg = small_config(grpo, tmp_path, steps=2)
    cfg.model.lora_rank = 4
    cfg.actor.lr = 1e-2
    grpo.main(cfg)
    state = torch.load(tmp_path / "checkpoints/global_step_2/policy/state.pt", weights_only=False)
    assert state["model"] and all("lora_" in k for k in state["model"])
    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "checkpoints/global_step_2/hf")
    base = AutoModelForCausalLM.from_pretrained(demos.ARITH_MODEL)
    diffs = [n for (n, p), (_, q) in zip(merged.named_parameters(), base.named_parameters()) if not torch.equal(p, q)]
    assert diffs and all("proj" in n for n in diffs)  # linear layers merged with the adapter; embeddings untouched


def run_cli(*args, timeout=120, recipe="grpo"):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("RLKIT_TRACEBACK", None)
    return subprocess.run(
        [sys.executable, str(ROOT / "recipes" / f"{recipe}.py"), *args], capture_output=True, text=True, timeout=timeout, env=env
    )


def test_help_documents_every_field():
    out = run_cli("--help")
    assert out.returncode == 0
    text = " ".join(out.stdout.split())
    for phrase in (
        "prompts per training step",
        "responses sampled per prompt",
        "KL estimator",
        "divide the group-centred reward",
        "--data.train-batch-size",
        "--actor.ppo-mini-batch-size",
        "--trainer.resume",
        "--model.lora-rank",
    ):
        assert phrase in text, phrase
    # --model.path's default is shown once, not as a path inside this install
    plain = " ".join(out.stdout.replace("│", " ").split())  # without the boxes' borders
    entry = plain[plain.index("--model.path STR") : plain.index("--model.trust-remote-code")]
    assert entry.count("(default:") == 1 and "(default: rlkit/assets/tiny-arith)" in entry  # config.shown_default
    assert str(ROOT / "rlkit") not in plain  # nor any data default
    # the docstring's multi-line example keeps its line breaks (a backslash ends each continued line)
    example = [line.strip() for line in out.stdout.splitlines() if "--data.train-files gsm8k" in line]
    assert example and example[0].startswith("--data.train-files") and example[0].endswith("\\")


def _write_parquet(path, rows):
    import datasets

    if not rows:  # an empty file with the right columns
        datasets.Dataset.from_list([_row()]).select([]).to_parquet(str(path))
        return str(path)
    datasets.Dataset.from_list(rows).to_parquet(str(path))
    return str(path)


def _row(prompt="What is 1+1?", answer="2"):
    return {
        "data_source": "rlkit/arith",
        "prompt": [{"role": "user", "content": prompt}],
        "ability": "arithmetic",
        "reward_model": {"style": "rule", "ground_truth": answer},
        "extra_info": {"index": 0},
    }


def _remote_code_model(folder):
    import shutil

    shutil.copytree(demos.ARITH_MODEL, folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(
        model_type="my_custom", auto_map={"AutoConfig": "configuration_x.XConfig", "AutoModelForCausalLM": "modeling_x.XForCausalLM"}
    )
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "configuration_x.py").write_text(
        "from transformers import LlamaConfig\nclass XConfig(LlamaConfig):\n    model_type = 'my_custom'\n"
    )
    (folder / "modeling_x.py").write_text("from transformers import LlamaForCausalLM\nclass XForCausalLM(LlamaForCausalLM):\n    pass\n")
    return folder


@pytest.mark.parametrize(
    "case",
    [
        "missing_column",
        "mistyped_column",
        "empty_dataset",
        "prompt_too_long",
        "unknown_model",
        "remote_code",
        "reward_raises",
        "n_is_1",
        "indivisible",
    ],
)
def test_bad_input_ends_with_one_clear_message(tmp_path, case):
    rows = [_row() for _ in range(16)]
    args = [
        "--trainer.default-local-dir",
        str(tmp_path / "out"),
        "--trainer.total-training-steps",
        "1",
        "--data.train-batch-size",
        "4",
        "--actor.ppo-mini-batch-size",
        "4",
        "--data.val-files",
    ]
    expect = {}
    if case == "missing_column":
        for r in rows:
            del r["reward_model"]
        expect = ["missing column 'reward_model'"]
    elif case == "mistyped_column":
        for r in rows:
            r["reward_model"] = "2"
        expect = ["'reward_model' must be a struct with a 'ground_truth' field"]
    elif case == "empty_dataset":
        rows = rows[:0]
        expect = ["no rows"]
    elif case == "remote_code":
        args += ["--model.path", str(_remote_code_model(tmp_path / "remote"))]
        expect = ["ships its own modelling code", "--model.trust-remote-code"]
    elif case == "prompt_too_long":
        rows[3] = _row(prompt="What is " + "1+" * 300 + "1?")
        expect = ["row 3", "--data.max-prompt-length", "--data.truncation"]
    elif case == "unknown_model":
        args += ["--model.path", str(tmp_path / "no-such-model")]
        expect = ["no-such-model", "hub id"]
    elif case == "reward_raises":
        args += ["--reward.custom-fn", f"{ROOT}/tests/fixtures/my_reward.py:raising_score"]
        expect = ["raising_score", "sample"]
    elif case == "n_is_1":
        args += ["--rollout.n", "1"]
        expect = ["--rollout.n >= 2"]
    elif case == "indivisible":
        args += ["--actor.ppo-mini-batch-size", "3"]
        expect = ["multiple of --actor.ppo-mini-batch-size"]
    args += ["--data.train-files", _write_parquet(tmp_path / "train.parquet", rows)]
    out = run_cli(*args)
    assert out.returncode == 1, out.stderr[-2000:]
    assert "Traceback" not in out.stderr
    err = out.stderr.split("rlkit: error:")[-1]
    for phrase in expect:
        assert phrase in err, (phrase, err)


def test_model_flag_is_short_for_model_path():
    from rlkit.recipe import expand_aliases

    assert expand_aliases(["--model", "Qwen/Qwen2.5-0.5B-Instruct", "--model.lora-rank", "8"]) == [
        "--model.path",
        "Qwen/Qwen2.5-0.5B-Instruct",
        "--model.lora-rank",
        "8",
    ]
    assert expand_aliases(["--model=./my-model"]) == ["--model.path=./my-model"]
    out = run_cli("--model", "/no/such/folder", "--trainer.total-training-steps", "1")
    assert out.returncode == 1 and "/no/such/folder" in out.stderr
