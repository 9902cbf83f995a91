"""Environments (rlkit/envs.py) on the turn loop: the Env protocol, GuessEnv, the gymnasium-style adapter, token in /
token out, the env's reward in the score; the embedded guess demo's data and model."""

import pickle
import threading
import time

import pytest
import torch
from transformers import AutoTokenizer

from rlkit import agent, demos, envs, recipe
from rlkit.agent import AgentConfig
from rlkit.errors import ConfigError
from rlkit.protocol import DataProto
from rlkit.rewards import RewardFn
from scripts.assets import tiny_guess

PROMPT = [{"role": "user", "content": "Guess my number, 1 to 15."}]
ROW = {"prompt": PROMPT, "ground_truth": "11", "extra_info": {"lo": 1, "hi": 15}, "data_source": "rlkit/env"}


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(demos.ARITH_MODEL)  # ChatML, byte-level BPE


def test_guess_env_replies_with_the_range_left_and_rewards_the_find():
    env = envs.GuessEnv()
    assert env.reset(ROW) == PROMPT
    assert env.step("8") == ([{"role": "user", "content": "higher: 9 to 15"}], 0.0, False)
    assert env.step(" 12\n") == ([{"role": "user", "content": "lower: 9 to 11"}], 0.0, False)
    assert env.step("twelve") == ([{"role": "user", "content": "a number please: 9 to 11"}], 0.0, False)
    assert env.step("3") == ([{"role": "user", "content": "higher: 9 to 11"}], 0.0, False)  # outside: the range stays
    assert env.step("11") == ([], 1.0, True)
    assert env.guesses == 4  # "twelve" is not a guess


def test_a_guess_too_long_for_int_is_no_guess():
    env = envs.GuessEnv()
    env.reset(ROW)
    assert env.step("9" * 5000) == ([{"role": "user", "content": "a number please: 1 to 15"}], 0.0, False)  # not ValueError
    assert env.guesses == 0


class Scripted:
    """A Sampler that plays fixed turns for every row (ids + log-probs -0.5) and records the contexts."""

    def __init__(self, turns):
        self.turns, self.contexts = list(turns), []

    def __call__(self, contexts, max_new_tokens):
        self.contexts.append(contexts)
        ids = self.turns.pop(0)
        return [(ids[:b], [-0.5] * min(len(ids), b)) for b in max_new_tokens]


