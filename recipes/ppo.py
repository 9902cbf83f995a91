"""PPO: Proximal Policy Optimization with a learned critic (Schulman et al., 2017; for LMs
Ziegler et al., 2019, Ouyang et al., 2022), in one file.

Sample n responses per prompt, score each with a verifiable reward, and turn each score into
per-token rewards with a KL penalty to the reference (starting) policy:

    r_t = s * [t = last token] - beta * KL_t,    KL_t = kl_penalty(log pi_old(y_t), log pi_ref(y_t))

A value model (the critic, the policy's checkpoint with a 1-output head) predicts V_t = V(x, y_<t),
the return from the state before token t. Generalised advantage estimation (GAE) turns its TD errors
into advantages, whitened over the batch, and returns, the critic's targets:

    delta_t = r_t + gamma * V_{t+1} - V_t,  A_t = delta_t + gamma * lam * A_{t+1},  R_t = A_t + V_t

Actor: grpo.py's clipped surrogate with its dual clip (c = 3), rho = pi/pi_old,
L = -mean_t min(rho_t A_t, clip(rho_t, 1-eps, 1+eps) A_t), at most -c A_t when A_t < 0.
Critic: L_V = 1/2 mean_t max((V_t - R_t)^2, (clip(V_t, V_old_t +- c_v) - R_t)^2), c_v: value clip.
beta is fixed, or adaptive (Ziegler et al.): e = clip(KL / target_kl - 1, -0.2, 0.2),
beta <- beta (1 + e B / horizon), with KL the batch mean of each response's mean KL_t and B the
number of trajectories.

Run it:

    python recipes/ppo.py                  # embedded tiny model + arithmetic task, CPU, ~3.5 min
    python recipes/ppo.py --help           # every option, documented
    python recipes/ppo.py --kl-ctrl adaptive --target-kl 0.05 --critic-warmup 5
    python recipes/ppo.py --model Qwen/Qwen2.5-0.5B-Instruct --model.lora-rank 16 \\
        --critic.lora-rank 16 \\
        --data.train-files gsm8k/train.parquet --data.val-files gsm8k/test.parquet \\
        --data.max-prompt-length 512 --data.max-response-length 512 --actor.lr 1e-6 --critic.lr 1e-5

Batch-size arithmetic, per training step:

    data.train_batch_size prompts            B   = 32
    x rollout.n samples each                 n   = 4      -> B*n = 128 trajectories (n = 1 is fine)
    actor: mini-batches of                   M   = actor.ppo_mini_batch_size prompts (M*n rows)
                                                          -> B/M optimizer steps per epoch
    critic: mini-batches of                  M_c = critic.ppo_mini_batch_size prompts (default M)
                                                          -> B/M_c optimizer steps per epoch
    each accumulated over micro-batches of   actor/critic.ppo_micro_batch_size trajectories

and each update is grpo.py's loop (see its docstring), the critic's with its own optimizer.
"""

from dataclasses import dataclass, field
from typing import Literal

