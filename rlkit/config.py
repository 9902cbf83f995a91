"""Typed configuration shared by every recipe. `tyro` turns these dataclasses into the CLI.

Each field's docstring is its `--help` text. Names follow verl's where verl has the same knob
(`train_batch_size`, `ppo_mini_batch_size`, `clip_ratio`, `kl_loss_coef`, ...), flattened:
verl's `actor_rollout_ref.actor.clip_ratio` is `--actor.clip-ratio` here. A recipe adds its own
algorithm fields next to these in its own `Config`.

Two kinds of section, in this order in a recipe's Config and in its --help:

- learning sections, what the model learns: which model and data, batch sizes, sampling, the loss and the
  optimiser, the reward, the schedule and the seed (`cfg.model`, `cfg.data`, `cfg.rollout`, `cfg.actor`,
  `cfg.reward`, `cfg.trainer`);
- the system sections, under `cfg.system`, how and where the run executes and what it writes: dtypes and kernels,
  micro-batches, validation, output and checkpoints, vLLM, the off-policy correction, what a failing step does,
  Ray/FSDP/Megatron, the asynchronous rollout, the sandbox (`cfg.system.model`, ..., `cfg.system.scale_out`).

A system section keeps its flags' names (`@system_section("model")`: `--model.dtype`, verl's name, is `cfg.system.model.dtype`);
--help shows it in a box of its own, `system.model`, after every learning option. The rule: `--X.field` is
`cfg.X.field` when --help lists it in the `X` box, and `cfg.system.<box>.field` when in a `system.<box>` box.

Sections by use: a recipe's Config takes only the fields its code reads, so every option its --help shows is read,
or refused with one line where the recipe cannot honour it (sft.py's --trainer.async-steps; tests/test_options_read.py). The layered classes are each the one before plus what a larger recipe reads:

    BaseDataConfig  < DataConfig     + the difficulty sampler (RL prompt rows)
    OptimConfig     < UpdateConfig   + the update loop (mini-batches, epochs)  < ActorConfig  + the policy loss
    BaseModelSystem < ModelSystem    + the policy engine's kernels and packed passes
    BaseDataSystem  < DataSystem     + truncation, generated tasks
    OptimSystem     < UpdateSystem   + token budget, non-finite steps          < ActorSystem  + off-policy, MoE replay
    RunSystem       < TrainerSystem  + sampled validation

recipes/rm.py takes the first of each, recipes/sft.py UpdateConfig/UpdateSystem, the RL recipes the last; cfg.system is
a System (PPOSystem: + critic, ToolsSystem: + agent, SFTSystem, RMSystem), all defined here, not in the recipes, since
worker processes unpickle them. From Python, set_flags(cfg, {"trainer.backend": "ray"}) sets options by flag name and
flag_values(cfg) lists them (a checkpoint's config.json holds these names). An option read only when another one
opens its path (--data.task-seed without --data.task) is refused alone with one line. Each section checks its own
values in `check` (next to its fields); `check_flags` runs them all, and the checks that read two sections, before any
model loads.
"""

from __future__ import annotations

import dataclasses
import os
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Literal

import tyro

from rlkit.errors import ConfigError

# The embedded demos' models and data (rlkit/demos.py names each); the defaults below are the default run's, tiny-arith
# on two-digit addition. (Here, not from rlkit.demos, whose judge loads the engine: every rlkit module may import config.)
ASSETS = Path(__file__).resolve().parent / "assets"


def learning_section(section: str):
    """Class decorator of a learning section, whose options are --<section>.<field> and cfg.<section>.<field>: a
    dataclass with slots, so that setting an option it lacks (a typo, or a system option: cfg.trainer.backend = "ray")
    fails loudly instead of setting nothing, and reading one says where it lives (cfg.system.scale_out.backend).
    (A slotted dataclass is a new class: its methods call a base's by name, BaseDataConfig.check(self), not super().)"""

    def make(cls):
        cls = dataclass(slots=True)(cls)
        cls.flag_section, cls.__getattr__ = section, _not_here
        return cls

    return make


def system_section(section: str):
    """Class decorator of a system section (a box of cfg.system): its fields are the flags --<section>.<field>
    (--model.dtype, not --system.model.dtype), so a system option keeps its name while --help lists it apart. A
    slotted dataclass, as learning_section's."""

    def make(cls):
        cls = dataclass(slots=True)(cls)
        hints = typing.get_type_hints(cls, include_extras=True)
        cls.__annotations__ = {
            f.name: Annotated[hints[f.name], tyro.conf.arg(name=f"{section}.{f.name}", prefix_name=False)] for f in dataclasses.fields(cls)
        }
        cls.flag_section, cls.__getattr__ = section, _not_here
        return cls

    return make


def _not_here(self, name: str):
    """A section's missing attribute: an AttributeError that names where that option lives, if it is one."""
    if name.startswith("__"):
        raise AttributeError(name)
    boxes = {**typing.get_type_hints(PPOSystem), **typing.get_type_hints(ToolsSystem)}
    where = [
        f"cfg.system.{box}.{name}"
        for box, cls in boxes.items()
        if cls.flag_section == self.flag_section and name in {f.name for f in dataclasses.fields(cls)}
    ]
    hint = f": --{self.flag_section}.{name.replace('_', '-')} is a system option, {where[0]}" if where else ""
    raise AttributeError(f"{type(self).__name__} has no attribute {name!r}{hint} (rlkit/config.py)")


