"""GRPO with tools: multi-turn rollouts in which the model calls tools, then GRPO as in grpo.py.

The differences from grpo.py: the prompts offer the tools (--agent.tools) or an environment
(--agent.env); the rollout is the turn loop `rlkit.agent.run_turns` (generate -> parse <tool_call>
-> run the tools -> append their ids with mask 0 -> generate again, until an answer or a limit);
the advantage can be credited per turn (--turn-credit; the default, outcome, is grpo.py's) and is
grouped by seat in self-play (--agent.self-play); and the metrics add tool use.
The tool responses are holes in the response mask: they are context for the later turns but never
trained on (docs/agents.md).

The default run is the embedded demo (rlkit/demos.py): two-digit multiplication, which the
tiny model cannot do alone, and a calculator, which it was warm-started to call only sometimes.

GRPO itself:

For each prompt, sample a group of n responses, score each with a verifiable reward, and use the
response's reward relative to its group as the advantage -- no value model:

    A_i = (r_i - mean(r_group)) / (std(r_group) + eps)          (Dr.GRPO: no division by std)

Then maximise the PPO clipped surrogate (dual clip) with a KL penalty to the reference policy:

    l_t  = -min(rho_t A, clip(rho_t, 1-eps_low, 1+eps_high) A),  at most -c A when A < 0  (c = 3)
    L    = mean_t l_t + beta * KL_t,   rho_t = pi(y_t | x, y_<t) / pi_old(y_t | x, y_<t)
    KL_t = exp(q) - q - 1,  q = log pi_ref(y_t) - log pi(y_t)   (k3 "low_var_kl", in [-10, 10])

Run it:

    python recipes/grpo_tools.py           # embedded tool model + multiplication, CPU, ~7 min
    python recipes/grpo_tools.py --agent.env guess   # guess-the-number (docs/environments.md)
    python recipes/grpo_tools.py --agent.env textarena:TicTacToe-v0-raw \\
        --agent.self-play --agent.tools "" --rollout.n 4 \\
        --data.train-files train.parquet   # both seats (docs/environments.md)
    python recipes/grpo_tools.py --help    # every option, documented
    python recipes/grpo_tools.py --model Qwen/Qwen2.5-0.5B-Instruct --model.lora-rank 16 \\
        --agent.tools calculator,python \\
        --data.train-files my/train.parquet --data.val-files my/test.parquet \\
        --data.max-prompt-length 512 --data.max-response-length 1024 --actor.lr 1e-5

Batch-size arithmetic, per training step:

    data.train_batch_size prompts            B   = 32
    x rollout.n samples each                 n   = 8      -> B*n = 256 trajectories
    split into mini-batches of               M   = actor.ppo_mini_batch_size prompts (M*n rows)
                                                          -> B/M optimizer steps per epoch
    each accumulated over micro-batches of   actor.ppo_micro_batch_size trajectories

and the update is grpo.py's (see its docstring). With B == M and ppo_epochs == 1 it is one optimizer
step: pi_old = pi, so rho = 1.
"""

from dataclasses import dataclass, field
from typing import Literal

from rlkit import agent, algos, demos, recipe
from rlkit.agent import AgentConfig
from rlkit.config import (
    ActorConfig,
    DataConfig,
    DataSystem,
    ModelConfig,
    RewardConfig,
    RolloutConfig,
    ToolsSystem,
    TrainerConfig,
    TrainerSystem,
)
from rlkit.data import PromptLoader, build_prompts
from rlkit.errors import ConfigError
from rlkit.placement import build_policy, build_reward
from rlkit.tools import tools_from_names


def demo_system(demo) -> ToolsSystem:  # the demo's validation prompts (256 of them), every 10 steps
    data = DataSystem(val_files=[str(demo / "val.parquet")], val_max_samples=256)
    return ToolsSystem(data=data, trainer=TrainerSystem(test_freq=10))


