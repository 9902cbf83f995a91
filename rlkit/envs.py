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
- `TextArenaEnv`, `SkyRLEnv`: the environments of two PyPI libraries, textarena (single-player text games) and
  skyrl-gym (`--agent.env textarena:GuessTheNumber-v0`, `--agent.env skyrl:gsm8k_multi_turn`; install words
  `textarena`, `skyrl` of scripts/install.sh).
- `TextArenaSeat`: self-play (--agent.self-play), one seat of a two-player textarena game (`TextArenaGame`); the turn
  loop plays a game's two seats as two episodes, sampling only the seat to move (`waiting`, `observe`, `leave`).

An env whose `gives_reward` is true has its episode reward added to the scorer's (rlkit.recipe.score, from the
batch's `env_reward`); its dataset's data_source is then usually "rlkit/env", a scorer that gives 0.
An env class may define `step_many(envs, actions)` to step many episodes at once (ToolEnv runs every row's
sandboxed tool calls together); otherwise each episode's `step` is called in turn.
"""

from __future__ import annotations

import importlib
import random
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
    that is not one bare integer ("I guess 7", "7." too) gets "a number please: a to b". Reward 1 for the right guess
    (done), else 0; the turn loop's --agent.max-turns bounds the guesses. Binary search finds any secret of 1..15 in 4
    guesses."""

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


# ----------------------------------------------------------------------------- environment libraries (PyPI)


LIBRARIES = {"textarena": ("textarena", "textarena==0.7.4"), "skyrl": ("skyrl_gym", "skyrl-gym==0.4.0")}
"""--agent.env LIB:ID -> (the module, the package scripts/install.sh LIB installs): the versions the adapters were tested with."""


def library(spec: str):
    """The module of --agent.env LIB:ID, imported; a ConfigError naming the install word when it is not installed."""
    lib = spec.split(":", 1)[0]
    module, package = LIBRARIES[lib]
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ConfigError(
            f"--agent.env {spec}: {package} is not installed ({e}); install it with `bash scripts/install.sh {lib}`"
        ) from None


class TextArenaEnv:
    """Adapter: a single-player textarena game as an Env (textarena 0.7: `make(id)`, `reset(num_players, seed)`,
    `get_observation() -> (player, observation)`, `step(action) -> (done, info)`, `close() -> (rewards, info)`).

    The row's prompt comes first, then the game's first observation as a user message; after each turn the game's new
    messages are one user message (a raw id, "...-raw", gives a list of messages: the player's own move, already in
    the context, is left out; a wrapped id gives its whole text so far: the part not shown yet is sent). The reward is
    the game's at its end (`close()`'s rewards[0]), 0 for the other steps and for a game the turn loop ends first.
    The game instance is drawn from the row's extra_info["seed"] (without one, every episode is a new random game);
    the game draws from a random stream of its own (textarena seeds Python's global `random`, which rlkit's checkpoints
    save: it is left as it was).
    Two-player games are played by `TextArenaSeat`s (--agent.self-play); more players are refused (EnvFactory)."""

    gives_reward = True

    def __init__(self, game_id: str):
        self.env, self.shown = library("textarena:" + game_id).make(game_id), ""
        self.rng = random.Random().getstate()  # the game's random stream (a fresh one until a seed is given)

    def _in_game(self, fn, **kwargs):
        """fn(**kwargs) on the game's random stream; Python's global one is put back."""
        outer = random.getstate()
        random.setstate(self.rng)
        try:
            return fn(**kwargs)
        finally:
            self.rng = random.getstate()
            random.setstate(outer)

    def reset(self, row: dict) -> list[dict]:
        self._in_game(self.env.reset, num_players=1, seed=(row.get("extra_info") or {}).get("seed"))
        prompt, obs = list(row.get("prompt") or []), self._observe()
        return prompt + [{"role": "user", "content": obs}] if obs else prompt

    def _observe(self) -> str:
        player, obs = self.env.get_observation()
        if isinstance(obs, str):  # a wrapper's text: the history so far
            new, self.shown = (obs[len(self.shown) :] if obs.startswith(self.shown) else obs), obs
            return new.strip()
        return "\n".join(str(m[1]) for m in obs if m[0] != player).strip()  # raw: (from_id, message, type)

    def step(self, action: str) -> tuple[list[dict], float, bool]:
        done, _ = self._in_game(self.env.step, action=action)
        if not done:
            obs = self._observe()
            return ([{"role": "user", "content": obs}] if obs else []), 0.0, False
        rewards, _ = self.env.close()
        return [], float((rewards or {}).get(0, 0.0)), True


