"""recipe.cli: a user's mistake (a UserError) ends with one line; any other exception is a bug and keeps its traceback."""

import dataclasses
import re
import warnings
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
    cfg.system.data.task = "reasoning_gym:chain_sum"
    assert recipe.run_name(cfg) == "grpo-qwen2.5-0.5b-instruct-chain_sum"


def test_a_rerun_into_a_used_folder_names_both_ways_forward(tmp_path):
    from rlkit.errors import RunExists

    cfg = load_recipe("rloo").Config()
    cfg.system.trainer.default_local_dir = str(tmp_path / "{experiment_name}")
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


def system_boxes(cfg) -> dict[str, tuple[str, list[str]]]:
    """--help's title of each box of cfg.system -> (the flag prefix of its options, their field names)."""
    out = {}
    for f in dataclasses.fields(cfg.system):
        section = getattr(cfg.system, f.name)
        out[f"system.{f.name.replace('_', '-')} options"] = (section.flag_section, [g.name for g in dataclasses.fields(section)])
    return out


def test_help_shows_the_learning_options_first_and_the_system_options_apart():
    """The Config's structure is --help's: the learning sections' boxes, then one box per section of cfg.system, whose
    options keep their flags (--trainer.backend lives in cfg.system.scale_out, shown in the system.scale-out box)."""
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
        expected = system_boxes(load_recipe(name).Config())
        assert titles[first_system:] == list(expected)
        for title, (prefix, names) in expected.items():  # each system flag in its own box only, under its section's name
            for field_name in names:
                flag = re.compile(rf"--{prefix}\.{field_name.replace('_', '-')}[ ,]")  # (a bool: --x, --no-x)
                assert flag.search(boxes[title]) and not flag.search(boxes.get(f"{prefix} options", "")), (title, flag)
        assert "--trainer.total-epochs" in boxes["trainer options"] and "--rollout.n " in boxes["rollout options"]


@pytest.mark.parametrize("name", ["grpo", "ppo", "grpo_tools", "sft", "rm"])
def test_every_option_is_the_flag_flag_values_names(name):
    """The flags tyro makes from a recipe's Config are exactly config.flag_values' names: a system section's @flags
    prefix is its options' prefix (so set_flags, the checks' messages and checkpoints speak the command line's names)."""
    import tyro

    cls = load_recipe(name).Config
    with warnings.catch_warnings():  # (get_parser: deprecated in tyro 1.0, still the way to list a CLI's flags)
        warnings.simplefilter("ignore", DeprecationWarning)
        parser = tyro.extras.get_parser(cls)
    shown = {a.option_strings[0] for a in parser._actions if a.option_strings and a.option_strings[0] != "-h"}
    assert shown == {"--" + k.replace("_", "-") for k in config.flag_values(cls())}


def test_system_flags_keep_their_names_and_land_in_their_sections():
    import tyro
    from test_grpo_recipe import load_recipe

    grpo = load_recipe("grpo")
    args = ["--trainer.backend", "ray", "--rollout.name", "vllm", "--trainer.async-steps", "2", "--reward.sandbox", "all"]
    cfg = tyro.cli(grpo.Config, args=[*args, "--model.no-remove-padding", "--rollout.n", "4", "--trainer.n-workers", "2"])
    assert type(cfg) is grpo.Config and type(cfg.trainer) is config.TrainerConfig and type(cfg.system.model) is config.ModelSystem
    expected = grpo.Config()
    expected.system.scale_out.backend, expected.system.async_rollout.async_steps, expected.system.scale_out.n_workers = "ray", 2, 2
    expected.system.rollout.name, expected.rollout.n = "vllm", 4
    expected.system.reward.sandbox, expected.system.model.remove_padding = "all", False
    assert cfg == expected  # the recipe's own defaults (actor.lr 1e-4) kept
    assert tyro.cli(grpo.Config, args=[]) == grpo.Config()


def test_set_flags_sets_options_by_flag_name_wherever_they_live():
    grpo = load_recipe("grpo")
    cfg = config.set_flags(grpo.Config(), {"trainer.backend": "ray", "trainer.seed": 7, "model.dtype": "float32", "actor.lr": 0.01})
    assert (cfg.system.scale_out.backend, cfg.trainer.seed, cfg.system.model.dtype, cfg.actor.lr) == ("ray", 7, "float32", 0.01)
    config.set_flags(cfg, {"norm-adv-by-std-in-grpo": False, "rollout.val-temperature": 0.5})  # dashes, a top-level option
    assert cfg.norm_adv_by_std_in_grpo is False and cfg.system.rollout.val_temperature == 0.5
    with pytest.raises(KeyError, match="--trainer.nope"):
        config.set_flags(cfg, {"trainer.nope": 1})
    with pytest.raises(KeyError, match="--critic.lr"):  # grpo.py has no critic
        config.set_flags(cfg, {"critic.lr": 1e-5})
    values = config.flag_values(cfg)
    assert values["trainer.backend"] == "ray" and values["model.dtype"] == "float32" and values["norm_adv_by_std_in_grpo"] is False


def test_grpo_help_shows_at_most_40_learning_options_before_the_system_boxes():
    """Issue #35: grpo.py's --help opened with 74 learning options; the run, validation, data-loading, off-policy,
    reliability and performance options now sit in cfg.system's sections, whose boxes come after them."""
    from test_grpo_recipe import run_cli

    out = run_cli("--help", recipe="grpo")
    boxes = help_boxes(out.stdout)
    learning = [body for title, body in boxes.items() if not title.startswith("system.")]
    titles = list(boxes)
    assert all(t.startswith("system.") for t in titles[titles.index("system.model options") :])
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

    assert config.shown_default(str(demos.ARITH_MODEL)) == "(default: rlkit/assets/tiny-arith)"
    assert config.shown_default(f"{demos.ARITH_DATA / 'a.parquet'} {demos.ARITH_DATA / 'b.parquet'}") == (
        "(default: rlkit/assets/arith/a.parquet rlkit/assets/arith/b.parquet)"
    )
    assert config.shown_default("Qwen/Qwen2.5-0.5B-Instruct") == "(default: Qwen/Qwen2.5-0.5B-Instruct)"
    assert config.shown_default("/elsewhere/x.parquet") == "(default: /elsewhere/x.parquet)"


def test_a_moved_or_misspelt_option_fails_loudly_in_python():
    """Sections are slotted dataclasses: code written for the old layout (cfg.trainer.backend = "ray", before the
    system options moved to cfg.system) or a typo raises instead of setting an attribute nothing reads; reading one
    says where the option lives now."""
    cfg = load_recipe("grpo").Config()
    with pytest.raises(AttributeError):
        cfg.trainer.backend = "ray"
    with pytest.raises(AttributeError):
        cfg.system.scale_out.n_worker = 2  # (n_workers)
    with pytest.raises(AttributeError, match=r"--trainer\.backend is a system option, cfg\.system\.scale_out\.backend"):
        _ = cfg.trainer.backend
    with pytest.raises(AttributeError, match=r"--actor\.ppo-micro-batch-size is a system option, cfg\.system\.actor"):
        _ = cfg.actor.ppo_micro_batch_size
    assert not hasattr(cfg.model, "dtype") and cfg.system.model.dtype == "auto"
