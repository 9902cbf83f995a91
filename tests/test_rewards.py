"""Tests for rlkit/rewards.py: built-in scorers, the registry, user-function loading, RewardFn, token placement."""

import sys
import threading
from pathlib import Path

import pytest
import torch

from rlkit.rewards import (
    SCORERS,
    RewardFn,
    arith_score,
    gsm8k_extract,
    gsm8k_flexible_score,
    gsm8k_lenient_score,
    gsm8k_score,
    load_function,
    math_score,
    register_scorer,
    token_level_rewards,
)

FIXTURE = Path(__file__).parent / "fixtures" / "my_reward.py"


def spec(name: str) -> str:
    return f"{FIXTURE}:{name}"


# ----------------------------------------------------------------------------- gsm8k
# Parity with verl v0.9.0 (tag 483b8a0) verl/utils/reward_score/gsm8k.py, compute_score(method="strict" | "flexible").
# Each expected value was worked out from verl's two regexes by hand; the same table was run once against
# verl's own compute_score (outside this repo) and agreed on every row.

PAD = "x" * 300  # verl reads only the last 300 characters


@pytest.mark.parametrize(
    "response, truth, expected",
    [
        ("She has 3 + 4 = 7 apples.\n#### 7", "7", 1.0),
        ("#### 8", "7", 0.0),
        ("The total is 1,234 dollars.\n#### 1,234", "1234", 1.0),  # "," removed from the answer
        ("#### 1234", "1,234", 0.0),  # ... but not from the ground truth (verl's preprocessing did that)
        ("#### -5", "-5", 1.0),
        ("#### 3.5", "3.5", 1.0),
        ("First guess #### 10, then corrected:\n#### 12", "12", 1.0),  # last match wins
        ("#### 12 ... no wait #### 10", "12", 0.0),
        ("The answer is 72.", "72", 0.0),  # no "#### " -> 0
        ("", "72", 0.0),
        ("#### 72.", "72", 0.0),  # captures "72." -> no match
        ("####72", "72", 0.0),  # exactly one space after ####
        ("####  72", "72", 0.0),
        ("#### $72", "72", 0.0),  # "$" is never captured, so verl's "$" strip never applies
        ("#### 72.0", "72", 0.0),  # string comparison, not numeric
        ("#### 7" + PAD, "7", 0.0),  # the answer lies before the last 300 characters
        ("#### 7" + PAD[:294], "7", 1.0),  # 6 + 294 = 300 characters: still read
    ],
)
def test_gsm8k_strict_as_verl(response, truth, expected):
    assert gsm8k_score("openai/gsm8k", response, truth) == expected


@pytest.mark.parametrize(
    "response, truth, expected",
    [
        ("The answer is 72", "72", 1.0),
        ("The answer is 72.", "72", 0.0),  # last number is "72." -> no match
        ("so 1,234 apples", "1234", 0.0),  # commas kept
        ("so 1,234 apples", "1,234", 1.0),
        ("#### 7\nstep 2.", "7", 0.0),  # "2." is the last number, beats the earlier "#### 7"
        ("I think 5 then 6 .", "6", 1.0),  # a lone "." is skipped
        ("#### -5", "-5", 1.0),
        ("no digits here", "1", 0.0),
        ("7" + PAD, "7", 0.0),  # outside the last 300 characters
    ],
)
def test_gsm8k_flexible_as_verl(response, truth, expected):
    assert gsm8k_flexible_score("rlkit/gsm8k-flexible", response, truth) == expected


def test_gsm8k_extract():
    assert gsm8k_extract("a #### 1,234 b #### 5,6") == "56"
    assert gsm8k_extract("nothing") is None
    assert gsm8k_extract("3 and 4.", "flexible") == "4."
    assert gsm8k_extract(". .", "flexible") == "."  # only dots: verl's loop ends on "."
    with pytest.raises(ValueError, match="strict"):
        gsm8k_extract("#### 1", "loose")


