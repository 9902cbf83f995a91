"""REINFORCE++ (Hu, 2025), and its group-baseline variant, in one file.

REINFORCE with PPO's tricks and no value model. The KL to the reference policy is part of the
reward, token by token, and the advantage is the discounted return, whitened over the whole batch:

    r_t = -beta * KL_t  (+ the outcome score s on the last token)
    G_t = r_t + gamma * G_{t+1}
    A_t = (G_t - mean(G)) / std(G)                 over every valid token of the batch

With --baseline (REINFORCE++-baseline) each response's total reward R_i = sum_t r_t (the score minus
the KL penalties, as verl sums it) is first centred on its prompt's group mean, then whitened over
the batch: A_i = whiten(R_i - mean_group(R)), the same for every token.
The update is grpo.py's clipped surrogate.

    python recipes/reinforce_pp.py                  # embedded tiny model + arithmetic task, CPU
    python recipes/reinforce_pp.py --baseline       # the group-baseline variant
    python recipes/reinforce_pp.py --help

Batch-size arithmetic, per training step: as grpo.py -- data.train_batch_size prompts x rollout.n
samples, split into mini-batches of actor.ppo_mini_batch_size prompts (x n trajectories), each
accumulated over micro-batches of actor.ppo_micro_batch_size trajectories. Plain REINFORCE++
needs no group, so rollout.n = 1 works.
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
from rlkit.rewards import token_level_rewards


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    actor: ActorConfig = field(
        default_factory=lambda: ActorConfig(lr=1e-4, ppo_mini_batch_size=32, use_kl_loss=False)
    )
    reward: RewardConfig = field(default_factory=RewardConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    baseline: bool = False
    """REINFORCE++-baseline: subtract the group's mean total reward (score and KL terms) before
    whitening (rollout.n >= 2)"""
    gamma: float = 1.0
    """discount of the return G_t = r_t + gamma * G_{t+1}"""
    use_kl_in_reward: bool = True
    """subtract kl_coef * KL_t from each token's reward"""
    kl_coef: float = 0.001
    """weight beta of the KL in the reward"""
    kl_penalty: str = "kl"
    """KL estimator in the reward: kl (k1), abs, mse (k2), low_var_kl (k3)"""
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
    if cfg.baseline and cfg.rollout.n < 2:
        raise ConfigError(
            "REINFORCE++-baseline needs --rollout.n >= 2: "
            "the baseline is the mean of the prompt's group"
        )
    # the reference policy: for the KL loss or the KL in the reward
    need_ref = cfg.actor.use_kl_loss or cfg.use_kl_in_reward
    policy = build_policy(cfg, need_ref=need_ref)  # actor + rollout + reference
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
    rollouts = recipe.Rollouts(cfg, policy, train, need_ref=need_ref)  # B prompts x n, each step

    for step in run.steps(rollouts):
        timings = {}
        with recipe.timer("step", timings):
            with recipe.timer("gen", timings):  # rollout: policy.generate, one response per row
                batch = rollouts.next()  # prompts + responses, response_mask: (B*n, R); uid
            with recipe.timer("reward", timings):  # one verifiable score per response
                scores, reward_metrics = recipe.score(batch, tok, reward_fn)  # scores: (B*n,)
                reward_metrics |= train.record(batch, scores)  # feeds the difficulty sampler
            with recipe.timer("ref", timings):  # log pi_ref(y_t): the reference for the KL penalty
                if need_ref:
                    batch = batch.union(policy.compute_ref_log_prob(batch))  # + ref_log_prob
            with recipe.timer("old_log_prob", timings):  # log pi_old(y_t): the denominator of rho
                batch = batch.union(policy.compute_log_prob(batch))  # + old_log_probs, entropys

            # ALGO LOGIC: token rewards (score on the last token - beta * KL_t), whitened returns
            mask = batch["response_mask"]  # token rewards and advantages: (B*n, R), like the mask
            batch["token_level_rewards"] = token_level_rewards(scores, mask)
            if cfg.use_kl_in_reward:
                kl = (
                    algos.kl_penalty(batch["old_log_probs"], batch["ref_log_prob"], cfg.kl_penalty)
                    * mask
                )
                batch["token_level_rewards"] = batch["token_level_rewards"] - cfg.kl_coef * kl
            if cfg.baseline:
                batch["advantages"] = algos.reinforce_pp_baseline_advantage(
                    batch["token_level_rewards"].sum(-1), batch["uid"], mask
                )
            else:
                batch["advantages"], _ = algos.reinforce_pp_advantage(
                    batch["token_level_rewards"], mask, cfg.gamma
                )

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
