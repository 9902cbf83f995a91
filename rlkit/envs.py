"""Environments for multi-turn rollouts: `reset(row) -> first observation`, `step(action) -> observation, reward, done`.

The turn loop (`rlkit.agent.run_turns`) makes one Env per episode and drives it, token in / token out::

    messages = env.reset(row)               # the first observation: the prompt's messages (row: one dataset row)
    repeat:
        ids = sample(context)               # one assistant turn                                   mask 1
        obs, reward, done = env.step(decode(ids))
        done                -> episode over (its reward: the sum of the step rewards)
        suffix = the ids of `obs` + the next generation prompt, rendered by the chat template      mask 0
        context = context + ids + suffix

Only the text of the new observation messages is tokenized, never the conversation (rlkit.agent.tool_suffix_ids).
Kinds shipped here:

- `ToolEnv`: the tools of rlkit/tools.py as an environment (an action that calls tools gets their results back;
  one that does not is the answer). Its reward is 0: the dataset's scorer scores the answer, as before.
- `GuessEnv`: guess-the-number with "higher" / "lower" replies; reward 1 for finding it (the embedded demo,
  rlkit/demos.py).
- `GymTextEnv`: the adapter shape for a gymnasium-style text environment (`reset(seed, options) -> (obs, info)`,
  `step(action) -> (obs, reward, terminated, truncated, info)`, observations and actions as text).

An env whose `gives_reward` is true has its episode reward added to the scorer's (rlkit.recipe.score, from the
batch's `env_reward`); its dataset's data_source is then usually "rlkit/env", a scorer that gives 0.
An env class may define `step_many(envs, actions)` to step many episodes at once (ToolEnv runs every row's
sandboxed tool calls together); otherwise each episode's `step` is called in turn.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from rlkit.errors import ConfigError
from rlkit.rewards import register_scorer
from rlkit.tools import Tools, parse_hermes
from rlkit.userfn import load_function


@runtime_checkable
class Env(Protocol):
    """One episode of a multi-turn environment (a new instance per episode)."""

    def reset(self, row: dict) -> list[dict]:
        """Start the episode on a dataset row (data_source, ground_truth, extra_info, prompt: chat messages);
        return the first observation as chat messages (usually the row's prompt)."""
        ...

    def step(self, action: str) -> tuple[list[dict], float, bool]:
        """The model's turn as text (its end-of-turn token removed) -> (observation messages, reward, done)."""
        ...


@register_scorer("rlkit/env")
def env_score(data_source, solution_str, ground_truth, extra_info=None) -> float:
    """The scorer of datasets whose environment gives the reward (rlkit/envs.py): 0 here, the env's reward is added."""
    return 0.0


env_score.in_process = True


# ----------------------------------------------------------------------------- tools as an environment


class ToolEnv:
    """The tool-calling turn loop as an Env: an action with <tool_call>s gets the tools' results as `tool` messages,
    one without calls is the answer (done). Limits: max_turns assistant turns and max_tool_calls calls per episode;
    a turn over either ends the episode unrun (`stopped_by_limit`). Reward 0: the dataset's scorer scores the answer."""

    gives_reward = False

    def __init__(self, tools: Tools, max_turns: int, max_tool_calls: int, parse=parse_hermes):
        self.tools, self.max_turns, self.max_tool_calls, self.parse = tools, max_turns, max_tool_calls, parse
        self.turns = self.tool_calls = self.tool_errors = self.tool_timeouts = 0
        self.tool_time, self.stopped_by_limit = 0.0, False

    def reset(self, row: dict) -> list[dict]:
        return list(row.get("prompt") or [])

    def step(self, action: str) -> tuple[list[dict], float, bool]:
        return ToolEnv.step_many([self], [action])[0]

    @staticmethod
    def step_many(envs: list[ToolEnv], actions: list[str]) -> list[tuple[list[dict], float, bool]]:
        """Step every episode; the calls of all of them run at once (Tools.call_many: sandboxed ones in parallel), in row order."""
        out, calling = [None] * len(envs), []
        for i, (env, action) in enumerate(zip(envs, actions)):
            env.turns += 1
            calls = env.parse(action)
            if not calls:  # the answer
                out[i] = ([], 0.0, True)
            elif env.turns >= env.max_turns or env.tool_calls + len(calls) > env.max_tool_calls:
                env.stopped_by_limit = True
                out[i] = ([], 0.0, True)
            else:
                calling.append((i, env, calls))
        if calling:
            flat = calling[0][1].tools.call_many([c for _, _, calls in calling for c in calls])
            for i, env, calls in calling:
                results, flat = flat[: len(calls)], flat[len(calls) :]
                env.tool_calls += len(calls)
                env.tool_errors += sum(r.error for r in results)
                env.tool_timeouts += sum(r.timed_out for r in results)
                env.tool_time += sum(r.seconds for r in results)
                out[i] = ([{"role": "tool", "name": c.name, "content": r.text} for c, r in zip(calls, results)], 0.0, False)
        return out


# ----------------------------------------------------------------------------- guess the number


_INT = re.compile(r"-?\d{1,30}")  # a longer number is no guess (int() of 4,301+ digits raises ValueError)


class GuessEnv:
    """Guess a secret integer in [lo, hi] (row: ground_truth = the secret; extra_info lo, hi). Each guess is answered
    "higher: a to b" or "lower: a to b" (a..b: where the secret can still be, from all the replies so far); a reply
    that holds no number gets "a number please: a to b". Reward 1 for the right guess (done), else 0; the turn loop's
    --agent.max-turns bounds the guesses. Binary search finds any secret of 1..15 in 4 guesses."""

    gives_reward = True

    def reset(self, row: dict) -> list[dict]:
        info = row.get("extra_info") or {}
        self.secret, self.lo, self.hi = int(row["ground_truth"]), int(info.get("lo", 1)), int(info.get("hi", 15))
        self.guesses = 0
        return list(row["prompt"])

    def step(self, action: str) -> tuple[list[dict], float, bool]:
        m = _INT.fullmatch(action.strip())
        if m is None:
            return [{"role": "user", "content": f"a number please: {self.lo} to {self.hi}"}], 0.0, False
        guess = int(m.group())
        self.guesses += 1
        if guess == self.secret:
            return [], 1.0, True
        if guess < self.secret:
            self.lo = max(self.lo, guess + 1)
            return [{"role": "user", "content": f"higher: {self.lo} to {self.hi}"}], 0.0, False
        self.hi = min(self.hi, guess - 1)
        return [{"role": "user", "content": f"lower: {self.lo} to {self.hi}"}], 0.0, False


# ----------------------------------------------------------------------------- gymnasium-style text environments


class GymTextEnv:
    """Adapter: a gymnasium-style environment whose observations and actions are text, as an Env.

    `make()` builds the wrapped env (one per episode); it must have `reset(seed=None, options=None) -> (obs, info)` and
    `step(action) -> (obs, reward, terminated, truncated, info)`, with obs a string. The row's prompt is shown first,
    followed by the env's first observation as a user message when it is not empty; each later observation is a user
    message; `options` gets the row's ground_truth and extra_info (where a task's instance lives), `seed` the row's
    extra_info["seed"] if any. Rewards are summed over the episode. Servers (OpenEnv, Harbor, ...) fit the same shape
    behind a client object, but cannot be tested offline here: only in-process environments are tested.
    """

    gives_reward = True

    def __init__(self, make):
        self.env = make()

    def reset(self, row: dict) -> list[dict]:
        info = row.get("extra_info") or {}
        obs, _ = self.env.reset(seed=info.get("seed"), options={"ground_truth": row.get("ground_truth"), "extra_info": info})
        prompt = list(row.get("prompt") or [])
        return prompt + [{"role": "user", "content": str(obs)}] if obs else prompt

    def step(self, action: str) -> tuple[list[dict], float, bool]:
        obs, reward, terminated, truncated, _ = self.env.step(action)
        done = bool(terminated or truncated)
        return ([] if done or not obs else [{"role": "user", "content": str(obs)}]), float(reward), done


# ----------------------------------------------------------------------------- --agent.env


@dataclass
class EnvFactory:
    """Makes the Env of each episode from --agent.env: "tools" (ToolEnv on --agent.tools), "guess" (GuessEnv), or
    "path/file.py:make_env" / "module:make_env" (a callable returning a new Env per call). Picklable (Ray workers)."""

    name: str
    tools: Tools | None = None
    max_turns: int = 3
    max_tool_calls: int = 2
    parse: object = parse_hermes

    def __post_init__(self):
        if self.name not in ("tools", "guess") and ":" not in self.name:
            raise ConfigError(f"--agent.env {self.name!r}: choose tools, guess, or a factory as path/file.py:make_env")

    def __call__(self) -> Env:
        if self.name == "tools":
            return ToolEnv(self.tools, self.max_turns, self.max_tool_calls, self.parse)
        if self.name == "guess":
            return GuessEnv()
        env = load_function(self.name)()
        if not isinstance(env, Env):
            raise ConfigError(
                f"--agent.env {self.name}: the factory returned a {type(env).__name__}, which has no reset(row) and step(action)"
            )
        return env
