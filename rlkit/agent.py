"""Multi-turn tool-use rollouts, token in / token out.

One episode, `run_turns`::

    context = prompt ids
    repeat:
        ids = sample(context)                       # one assistant turn, up to and including its EOS   mask 1
        calls = parse(decode(ids))                  # <tool_call>{json}</tool_call> (rlkit.tools.parse_hermes)
        no call              -> done (the answer)
        over a limit         -> done, stopped_by_limit
        results = tools.call_many(calls)            # errors come back as text, counted; all rows' calls at once
        suffix = tool_suffix_ids(results)           # ONLY the new messages, rendered by the chat template   mask 0
        context = context + ids + suffix

The ids the trainer scores are the ids the policy sampled plus the tool segments, concatenated: the
conversation is never decoded and encoded again (BPE is not a bijection: re-encoding changes ids,
and then the trainer scores tokens the policy never sampled). The output is the layout of
`rlkit.rollout.assemble` with holes in the response mask::

    responses       | sampled turn 1 | tool response + next prompt | sampled turn 2 | pad
    response_mask   | 1 1 1 ... 1    | 0 0 0 ... 0                 | 1 1 ... 1      | 0
    attention_mask  | 1 1 1 ... 1    | 1 1 1 ... 1                 | 1 1 ... 1      | 0
    rollout_log_probs| log pi(y_t)   | 0                           | log pi(y_t)    | 0

Limits (AgentConfig): assistant turns, tool calls, and the response budget (sampled + tool tokens,
--data.max-response-length, as verl's response_length).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from rlkit.config import learning_section
from rlkit.envs import EnvFactory, StepTimeout
from rlkit.errors import ConfigError
from rlkit.protocol import DataProto
from rlkit.tools import Tools, parse_hermes, render_prompt, truncate_middle

logger = logging.getLogger(__name__)
_warned: list[str] = []  # the first environment error, logged once per process


@learning_section("agent")
class AgentConfig:
    tools: str = "calculator"
    """comma-separated tools from rlkit.tools offered to the model (calculator, python)"""
    env: str = "tools"
    """the environment of each episode (rlkit/envs.py): tools (the --agent.tools), guess (guess-the-number, its
    embedded model and data), textarena:GAME-ID or skyrl:ENV-ID (environment libraries), or your factory as
    path/file.py:make_env"""
    max_turns: int = 3
    """assistant turns per episode; a turn that still calls a tool at the limit ends the episode (stopped by limit)"""
    max_tool_calls: int = 2
    """tool calls per episode; a turn that would go over ends the episode (stopped by limit)"""
    max_tool_response_chars: int = 256
    """a tool's output is cut in the middle to this many characters"""
    max_observation_chars: int = 8192
    """an environment's observation message is cut in the middle to this many characters (agent/obs_truncated)"""
    max_step_seconds: float = 120.0
    """an environment step that takes longer ends its episode (agent/env_errors/timeout; the step is abandoned); 0 = no limit;
    an env class with step_many (the tools) bounds its own steps"""
    self_play: bool = False
    """a two-player textarena game (--agent.env textarena:GAME-ID): the policy plays both seats, rows 2k and 2k+1 being
    seats 0 and 1 of one game, each credited with its own outcome; GRPO groups a prompt's rows by seat (docs/environments.md)"""


@dataclass
class Episode:
    """One trajectory as it grows: response ids, their mask (1 sampled, 0 tool) and rollout log-probs."""

    prompt: list[int]
    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    tool_timeouts: int = 0
    tool_time: float = 0.0
    stopped_by_limit: bool = False
    env_errors: int = 0  # steps whose env raised or returned something malformed (the episode ended there)
    env_error: str = ""  # why: one of ENV_ERRORS (raised, malformed, timeout, nonfinite_reward); "" = none
    obs_truncated: int = 0  # observation messages cut to --agent.max-observation-chars
    done: bool = False
    reward: float = 0.0  # the sum of the env's step rewards
    turn_of: list[int] = field(default_factory=list)  # per response id: the assistant turn (0, 1, ...) it was sampled in; -1 not sampled
    turn_rewards: list[float] = field(default_factory=list)  # per turn: the env's reward for it (0 for a turn no step followed)
    turn_obs: list[int] = field(default_factory=list)  # per turn: a hash of the observation it answered (step groups)
    env_reward: bool = False  # whether the env gives rewards (then `reward` is added to the scorer's)
    seat: int = -1  # self-play: the seat (0, 1) this episode played; -1 = not a two-player game

    def append(self, ids: list[int], sampled: bool, log_probs: list[float] | None = None) -> None:
        self.ids += ids
        self.mask += [int(sampled)] * len(ids)
        self.log_probs += log_probs if log_probs is not None else [0.0] * len(ids)
        self.turn_of += [self.turns if sampled else -1] * len(ids)  # (turns counts the turns before this one)

    def finish(self, by_limit: bool) -> None:
        self.done, self.stopped_by_limit = True, by_limit


