"""Which worker group each role of a recipe gets, and where its workers run.

A recipe asks for its roles here::

    policy = build_policy(cfg)                 # actor + rollout + reference
    critic = build_critic(cfg, policy)         # PPO's value model
    reward_fn = build_reward(cfg, policy)      # the scoring function (+ a reward model)

With --trainer.backend local each is one worker in this process (rlkit/workers.py). With ray each is a
RayWorkerGroup of FSDP2 workers (rlkit/fsdp_workers.py) placed on Ray resource pools, as verl's
ResourcePoolManager places them: this module sits above both worker modules, which never import it.
Every group has close(); recipe.Run.finish closes the ones it was given.
"""

from __future__ import annotations

import dataclasses

from rlkit.config import rows_per_mini_batch
from rlkit.errors import ConfigError, MissingFile
from rlkit.workers import ActorRolloutRefWorker, CriticWorker, LocalWorkerGroup, resolved


def resource_pools(t, device: str, critic: bool = False, reward_model: bool = False, teacher: bool = False) -> dict:
    """Roles -> Ray resource pools, for the scale-out section `t` (cfg.system.scale_out), --trainer.device and the roles
    the recipe has besides the policy.

    actor/rollout/reference always share the "global" pool (--trainer.n-workers bundles). PPO's critic
    is colocated on it (--trainer.critic-workers 0: each bundle holds an actor and a critic process,
    each with half of its CPUs/GPU) or gets a pool of its own (--trainer.critic-workers N); the same
    for a reward model (--reward.model-path) with --trainer.reward-workers. On-policy distillation's teacher
    (recipes/opd.py --teacher) is always colocated: one replica per bundle, beside the policy's worker.
    """
    from rlkit.ray_group import ResourcePool, cluster_gpus, gpus_per_worker, init_ray

    init_ray(t.ray_address)
    gpus = gpus_per_worker(device, cluster_gpus())  # from the cluster's resources, not the driver's CUDA
    pools = {"global": ResourcePool(t.n_workers, t.cpus_per_worker, gpus, name="global")}
    roles = {"actor_rollout_ref": "global"}
    for role, wanted, n in (("critic", critic, t.critic_workers), ("reward_model", reward_model, t.reward_workers)):
        if not wanted:
            continue
        if n:
            pools[role] = ResourcePool(n, t.cpus_per_worker, gpus, name=role)
        roles[role] = role if n else "global"
    if teacher:
        roles["teacher"] = "global"
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