@dataclass
class Config:
    model: ModelConfig = field(default_factory=lambda: ModelConfig(path=str(demos.CALC_MODEL)))
    data: DataConfig = field(
        default_factory=lambda: DataConfig(
            train_files=[str(demos.MULT_DATA / "train.parquet")],
            max_response_length=64,  # sampled + tool tokens, all turns
        )
    )
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    actor: ActorConfig = field(default_factory=lambda: ActorConfig(lr=1e-4, ppo_mini_batch_size=32))
    reward: RewardConfig = field(default_factory=RewardConfig)
    trainer: TrainerConfig = field(default_factory=lambda: TrainerConfig(total_training_steps=40))
    agent: AgentConfig = field(default_factory=AgentConfig)
    norm_adv_by_std_in_grpo: bool = True
    """divide the group-centred reward by the group's std (False = Dr.GRPO)"""
    turn_credit: Literal["outcome", "return_to_go", "step_group", "turn_baseline"] = "outcome"
    """how an episode's rewards become each turn's advantage (docs/agents.md): outcome (the summed
    reward, GRPO; every turn the same), return_to_go (each turn's discounted return vs the group),
    step_group (GiGPO: + a step advantage among turns that answered the same observation),
    turn_baseline (a leave-one-out baseline per turn index)"""
    turn_gamma: float = 1.0
    """the discount over turns of --turn-credit return_to_go, step_group and turn_baseline"""
    system: ToolsSystem = field(default_factory=lambda: demo_system(demos.MULT_DATA))
    """how and where the run executes (dtypes, batching, validation, output, vLLM, Ray, async)"""


@dataclass
class GuessConfig(Config):
    """--agent.env guess: the defaults are the guess-the-number demo's (rlkit/demos.py)"""

    model: ModelConfig = field(default_factory=lambda: ModelConfig(path=str(demos.GUESS_MODEL)))
    data: DataConfig = field(
        default_factory=lambda: DataConfig(
            train_files=[str(demos.GUESS_DATA / "train.parquet")],
            max_response_length=96,  # 4 guesses and 3 replies of ~20 tokens
        )
    )
    agent: AgentConfig = field(
        default_factory=lambda: AgentConfig(tools="", env="guess", max_turns=4)
    )
    system: ToolsSystem = field(default_factory=lambda: demo_system(demos.GUESS_DATA))


PRESETS = {
    "guess": GuessConfig
}  # --agent.env NAME -> the Config whose defaults the run starts from


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


# ALGO LOGIC: per-turn advantages (B*n, T) from per-turn rewards (--turn-credit; rlkit/algos.py)
def turn_advantages(cfg: Config, rewards, exists, keys, uid):
    g, std = cfg.turn_gamma, cfg.norm_adv_by_std_in_grpo
    if cfg.turn_credit == "return_to_go":  # (G_ik - mean_g G_.0) / std_g G_.0
        return algos.return_to_go_advantage(rewards, exists, uid, g, std)
    if cfg.turn_credit == "step_group":  # A^E_i + A^S_ik, step groups: same uid, same observation
        return algos.step_group_advantage(rewards, exists, uid, keys, g, 1.0, std)
    return algos.per_turn_baseline_advantage(rewards, exists, uid, g)  # G_ik - mean_{j != i} G_jk


