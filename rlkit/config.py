"""Typed configuration shared by every recipe. `tyro` turns these dataclasses into the CLI.

Each field's docstring is its `--help` text. Names follow verl's where verl has the same knob
(`train_batch_size`, `ppo_mini_batch_size`, `clip_ratio`, `kl_loss_coef`, ...), flattened:
verl's `actor_rollout_ref.actor.clip_ratio` is `--actor.clip-ratio` here. A recipe adds its own
algorithm fields next to these in its own `Config`.

Sections by use: a recipe's Config takes only the fields its code reads, so every option its --help shows
does something (tests/test_options_read.py). The sections are layered, each class the one before plus what a
larger recipe reads, under the same flag names:

    BaseModelConfig  < ModelConfig     + the policy engine's kernels and packed passes
    BaseDataConfig   < DataConfig      + RL prompt rows: truncation, the difficulty sampler, generated tasks
    OptimConfig      < UpdateConfig    + the engine's update loop (mini-batches, epochs, non-finite steps)
                     < ActorConfig     + the policy loss (clip, entropy, KL, the off-policy correction)
    RunConfig        < TrainerConfig   + sampled validation, Ray/FSDP/Megatron, the asynchronous rollout

recipes/rm.py takes the first column, recipes/sft.py UpdateConfig, the RL recipes the last. An option read only
when another one opens its path (--data.task-seed without --data.task) is refused alone with one line. Each
section checks its own values in `check` (next to its fields); `check_flags` runs them all, and the checks that
read two sections, before any model loads.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Annotated, Literal

import tyro

from rlkit import demos
from rlkit.errors import ConfigError


def shown_default(value) -> str | None:
    """How --help shows a default that lies inside the install (an absolute path, or a list of them): relative to it,
    e.g. rlkit/assets/tiny-calc. None for any other value (tyro shows it as it is). cli_view applies it to each recipe's
    own defaults, so grpo_tools.py shows tiny-calc and rm.py its pairs, not the shared sections' tiny-arith."""
    root = str(demos.ASSETS.parents[1]) + os.sep
    values = value if isinstance(value, list) else [value]
    if values and all(isinstance(v, str) and v.startswith(root) for v in values):
        return " ".join(v[len(root) :] for v in values)
    return None


@dataclass
class BaseModelConfig:
    """The model every recipe loads: where, its dtype, LoRA, activation checkpointing (recipes/rm.py: only this)."""

    path: str = str(demos.ARITH_MODEL)
    """model to train: a local Hugging Face folder or a hub id"""
    trust_remote_code: bool = False
    """allow code shipped with the model to run (needed by some hub models; off unless asked)"""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """compute dtype: auto = float32 on CPU, bfloat16 on GPU; 16-bit full training keeps float32 master weights (docs/gpu.md)"""
    lora_rank: int = 0
    """LoRA rank; 0 trains all parameters (and keeps a frozen copy as the reference policy)"""
    lora_alpha: int = 16
    """LoRA scaling alpha"""
    target_modules: str = "all-linear"
    """LoRA target modules: 'all-linear' or a comma-separated list such as 'q_proj,v_proj'"""
    gradient_checkpointing: Literal["auto", "on", "off"] = "auto"
    """recompute activations in the backward: less memory, ~30 % slower update (auto: on for 10M+ parameters on a GPU)"""


@dataclass
class ModelConfig(BaseModelConfig):
    """+ the policy engine's attention kernel and packed passes (rlkit/engine.py), vision towers."""

    attn_implementation: Literal["auto", "sdpa", "flash_attention_2", "eager"] = "auto"
    """attention kernel: auto = flash_attention_2 on CUDA when flash-attn imports with its kernel, else sdpa"""
    remove_padding: bool = True
    """passes on real tokens only, sequences packed into rows (rlkit/packing.py; varlen with flash_attention_2)"""
    share_prompt: bool = True
    """with remove_padding: a group's shared prompt computed once in those passes (sdpa and eager, not varlen)"""
    freeze_vision_tower: bool = True
    """vision-language models: train the language model only (LoRA: adapters on it only); false trains the vision tower too"""
    shared_prompt_attention: Literal["auto", "mask", "split"] = "auto"
    """with share_prompt and sdpa: mask = one dense block-mask sdpa call per row ((P + nR)^2 pairs); split = one sdpa
    call per sequence, only the pairs the mask allows (rlkit/packing.py); auto = split where it saves enough attention
    work per extra call (packing.split_pays: long responses), not with gradient checkpointing"""


