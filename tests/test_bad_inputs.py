"""The failures a new user still hits (issues #10 and #21): each ends with one line naming the flag or file and the fix.

Most cases stop in `recipe.preflight` / rlkit/preflight.py, before the model loads (the tests make a model load fail
them). docs/errors.md lists every case with its message. Also: parse_hermes under fuzzing (no exception escapes, no
unbounded work), the async generation worker's hang/stop/kill messages, and the bench/reliability.py driver.
"""

import dataclasses
import math
import multiprocessing
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from test_grpo_recipe import ROOT, _row, _write_parquet, load_recipe

from rlkit import agent, checkpoint, tools
from rlkit.async_rollout import Rollouts
from rlkit.config import (
    AsyncConfig,
    ModelConfig,
    RewardConfig,
    RewardSystem,
    RolloutConfig,
    System,
    TrainerSystem,
    flag_values,
    nested,
    set_flags,
)
from rlkit.errors import ConfigError, RunFailed, UserError
from rlkit.rewards import RewardFn, time_limit

FIXTURE = ROOT / "tests" / "fixtures" / "my_reward.py"


def moe(cfg):
    """The embedded mixture-of-experts (rlkit/assets/tiny-moe) as the policy."""
    from rlkit import demos

    cfg.model.path = str(demos.MOE_MODEL)


def tiny(grpo, tmp_path, **data):
    cfg = grpo.Config()
    cfg.data.train_files = [_write_parquet(tmp_path / "train.parquet", [_row() for _ in range(8)])]
    cfg.system.data.val_files = []
    cfg.data.train_batch_size = cfg.actor.ppo_mini_batch_size = 4
    cfg.rollout.n = 2
    cfg.trainer.total_training_steps = 1
    cfg.system.trainer.val_before_train = False
    cfg.system.trainer.default_local_dir = str(tmp_path / "out")
    return set_flags(cfg, {f"data.{k}": v for k, v in data.items()})


def corrupt_checkpoint(cfg, tmp_path):
    """A checkpoint of exactly this run whose policy/state.pt is garbage."""

    def garbage(folder):
        folder.mkdir()
        (folder / "state.pt").write_bytes(b"PK\x03\x04 garbage")

    path = checkpoint.save(
        tmp_path / "ckpt", 1, {"loader": {"epoch": 0, "position": 1}}, nested(flag_values(cfg)), parts={"policy": garbage}
    )
    cfg.system.trainer.resume = str(path)
    return str(path / "policy" / "state.pt")