def main(cfg: Config) -> dict:
    # TRY NOT TO MODIFY: setup -- threads, seed, model, data, reward function, logging, resume
    recipe.setup(cfg)  # threads, seed, batch-size checks
    if cfg.rollout.n < 2:
        raise ConfigError(
            "GRPO needs --rollout.n >= 2: "
            "the advantage compares each response with the others of its group"
        )
    if not 0.0 <= cfg.turn_gamma <= 1.0:
        raise ConfigError(f"--turn-gamma {cfg.turn_gamma}: must be in [0, 1] (1 = no discount)")
    # rlkit/tools.py: calculator, python
    tools = tools_from_names(
        cfg.agent.tools, cfg.agent.max_tool_response_chars, cfg.system.agent.sandbox_level
    )
    # actor + rollout + reference; generate() runs the turn loop (agent.run_turns) with the tools
    policy = agent.AgentPolicy(
        build_policy(cfg), tools, cfg.agent, cfg.rollout, cfg.data.max_response_length
    )
    tok = policy.tokenizer
    v = cfg.system.data  # the validation files and how many of their prompts
    train = PromptLoader(
        build_prompts(cfg.data.train_files, tok, cfg.data, v, tools=tools.schemas),  # offer tools
        cfg.data.train_batch_size,
        tok.pad_token_id,
        cfg.data.shuffle,
        cfg.trainer.seed,
    )
    val = (
        build_prompts(v.val_files, tok, cfg.data, v, v.val_max_samples, tools=tools.schemas)
        if v.val_files
        else None
    )
    reward_fn = build_reward(cfg, policy)  # the scoring function (+ a reward model, if any)
    run = recipe.Run(cfg, policy, train, val, reward_fn)
    actor_loss = make_actor_loss(cfg)
    rollouts = recipe.Rollouts(cfg, policy, train)  # each step: B prompts from train x n samples

    for step in run.steps(rollouts):
        timings = {}
        with recipe.timer("step", timings):
            with recipe.timer("gen", timings):  # rollout: the turn loop, one episode per row
                # prompts + the turn loop's responses (sampled and tool ids), response_mask (0 on
                # tool ids): (B*n, R); uid
                batch = rollouts.next()
            with recipe.timer("reward", timings):  # one verifiable score per response
                scores, reward_metrics = recipe.score(batch, tok, reward_fn)  # scores: (B*n,)
                reward_metrics |= train.record(batch, scores)  # feeds the difficulty sampler
            with recipe.timer("ref", timings):  # log pi_ref(y_t): the reference for the KL penalty
                if cfg.actor.use_kl_loss:
                    batch = batch.union(policy.compute_ref_log_prob(batch))  # + ref_log_prob
            with recipe.timer("old_log_prob", timings):  # log pi_old(y_t): the denominator of rho
                if not policy.update_is_one_step():  # one step: pi_old = pi, taken from the update
                    batch = batch.union(policy.compute_log_prob(batch))  # + old_log_probs, entropys

            # ALGO LOGIC: the groups: a prompt's n samples; in self-play, its rows of one seat
            uid = agent.seat_groups(batch)  # self-play: seat 0 vs seat 0's
            # ALGO LOGIC: group-relative advantage, the same for every token of a response
            advantages = algos.grpo_advantage(scores, uid, cfg.norm_adv_by_std_in_grpo)
            batch["advantages"] = advantages[:, None] * batch["response_mask"]  # (B*n,) -> (B*n, R)
            # ALGO LOGIC: or per turn: each sampled token gets its turn's advantage (--turn-credit)
            turns = agent.turn_rewards(batch, scores)  # rewards, exists, keys: (B*n, T)
            if cfg.turn_credit != "outcome":
                adv = turn_advantages(cfg, *turns, uid)  # (B*n, T)
                mask = batch["response_mask"]
                batch["advantages"] = algos.turn_token_advantages(adv, batch["turn_index"], mask)

            with recipe.timer("update", timings):  # ALGO LOGIC: the loss of make_actor_loss
                actor_metrics = policy.update(batch, actor_loss)  # then the rollout's weight sync

        # TRY NOT TO MODIFY: metrics, validation, checkpoints
        metrics = {
            **recipe.batch_metrics(batch, scores, cfg.data.max_response_length),
            **reward_metrics,
            **actor_metrics,
        }
        # turns, tool calls / errors / timeouts / time, stopped by a limit, tokens
        metrics.update(agent.agent_metrics(batch))
        metrics.update(agent.turn_metrics(batch, turns[0], turns[1], batch["advantages"]))
        metrics.update(agent.seat_metrics(batch, scores))  # self-play: each seat's outcome, draws
        run.end_of_step(step, metrics, timings, batch)
    return run.finish()


if __name__ == "__main__":
    recipe.cli(main, recipe.preset(Config, "--agent.env", PRESETS))  # picked before parsing