class TextArenaGame:
    """One two-player textarena game shared by its two seats (`TextArenaSeat`, self-play): the game, its random
    stream, and how it ended. `left` is set when one seat's episode ended before the game did (the turn loop's limits,
    or an error: then its text), and the game is over for both, with no outcome."""

    def __init__(self, game_id: str):
        self.arena = TextArenaEnv.__new__(TextArenaEnv)  # its random stream and _in_game, not its one-player reset
        self.arena.env, self.arena.rng = library("textarena:" + game_id).make(game_id), random.Random().getstate()
        self.rewards: dict | None = None  # each seat's outcome, once the game is over
        self.left: str | None = None

    @property
    def over(self) -> bool:
        return self.rewards is not None or self.left is not None

    def to_move(self) -> int:
        return self.arena.env.state.current_player_id


class TextArenaSeat:
    """Self-play: one seat (0 or 1) of a two-player textarena game as an Env; the two seats of a game are two episodes
    (rows) of the turn loop, made together by `EnvFactory.pair()`, each with its own tokens and its own outcome.

    Seat 0 resets the game on its row (its extra_info["seed"]); seat 1 joins it (its own row is not read). While the other
    seat is to move, `waiting` is true and the turn loop does not sample this seat; `observe()` then gives what the seat
    has not seen yet (the other's move and the game's messages, as TextArenaEnv shows them: raw ids leave out the seat's
    own move) and, once the game is over, ([], this seat's reward, True): textarena's close(), +1 / -1 for a win / loss,
    0 for a draw (zero-sum), credited to the seat's last turn. A seat whose episode ends first (a limit, an error: the
    turn loop calls `leave`) ends the game for both with no outcome (reward 0; the other seat is stopped by a limit,
    or ends with the same env error)."""

    gives_reward = True

    def __init__(self, game: TextArenaGame, seat: int):
        self.game, self.seat, self.shown = game, seat, ""
        self.stopped_by_limit = False

    def reset(self, row: dict) -> list[dict]:
        """The row's prompt; the seat to move first also gets the game's first observation (the other one gets it,
        with the first move, from observe())."""
        if self.seat == 0:
            self.game.arena._in_game(self.game.arena.env.reset, num_players=2, seed=(row.get("extra_info") or {}).get("seed"))
        prompt = list(row.get("prompt") or [])
        if self.waiting:
            return prompt
        obs = self._observe()
        return prompt + [{"role": "user", "content": obs}] if obs else prompt

    @property
    def waiting(self) -> bool:
        """The other seat is to move (the game is not over)."""
        return not self.game.over and self.game.to_move() != self.seat

    def _observe(self) -> str:
        player, obs = self.game.arena.env.get_observation()
        assert player == self.seat, f"seat {self.seat} observed on seat {player}'s turn"
        if isinstance(obs, str):  # a wrapper's text: the history so far, this seat's
            new, self.shown = (obs[len(self.shown) :] if obs.startswith(self.shown) else obs), obs
            return new.strip()
        return "\n".join(str(m[1]) for m in obs if m[0] != self.seat).strip()

    def step(self, action: str) -> tuple[list[dict], float, bool]:
        """This seat's move. The game over: ([], its reward, True); the same seat to move again (an invalid move that
        textarena lets it retry): the game's reply; else ([], 0.0, False) and `waiting` (observe() later)."""
        if self.game.to_move() != self.seat:
            raise RuntimeError(f"seat {self.seat} moved on seat {self.game.to_move()}'s turn")
        done, _ = self.game.arena._in_game(self.game.arena.env.step, action=action)
        if done:
            rewards, _ = self.game.arena.env.close()
            self.game.rewards = dict(rewards or {})
            return [], float(self.game.rewards.get(self.seat, 0.0)), True
        if self.waiting:
            return [], 0.0, False
        obs = self._observe()
        return ([{"role": "user", "content": obs}] if obs else []), 0.0, False

    def observe(self) -> tuple[list[dict], float, bool]:
        """What happened since this seat's last move, once it is to move again or the game is over."""
        if self.game.left is not None:
            if self.game.left:  # the other seat's episode ended with an env error: the same one here
                error = self.game.left.split(":", 1)
                raise (StepTimeout if error[0] == "timeout" else RuntimeError)(f"the other seat: {error[-1].strip()}")
            self.stopped_by_limit = True  # the other seat's episode hit a limit: no outcome
            return [], 0.0, True
        if self.game.rewards is not None:
            return [], float(self.game.rewards.get(self.seat, 0.0)), True
        obs = self._observe()
        return ([{"role": "user", "content": obs}] if obs else []), 0.0, False

    def leave(self, error: str = "") -> None:
        """This seat's episode ended before the game did: the game ends for both, with no outcome."""
        if not self.game.over:
            self.game.left = error


