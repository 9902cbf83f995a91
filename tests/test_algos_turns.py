"""Turn-level credit (rlkit/algos.py, recipes/grpo_tools.py --turn-credit): each estimator on hand-derived values, the
bias of per-turn-index normalisation (verl RFC #7244) against the leave-one-out per-turn baseline by exact
enumeration, and the turn tables read back from the token-aligned batch of a real turn loop (GuessEnv)."""

import itertools
import math

import pytest
import torch

from rlkit import agent, algos, envs
from rlkit.agent import AgentConfig

# Two groups. a: row 0 has 3 turns (rewards 0, 0.5, 1), row 1 two (0, 0), row 2 one (1); b: row 3 two (1, 0), row 4 one (0).
R = torch.tensor([[0.0, 0.5, 1.0], [0.0, 0.0, 0.0], [1.0, 0.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
E = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 0], [1, 0, 0]], dtype=torch.bool)
UID = ["a", "a", "a", "b", "b"]
# observations: every turn 0 answers the prompt (7); rows 0, 1 and 3 see observation 11 before turn 1; row 0 then 12
KEYS = torch.tensor([[7, 11, 12], [7, 11, 0], [7, 0, 0], [7, 11, 0], [7, 0, 0]])


def close(x, rows):
    assert x.shape == E.shape
    want = torch.tensor([r + [0.0] * (3 - len(r)) for r in rows])
    assert torch.allclose(x, want, atol=1e-4), x


def test_turn_returns_discount_backwards_within_each_episode():
    # gamma 0.5: row 0: G2 = 1, G1 = 0.5 + 0.5 * 1 = 1, G0 = 0 + 0.5 * 1 = 0.5
    close(algos.turn_returns(R, E, 0.5), [[0.5, 1.0, 1.0], [0, 0], [1.0], [1.0, 0.0], [0.0]])
    junk = R.clone()
    junk[1, 2] = junk[2, 1] = 5.0  # past an episode's last turn: never counted
    close(algos.turn_returns(junk, E, 0.5), [[0.5, 1.0, 1.0], [0, 0], [1.0], [1.0, 0.0], [0.0]])


def test_return_to_go_advantage_against_the_groups_episode_returns():
    # G0 of group a = 0.5, 0, 1: mean 0.5, unbiased std 0.5; group b = 1, 0: mean 0.5, std sqrt(0.5)
    close(algos.return_to_go_advantage(R, E, UID, 0.5, norm_by_std=False), [[0, 0.5, 0.5], [-0.5, -0.5], [0.5], [0.5, -0.5], [-0.5]])
    s = 0.5 / math.sqrt(0.5)
    close(algos.return_to_go_advantage(R, E, UID, 0.5), [[0, 1, 1], [-1, -1], [1], [s, -s], [-s]])


