"""DAPO: Decoupled clip and Dynamic sAmpling Policy Optimization (Yu et al., 2025), in one file.

GRPO's group-relative advantage with four changes:

1. clip-higher: decoupled clip range, rho in [1 - 0.2, 1 + 0.28], so rare tokens can grow;
2. token-level loss: every token of the batch weighs the same (loss_agg_mode=token-mean);
3. overlong reward shaping: inside the last `overlong_buffer_len` tokens before
   max_response_length, the reward falls linearly, by up to `overlong_penalty_factor`:
       r += min(-(|y| - (L_max - L_buf)) / L_buf * factor, 0);
4. dynamic sampling: groups whose responses all score the same carry no signal (advantage 0);
   drop them and keep generating until train_batch_size informative groups are collected.
No KL penalty by default.

    python recipes/dapo.py                          # embedded tiny model + arithmetic task, CPU
    python recipes/dapo.py --help

Batch-size arithmetic, per training step: as grpo.py (B prompts x n samples, mini-batches of
M prompts, micro-batches of trajectories), except that B informative prompts are collected from
as many generation batches of `gen_batch_size` prompts as needed (at most max_num_gen_batches).
"""

from dataclasses import dataclass, field

import torch

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
from rlkit.errors import ConfigError, RunFailed
from rlkit.placement import build_policy, build_reward
from rlkit.protocol import DataProto


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    actor: ActorConfig = field(
        default_factory=lambda: ActorConfig(
            lr=1e-4,
            ppo_mini_batch_size=32,
            clip_ratio_low=0.2,
            clip_ratio_high=0.28,
            loss_agg_mode="token-mean",
            use_kl_loss=False,
        )
    )
    reward: RewardConfig = field(default_factory=RewardConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    norm_adv_by_std_in_grpo: bool = True
    """divide the group-centred reward by the group's std (False = Dr.GRPO)"""
    overlong_buffer_len: int = 2
    """length of the soft-punishment zone before max_response_length (0: no overlong shaping)"""
    overlong_penalty_factor: float = 1.0
    """largest overlong penalty, reached at max_response_length"""
    filter_groups: bool = True
    """dynamic sampling: drop groups whose rewards are all equal and generate more"""
    gen_batch_size: int = 48
    """prompts per generation batch while collecting informative groups (epochs count these)"""
    max_num_gen_batches: int = 10
    """stop with an error after this many generation batches in one step (0 = unlimited)"""
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
    if cfg.rollout.n < 2:
        raise ConfigError(
            "DAPO needs --rollout.n >= 2: "
            "the advantage compares each response with the others of its group"
        )
    policy = build_policy(cfg)  # actor + rollout + reference: here, or on Ray (docs/scaling.md)
    tok = policy.tokenizer
    train = PromptLoader(
        build_prompts(cfg.data.train_files, tok, cfg.data, cfg.system.data),
        cfg.gen_batch_size,
        tok.pad_token_id,
        cfg.data.shuffle,
        cfg.trainer.seed,
    )
    v = cfg.system.data  # the validation files and how many of their prompts
    val = build_prompts(v.val_files, tok, cfg.data, v, v.val_max_samples) if v.val_files else None
    reward_fn = build_reward(cfg, policy)  # the scoring function (+ a reward model, if any)
    run = recipe.Run(cfg, policy, train, val, reward_fn)
    actor_loss = make_actor_loss(cfg)
    rollouts = recipe.Rollouts(cfg, policy, train)  # each call: G prompts from train x n samples

    for step in run.steps(rollouts):
        timings = {}
        with recipe.timer("step", timings):
            # informative groups; every generation batch's reward metrics; generation batches
            kept, gen_metrics, num_gen_batches = [], [], 0
            while sum(len(b) for b in kept) < cfg.data.train_batch_size * cfg.rollout.n:
                num_gen_batches += 1
                if 0 < cfg.max_num_gen_batches < num_gen_batches:
                    raise RunFailed(
                        f"dynamic sampling: {cfg.max_num_gen_batches} generation batches gave "
                        f"fewer than {cfg.data.train_batch_size} prompts whose responses differ in "
                        "reward. The task is too easy or too hard for the model: raise "
                        "--max-num-gen-batches (0 = unlimited), raise --rollout.n, or pass "
                        "--no-filter-groups"
                    )
                with recipe.timer("gen", timings):  # rollout: policy.generate, one response per row
                    batch = rollouts.next()  # prompts + responses, response_mask: (G*n, R); uid
                with recipe.timer("reward", timings):  # one verifiable score per response
                    scores, reward_metrics = recipe.score(batch, tok, reward_fn)  # scores: (G*n,)
                    reward_metrics |= train.record(batch, scores)  # feeds the difficulty sampler
                gen_metrics.append((reward_metrics, len(batch)))

                # ALGO LOGIC: overlong reward shaping, then keep only groups whose rewards differ
                if cfg.overlong_buffer_len > 0:
                    scores = scores + algos.overlong_reward_penalty(
                        batch["response_mask"].sum(-1),
                        cfg.data.max_response_length,
                        cfg.overlong_buffer_len,
                        cfg.overlong_penalty_factor,
                    )
                batch["scores"] = scores
                keep = (
                    algos.informative_groups(batch["uid"], scores)
                    if cfg.filter_groups
                    else torch.ones(len(batch), dtype=torch.bool)
                )
                kept.append(batch.index(keep))
            batch = DataProto.concat(kept).index(
                slice(0, cfg.data.train_batch_size * cfg.rollout.n)
            )
            scores = batch["scores"]  # (B*n,)
            reward_metrics = recipe.mean_metrics(gen_metrics)  # over all generated responses
            reward_metrics["dapo/num_gen_batches"] = num_gen_batches
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