@pytest.mark.parametrize(
    "response, truth, expected",
    [
        ("She has 3 + 4 = 7 apples.\n#### 7", "7", 1.0),
        ("#### 8", "7", 0.0),
        ("The total is 1,234 dollars.\n#### 1,234", "1234", 1.0),
        ("#### 1234", "1,234", 1.0),  # ground truth is normalised the same way
        ("#### -5", "-5", 1.0),
        ("#### 5", "-5", 0.0),
        ("#### 3.5", "3.5", 1.0),
        ("First guess #### 10, then corrected:\n#### 12", "12", 1.0),  # last match wins
        ("#### 12 ... no wait #### 10", "12", 0.0),
        ("The answer is 72.", "72", 0.0),  # no "####" -> 0
        ("", "72", 0.0),
        ("#### 72.", "72", 1.0),  # trailing full stop stripped
        ("####72", "72", 1.0),
        ("#### 72.0", "72", 0.0),  # string comparison, not numeric
        ("#### 7" + PAD, "7", 1.0),  # reads the whole response
    ],
)
def test_gsm8k_lenient(response, truth, expected):
    assert gsm8k_lenient_score("rlkit/gsm8k-lenient", response, truth) == expected


# ----------------------------------------------------------------------------- math (math-verify)


def test_math_score_equivalent_forms():
    pytest.importorskip("math_verify")
    assert math_score("math", "So the answer is $\\boxed{\\frac{1}{2}}$.", "0.5") == 1.0
    assert math_score("math", "\\boxed{\\frac{1}{2}}", "0.5") == 1.0
    assert math_score("math", "\\boxed{0.5}", "\\frac{1}{2}") == 1.0
    assert math_score("math", "\\boxed{3}", "\\boxed{3}") == 1.0  # already-boxed ground truth is not re-wrapped


@pytest.mark.parametrize(
    "response, truth",
    [
        ("\\boxed{\\sqrt{2}}", "\\sqrt{2}"),
        ("\\boxed{2^{1/2}}", "\\sqrt{2}"),
        ("\\boxed{\\frac{\\sqrt{2}}{2}}", "\\frac{1}{\\sqrt{2}}"),
        ("\\boxed{3\\pi}", "3\\pi"),
        ("\\boxed{x^2 + 2x + 1}", "(x+1)^2"),
    ],
)
def test_math_score_ground_truths_beyond_fractions(response, truth):
    """Ground truths with roots, pi and polynomials are parsed as LaTeX (wrapped in $...$), not as plain text."""
    pytest.importorskip("math_verify")
    assert math_score("math", response, truth) == 1.0
    assert math_score("math", "\\boxed{2}", truth) == 0.0


def test_math_score_wrong_answer():
    pytest.importorskip("math_verify")
    assert math_score("math", "\\boxed{\\frac{1}{3}}", "0.5") == 0.0
    assert math_score("math", "I don't know.", "0.5") == 0.0


def test_math_score_works_outside_main_thread():
    # math-verify's default signal.alarm timeouts raise ValueError outside the main thread.
    pytest.importorskip("math_verify")
    results = []

    def work():
        try:
            results.append(math_score("math", "\\boxed{\\frac{1}{2}}", "0.5"))
            results.append(math_score("math", "\\boxed{7}", "0.5"))
        except Exception as e:  # surfaced in the main thread below
            results.append(e)

    t = threading.Thread(target=work)
    t.start()
    t.join()
    assert results == [1.0, 0.0]


def test_math_score_missing_package_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "math_verify", None)  # makes `import math_verify` fail
    with pytest.raises(ImportError, match="pip install math-verify"):
        math_score("math", "\\boxed{1}", "1")


# ----------------------------------------------------------------------------- arith


def test_arith_score():
    assert arith_score("rlkit/arith", "81", "81") == {"score": 1.0, "acc": 1.0}
    assert arith_score("rlkit/arith", "  81\n", "81") == {"score": 1.0, "acc": 1.0}
    assert arith_score("rlkit/arith", "81", 81) == {"score": 1.0, "acc": 1.0}
    assert arith_score("rlkit/arith", "82", "81") == {"score": 0.0, "acc": 0.0}
    assert arith_score("rlkit/arith", "The answer is 81", "81") == {"score": 0.0, "acc": 0.0}
    assert arith_score("rlkit/arith", "81.", "81") == {"score": 0.0, "acc": 0.0}
    assert arith_score("rlkit/arith", "", "81") == {"score": 0.0, "acc": 0.0}


