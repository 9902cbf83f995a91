"""Every option a recipe's --help shows is read by that recipe, or refused with one line (issue #35 item 2).

How: one tiny run of each recipe (1 step, 4 prompts, validation on 4 prompts) with every section of its Config
recording which fields the recipe's code reads (config validation and dataclasses' own copying do not count: a value
that is only checked is not used). An option the tiny run does not read is either
  - in OTHER_PATHS: read on a path the tiny run does not take (LoRA, Ray, vLLM, a reward model, ...), checked
    statically: the field is read as an attribute by code outside rlkit/config.py, or
  - refused: set alone to a non-default value, the recipe stops with a ConfigError naming the flag before any model
    loads.
Before the sections were split by use, recipes/rm.py showed 87 options of which 39 were none of these (--trainer.backend
ray, --actor.nan-policy, --actor.clip-ratio, ... accepted and ignored).
"""

from __future__ import annotations

import ast
import dataclasses
import re
import sys
import typing
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from test_grpo_recipe import load_recipe, small_config  # noqa: E402

from rlkit import config  # noqa: E402

COPIES = ("flag_values", "sections", "set_flags")  # rlkit.config's functions that copy every value: not a use

RECIPES = sorted(p.stem for p in (ROOT / "recipes").glob("*.py"))

# option -> (the path that reads it, what a recipe must call to have that path: a string in its source)
ENGINE, REWARD, ASYNC = "build_policy(", "build_reward(", "recipe.Rollouts("
OTHER_PATHS = {
    "model.lora_alpha": ("--model.lora-rank > 0", ""),
    "model.target_modules": ("--model.lora-rank > 0", ""),
    "model.freeze_vision_tower": ("a vision-language model (rlkit/vlm.py)", ENGINE),
    "data.task_options": ("--data.task (rlkit/tasks.py)", ENGINE),
    "data.task_train_size": ("--data.task", ENGINE),
    "data.task_val_size": ("--data.task", ENGINE),
    "data.task_seed": ("--data.task", ENGINE),
    "data.task_format": ("--data.task", ENGINE),
    "data.sampler_weights": ("--data.sampler difficulty", ENGINE),
    "rollout.gpu_memory_utilization": ("--rollout.name vllm", ENGINE),
    "rollout.kv_cache_gb": ("--rollout.name vllm", ENGINE),
    "rollout.enforce_eager": ("--rollout.name vllm", ENGINE),
    "rollout.max_num_seqs": ("--rollout.name vllm", ENGINE),
    "rollout.lora_adapter_sync": ("--rollout.name vllm with LoRA", ENGINE),
    "rollout.log_probs": ("the sampler's log-probs (off-policy correction)", ENGINE),
    "actor.nan_policy": ("a non-finite loss in the engine's update", ENGINE),
    "actor.max_skipped_steps": ("--actor.nan-policy skip", ENGINE),
    "actor.rollout_correction": ("rollout log-probs: vllm, async", ENGINE),
    "actor.rollout_is_cap": ("rollout log-probs: vllm, async", ENGINE),
    "actor.rollout_is_low": ("rollout log-probs: vllm, async", ENGINE),
    "actor.clip_ratio": ("--actor.clip-ratio-low/-high unset", ENGINE),
    "actor.kl_loss_type": ("--actor.use-kl-loss", ENGINE),
    "critic.nan_policy": ("a non-finite loss in the critic's update", ENGINE),
    "critic.max_skipped_steps": ("--critic.nan-policy skip", ENGINE),
    "reward.combine": ("--reward.model-path", REWARD),
    "reward.model_micro_batch_size": ("--reward.model-path", REWARD),
    "trainer.total_epochs": ("--trainer.total-training-steps unset", ""),
    "trainer.n_workers": ("--trainer.backend ray", ENGINE),
    "trainer.cpus_per_worker": ("--trainer.backend ray", ENGINE),
    "trainer.critic_workers": ("--trainer.backend ray with a critic", ENGINE),
    "trainer.reward_workers": ("--trainer.backend ray with a reward model", ENGINE),
    "trainer.fsdp_param_dtype": ("--trainer.backend ray", ENGINE),
    "trainer.fsdp_offload": ("--trainer.backend ray", ENGINE),
    "trainer.tp_size": ("--trainer.engine megatron", ENGINE),
    "trainer.sp_size": ("--trainer.backend ray (Ulysses sequence parallelism)", ENGINE),
    "trainer.ray_address": ("--trainer.backend ray", ENGINE),
    "trainer.async_workers": ("--trainer.async-steps", ASYNC),
    "trainer.async_timeout_s": ("--trainer.async-steps", ASYNC),
    "agent.max_observation_chars": ("an environment's observation (--agent.env)", ""),
    "norm_adv_by_std_in_grpo": ("opd.py: --task-reward-coef > 0", ""),
    "target_kl": ("ppo.py: --kl-ctrl adaptive", "AdaptiveKLController("),
    "horizon": ("ppo.py: --kl-ctrl adaptive", "AdaptiveKLController("),
}