# sample(contexts, max_new_tokens) -> per context (sampled ids ending with an EOS if the turn ended, their log-probs)
Sampler = Callable[[list[list[int]], list[int]], list[tuple[list[int], list[float]]]]

_PROBE = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]


def tool_suffix_ids(tokenizer, tool_messages: list[dict], eos_text: str) -> list[int]:
    """The ids that follow an assistant turn ending in `eos_text`: the tool messages and the next generation prompt.

    Renders a fixed probe conversation with and without the tool messages (TRL's method) and keeps the
    difference after the probe's last `eos_text`; only that text is tokenized. Raises ConfigError when
    the template does not simply append (it rewrites earlier turns).
    """
    before = tokenizer.apply_chat_template(_PROBE, tokenize=False)
    after = tokenizer.apply_chat_template(_PROBE + tool_messages, tokenize=False, add_generation_prompt=True)
    cut = before.rfind(eos_text)
    if cut < 0 or after[: cut + len(eos_text)] != before[: cut + len(eos_text)]:
        raise ConfigError(
            f"the chat template of {tokenizer.name_or_path} does not end an assistant turn with {eos_text!r} and append "
            "the tool messages after it; multi-turn rollouts need an append-only template"
        )
    return tokenizer(after[cut + len(eos_text) :], add_special_tokens=False)["input_ids"]