@dataclass
class BaseDataConfig:
    """Files, lengths and batch sizes every recipe reads (recipes/rm.py: only this)."""

    train_files: list[str] = field(default_factory=lambda: [str(demos.ARITH_DATA / "train.parquet")])
    """verl-format parquet file(s) for training (columns data_source, prompt, ability, reward_model, extra_info)"""
    val_files: list[str] = field(default_factory=lambda: [str(demos.ARITH_DATA / "val.parquet")])
    """verl-format parquet file(s) for validation; empty to skip validation"""
    prompt_key: str = "prompt"
    """column that holds the chat messages"""
    max_prompt_length: int = 512
    """prompt token budget; longer prompts are handled by `truncation`"""
    max_response_length: int = 8
    """maximum number of generated tokens per response"""
    train_batch_size: int = 32
    """prompts per training step (each sampled rollout.n times)"""
    val_batch_size: int = 512
    """prompts per generation batch during validation"""
    val_max_samples: int = 512
    """use at most this many validation prompts (-1 = all)"""
    shuffle: bool = True
    """shuffle the training prompts every epoch (seeded by trainer.seed)"""

    def check(self) -> None:
        for flag, value in {
            "--data.max-prompt-length": self.max_prompt_length,
            "--data.max-response-length": self.max_response_length,
            "--data.val-batch-size": self.val_batch_size,
        }.items():
            if value <= 0:
                raise ConfigError(f"{flag} {value}: must be at least 1")


@dataclass
class DataConfig(BaseDataConfig):
    """+ the RL prompt rows: truncation, the difficulty sampler, generated tasks (rlkit/data.py, rlkit/tasks.py)."""

    truncation: Literal["error", "left", "right", "middle"] = "error"
    """what to do with a prompt over max_prompt_length: error (names the row), or keep the end (left), the start (right), both ends (middle)"""
    filter_overlong_prompts: bool = False
    """drop prompts over max_prompt_length when loading, instead of applying `truncation`"""
    sampler: Literal["uniform", "difficulty"] = "uniform"
    """how the RL recipes draw training prompts: uniform (epoch by epoch), or difficulty (weighted by each prompt's last pass rate: hard/normal/easy pools, data.DifficultySampler)"""
    sampler_weights: tuple[float, float, float] = (0.2, 1.0, 0.2)
    """with --data.sampler difficulty: the weights of the hard (pass rate < 0.25), normal and easy (> 0.75) pools; unseen prompts count as normal"""
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
        super().check()
        default = DataConfig()
        if self.task is None:  # the generated task's options are read only with one
            for name in ("task_options", "task_train_size", "task_val_size", "task_seed", "task_format"):
                if getattr(self, name) != getattr(default, name):
                    flag = "--data." + name.replace("_", "-")
                    raise ConfigError(f"{flag} applies to a generated task only: add --data.task NAME, or drop it")
        if self.sampler != "difficulty" and tuple(self.sampler_weights) != default.sampler_weights:
            raise ConfigError("--data.sampler-weights applies to --data.sampler difficulty only: add it, or drop the weights")


@dataclass
class RolloutConfig:
    name: Literal["hf", "vllm"] = "hf"
    """generation backend: hf (generate on the training model) or vllm (an engine beside it, synced each update; docs/vllm.md)"""
    n: int = 8
    """responses sampled per prompt (the group size of GRPO)"""
    temperature: float = 1.0
    """sampling temperature (log-probs are computed at the same temperature)"""
    top_p: float = 1.0
    """nucleus sampling threshold"""
    top_k: int = 0
    """top-k sampling (0 = off)"""
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
        if not self.temperature > 0:  # NaN too
            raise ConfigError(
                f"--rollout.temperature {self.temperature}: training samples responses, which needs a temperature > 0 (1.0 is "
                "usual); greedy decoding (0) is only for --rollout.val-temperature"
            )
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


