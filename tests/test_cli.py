"""recipe.cli: a user's mistake (a UserError) ends with one line; any other exception is a bug and keeps its traceback."""

import dataclasses
import re
from dataclasses import dataclass

import pytest
from test_grpo_recipe import load_recipe

from rlkit import config, recipe
from rlkit.errors import ConfigError


@dataclass
class Config:
    lr: float = 0.1
    """learning rate"""


def bad_flag(cfg):
    raise ConfigError(f"--lr {cfg.lr} must be below 0.01; pass --lr 0.001")


def shape_bug(cfg):  # what a forked recipe's loss does with mismatched shapes
    raise ValueError("operands could not be broadcast together with shapes (8,3) (8,4)")


def test_user_error_is_one_line(monkeypatch, capsys):
    monkeypatch.setattr("sys.argv", ["recipe.py", "--lr", "0.5"])
    monkeypatch.delenv("RLKIT_TRACEBACK", raising=False)
    with pytest.raises(SystemExit) as info:
        recipe.cli(bad_flag, Config)
    assert info.value.code == 1
    err = capsys.readouterr().err
    assert "rlkit: error: --lr 0.5 must be below 0.01; pass --lr 0.001\n" in err
    assert "Traceback" not in err and "bad_flag" not in err


def test_a_bug_keeps_its_traceback(monkeypatch, capsys):
    monkeypatch.setattr("sys.argv", ["recipe.py"])
    with pytest.raises(ValueError, match="could not be broadcast") as info:
        recipe.cli(shape_bug, Config)
    assert info.traceback[-1].name == "shape_bug"  # raised as is, from where it happened
    assert "rlkit: error" not in capsys.readouterr().err


def test_rlkit_traceback_shows_a_user_errors_traceback(monkeypatch):
    monkeypatch.setattr("sys.argv", ["recipe.py"])
    monkeypatch.setenv("RLKIT_TRACEBACK", "1")
    with pytest.raises(ConfigError):
        recipe.cli(bad_flag, Config)


def test_each_recipe_names_its_runs_after_itself_and_what_it_trains_on():
    recipes = ("grpo", "rloo", "dapo", "ppo", "reinforce_pp", "grpo_tools")  # grpo_tools: its own default model and data
    assert {name: recipe.run_name(load_recipe(name).Config()) for name in recipes} == {name: name for name in recipes}
    cfg = load_recipe("grpo").Config()
    cfg.model.path = "Qwen/Qwen2.5-0.5B-Instruct"
    cfg.data.train_files = ["data/gsm8k/train.parquet"]
    assert recipe.run_name(cfg) == "grpo-qwen2.5-0.5b-instruct-gsm8k"
    cfg.data.task = "reasoning_gym:chain_sum"
    assert recipe.run_name(cfg) == "grpo-qwen2.5-0.5b-instruct-chain_sum"


def test_a_rerun_into_a_used_folder_names_both_ways_forward(tmp_path):
    from rlkit.errors import RunExists

    cfg = load_recipe("rloo").Config()
    cfg.trainer.default_local_dir = str(tmp_path / "{experiment_name}")
    step = tmp_path / "rloo/checkpoints/global_step_3"
    step.mkdir(parents=True)
    (step / "state.pt").write_bytes(b"")
    with pytest.raises(RunExists) as info:
        recipe.Run(cfg, policy=None, train_loader=[], val_prompts=None, reward_fn=None)
    msg = str(info.value)
    assert "\n" not in msg and str(tmp_path / "rloo/checkpoints") in msg
    assert "--trainer.resume auto" in msg and "--trainer.experiment-name" in msg


def test_mean_metrics_weights_means_by_rows_and_sums_counts():
    """DAPO's reward metrics over its generation batches: a mean per response, not per batch."""
    got = recipe.mean_metrics([({"reward/acc": 1.0, "reward/errors": 2.0}, 24), ({"reward/acc": 0.0, "reward/errors": 1.0}, 8)])
    assert got == {"reward/acc": 0.75, "reward/errors": 3.0}


def test_mean_metrics_sums_reward_timeouts_like_errors():
    """reward/timeouts counts timed-out calls (a subset of reward/errors): 2 + 1 over two batches is 3, not their row-weighted
    mean (2*24 + 1*8) / 32 = 1.75."""
    got = recipe.mean_metrics([({"reward/errors": 2.0, "reward/timeouts": 2.0}, 24), ({"reward/errors": 1.0, "reward/timeouts": 1.0}, 8)])
    assert got == {"reward/errors": 3.0, "reward/timeouts": 3.0}


def help_boxes(text: str) -> dict[str, str]:
    """--help's boxes: title -> the text inside."""
    boxes, title = {}, None
    for line in text.splitlines():
        if line.startswith("╭─ "):
            title = line[3:].split(" ─")[0]
            boxes[title] = ""
        elif title and line.startswith("│"):
            boxes[title] += line.strip("│ ") + "\n"
    return boxes