from rlkit import algos, recipe
from rlkit.config import (
    ActorConfig,
    CriticConfig,
    DataConfig,
    ModelConfig,
    PPOSystem,
    RewardConfig,
    RolloutConfig,
    TrainerConfig,
)
from rlkit.data import PromptLoader, build_prompts
from rlkit.placement import build_critic, build_policy, build_reward
from rlkit.rewards import token_level_rewards


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=lambda: RolloutConfig(n=4))
    actor: ActorConfig = field(
        default_factory=lambda: ActorConfig(lr=1e-4, ppo_mini_batch_size=32, use_kl_loss=False)
    )
    critic: CriticConfig = field(default_factory=lambda: CriticConfig(lr=1e-4))
    reward: RewardConfig = field(default_factory=RewardConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    gamma: float = 1.0
    """GAE discount gamma"""
    lam: float = 1.0
    """GAE lambda: 1 = Monte-Carlo return - V (unbiased), 0 = one-step TD error (low variance)"""
    use_kl_in_reward: bool = True
    """subtract beta * KL_t (to the reference policy) from each token's reward"""
    kl_penalty: str = "kl"
    """KL estimator in the reward: kl (k1), abs, mse (k2), low_var_kl (k3)"""
    kl_ctrl: Literal["fixed", "adaptive"] = "fixed"
    """beta stays kl_coef (fixed) or follows target_kl (adaptive, Ziegler et al. 2019)"""
    kl_coef: float = 0.001
    """(initial) weight beta of the KL in the reward"""
    target_kl: float = 0.1
    """adaptive controller: the per-token KL it steers towards"""
    horizon: int = 10000
    """adaptive controller: trajectories over which beta may change by the clipped error (20%)"""
    critic_warmup: int = 0
    """train only the critic for this many first steps (the actor waits for useful values)"""
    system: PPOSystem = field(default_factory=PPOSystem)
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


# ALGO LOGIC: the critic's loss on one micro-batch: clipped regression of V onto the GAE returns
def make_critic_loss(cfg: Config):
    c = cfg.critic

    def critic_loss(mb, vpreds, _entropy, norm):  # vpreds, mask: (b, R)
        mask = mb["response_mask"]
        vf_loss, clipfrac = algos.value_loss(
            vpreds, mb["returns"], mb["values"], mask, c.cliprange_value, c.loss_agg_mode, norm=norm
        )
        return (
            vf_loss,
            {"vf_loss": vf_loss},
            {"vf_clipfrac": clipfrac, "vpred_mean": algos.masked_mean(vpreds, mask).item()},
        )

    return critic_loss


# ALGO LOGIC: token rewards = score on the last token - beta * KL_t; then the controller moves beta
def kl_in_reward(scores, batch, kl_ctrl, kind: str):
    mask = batch["response_mask"]
    kl = algos.kl_penalty(batch["old_log_probs"], batch["ref_log_prob"], kind) * mask
    beta = kl_ctrl.value
    rewards = token_level_rewards(scores, mask) - beta * kl
    current_kl = algos.masked_mean(kl, mask, dim=-1).mean().item()  # mean of the per-response means
    kl_ctrl.update(current_kl, n_steps=len(batch))
    return rewards, {"actor/reward_kl_penalty": current_kl, "actor/reward_kl_coef": beta}


def main(cfg: Config) -> dict:
    # TRY NOT TO MODIFY: setup -- threads, seed, models, data, reward function, logging, resume
    recipe.setup(cfg)  # threads, seed, batch-size checks
    need_ref = cfg.actor.use_kl_loss or cfg.use_kl_in_reward
    # actor + rollout + reference (+ room for the critic on Ray)
    policy = build_policy(cfg, need_ref=need_ref, critic=cfg.critic)
    critic = build_critic(cfg, policy)  # value model: the policy's checkpoint + a fresh value head
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
    kl_ctrl = (
        algos.AdaptiveKLController(cfg.kl_coef, cfg.target_kl, cfg.horizon)
        if cfg.kl_ctrl == "adaptive"
        else algos.FixedKLController(cfg.kl_coef)
    )
    run = recipe.Run(
        cfg, policy, train, val, reward_fn, stateful={"critic": critic, "kl_ctrl": kl_ctrl}
    )
    actor_loss, critic_loss = make_actor_loss(cfg), make_critic_loss(cfg)
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
            with recipe.timer(
                "values", timings
            ):  # V_old(s_t): the critic's estimate before token t
                batch = batch.union(critic.compute_values(batch))  # + values: (B*n, R)

            # ALGO LOGIC: token rewards (KL in the reward), GAE advantages (whitened), returns
            kl_metrics = {}
            if cfg.use_kl_in_reward:
                batch["token_level_rewards"], kl_metrics = kl_in_reward(
                    scores, batch, kl_ctrl, cfg.kl_penalty
                )
            else:
                batch["token_level_rewards"] = token_level_rewards(scores, batch["response_mask"])
            batch["advantages"], batch["returns"] = algos.gae_advantage(
                batch["token_level_rewards"],
                batch["values"],
                batch["response_mask"],
                cfg.gamma,
                cfg.lam,
            )

            with recipe.timer("update_critic", timings):  # ALGO LOGIC: the loss of make_critic_loss
                critic_metrics = critic.update(batch, critic_loss)
            actor_metrics = {}
            if step > cfg.critic_warmup:
                with recipe.timer("update", timings):  # ALGO LOGIC: the loss of make_actor_loss
                    actor_metrics = policy.update(batch, actor_loss)  # then the weight sync

        # TRY NOT TO MODIFY: metrics, validation, checkpoints
        metrics = {
            **recipe.batch_metrics(batch, scores, cfg.data.max_response_length),
            **reward_metrics,
            **kl_metrics,
            **critic_metrics,
            **actor_metrics,
        }
        run.end_of_step(step, metrics, timings, batch)
    return run.finish()


if __name__ == "__main__":
    recipe.cli(main, Config)
