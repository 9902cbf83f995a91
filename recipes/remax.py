"""ReMax: REINFORCE, the greedy response's reward as baseline (Li et al., 2023, arXiv 2310.10505).

For each prompt, decode one extra response *greedily* and score it like the samples; its reward is
the baseline of every sample of that prompt -- no value model, and no group of samples needed:

    b(x) = r(x, y_greedy),        A_i = r(x, y_i) - b(x)          (the same for every token of y_i)

No std normalisation. The update is grpo.py's (clipped surrogate + k3 KL to the reference); with one
optimizer step per batch (the default) the ratio is 1 and it is REINFORCE with baseline b. The cost
is one greedy generation of B rows per step (inside timing/gen). The paper samples one response per
prompt (--rollout.n 1); the default keeps grpo.py's n = 8 so that both see the same samples per
step.
The greedy decoding is the validation decoding (--rollout.val-temperature 0, the default).

    python recipes/remax.py                         # embedded tiny model + arithmetic task, CPU
    python recipes/remax.py --help
    python recipes/remax.py --rollout.n 1  # the paper's setting: one sample + one greedy per prompt

Batch-size arithmetic, per training step: as grpo.py -- data.train_batch_size prompts x rollout.n
samples, split into mini-batches of actor.ppo_mini_batch_size prompts (x n trajectories), each
accumulated over micro-batches of actor.ppo_micro_batch_size trajectories.
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
from rlkit.errors import ConfigError
from rlkit.placement import build_policy, build_reward
from rlkit.rewards import token_level_rewards


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    actor: ActorConfig = field(default_factory=lambda: ActorConfig(lr=1e-4, ppo_mini_batch_size=32))
    reward: RewardConfig = field(default_factory=RewardConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
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
    if cfg.system.rollout.val_temperature != 0:
        raise ConfigError(
            "ReMax's baseline is the greedy response: "
            "keep --rollout.val-temperature 0 (greedy validation decoding)"
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

    # ALGO LOGIC: the baseline -- one greedy response per prompt, scored like the samples
    def greedy_baseline(batch):  # the B prompts of a batch, before Rollouts repeats them n times
        greedy = policy.generate(batch, validate=True)  # + responses, response_mask: (B, R), greedy
        batch["greedy_score"] = recipe.score(greedy, tok, reward_fn)[0].tolist()  # b(x), per prompt
        return batch  # greedy_score is kept through the repeat and generate()

    # each step: B prompts from train, + their greedy score, x n samples
    rollouts = recipe.Rollouts(cfg, policy, train, prepare=greedy_baseline)

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

            # ALGO LOGIC: score minus its prompt's greedy score, the same for every token
            mask = batch["response_mask"]  # (B*n, R)
            # (B*n,): each row carries its prompt's b(x)
            baseline = torch.tensor(list(batch["greedy_score"]), dtype=torch.float32)
            rewards = token_level_rewards(scores, mask)  # (B*n, R)
            batch["advantages"], _ = algos.remax_advantage(rewards, baseline, mask)  # (B*n, R)
            reward_metrics["critic/greedy_score/mean"] = baseline.mean().item()

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
