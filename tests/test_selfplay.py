"""Self-play (--agent.self-play): a two-player textarena game through the turn loop, the policy on both seats; each
seat's row holds its own tokens and observations and its own outcome; GRPO groups by seat; faults end the game's two
episodes, not the run; bad inputs are one line."""

import re
import threading
import time

import pytest
import torch
from transformers import AutoTokenizer

from rlkit import agent, algos, demos, envs
from rlkit.agent import AgentConfig
from rlkit.errors import ConfigError

pytest.importorskip("textarena", reason="textarena not installed: bash scripts/install.sh textarena")

GAME = "textarena:TicTacToe-v0-raw"  # raw: the game's messages; a seat's own move is not echoed back to it


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(demos.ARITH_MODEL)  # ChatML, byte-level BPE


def row(tag: str, seed: int = 0) -> dict:
    return {
        "prompt": [{"role": "system", "content": f"Game {tag}."}],
        "extra_info": {"seed": seed},
        "ground_truth": "",
        "data_source": "rlkit/env",
    }


class SeatPolicy:
    """A Sampler that reads each context's game tag and seat ("You are Player s") and plays that seat's next scripted
    move; it records the (game, seat) of every sampled turn, in order, and the context each saw."""

    def __init__(self, tok, moves: dict[tuple[str, int], list[str]]):
        self.tok, self.moves, self.order, self.seen = tok, {k: list(v) for k, v in moves.items()}, [], []

    def __call__(self, contexts, max_new_tokens):
        out = []
        for c, budget in zip(contexts, max_new_tokens):
            text = self.tok.decode(c)
            key = (re.search(r"Game (\w+)\.", text).group(1), int(re.search(r"You are Player (\d)", text).group(1)))
            self.order.append(key)
            self.seen.append((key, text))
            ids = self.tok(self.moves[key].pop(0), add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id]
            out.append((ids[:budget], [-0.5] * min(len(ids), budget)))
        return out


def play(tok, moves, rows, cfg=None, make=None, budget=4000):
    policy = SeatPolicy(tok, moves)
    make = make or envs.EnvFactory(GAME, self_play=True)
    cfg = cfg or AgentConfig(max_turns=6)
    eps = agent.run_turns(policy, [[5]] * len(rows), tok, None, cfg, budget, [tok.eos_token_id], make_env=make, rows=rows)
    return eps, policy


def sampled_text(tok, e) -> list[str]:
    """An episode's sampled turns as text (mask 1 runs, end-of-turn token dropped)."""
    turns, cur = [], []
    for t, m in zip(e.ids, e.mask):
        if m:
            cur.append(t)
        elif cur:
            turns.append(tok.decode(cur[:-1])), cur.clear()
    return turns + ([tok.decode(cur[:-1])] if cur else [])


def test_both_seats_play_each_row_holds_its_seats_tokens_and_outcome(tok):
    # game A: seat 0 (O) takes the diagonal 4, 0, 8 and wins; game B: seat 0 first sends no move (textarena lets it
    # retry), then seat 1 (X) takes the diagonal 4, 2, 6 and wins
    moves = {
        ("A", 0): ["[4]", "[0]", "[8]"],
        ("A", 1): ["[1]", "[2]"],
        ("B", 0): ["pass", "[0]", "[1]", "[8]"],
        ("B", 1): ["[4]", "[2]", "[6]"],
    }
    eps, policy = play(tok, moves, [row("A"), row("A"), row("B", 1), row("B", 1)])
    assert [e.seat for e in eps] == [0, 1, 0, 1]
    # the game's turn order: the seats alternate, an invalid move is retried by the same seat
    order = {g: [s for gg, s in policy.order if gg == g] for g in "AB"}
    assert order == {"A": [0, 1, 0, 1, 0], "B": [0, 0, 1, 0, 1, 0, 1]}
    # each row holds exactly its seat's sampled moves (mask 1), in order
    assert [sampled_text(tok, e) for e in eps] == [moves[k] for k in (("A", 0), ("A", 1), ("B", 0), ("B", 1))]
    assert all(all(not s.startswith("[") or len(s) == 3 for s in sampled_text(tok, e)) for e in eps)
    # the outcomes: textarena's +1 / -1, zero-sum, each on its seat's last turn
    assert [e.reward for e in eps] == [1.0, -1.0, -1.0, 1.0]
    assert [e.turn_rewards for e in eps] == [[0, 0, 1], [0, -1], [0, 0, 0, -1], [0, 0, 1]]
    assert all(e.done and not e.stopped_by_limit and e.env_error == "" for e in eps)
    # what each seat saw: its own prompt and the other's moves, never the other's prompt
    text = [tok.decode(e.prompt + e.ids) for e in eps]
    assert "You are Player 0" in text[0] and "You are Player 1" not in text[0]
    assert "You are Player 1" in text[1] and "You are Player 0" not in text[1]
    assert "Player 1 placed their symbol (X) in cell 1." in text[0]  # seat 1's move, in seat 0's observation (mask 0)
    first_obs = tok.decode(eps[0].ids[eps[0].mask.index(0) : eps[0].mask.index(1, eps[0].mask.index(0))])  # seat 0's
    # the other's move as it wrote it, then the game's words; the seat's own move is in its context already, not repeated
    assert "\n[1]\nPlayer 1 placed their symbol (X) in cell 1." in first_obs and "[4]\nPlayer 0 placed" not in first_obs
    assert "[4]\nPlayer 0 placed their symbol (O) in cell 4." in tok.decode(eps[1].prompt)  # seat 1 sees seat 0's move
    prompt1 = tok.decode(eps[1].prompt)  # seat 1's prompt: the first move is part of it
    assert "Game A." in prompt1 and "Player 0 placed their symbol (O) in cell 4." in prompt1 and eps[1].turns == 2
    assert "attempted an invalid move" in tok.decode(eps[2].ids) and "attempted an invalid move" not in tok.decode(
        eps[3].prompt + eps[3].ids
    )
    # the observation tokens are not sampled: every mask-1 id is one of the seat's own moves (checked above), the rest 0
    for e in eps:
        assert sum(e.mask) == sum(len(tok(m, add_special_tokens=False)["input_ids"]) + 1 for m in sampled_text(tok, e))