def run_turns(
    sample: Sampler,
    prompts: list[list[int]],
    tokenizer,
    tools: Tools,
    cfg: AgentConfig,
    max_response_tokens: int,
    eos: list[int],
    parse=parse_hermes,
    make_env=None,
    rows: list[dict] | None = None,
) -> list[Episode]:
    """The turn loop (module docstring) for a batch of prompts; every active episode samples its turn together.

    Each episode drives its own Env (rlkit/envs.py), made by `make_env()` (default: a ToolEnv on `tools`) and reset on
    its row of `rows` (data_source, ground_truth, extra_info, prompt). An env whose first observation differs from the
    row's prompt gets that observation rendered by the chat template as its prompt (Episode.prompt).

    Self-play (a factory with `seats == 2`, --agent.self-play): rows 2k and 2k+1 are seats 0 and 1 of one game
    (`make_env.pair()`). A seat whose env is `waiting` (the other seat is to move) is not sampled; once it is to move
    again, `env.observe()` gives what it has not seen (the other's move) as its step result would, and the game's end
    its own outcome. A seat that has not moved yet gets its prompt then (the first move is part of it). An episode that
    ends before its game does (a limit, an env error) calls `env.leave(error)`: the game ends for the other seat too."""
    if make_env is None:
        make_env = EnvFactory("tools", tools, cfg.max_turns, cfg.max_tool_calls, parse)
    rows = rows if rows is not None else [{}] * len(prompts)
    episodes = [Episode(list(p)) for p in prompts]
    envs = make_envs(make_env, len(prompts))
    firsts: dict[int, list[dict]] = {}  # self-play: a seat that waits for the first move -> its first observation so far
    pending: dict[int, list[int]] = {}  # self-play: a seat that waits for the other's move -> the ids of its last turn
    errors: dict[int, str] = {}  # an episode's env error, for its env's leave()

    def set_prompt(e: Episode, first: list[dict], row: dict) -> None:
        e.turn_obs.append(obs_key(first))
        base = row.get("prompt")
        if base is not None and not isinstance(base, str) and first != list(base):  # the env shows its own first observation
            e.prompt = tokenizer(render_prompt(tokenizer, first, []), add_special_tokens=False)["input_ids"]

    def end(i: int, by_limit: bool) -> None:
        episodes[i].finish(by_limit)
        if hasattr(envs[i], "leave"):  # self-play: its game ends for the other seat too (a no-op when it is over)
            envs[i].leave(errors.get(i, ""))

    def settle(i: int, ids: list[int], obs: list[dict], reward: float, done: bool, error: str | None) -> None:
        """Episode i after the env's answer to its turn `ids`: end it, or append the observation for its next turn."""
        e = episodes[i]
        e.reward += reward
        e.turn_rewards[-1] += reward
        if error:  # the model's action broke the env (or the env broke): this episode ends here, the run goes on
            e.env_errors += 1
            e.env_error = error.split(":", 1)[0]  # its reason, one of ENV_ERRORS
            errors[i] = error
            if not _warned:
                _warned.append(error)
                logger.warning("an environment step failed (counted in agent/env_errors, the episode ends): %s", error)
            end(i, by_limit=False)
        elif done:
            end(i, by_limit=getattr(envs[i], "stopped_by_limit", False))
        elif e.turns >= cfg.max_turns:
            end(i, by_limit=True)
        else:
            cut = [m for m in obs if len(m["content"]) > cfg.max_observation_chars]
            obs = [{**m, "content": truncate_middle(m["content"], cfg.max_observation_chars)} for m in obs]
            e.obs_truncated += len(cut)
            suffix = tool_suffix_ids(tokenizer, obs, tokenizer.convert_ids_to_tokens(ids[-1]))  # after the sampled end of turn
            if len(e.ids) + len(suffix) >= max_response_tokens:  # no room left to sample after the observation
                end(i, by_limit=True)
            else:
                e.append(suffix, False)
                e.turn_obs.append(obs_key(obs))  # what the next turn answers

    for i, (e, env, row) in enumerate(zip(episodes, envs, rows)):
        first = env.reset(row)
        if getattr(env, "waiting", False):
            firsts[i] = first
        else:
            set_prompt(e, first, row)
    while True:
        while ready := [i for i in (*firsts, *pending) if not getattr(envs[i], "waiting", False)]:  # self-play: this seat's turn
            i = ready[0]
            obs, reward, done, error = _checked(_call(envs[i].observe, cfg.max_step_seconds))
            if i in pending:
                settle(i, pending.pop(i), obs, reward, done, error)  # (may end the game: the other seat is ready then)
                continue
            first, e = firsts.pop(i), episodes[i]
            set_prompt(e, first + obs, rows[i])  # the first move is part of its prompt
            if error or done:  # the game ended before this seat moved: no turn to credit (its row trains nothing)
                e.reward, e.env_errors, e.env_error = reward, int(bool(error)), (error or "").split(":", 1)[0]
                end(i, by_limit=getattr(envs[i], "stopped_by_limit", False))
        if not (active := [i for i, e in enumerate(episodes) if not e.done and i not in pending and i not in firsts]):
            for i in (*firsts, *pending):  # waiting for a move that no episode will make (an env that never hands over)
                firsts.pop(i, None), pending.pop(i, None)
                episodes[i].env_errors, episodes[i].env_error = 1, "malformed"
                episodes[i].finish(by_limit=False)
            break
        outs = sample([episodes[i].prompt + episodes[i].ids for i in active], [max_response_tokens - len(episodes[i].ids) for i in active])
        stepping = []  # (row, its turn's ids): the turns that ended in an end-of-turn token; their env takes the action
        for i, (ids, log_probs) in zip(active, outs):
            e = episodes[i]
            e.append(ids, True, log_probs)
            e.turns += 1
            e.turn_rewards.append(0.0)  # the env's reward for this turn, if a step follows
            if not ids or ids[-1] not in eos:  # the token budget ran out inside the turn
                end(i, by_limit=True)
            else:
                stepping.append((i, ids))
        actions = [tokenizer.decode(ids[:-1]) for _, ids in stepping]  # the turn's text without its end-of-turn token
        steps = step_all([envs[i] for i, _ in stepping], actions, cfg.max_step_seconds)
        for (i, ids), (obs, reward, done, error) in zip(stepping, steps):
            if not (error or done) and getattr(envs[i], "waiting", False):  # self-play: the other seat moves next
                episodes[i].turn_rewards[-1] += reward
                episodes[i].reward += reward
                pending[i] = ids
            else:
                settle(i, ids, obs, reward, done, error)
    for e, env in zip(episodes, envs):
        for key in ENV_STATS:
            setattr(e, key, getattr(env, key, getattr(e, key)))
        e.env_reward = getattr(env, "gives_reward", False)
        e.seat = getattr(env, "seat", -1)
    return episodes


