"""OPD: on-policy distillation (Agarwal et al. 2024, GKD; Thinking Machines 2025), in one file.

The student samples its own responses; a frozen teacher scores every sampled token; the per-token
reverse KL, estimated from that one sample, is a per-token penalty -- no reward model, no value:

    d_t = log pi(y_t | x, y_<t) - log pi_T(y_t | x, y_<t)            (student minus teacher)
    A_t = -kl_coef * d_t                 (+ task_reward_coef * the GRPO advantage, if asked)

Then the PPO clipped surrogate of grpo.py with these per-token advantages. Averaged over the
student's samples, d_t is KL(pi || pi_T) per token: the update moves the student toward the
teacher on the text the student itself writes (mode-seeking), so it needs no teacher generation.
The teacher must share the student's tokenizer and chat template (checked before it loads).

Run it:

    python recipes/opd.py --teacher outputs/grpo/checkpoints/global_step_296/hf  # default grpo run
    python recipes/opd.py --help          # every option, documented
    python recipes/opd.py --model Qwen/Qwen2.5-0.5B-Instruct --teacher Qwen/Qwen2.5-7B-Instruct \\
        --data.train-files gsm8k/train.parquet --data.val-files gsm8k/test.parquet

Batch-size arithmetic, per training step (as grpo.py):

    data.train_batch_size prompts            B   = 32
    x rollout.n samples each                 n   = 4      -> B*n = 128 trajectories
    split into mini-batches of               M   = actor.ppo_mini_batch_size prompts (M*n rows)
                                                          -> B/M optimizer steps per epoch
    each accumulated over micro-batches of   actor.ppo_micro_batch_size trajectories

One extra forward pass per step: the teacher's (timing/teacher). The student's log-probs
before the update are computed every step (timing/old_log_prob): the advantage needs them.
docs/opd.md: the formula beside its code line, the flags, the measured demo.
"""

from dataclasses import dataclass, field