def test_seat_groups_compare_a_seat_with_the_same_seat_of_the_prompts_other_games(tok):
    # two games of one prompt (uid p below; tagged A and C for the script): seat 0 wins A, seat 1 wins C
    moves = {("A", 0): ["[4]", "[0]", "[8]"], ("A", 1): ["[1]", "[2]"], ("C", 0): ["[0]", "[1]", "[8]"], ("C", 1): ["[4]", "[2]", "[6]"]}
    eps, _ = play(tok, moves, [row("A"), row("A"), row("C"), row("C")])
    assert [e.reward for e in eps] == [1.0, -1.0, -1.0, 1.0]
    out = agent.assemble_episodes(agent.left_pad([[5]] * 4, tok.pad_token_id), eps, 4000, tok.pad_token_id)
    out["uid"] = ["p"] * 4  # one prompt
    assert out["agent_seat"].tolist() == [0.0, 1.0, 0.0, 1.0]
    uid = agent.seat_groups(out)
    assert list(uid) == ["p/seat0", "p/seat1", "p/seat0", "p/seat1"]
    scores = torch.tensor([e.reward for e in eps])
    adv = algos.grpo_advantage(scores, uid, norm_by_std=False)
    # seat 0: +1 vs -1 in its group (mean 0) -> +1, -1; seat 1 likewise; by the prompt alone every advantage would be
    # the score itself too (the mean of a zero-sum group is 0), but a seat's std and mean would mix in its opponent's
    assert adv.tolist() == [1.0, -1.0, -1.0, 1.0]
    m = agent.seat_metrics(out, scores)
    assert (m["agent/seat0/reward"], m["agent/seat1/reward"], m["agent/selfplay/draws"]) == (0.0, 0.0, 0.0)


def test_a_turn_limit_on_one_seat_ends_the_game_for_both_with_no_outcome(tok):
    moves = {("A", 0): ["[4]", "[0]"], ("A", 1): ["[1]", "[2]"]}
    eps, policy = play(tok, moves, [row("A"), row("A")], AgentConfig(max_turns=2))
    assert [s for _, s in policy.order] == [0, 1, 0, 1]
    assert [(e.reward, e.turns, e.stopped_by_limit, e.done) for e in eps] == [(0.0, 2, True, True), (0.0, 2, True, True)]


class Faulty(envs.EnvFactory):
    """The TicTacToe factory whose games raise (or hang) on their third move."""

    def __init__(self, how):
        super().__init__(GAME, self_play=True)
        self.how = how

    def pair(self):
        a, b = super().pair()
        inner, moves = a.game.arena.env.step, [0]

        def step(action):
            moves[0] += 1
            if moves[0] == 3:
                if self.how == "hang":
                    threading.Event().wait()
                raise ValueError("the board broke")
            return inner(action)

        a.game.arena.env.step = step
        return a, b