def make_envs(make_env, n: int) -> list:
    """One Env per episode: make_env() each, or in self-play (`make_env.seats == 2`) the seats of n / 2 games."""
    if getattr(make_env, "seats", 1) == 1:
        return [make_env() for _ in range(n)]
    if n % 2:
        raise ConfigError(
            f"--agent.self-play: rows 2k and 2k+1 are the two seats of a game, so a batch needs an even number of rows, got {n}"
        )
    return [seat for _ in range(n // 2) for seat in make_env.pair()]


def check_self_play(n: int) -> None:
    """--agent.self-play with --rollout.n n: n / 2 games per prompt, and each seat's group needs two or more of them."""
    if n < 4 or n % 2:
        raise ConfigError(
            f"--agent.self-play: --rollout.n {n}: the n samples of a prompt are n / 2 games, and each seat's "
            "GRPO group needs 2 or more of them: use an even n >= 4"
        )


def _call(fn, max_seconds: float = 0.0):
    """fn() within max_seconds, or the exception it raised (for _checked)."""
    try:
        return _within(max_seconds, fn)
    except Exception as e:
        return e


ENV_STATS = ("tool_calls", "tool_errors", "tool_timeouts", "tool_time")  # an env's own counters, copied to its Episode


ENV_ERRORS = ("raised", "malformed", "timeout", "nonfinite_reward")  # why an env step ended its episode: agent/env_errors/<reason>


def obs_key(messages: list[dict]) -> int:
    """A stable 48-bit hash of an observation's messages (the same in every process: Ray workers): step groups' anchor."""
    text = json.dumps(messages, sort_keys=True, default=str)
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=6).digest(), "little")


def _within(seconds: float, fn, *args):
    """fn(*args), or StepTimeout if it has not returned after `seconds` (0: no limit). The call runs on a daemon thread
    that is abandoned when late: a hung env cannot be killed from Python, but its episode ends and the run goes on."""
    if not seconds:
        return fn(*args)
    box: list = []

    def call():
        try:
            box.append((True, fn(*args)))
        except BaseException as e:  # handed to the caller
            box.append((False, e))

    t = threading.Thread(target=call, daemon=True, name="rlkit-env-step")
    t.start()
    t.join(seconds)
    if not box:
        raise StepTimeout(f"the step took more than --agent.max-step-seconds {seconds:g}")
    ok, value = box[0]
    if not ok:
        raise value
    return value


def step_all(envs: list, actions: list[str], max_seconds: float = 0.0) -> list[tuple[list[dict], float, bool, str | None]]:
    """Each env's step(action) -> (obs, reward, done, error), in order; an env class with `step_many(envs, actions)`
    steps all of its episodes at once (ToolEnv: every row's tool calls together). A step that raises, takes more than
    `max_seconds` (0: no limit), returns something other than (a list of messages with text content, a number, a
    flag), or a reward that is not finite, gives ([], 0.0, True, its error), the error starting with its reason
    (ENV_ERRORS) and a colon. The time limit runs each `step` on a thread of its own; `step_many` runs in this thread,
    unlimited: it bounds its own calls (ToolEnv: each tool's time limit), and a sandbox it starts must not be tied to a
    short-lived thread (PR_SET_PDEATHSIG fires when the thread that started a process ends)."""
    out: list = [None] * len(envs)
    by_class: dict = {}
    for k, env in enumerate(envs):
        by_class.setdefault(type(env), []).append(k)
    for cls, ks in by_class.items():
        step_many = getattr(cls, "step_many", None)
        try:
            if step_many:
                res = list(step_many([envs[k] for k in ks], [actions[k] for k in ks]))  # in this thread (below)
            else:
                res = [_step(envs[k], actions[k], max_seconds) for k in ks]
            if len(res) != len(ks):
                raise ValueError(f"{cls.__name__}.step_many gave {len(res)} results for {len(ks)} episodes")
        except Exception as e:
            res = [e] * len(ks)
        for k, r in zip(ks, res):
            out[k] = _checked(r)
    return out