class StepTimeout(Exception):
    """A step that ran past --agent.max-step-seconds (rlkit.agent counts it as agent/env_errors/timeout)."""


class SkyRLEnv:
    """Adapter: a skyrl-gym text environment as an Env (skyrl_gym 0.4: `make(id, env_config, extras)`,
    `init(prompt) -> (prompt, metadata)`, `step(action) -> {observations, reward, done, metadata}`, `close()`).

    Made at each reset from the row, as skyrl's own dataset rows feed it: extras = {reward_spec: {method: rule,
    ground_truth: the row's}, extra_info: the row's}, env_config = extra_info["env_config"] if any. Observations are
    chat messages already; rewards are per step (summed over the episode by the turn loop)."""

    gives_reward = True

    def __init__(self, env_id: str):
        self.env_id, self.skyrl, self.env = env_id, library("skyrl:" + env_id), None

    def reset(self, row: dict) -> list[dict]:
        from omegaconf import OmegaConf  # a dependency of skyrl-gym

        info = dict(row.get("extra_info") or {})
        extras = {"reward_spec": {"method": "rule", "ground_truth": row.get("ground_truth")}, "extra_info": info}
        self.env = self.skyrl.make(self.env_id, env_config=OmegaConf.create(info.get("env_config") or {}), extras=extras)
        prompt, _ = self.env.init(list(row.get("prompt") or []))
        return list(prompt)

    def step(self, action: str) -> tuple[list[dict], float, bool]:
        out = self.env.step(action)
        if out["done"]:
            self.env.close()
        return list(out["observations"]), float(out["reward"]), bool(out["done"])