def options(cfg) -> list[str]:
    """The options --help shows, by flag name with underscores (flag = "--" + this, "_" -> "-"): section.field of
    every leaf field, a system section's under its flags' prefix (cfg.system.scale_out.backend: trainer.backend)."""
    return list(config.flag_values(cfg))


def flag(option: str) -> str:
    return "--" + option.replace("_", "-")


def recording(cls, prefix: str, reads: set):
    """cls, its field reads added to `reads` unless made by dataclasses/copy or a check function (validation)."""
    names = {f.name for f in dataclasses.fields(cls)}

    class Recording(cls):
        __slots__ = ()  # the sections' layout (slotted dataclasses), so that an instance's class can be swapped

        def __getattribute__(self, name):
            if name in names:
                caller = sys._getframe(1)
                while caller.f_code.co_name.startswith("<") and caller.f_back:  # a comprehension's frame: its function's
                    caller = caller.f_back
                if caller.f_globals.get("__name__") not in ("dataclasses", "copy") and not caller.f_code.co_name.startswith(
                    ("check", *COPIES)
                ):
                    reads.add(prefix + name)
            return super().__getattribute__(name)

    Recording.__name__, Recording.__qualname__, Recording.__module__ = cls.__name__, cls.__qualname__, cls.__module__
    return Recording


def tiny_config(recipe, name: str, out: Path):
    cfg = small_config(recipe, out, steps=1, num_threads=1, save_freq=0)
    cfg.data.train_batch_size = 4
    if hasattr(cfg.actor, "ppo_mini_batch_size"):
        cfg.actor.ppo_mini_batch_size = 4
    cfg.system.data.val_max_samples = 4
    if hasattr(cfg, "rollout"):
        cfg.rollout.n = 2
    if name == "dapo":
        cfg.gen_batch_size = 4
    if name == "opd":  # the embedded model as its own teacher will do
        cfg.teacher = str(ROOT / "rlkit" / "assets" / "tiny-arith")
    return cfg


def read_in_one_run(name: str, out: Path) -> tuple[list[str], set[str]]:
    from rlkit import tracking

    recipe = load_recipe(name)
    cfg, reads = tiny_config(recipe, name, out), set()
    for prefix, section in config.sections(cfg):
        section.__class__ = recording(type(section), prefix + ".", reads)
    top = {f.name for f in dataclasses.fields(cfg) if not dataclasses.is_dataclass(getattr(cfg, f.name))}
    cfg.__class__ = recording(type(cfg), "", reads)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tracking, "plot_learning_curve", lambda metrics, png, title="": Path(png))
        recipe.main(cfg)
    reads = {r for r in reads if "." in r or r in top}
    return options(cfg), reads


def source(name: str) -> str:
    return (ROOT / "recipes" / f"{name}.py").read_text()


def without_checks(path: Path) -> str:
    """rlkit/config.py's code less its check functions and methods (a value only checked is not used): its
    properties read fields too (actor.clip_low reads clip_ratio)."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if hasattr(node, "body") and isinstance(node.body, list):
            node.body = [n for n in node.body if not (isinstance(n, ast.FunctionDef) and n.name.startswith("check"))] or [ast.Pass()]
    return ast.unparse(tree)


CODE = "\n".join(p.read_text() if p.name != "config.py" else without_checks(p) for p in sorted((ROOT / "rlkit").glob("*.py")))


def read_elsewhere(option: str, name: str) -> bool:
    """On OTHER_PATHS for this recipe, and read as an attribute by code outside config.py."""
    if option not in OTHER_PATHS:
        return False
    _, needs = OTHER_PATHS[option]
    field_name = option.rsplit(".", 1)[-1]
    code = CODE + source(name)
    read = rf"\.{field_name}\b(?!\s*=[^=])|getattr\(\w+, \"{field_name}\""
    return needs in source(name) and re.search(read, code) is not None


def other_value(cls, option_field: str, default):
    """A non-default value of the field's type."""
    hint = typing.get_type_hints(cls, include_extras=True)[option_field]
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) is typing.Annotated:
        hint, args = args[0], [a for a in typing.get_args(args[0]) if a is not type(None)]
    if typing.get_origin(hint) is typing.Literal:
        return next(a for a in args if a != default)
    if isinstance(default, bool):
        return not default
    if isinstance(default, int):
        return default + 2
    if isinstance(default, float):
        return default * 2 + 0.5
    if isinstance(default, tuple):
        return tuple(v * 2 + 0.5 for v in default)
    if isinstance(default, str) or default is None:
        return "x=1"
    return default