CASES = {
    # name: (change the config, phrases the message holds); a change may return extra phrases
    "string_prompts": (
        lambda c, t: set_flags(c, {"data.train_files": [_write_parquet(t / "s.parquet", [dict(_row(), prompt="What is 1+1?")] * 8)]}),
        ["holds strings", '"role": "user"'],
    ),
    "max_prompt_length_0": (
        lambda c, t: set_flags(c, {"data.max_prompt_length": 0, "data.truncation": "left"}),
        ["--data.max-prompt-length 0", "at least 1"],
    ),
    "not_parquet": (
        lambda c, t: (t / "train.csv").write_text("a,b\n1,2\n") and set_flags(c, {"data.train_files": [str(t / "train.csv")]}),
        ["--data.train-files", "train.csv: not a parquet file"],
    ),
    "empty_file": (
        lambda c, t: (t / "e.parquet").write_bytes(b"") or set_flags(c, {"data.train_files": [str(t / "e.parquet")]}),
        ["--data.train-files", "e.parquet: not a parquet file"],
    ),
    "empty_dataset": (
        lambda c, t: set_flags(c, {"data.train_files": [_write_parquet(t / "none.parquet", [])]}),
        ["--data.train-files", "none.parquet: no rows"],
    ),
    "long_val_prompt": (
        lambda c, t: set_flags(c, {"data.val_files": [_write_parquet(t / "val.parquet", [_row(), _row("What is " + "1+" * 300 + "1?")])]}),
        ["row 1 of", "val.parquet", "--data.max-prompt-length", "--data.truncation"],
    ),
    "max_response_length_0": (lambda c, t: set_flags(c, {"data.max_response_length": 0}), ["--data.max-response-length 0"]),
    "val_batch_size_0": (lambda c, t: set_flags(c, {"data.val_batch_size": 0}), ["--data.val-batch-size 0"]),
    "val_n_0": (lambda c, t: set_flags(c, {"trainer.val_n": 0}), ["--trainer.val-n 0", "at least 1"]),
    "negative_micro_batch": (
        lambda c, t: set_flags(c, {"actor.ppo_micro_batch_size": -2}),
        ["--actor.ppo-micro-batch-size -2", "0 (auto)"],
    ),
    "negative_log_prob_micro_batch": (
        lambda c, t: set_flags(c, {"rollout.log_prob_micro_batch_size": -1}),
        ["--rollout.log-prob-micro-batch-size -1"],
    ),
    "reward_model_micro_batch_0": (  # 0 passed to the reward model was range(0, n, 0): a ValueError after the model loaded
        lambda c, t: set_flags(c, {"reward.model_micro_batch_size": 0}),
        ["--reward.model-micro-batch-size 0", "at least 1"],
    ),
    "lr_zero": (lambda c, t: set_flags(c, {"actor.lr": 0.0}), ["--actor.lr 0.0", "learning rate"]),
    "lr_absurd": (lambda c, t: set_flags(c, {"actor.lr": 3.0}), ["--actor.lr 3.0", "well below 1"]),
    "ppo_epochs_0": (lambda c, t: set_flags(c, {"actor.ppo_epochs": 0}), ["--actor.ppo-epochs 0"]),
    "temperature_0": (
        lambda c, t: set_flags(c, {"rollout.temperature": 0.0}),
        ["--rollout.temperature 0.0", "temperature > 0", "--rollout.val-temperature"],
    ),
    "reward_file_import_error": (
        lambda c, t: (
            (t / "bad_reward.py").write_text("import no_such_module_xyz\n")
            and set_flags(c, {"reward.custom_fn": f"{t}/bad_reward.py:score"})
        ),
        ["the reward file", "bad_reward.py", "failed while importing", "no_such_module_xyz"],
    ),
    "null_ground_truth": (
        lambda c, t: set_flags(
            c, {"data.train_files": [_write_parquet(t / "n.parquet", [_row(answer=None if i in (2, 5) else "2") for i in range(8)])]}
        ),
        ["n.parquet", "ground_truth is null in row(s) 2, 5"],
    ),
    "over_the_context": (
        lambda c, t: set_flags(
            c,
            {
                "data.max_response_length": 64,
                "data.train_files": [_write_parquet(t / "c.parquet", [_row("What is " + "1+" * 40 + "1?")] * 8)],
            },
        ),
        ["+ --data.max-response-length 64", "over the model's context of 128", "max_position_embeddings"],
    ),
    "corrupt_policy_state": (corrupt_checkpoint, ["cannot read", "corrupt or cut short"]),
    # issue #21: before the model loads (and before Ray starts)
    "grad_clip_0": (lambda c, t: set_flags(c, {"actor.grad_clip": 0.0}), ["--actor.grad-clip 0.0", "must be > 0", "zero every update"]),
    "grad_clip_negative": (lambda c, t: set_flags(c, {"actor.grad_clip": -1.0}), ["--actor.grad-clip -1.0", "reverse it"]),
    "temperature_nan": (lambda c, t: set_flags(c, {"rollout.temperature": math.nan}), ["--rollout.temperature nan", "finite"]),
    "kl_loss_coef_inf": (lambda c, t: set_flags(c, {"actor.kl_loss_coef": math.inf}), ["--actor.kl-loss-coef inf", "finite"]),
    "sampler_weights_nan": (
        lambda c, t: set_flags(c, {"data.sampler_weights": (0.2, math.nan, 0.2)}),
        ["--data.sampler-weights (0.2, nan, 0.2)", "finite"],
    ),
    "async_steps_negative": (lambda c, t: set_flags(c, {"trainer.async_steps": -1}), ["--trainer.async-steps -1", ">= 0"]),
    "async_workers_0": (
        lambda c, t: set_flags(c, {"trainer.async_steps": 1, "trainer.async_workers": 0}),
        ["--trainer.async-workers 0", ">= 1"],
    ),
    "async_timeout_negative": (
        lambda c, t: set_flags(c, {"trainer.async_steps": 1, "trainer.async_timeout_s": -5.0}),
        ["--trainer.async-timeout-s -5.0", "0 to wait"],
    ),
    "megatron_tp_mismatch": (
        lambda c, t: set_flags(c, {"trainer.backend": "ray", "trainer.engine": "megatron", "trainer.n_workers": 3, "trainer.tp_size": 2}),
        ["--trainer.tp-size 2 must divide --trainer.n-workers 3"],
    ),
    "megatron_async": (
        lambda c, t: set_flags(
            c, {"trainer.backend": "ray", "trainer.engine": "megatron", "trainer.n_workers": 2, "trainer.async_steps": 1}
        ),
        ["--trainer.async-steps 1 does not run with --trainer.engine megatron"],
    ),
    "megatron_heads": (  # the embedded model's config.json says how many heads it has: read without loading it
        lambda c, t: set_flags(c, {"trainer.backend": "ray", "trainer.engine": "megatron", "trainer.n_workers": 7, "trainer.tp_size": 7}),
        ["--trainer.tp-size 7 must divide the attention heads"],
    ),
    "megatron_local": (lambda c, t: set_flags(c, {"trainer.engine": "megatron"}), ["--trainer.engine megatron runs on Ray workers"]),
    # --trainer.sp-size (Ulysses): each refused before Ray starts; the padded layout set where the case is about something else
    "sp_local": (lambda c, t: set_flags(c, {"trainer.sp_size": 2}), ["--trainer.sp-size 2 runs on Ray workers", "--trainer.backend ray"]),
    "sp_workers": (
        lambda c, t: set_flags(c, {"trainer.backend": "ray", "trainer.n_workers": 3, "trainer.sp_size": 2}),
        ["--trainer.sp-size 2 must divide --trainer.n-workers 3"],
    ),
    "sp_megatron": (
        lambda c, t: set_flags(c, {"trainer.backend": "ray", "trainer.engine": "megatron", "trainer.sp_size": 2}),
        ["--trainer.sp-size 2 runs with the FSDP engine only", "--trainer.engine fsdp"],
    ),
    "sp_packed": (
        lambda c, t: set_flags(c, {"trainer.backend": "ray", "trainer.n_workers": 2, "trainer.sp_size": 2}),
        ["--trainer.sp-size 2 does not take packed rows yet", "--model.no-remove-padding"],
    ),
    "sp_attention": (
        lambda c, t: set_flags(
            c,
            {
                "trainer.backend": "ray",
                "trainer.n_workers": 2,
                "trainer.sp_size": 2,
                "model.remove_padding": False,
                "model.attn_implementation": "eager",
            },
        ),
        ["--trainer.sp-size 2 runs its own sdpa attention", "--model.attn-implementation sdpa"],
    ),
    "sp_checkpointing": (
        lambda c, t: set_flags(
            c,
            {
                "trainer.backend": "ray",
                "trainer.n_workers": 2,
                "trainer.sp_size": 2,
                "model.remove_padding": False,
                "model.gradient_checkpointing": "on",
            },
        ),
        ["--trainer.sp-size 2 does not run with gradient checkpointing", "--model.gradient-checkpointing off"],
    ),
    "sp_router_replay": (  # forward_sp splits no routing over the shards (on the embedded MoE: 4 heads, S = 2 divides them)
        lambda c, t: (
            set_flags(
                c,
                {
                    "trainer.backend": "ray",
                    "trainer.n_workers": 2,
                    "trainer.sp_size": 2,
                    "model.remove_padding": False,
                    "actor.router_replay": "r2",
                },
            ),
            moe(c),
        ),
        ["--trainer.sp-size 2 does not carry --actor.router-replay r2", "--actor.router-replay none"],
    ),
    "sp_heads": (  # the embedded model has 4 attention heads (its config.json, read without loading it)
        lambda c, t: set_flags(c, {"trainer.backend": "ray", "trainer.n_workers": 3, "trainer.sp_size": 3, "model.remove_padding": False}),
        ["--trainer.sp-size 3 must divide the model's 4 attention heads"],
    ),
    "swap_without_async": (lambda c, t: set_flags(c, {"trainer.swap_every": 4}), ["--trainer.swap-every", "--trainer.async-steps 1"]),
    "swap_with_generate": (
        lambda c, t: set_flags(c, {"trainer.async_steps": 1, "trainer.swap_every": 4, "rollout.hf_impl": "generate"}),
        ["--trainer.swap-every 4 does not run with --rollout.hf-impl generate"],
    ),
    "swap_mode_alone": (
        lambda c, t: set_flags(c, {"trainer.async_steps": 1, "trainer.swap_mode": "reprefill"}),
        ["--trainer.swap-mode reprefill", "--trainer.swap-every"],
    ),
    "max_staleness_negative": (
        lambda c, t: set_flags(c, {"trainer.async_steps": 1, "trainer.max_staleness": -1}),
        ["--trainer.max-staleness -1"],
    ),
    "queue_without_async": (lambda c, t: set_flags(c, {"trainer.queue_groups": 2}), ["--trainer.queue-groups", "--trainer.async-steps 1"]),
    "queue_with_ray": (
        lambda c, t: set_flags(c, {"trainer.async_steps": 1, "trainer.queue_groups": 2, "trainer.backend": "ray"}),
        ["--trainer.queue-groups 2 does not run with --trainer.backend ray"],
    ),
    "max_staleness_masks_every_batch": (
        lambda c, t: set_flags(c, {"trainer.async_steps": 2, "trainer.max_staleness": 1}),
        ["--trainer.max-staleness 1 < --trainer.async-steps 2 masks every batch", "--trainer.queue-groups"],
    ),
    "drop_finished_out_of_range": (lambda c, t: set_flags(c, {"rollout.drop_finished": 2.0}), ["--rollout.drop-finished 2.0"]),
    "drop_finished_with_generate": (
        lambda c, t: set_flags(c, {"rollout.drop_finished": 0.5, "rollout.hf_impl": "generate"}),
        ["--rollout.drop-finished 0.5", "fast"],
    ),
    # MoE router replay (docs/moe.md): the model's config.json is read for its experts, never the weights
    "router_replay_no_experts": (lambda c, t: set_flags(c, {"actor.router_replay": "r2"}), ["--actor.router-replay r2", "has no experts"]),
    "r3_with_vllm": (
        lambda c, t: (moe(c), set_flags(c, {"actor.router_replay": "r3", "rollout.name": "vllm"})),
        ["--actor.router-replay r3", "--rollout.name vllm", "use --actor.router-replay r2"],
    ),
    "r3_with_drop_finished": (
        lambda c, t: (moe(c), set_flags(c, {"actor.router_replay": "r3", "rollout.drop_finished": 0.5})),
        ["--actor.router-replay r3", "--rollout.drop-finished 0.5"],
    ),
    "r3_with_reprefill": (
        lambda c, t: (
            moe(c),
            set_flags(
                c, {"actor.router_replay": "r3", "trainer.async_steps": 1, "trainer.swap_every": 4, "trainer.swap_mode": "reprefill"}
            ),
        ),
        ["--actor.router-replay r3", "--trainer.swap-mode reprefill"],
    ),
    "r3_with_async": (
        lambda c, t: (moe(c), set_flags(c, {"actor.router_replay": "r3", "trainer.async_steps": 1})),
        ["--actor.router-replay r3", "--trainer.async-steps 1"],
    ),
    "moe_with_megatron": (
        lambda c, t: (
            moe(c),
            set_flags(c, {"trainer.backend": "ray", "trainer.engine": "megatron", "trainer.n_workers": 2}),
        ),
        ["--trainer.engine megatron", "mixture-of-experts", "use --trainer.engine fsdp"],
    ),
    "moe_with_vllm_on_cpu": (
        lambda c, t: (moe(c), set_flags(c, {"rollout.name": "vllm", "trainer.device": "cpu"})),
        ["--rollout.name vllm on CPU", "mixture-of-experts", "use --rollout.name hf"],
    ),
    "filter_drops_every_prompt": (
        lambda c, t: set_flags(c, {"data.max_prompt_length": 2, "data.filter_overlong_prompts": True}),
        ["every prompt is over --data.max-prompt-length 2"],
    ),
}
AFTER_MODEL_LOAD = {"corrupt_policy_state"}  # the checkpoint is read when the run starts, after the model is built


