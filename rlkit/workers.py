"""Workers: what the recipe (the single controller) calls to generate, score log-probs and update.

A recipe never touches a model directly. It calls a worker group::

    policy.generate(prompts)             -> prompts + responses (+ masks)
    policy.compute_log_prob(batch)       -> old_log_probs, entropys
    policy.compute_ref_log_prob(batch)   -> ref_log_prob
    policy.update(batch, loss_fn)        -> metrics

`ActorRolloutRefWorker` is the actor (trained), the rollout (generation) and the reference
(frozen) roles on one model. `CriticWorker` is a value model (PPO's critic)::

    critic.compute_values(batch)         -> values
    critic.update(batch, loss_fn)        -> metrics

`LocalWorkerGroup` runs one such worker in this process; a group with workers on Ray answers the
same calls, so a recipe does not change when it scales out.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from rlkit.engine import TorchEngine, auto_micro_batch, num_params
from rlkit.errors import ConfigError, MissingFile
from rlkit.models import resolve_model_path
from rlkit.protocol import DataProto
from rlkit.rollout import HFRollout


def resolved(model_cfg):
    """model_cfg with a built-in model name (e.g. smollm2-135m-instruct) replaced by its local folder."""
    path = resolve_model_path(model_cfg.path)
    return model_cfg if path == model_cfg.path else dataclasses.replace(model_cfg, path=path)


def make_rollout(engine, rollout_cfg, data_cfg, model_path: str, seed: int):
    """The generation backend named by --rollout.name: hf (generate on the training model) or vllm."""
    if rollout_cfg.name == "hf":
        return HFRollout(engine.model, engine.tokenizer, engine.device)
    if rollout_cfg.name == "vllm":
        from rlkit.vllm_rollout import VLLMRollout

        return VLLMRollout(
            engine.model,
            engine.tokenizer,
            model_path,
            engine.dtype,
            engine.device,
            rollout_cfg,
            max_model_len=data_cfg.max_prompt_length + data_cfg.max_response_length,
            seed=seed,
        )
    raise ConfigError(f"unknown --rollout.name {rollout_cfg.name!r}; available: hf, vllm")


class CheckpointFiles:
    """A worker's part of a training checkpoint, written into (and read from) a folder of its own.

    One process writes its state_dict() to folder/state.pt; the FSDP workers override both methods
    to write sharded files, each process its own shard (torch.distributed.checkpoint).
    """

    def save_checkpoint(self, folder: str | Path) -> None:
        Path(folder).mkdir(parents=True, exist_ok=True)
        torch.save(self.state_dict(), Path(folder) / "state.pt")

    def load_checkpoint(self, folder: str | Path) -> None:
        file = Path(folder) / "state.pt"
        if not file.is_file():
            raise MissingFile(f"{folder} holds no state.pt: was it saved with another --trainer.backend? Resume with the same backend")
        from rlkit.checkpoint import load_file

        self.load_state_dict(load_file(file))  # weights_only: a shared checkpoint cannot run code


class ActorRolloutRefWorker(CheckpointFiles):
    """Actor + rollout + reference on one model (one device)."""

    def __init__(
        self, model_cfg, actor_cfg, rollout_cfg, data_cfg, device: str = "auto", seed: int = 0, need_ref: bool | None = None, wrap=None
    ):
        if rollout_cfg.name not in ("hf", "vllm"):
            raise ConfigError(f"unknown --rollout.name {rollout_cfg.name!r}; available: hf, vllm")
        model_cfg = resolved(model_cfg)
        torch.manual_seed(seed)  # fresh weights (LoRA's) start the same in every process and on every backend
        self.engine = TorchEngine(model_cfg, actor_cfg, device, need_ref=need_ref, wrap=wrap)
        self.tokenizer = self.engine.tokenizer
        self.rollout = make_rollout(self.engine, rollout_cfg, data_cfg, model_cfg.path, seed)
        self.actor_cfg, self.rollout_cfg, self.data_cfg, self.seed = actor_cfg, rollout_cfg, data_cfg, seed
        self.updates = 0
        self.dp_size = 1  # processes sharing each mini-batch (FSDP workers set it)
        self.micro_batch = auto_micro_batch(actor_cfg.ppo_micro_batch_size, self.engine.model, 256, 8)
        self.log_prob_micro_batch = auto_micro_batch(rollout_cfg.log_prob_micro_batch_size, self.engine.model, 256, 16)

    def generate(self, prompts: DataProto, validate: bool = False) -> DataProto:
        """Sample one response per row (temperature rollout.temperature, or val_temperature when validating)."""
        r = self.rollout_cfg
        return self.rollout.generate(
            prompts,
            self.data_cfg.max_response_length,
            temperature=r.val_temperature if validate else r.temperature,
            top_p=r.top_p,
            top_k=r.top_k,
        )

    def is_on_policy(self) -> bool:
        """True when an update is one optimizer step (ppo_epochs 1, mini-batch = whole batch): then π_old = π
        and the old log-probs need no pass of their own (the update takes its own, detached)."""
        return self.actor_cfg.ppo_epochs == 1 and self.actor_cfg.ppo_mini_batch_size >= self.data_cfg.train_batch_size

    def compute_log_prob(self, batch: DataProto) -> DataProto:
        """Per-token log-probs of the responses under the current policy (π_old) and their entropy."""
        lp, ent = self.engine.compute_log_prob(batch, self.rollout_cfg.temperature, self.log_prob_micro_batch, with_entropy=True)
        return DataProto.from_dict(tensors={"old_log_probs": lp, "entropys": ent})

    def compute_ref_log_prob(self, batch: DataProto) -> DataProto:
        """Per-token log-probs under the reference policy (LoRA: adapter disabled; else a frozen copy)."""
        lp, _ = self.engine.compute_log_prob(batch, self.rollout_cfg.temperature, self.log_prob_micro_batch, ref=True)
        return DataProto.from_dict(tensors={"ref_log_prob": lp})

    def update(self, batch: DataProto, loss_fn) -> dict:
        """The policy update: ppo_mini_batch_size prompts × n trajectories per optimizer step."""
        a = self.actor_cfg
        metrics = self.engine.update(
            batch,
            loss_fn,
            mini_batch_size=a.ppo_mini_batch_size * self.rollout_cfg.n // self.dp_size,
            micro_batch_size=self.micro_batch,
            epochs=a.ppo_epochs,
            temperature=self.rollout_cfg.temperature,
            with_entropy=a.entropy_coeff != 0,
            shuffle_seed=(self.seed * 100003 + self.updates) if a.shuffle else None,
        )
        self.updates += 1
        synced = self.sync_rollout()
        if synced is not None:
            metrics["timing/weight_sync"] = synced
        return metrics

    def sync_rollout(self) -> float | None:
        """Give a separate inference engine (vllm) the current weights; seconds taken, None without one."""
        return self.rollout.sync_weights() if hasattr(self.rollout, "sync_weights") else None

    def num_params(self) -> tuple[int, int]:
        return num_params(self.engine.model)

    def state_dict(self) -> dict:
        return {**self.engine.state_dict(), "updates": self.updates}

    def load_state_dict(self, state: dict) -> None:
        self.engine.load_state_dict(state)
        self.updates = state["updates"]
        self.sync_rollout()  # resumed weights differ from the folder vLLM loaded

    def save_pretrained(self, path: str | Path) -> None:
        self.engine.save_pretrained(path)


class CriticWorker(CheckpointFiles):
    """A value model V(s_t) on one device: the policy's checkpoint (or critic.path) with a fresh 1-output head."""

    def __init__(self, model_cfg, critic_cfg, rollout_cfg, actor_mini_batch_size: int, device: str = "auto", seed: int = 0, wrap=None):
        model_cfg = dataclasses.replace(model_cfg, path=critic_cfg.path or model_cfg.path, lora_rank=critic_cfg.lora_rank)
        torch.manual_seed(seed)  # the fresh value head starts the same in every process and on every backend
        self.engine = TorchEngine(resolved(model_cfg), critic_cfg, device, value_head=True, wrap=wrap)
        self.critic_cfg, self.rollout_cfg = critic_cfg, rollout_cfg
        self.dp_size = 1  # processes sharing each mini-batch (FSDP workers set it)
        self.mini_batch_size = critic_cfg.ppo_mini_batch_size or actor_mini_batch_size  # prompts
        self.micro_batch = auto_micro_batch(critic_cfg.ppo_micro_batch_size, self.engine.model, 256, 8)
        self.values_micro_batch = auto_micro_batch(rollout_cfg.log_prob_micro_batch_size, self.engine.model, 256, 16)

    def compute_values(self, batch: DataProto) -> DataProto:
        """V(s_t) for every response token t (the state before it): 'values', shaped like the responses."""
        values = self.engine.compute_values(batch, self.values_micro_batch)
        return DataProto.from_dict(tensors={"values": values})

    def update(self, batch: DataProto, loss_fn) -> dict:
        """The critic update: ppo_mini_batch_size prompts × n trajectories per optimizer step; loss_fn gets values."""
        c = self.critic_cfg
        return self.engine.update(
            batch,
            loss_fn,
            mini_batch_size=self.mini_batch_size * self.rollout_cfg.n // self.dp_size,
            micro_batch_size=self.micro_batch,
            epochs=c.ppo_epochs,
        )

    def num_params(self) -> tuple[int, int]:
        return num_params(self.engine.model)

    def state_dict(self) -> dict:
        return self.engine.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.engine.load_state_dict(state)