def shown_default(label: str) -> str:
    """--help's "(default: ...)" of a path option: a default inside the install shown from its root
    (rlkit/assets/tiny-calc, not /home/.../rlkit/assets/tiny-calc); tyro passes it each recipe's own default."""
    return "(default: " + label.replace(str(ASSETS.parents[1]) + os.sep, "") + ")"


Path_ = Annotated[str, tyro.conf.arg(help_behavior_hint=shown_default)]  # a path option (shown_default)
Paths = Annotated[list[str], tyro.conf.arg(help_behavior_hint=shown_default)]


# ---------------------------------------------------------------------------------------------------------------------
# Learning sections: what the model learns
# ---------------------------------------------------------------------------------------------------------------------
@learning_section("model")
class ModelConfig:
    """The model to train: where it is, LoRA."""

    path: Path_ = str(ASSETS / "tiny-arith")
    """model to train: a local Hugging Face folder or a hub id"""
    trust_remote_code: bool = False
    """allow code shipped with the model to run (needed by some hub models; off unless asked)"""
    lora_rank: int = 0
    """LoRA rank; 0 trains all parameters (and keeps a frozen copy as the reference policy)"""
    lora_alpha: int = 16
    """LoRA scaling alpha"""
    target_modules: str = "all-linear"
    """LoRA target modules: 'all-linear' or a comma-separated list such as 'q_proj,v_proj'"""


@learning_section("data")
class BaseDataConfig:
    """The training files, lengths and batch size every recipe reads (recipes/rm.py: only this)."""

    train_files: Paths = field(default_factory=lambda: [str(ASSETS / "arith" / "train.parquet")])
    """verl-format parquet file(s) for training (columns data_source, prompt, ability, reward_model, extra_info)"""
    max_prompt_length: int = 512
    """prompt token budget; longer prompts are handled by `truncation`"""
    max_response_length: int = 8
    """maximum number of generated tokens per response"""
    train_batch_size: int = 32
    """prompts per training step (each sampled rollout.n times)"""
    shuffle: bool = True
    """shuffle the training prompts every epoch (seeded by trainer.seed)"""

    def check(self) -> None:
        for flag, value in {
            "--data.max-prompt-length": self.max_prompt_length,
            "--data.max-response-length": self.max_response_length,
        }.items():
            if value <= 0:
                raise ConfigError(f"{flag} {value}: must be at least 1")


@learning_section("data")
class DataConfig(BaseDataConfig):
    """+ how the RL recipes draw their prompts: the difficulty sampler (rlkit/data.py)."""

    sampler: Literal["uniform", "difficulty"] = "uniform"
    """how the RL recipes draw training prompts: uniform (epoch by epoch), or difficulty (weighted by each prompt's last pass rate: hard/normal/easy pools, data.DifficultySampler)"""
    sampler_weights: tuple[float, float, float] = (0.2, 1.0, 0.2)
    """with --data.sampler difficulty: the weights of the hard (pass rate < 0.25), normal and easy (> 0.75) pools; unseen prompts count as normal"""

    def check(self) -> None:
        BaseDataConfig.check(self)
        if self.sampler != "difficulty" and tuple(self.sampler_weights) != DataConfig().sampler_weights:
            raise ConfigError("--data.sampler-weights applies to --data.sampler difficulty only: add it, or drop the weights")


@learning_section("rollout")
class RolloutConfig:
    """How responses are sampled: the group size and the sampling distribution."""

    n: int = 8
    """responses sampled per prompt (the group size of GRPO)"""
    temperature: float = 1.0
    """sampling temperature (log-probs are computed at the same temperature)"""
    top_p: float = 1.0
    """nucleus sampling threshold"""
    top_k: int = 0
    """top-k sampling (0 = off)"""

    def check(self) -> None:
        if not self.temperature > 0:  # NaN too
            raise ConfigError(
                f"--rollout.temperature {self.temperature}: training samples responses, which needs a temperature > 0 (1.0 is "
                "usual); greedy decoding (0) is only for --rollout.val-temperature"
            )


def check_lr(flag: str, value: float) -> None:
    if not 0 < value < 1:
        raise ConfigError(f"{flag} {value}: a learning rate must be > 0 and well below 1 (typical: 1e-6 to 1e-4 for an LM, 1e-3 for LoRA)")


@learning_section("actor")
class OptimConfig:
    """The optimiser: AdamW, warm-up, clipping (recipes/rm.py: only this)."""

    lr: float = 1e-6
    """AdamW learning rate (recipes set their own for the embedded tiny models; a real model: ~1e-5 with LoRA, 1e-6 full)"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    warmup_steps: int = 0
    """linear learning-rate warm-up, in optimizer steps"""
    grad_clip: float = 1.0
    """clip the global gradient norm to this value"""

    def check(self) -> None:
        check_lr("--actor.lr", self.lr)


@learning_section("actor")
class UpdateConfig(OptimConfig):
    """+ the engine's update loop: mini-batches and epochs (recipes/sft.py: only this)."""

    ppo_mini_batch_size: int = 32
    """prompts per optimizer step; × rollout.n trajectories (as in verl). train_batch_size / this = optimizer steps per epoch"""
    ppo_epochs: int = 1
    """passes over the rollout batch per training step"""
    shuffle: bool = False
    """shuffle trajectories before splitting into mini-batches"""

    def check(self) -> None:
        OptimConfig.check(self)
        if self.ppo_epochs <= 0:
            raise ConfigError(f"--actor.ppo-epochs {self.ppo_epochs}: must be at least 1")