def check_lr(flag: str, value: float) -> None:
    if not 0 < value < 1:
        raise ConfigError(f"{flag} {value}: a learning rate must be > 0 and well below 1 (typical: 1e-6 to 1e-4 for an LM, 1e-3 for LoRA)")


@dataclass
class OptimConfig:
    """The optimiser and its micro-batches: AdamW, warm-up, clipping (recipes/rm.py: only this)."""

    lr: float = 1e-6
    """AdamW learning rate (recipes set their own for the embedded tiny models; a real model: ~1e-5 with LoRA, 1e-6 full)"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    warmup_steps: int = 0
    """linear learning-rate warm-up, in optimizer steps"""
    grad_clip: float = 1.0
    """clip the global gradient norm to this value"""
    ppo_micro_batch_size: int = 0
    """trajectories per forward/backward pass, memory only (0 = auto: 256 under 10M parameters, else 8; recipes/rm.py
    counts pairs, auto 64 on CPU and 4 on a GPU)"""

    def check(self) -> None:
        check_lr("--actor.lr", self.lr)
        if self.ppo_micro_batch_size < 0:
            raise ConfigError(f"--actor.ppo-micro-batch-size {self.ppo_micro_batch_size}: must be 0 (auto) or a positive number")


@dataclass
class UpdateConfig(OptimConfig):
    """+ the engine's update loop: mini-batches, epochs, token budget, non-finite steps (recipes/sft.py: only this)."""

    ppo_mini_batch_size: int = 32
    """prompts per optimizer step; × rollout.n trajectories (as in verl). train_batch_size / this = optimizer steps per epoch"""
    max_token_len_per_micro_batch: int = 0
    """token budget of a forward pass instead of a row count (verl's ppo_max_token_len_per_gpu; 0 = off)"""
    ppo_epochs: int = 1
    """passes over the rollout batch per training step"""
    shuffle: bool = False
    """shuffle trajectories before splitting into mini-batches"""
    nan_policy: Literal["error", "skip"] = "error"
    """on a non-finite loss or gradient: stop with an error, or skip that optimizer step"""
    max_skipped_steps: int = 3
    """with --actor.nan-policy skip: stop after this many consecutive skipped optimizer steps (0 = never)"""

    def check(self) -> None:
        super().check()
        if self.ppo_epochs <= 0:
            raise ConfigError(f"--actor.ppo-epochs {self.ppo_epochs}: must be at least 1")
        if self.max_skipped_steps < 0:
            raise ConfigError(f"--actor.max-skipped-steps {self.max_skipped_steps}: must be 0 (never stop) or a positive number")
        if self.nan_policy != "skip" and self.max_skipped_steps != 3:
            raise ConfigError("--actor.max-skipped-steps applies to --actor.nan-policy skip only: add it, or drop the limit")


@dataclass
class ActorConfig(UpdateConfig):
    """+ the policy loss: PPO clip, entropy bonus, KL to the reference, the off-policy correction."""

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