def build_policy(cfg, need_ref: bool | None = None, critic=None):
    """The actor/rollout/reference worker group for a recipe config (sections model, actor, rollout, data, reward, trainer).

    need_ref: whether the recipe asks for reference log-probs (default: cfg.actor.use_kl_loss).
    critic: the recipe's CriticConfig when it trains a critic (PPO), so that with --trainer.backend ray
    its pool is planned beside the policy's. With ray the group gets every role's resource pool as
    `.pools`, so that build_critic and build_reward can place their workers beside it.
    """
    s, t = cfg.system, cfg.system.scale_out
    device, seed = s.trainer.device, cfg.trainer.seed
    async_steps = s.async_rollout.async_steps
    if async_steps and s.rollout.name != "hf":  # the async generation worker owns the vLLM engine; HF here validates
        s = dataclasses.replace(s, rollout=dataclasses.replace(s.rollout, name="hf"))
    if async_steps:  # the generation workers compute ref_log_prob (rlkit/async_rollout.py): a frozen copy here would go unused
        need_ref = False
    args = (cfg.model, cfg.actor, cfg.rollout, cfg.data)
    if t.backend == "local" and t.engine != "fsdp":
        raise ConfigError(f"--trainer.engine {t.engine} runs on Ray workers: add --trainer.backend ray --trainer.n-workers N")
    if t.backend == "local":
        return LocalWorkerGroup(ActorRolloutRefWorker(*args, device=device, seed=seed, need_ref=need_ref, system=s))
    if t.backend != "ray":
        raise ConfigError(f"unknown --trainer.backend {t.backend!r}: use local or ray")
    from rlkit.engine import load_tokenizer
    from rlkit.fsdp_workers import FSDPActorRolloutRefWorker
    from rlkit.ray_group import RayWorkerGroup

    _check_split("policy", rows_per_mini_batch(cfg.actor, cfg.rollout), t.n_workers, "--trainer.n-workers")
    if critic is not None:
        _check_split(
            "critic",
            rows_per_mini_batch(cfg.actor, cfg.rollout, critic.ppo_mini_batch_size),
            t.critic_workers or t.n_workers,
            "--trainer.critic-workers" if t.critic_workers else "--trainer.n-workers",
        )
    teacher = bool(getattr(cfg, "teacher", ""))  # recipes/opd.py: its teacher's replicas share the bundles
    pools = resource_pools(t, device, critic=critic is not None, reward_model=bool(cfg.reward.model_path), teacher=teacher)
    if t.engine == "megatron":  # Megatron-core tensor parallelism (rlkit/megatron_workers.py)
        from rlkit.megatron_workers import MegatronActorRolloutRefWorker, require_megatron

        require_megatron()
        if t.tp_size > 1 and cfg.actor.loss_agg_mode == "token-sum":  # its sum would be counted once per tensor-parallel rank
            raise ConfigError("--actor.loss-agg-mode token-sum is not supported with --trainer.engine megatron --trainer.tp-size > 1 yet")
        worker, options = MegatronActorRolloutRefWorker, {"tp_size": t.tp_size}
    elif t.engine == "fsdp":
        worker, options = FSDPActorRolloutRefWorker, {"fsdp": fsdp_options(t)}
    else:
        raise ConfigError(f"unknown --trainer.engine {t.engine!r}: use fsdp or megatron")
    group = RayWorkerGroup(
        worker,
        pools["actor_rollout_ref"],
        *args,
        share=_share(pools, "actor_rollout_ref"),
        device=device,
        seed=seed,
        need_ref=need_ref,
        system=s,
        **options,
    )
    group.tokenizer = load_tokenizer(resolved(cfg.model).path, cfg.model.trust_remote_code)
    group.pools = pools
    return _owning(group, pools, True)


def _pools_of(policy, role: str, t, device: str) -> tuple[dict, bool]:
    """The roles' pools: the policy group's (False), or new ones made for `role`'s group built on its own (True)."""
    pools = getattr(policy, "pools", None)
    if pools and role in pools:
        return pools, False
    if pools:
        raise ConfigError(f"the policy group was built without a {role} pool: pass the recipe's config section to build_policy")
    return resource_pools(t, device, critic=role == "critic", reward_model=role == "reward_model", teacher=role == "teacher"), True


def _owning(group, pools: dict, made: bool):
    """A group built on pools made for it frees them (each once) when it is closed."""
    if made:
        group.owned_pools += list(dict.fromkeys(pools.values()))
    return group


def fsdp_options(t) -> dict:
    """The FSDP2 settings of --trainer: compute dtype, CPU offload and the sequence-parallel size."""
    return {"param_dtype": t.fsdp_param_dtype, "offload": t.fsdp_offload, "sp_size": t.sp_size}


def build_critic(cfg, policy=None):
    """The critic worker group for a recipe config (sections model, critic, actor, rollout, trainer).

    With --trainer.backend ray, pass the policy group (built with critic=cfg.critic): the critic goes on
    its pool (colocated) or on its own.
    """
    s, t = cfg.system, cfg.system.scale_out
    device, seed = s.trainer.device, cfg.trainer.seed
    args = (cfg.model, cfg.critic, cfg.rollout, cfg.actor.ppo_mini_batch_size)
    if t.backend == "local":
        return LocalWorkerGroup(CriticWorker(*args, device=device, seed=seed, system=s))
    from rlkit.fsdp_workers import FSDPCriticWorker
    from rlkit.ray_group import RayWorkerGroup

    pools, made = _pools_of(policy, "critic", t, device)
    group = RayWorkerGroup(
        FSDPCriticWorker, pools["critic"], *args, share=_share(pools, "critic"), device=device, seed=seed, fsdp=fsdp_options(t), system=s
    )
    return _owning(group, pools, made)