def test_help_shows_the_learning_options_first_and_the_system_options_apart():
    from test_grpo_recipe import run_cli

    for name in ("grpo", "ppo"):
        out = run_cli("--help", recipe=name)
        assert out.returncode == 0, out.stderr
        boxes = help_boxes(out.stdout)
        titles = list(boxes)
        first_system = next(i for i, t in enumerate(titles) if t.startswith("system."))
        assert titles[:first_system] == ["options", "model options", "data options", "rollout options", "actor options"] + (
            ["critic options"] if name == "ppo" else []
        ) + ["reward options", "trainer options"]
        assert all(t.startswith("system.") for t in titles[first_system:])
        for group, sections in config.SYSTEM_OPTIONS.items():  # each system flag in its own box only, under its old name
            box = boxes[f"system.{group.replace('_', '-')} options"]
            for section, names in sections.items():
                if f"{section} options" not in boxes:  # critic: PPO's only; agent: grpo_tools' only
                    continue
                for name in names:
                    flag = re.compile(rf"--{section}\.{name.replace('_', '-')}[ ,]")  # (a bool: --x, --no-x)
                    assert flag.search(box) and not flag.search(boxes[f"{section} options"]), (name, flag)
        assert "--trainer.total-epochs" in boxes["trainer options"] and "--rollout.n " in boxes["rollout options"]


def test_system_flags_keep_their_names_and_land_in_their_sections():
    import tyro
    from test_grpo_recipe import load_recipe

    grpo = load_recipe("grpo")
    view, to_config = config.cli_view(grpo.Config)
    args = ["--trainer.backend", "ray", "--rollout.name", "vllm", "--trainer.async-steps", "2", "--reward.sandbox", "all"]
    cfg = to_config(tyro.cli(view, args=[*args, "--model.no-remove-padding", "--rollout.n", "4", "--trainer.n-workers", "2"]))
    assert type(cfg) is grpo.Config and type(cfg.trainer) is config.TrainerConfig and type(cfg.model) is config.ModelConfig
    expected = grpo.Config()
    expected.trainer.backend, expected.trainer.async_steps, expected.trainer.n_workers = "ray", 2, 2
    expected.rollout.name, expected.rollout.n, expected.reward.sandbox, expected.model.remove_padding = "vllm", 4, "all", False
    assert dataclasses.asdict(cfg) == dataclasses.asdict(expected)  # the recipe's own defaults (actor.lr 1e-4) kept
    assert to_config(tyro.cli(view, args=[])) == grpo.Config()


def test_grpo_help_shows_at_most_40_learning_options_before_the_system_boxes():
    """Issue #35: grpo.py's --help opened with 74 learning options; the run, validation, data-loading, off-policy,
    reliability and performance options now wait in system boxes after them (config.SYSTEM_OPTIONS' rule)."""
    from test_grpo_recipe import run_cli

    out = run_cli("--help", recipe="grpo")
    boxes = help_boxes(out.stdout)
    learning = [body for title, body in boxes.items() if not title.startswith("system.")]
    titles = list(boxes)
    assert all(t.startswith("system.") for t in titles[titles.index("system.run options") :])
    flags = re.findall(r"^--[a-z][\w.-]*", "".join(learning), re.M)
    assert 30 <= len(flags) <= 40, flags
    assert "--actor.lr" in flags and "--trainer.experiment-name" not in flags and "--data.task" not in flags


@pytest.mark.parametrize(
    "name, args, shown",
    [
        ("grpo", [], ["rlkit/assets/tiny-arith", "rlkit/assets/arith/train.parquet", "rlkit/assets/arith/val.parquet"]),
        ("grpo_tools", [], ["rlkit/assets/tiny-calc", "rlkit/assets/mult/train.parquet", "rlkit/assets/mult/val.parquet"]),
        ("grpo_tools", ["--agent.env", "guess"], ["rlkit/assets/tiny-guess", "rlkit/assets/guess/train.parquet"]),
        ("rm", [], ["rlkit/assets/tiny-arith", "rlkit/assets/arith-prefs/train.parquet", "rlkit/assets/arith-prefs/val.parquet"]),
    ],
)
def test_help_shows_each_recipes_own_default_paths_relative_to_the_install(name, args, shown):
    """--help used to show the shared sections' fixed text (tiny-arith, arith/*.parquet) for every recipe, so rm.py and
    grpo_tools.py showed files they never read; now the hint is each recipe's own default (config.shown_default)."""
    from test_grpo_recipe import ROOT, run_cli

    out = run_cli(*args, "--help", recipe=name)
    assert out.returncode == 0, out.stderr
    text = " ".join(out.stdout.replace("│", " ").split())
    flags = ["--model.path", "--data.train-files", "--data.val-files"]
    for flag, path in zip(flags, shown):
        assert re.search(rf"{re.escape(flag)} \S+ .*?\(default: {re.escape(path)}\)", text), (flag, path)
    assert f"default: {ROOT}" not in text  # no default shown as an absolute path of this install


def test_shown_default_is_relative_inside_the_install_only():
    from rlkit import demos

    assert config.shown_default(str(demos.ARITH_MODEL)) == "rlkit/assets/tiny-arith"
    assert config.shown_default([str(demos.ARITH_DATA / "a.parquet"), str(demos.ARITH_DATA / "b.parquet")]) == (
        "rlkit/assets/arith/a.parquet rlkit/assets/arith/b.parquet"
    )
    assert config.shown_default("Qwen/Qwen2.5-0.5B-Instruct") is None and config.shown_default([]) is None
    assert config.shown_default(512) is None and config.shown_default(["/elsewhere/x.parquet"]) is None