@pytest.mark.parametrize("how, reason", [("raise", "raised"), ("hang", "timeout")])
def test_a_game_that_raises_or_hangs_ends_its_two_episodes_with_the_reason_not_the_run(tok, how, reason):
    moves = {("A", 0): ["[4]", "[0]", "[8]"], ("A", 1): ["[1]", "[2]"]}
    made = iter([Faulty(how).pair(), envs.EnvFactory(GAME, self_play=True).pair()])
    make = type("F", (), {"seats": 2, "pair": staticmethod(lambda: next(made))})()
    moves |= {("B", 0): ["[4]", "[0]", "[8]"], ("B", 1): ["[1]", "[2]"]}
    start = time.monotonic()
    eps, _ = play(tok, moves, [row("A"), row("A"), row("B"), row("B")], AgentConfig(max_turns=6, max_step_seconds=0.5), make)
    assert time.monotonic() - start < 10  # the hung step is abandoned after 0.5 s
    assert [(e.env_error, e.env_errors, e.reward, e.done) for e in eps[:2]] == [(reason, 1, 0.0, True)] * 2
    assert eps[0].turns == 2 and eps[1].turns == 1  # seat 0's second move (the game's third) broke it
    assert [(e.env_error, e.reward) for e in eps[2:]] == [("", 1.0), ("", -1.0)]  # the other game is played out
    out = agent.assemble_episodes(agent.left_pad([[5]] * 4, tok.pad_token_id), eps, 4000, tok.pad_token_id)
    assert agent.agent_metrics(out)[f"agent/env_errors/{reason}"] == 2.0


def test_self_play_bad_inputs_are_one_line(tok):
    cases = {
        (
            "textarena:ThreePlayerTicTacToe-v0",
            True,
        ): "a game for more than two players; rlkit plays one-player textarena games, and two-player",
        ("textarena:ThreePlayerTicTacToe-v0", False): "a game for more than two players",
        ("textarena:TicTacToe-v0", False): "a game for two players; add --agent.self-play",
        ("textarena:GuessTheNumber-v0", True): "--agent.self-play: --agent.env textarena:GuessTheNumber-v0 is a one-player game",
        ("guess", True): "--agent.self-play: needs a two-player textarena game (--agent.env textarena:GAME-ID), got guess",
    }
    for (spec, self_play), msg in cases.items():
        with pytest.raises(ConfigError) as e:
            envs.EnvFactory(spec, self_play=self_play)
        assert msg in str(e.value) and "\n" not in str(e.value), str(e.value)
    with pytest.raises(ConfigError, match="an even number of rows, got 3$"):
        agent.make_envs(envs.EnvFactory(GAME, self_play=True), 3)
    for n in (2, 3, 5):
        with pytest.raises(ConfigError, match=f"^--agent.self-play: --rollout.n {n}: .* use an even n >= 4$"):
            agent.AgentPolicy(None, None, AgentConfig(env=GAME, self_play=True), type("R", (), {"n": n})(), 64)


def test_grpo_tools_one_step_in_self_play_on_the_embedded_model(tmp_path):
    """One GRPO step of recipes/grpo_tools.py with the policy on both seats of TicTacToe: 1 prompt x 4 samples = 2 games
    per prompt; the tiny model rarely writes a valid move, so most games end by textarena's invalid-move rule (the
    second invalid move loses: +1 / -1), which is still an outcome per seat."""
    import importlib.util
    import json
    from pathlib import Path

    import pandas as pd

    rows = [
        {"data_source": "rlkit/env", "prompt": [{"role": "user", "content": "Play."}], "ability": "game",
         "reward_model": {"style": "env", "ground_truth": ""}, "extra_info": {"seed": k}}
        for k in range(4)
    ]  # fmt: skip
    pd.DataFrame(rows).to_parquet(tmp_path / "ttt.parquet")
    spec = importlib.util.spec_from_file_location("recipe_grpo_tools", Path(__file__).resolve().parents[1] / "recipes" / "grpo_tools.py")
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    cfg = recipe.Config()
    import shutil

    model = tmp_path / "tiny-guess"  # the embedded model with a longer context in its config: textarena's rules are long
    shutil.copytree(demos.GUESS_MODEL, model)  # (a llama: RoPE, no learned positions, so only the config's number changes)
    conf = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**conf, "max_position_embeddings": 2048}))
    cfg.model.path = str(model)
    cfg.agent = AgentConfig(tools="", env=GAME, self_play=True, max_turns=3)
    cfg.data.train_files, cfg.system.data.val_files = [str(tmp_path / "ttt.parquet")], []
    cfg.data.max_response_length = 400  # the game's observations (board, moves) are ~200 tokens a turn with this tokenizer
    cfg.data.train_batch_size, cfg.actor.ppo_mini_batch_size, cfg.rollout.n = 1, 1, 4  # 2 games
    cfg.trainer.total_training_steps, cfg.system.trainer.test_freq, cfg.system.trainer.default_local_dir = 1, 0, str(tmp_path)
    recipe.main(cfg)
    last = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()][-1]
    assert last["step"] == 1
    # zero-sum: a finished game gives its seats +r and -r, an unfinished one 0 and 0, so the seats' means are opposite
    assert last["agent/seat0/reward"] == pytest.approx(-last["agent/seat1/reward"])
    assert 0 <= last["agent/selfplay/draws"] <= 1 and last["agent/turns/mean"] >= 1
    assert all(key in last for key in ("actor/pg_loss", "agent/env_errors/mean"))