def no_model(monkeypatch, recipe):
    """Make loading the model (or starting Ray) fail the test: a check that should come first must have stopped the run."""

    def load(*args, **kwargs):
        pytest.fail("the model loaded (or Ray started) before the bad input was refused")

    monkeypatch.setattr(recipe, "build_policy", load)
    monkeypatch.setattr("rlkit.placement.resource_pools", load)


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input_stops_with_one_line_naming_flag_or_file(tmp_path, case, monkeypatch):
    grpo = load_recipe("grpo")
    cfg = tiny(grpo, tmp_path)
    if case not in AFTER_MODEL_LOAD:
        no_model(monkeypatch, grpo)
    change, phrases = CASES[case]
    extra = change(cfg, tmp_path)
    phrases = phrases + ([extra] if isinstance(extra, str) else [])
    with pytest.raises(UserError) as info:
        grpo.main(cfg)
    message = str(info.value)
    assert "\n" not in message, message
    for phrase in phrases:
        assert phrase in message, (phrase, message)


@pytest.mark.parametrize("recipe, field", [("ppo", "kl_coef"), ("opd", "kl_coef"), ("rm", "center_coef")])
def test_a_nan_or_inf_in_a_recipes_own_float_flag_is_refused_in_one_line(recipe, field):
    """Not only the shared sections: every float of a recipe's Config (issue 34: --kl-coef / --center-coef nan stopped
    later with "lower --actor.lr")."""
    from rlkit.config import check_values

    for bad in (math.nan, math.inf, -math.inf):
        cfg = load_recipe(recipe).Config()
        setattr(cfg, field, bad)
        with pytest.raises(ConfigError, match=f"^--{field.replace('_', '-')} {bad}: must be a finite number$"):
            check_values(cfg)
    check_values(load_recipe(recipe).Config())  # the defaults pass