class LocalWorkerGroup:
    """One worker in this process. Method calls go straight to it; same interface as a Ray group."""

    def __init__(self, worker):
        self.worker = worker

    def __getattr__(self, name):
        return getattr(self.worker, name)


def resource_pools(cfg) -> dict:
    """Roles -> Ray resource pools, as verl's ResourcePoolManager maps them.

    actor/rollout/reference always share the "global" pool (--trainer.n-workers bundles). PPO's critic
    is colocated on it (--trainer.critic-workers 0: each bundle holds an actor and a critic process,
    each with half of its CPUs/GPU) or gets a pool of its own (--trainer.critic-workers N); the same
    for a reward model (--reward.model-path) with --trainer.reward-workers.
    """
    from rlkit.ray_group import ResourcePool, init_ray

    t = cfg.trainer
    init_ray(t.ray_address)
    gpus = 1 if resolve_device_name(t.device) == "cuda" else 0
    pools = {"global": ResourcePool(t.n_workers, t.cpus_per_worker, gpus, name="global")}
    roles = {"actor_rollout_ref": "global"}
    for role, n in (("critic", t.critic_workers), ("reward_model", t.reward_workers)):
        if (
            role == "critic"
            and not hasattr(cfg, "critic")
            or role == "reward_model"
            and not getattr(getattr(cfg, "reward", None), "model_path", None)
        ):
            continue  # the recipe has no such role
        if n:
            pools[role] = ResourcePool(n, t.cpus_per_worker, gpus, name=role)
        roles[role] = role if n else "global"
    return {role: pools[name] for role, name in roles.items()}