def test_return_to_go_with_gamma_1_and_a_final_reward_is_the_outcome_advantage():
    final = torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.0, 0.0], [1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    outcome = algos.grpo_advantage(final.sum(1), UID)
    assert torch.equal(algos.return_to_go_advantage(final, E, UID, 1.0), outcome[:, None] * E)


def test_step_group_advantage_gigpo():
    # gamma 1: G = row0 [1.5, 1.5, 1], row1 [0, 0], row2 [1], row3 [1, 0], row4 [0]
    # A^E (episode sums 1.5, 0, 1 | 1, 0): 2/3, -5/6, 1/6 | 1/2, -1/2
    # step groups: (a, 7): G 1.5, 0, 1 -> 2/3, -5/6, 1/6; (a, 11): 1.5, 0 -> 3/4, -3/4; (a, 12), (b, 11): one turn -> 0;
    # (b, 7): 1, 0 -> 1/2, -1/2
    adv = algos.step_group_advantage(R, E, UID, KEYS, gamma=1.0, norm_by_std=False)
    close(adv, [[4 / 3, 17 / 12, 2 / 3], [-5 / 3, -19 / 12], [1 / 3], [1.0, 1 / 2], [-1.0]])
    # omega 0: the episode advantage alone, on every turn
    close(algos.step_group_advantage(R, E, UID, KEYS, 1.0, 0.0, False), [[2 / 3] * 3, [-5 / 6] * 2, [1 / 6], [0.5] * 2, [-0.5]])


def test_per_turn_baseline_is_leave_one_out_per_turn_index():
    # gamma 0.5 (G as in test_turn_returns...): turn 0 of a: 0.5 - (0 + 1)/2 = 0, 0 - 0.75, 1 - 0.25;
    # turn 1 of a: 1 - 0, 0 - 1; turn 2 of a and turn 1 of b: no other row got there -> G itself (1, 0)
    close(algos.per_turn_baseline_advantage(R, E, UID, 0.5), [[0, 1, 1], [-0.75, -1], [0.75], [1, 0], [-1]])
    # the biased one: mean over the rows at turn k, itself included (singleton: mean 0, as grpo_advantage)
    close(algos.per_turn_index_advantage(R, E, UID, 0.5, norm_by_std=False), [[0, 0.5, 1], [-0.5, -0.5], [0.5], [0.5, 0], [-0.5]])


def expected_turn2_gradient(estimator, p1=0.5, p2=0.5) -> float:
    """E[A_01 d/dtheta2 log pi(a_2)] for row 0 of a group of 2, by enumerating both rows' episodes exactly.

    Each episode: turn 1 acts a1 ~ Bernoulli(p1); a1 = 0 ends it with reward 0; a1 = 1 gives reward 0 and a turn 2,
    a2 ~ Bernoulli(p2) (logit theta2), reward a2. The true gradient of J = p1 p2 in theta2 is p1 p2 (1 - p2)."""
    outcomes = [((0, None), 1 - p1), ((1, 0), p1 * (1 - p2)), ((1, 1), p1 * p2)]
    total = 0.0
    for (ep0, q0), (ep1, q1) in itertools.product(outcomes, outcomes):
        if ep0[1] is None:
            continue  # row 0 has no turn 2: no gradient for theta2
        rewards = torch.tensor([[0.0, float(ep[1] or 0)] for ep in (ep0, ep1)])
        exists = torch.tensor([[True, ep[1] is not None] for ep in (ep0, ep1)])
        adv = estimator(rewards, exists, ["g", "g"])
        total += q0 * q1 * adv[0, 1].item() * (ep0[1] - p2)
    return total


def test_per_turn_index_normalisation_is_biased_and_the_leave_one_out_baseline_is_not():
    truth = 0.5 * 0.5 * 0.5  # p1 p2 (1 - p2)
    # leave-one-out: row 1 without a turn 2 (1/2): A = G = a2 -> 1/2 * 1/2 * Var(a2) = 1/16;
    # both at turn 2 (1/4): A = a2 - a2' -> 1/4 * Var(a2) = 1/16; 1/16 + 1/16 = 1/8 = the truth
    assert expected_turn2_gradient(algos.per_turn_baseline_advantage) == pytest.approx(truth, abs=1e-12)
    # mean only, itself included: both at turn 2: A = (a2 - a2')/2 -> half of it: 1/16 + 1/32 = 3/32 < 1/8
    biased = expected_turn2_gradient(lambda r, e, u: algos.per_turn_index_advantage(r, e, u, norm_by_std=False))
    assert biased == pytest.approx(3 / 32, abs=1e-12)
    # and with the std: both at turn 2: A = sign(a2 - a2') / sqrt(2) -> 1/16 + 1/(16 sqrt 2) = 0.1067
    normed = expected_turn2_gradient(algos.per_turn_index_advantage)
    assert normed == pytest.approx(1 / 16 + 1 / (16 * math.sqrt(2)), abs=1e-5) and abs(normed - truth) > 0.01


def test_turn_token_advantages_put_each_turns_value_on_its_sampled_tokens():
    adv = torch.tensor([[1.0, -2.0], [3.0, 0.0]])
    idx = torch.tensor([[0, 0, -1, -1, 1, -1], [0, -1, -1, -1, -1, -1]])
    mask = (idx >= 0).long()
    out = algos.turn_token_advantages(adv, idx, mask)
    assert out.tolist() == [[1.0, 1.0, 0.0, 0.0, -2.0, 0.0], [3.0, 0.0, 0.0, 0.0, 0.0, 0.0]]


class Scripted:
    def __init__(self, turns):
        self.turns = list(turns)

    def __call__(self, contexts, max_new_tokens):
        ids = self.turns.pop(0)
        return [(ids[:b], [-0.5] * min(len(ids), b)) for b in max_new_tokens]


class Shaped(envs.GuessEnv):
    """GuessEnv with a shaped reward: 0.25 for each guess that is wrong."""

    def step(self, action):
        obs, reward, done = super().step(action)
        return obs, reward if done else 0.25, done


def test_the_turn_loop_batch_carries_turn_rewards_token_aligned_through_chunks():
    from transformers import AutoTokenizer

    from rlkit import demos

    tok = AutoTokenizer.from_pretrained(demos.ARITH_MODEL)
    eos = tok.eos_token_id
    t1, t2, t3 = (tok(x, add_special_tokens=False)["input_ids"] + [eos] for x in ("8", "12", "11"))
    prompt = [{"role": "user", "content": "Guess."}]
    row = {"prompt": prompt, "ground_truth": "11", "extra_info": {"lo": 1, "hi": 15}}
    rows = [row, {**row, "ground_truth": "8"}, {**row, "ground_truth": "12"}]
    eps = agent.run_turns(
        Scripted([t1, t2, t3]), [[5], [5], [5]], tok, None, AgentConfig(max_turns=4), 200, [eos], make_env=Shaped, rows=rows
    )
    assert [e.turn_rewards for e in eps] == [[0.25, 0.25, 1.0], [1.0], [0.25, 1.0]]
    assert eps[0].turn_obs[1] == eps[2].turn_obs[1] != eps[0].turn_obs[2]  # both saw "higher: 9 to 15" before turn 2
    batch = agent.assemble_episodes(agent.left_pad([[5]] * 3, tok.pad_token_id), eps, 200, tok.pad_token_id)
    assert batch["turn_index"][0][batch["response_mask"][0].bool()].unique().tolist() == [0, 1, 2]
    assert (batch["turn_index"] >= 0).long().equal(batch["response_mask"])  # every sampled token has its turn, no other
    scores = torch.tensor([1.5, 1.0, 1.25]) + torch.tensor([0.0, 0.0, 2.0])  # the env's sums; row 2's scorer adds 2
    rewards, exists, keys = agent.turn_rewards(batch, scores)
    assert rewards.tolist() == [[0.25, 0.25, 1.0], [1.0, 0.0, 0.0], [0.25, 3.0, 0.0]]  # the scorer's part on the last turn
    assert exists.tolist() == [[True] * 3, [True, False, False], [True, True, False]]
    assert keys[0, 1] == keys[2, 1] and keys[0, 0] == keys[1, 0] == keys[2, 0]
    # what the trainer's mini- and micro-batches see: any row split keeps each row's turns
    for part, s, lo in zip(batch.split(2), scores.split(2), (0, 2)):
        r, e, _ = agent.turn_rewards(part, s)
        assert (
            r.tolist() == rewards[lo : lo + len(s), : r.shape[1]].tolist() and e.tolist() == exists[lo : lo + len(s), : r.shape[1]].tolist()
        )
    m = agent.turn_metrics(batch, rewards, exists, algos.turn_token_advantages(rewards, batch["turn_index"], batch["response_mask"]))
    assert m["agent/turn/0/reward"] == pytest.approx(0.5) and m["agent/turn/2/reward"] == 1.0
    assert m["agent/turn/1/advantage"] == pytest.approx((0.25 + 3.0) / 2)  # rows 0 and 2 both said "12" at turn 1
    assert m["agent/turn/0/length"] == len(t1) and "agent/turn/3/reward" not in m


def test_grpo_tools_turn_credit_gives_turns_their_own_advantages_and_checks_gamma(tmp_path, monkeypatch):
    from test_grpo_recipe import load_recipe, small_config

    from rlkit.errors import ConfigError

    recipe = load_recipe("grpo_tools")
    cfg = small_config(recipe, tmp_path / "bad", steps=1, num_threads=1, save_freq=0, test_freq=0)
    cfg.turn_gamma = 1.5
    with pytest.raises(ConfigError, match="--turn-gamma 1.5"):
        recipe.main(cfg)
    seen = []
    original = algos.turn_token_advantages
    monkeypatch.setattr(algos, "turn_token_advantages", lambda *a: seen.append(original(*a)) or seen[-1])
    cfg = small_config(recipe, tmp_path / "run", steps=1, num_threads=1, save_freq=0, test_freq=0)
    guess = recipe.GuessConfig()  # what --agent.env guess starts from
    cfg.model, cfg.data.train_files, cfg.agent = guess.model, guess.data.train_files, guess.agent
    cfg.data.max_response_length, cfg.turn_credit = guess.data.max_response_length, "turn_baseline"
    cfg.system.data.val_files = []
    recipe.main(cfg)
    (adv,) = seen  # one training step
    assert any(len(set(row[row != 0].tolist())) > 1 for row in adv)  # some episode's turns got different advantages
    import json

    row = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    assert {"agent/turn/0/reward", "agent/turn/0/advantage", "agent/turn/0/length", "agent/env_errors/timeout"} <= set(row)