def literal_fields(cfg, prefix="--"):
    """(section, field name, flag, choices) of every Literal field of a Config and of its sections."""
    import typing

    hints = typing.get_type_hints(type(cfg))
    for f in dataclasses.fields(cfg):
        value, flag = getattr(cfg, f.name), prefix + f.name.replace("_", "-")
        if dataclasses.is_dataclass(value):  # a system section (cfg.system.model) is named by its flags (--model.dtype)
            yield from literal_fields(value, f"--{value.flag_section}." if hasattr(value, "flag_section") else flag + ".")
        elif typing.get_origin(hints[f.name]) is typing.Literal:
            yield cfg, f.name, flag, typing.get_args(hints[f.name])


@pytest.mark.parametrize("recipe", sorted(p.stem for p in (ROOT / "recipes").glob("*.py")))
def test_a_literal_flag_set_in_python_outside_its_choices_is_refused_in_one_line(recipe):
    """tyro refuses `--turn-credit nope` on the command line, but a Config built in Python (a notebook, bench/turn_credit.py)
    is not parsed: grpo_tools.py ran `turn_credit = "nope"` as turn_baseline. check_flags refuses every such field."""
    from rlkit.config import check_flags

    flags = [flag for _, _, flag, _ in literal_fields(load_recipe(recipe).Config())]
    assert "--model.dtype" in flags, flags  # the walk reaches the sections (every recipe has a model section)
    n = len(flags)
    for i in range(n):
        cfg = load_recipe(recipe).Config()
        section, name, flag, choices = list(literal_fields(cfg))[i]
        setattr(section, name, "bogus")
        with pytest.raises(ConfigError, match=f"^{flag} 'bogus': choose one of {', '.join(map(str, choices))}$"):
            check_flags(cfg)
    check_flags(load_recipe(recipe).Config())  # the defaults pass