@learning_section("actor")
class ActorConfig(UpdateConfig):
    """+ the policy loss: PPO clip, entropy bonus, KL to the reference."""

    clip_ratio: float = 0.2
    """PPO clip range ε for the ratio π/π_old"""
    clip_ratio_low: float | None = None
    """lower clip ε (defaults to clip_ratio)"""
    clip_ratio_high: float | None = None
    """upper clip ε (defaults to clip_ratio; DAPO's clip-higher uses 0.28)"""
    clip_ratio_c: float | None = 3.0
    """dual-clip constant c > 1 bounding the loss for negative advantages (None disables)"""
    loss_agg_mode: Literal["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = "token-mean"
    """how per-token losses are averaged into one number"""
    entropy_coeff: float = 0.0
    """weight of the entropy bonus (subtracted from the loss)"""
    use_kl_loss: bool = True
    """add a KL(π‖π_ref) penalty to the loss"""
    kl_loss_coef: float = 0.001
    """weight of the KL penalty"""
    kl_loss_type: str = "low_var_kl"
    """KL estimator: kl (k1), abs, mse (k2), low_var_kl (k3); append '+' for the straight-through k2 gradient"""

    # The clip range, resolved in one place. (Properties, not __post_init__: tyro builds the command line's
    # defaults from a default instance, so a field filled in there would hide a later --actor.clip-ratio.)
    @property
    def clip_low(self) -> float:
        """ε_low: clip_ratio_low, or clip_ratio when unset"""
        return self.clip_ratio if self.clip_ratio_low is None else self.clip_ratio_low

    @property
    def clip_high(self) -> float:
        """ε_high: clip_ratio_high, or clip_ratio when unset"""
        return self.clip_ratio if self.clip_ratio_high is None else self.clip_ratio_high


@learning_section("critic")
class CriticConfig:
    """The value model (PPO's critic): where it starts, its optimiser and update loop, the clipped value loss."""

    path: str | None = None
    """value model to start from: a Hugging Face folder or hub id loaded with a fresh 1-output head (default: --model.path)"""
    lora_rank: int = 0
    """LoRA rank for the value model (the head always trains); 0 trains all parameters"""
    lr: float = 1e-5
    """AdamW learning rate of the value model"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    warmup_steps: int = 0
    """linear learning-rate warm-up, in optimizer steps"""
    grad_clip: float = 1.0
    """clip the value model's global gradient norm to this value"""
    ppo_mini_batch_size: int | None = None
    """prompts per critic optimizer step, × rollout.n trajectories (default: actor.ppo_mini_batch_size)"""
    ppo_epochs: int = 1
    """passes over the rollout batch per training step"""
    cliprange_value: float | None = 0.5
    """the value loss does not reward moving V further than this from the old value (None disables)"""
    loss_agg_mode: Literal["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = "token-mean"
    """how per-token value losses are averaged into one number"""

    def check(self) -> None:
        check_lr("--critic.lr", self.lr)
        if self.ppo_epochs <= 0:
            raise ConfigError(f"--critic.ppo-epochs {self.ppo_epochs}: must be at least 1")


@learning_section("reward")
class RewardConfig:
    """What scores a response: your function, a reward model, or both."""

    custom_fn: str | None = None
    """your scoring function as path/to/file.py:function_name, verl signature compute_score(data_source, solution_str, ground_truth, extra_info=None)"""
    model_path: str | None = None
    """a reward model (AutoModelForSequenceClassification, 1 output) scoring prompt + response with its own tokenizer and chat template"""
    combine: Literal["replace", "add"] = "replace"
    """with --reward.model-path: the model's score is the reward (replace) or is added to the function's (add)"""


@learning_section("trainer")
class TrainerConfig:
    """The run's length and seed."""

    total_epochs: int = 1
    """passes over the training prompts"""
    total_training_steps: int | None = None
    """stop after this many steps (overrides total_epochs when set)"""
    seed: int = 1
    """seed for data order, sampling and initialisation"""


# ---------------------------------------------------------------------------------------------------------------------
# System sections: how and where the run executes, what it writes (cfg.system.<box>; --help lists them last)
# ---------------------------------------------------------------------------------------------------------------------
@system_section("model")
class BaseModelSystem:
    """How the model runs: its dtype, activation checkpointing (recipes/rm.py: only this)."""

    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """compute dtype: auto = float32 on CPU, bfloat16 on GPU; 16-bit full training keeps float32 master weights (docs/gpu.md)"""
    gradient_checkpointing: Literal["auto", "on", "off"] = "auto"
    """recompute activations in the backward: less memory, ~30 % slower update (auto: on for 10M+ parameters on a GPU)"""


@system_section("model")
class ModelSystem(BaseModelSystem):
    """+ the policy engine's attention kernel and packed passes (rlkit/engine.py), vision towers."""

    attn_implementation: Literal["auto", "sdpa", "flash_attention_2", "eager"] = "auto"
    """attention kernel: auto = flash_attention_2 on CUDA when flash-attn imports with its kernel, else sdpa"""
    remove_padding: bool = True
    """passes on real tokens only, sequences packed into rows (rlkit/packing.py; varlen with flash_attention_2)"""
    share_prompt: bool = True
    """with remove_padding: a group's shared prompt computed once in those passes (sdpa and eager, not varlen)"""
    shared_prompt_attention: Literal["auto", "mask", "split"] = "auto"
    """with share_prompt and sdpa: mask = one dense block-mask sdpa call per row ((P + nR)^2 pairs); split = one sdpa
    call per sequence, only the pairs the mask allows (rlkit/packing.py); auto = split where it saves enough attention
    work per extra call (packing.split_pays: long responses), not with gradient checkpointing"""
    freeze_vision_tower: bool = True
    """vision-language models: train the language model only (LoRA: adapters on it only); false trains the vision tower too"""


@system_section("data")
class BaseDataSystem:
    """Validation files and how the rows are read (recipes/rm.py: only this)."""

    val_files: Paths = field(default_factory=lambda: [str(ASSETS / "arith" / "val.parquet")])
    """verl-format parquet file(s) for validation; empty to skip validation"""
    val_batch_size: int = 512
    """prompts per generation batch during validation"""
    val_max_samples: int = 512
    """use at most this many validation prompts (-1 = all)"""
    prompt_key: str = "prompt"
    """column that holds the chat messages"""

    def check(self) -> None:
        if self.val_batch_size <= 0:
            raise ConfigError(f"--data.val-batch-size {self.val_batch_size}: must be at least 1")


@system_section("data")
class DataSystem(BaseDataSystem):
    """+ the RL prompt rows: truncation, generated tasks (rlkit/data.py, rlkit/tasks.py)."""

    truncation: Literal["error", "left", "right", "middle"] = "error"
    """what to do with a prompt over max_prompt_length: error (names the row), or keep the end (left), the start (right), both ends (middle)"""
    filter_overlong_prompts: bool = False
    """drop prompts over max_prompt_length when loading, instead of applying `truncation`"""
    task: str | None = None
    """generate the data instead of reading files: reasoning_gym:NAME (e.g. reasoning_gym:chain_sum; needs `pip install reasoning-gym==0.1.25`); train/val files are then ignored"""
    task_options: str = ""
    """the task's own config options, key=value,key=value or JSON (e.g. min_terms=2,max_terms=2,max_digits=1)"""
    task_train_size: int = 1000
    """training items to generate (seed task_seed)"""
    task_val_size: int = 200
    """validation items to generate (questions also in the training set dropped); at least 1"""
    task_seed: int = 0
    """seed of the generated task data"""
    task_format: Literal["direct", "default", "plain", "number"] = "direct"
    """how the answer is asked for and read: reasoning-gym's system prompt (direct/default), none (plain: the whole response; number: its last number); README.md"""

    def check(self) -> None:
        BaseDataSystem.check(self)
        default = DataSystem()
        if self.task is None:  # the generated task's options are read only with one
            for name in ("task_options", "task_train_size", "task_val_size", "task_seed", "task_format"):
                if getattr(self, name) != getattr(default, name):
                    flag = "--data." + name.replace("_", "-")
                    raise ConfigError(f"{flag} applies to a generated task only: add --data.task NAME, or drop it")


@system_section("rollout")
class RolloutSystem:
    """The generation backend (hf or vllm), its batching and memory, validation's temperature, the sampler's log-probs."""

    name: Literal["hf", "vllm"] = "hf"
    """generation backend: hf (generate on the training model) or vllm (an engine beside it, synced each update; docs/vllm.md)"""
    val_temperature: float = 0.0
    """temperature for validation; 0 = greedy"""
    log_prob_micro_batch_size: int = 0
    """rows per forward pass of the log-prob and value passes (0 = --actor.ppo-micro-batch-size)"""
    hf_impl: Literal["fast", "generate"] = "fast"
    """hf: fast (rlkit's decoding loop, KV cache written in place: the same tokens as generate, faster) or generate (transformers'); docs/performance.md"""
    micro_batch_size: int = 0
    """hf: rows per generate call (0 = auto: on CUDA what half the free memory holds, docs/gpu.md; on CPU 64, all under 10M params)"""
    gpu_memory_utilization: float = 0.5
    """vllm on a GPU: share of GPU memory the engine takes while it generates; it sleeps in the trainer's passes (docs/gpu.md)"""
    kv_cache_gb: int = 1
    """vllm on CPU: GiB of RAM for the KV cache (VLLM_CPU_KVCACHE_SPACE)"""
    enforce_eager: bool = False
    """vllm on a GPU: skip CUDA graphs (slower decoding, faster start); always on for CPU"""
    max_num_seqs: int = 0
    """vllm: most sequences decoded at once (0 = vLLM's default)"""
    lora_adapter_sync: bool = True
    """vllm with --model.lora-rank > 0: sync the LoRA adapter as an adapter, not merged into the weights (docs/vllm.md)"""
    log_probs: bool = False
    """hf: also keep the sampler's own log-probs, for the rollout_corr/ metrics and the correction (docs/off-policy.md)"""
    drop_finished: float = 0.0
    """hf fast: once finished rows are at least this fraction of the rows still decoding, they leave the batch (same tokens; 0 = off; docs/performance.md)"""

    def check(self) -> None:
        if self.log_prob_micro_batch_size < 0:
            raise ConfigError(
                f"--rollout.log-prob-micro-batch-size {self.log_prob_micro_batch_size}: must be 0 (auto) or a positive number"
            )
        if not 0 <= self.drop_finished <= 1:
            raise ConfigError(f"--rollout.drop-finished {self.drop_finished}: a fraction in (0, 1] of the rows still decoding, or 0 (off)")
        if self.drop_finished and (self.name != "hf" or self.hf_impl != "fast"):
            why = "--rollout.name vllm schedules its own rows" if self.name != "hf" else "--rollout.hf-impl generate keeps every row"
            raise ConfigError(
                f"--rollout.drop-finished {self.drop_finished} applies to rlkit's fast loop only ({why}): use --rollout.name hf --rollout.hf-impl fast, or drop it"
            )


@system_section("actor")
class OptimSystem:
    """The update's micro-batches, memory only (recipes/rm.py: only this)."""

    ppo_micro_batch_size: int = 0
    """trajectories per forward/backward pass, memory only (0 = auto: 256 under 10M parameters, else 8; recipes/rm.py
    counts pairs, auto 64 on CPU and 4 on a GPU)"""

    def check(self) -> None:
        if self.ppo_micro_batch_size < 0:
            raise ConfigError(f"--actor.ppo-micro-batch-size {self.ppo_micro_batch_size}: must be 0 (auto) or a positive number")


@system_section("actor")
class UpdateSystem(OptimSystem):
    """+ a token budget per pass, and what a non-finite step does (recipes/sft.py: only this)."""

    max_token_len_per_micro_batch: int = 0
    """token budget of a forward pass instead of a row count (verl's ppo_max_token_len_per_gpu; 0 = off)"""
    nan_policy: Literal["error", "skip"] = "error"
    """on a non-finite loss or gradient: stop with an error, or skip that optimizer step"""
    max_skipped_steps: int = 3
    """with --actor.nan-policy skip: stop after this many consecutive skipped optimizer steps (0 = never)"""

    def check(self) -> None:
        OptimSystem.check(self)
        if self.max_skipped_steps < 0:
            raise ConfigError(f"--actor.max-skipped-steps {self.max_skipped_steps}: must be 0 (never stop) or a positive number")
        if self.nan_policy != "skip" and self.max_skipped_steps != 3:
            raise ConfigError("--actor.max-skipped-steps applies to --actor.nan-policy skip only: add it, or drop the limit")


@system_section("actor")
class ActorSystem(UpdateSystem):
    """+ the off-policy correction (a sampler that is not the trainer: vllm, async; docs/off-policy.md), MoE router replay."""

    rollout_correction: Literal["none", "token-tis", "token-mis", "seq-tis", "seq-mis", "geo-mask"] = "token-tis"
    """with rollout log-probs (vllm, async): weight or mask each token's loss by pi_old/mu (docs/off-policy.md)"""
    rollout_is_cap: float | None = None
    """the correction's upper bound C: the -tis cap, the upper bound of -mis and geo-mask (default per mode: 2.0; geo-mask 1.001)"""
    rollout_is_low: float | None = None
    """the lower bound of -mis and geo-mask (default per mode: 0.5; geo-mask 0.999)"""
    router_replay: Literal["none", "r2", "r3"] = "none"
    """MoE: force recorded expert routing in the training forwards: r2 recorded in the old-log-prob pass, r3 at rollout (docs/moe.md)"""

    @property
    def rollout_is_threshold(self):
        """--actor.rollout-is-cap / -low resolved for algos.rollout_correction: C for -tis, (low, high) otherwise, None = defaults"""
        from rlkit.algos import CORRECTION_DEFAULTS

        default = CORRECTION_DEFAULTS.get(self.rollout_correction)
        if default is None or isinstance(default, float):
            return self.rollout_is_cap if self.rollout_is_cap is not None else default
        low, high = default
        return (low if self.rollout_is_low is None else self.rollout_is_low, high if self.rollout_is_cap is None else self.rollout_is_cap)


@system_section("critic")
class CriticSystem:
    """The value model's micro-batches and what a non-finite step does (recipes/ppo.py)."""

    ppo_micro_batch_size: int = 0
    """trajectories per forward/backward pass of the value model, memory only (0 = auto, as the actor's)"""
    max_token_len_per_micro_batch: int = 0
    """token budget of a value-model forward pass, as --actor.max-token-len-per-micro-batch; 0 = off"""
    nan_policy: Literal["error", "skip"] = "error"
    """on a non-finite loss or gradient: stop with an error, or skip that optimizer step"""
    max_skipped_steps: int = 3
    """with --critic.nan-policy skip: stop after this many consecutive skipped optimizer steps (0 = never)"""

    def check(self) -> None:
        if self.ppo_micro_batch_size < 0:
            raise ConfigError(f"--critic.ppo-micro-batch-size {self.ppo_micro_batch_size}: must be 0 (auto) or a positive number")


@system_section("reward")
class RewardSystem:
    """Where and how scorers run (the sandbox), what a failing scorer does, the reward model's batches."""

    on_error: Literal["raise", "zero"] = "raise"
    """when a scoring function raises, hangs or returns a non-number: stop (raise) or score 0 and count it (zero)"""
    timeout_s: float = 30.0
    """wall-clock limit per scorer call (0 = none); in the sandbox the call's whole process group is killed, and the call counts as failing"""
    sandbox: Literal["auto", "all", "off"] = "auto"
    """where scorers run: auto = --reward.custom-fn, reasoning-gym and math-verify scorers in sandboxed processes, plain string scorers (gsm8k, the embedded task) here; all = every scorer sandboxed; off = all in this process (only for code and data you trust). See docs/sandbox.md"""
    sandbox_level: Literal["process", "network", "strict"] = "process"
    """the least isolation to accept, else stop before training: process (own process, limits, temp dir), network (+ no network), strict (+ no writes outside its temp dir)"""
    sandbox_workers: int = 0
    """sandboxed scorer processes working in parallel (0 = one per CPU core, at most 8)"""
    sandbox_fresh: bool = False
    """start a new sandbox process for every scorer call (strictest, slower); default: a fork of a long-lived worker per call"""
    sandbox_memory_mb: int = 2048
    """address-space limit of each sandboxed scorer process, MiB"""
    model_micro_batch_size: int = 32
    """sequences per forward pass of the reward model"""

    def check(self) -> None:
        if self.model_micro_batch_size < 1:  # (no auto: the reward model scores this many sequences per pass)
            raise ConfigError(f"--reward.model-micro-batch-size {self.model_micro_batch_size}: must be at least 1")


@system_section("trainer")
class RunSystem:
    """Where the run writes and logs, its checkpoints and validation schedule, its device and threads (recipes/rm.py)."""

    test_freq: int = 10
    """validate every this many steps (0 = only at the end)"""
    val_before_train: bool = True
    """validate the starting model before the first step"""
    save_freq: int = 0
    """save a checkpoint every this many steps (0 = only at the end)"""
    max_ckpt_to_keep: int = 2
    """keep the newest this many checkpoints"""
    resume: str = "disable"
    """'disable', 'auto' (latest checkpoint in default_local_dir) or a checkpoint folder"""
    default_local_dir: str = "outputs/{experiment_name}"
    """where checkpoints, metrics.jsonl and the learning-curve PNG are written"""
    project_name: str = "rlkit"
    """project name for wandb"""
    experiment_name: str | None = None
    """run name (default: recipe, model, data, e.g. grpo-qwen2.5-0.5b-instruct-gsm8k)"""
    logger: list[Literal["console", "wandb"]] = field(default_factory=lambda: ["console"])
    """where to log: console and/or wandb (WANDB_MODE=offline works with no network)"""
    device: str = "auto"
    """cpu, cuda, cuda:1, ... (auto = cuda when available)"""
    num_threads: int = 0
    """torch CPU threads (0 = 1 thread on a machine with ≤ 4 cores, else torch's default)"""


@system_section("trainer")
class TrainerSystem(RunSystem):
    """+ sampled validation (the recipes on rlkit.placement)."""

    val_n: int = 1
    """samples per validation prompt: 1 = one at --rollout.val-temperature; n > 1 also logs val/mean@n, val/pass@k, val/maj@k (docs/eval.md)"""

    def check(self) -> None:
        if self.val_n <= 0:
            raise ConfigError(f"--trainer.val-n {self.val_n}: must be at least 1")


@system_section("trainer")
class ScaleOutConfig:
    """Ray workers, FSDP2, Megatron tensor parallelism, Ulysses sequence parallelism (docs/scaling.md)."""

    backend: Literal["local", "ray"] = "local"
    """local: one worker in this process; ray: n_workers Ray actors with the model sharded by FSDP2"""
    n_workers: int = 1
    """worker processes with --trainer.backend ray (one per GPU; on CPU, gloo)"""
    cpus_per_worker: float = 1
    """CPU cores reserved per Ray worker bundle (colocated roles split a bundle)"""
    critic_workers: int = 0
    """PPO's critic with --trainer.backend ray: 0 = colocated with the actor (sharing its bundles); N = a pool of N bundles of its own"""
    reward_workers: int = 0
    """a reward model (--reward.model-path) with --trainer.backend ray: 0 = replicas colocated with the actor (one per bundle); N = a pool of N bundles of its own"""
    fsdp_param_dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """FSDP2 compute dtype (auto: bfloat16 on GPU, float32 on CPU); master weights stay float32 (docs/scaling.md)"""
    fsdp_offload: bool = False
    """FSDP2: keep sharded weights, gradients and optimizer state in CPU memory (larger models, slower)"""
    sp_size: int = 1
    """Ulysses sequence parallelism with --trainer.backend ray: S workers split each row's positions (n_workers = S x data-parallel size; docs/scaling.md)"""
    engine: Literal["fsdp", "megatron"] = "fsdp"
    """the policy's engine on Ray: fsdp (FSDP2) or megatron (tensor parallel, --trainer.tp-size; docs/scaling.md)"""
    tp_size: int = 1
    """--trainer.engine megatron: tensor-parallel size T (n_workers = T x data-parallel size)"""
    ray_address: str | None = None
    """a running Ray cluster to join (e.g. 127.0.0.1:6379, or set RAY_ADDRESS); default: start a local one"""


@system_section("trainer")
class AsyncConfig:
    """The asynchronous rollout: generation workers k steps ahead, in-flight weight updates, a queue of groups (docs/off-policy.md)."""

    async_steps: int = 0
    """k >= 1: a generation worker samples the batches of steps t+1..t+k while step t updates (docs/off-policy.md)"""
    async_workers: int = 1
    """with --trainer.async-steps >= 1: generation workers, each sampling a share of every batch"""
    async_timeout_s: float = 3600.0
    """with --trainer.async-steps >= 1: stop with one line when a generation worker sends nothing for this many seconds (a stopped one: after at most 60 s); 0 = wait forever"""
    swap_every: int = 0
    """with --trainer.async-steps >= 1: C > 0 = the worker polls every C tokens for weights pushed since its job began and loads them mid-generation (0 = off: whole batches, k-step; docs/off-policy.md)"""
    swap_mode: Literal["keep_kv", "reprefill"] = "keep_kv"
    """with --trainer.swap-every: keep_kv (go on with the KV cache of the old weights, PipelineRL) or reprefill (recompute prompt + tokens so far under the new weights, partial rollout)"""
    max_staleness: int = 0
    """with --trainer.async-steps >= 1: s > 0 = samples whose oldest token is more than s updates behind are masked out of the loss, counted in async/dropped_samples; with --trainer.queue-groups: such groups are dropped, async/dropped_groups (0 = off)"""
    queue_groups: int = 0
    """with --trainer.async-steps >= 1: G > 0 = a queue of groups: workers pull G prompts at a time and push their groups back, each step takes the next B ready ones, whoever made them (0 = each batch split evenly between the workers)"""

    def check(self) -> None:
        k = self.async_steps
        if k < 0:
            raise ConfigError(f"--trainer.async-steps {k}: must be >= 0 (0 = synchronous)")
        if self.async_workers < 1:
            raise ConfigError(f"--trainer.async-workers {self.async_workers}: must be >= 1")
        if self.async_timeout_s < 0:
            raise ConfigError(
                f"--trainer.async-timeout-s {self.async_timeout_s}: must be > 0 seconds, or 0 to wait for the workers forever"
            )
        if k == 0 and (self.async_workers != 1 or self.async_timeout_s != 3600.0):
            flag = "--trainer.async-workers" if self.async_workers != 1 else "--trainer.async-timeout-s"
            raise ConfigError(f"{flag} applies to the asynchronous rollout only: add --trainer.async-steps 1 (or more), or drop it")
        if self.swap_every < 0 or self.max_staleness < 0:
            flag, value = (
                ("--trainer.swap-every", self.swap_every) if self.swap_every < 0 else ("--trainer.max-staleness", self.max_staleness)
            )
            raise ConfigError(f"{flag} {value}: must be >= 0 (0 = off)")
        if k == 0 and (self.swap_every or self.max_staleness):
            flag = "--trainer.swap-every" if self.swap_every else "--trainer.max-staleness"
            raise ConfigError(
                f"{flag} applies to the asynchronous generation worker only: add --trainer.async-steps 1 (or more), or drop it"
            )
        if self.queue_groups < 0:
            raise ConfigError(f"--trainer.queue-groups {self.queue_groups}: must be >= 0 (0 = off: each batch split between the workers)")
        if k == 0 and self.queue_groups:
            raise ConfigError(
                "--trainer.queue-groups applies to the asynchronous generation workers only: add --trainer.async-steps 1 (or more), or drop it"
            )
        if 0 < self.max_staleness < k and not self.swap_every and not self.queue_groups:
            raise ConfigError(
                f"--trainer.max-staleness {self.max_staleness} < --trainer.async-steps {k} masks every batch from step {k + 1} on (each is "
                f"{k} updates behind, forever): raise it to >= {k}, or add --trainer.queue-groups G (stale groups are dropped, fresh ones taken)"
            )
        if self.swap_mode != "keep_kv" and not self.swap_every:
            raise ConfigError(
                f"--trainer.swap-mode {self.swap_mode} applies to in-flight weight updates only: add --trainer.swap-every C (tokens between polls), or drop it"
            )


@system_section("agent")
class AgentSystem:
    """Where the python tool runs (recipes/grpo_tools.py)."""

    sandbox_level: Literal["process", "network", "strict"] = "process"
    """the least isolation the python tool may run under, else stop before the model loads (see docs/sandbox.md)"""


@dataclass(slots=True)
class System:
    """How and where an RL recipe runs (cfg.system): each box is a section's system options, under the section's flags."""

    model: ModelSystem = field(default_factory=ModelSystem)
    data: DataSystem = field(default_factory=DataSystem)
    rollout: RolloutSystem = field(default_factory=RolloutSystem)
    actor: ActorSystem = field(default_factory=ActorSystem)
    reward: RewardSystem = field(default_factory=RewardSystem)
    trainer: TrainerSystem = field(default_factory=TrainerSystem)
    scale_out: ScaleOutConfig = field(default_factory=ScaleOutConfig)
    async_rollout: AsyncConfig = field(default_factory=AsyncConfig)


# The recipes whose system options differ from the RL recipes' (defined here, not in the recipes: a worker process
# unpickles the cfg.system it is handed, and must find its class whatever way the recipe was loaded).
@dataclass(slots=True)
class PPOSystem(System):
    """+ the value model's micro-batches and non-finite steps (recipes/ppo.py)."""

    critic: CriticSystem = field(default_factory=CriticSystem)


@dataclass(slots=True)
class ToolsSystem(System):
    """+ where the python tool runs (recipes/grpo_tools.py)."""

    agent: AgentSystem = field(default_factory=AgentSystem)


@dataclass(slots=True)
class SFTSystem(System):
    """recipes/sft.py: its actor box without the off-policy correction (SFT has no policy loss)."""

    actor: UpdateSystem = field(default_factory=UpdateSystem)


@dataclass(slots=True)
class RMSystem:
    """recipes/rm.py: what it reads, none of the RL engine: the model's dtype, validation pairs, micro-batches, the run."""

    model: BaseModelSystem = field(default_factory=BaseModelSystem)
    data: BaseDataSystem = field(default_factory=BaseDataSystem)
    actor: OptimSystem = field(default_factory=OptimSystem)
    trainer: RunSystem = field(default_factory=RunSystem)


# ---------------------------------------------------------------------------------------------------------------------
# A Config as flags, and the checks
# ---------------------------------------------------------------------------------------------------------------------
def flag_values(cfg) -> dict:
    """{option: value} of a recipe's Config, each option named by its flag with underscores ("model.dtype",
    "trainer.backend", "norm_adv_by_std_in_grpo"): the names --help shows, whichever section holds the field. A
    checkpoint's config.json holds these (nested by their first part), so resuming compares flags, not layouts."""
    out = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if not dataclasses.is_dataclass(getattr(cfg, f.name))}
    for prefix, section in sections(cfg):
        out |= {f"{prefix}.{f.name}": getattr(section, f.name) for f in dataclasses.fields(section)}
    return out


def nested(values: dict) -> dict:
    """{"model.path": x, "seed": 1} -> {"model": {"path": x}, "seed": 1} (flag_values as a checkpoint's config.json)."""
    out: dict = {}
    for key, value in values.items():
        *parents, name = key.split(".")
        node = out
        for p in parents:
            node = node.setdefault(p, {})
        node[name] = value
    return out


def sections(cfg) -> list[tuple[str, object]]:
    """(flag prefix, section) of every section of a recipe's Config: the learning ones ("model", cfg.model), then each
    box of cfg.system ("model", cfg.system.model: a system section keeps its flags' prefix, its flag_section)."""
    out = []
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if f.name == "system":
            out += [(getattr(value, g.name).flag_section, getattr(value, g.name)) for g in dataclasses.fields(value)]
        elif dataclasses.is_dataclass(value):
            out.append((f.name, value))
    return out


def owner(cfg, name: str) -> tuple[object, str]:
    """(the section that holds the option `name`, its field): owner(cfg, "trainer.backend") is (cfg.system.scale_out,
    "backend"); a top-level option's owner is cfg itself. Dashes or underscores; a KeyError for an option cfg lacks."""
    prefix, _, key = name.replace("-", "_").rpartition(".")
    for p, section in [("", cfg), *sections(cfg)]:
        if p == prefix and key in {f.name for f in dataclasses.fields(section)}:
            return section, key
    raise KeyError(f"{type(cfg).__name__} has no option --{name.replace('_', '-')}")


def set_flags(cfg, values: dict):
    """Set options of a recipe's Config by their flag names, wherever their sections sit, as the command line would:
    set_flags(cfg, {"trainer.seed": 3, "trainer.backend": "ray"}) sets cfg.trainer.seed and cfg.system.scale_out.backend
    (dashes or underscores). An option the Config lacks is a KeyError naming it (owner). Returns cfg."""
    for name, value in values.items():
        setattr(*owner(cfg, name), value)
    return cfg


def check_values(cfg) -> None:
    """Every float flag of a recipe's Config (its sections' too, and floats in tuple flags) must be finite: a NaN or
    inf (tyro reads "nan", "inf") would surface steps later as a non-finite loss ("lower --actor.lr"). And every
    Literal flag holds one of its choices (a Config built in Python, e.g. `cfg.turn_credit = "nope"`, skips tyro's check)."""
    import math

    for prefix, owner in [("", cfg), *sections(cfg)]:
        hints = typing.get_type_hints(type(owner))
        for f in dataclasses.fields(owner):
            value = getattr(owner, f.name)
            if dataclasses.is_dataclass(value):
                continue
            flag = "--" + (f"{prefix}.{f.name}" if prefix else f.name).replace("_", "-")
            choices = typing.get_args(hints[f.name]) if typing.get_origin(hints[f.name]) is Literal else None
            if any(isinstance(v, float) and not math.isfinite(v) for v in (value if isinstance(value, (tuple, list)) else [value])):
                raise ConfigError(f"{flag} {value}: must be a finite number")
            if choices and value not in choices:  # tyro refuses these on the command line; a Config built in Python is not parsed
                raise ConfigError(f"{flag} {value!r}: choose one of {', '.join(map(str, choices))}")


def check_flags(cfg) -> None:
    """Refuse flag values that cannot train, each with one line naming the flag and the fix (cfg: any recipe's Config):
    every float finite, then each section's own `check`, then the checks that read two sections."""
    check_values(cfg)
    for _, section in sections(cfg):
        if hasattr(section, "check"):
            section.check()
    b, m = cfg.data.train_batch_size, cfg.actor.ppo_mini_batch_size if isinstance(cfg.actor, UpdateConfig) else None
    if m is None:  # one optimizer step per batch (recipes/rm.py's OptimConfig)
        if b <= 0:
            raise ConfigError(f"--data.train-batch-size {b}: must be at least 1")
    elif b <= 0 or m <= 0 or b % m:
        raise ConfigError(f"--data.train-batch-size {b} must be a positive multiple of --actor.ppo-mini-batch-size {m}")
    check_router_replay(cfg)


def check_router_replay(cfg) -> None:
    """--actor.router-replay r3 records the routing in the rollout's own forwards: only the HF decode paths record it
    (the fast loop, generate), and only when every row's forward calls line up with its columns. (Whether the model has
    experts at all, and the engines, are the preflight's: they read the model's config.json.)"""
    s = cfg.system
    if getattr(s.actor, "router_replay", "none") != "r3":
        return
    r, a = s.rollout, s.async_rollout
    why = (
        "--rollout.name vllm (vLLM 0.32 can return routed experts, enable_return_routed_experts, but rlkit does not read "
        "them yet)" if r.name != "hf"
        else f"--rollout.drop-finished {r.drop_finished} (finished rows leave the decode batch: the steps' routing no longer "
        "lines up with the rows)" if r.drop_finished
        else "--trainer.swap-mode reprefill (the re-prefill routes the prompt again under new weights)"
        if a.swap_every and a.swap_mode == "reprefill"
        else f"--trainer.async-steps {a.async_steps} (the async generation worker does not record routing yet)"
        if a.async_steps
        else "the multi-turn turn loop (grpo_tools.py: tool tokens are not sampled)" if getattr(cfg, "agent", None) is not None
        else None
    )  # fmt: skip
    if why:
        raise ConfigError(
            f"--actor.router-replay r3 records routing at rollout, which cannot be done with {why}; use --actor.router-replay r2"
        )


def rows_per_mini_batch(actor, rollout, prompts: int | None = None) -> int:
    """Trajectories per optimizer step: `prompts` (default --actor.ppo-mini-batch-size; a critic's own) x --rollout.n
    samples each, as in verl. The one place this product is computed."""
    return (prompts or actor.ppo_mini_batch_size) * rollout.n