@dataclass
class CriticConfig:
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
    ppo_micro_batch_size: int = 0
    """trajectories per forward/backward pass of the value model, memory only (0 = auto, as the actor's)"""
    max_token_len_per_micro_batch: int = 0
    """token budget of a value-model forward pass, as --actor.max-token-len-per-micro-batch; 0 = off"""
    ppo_epochs: int = 1
    """passes over the rollout batch per training step"""
    cliprange_value: float | None = 0.5
    """the value loss does not reward moving V further than this from the old value (None disables)"""
    loss_agg_mode: Literal["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = "token-mean"
    """how per-token value losses are averaged into one number"""
    nan_policy: Literal["error", "skip"] = "error"
    """on a non-finite loss or gradient: stop with an error, or skip that optimizer step"""
    max_skipped_steps: int = 3
    """with --critic.nan-policy skip: stop after this many consecutive skipped optimizer steps (0 = never)"""

    def check(self) -> None:
        check_lr("--critic.lr", self.lr)
        if self.ppo_epochs <= 0:
            raise ConfigError(f"--critic.ppo-epochs {self.ppo_epochs}: must be at least 1")
        if self.ppo_micro_batch_size < 0:
            raise ConfigError(f"--critic.ppo-micro-batch-size {self.ppo_micro_batch_size}: must be 0 (auto) or a positive number")


@dataclass
class RewardConfig:
    custom_fn: str | None = None
    """your scoring function as path/to/file.py:function_name, verl signature compute_score(data_source, solution_str, ground_truth, extra_info=None)"""
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
    model_path: str | None = None
    """a reward model (AutoModelForSequenceClassification, 1 output) scoring prompt + response with its own tokenizer and chat template"""
    combine: Literal["replace", "add"] = "replace"
    """with --reward.model-path: the model's score is the reward (replace) or is added to the function's (add)"""
    model_micro_batch_size: int = 32
    """sequences per forward pass of the reward model"""

    def check(self) -> None:
        if self.model_micro_batch_size < 0:
            raise ConfigError(f"--reward.model-micro-batch-size {self.model_micro_batch_size}: must be 0 (auto) or a positive number")


@dataclass
class RunConfig:
    """The run's schedule, logging, checkpoints, seed and device (recipes/rm.py: only this)."""

    total_epochs: int = 1
    """passes over the training prompts"""
    total_training_steps: int | None = None
    """stop after this many steps (overrides total_epochs when set)"""
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
    seed: int = 1
    """seed for data order, sampling and initialisation"""
    device: str = "auto"
    """cpu, cuda, cuda:1, ... (auto = cuda when available)"""
    num_threads: int = 0
    """torch CPU threads (0 = 1 thread on a machine with ≤ 4 cores, else torch's default)"""


@dataclass
class TrainerConfig(RunConfig):
    """+ sampled validation, the Ray/FSDP/Megatron scale-out and the asynchronous rollout (the recipes on rlkit.placement)."""

    val_n: int = 1
    """samples per validation prompt: 1 = one at --rollout.val-temperature; n > 1 also logs val/mean@n, val/pass@k, val/maj@k (docs/eval.md)"""
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
        if self.val_n <= 0:
            raise ConfigError(f"--trainer.val-n {self.val_n}: must be at least 1")
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


# --help by audience. The rule: a learning option changes what the model learns (which model and data, batch sizes,
# sampling, the loss and optimiser, the reward, the schedule and seed); every other option says how and where a run
# executes or what it writes: output and checkpoints, validation plumbing, how rows are read or generated, the
# off-policy correction, what a failing step does, performance knobs, scale-out, vLLM, async, the sandbox. --help
# lists those after every learning option, in system.<group> boxes (grpo.py: <= 40 learning options first,
# tests/test_cli.py). Their flags (--trainer.backend, --rollout.name, ...) and their place in the config
# (cfg.trainer.backend, cfg.rollout.name) do not change: only the help is regrouped, by cli_view.
# group -> {section: fields}; a section a recipe lacks (critic), or a field its section lacks (rm.py), is skipped.
SYSTEM_OPTIONS = {
    "run": {  # where the run writes, what it logs, its checkpoints
        "trainer": ("save_freq", "max_ckpt_to_keep", "resume", "default_local_dir", "project_name", "experiment_name", "logger"),
    },
    "validation": {
        "trainer": ("test_freq", "val_before_train", "val_n"),
        "data": ("val_files", "val_batch_size", "val_max_samples"),
        "rollout": ("val_temperature",),
    },
    "data_loading": {  # how the rows are read, cut, or generated
        "data": (
            "prompt_key",
            "truncation",
            "filter_overlong_prompts",
            "task",
            "task_options",
            "task_train_size",
            "task_val_size",
            "task_seed",
            "task_format",
        ),
        "model": ("freeze_vision_tower",),
    },
    "off_policy": {  # the correction for a sampler that is not the trainer (vllm, async): docs/off-policy.md
        "actor": ("rollout_correction", "rollout_is_cap", "rollout_is_low", "router_replay"),
        "rollout": ("log_probs",),
    },
    "reliability": {  # what a non-finite step or a failing scorer does
        "actor": ("nan_policy", "max_skipped_steps"),
        "critic": ("nan_policy", "max_skipped_steps"),
        "reward": ("on_error", "timeout_s"),
    },
    "performance": {
        "trainer": ("device", "num_threads"),
        "model": ("dtype", "attn_implementation", "gradient_checkpointing", "remove_padding", "share_prompt", "shared_prompt_attention"),
        "rollout": ("hf_impl", "micro_batch_size", "log_prob_micro_batch_size", "drop_finished"),
        "actor": ("ppo_micro_batch_size", "max_token_len_per_micro_batch"),
        "critic": ("ppo_micro_batch_size", "max_token_len_per_micro_batch"),
        "reward": ("model_micro_batch_size",),
    },
    "scale_out": {
        "trainer": (
            "backend",
            "n_workers",
            "cpus_per_worker",
            "critic_workers",
            "reward_workers",
            "engine",
            "tp_size",
            "fsdp_param_dtype",
            "fsdp_offload",
            "sp_size",
            "ray_address",
        )
    },
    "vllm": {"rollout": ("name", "gpu_memory_utilization", "kv_cache_gb", "enforce_eager", "max_num_seqs", "lora_adapter_sync")},
    "async_rollout": {
        "trainer": ("async_steps", "async_workers", "async_timeout_s", "swap_every", "swap_mode", "max_staleness", "queue_groups")
    },
    "sandbox": {
        "reward": ("sandbox", "sandbox_level", "sandbox_workers", "sandbox_fresh", "sandbox_memory_mb"),
        "agent": ("sandbox_level",),
    },
}


def field_docs(cls) -> dict[str, str]:
    """{field: the docstring under it} of a dataclass (its --help text), from its source."""
    import ast
    import inspect
    import textwrap

    out = {}
    for klass in reversed(cls.__mro__[:-1]):  # a subclass's docstring wins
        try:
            body = ast.parse(textwrap.dedent(inspect.getsource(klass))).body[0].body
        except (OSError, TypeError):  # made at run time: no source
            continue
        for stmt, nxt in zip(body, body[1:]):
            if isinstance(stmt, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
                out[stmt.target.id] = " ".join(str(nxt.value.value).split())
    return out


def cli_view(config_cls):
    """What tyro parses for a recipe's Config: the same flags, with SYSTEM_OPTIONS shown apart (see there).

    Returns (view_cls, to_config): view_cls is config_cls with those fields hidden in their sections and offered
    again, under their own flag names, in a `system` section of one box per group; to_config(parsed view) is the
    config_cls instance the recipe gets (each section its own class again, the system values back in place).
    """
    import copy
    import dataclasses
    import typing

    default = config_cls()
    moved: dict[str, dict[str, str]] = {}  # section -> {field: group}
    for group, sections in SYSTEM_OPTIONS.items():
        for section, names in sections.items():
            value = getattr(default, section, None)
            if dataclasses.is_dataclass(value):  # only the fields this recipe's section has (rm.py's RunConfig: no backend)
                have = {f.name for f in dataclasses.fields(value)}
                moved.setdefault(section, {}).update(dict.fromkeys([n for n in names if n in have], group))
    shown: dict[str, dict[str, str]] = {}  # section -> {field: its default as --help shows it} (shown_default)
    for f in dataclasses.fields(default):
        value = getattr(default, f.name)
        if dataclasses.is_dataclass(value):
            texts = {g.name: shown_default(getattr(value, g.name)) for g in dataclasses.fields(value)}
            if any(texts.values()):
                shown[f.name] = {n: t for n, t in texts.items() if t}
                moved.setdefault(f.name, {})

    if not moved:  # a config without the shared sections: as it is
        return config_cls, lambda cfg: cfg

    def keep(value):  # a default: a fresh copy of the recipe's own default value
        return dataclasses.field(default_factory=lambda: copy.deepcopy(value))

    sections, groups = [], {group: [] for group in SYSTEM_OPTIONS}
    for section, names in moved.items():
        value = getattr(default, section)
        hints, docs = typing.get_type_hints(type(value), include_extras=True), field_docs(type(value))
        hidden = [(n, Annotated[hints[n], tyro.conf.Suppress], keep(getattr(value, n))) for n in names]
        hint = {n: tyro.conf.arg(help_behavior_hint=f"(default: {t})") for n, t in shown.get(section, {}).items()}
        hidden += [(n, Annotated[hints[n], h], keep(getattr(value, n))) for n, h in hint.items() if n not in names]
        view = dataclasses.make_dataclass(type(value).__name__, hidden, bases=(type(value),))
        state = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
        sections.append((section, view, dataclasses.field(default_factory=lambda v=view, s=state: v(**copy.deepcopy(s)))))
        for n, group in names.items():
            text = shown.get(section, {}).get(n)
            flag = tyro.conf.arg(
                name=f"{section}.{n}", prefix_name=False, help=docs.get(n), help_behavior_hint=text and f"(default: {text})"
            )
            groups[group].append((f"{section}__{n}", Annotated[hints[n], flag], keep(getattr(value, n))))
    boxes = [(g, dataclasses.make_dataclass(f"System_{g}", f)) for g, f in groups.items() if f]
    system = dataclasses.make_dataclass("System", [(g, cls, dataclasses.field(default_factory=cls)) for g, cls in boxes])
    view_cls = dataclasses.make_dataclass(
        config_cls.__name__, [*sections, ("system", system, dataclasses.field(default_factory=system))], bases=(config_cls,)
    )
    view_cls.__module__ = config_cls.__module__  # (recipe.run_name names a run after the recipe's module)

    def to_config(view) -> config_cls:
        values = {f.name: getattr(view, f.name) for f in dataclasses.fields(config_cls)}
        for section, names in moved.items():
            cls = type(getattr(default, section))
            state = {f.name: getattr(values[section], f.name) for f in dataclasses.fields(cls)}
            state.update({n: getattr(getattr(view.system, g), f"{section}__{n}") for n, g in names.items()})
            values[section] = cls(**state)
        return config_cls(**values)

    return view_cls, to_config


def check_values(cfg, prefix: str = "--") -> None:
    """Every float flag of a recipe's Config (its sections' too, and floats in tuple flags) must be finite: a NaN or
    inf (tyro reads "nan", "inf") would surface steps later as a non-finite loss ("lower --actor.lr"). And every
    Literal flag holds one of its choices (a Config built in Python, e.g. `cfg.turn_credit = "nope"`, skips tyro's check)."""
    import dataclasses
    import math
    import typing

    from rlkit.errors import ConfigError

    hints = typing.get_type_hints(type(cfg))
    for f in dataclasses.fields(cfg):
        value, flag = getattr(cfg, f.name), prefix + f.name.replace("_", "-")
        choices = typing.get_args(hints[f.name]) if typing.get_origin(hints[f.name]) is Literal else None
        if dataclasses.is_dataclass(value):
            check_values(value, flag + ".")
        elif any(isinstance(v, float) and not math.isfinite(v) for v in (value if isinstance(value, (tuple, list)) else [value])):
            raise ConfigError(f"{flag} {value}: must be a finite number")
        elif choices and value not in choices:  # tyro refuses these on the command line; a Config built in Python is not parsed
            raise ConfigError(f"{flag} {value!r}: choose one of {', '.join(map(str, choices))}")


def check_flags(cfg) -> None:
    """Refuse flag values that cannot train, each with one line naming the flag and the fix (cfg: any recipe's Config):
    every float finite, then each section's own `check`, then the checks that read two sections."""
    import dataclasses

    check_values(cfg)
    for f in dataclasses.fields(cfg):
        section = getattr(cfg, f.name)
        if dataclasses.is_dataclass(section) and hasattr(section, "check"):
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
    mode = getattr(cfg.actor, "router_replay", "none")
    if mode != "r3":
        return
    r, t = cfg.rollout, cfg.trainer
    why = (
        "--rollout.name vllm (vLLM 0.32 can return routed experts, enable_return_routed_experts, but rlkit does not read "
        "them yet)" if r.name != "hf"
        else f"--rollout.drop-finished {r.drop_finished} (finished rows leave the decode batch: the steps' routing no longer "
        "lines up with the rows)" if r.drop_finished
        else "--trainer.swap-mode reprefill (the re-prefill routes the prompt again under new weights)"
        if getattr(t, "swap_every", 0) and getattr(t, "swap_mode", "keep_kv") == "reprefill"
        else f"--trainer.async-steps {t.async_steps} (the async generation worker does not record routing yet)"
        if getattr(t, "async_steps", 0)
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