def ids_of(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def test_turn_loop_drives_one_env_per_episode_token_in_token_out(tok):
    eos = tok.eos_token_id
    t1, t2 = ids_of(tok, "8") + [eos], ids_of(tok, "11") + [eos]
    rows = [ROW, {**ROW, "ground_truth": "8"}]  # the second finds it at once
    sampler = Scripted([t1, t2])
    eps = agent.run_turns(sampler, [[5, 6], [5, 6]], tok, None, AgentConfig(max_turns=4), 200, [eos], make_env=envs.GuessEnv, rows=rows)
    reply = ids_of(tok, "\n<|im_start|>user\nhigher: 9 to 15<|im_end|>\n<|im_start|>assistant\n")
    assert eps[0].ids == t1 + reply + t2  # sampled ids + the reply's ids, never re-tokenized
    assert eps[0].mask == [1] * len(t1) + [0] * len(reply) + [1] * len(t2)
    assert (eps[0].reward, eps[0].turns, eps[0].stopped_by_limit, eps[0].env_reward) == (1.0, 2, False, True)
    assert (eps[1].ids, eps[1].reward, eps[1].turns) == (t1, 1.0, 1)
    assert sampler.contexts[1] == [[5, 6] + t1 + reply]  # only the open episode samples again


def test_max_turns_ends_an_unsolved_game_with_reward_zero(tok):
    eos = tok.eos_token_id
    t = ids_of(tok, "1") + [eos]
    ep = agent.run_turns(Scripted([t] * 3), [[5]], tok, None, AgentConfig(max_turns=3), 200, [eos], make_env=envs.GuessEnv, rows=[ROW])[0]
    assert (ep.turns, ep.reward, ep.stopped_by_limit) == (3, 0.0, True)


class Countdown:
    """A gymnasium-style text env: say the numbers down from options' ground_truth to 1; +0.5 per right one."""

    def reset(self, seed=None, options=None):
        self.n = int(options["ground_truth"])
        return f"start at {self.n}", {}

    def step(self, action):
        right = action.strip() == str(self.n)
        self.n -= 1
        return f"now {self.n}", 0.5 * right, self.n == 0, False, {}


def test_gym_text_env_adapter_and_a_first_observation_of_its_own(tok):
    eos = tok.eos_token_id
    row = {"prompt": [{"role": "user", "content": "Count down."}], "ground_truth": "2", "extra_info": {}}
    env = envs.GymTextEnv(Countdown)
    first = env.reset(row)
    assert first == [row["prompt"][0], {"role": "user", "content": "start at 2"}]
    assert env.step("2") == ([{"role": "user", "content": "now 1"}], 0.5, False)
    assert env.step("7") == ([], 0.0, True)

    t2, t1 = ids_of(tok, "2") + [eos], ids_of(tok, "1") + [eos]
    sampler = Scripted([t2, t1])
    eps = agent.run_turns(sampler, [[5]], tok, None, AgentConfig(), 200, [eos], make_env=lambda: envs.GymTextEnv(Countdown), rows=[row])
    prompt = ids_of(tok, tok.apply_chat_template(first, add_generation_prompt=True, tokenize=False))
    assert eps[0].prompt == prompt and sampler.contexts[0] == [prompt]  # the env's first observation is the prompt
    assert eps[0].reward == 1.0
    prompts = agent.left_pad([[5]], tok.pad_token_id)
    out = agent.assemble_episodes(prompts, eps, 64, tok.pad_token_id)
    assert out["prompts"][0].tolist()[-len(prompt) :] == prompt and out["env_reward"].tolist() == [1.0]
    assert out["input_ids"].shape[1] == len(prompt) + 64


def test_env_factory_names_and_errors(tmp_path):
    assert isinstance(envs.EnvFactory("guess")(), envs.GuessEnv)
    assert isinstance(envs.EnvFactory("tools", max_turns=2)(), envs.ToolEnv)
    with pytest.raises(ConfigError, match="choose tools, guess, textarena:GAME-ID, skyrl:ENV-ID, or a factory"):
        envs.EnvFactory("chess")
    f = tmp_path / "my_env.py"
    f.write_text("def make_env():\n    return 42\n")
    with pytest.raises(ConfigError, match="has no reset"):
        envs.EnvFactory(f"{f}:make_env")()


def test_loop_score_adds_the_env_reward():
    class Tok:
        pad_token_id = 0

        def batch_decode(self, ids, skip_special_tokens=True):
            return ["x"] * len(ids)

    batch = DataProto.from_dict(
        tensors={
            "responses": torch.zeros(3, 1, dtype=torch.long),
            "response_mask": torch.ones(3, 1, dtype=torch.long),
            "env_reward": torch.tensor([1.0, 0.0, 1.0]),
        },
        non_tensors={"data_source": ["rlkit/env"] * 3, "ground_truth": ["1"] * 3, "extra_info": [None] * 3, "raw_prompt": [PROMPT] * 3},
    )
    scores, metrics = recipe.score(batch, Tok(), RewardFn())
    assert scores.tolist() == [1.0, 0.0, 1.0] and metrics["reward/env"] == pytest.approx(2 / 3)


def test_guess_demo_data_and_defaults():
    import datasets

    train = datasets.Dataset.from_parquet(str(demos.GUESS_DATA / "train.parquet"))
    val = datasets.Dataset.from_parquet(str(demos.GUESS_DATA / "val.parquet"))
    held_out = {r["reward_model"]["ground_truth"] for r in val}
    assert len(held_out) == 5 and not held_out & {r["reward_model"]["ground_truth"] for r in train}
    assert set(train["data_source"]) == {"rlkit/env"}
    # the mixed strategy's games: binary search finds every secret of 1..15 within 4 guesses
    import random

    assert all(tiny_guess.play(s, 1.0, random.Random(0))[-1] == s for s in range(1, 16))


def run_config(monkeypatch, *argv):
    """The config `python recipes/grpo_tools.py ARGV` runs with: the recipe as a script, stopped where main() starts."""
    import runpy
    import sys

    from test_grpo_recipe import ROOT

    class Parsed(Exception):
        pass

    def stop(cfg):
        raise Parsed(cfg)

    monkeypatch.setattr(recipe, "setup", stop)
    monkeypatch.setattr(sys, "argv", ["grpo_tools.py", *argv])
    with pytest.raises(Parsed) as e:
        runpy.run_path(str(ROOT / "recipes" / "grpo_tools.py"), run_name="__main__")
    return e.value.args[0]


def test_agent_env_guess_is_a_preset_and_explicit_flags_win(monkeypatch):
    """--agent.env guess starts from the guess demo's defaults (its model, data, no tools, 4 turns, 96 tokens), chosen
    before parsing: a flag given explicitly keeps its value even when it equals the tool demo's default."""
    cfg = run_config(monkeypatch, "--agent.env", "guess")
    assert (cfg.model.path, cfg.data.train_files, cfg.system.data.val_files) == (
        str(demos.GUESS_MODEL),
        [str(demos.GUESS_DATA / "train.parquet")],
        [str(demos.GUESS_DATA / "val.parquet")],
    )
    assert (cfg.agent.env, cfg.agent.tools, cfg.agent.max_turns, cfg.data.max_response_length) == ("guess", "", 4, 96)
    cfg = run_config(monkeypatch, "--agent.max-turns", "3", "--agent.env=guess", "--data.max-response-length", "64")
    assert (cfg.agent.max_turns, cfg.data.max_response_length, cfg.model.path) == (3, 64, str(demos.GUESS_MODEL))
    cfg = run_config(monkeypatch, "--agent.env", "guess", "--model", str(demos.CALC_MODEL), "--agent.tools", "calculator")
    assert (cfg.model.path, cfg.agent.tools) == (str(demos.CALC_MODEL), "calculator")
    cfg = run_config(monkeypatch)  # no preset: the tool demo
    assert (cfg.model.path, cfg.agent.env, cfg.agent.tools, cfg.agent.max_turns) == (str(demos.CALC_MODEL), "tools", "calculator", 3)


class Broken:
    """An env whose step fails on the model's text as a careless parser would (or returns something malformed)."""

    gives_reward = True

    def __init__(self, how):
        self.how = how

    def reset(self, row):
        return list(row["prompt"])

    def step(self, action):
        if self.how == "raise":
            return [], float(int(action.strip() * 5000)), True  # ValueError: the int-string limit
        if self.how == "huge":
            return [{"role": "user", "content": "x" * 10_000_000}], 0.25, False  # a 10 MB observation
        if self.how == "hang":
            threading.Event().wait()  # never returns
        if self.how in ("nan", "inf"):
            return [{"role": "user", "content": "go on"}], float(self.how), False
        return None  # malformed


@pytest.mark.parametrize(
    "how, reason",
    [("raise", "raised"), ("malformed", "malformed"), ("hang", "timeout"), ("nan", "nonfinite_reward"), ("inf", "nonfinite_reward")],
)
def test_an_env_step_that_fails_ends_that_episode_counted_and_the_rest_go_on(tok, how, reason):
    eos = tok.eos_token_id
    t = ids_of(tok, "8") + [eos]
    made = iter([Broken(how), envs.GuessEnv()])
    rows = [ROW, {**ROW, "ground_truth": "8"}]
    start = time.monotonic()
    cfg = AgentConfig(max_turns=4, max_step_seconds=0.5)  # a step that hangs is abandoned after 0.5 s
    eps = agent.run_turns(Scripted([t, t]), [[5], [5]], tok, None, cfg, 200, [eos], make_env=lambda: next(made), rows=rows)
    assert time.monotonic() - start < 5
    assert (eps[0].done, eps[0].env_errors, eps[0].reward, eps[0].stopped_by_limit, eps[0].env_error) == (True, 1, 0.0, False, reason)
    assert (eps[1].env_errors, eps[1].reward, eps[1].env_error) == (0, 1.0, "")
    out = agent.assemble_episodes(agent.left_pad([[5], [5]], tok.pad_token_id), eps, 200, tok.pad_token_id)
    m = agent.agent_metrics(out)
    assert m["agent/env_errors/mean"] == 0.5 and m[f"agent/env_errors/{reason}"] == 1.0
    assert sum(m[f"agent/env_errors/{r}"] for r in agent.ENV_ERRORS) == 1.0
    assert out["turn_reward"].sum(1).tolist() == [0.0, 1.0]  # the faulty step's reward is 0, not NaN


def test_a_slow_step_within_the_limit_is_kept_and_no_limit_means_none(tok):
    class Slow(envs.GuessEnv):
        def step(self, action):
            time.sleep(0.3)
            return super().step(action)

    eos = tok.eos_token_id
    t = ids_of(tok, "8") + [eos]
    for limit in (2.0, 0.0):
        ep = agent.run_turns(
            Scripted([t]),
            [[5]],
            tok,
            None,
            AgentConfig(max_step_seconds=limit),
            200,
            [eos],
            make_env=Slow,
            rows=[{**ROW, "ground_truth": "8"}],
        )[0]
        assert (ep.reward, ep.env_error) == (1.0, "")


def test_a_huge_observation_is_cut_and_counted(tok):
    eos = tok.eos_token_id
    t = ids_of(tok, "8") + [eos]
    start = time.monotonic()
    cfg = AgentConfig(max_turns=2, max_observation_chars=1000)
    ep = agent.run_turns(Scripted([t, t]), [[5]], tok, None, cfg, 2000, [eos], make_env=lambda: Broken("huge"), rows=[ROW])[0]
    assert time.monotonic() - start < 10 and ep.obs_truncated == 1 and ep.reward == 0.5
    assert 200 < ep.mask.count(0) < 1100  # the observation's tokens: ~1,000 characters of it


class Truncating(Countdown):
    def step(self, action):
        obs, reward, terminated, _, info = super().step(action)
        return obs, reward, terminated, True, info  # the time limit of a gymnasium TimeLimit wrapper


def test_gym_text_env_ends_on_truncated_too():
    env = envs.GymTextEnv(Truncating)
    env.reset({"prompt": [], "ground_truth": "5", "extra_info": {}})
    assert env.step("5") == ([], 0.5, True)


# ----------------------------------------------------------------------------- environment libraries (PyPI): textarena, skyrl-gym


GAME = [{"role": "system", "content": "Play the game."}]


def test_textarena_game_runs_through_the_turn_loop_and_its_end_reward_is_the_episodes(tok):
    pytest.importorskip("textarena", reason="textarena not installed: bash scripts/install.sh textarena")
    eos = tok.eos_token_id
    make = pickle.loads(pickle.dumps(envs.EnvFactory("textarena:GuessTheNumber-v0-raw")))  # raw: no wrapper; a Ray worker's copy
    assert isinstance(make(), envs.TextArenaEnv)
    row = {"prompt": GAME, "extra_info": {"seed": 3}, "ground_truth": "", "data_source": "rlkit/env"}  # seed 3: the secret is 8
    t1, t2 = ids_of(tok, "[10]") + [eos], ids_of(tok, "[8]") + [eos]
    eps = agent.run_turns(Scripted([t1, t2]), [[5]], tok, None, AgentConfig(max_turns=4), 200, [eos], make_env=make, rows=[row])
    reply = ids_of(tok, "\n<|im_start|>user\nThe target number is lower.<|im_end|>\n<|im_start|>assistant\n")  # no echo of "[10]"
    assert eps[0].ids == t1 + reply + t2 and eps[0].mask == [1] * len(t1) + [0] * len(reply) + [1] * len(t2)
    assert (eps[0].reward, eps[0].turn_rewards, eps[0].turns, eps[0].env_reward) == (1.0, [0.0, 1.0], 2, True)
    prompt = tok.decode(eps[0].prompt)  # the row's prompt, then the game's first observation
    assert prompt.startswith(
        "<|im_start|>system\nPlay the game.<|im_end|>\n<|im_start|>user\nYou are Player 0. You are playing Guess The Number."
    )
    assert prompt.endswith("Enter your guess.<|im_end|>\n<|im_start|>assistant\n")


def test_textarena_wrapped_text_sends_only_what_is_new_and_a_lost_game_keeps_its_reward():
    pytest.importorskip("textarena", reason="textarena not installed: bash scripts/install.sh textarena")
    import random

    env = envs.EnvFactory("textarena:GuessTheNumber-v0")()  # the default wrappers: the whole history as one text
    random.seed(0)
    before = random.random()
    random.seed(0)
    first = env.reset({"prompt": GAME, "extra_info": {"seed": 3}})
    assert random.random() == before  # textarena seeded its own stream, not Python's
    assert first[:1] == GAME and first[1]["content"].startswith("[GAME] You are Player 0.")
    assert env.step("[10]") == ([{"role": "user", "content": "[Player] [10]\n[GAME] The target number is lower."}], 0.0, False)
    obs, reward, done = env.step("no guess")  # textarena's first invalid move: a warning
    assert (reward, done) == (0.0, False) and obs[0]["content"].startswith("[Player] [no guess]\n[GAME] You attempted an invalid move.")
    # the second ends the game with textarena's reward: 1 - |last guess - secret| / (20 - 1)
    assert env.step("still none") == ([], pytest.approx(1 - 2 / 19), True)


def test_skyrl_gym_env_runs_through_the_turn_loop_with_per_turn_rewards(tok):
    pytest.importorskip("skyrl_gym", reason="skyrl-gym not installed: bash scripts/install.sh skyrl")
    eos = tok.eos_token_id
    make = envs.EnvFactory("skyrl:gsm8k_multi_turn")
    assert isinstance(make(), envs.SkyRLEnv)
    row = {"prompt": [{"role": "user", "content": "6 * 7?"}], "ground_truth": "42", "extra_info": {}, "data_source": "rlkit/env"}
    t1, t2 = ids_of(tok, "#### 41") + [eos], ids_of(tok, "#### 42") + [eos]
    sampler = Scripted([t1, t2])
    ep = agent.run_turns(sampler, [[5, 6]], tok, None, AgentConfig(max_turns=4), 300, [eos], make_env=make, rows=[row])[0]
    ask = "Please provide your step-by-step reasoning, and also include a tentative numeric answer at the end in the exact format: '#### ANSWER'."
    reply = ids_of(tok, f"\n<|im_start|>user\n{ask}<|im_end|>\n<|im_start|>assistant\n")
    assert ep.ids == t1 + reply + t2 and ep.prompt == [5, 6]  # the row's prompt unchanged: init() returned it
    # skyrl's per-turn reward: 1 for the right answer, a format score of 0.2 / 5 turns for a wrong one in the format
    assert ep.turn_rewards == [pytest.approx(0.04), 1.0] and ep.reward == pytest.approx(1.04)
    assert (ep.turns, ep.stopped_by_limit, ep.env_reward) == (2, False, True)


def test_library_env_errors_are_one_line(monkeypatch):
    pytest.importorskip("textarena", reason="textarena not installed: bash scripts/install.sh textarena")
    pytest.importorskip("skyrl_gym", reason="skyrl-gym not installed: bash scripts/install.sh skyrl")
    cases = {
        "textarena:Nope-v0": "'Nope-v0' is not a textarena environment; known: 2048-v0,",
        "skyrl:nope": "'nope' is not a skyrl environment; known: aime, gsm8k, gsm8k_multi_turn,",
        "textarena:TicTacToe-v0": "a game for two players; add --agent.self-play (the policy plays both seats",
        "textarena:ThreePlayerTicTacToe-v0": "a game for more than two players; rlkit plays one-player textarena games, and two-player",
    }
    for spec, msg in cases.items():
        with pytest.raises(ConfigError, match=f"^--agent.env {spec}: ") as e:
            envs.EnvFactory(spec)
        assert msg in str(e.value) and "\n" not in str(e.value)
    for lib, module, word in (("textarena", "textarena", "textarena"), ("skyrl", "skyrl_gym", "skyrl")):
        monkeypatch.setitem(__import__("sys").modules, module, None)  # the package is missing
        with pytest.raises(
            ConfigError, match=f"^--agent.env {lib}:X: .* is not installed .*; install it with `bash scripts/install.sh {word}`$"
        ):
            envs.EnvFactory(f"{lib}:X")
    assert "textarena:GAME-ID" in str(pytest.raises(ConfigError, envs.EnvFactory, "nope").value)