def test_the_critics_grad_clip_is_checked_too():
    from rlkit import preflight

    cfg = load_recipe("ppo").Config()
    cfg.critic.grad_clip = 0.0
    with pytest.raises(ConfigError, match=r"--critic.grad-clip 0.0"):
        preflight.check_grad_clip(cfg)


def test_sequence_parallel_refuses_the_critic_and_a_vision_language_model_before_the_model_loads(monkeypatch):
    from rlkit import preflight

    cfg = load_recipe("ppo").Config()  # a critic (value head): no sequence-parallel pass yet
    cfg.system.scale_out.backend, cfg.system.scale_out.n_workers, cfg.system.scale_out.sp_size, cfg.system.model.remove_padding = (
        "ray",
        2,
        2,
        False,
    )
    with pytest.raises(ConfigError, match=r"--trainer.sp-size 2: the critic's value head has no sequence-parallel pass yet"):
        preflight.check_sequence_parallel(cfg)
    cfg = load_recipe("grpo").Config()
    cfg.system.scale_out.backend, cfg.system.scale_out.n_workers, cfg.system.scale_out.sp_size, cfg.system.model.remove_padding = (
        "ray",
        2,
        2,
        False,
    )
    preflight.check_sequence_parallel(cfg)  # the embedded model (4 heads): accepted
    vlm = SimpleNamespace(vision_config={}, num_attention_heads=4)  # what config.json of a Qwen2-VL says, in short
    monkeypatch.setattr(preflight, "_model_config", lambda cfg: vlm)
    with pytest.raises(ConfigError, match=r"--trainer.sp-size 2 does not run on a vision-language model"):
        preflight.check_sequence_parallel(cfg)


def test_nan_policy_skip_stops_after_k_skipped_steps(tmp_path, monkeypatch):
    grpo = load_recipe("grpo")
    cfg = tiny(grpo, tmp_path)
    cfg.trainer.total_training_steps = 5
    cfg.system.actor.nan_policy, cfg.system.actor.max_skipped_steps = "skip", 2
    monkeypatch.setattr(grpo, "make_actor_loss", lambda cfg: lambda mb, logp, ent, norm: (logp.sum() * torch.nan, {}, {}))
    with pytest.raises(FloatingPointError, match=r"2 optimizer steps in a row skipped .*--actor.max-skipped-steps 2") as info:
        grpo.main(cfg)
    assert "\n" not in str(info.value)
    rows = (Path(cfg.system.trainer.default_local_dir) / "metrics.jsonl").read_text().splitlines()
    assert len(rows) == 1  # step 1 skipped and logged; step 2 skipped again and stopped the run


def test_a_scorer_calling_sys_exit_ends_the_cli_with_status_1_and_one_line(tmp_path):
    train = _write_parquet(tmp_path / "train.parquet", [_row() for _ in range(8)])
    args = ["--data.train-files", train, "--data.val-files", "--data.train-batch-size", "4", "--actor.ppo-mini-batch-size", "4"]
    args += ["--rollout.n", "2", "--trainer.total-training-steps", "1", "--trainer.default-local-dir", str(tmp_path / "out")]
    args += ["--reward.custom-fn", f"{FIXTURE}:exit_score"]
    out = subprocess.run([sys.executable, str(ROOT / "recipes" / "grpo.py"), *args], capture_output=True, text=True, timeout=300)
    assert out.returncode == 1, out.stderr[-2000:]
    err = out.stderr.split("rlkit: error:")[-1]
    assert "exit_score failed on sample 0" in err and "called sys.exit(0)" in err and "Traceback" not in out.stderr


# ----------------------------------------------------------------------------- grpo_tools: agent flags and prompts


def tools_cfg(grpo_tools, tmp_path):
    cfg = grpo_tools.Config()
    cfg.data.train_batch_size = cfg.actor.ppo_mini_batch_size = 4
    cfg.rollout.n = 2
    cfg.system.trainer.default_local_dir = str(tmp_path / "out")
    return cfg