# ----------------------------------------------------------------------------- registry


def test_registry_contents():
    for name in ("openai/gsm8k", "gsm8k"):
        assert SCORERS[name] is gsm8k_score
    assert SCORERS["rlkit/gsm8k-flexible"] is gsm8k_flexible_score
    assert SCORERS["rlkit/gsm8k-lenient"] is gsm8k_lenient_score
    for name in ("math", "lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500"):
        assert SCORERS[name] is math_score
    assert SCORERS["rlkit/arith"] is arith_score


def test_register_scorer_adds_and_refuses_conflicts():
    @register_scorer("test/const-a", "test/const-b")
    def const_score(data_source, solution_str, ground_truth, extra_info=None):
        return 0.25

    try:
        assert SCORERS["test/const-a"] is const_score and SCORERS["test/const-b"] is const_score
        scores, _ = RewardFn()(["test/const-a", "test/const-b"], ["x", "y"], ["", ""])
        assert scores.tolist() == [0.25, 0.25]
        with pytest.raises(ValueError, match="already scored by"):
            register_scorer("test/const-a")(gsm8k_score)
    finally:
        SCORERS.pop("test/const-a", None)
        SCORERS.pop("test/const-b", None)


def test_unknown_data_source_lists_registered_and_the_fix():
    with pytest.raises(ValueError) as info:
        RewardFn()(["no/such-dataset"], ["1"], ["1"])
    message = str(info.value)
    assert "no/such-dataset" in message
    assert "rlkit/arith" in message and "openai/gsm8k" in message and "HuggingFaceH4/MATH-500" in message
    assert "--reward.custom-fn path.py:fn" in message


def test_reward_fn_dispatches_on_data_source():
    scores, metrics = RewardFn()(
        ["rlkit/arith", "openai/gsm8k", "rlkit/arith"],
        ["5", "#### 6", "nope"],
        ["5", "6", "7"],
    )
    assert scores.dtype == torch.float32 and scores.shape == (3,)
    assert scores.tolist() == [1.0, 1.0, 0.0]
    assert metrics == {"reward/acc": 0.5}  # averaged over the two arith samples that report acc


def test_reward_fn_single_data_source_string_and_length_check():
    scores, _ = RewardFn()("rlkit/arith", ["1", "2"], ["1", "3"])
    assert scores.tolist() == [1.0, 0.0]
    with pytest.raises(ValueError, match="length mismatch"):
        RewardFn()(["rlkit/arith"], ["1", "2"], ["1", "2"])


# ----------------------------------------------------------------------------- load_function


def test_load_function_from_file():
    fn = load_function(spec("compute_score"))
    assert fn("any", " 4 ", "4") == {"score": 1.0, "acc": 1.0, "length": 3, "pred": "4"}


def test_load_function_relative_path(monkeypatch):
    monkeypatch.chdir(Path(__file__).parent)
    fn = load_function("fixtures/my_reward.py:compute_score")
    assert fn("any", "4", "5")["score"] == -1.0


def test_load_function_from_module():
    assert load_function("rlkit.rewards:gsm8k_score") is gsm8k_score


def test_load_function_missing_colon():
    with pytest.raises(ValueError, match='expected "path/to/file.py:function_name"'):
        load_function(str(FIXTURE))
    with pytest.raises(ValueError, match='expected "path/to/file.py:function_name"'):
        load_function(f"{FIXTURE}:")


def test_load_function_missing_file_names_absolute_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError) as info:
        load_function("rewards/nope.py:compute_score")
    assert str(tmp_path.resolve() / "rewards" / "nope.py") in str(info.value)


def test_load_function_missing_function_lists_defined_ones():
    with pytest.raises(ValueError) as info:
        load_function(spec("compute_scor"))
    message = str(info.value)
    assert "'compute_scor'" in message
    for name in ("compute_score", "raising_score", "none_score", "nan_score"):
        assert name in message
    assert "NOT_A_FUNCTION" not in message and "isnan" not in message  # only callables the file defines


def test_load_function_not_callable():
    with pytest.raises(ValueError, match="is a int, not a function"):
        load_function(spec("NOT_A_FUNCTION"))