def _step(env, action: str, max_seconds: float = 0.0):
    try:
        return _within(max_seconds, env.step, action)
    except Exception as e:
        return e


def _checked(res) -> tuple[list[dict], float, bool, str | None]:
    """A step's result as (obs, reward, done, None), or ([], 0.0, True, "<reason>: <error>") for an exception (raised,
    timeout), a malformed result (malformed) or a reward that is NaN or infinite (nonfinite_reward)."""
    if isinstance(res, Exception):
        return [], 0.0, True, f"{'timeout' if isinstance(res, StepTimeout) else 'raised'}: {type(res).__name__}: {str(res)[:200]}"
    try:
        obs, reward, done = res
        if not all(isinstance(m, dict) and isinstance(m.get("content"), str) for m in obs):
            raise TypeError("the observation must be a list of messages with text 'content'")
        obs, reward, done = list(obs), float(reward), bool(done)
    except Exception as e:
        return [], 0.0, True, f"malformed: {type(e).__name__}: {str(e)[:200]}"
    if not math.isfinite(reward):
        return [], 0.0, True, f"nonfinite_reward: the step's reward is {reward}"
    return obs, reward, done, None


EPISODE_STATS = ("turns", "tool_calls", "tool_errors", "tool_timeouts", "tool_time", "stopped_by_limit", "env_errors", "obs_truncated")


def _turns_of(mask: list[int]) -> list[int]:
    """An Episode built by hand (no turn_of): each run of sampled ids is a turn."""
    out, k, prev = [], -1, 0
    for m in mask:
        k += m and not prev
        out.append(k if m else -1)
        prev = m
    return out


def assemble_episodes(prompts: DataProto, episodes: list[Episode], width: int, pad_id: int) -> DataProto:
    """Episodes -> the rollout layout (rlkit.rollout.assemble) with holes, rollout_log_probs and per-row stats `agent_*`."""
    B = len(episodes)
    responses = torch.full((B, width), pad_id, dtype=torch.long)
    mask = torch.zeros((B, width), dtype=torch.long)
    real = torch.zeros((B, width), dtype=torch.long)  # 1 on every response token, sampled or tool
    log_probs = torch.zeros((B, width))
    turn = torch.full((B, width), -1, dtype=torch.long)  # the turn of each sampled token, -1 elsewhere
    turn_reward = torch.zeros((B, width))  # each turn's env reward, on the turn's last sampled token
    turn_obs = torch.zeros((B, width), dtype=torch.long)  # the hash of the observation each sampled token's turn answered
    for i, e in enumerate(episodes):
        n = len(e.ids)
        responses[i, :n] = torch.tensor(e.ids, dtype=torch.long)
        mask[i, :n] = torch.tensor(e.mask)
        real[i, :n] = 1
        log_probs[i, :n] = torch.tensor(e.log_probs)
        turn[i, :n] = torch.tensor(e.turn_of if len(e.turn_of) == n else _turns_of(e.mask), dtype=torch.long)
        for k, r in enumerate(e.turn_rewards):
            at = (turn[i] == k).nonzero()
            if len(at):
                turn_reward[i, at[-1]] = r
                turn_obs[i, at[:, 0]] = e.turn_obs[k]
    if any(e.prompt != ids[m.bool()].tolist() for e, ids, m in zip(episodes, prompts["input_ids"], prompts["attention_mask"])):
        padded, prompts = left_pad([e.prompt for e in episodes], pad_id), prompts.select(tensor_keys=[])  # an env's own first observation
        for key in ("input_ids", "attention_mask"):
            prompts[key] = padded[key]
    attn = torch.cat([prompts["attention_mask"], real], dim=1)
    out = prompts.select(tensor_keys=[])
    out["prompts"] = prompts["input_ids"]
    out["responses"] = responses  # (B, R) sampled and tool ids
    out["response_mask"] = mask  # (B, R) 1 sampled, 0 tool tokens and padding
    out["input_ids"] = torch.cat([prompts["input_ids"], responses], dim=1)
    out["attention_mask"] = attn
    out["position_ids"] = (attn.cumsum(-1) - 1).clamp(min=0)
    out["rollout_log_probs"] = log_probs * mask
    out["turn_index"] = turn  # (B, R) token-aligned, so mini- and micro-batches, packing and Ray shards keep them
    out["turn_reward"] = turn_reward  # (B, R)
    out["turn_obs"] = turn_obs  # (B, R)
    out["agent_tool_tokens"] = (real - mask).sum(-1).float()  # (B,)
    out["agent_seat"] = torch.tensor([float(e.seat) for e in episodes])  # (B,) self-play: the seat played, -1 none
    for key in EPISODE_STATS:
        out[f"agent_{key}"] = torch.tensor([float(getattr(e, key)) for e in episodes])
    for reason in ENV_ERRORS:
        out[f"agent_env_error_{reason}"] = torch.tensor([float(e.env_error == reason) for e in episodes])
    if any(e.env_reward for e in episodes):  # an environment's reward: rlkit.recipe.score adds it to the scorer's
        out["env_reward"] = torch.tensor([e.reward for e in episodes])  # (B,)
    return out