from rlkit import algos, recipe
from rlkit.config import (
    ActorConfig,
    DataConfig,
    ModelConfig,
    RewardConfig,
    RolloutConfig,
    System,
    TrainerConfig,
)
from rlkit.data import PromptLoader, build_prompts
from rlkit.errors import ConfigError
from rlkit.placement import build_policy, build_reward, build_teacher, check_teacher


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    actor: ActorConfig = field(
        default_factory=lambda: ActorConfig(lr=1e-4, ppo_mini_batch_size=32, use_kl_loss=False)
    )
    reward: RewardConfig = field(default_factory=RewardConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    rollout: RolloutConfig = field(default_factory=lambda: RolloutConfig(n=4))
    teacher: str = ""
    """the teacher: a model folder or built-in name, with the student's tokenizer and template"""
    kl_coef: float = 1.0
    """lambda in A_t = -lambda * d_t: the weight of the per-token reverse KL to the teacher"""
    discount: float = 0.0
    """gamma: A_t sums the later tokens' -lambda*d_s discounted by gamma (0: each its own)"""
    task_reward_coef: float = 0.0
    """> 0 adds this times the GRPO advantage of the task reward (needs --rollout.n >= 2)"""
    norm_adv_by_std_in_grpo: bool = True
    """with --task-reward-coef: divide the group-centred reward by the group's std"""
    system: System = field(default_factory=System)
    """how and where the run executes (dtypes, batching, validation, output, vLLM, Ray, async)"""


# ALGO LOGIC: the actor's loss on a micro-batch: clipped surrogate - entropy bonus + KL to pi_ref
def make_actor_loss(cfg: Config):
    a, off = cfg.actor, cfg.system.actor  # the loss; the off-policy correction's settings

    def actor_loss(mb, log_prob, entropy, norm):  # log_prob, entropy: (b, R); norm: algos.Norm
        weights, mask, corr = algos.rollout_weights(mb, off)  # on-policy: None, response_mask, {}
        mode = a.loss_agg_mode  # how token losses become one number (algos.agg_loss)
        pg_loss, metrics = algos.ppo_clip_loss(
            log_prob,
            mb["old_log_probs"],
            mb["advantages"],
            mask,
            a.clip_low,
            a.clip_high,
            a.clip_ratio_c,
            loss_agg_mode=mode,
            norm=norm,
            weights=weights,
        )
        metrics.update(corr)
        parts = {"pg_loss": pg_loss}  # each term as it enters the loss, unweighted: actor/<name>
        if a.entropy_coeff:
            parts["entropy_loss"] = -algos.agg_loss(entropy, mask, mode, norm=norm)
        if a.use_kl_loss:
            kl = algos.kl_penalty(log_prob, mb["ref_log_prob"], a.kl_loss_type)  # (b, R)
            parts["kl_loss"] = algos.agg_loss(kl, mask, mode, norm=norm)
        loss = pg_loss + a.entropy_coeff * parts.get("entropy_loss", 0.0)
        loss = loss + a.kl_loss_coef * parts.get("kl_loss", 0.0)
        return loss, parts, metrics

    actor_loss.needs_entropy = a.entropy_coeff != 0  # the engine computes it only when asked
    return actor_loss


def main(cfg: Config) -> dict:
    # TRY NOT TO MODIFY: setup -- threads, seed, model, data, reward function, logging, resume
    recipe.setup(cfg)  # threads, seed, batch-size checks
    if not cfg.teacher:
        raise ConfigError("recipes/opd.py needs --teacher PATH: the model whose tokens it distills")
    for flag, v, top in (("--kl-coef", cfg.kl_coef, 1e6), ("--discount", cfg.discount, 1.0)):
        if not 0 <= v <= top:  # (NaN and inf: recipe.setup's config.check_values, first)
            raise ConfigError(f"{flag} {v}: must be a number from 0 to {top:g}")
    if cfg.task_reward_coef and cfg.rollout.n < 2:
        raise ConfigError(
            "--task-reward-coef needs --rollout.n >= 2: "
            "the GRPO advantage compares each response with the others of its group"
        )
    if cfg.rollout.temperature != 1.0:
        raise ConfigError(
            f"--rollout.temperature {cfg.rollout.temperature}: on-policy distillation samples at 1 "
            "(d_t estimates the KL of the distribution the student samples from)"
        )
    check_teacher(cfg)  # it exists and scores the student's token ids: before either loads
    policy = build_policy(cfg)  # actor + rollout + reference: here, or on Ray (docs/scaling.md)
    teacher = build_teacher(cfg, policy)  # ALGO LOGIC: frozen, scores the student's tokens
    tok = policy.tokenizer
    train = PromptLoader(
        build_prompts(cfg.data.train_files, tok, cfg.data, cfg.system.data),
        cfg.data.train_batch_size,
        tok.pad_token_id,
        cfg.data.shuffle,
        cfg.trainer.seed,
    )
    v = cfg.system.data  # the validation files and how many of their prompts
    val = build_prompts(v.val_files, tok, cfg.data, v, v.val_max_samples) if v.val_files else None
    reward_fn = build_reward(cfg, policy)  # the scoring function (+ a reward model, if any)
    run = recipe.Run(cfg, policy, train, val, reward_fn)
    actor_loss = make_actor_loss(cfg)
    rollouts = recipe.Rollouts(cfg, policy, train)  # each step: B prompts from train x n samples

    for step in run.steps(rollouts):
        timings = {}
        with recipe.timer("step", timings):
            with recipe.timer("gen", timings):  # rollout: policy.generate, one response per row
                batch = rollouts.next()  # prompts + responses, response_mask: (B*n, R); uid
            with recipe.timer("reward", timings):  # one verifiable score per response
                scores, reward_metrics = recipe.score(batch, tok, reward_fn)  # scores: (B*n,)
                reward_metrics |= train.record(batch, scores)  # feeds the difficulty sampler
            with recipe.timer("ref", timings):  # log pi_ref(y_t): the reference for the KL penalty
                if cfg.actor.use_kl_loss:
                    batch = batch.union(policy.compute_ref_log_prob(batch))  # + ref_log_prob
            with recipe.timer("old_log_prob", timings):  # log pi(y_t) before the update: d_t's
                batch = batch.union(policy.compute_log_prob(batch))  # ALGO LOGIC: every step
            with recipe.timer("teacher", timings):  # ALGO LOGIC: log pi_T(y_t), the teacher's
                batch = batch.union(teacher.compute_log_prob(batch))  # + teacher_log_prob (B*n, R)

            # ALGO LOGIC: per-token advantage -kl_coef * d_t (+ the task's group-relative advantage)
            mask = batch["response_mask"]  # (B*n, R)
            advantages, d = algos.distill_advantage(
                batch["old_log_probs"], batch["teacher_log_prob"], mask, cfg.kl_coef, cfg.discount
            )  # both (B*n, R)
            if cfg.task_reward_coef:
                task = algos.grpo_advantage(scores, batch["uid"], cfg.norm_adv_by_std_in_grpo)
                advantages = advantages + cfg.task_reward_coef * task[:, None] * mask
            batch["advantages"] = advantages
            lp_teacher, lp_student = batch["teacher_log_prob"], batch["old_log_probs"]
            distill_metrics = {  # ALGO LOGIC: d_t should fall as the student nears the teacher
                "distill/reverse_kl": algos.masked_mean(d, mask).item(),
                "distill/teacher_log_prob": algos.masked_mean(lp_teacher, mask).item(),
                "distill/student_log_prob": algos.masked_mean(lp_student, mask).item(),
            }

            with recipe.timer("update", timings):  # ALGO LOGIC: the loss of make_actor_loss
                actor_metrics = policy.update(batch, actor_loss)  # then the rollout's weight sync

        # TRY NOT TO MODIFY: metrics, validation, checkpoints
        metrics = {
            **recipe.batch_metrics(batch, scores, cfg.data.max_response_length),
            **reward_metrics,
            **actor_metrics,
            **distill_metrics,
        }
        run.end_of_step(step, metrics, timings, batch)
    teacher.close()  # on Ray: its replicas, before the policy's pools they sit on are freed
    return run.finish()


if __name__ == "__main__":
    recipe.cli(main, Config)
