"""GRPO: Group Relative Policy Optimization (Shao et al., 2024, DeepSeekMath), in one file.

For each prompt, sample a group of n responses, score each with a verifiable reward, and use the
response's reward relative to its group as the advantage -- no value model:

    A_i = (r_i - mean(r_group)) / (std(r_group) + eps)          (Dr.GRPO: no division by std)

Then maximise the PPO clipped surrogate (dual clip) with a KL penalty to the reference policy:

    l_t  = -min(rho_t A, clip(rho_t, 1-eps_low, 1+eps_high) A),  at most -c A when A < 0  (c = 3)
    L    = mean_t l_t + beta * KL_t,   rho_t = pi(y_t | x, y_<t) / pi_old(y_t | x, y_<t)
    KL_t = exp(q) - q - 1,  q = log pi_ref(y_t) - log pi(y_t)   (k3 "low_var_kl", in [-10, 10])

Run it:

    python recipes/grpo.py                 # embedded tiny model + arithmetic task, CPU, ~3 min
    python recipes/grpo.py --help          # every option, documented
    python recipes/grpo.py --model Qwen/Qwen2.5-0.5B-Instruct --model.lora-rank 16 \\
        --data.train-files gsm8k/train.parquet --data.val-files gsm8k/test.parquet \\
        --data.max-prompt-length 512 --data.max-response-length 512 --actor.lr 1e-5

Batch-size arithmetic, per training step:

    data.train_batch_size prompts            B   = 32
    x rollout.n samples each                 n   = 8      -> B*n = 256 trajectories
    split into mini-batches of               M   = actor.ppo_mini_batch_size prompts (M*n rows)
                                                          -> B/M optimizer steps per epoch
    each accumulated over micro-batches of   actor.ppo_micro_batch_size trajectories

and the update, policy.update (TorchEngine.update in rlkit/engine.py):

    for epoch in range(actor.ppo_epochs):
        for mini in batch.split(M * n):                          # one optimizer step each
            optimizer.zero_grad()
            for micro in mini.split(actor.ppo_micro_batch_size):  # memory only, same gradient
                actor_loss(micro, log_prob, entropy, norm).backward()  # norm: mini's token count
            clip_grad_norm_(actor.grad_clip); optimizer.step()
    then the rollout gets the new weights (vllm: copied into its engine; hf samples this model)

With B == M and ppo_epochs == 1 the update is one optimizer step: pi_old = pi, so rho = 1.
Other engines and scales are flags, not code: docs/scaling.md, docs/vllm.md, docs/off-policy.md.
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
    actor: ActorConfig = field(default_factory=lambda: ActorConfig(lr=1e-4, ppo_mini_batch_size=32))
    reward: RewardConfig = field(default_factory=RewardConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    norm_adv_by_std_in_grpo: bool = True
    """divide the group-centred reward by the group's std (False = Dr.GRPO)"""
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
            "GRPO needs --rollout.n >= 2: "
            "the advantage compares each response with the others of its group"
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