def generate_multi_turn(
    sample: Sampler,
    prompts: DataProto,
    tokenizer,
    tools: Tools,
    cfg: AgentConfig,
    max_response_tokens: int,
    eos: list[int],
    parse=parse_hermes,
    make_env=None,
) -> DataProto:
    """run_turns on a DataProto of left-padded prompts; returns assemble_episodes' layout (width max_response_tokens)."""
    contexts = [ids[m.bool()].tolist() for ids, m in zip(prompts["input_ids"], prompts["attention_mask"])]
    keys = [(k, "prompt" if k == "raw_prompt" else k) for k in ("data_source", "ground_truth", "extra_info", "raw_prompt") if k in prompts]
    rows = [{name: prompts[k][i] for k, name in keys} for i in range(len(contexts))]  # what each env's reset sees
    episodes = run_turns(sample, contexts, tokenizer, tools, cfg, max_response_tokens, eos, parse, make_env, rows)
    return assemble_episodes(prompts, episodes, max_response_tokens, tokenizer.pad_token_id)


def agent_metrics(batch: DataProto) -> dict:
    """Per-step tool-use metrics from the rows' agent_* stats."""
    mask = batch["response_mask"].float()
    calls = batch["agent_tool_calls"]
    return {
        "agent/turns/mean": batch["agent_turns"].mean().item(),
        "agent/turns/max": batch["agent_turns"].max().item(),
        "agent/tool_calls/mean": calls.mean().item(),
        "agent/tool_call_rate": (calls > 0).float().mean().item(),  # share of episodes that call a tool
        "agent/tool_errors/mean": batch["agent_tool_errors"].mean().item(),
        "agent/tool_timeouts/mean": batch["agent_tool_timeouts"].mean().item(),
        "agent/tool_time_s": batch["agent_tool_time"].sum().item(),
        "agent/stopped_by_limit": batch["agent_stopped_by_limit"].mean().item(),
        "agent/env_errors/mean": batch["agent_env_errors"].mean().item(),
        "agent/obs_truncated/mean": batch["agent_obs_truncated"].mean().item(),
        "agent/sampled_tokens/mean": mask.sum(-1).mean().item(),
        "agent/tool_tokens/mean": batch["agent_tool_tokens"].mean().item(),
        # episodes ended by an env fault, per reason (ENV_ERRORS)
        **{f"agent/env_errors/{r}": batch[f"agent_env_error_{r}"].sum().item() for r in ENV_ERRORS if f"agent_env_error_{r}" in batch},
    }


