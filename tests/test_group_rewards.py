"""Group- and batch-level reward functions (@rlkit.rewards.batched): one call per group (uid) or per batch,
one score per response, in row order; sandboxed like every user function."""

from pathlib import Path

import pytest
import torch

from rlkit import recipe
from rlkit.errors import ConfigError, RunFailed
from rlkit.protocol import DataProto
from rlkit.rewards import RewardFn, batched

FIXTURE = Path(__file__).parent / "fixtures" / "group_reward.py"

# Two interleaved groups, a and b, truth 10 and 0. Group a: |10-9|=1, |10-13|=3, "x" = inf -> ranks 1, 1/2, 0.
# Group b: |0-0|=0, |0-5|=5 -> 1, 0. Rows stay in their places.
GROUPS = ["a", "b", "a", "b", "a"]
RESPONSES = ["9", "0", "13", "5", "x"]
TRUTHS = ["10", "0", "10", "0", "10"]
RANKS = [1.0, 1.0, 0.5, 0.0, 0.0]


@pytest.mark.parametrize("sandbox", ["auto", "off"])  # auto: a user file runs in the sandbox, one job per group
def test_group_ranking_reward_keeps_the_row_order(sandbox):
    reward = RewardFn(custom_fn=f"{FIXTURE}:rank_score", sandbox=sandbox)
    scores, metrics = reward("ds", RESPONSES, TRUTHS, groups=GROUPS)
    assert scores.tolist() == RANKS
    assert metrics == {"reward/k": (3 * 3 + 2 * 2) / 5}  # each row reports its group's size


def test_without_groups_each_row_is_its_own_group():
    scores, metrics = RewardFn(custom_fn=f"{FIXTURE}:rank_score")("ds", RESPONSES, TRUTHS)
    assert scores.tolist() == [1.0] * 5 and metrics == {"reward/k": 1.0}


def test_batch_level_reward_sees_every_row_once():
    # "7" appears 3 times: each agrees with 2 of the 4 others; "8" and "9" with none
    scores, _ = RewardFn(custom_fn=f"{FIXTURE}:agreement_score")("ds", ["7", "8", "7", "9", "7"], [""] * 5, groups=GROUPS)
    assert scores.tolist() == [0.5, 0.0, 0.5, 0.0, 0.5]


def test_group_reward_receives_the_prompts():
    prompts = [[{"role": "user", "content": c}] for c in ("p", "q", "p")]
    scores, _ = RewardFn(custom_fn=f"{FIXTURE}:prompt_echo_score")("ds", ["p", "x", "q"], [""] * 3, prompts=prompts, groups=[0, 1, 0])
    assert scores.tolist() == [1.0, 0.0, 0.0]


def test_wrong_number_of_scores_is_one_line_naming_the_fix():
    with pytest.raises(RunFailed) as info:
        RewardFn(custom_fn=f"{FIXTURE}:short_score")("ds", RESPONSES, TRUTHS, groups=GROUPS)
    message = str(info.value)
    assert "\n" not in message
    assert "short_score" in message and "returned 2 scores for 3 responses" in message and "one score per response" in message


def test_wrong_length_with_on_error_zero_zeroes_that_group_only():
    reward = RewardFn(custom_fn=f"{FIXTURE}:short_score", on_error="zero")
    scores, metrics = reward("ds", ["a", "b", "c"], ["", "", ""], groups=["g", "g", "h"])  # g: 1 score for 2; h: fine
    assert scores.tolist() == [0.0, 0.0, 1.0]
    assert metrics["reward/errors"] == 2.0


def test_a_callable_in_process_and_a_bad_level():
    @batched("batch")
    def longest(data_sources, solution_strs, ground_truths, extra_infos, groups, prompts):
        best = max(map(len, solution_strs))
        return torch.tensor([float(len(s) == best) for s in solution_strs])  # a tensor is accepted too

    scores, _ = RewardFn(custom_fn=longest)("ds", ["ab", "abc", "a"], [""] * 3)
    assert scores.tolist() == [0.0, 1.0, 0.0]
    with pytest.raises(ConfigError, match="choose 'group' or 'batch'"):
        batched("prompt")


def test_loop_score_hands_the_uids_to_the_reward():
    class Tok:  # decode_responses' needs: a pad id and batch_decode
        pad_token_id = 0

        def batch_decode(self, ids, skip_special_tokens=True):
            return [RESPONSES[int(row[0])] for row in ids]

    batch = DataProto.from_dict(
        tensors={"responses": torch.arange(5)[:, None], "response_mask": torch.ones(5, 1, dtype=torch.long)},
        non_tensors={
            "uid": GROUPS,
            "data_source": ["ds"] * 5,
            "ground_truth": TRUTHS,
            "extra_info": [None] * 5,
            "raw_prompt": [[{"role": "user", "content": "q"}]] * 5,
        },
    )
    scores, _ = recipe.score(batch, Tok(), RewardFn(custom_fn=f"{FIXTURE}:rank_score"))
    assert scores.tolist() == RANKS