def build_reward(cfg, policy=None):
    """The reward of a recipe config: the scoring function, plus with --reward.model-path a reward model,
    loaded in this process or, with --trainer.backend ray, as replicas on Ray workers (pass the policy
    group: they go on its pool, or on their own with --trainer.reward-workers N)."""
    from rlkit.rewards import RewardFn

    t, r, rs, device = cfg.system.scale_out, cfg.reward, cfg.system.reward, cfg.system.trainer.device
    length = cfg.data.max_prompt_length + cfg.data.max_response_length  # what the reward model reads (recipes/rm.py's limit)
    if t.backend == "local" or not r.model_path:
        return RewardFn.from_config(r, device, max_length=length, system=rs)
    from rlkit.ray_group import RayWorkerGroup
    from rlkit.reward_model import RayRewardModel, RewardModelWorker

    pools, made = _pools_of(policy, "reward_model", t, device)
    group = RayWorkerGroup(
        RewardModelWorker,
        pools["reward_model"],
        r.model_path,
        device,
        rs.model_micro_batch_size,
        cfg.model.trust_remote_code,
        length,
        share=_share(pools, "reward_model"),
    )
    return RewardFn.from_config(r, device, model=RayRewardModel(_owning(group, pools, made)), system=rs)


def check_teacher(cfg) -> None:
    """--teacher (recipes/opd.py), before any model loads: a readable model that scores the student's token ids -- the
    same vocabulary and chat template, and an embedding row for every id the student can sample (vocab_size)."""
    from transformers import AutoConfig

    from rlkit.engine import load_tokenizer

    def read(model_cfg):
        path = resolved(model_cfg).path
        config = AutoConfig.from_pretrained(path, trust_remote_code=cfg.model.trust_remote_code).get_text_config()
        return load_tokenizer(path, cfg.model.trust_remote_code), config.vocab_size

    try:
        student, student_vocab = read(cfg.model)
    except (OSError, ValueError):  # the student's own load says what is wrong with it
        return
    try:
        teacher, teacher_vocab = read(dataclasses.replace(cfg.model, path=cfg.teacher, lora_rank=0))
    except (OSError, ValueError) as e:
        raise MissingFile(
            f"--teacher {cfg.teacher}: no model there ({str(e).splitlines()[0][:120]}); pass a model folder or a hub id"
        ) from e
    for what, a, b in (
        ("vocabulary", student.get_vocab(), teacher.get_vocab()),
        ("chat template", student.chat_template, teacher.chat_template),
    ):
        if a != b:
            raise ConfigError(
                f"--teacher {cfg.teacher} has another {what} than --model.path {cfg.model.path}: the teacher scores the "
                "student's token ids, so both must use the same tokenizer and chat template (pick a teacher of the same family)"
            )
    if teacher_vocab < student_vocab:
        raise ConfigError(
            f"--teacher {cfg.teacher} has {teacher_vocab} embedding rows, fewer than the student's {student_vocab} (vocab_size): "
            "it cannot score every token the student samples; pick a teacher with at least as many"
        )


def build_teacher(cfg, policy=None):
    """On-policy distillation's teacher (recipes/opd.py): --teacher as a frozen model that scores the student's
    tokens, in this process or, with --trainer.backend ray, as one replica per bundle of the policy's pool (pass
    the policy group). Call check_teacher(cfg) first, before the student loads."""
    from rlkit.workers import TeacherWorker

    t, device = cfg.system.scale_out, cfg.system.trainer.device
    teacher_cfg = dataclasses.replace(cfg.model, path=cfg.teacher, lora_rank=0)
    args = (teacher_cfg, cfg.rollout)
    if t.backend == "local":
        return LocalWorkerGroup(TeacherWorker(*args, device=device, system=cfg.system))
    from rlkit.ray_group import RayWorkerGroup

    pools, made = _pools_of(policy, "teacher", t, device)
    group = RayWorkerGroup(TeacherWorker, pools["teacher"], *args, share=_share(pools, "teacher"), device=device, system=cfg.system)
    return _owning(group, pools, made)