def turn_rewards(batch: DataProto, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-turn tables (B, T) from the batch's token-aligned turn tensors: rewards, the mask of turns that exist,
    and the observation keys. The scorer's part of each score (scores - env_reward) is added to the episode's last
    turn, so a row's turn rewards sum to its score (T = the batch's most turns)."""
    idx = batch["turn_index"]
    T = max(int(idx.max()) + 1, 1)
    onehot = (idx[:, :, None] == torch.arange(T)[None, None, :]).float()  # (B, R, T)
    exists = onehot.sum(1) > 0  # (B, T)
    rewards = torch.einsum("brt,br->bt", onehot, batch["turn_reward"].float())
    keys = batch["turn_obs"].gather(1, onehot.argmax(1)) * exists  # the key on each turn's first token
    last = (exists.long().cumsum(1) == exists.sum(1, keepdim=True)) & exists  # the last turn of each row
    rest = scores.float() - rewards.sum(1)  # the scorer's part
    rewards = rewards + last.float() * rest[:, None]
    return rewards, exists, keys


def turn_metrics(batch: DataProto, rewards: torch.Tensor, exists: torch.Tensor, advantages: torch.Tensor) -> dict:
    """Per turn index k (0, 1, ...): the mean reward, advantage (over its sampled tokens) and sampled length of the
    episodes that reached turn k."""
    idx, out = batch["turn_index"], {}
    for k in range(rewards.shape[1]):
        on = idx == k
        if not exists[:, k].any():
            continue
        out[f"agent/turn/{k}/reward"] = rewards[exists[:, k], k].mean().item()
        out[f"agent/turn/{k}/advantage"] = advantages[on].float().mean().item() if on.any() else 0.0
        out[f"agent/turn/{k}/length"] = on.sum(1)[exists[:, k]].float().mean().item()
    return out


def seat_groups(batch: DataProto):
    """The GRPO groups (uid) of a batch: in self-play (rows with agent_seat >= 0) a prompt's rows of one seat, so that a
    seat's outcome is compared with that seat's in the prompt's other games (the same role, the same opening), never
    with its own opponent's (zero-sum: the mirror of its own); else the uid as is."""
    uid = batch["uid"]
    if "agent_seat" not in batch or (batch["agent_seat"] < 0).all():
        return uid
    return np.array([f"{u}/seat{int(s)}" for u, s in zip(uid, batch["agent_seat"].tolist())], dtype=object)


def seat_metrics(batch: DataProto, scores: torch.Tensor) -> dict:
    """Self-play: each seat's mean outcome and the share of drawn (or unfinished) games; {} without seats."""
    if "agent_seat" not in batch or (batch["agent_seat"] < 0).all():
        return {}
    seat, scores = batch["agent_seat"], scores.float()
    return {
        "agent/seat0/reward": scores[seat == 0].mean().item(),  # the seat that moves first
        "agent/seat1/reward": scores[seat == 1].mean().item(),
        "agent/selfplay/draws": (scores[seat == 0] == 0).float().mean().item(),  # games with no winner: drawn, or no outcome
    }


# ----------------------------------------------------------------------------- backends