def _share(pools: dict, role: str) -> float:
    """The share of each bundle a role's workers take: bundles are split evenly among the roles placed on them."""
    return 1 / sum(p is pools[role] for p in pools.values())


def _check_split(what: str, trajectories: int, n_workers: int, flag: str) -> None:
    if trajectories % n_workers:
        raise ConfigError(
            f"a {what} mini-batch of {trajectories} trajectories (mini-batch size x --rollout.n) does not split "
            f"over {flag} {n_workers}; make it a multiple"
        )


def build_policy(cfg, need_ref: bool | None = None):
    """The actor/rollout/reference worker group for a recipe config (fields model, actor, rollout, data, trainer).

    need_ref: whether the recipe asks for reference log-probs (default: cfg.actor.use_kl_loss).
    With --trainer.backend ray the group gets every role's resource pool as `.pools`, so that
    build_critic and build_reward can place their workers beside it.
    """
    t = cfg.trainer
    args = (cfg.model, cfg.actor, cfg.rollout, cfg.data)
    if t.backend == "local":
        return LocalWorkerGroup(ActorRolloutRefWorker(*args, device=t.device, seed=t.seed, need_ref=need_ref))
    if t.backend != "ray":
        raise ConfigError(f"unknown --trainer.backend {t.backend!r}: use local or ray")
    from rlkit.engine import load_tokenizer
    from rlkit.fsdp_workers import FSDPActorRolloutRefWorker
    from rlkit.ray_group import RayWorkerGroup

    _check_split("policy", cfg.actor.ppo_mini_batch_size * cfg.rollout.n, t.n_workers, "--trainer.n-workers")
    if hasattr(cfg, "critic"):
        _check_split(
            "critic",
            (cfg.critic.ppo_mini_batch_size or cfg.actor.ppo_mini_batch_size) * cfg.rollout.n,
            t.critic_workers or t.n_workers,
            "--trainer.critic-workers" if t.critic_workers else "--trainer.n-workers",
        )
    pools, made = _pools_of(cfg, None)
    group = RayWorkerGroup(
        FSDPActorRolloutRefWorker,
        pools["actor_rollout_ref"],
        *args,
        share=_share(pools, "actor_rollout_ref"),
        device=t.device,
        seed=t.seed,
        need_ref=need_ref,
        fsdp=fsdp_options(t),
    )
    group.tokenizer = load_tokenizer(resolved(cfg.model).path, cfg.model.trust_remote_code)
    group.pools = pools
    return _owning(group, pools, made)


