"""GSPO: Group Sequence Policy Optimization (Zheng et al., 2025, arXiv 2507.18071), in one file.

GRPO's group-relative advantage, but the importance ratio and its clip are per *sequence*: the
ratio is the geometric mean of the token ratios, so every token of a response is kept or clipped
together and long responses do not pile up token-level noise:

    s_i = exp( 1/|y_i| * sum_t (log pi(y_it) - log pi_old(y_it)) )
    L   = -mean_i min(s_i A_i, clip(s_i, 1-eps_low, 1+eps_high) A_i)     (no KL: the paper's setup)

The clip range is the paper's, eps_low = 3e-4 and eps_high = 4e-4 -- 500-670 times below GRPO's
0.2, because a sequence ratio moves far less than a token ratio. With one optimizer step per
batch (the default: mini-batch = batch) s_i = 1 and the clip never bites; it does with
--actor.ppo-mini-batch-size < --data.train-batch-size or --actor.ppo-epochs > 1. --gspo-token uses
GSPO-token (per-token advantages, sequence-level ratio value): the same gradient as GSPO when the
advantage is constant along a response, as here (verl's loss_mode=gspo is this variant).

    python recipes/gspo.py                          # embedded tiny model + arithmetic task, CPU
    python recipes/gspo.py --help
    python recipes/gspo.py --actor.ppo-mini-batch-size 8 --gspo-token  # 4 optimizer steps
Batch-size arithmetic, per training step: as grpo.py -- data.train_batch_size prompts x rollout.n
samples, split into mini-batches of actor.ppo_mini_batch_size prompts (x n trajectories), each
accumulated over micro-batches of actor.ppo_micro_batch_size trajectories.
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
from rlkit.placement import build_policy, build_reward


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    actor: ActorConfig = field(
        default_factory=lambda: ActorConfig(
            lr=1e-4,
            ppo_mini_batch_size=32,
            clip_ratio_low=algos.GSPO_CLIP_RATIO_LOW,  # 3e-4, the paper's
            clip_ratio_high=algos.GSPO_CLIP_RATIO_HIGH,  # 4e-4
            # mean over tokens, then over sequences: the paper's mean_i L_i
            loss_agg_mode="seq-mean-token-mean",
            use_kl_loss=False,
        )
    )
    reward: RewardConfig = field(default_factory=RewardConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    norm_adv_by_std_in_grpo: bool = True
    """divide the group-centred reward by the group's std (False = Dr.GRPO)"""
    gspo_token: bool = False
    """GSPO-token: per-token advantages; ratio sg(log s_i) + log pi_t - sg(log pi_t), s_i's value"""
    system: System = field(default_factory=System)
    """how and where the run executes (dtypes, batching, validation, output, vLLM, Ray, async)"""


# ALGO LOGIC: the actor's loss on a micro-batch: sequence-clipped surrogate - entropy + KL to pi_ref
def make_actor_loss(cfg: Config):
    a, off = cfg.actor, cfg.system.actor  # the loss; the off-policy correction's settings

    def actor_loss(mb, log_prob, entropy, norm):  # log_prob, entropy: (b, R); norm: algos.Norm
        weights, mask, corr = algos.rollout_weights(mb, off)  # on-policy: None, response_mask, {}
        mode = a.loss_agg_mode  # how token losses become one number (algos.agg_loss)
        # s_i = exp(mean_t log pi - log pi_old), clipped to [1-eps_low, 1+eps_high]
        pg_loss, metrics = algos.gspo_loss(
            log_prob,
            mb["old_log_probs"],
            mb["advantages"],
            mask,
            a.clip_low,
            a.clip_high,
            token_level=cfg.gspo_token,
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
    if cfg.rollout.n < 2:
        raise ConfigError(
            "GSPO needs --rollout.n >= 2: "
            "the advantage compares each response with the others of its group"
        )
    if cfg.actor.clip_ratio_c != ActorConfig().clip_ratio_c:  # read by the PPO clip loss only
        raise ConfigError(
            "--actor.clip-ratio-c: GSPO's loss has no dual clip (sequence-level clip)"
        )
    policy = build_policy(cfg)  # actor + rollout + reference: here, or on Ray (docs/scaling.md)
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
            with recipe.timer("old_log_prob", timings):  # log pi_old(y_t): the denominator of rho
                if not policy.update_is_one_step():  # one step: pi_old = pi, taken from the update
                    batch = batch.union(policy.compute_log_prob(batch))  # + old_log_probs, entropys

            # ALGO LOGIC: group-relative advantage, the same for every token of a response
            advantages = algos.grpo_advantage(scores, batch["uid"], cfg.norm_adv_by_std_in_grpo)
            batch["advantages"] = advantages[:, None] * batch["response_mask"]  # (B*n,) -> (B*n, R)

            with recipe.timer("update", timings):  # ALGO LOGIC: the loss of make_actor_loss
                actor_metrics = policy.update(batch, actor_loss)  # then the rollout's weight sync

        # TRY NOT TO MODIFY: metrics, validation, checkpoints
        metrics = {
            **recipe.batch_metrics(batch, scores, cfg.data.max_response_length),
            **reward_metrics,
            **actor_metrics,
        }
        run.end_of_step(step, metrics, timings, batch)
    return run.finish()


if __name__ == "__main__":
    recipe.cli(main, Config)