TOOL_CASES = {
    "max_turns_0": (lambda c, t: setattr(c.agent, "max_turns", 0), ["--agent.max-turns 0", "at least 1"]),
    "max_tool_calls_negative": (lambda c, t: setattr(c.agent, "max_tool_calls", -1), ["--agent.max-tool-calls -1"]),
    "tool_response_chars_0": (lambda c, t: setattr(c.agent, "max_tool_response_chars", 0), ["--agent.max-tool-response-chars 0"]),
    "observation_chars_0": (lambda c, t: setattr(c.agent, "max_observation_chars", 0), ["--agent.max-observation-chars 0"]),
    "unknown_tool": (lambda c, t: setattr(c.agent, "tools", "calculator,shell"), ["--agent.tools", "unknown tool(s) shell"]),
    "unknown_env": (
        lambda c, t: setattr(c.agent, "env", "chess"),
        ["--agent.env 'chess'", "choose tools, guess, textarena:GAME-ID, skyrl:ENV-ID, or a factory"],
    ),
    "self_play_three_players": (  # textarena's ThreePlayerTicTacToe asserts 3 players: no seat count rlkit plays
        lambda c, t: (setattr(c.agent, "env", "textarena:ThreePlayerTicTacToe-v0"), setattr(c.agent, "self_play", True)),
        ["--agent.env textarena:ThreePlayerTicTacToe-v0: a game for more than two players", "--agent.self-play"],
    ),
    "self_play_one_player_env": (
        lambda c, t: (setattr(c.agent, "env", "textarena:GuessTheNumber-v0"), setattr(c.agent, "self_play", True)),
        ["--agent.self-play: --agent.env textarena:GuessTheNumber-v0 is a one-player game"],
    ),
    "self_play_not_textarena": (
        lambda c, t: setattr(c.agent, "self_play", True),  # the default env: tools
        ["--agent.self-play: needs a two-player textarena game (--agent.env textarena:GAME-ID), got tools"],
    ),
    "self_play_n_2": (  # tools_cfg's --rollout.n 2: one game per prompt, a seat group of one
        lambda c, t: (setattr(c.agent, "env", "textarena:TicTacToe-v0"), setattr(c.agent, "self_play", True)),
        ["--agent.self-play: --rollout.n 2:", "use an even n >= 4"],
    ),
    "prompt_with_tools_too_long": (  # the embedded prompts: 19 tokens, 31 with the tools offered; checked with them
        lambda c, t: setattr(c.data, "max_prompt_length", 25),
        ["has 31 tokens, over --data.max-prompt-length 25", "train.parquet"],
    ),
}


@pytest.mark.parametrize("case", sorted(TOOL_CASES))
def test_agent_flags_and_tool_prompts_are_checked_before_the_model_loads(tmp_path, case, monkeypatch):
    from test_agent import load_tools_recipe

    grpo_tools = load_tools_recipe()
    cfg = tools_cfg(grpo_tools, tmp_path)
    no_model(monkeypatch, grpo_tools)
    change, phrases = TOOL_CASES[case]
    change(cfg, tmp_path)
    with pytest.raises(UserError) as info:
        grpo_tools.main(cfg)
    assert "\n" not in str(info.value)
    for phrase in phrases:
        assert phrase in str(info.value), (phrase, str(info.value))


def test_the_tool_template_check_reads_a_built_in_models_local_folder_not_the_hub(monkeypatch):
    """A built-in name (smollm2-135m-instruct) is not a hub id: reading its generation config by name went to the hub
    and slept through 23 s of retries with no network. The check must read the materialised folder."""
    import transformers
    from test_agent import load_tools_recipe

    from rlkit import preflight, workers
    from rlkit.demos import CALC_MODEL as MODEL_DIR

    cfg = load_tools_recipe().Config()
    cfg.model.path = "my-built-in"
    monkeypatch.setattr(workers, "resolve_model_path", lambda p: str(MODEL_DIR) if p == "my-built-in" else p)
    seen = []
    real = transformers.GenerationConfig.from_pretrained
    monkeypatch.setattr(transformers.GenerationConfig, "from_pretrained", lambda p, **k: seen.append(str(p)) or real(p, **k))
    preflight.check_prompts(cfg)
    assert seen == [str(MODEL_DIR)]


# ----------------------------------------------------------------------------- scorers: NaN extras, every call failing


def scorer_file(tmp_path, body: str) -> str:
    (tmp_path / "scorer.py").write_text(f"def score(data_source, solution_str, ground_truth, extra_info=None):\n    {body}\n")
    return f"{tmp_path / 'scorer.py'}:score"


def test_a_nan_extra_from_a_scorer_is_refused_not_printed_as_accuracy(tmp_path):
    spec = scorer_file(tmp_path, "return {'score': 1.0, 'acc': float('nan')}")  # once: 'held-out accuracy: nan'
    with pytest.raises(RunFailed) as info:
        RewardFn.from_config(RewardConfig(custom_fn=spec))(["ds"] * 2, ["a", "b"], ["1", "1"])
    message = str(info.value)
    assert "scorer.py" in message or "score failed" in message
    assert "dict['acc'] is nan; expected a finite number" in message and "\n" not in message
    reward = RewardFn(spec, on_error="zero")  # counted as an error, like a NaN score
    try:
        scores, metrics = reward(["ds"] * 2, ["a", "b"], ["1", "1"])
    finally:
        reward.close()
    assert scores.tolist() == [0.0, 0.0] and metrics["reward/errors"] == 2.0 and "reward/acc" not in metrics