def test_load_function_missing_module():
    with pytest.raises(ValueError, match="cannot import module 'no_such_pkg.rewards'"):
        load_function("no_such_pkg.rewards:fn")


# ----------------------------------------------------------------------------- RewardFn with user functions


def test_custom_fn_used_for_every_data_source_and_extras_averaged():
    reward = RewardFn(custom_fn=spec("compute_score"))
    scores, metrics = reward(["a", "b", "c", "d"], ["1", "2", "x", "4"], ["1", "2", "3", "5"])
    assert scores.tolist() == [1.0, 1.0, -1.0, -1.0]
    assert metrics == {"reward/acc": 0.5, "reward/length": 1.0}  # non-numeric "pred" is not a metric


def test_custom_fn_may_be_a_callable():
    scores, _ = RewardFn(custom_fn=lambda data_source, solution_str, ground_truth, extra_info=None: 3)(["x"], ["y"], ["z"])
    assert scores.tolist() == [3.0]


def test_extra_info_is_passed_through():
    seen = []

    def scorer(data_source, solution_str, ground_truth, extra_info=None):
        seen.append(extra_info)
        return 0.0

    RewardFn(custom_fn=scorer)(["a", "b"], ["", ""], ["", ""], extra_infos=[{"index": 0}, {"index": 1}])
    assert seen == [{"index": 0}, {"index": 1}]


def test_raise_policy_names_function_sample_and_data_source():
    reward = RewardFn(custom_fn=spec("raising_score"))
    with pytest.raises(RuntimeError) as info:
        reward(["ds/a", "ds/b"], ["fine", "the response"], ["1", "2"])
    message = str(info.value)
    assert "raising_score" in message and "my_reward" in message  # module:qualname
    assert "sample 0" in message and "'ds/a'" in message and "'fine'" in message
    assert "ZeroDivisionError: boom (in the sandbox)" in message
    with pytest.raises(RuntimeError) as info:  # in-process (trusted code only), the original error is the cause
        RewardFn(custom_fn=spec("raising_score"), sandbox="off")(["ds/a"], ["fine"], ["1"])
    assert isinstance(info.value.__cause__, ZeroDivisionError)


@pytest.mark.parametrize(
    "name, responses, bad_index, needle",
    [
        ("none_score", ["a", "b"], 0, "None"),
        ("nan_score", ["ok", "nan"], 1, "nan"),
    ],
)
def test_raise_policy_rejects_invalid_returns(name, responses, bad_index, needle):
    with pytest.raises(RuntimeError) as info:
        RewardFn(custom_fn=spec(name))(["ds"] * 2, responses, ["", ""])
    message = str(info.value)
    assert name in message and f"sample {bad_index}" in message and needle in message
    assert isinstance(info.value.__cause__, ValueError)


def test_raise_policy_rejects_dict_without_score():
    scorer = lambda data_source, solution_str, ground_truth, extra_info=None: {"acc": 1.0}  # noqa: E731
    with pytest.raises(RuntimeError, match="without a 'score' key"):
        RewardFn(custom_fn=scorer)(["ds"], ["a"], ["a"])


def test_raise_policy_rejects_non_numbers():
    scorer = lambda data_source, solution_str, ground_truth, extra_info=None: "1.0"  # noqa: E731
    with pytest.raises(RuntimeError, match="expected a number"):
        RewardFn(custom_fn=scorer)(["ds"], ["a"], ["a"])


def test_error_message_truncates_long_responses():
    with pytest.raises(RuntimeError) as info:
        RewardFn(custom_fn=spec("raising_score"))(["ds"], ["x" * 10_000], [""])
    assert "x" * 200 + "..." in str(info.value)
    assert "x" * 201 not in str(info.value)


def test_zero_policy_counts_errors():
    scores, metrics = RewardFn(custom_fn=spec("nan_score"), on_error="zero")(["ds"] * 3, ["ok", "nan", "nan"], [""] * 3)
    assert scores.tolist() == [1.0, 0.0, 0.0]
    assert metrics == {"reward/errors": 2.0, "reward/timeouts": 0.0}

    scores, metrics = RewardFn(custom_fn=spec("raising_score"), on_error="zero")(["ds"] * 2, ["a", "b"], ["", ""])
    assert scores.tolist() == [0.0, 0.0] and metrics["reward/errors"] == 2.0

    _, metrics = RewardFn(on_error="zero")(["rlkit/arith"], ["1"], ["1"])
    assert metrics == {"reward/acc": 1.0, "reward/errors": 0.0, "reward/timeouts": 0.0}