def left_pad(contexts: list[list[int]], pad_id: int) -> DataProto:
    """Token-id lists -> a DataProto of left-padded prompts (input_ids, attention_mask, position_ids)."""
    width = max(map(len, contexts))
    ids = torch.full((len(contexts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(contexts), width), dtype=torch.long)
    for i, c in enumerate(contexts):
        ids[i, width - len(c) :] = torch.tensor(c, dtype=torch.long)
        mask[i, width - len(c) :] = 1
    return DataProto.from_dict(tensors={"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0)})


def hf_sampler(
    rollout, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0, rows: Callable | None = None, drop_finished: float = 0.0
) -> Sampler:
    """A Sampler on rlkit.rollout.HFRollout: the contexts go in as ids, the sampled ids and log-probs come out.
    rows(prompts): rows per generate call (the worker's generation_rows: what fits in memory); None: all at once.
    drop_finished: --rollout.drop-finished (0 = off), the fast loop's."""
    extra = {"drop_finished": drop_finished} if drop_finished else {}

    def sample(contexts, max_new_tokens):
        prompts = left_pad(contexts, rollout.tokenizer.pad_token_id)
        out = rollout.generate(
            prompts, max(max_new_tokens), temperature, top_p, top_k, rows(prompts) if rows else None, return_log_probs=True, **extra
        )
        res = []
        for i, budget in enumerate(max_new_tokens):
            n = min(int(out["response_mask"][i].sum()), budget)
            res.append((out["responses"][i, :n].tolist(), out["rollout_log_probs"][i, :n].tolist()))
        return res

    return sample


def vllm_sampler(rollout, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0) -> Sampler:
    """A Sampler on rlkit.vllm_rollout.VLLMRollout: ids in (`prompt_token_ids`), ids and log-probs out, no text.
    Through VLLMRollout.sample: the engine awake, the LoRA adapter on."""

    def sample(contexts, max_new_tokens):
        params = [rollout.sampling_params(n, temperature, top_p, top_k) for n in max_new_tokens]  # a budget per row
        outs = rollout.sample([{"prompt_token_ids": c} for c in contexts], params)
        res = []
        for out in outs:
            s = out.outputs[0]
            ids = list(s.token_ids)
            res.append((ids, [s.logprobs[j][t].logprob for j, t in enumerate(ids)] if s.logprobs is not None else [0.0] * len(ids)))
        return res

    return sample


def sampler_for(
    rollout, temperature: float, top_p: float = 1.0, top_k: int = 0, rows: Callable | None = None, drop_finished: float = 0.0
) -> Sampler:
    """The Sampler of a rollout backend: VLLMRollout (vllm, has an engine `llm`) or HFRollout (hf, `rows` per call)."""
    if hasattr(rollout, "llm"):
        return vllm_sampler(rollout, temperature, top_p, top_k)
    return hf_sampler(rollout, temperature, top_p, top_k, rows, drop_finished)


@dataclass
class TurnLoop:
    """What a worker's generate() runs once set_agent(TurnLoop(...)) is called: the turn loop on that worker's rollout
    (hf or vllm) and tokenizer. Picklable, so that with --trainer.backend ray each worker runs it on its share of the rows."""

    tools: Tools
    agent_cfg: AgentConfig
    rollout_cfg: object  # RolloutConfig: temperature, top_p, top_k (validation's temperature: the worker's rollout_sys)
    max_response_length: int
    parse: Callable = parse_hermes
    make_env: Callable | None = None  # an EnvFactory (--agent.env); None: the tools

    def __call__(self, worker, prompts: DataProto, validate: bool = False) -> DataProto:
        r, s, rollout = self.rollout_cfg, worker.rollout_sys, worker.rollout
        rows = getattr(worker, "generation_rows", None)  # what fits in memory, as single-turn generation
        sample = sampler_for(rollout, s.val_temperature if validate else r.temperature, r.top_p, r.top_k, rows, s.drop_finished)
        return generate_multi_turn(
            sample, prompts, worker.tokenizer, self.tools, self.agent_cfg, self.max_response_length, rollout.eos, self.parse, self.make_env
        )


class AgentPolicy:
    """A policy worker group whose `generate` runs the turn loop (training and validation); every other call
    goes to the group. Local backend: the turn loop and the tools run in this process; ray: on each worker, on its
    share of the rows (TurnLoop, handed to the workers by set_agent)."""

    def __init__(self, policy, tools: Tools, agent_cfg: AgentConfig, rollout_cfg, max_response_length: int, parse=parse_hermes):
        if agent_cfg.max_turns < 1 or agent_cfg.max_tool_calls < 0:
            raise ConfigError(
                f"--agent.max-turns must be >= 1 and --agent.max-tool-calls >= 0, got {agent_cfg.max_turns}, {agent_cfg.max_tool_calls}"
            )
        if agent_cfg.self_play:
            check_self_play(rollout_cfg.n)
        self.policy, self.tools, self.agent_cfg = policy, tools, agent_cfg
        make_env = EnvFactory(
            agent_cfg.env, tools, agent_cfg.max_turns, agent_cfg.max_tool_calls, parse, agent_cfg.self_play
        )  # --agent.env
        self.turn_loop = TurnLoop(
            tools, agent_cfg, rollout_cfg, max_response_length, parse, make_env
        )  # (--trainer.async-steps: the worker's too)
        policy.set_agent(self.turn_loop)  # its generate() is now multi-turn

    def __getattr__(self, name):
        return getattr(self.policy, name)