def check_library_env(spec: str, self_play: bool = False) -> None:
    """--agent.env LIB:ID: the package is installed, ID is one of its environments and (textarena) a one-player game,
    or with self_play (--agent.self-play) a two-player one; else a one-line ConfigError."""
    lib, env_id = spec.split(":", 1)
    mod = library(spec)
    registry = mod.envs.registration.ENV_REGISTRY if lib == "textarena" else mod.registry
    if env_id not in registry:
        known = sorted(k for k in registry if not k.endswith(("-raw", "-train")))  # textarena: each id also has these two
        raise ConfigError(f"--agent.env {spec}: {env_id!r} is not a {lib} environment; known: {', '.join(known[:12])}, ...")
    if lib != "textarena":
        if self_play:
            raise ConfigError(f"--agent.self-play: needs a two-player textarena game (--agent.env textarena:GAME-ID), got {spec}")
        return
    players = None  # 1 or 2: the number the game starts with
    for n in (1, 2):
        try:
            if n == 1:
                TextArenaEnv(env_id).reset({})
            else:
                game = TextArenaGame(env_id)
                game.arena._in_game(game.arena.env.reset, num_players=2, seed=0)
            players = n
            break
        except AssertionError:  # textarena's states assert their number of players
            continue
        except Exception as e:  # e.g. a game whose word list must be downloaded (no network)
            why = next((line.strip() for line in str(e).splitlines() if line.strip(" *")), "")  # one line
            raise ConfigError(f"--agent.env {spec}: textarena could not start it offline: {type(e).__name__}: {why}") from None
    if players is None:
        raise ConfigError(
            f"--agent.env {spec}: a game for more than two players; rlkit plays one-player textarena games, and two-player "
            "ones with --agent.self-play"
        )
    if players == 2 and not self_play:
        raise ConfigError(
            f"--agent.env {spec}: a game for two players; add --agent.self-play (the policy plays both seats, docs/environments.md)"
        )
    if players == 1 and self_play:
        raise ConfigError(f"--agent.self-play: --agent.env {spec} is a one-player game; self-play needs a two-player one")


# ----------------------------------------------------------------------------- --agent.env


@dataclass
class EnvFactory:
    """Makes the Env of each episode from --agent.env: "tools" (ToolEnv on --agent.tools), "guess" (GuessEnv),
    "textarena:GAME-ID" (TextArenaEnv), "skyrl:ENV-ID" (SkyRLEnv), or "path/file.py:make_env" / "module:make_env" (a
    callable returning a new Env per call). Picklable (Ray workers)."""

    name: str
    tools: Tools | None = None
    max_turns: int = 3
    max_tool_calls: int = 2
    parse: object = parse_hermes
    self_play: bool = False  # --agent.self-play: a two-player textarena game, its seats made by pair()

    def __post_init__(self):
        if self.name not in ("tools", "guess") and ":" not in self.name:
            raise ConfigError(
                f"--agent.env {self.name!r}: choose tools, guess, textarena:GAME-ID, skyrl:ENV-ID, or a factory as path/file.py:make_env"
            )
        if self.name.split(":", 1)[0] in LIBRARIES:
            check_library_env(self.name, self.self_play)
        elif self.self_play:
            raise ConfigError(f"--agent.self-play: needs a two-player textarena game (--agent.env textarena:GAME-ID), got {self.name}")

    @property
    def seats(self) -> int:
        """Episodes per game: 2 in self-play (rows 2k, 2k+1 are seats 0 and 1 of one game), else 1."""
        return 2 if self.self_play else 1

    def pair(self) -> tuple[TextArenaSeat, TextArenaSeat]:
        """Self-play: the two seats of a new game."""
        game = TextArenaGame(self.name.split(":", 1)[1])
        return TextArenaSeat(game, 0), TextArenaSeat(game, 1)

    def __call__(self) -> Env:
        if self.name == "tools":
            return ToolEnv(self.tools, self.max_turns, self.max_tool_calls, self.parse)
        if self.name == "guess":
            return GuessEnv()
        lib, env_id = self.name.split(":", 1)
        if self.self_play:
            raise ConfigError("--agent.self-play: the seats of a game are made together, by EnvFactory.pair()")
        if lib in LIBRARIES:
            return TextArenaEnv(env_id) if lib == "textarena" else SkyRLEnv(env_id)
        env = load_function(self.name)()
        if not isinstance(env, Env):
            raise ConfigError(
                f"--agent.env {self.name}: the factory returned a {type(env).__name__}, which has no reset(row) and step(action)"
            )
        return env