def test_zero_policy_still_rejects_unknown_data_source():
    with pytest.raises(ValueError, match="no reward function"):  # a config error, not a scoring error
        RewardFn(on_error="zero")(["no/such"], ["1"], ["1"])


def test_bad_on_error_value():
    with pytest.raises(ValueError, match="on_error"):
        RewardFn(on_error="ignore")


# ----------------------------------------------------------------------------- token_level_rewards


def test_token_level_rewards_on_last_valid_token():
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]])
    out = token_level_rewards(torch.tensor([0.5, -1.0, 2.0]), mask)
    expected = torch.tensor([[0.0, 0.0, 0.5, 0.0], [-1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    assert out.dtype == torch.float32
    assert torch.equal(out, expected)
    assert torch.equal(out.sum(-1), torch.tensor([0.5, -1.0, 0.0]))  # the empty row gets nothing


def test_token_level_rewards_full_row_and_mask_with_holes():
    mask = torch.tensor([[1, 1, 1, 1], [1, 0, 1, 0]], dtype=torch.bool)
    out = token_level_rewards(torch.tensor([1.0, 3.0]), mask)
    assert torch.equal(out, torch.tensor([[0.0, 0.0, 0.0, 1.0], [0.0, 0.0, 3.0, 0.0]]))


def test_token_level_rewards_shape_check():
    with pytest.raises(ValueError, match="shape"):
        token_level_rewards(torch.zeros(2), torch.ones(3, 4))


def test_a_hanging_user_function_is_stopped_by_the_time_limit():
    import time

    from rlkit.rewards import RewardFn

    fn = RewardFn(f"{FIXTURE}:hanging_score", timeout_s=0.2)
    start = time.perf_counter()
    with pytest.raises(RuntimeError, match=r"hanging_score failed on sample 0 .*no result after 0.2 s \(wall clock\)"):
        fn("rlkit/arith", ["12"], ["12"])
    assert time.perf_counter() - start < 2
    zero = RewardFn(f"{FIXTURE}:hanging_score", on_error="zero", timeout_s=0.1)
    scores, metrics = zero("rlkit/arith", ["1", "2"], ["1", "2"])
    assert scores.tolist() == [0.0, 0.0] and metrics["reward/errors"] == 2.0 and metrics["reward/timeouts"] == 2.0
    off = RewardFn(f"{FIXTURE}:hanging_score", timeout_s=0.2, sandbox="off")  # in-process: SIGALRM on the main thread
    with pytest.raises(RuntimeError, match=r"TimeoutError: no result after 0.2 s"):
        off("rlkit/arith", ["12"], ["12"])
    # counted in reward/timeouts in the trainer too (they were errors only: a doc audit found it)
    off_zero = RewardFn(f"{FIXTURE}:hanging_score", on_error="zero", timeout_s=0.1, sandbox="off")
    scores, metrics = off_zero("rlkit/arith", ["1", "2"], ["1", "2"])
    assert metrics["reward/errors"] == 2.0 and metrics["reward/timeouts"] == 2.0


def test_the_time_limit_is_for_the_users_function_not_the_built_in_scorers(monkeypatch):
    """--reward.timeout-s bounds a --reward.custom-fn run in this process; a built-in scorer keeps its own limits
    (math-verify sets its own SIGALRM, which ours would replace): one slower than the limit still scores."""
    import time

    from rlkit import rewards

    def slow_builtin(data_source, solution_str, ground_truth, extra_info=None):
        time.sleep(0.3)  # 6x the limit below: SIGALRM would interrupt this sleep with TimeoutError
        return 1.0

    monkeypatch.setitem(rewards.SCORERS, "test/slow", slow_builtin)
    scores, _ = rewards.RewardFn(timeout_s=0.05, sandbox="off")("test/slow", ["x"], ["x"])
    assert scores.tolist() == [1.0]