class Loaded(Exception):
    """A model started loading: nothing refused the option first."""


def refused(name: str, option: str, tmp: Path) -> bool:
    """The option alone at a non-default value ends in a ConfigError naming its flag, before a model loads."""
    from rlkit import placement
    from rlkit.errors import ConfigError

    recipe = load_recipe(name)
    cfg = tiny_config(recipe, name, tmp)
    section, last = config.owner(cfg, option)
    setattr(section, last, other_value(type(section), last, getattr(section, last)))

    def load(*a, **k):
        raise Loaded

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(placement, "build_policy", load)
        mp.setattr(recipe, "build_policy", load, raising=False)
        mp.setattr(recipe, "RewardTrainer", load, raising=False)
        try:
            recipe.main(cfg)
        except ConfigError as e:
            return flag(option) in str(e) and "\n" not in str(e)
        except Loaded:
            return False
    return False


def unhonoured(name: str, tmp: Path) -> list[str]:
    shown, reads = read_in_one_run(name, tmp / "run")
    rest = [o for o in shown if o not in reads and not read_elsewhere(o, name)]
    return [o for o in rest if not refused(name, o, tmp / "refused")]


@pytest.mark.parametrize("name", RECIPES)
def test_every_option_a_recipe_shows_is_read_or_refused(name, tmp_path):
    assert unhonoured(name, tmp_path) == []


def test_the_recorder_sees_an_unread_option(tmp_path, monkeypatch):
    """A field planted in rm.py's optimiser section and read nowhere is reported, though a check function reads it."""
    from rlkit import config

    @dataclasses.dataclass
    class Planted(config.OptimConfig):
        ignored: int = 0

        def check(self) -> None:
            super().check()
            assert self.ignored >= 0  # a check's read is not a use

    monkeypatch.setattr(config, "OptimConfig", Planted)  # what recipes/rm.py imports when loaded
    assert unhonoured("rm", tmp_path) == ["actor.ignored"]


NEEDS_ANOTHER = [  # (section, field, value, the refusal's message): each option alone, without what opens its path
    ("data", "task_seed", 3, "--data.task-seed applies to a generated task only: add --data.task NAME"),
    ("data", "task_options", "min_terms=2", "--data.task-options applies to a generated task only"),
    ("data", "sampler_weights", (1.0, 1.0, 1.0), "--data.sampler-weights applies to --data.sampler difficulty only"),
    ("actor", "max_skipped_steps", 5, "--actor.max-skipped-steps applies to --actor.nan-policy skip only"),
    ("trainer", "async_workers", 2, "--trainer.async-workers applies to the asynchronous rollout only"),
    ("trainer", "async_timeout_s", 60.0, "--trainer.async-timeout-s applies to the asynchronous rollout only"),
]


@pytest.mark.parametrize("section, name, value, message", NEEDS_ANOTHER)
def test_an_option_that_needs_another_is_refused_alone(section, name, value, message):
    """Options read only on a path another option opens were accepted and ignored without it; now one line each.
    With that option they pass the checks."""
    from rlkit import config
    from rlkit.errors import ConfigError

    cfg = config.set_flags(load_recipe("grpo").Config(), {f"{section}.{name}": value})
    with pytest.raises(ConfigError, match=re.escape(message)):
        config.check_flags(cfg)
    opens = {"data": ("task", "reasoning_gym:chain_sum"), "actor": ("nan_policy", "skip"), "trainer": ("async_steps", 1)}
    key, on = ("sampler", "difficulty") if name == "sampler_weights" else opens[section]
    config.set_flags(cfg, {f"{section}.{key}": on})
    config.check_flags(cfg)


def test_docs_errors_md_quotes_each_needs_another_option_refusal():
    """docs/errors.md has a row for each refusal above, with its message as the code writes it."""
    import inspect

    page = (ROOT / "docs" / "errors.md").read_text()
    messages = [case[3] for case in NEEDS_ANOTHER] + [
        "--actor.clip-ratio-c: CISPO's loss has no dual clip (its weights are capped instead)",
        "its ratio is clipped in log space",
        "sequence-level clip",
    ]
    missing = [m for m in messages if m not in page]
    assert not missing, f"docs/errors.md lacks these refusals: {missing}"
    for name in ("cispo", "gmpo", "gspo"):  # and each recipe still says what the page quotes
        source = inspect.getsource(load_recipe(name))
        assert any(m in source for m in messages[-3:]), name


@pytest.mark.parametrize("name", ["cispo", "gmpo", "gspo"])
def test_a_loss_without_dual_clip_refuses_clip_ratio_c(name, tmp_path):
    assert refused(name, "actor.clip_ratio_c", tmp_path)