def test_on_error_zero_stops_a_run_whose_scorer_fails_on_every_call(tmp_path):
    spec = scorer_file(tmp_path, "return 1 / 0")
    reward = RewardFn.from_config(RewardConfig(custom_fn=spec), system=RewardSystem(on_error="zero"))
    try:
        with pytest.raises(RunFailed) as info:
            reward(["ds"] * 3, ["a", "b", "c"], ["1", "1", "1"])
    finally:
        reward.close()
    message = str(info.value)
    assert "every one of the 3 reward calls of this batch failed" in message and "ZeroDivisionError" in message
    assert "score failed on sample 0" in message and "\n" not in message


def test_on_error_zero_keeps_going_when_some_calls_succeed(tmp_path):
    spec = scorer_file(tmp_path, "return 1.0 / int(solution_str)")
    reward = RewardFn.from_config(RewardConfig(custom_fn=spec), system=RewardSystem(on_error="zero"))
    try:
        scores, metrics = reward(["ds"] * 3, ["1", "0", "2"], ["1", "1", "1"])
    finally:
        reward.close()
    assert scores.tolist() == [1.0, 0.0, 0.5] and metrics["reward/errors"] == 1.0


def test_a_run_with_on_error_zero_and_a_scorer_failing_every_call_ends_with_one_line(tmp_path):
    grpo = load_recipe("grpo")
    cfg = tiny(grpo, tmp_path)
    cfg.reward.custom_fn, cfg.system.reward.on_error = scorer_file(tmp_path, "raise KeyError('answer')"), "zero"
    with pytest.raises(RunFailed, match=r"every one of the 8 reward calls of this batch failed .*KeyError: 'answer'"):
        grpo.main(cfg)
    assert (Path(cfg.system.trainer.default_local_dir) / "metrics.jsonl").read_text() == ""  # stopped in step 1: no step logged


# ----------------------------------------------------------------------------- parse_hermes: bounded, never raises


def test_a_deeply_nested_tool_call_is_an_error_for_the_model_not_a_crash():
    (call,) = tools.parse_hermes("<tool_call>" + "[" * 1000 + "</tool_call>")  # once: RecursionError, the run ended
    assert call.error.startswith("malformed tool call") and "MAX_JSON_DEPTH" in call.error
    (call,) = tools.parse_hermes('<tool_call>{"name": "f", "arguments": "' + "[" * 1000 + '"}</tool_call>')
    assert "MAX_JSON_DEPTH" in call.error  # the arguments given as a JSON string are bounded too
    (call,) = tools.parse_hermes('<tool_call>{"name": "f", "arguments": {"x": "' + "a" * tools.MAX_CALL_CHARS + '"}}</tool_call>')
    assert "MAX_CALL_CHARS" in call.error
    for lists, ok in ((tools.MAX_JSON_DEPTH - 2, True), (tools.MAX_JSON_DEPTH - 1, False)):  # the call and its arguments: 2 levels
        (call,) = tools.parse_hermes('<tool_call>{"name": "f", "arguments": {"x": ' + "[" * lists + "]" * lists + "}}</tool_call>")
        assert (call.error is None) == ok and call.name == ("f" if ok else "")
    assert tools.json_depth('{"a": "[[[{{", "b": [1, {"c": "\\"]"}]}') == 3  # brackets in strings (and escaped quotes) ignored


def test_a_malformed_call_goes_back_to_the_model_and_counts_as_a_tool_error():
    from test_agent import Scripted, chars
    from transformers import AutoTokenizer

    from rlkit import demos

    tok = AutoTokenizer.from_pretrained(demos.ARITH_MODEL)
    turn = chars(tok, "<tool_call>" + "[" * 300 + "</tool_call>") + [tok.eos_token_id]
    sampler = Scripted([turn, [tok.eos_token_id]])
    (ep,) = agent.run_turns(sampler, [[5, 6]], tok, tools.Tools([tools.calculator]), agent.AgentConfig(), 1000, [tok.eos_token_id])
    assert (ep.tool_calls, ep.tool_errors, ep.turns) == (1, 1, 2)  # counted in agent/tool_errors; the episode goes on
    assert "MAX_JSON_DEPTH" in tok.decode(sampler.contexts[1][2 + len(turn) :])