def _pools_of(cfg, policy) -> tuple[dict, bool]:
    """The roles' pools: the policy group's (False), or new ones made for a group built on its own (True)."""
    pools = getattr(policy, "pools", None)
    return (pools, False) if pools else (resource_pools(cfg), True)


def _owning(group, pools: dict, made: bool):
    """A group built on pools made for it frees them (each once) at shutdown."""
    if made:
        group.owned_pools += list(dict.fromkeys(pools.values()))
    return group


def fsdp_options(t) -> dict:
    """The FSDP2 settings of --trainer: compute dtype and CPU offload."""
    return {"param_dtype": t.fsdp_param_dtype, "offload": t.fsdp_offload}


def resolve_device_name(device: str) -> str:
    """'auto' -> 'cuda' when this machine has a GPU, else 'cpu'; 'cuda:1' -> 'cuda'."""
    from rlkit.engine import resolve_device

    return resolve_device(device).type


def build_critic(cfg, policy=None):
    """The critic worker group for a recipe config (fields model, critic, actor, rollout, trainer).

    With --trainer.backend ray, pass the policy group: the critic goes on its pool (colocated) or on its own.
    """
    t = cfg.trainer
    args = (cfg.model, cfg.critic, cfg.rollout, cfg.actor.ppo_mini_batch_size)
    if t.backend == "local":
        return LocalWorkerGroup(CriticWorker(*args, device=t.device, seed=t.seed))
    from rlkit.fsdp_workers import FSDPCriticWorker
    from rlkit.ray_group import RayWorkerGroup

    pools, made = _pools_of(cfg, policy)
    group = RayWorkerGroup(
        FSDPCriticWorker, pools["critic"], *args, share=_share(pools, "critic"), device=t.device, seed=t.seed, fsdp=fsdp_options(t)
    )
    return _owning(group, pools, made)


def build_reward(cfg, policy=None):
    """The reward of a recipe config: the scoring function, plus with --reward.model-path a reward model,
    loaded in this process or, with --trainer.backend ray, as replicas on Ray workers (pass the policy
    group: they go on its pool, or on their own with --trainer.reward-workers N)."""
    from rlkit.rewards import RewardFn

    t, r = cfg.trainer, cfg.reward
    if t.backend == "local" or not r.model_path:
        return RewardFn.from_config(r, t.device)
    from rlkit.ray_group import RayWorkerGroup
    from rlkit.reward_model import RayRewardModel, RewardModelWorker

    pools, made = _pools_of(cfg, policy)
    group = RayWorkerGroup(
        RewardModelWorker,
        pools["reward_model"],
        r.model_path,
        t.device,
        r.model_micro_batch_size,
        cfg.model.trust_remote_code,
        share=_share(pools, "reward_model"),
    )
    return RewardFn.from_config(r, t.device, model=RayRewardModel(_owning(group, pools, made)))