def fuzz_texts(rng: random.Random, n: int):
    """Random and adversarial model outputs around the Hermes tags."""
    pieces = ["<tool_call>", "</tool_call>", "{", "}", "[", "]", '"', "\\", ":", ",", '"name"', '"arguments"', "null", "1e999", "-0",
              "9" * 5000, "NaN", "Infinity", "\x00", "\ud800", "é", "\u202e", "💥", "\n", " ", '"calculator"', "true"]  # fmt: skip
    for i in range(n):
        kind = i % 8
        if kind == 0:  # random pieces
            yield "".join(rng.choice(pieces) for _ in range(rng.randint(0, 60)))
        elif kind == 1:  # deep nesting, in the call or in its arguments string
            d = rng.randint(30, 5000)
            inner = rng.choice(["[" * d, "{" * d, '{"a":' * d, "[" * d + "]" * d])
            yield "<tool_call>" + (inner if rng.random() < 0.5 else '{"name": "f", "arguments": ' + '"' + inner + '"}') + "</tool_call>"
        elif kind == 2:  # huge numbers
            yield (
                '<tool_call>{"name": "calculator", "arguments": {"expression": '
                + rng.choice(["1" * 10000, "1e99999", "-" + "9" * 4301])
                + "}}</tool_call>"
            )
        elif kind == 3:  # unterminated and nested tags
            yield "<tool_call>" * rng.randint(1, 200) + '{"name": "f"}' + "</tool_call>" * rng.randint(0, 3)
        elif kind == 4:  # random unicode, NUL bytes included
            yield "<tool_call>" + "".join(chr(rng.randint(0, 0x10FFFF)) for _ in range(rng.randint(0, 200))) + "</tool_call>"
        elif kind == 5:  # very long strings
            yield "<tool_call>" + '{"name": "f", "arguments": {"x": "' + "a" * rng.randint(1, 100_000) + '"}}</tool_call>'
        elif kind == 6:  # valid calls with random names and arguments
            yield (
                "<tool_call>"
                + '{"name": '
                + rng.choice(['"f"', "1", "null", "[]", '{"a": 1}'])
                + ', "arguments": '
                + rng.choice(['{"x": 1}', '"{\\"x\\": 1}"', "[]", '"[["', "3"])
                + "}</tool_call>"
            )
        else:  # many tags in one long turn
            yield ("text <tool_call>{}</tool_call> " * rng.randint(1, 300)) + "<tool_call>" * rng.randint(0, 300)


def test_parse_hermes_fuzz_no_exception_escapes_and_every_result_is_well_formed():
    rng = random.Random(21)
    count = 0
    for text in fuzz_texts(rng, 3000):
        calls = tools.parse_hermes(text)  # raises nothing: any exception fails the test
        assert len(calls) <= text.count("</tool_call>")  # each call is one closed tag
        for call in calls:
            if call.error is None:
                assert isinstance(call.name, str) and isinstance(call.arguments, dict)
            else:
                assert call.error.startswith("malformed tool call") and len(call.error) < 300  # what the model reads: short
        count += 1
    assert count == 3000


# ----------------------------------------------------------------------------- the async generation worker


def _sleeper():
    time.sleep(120)


def waiting_rollouts(timeout_s: float):
    """A Rollouts waiting on one stand-in 'generation worker' (a process that sleeps and never answers)."""
    system = System(async_rollout=AsyncConfig(async_timeout_s=timeout_s), trainer=TrainerSystem(device="cpu"))  # hf, dtype auto
    cfg = SimpleNamespace(system=system, rollout=RolloutConfig(n=2), model=ModelConfig())  # lora_rank 0
    r = Rollouts(cfg, None, None)
    r.k = 1
    ctx = multiprocessing.get_context("fork")
    proc = ctx.Process(target=_sleeper, daemon=True)
    proc.start()
    r.procs = [(proc, ctx.Queue(), ctx.Queue())]
    return r, proc


@pytest.mark.parametrize("how", ["sigstop", "sigkill", "silent"])
def test_a_stopped_killed_or_silent_async_worker_ends_the_wait_with_one_line(how):
    r, proc = waiting_rollouts(timeout_s=3.0)
    if how == "sigstop":
        os.kill(proc.pid, signal.SIGSTOP)
    elif how == "sigkill":
        os.kill(proc.pid, signal.SIGKILL)
    try:
        with time_limit(60), pytest.raises(RunFailed) as info:  # (before: waited forever; the limit turns that into a failure)
            r._receive(0, "batch")
    finally:
        if proc.is_alive():
            proc.kill()
    message = str(info.value)
    assert "\n" not in message and f"generation worker 0 (pid {proc.pid}" in message
    expected = {"sigstop": "has been stopped (SIGSTOP", "sigkill": "was killed by SIGKILL", "silent": "--trainer.async-timeout-s 3"}
    assert expected[how] in message, message
    assert "__main__" not in message
    proc.join(timeout=10)
    assert not proc.is_alive()  # a stopped or hung worker is killed, not left behind


# ----------------------------------------------------------------------------- bench/reliability.py


def test_reliability_driver_lists_its_cases_and_runs_one():
    bench = [sys.executable, str(ROOT / "bench" / "reliability.py")]
    listed = subprocess.run([*bench, "--list"], capture_output=True, text=True, timeout=120)
    assert listed.returncode == 0, listed.stderr[-1000:]
    names = {line.split()[0] for line in listed.stdout.splitlines() if line.strip()}
    assert {"parse_nested", "parse_fuzz", "checkpoint_pickle", "sandbox_environ", "owner_sigkill", "async_worker_stopped"} <= names
    # rm_lr_negative: the driver's recipe command line fits rm.py too (it passed --actor.ppo-mini-batch-size, a flag rm.py
    # does not take since issue #35, and its 3 rm cases failed on tyro's usage error: the driver is not run in CI)
    cases = ["--only", "parse_nested", "--only", "rm_lr_negative"]
    out = subprocess.run([*bench, *cases], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-1000:] + out.stderr[-1000:]
    assert "| parse_nested | PASS |" in out.stdout and "| rm_lr_negative | PASS |" in out.stdout and "2/2 pass" in out.stdout
