"""Evaluation: the estimators on hand-computed values, `python scripts/eval.py` end to end, and --trainer.val-n."""

import importlib.util
import json
import math
import sys
from fractions import Fraction
from pathlib import Path

import pytest

from rlkit import evaluation
from rlkit.evaluation import estimates, ks_for, maj_at_k, majority, pass_at_k
from rlkit.rewards import arith_score, gsm8k_flexible_score, gsm8k_lenient_score, gsm8k_score

# pass@k is a product of at most n float64 factors, each rounded once: relative error <= n * 2**-52 (~1e-13 for
# n = 500), so 1e-12 holds on any CPU; the hand values below are exact decimals.
TOL = 1e-12
ROOT = Path(__file__).resolve().parents[1]


def load_eval():
    """scripts/eval.py as a module (registered, as an import would: tyro reads its Config's annotations)."""
    if "rlkit_eval_script" not in sys.modules:
        spec = importlib.util.spec_from_file_location("rlkit_eval_script", ROOT / "scripts" / "eval.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod
        spec.loader.exec_module(mod)
    return sys.modules["rlkit_eval_script"]


def test_pass_at_k_hand_values():
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25, abs=TOL)
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5, abs=TOL)
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10, abs=TOL)  # 1 - C(3,2)/C(5,2) = 0.7
    assert pass_at_k(4, 0, 4) == 0.0 and pass_at_k(7, 0, 1) == 0.0  # no correct sample
    assert pass_at_k(4, 4, 1) == 1.0


def test_pass_at_k_is_one_when_every_subset_holds_a_correct_sample():
    """verl PR #7240: 1 correct of 4 samples is pass@4 = 1 (every 4-subset is all 4 samples); verl's bootstrap, drawing
    with replacement, reports 1 - (3/4)^4 = 0.684."""
    assert pass_at_k(4, 1, 4) == 1.0
    assert 1 - (3 / 4) ** 4 == pytest.approx(0.684, abs=1e-3)  # what sampling with replacement gives instead
    assert pass_at_k(10, 3, 8) == 1.0  # n - c = 7 < 8


@pytest.mark.parametrize("n", [1, 4, 16, 100, 500])
def test_pass_at_k_equals_the_binomial_formula_without_overflow(n):
    for c in sorted({0, 1, n // 3, n - 1, n}):
        for k in sorted({1, 2, n // 2, n} & set(range(1, n + 1))):
            exact = 1 - Fraction(math.comb(n - c, k), math.comb(n, k))  # integers: C(500, 250) ~ 1e149, no float
            assert pass_at_k(n, c, k) == pytest.approx(float(exact), rel=TOL, abs=TOL), (n, c, k)


def test_pass_at_k_refuses_impossible_counts():
    for n, c, k in [(4, 5, 1), (4, -1, 1), (4, 1, 0), (4, 1, 5)]:
        with pytest.raises(ValueError):
            pass_at_k(n, c, k)


def test_majority_breaks_ties_by_the_first_answer_and_ignores_missing_ones():
    assert majority(["a", "b", "b", "c"], [True, False, False, False]) is False  # "b" wins 2:1:1
    assert majority(["a", "b"], [True, False]) is True  # tie: "a" comes first
    assert majority(["b", "a"], [False, True]) is False  # the same votes in the other order: "b"
    assert majority([None, None, "x", "y"], [False, False, True, False]) is True  # None never votes
    assert majority([None, None], [True, True]) is False  # no answer: not correct


def test_maj_at_k_averages_disjoint_blocks_of_k():
    answers, correct = ["a", "b", "b", "c", "a"], [True, False, False, False, True]
    assert maj_at_k(answers, correct, 5) == 1.0  # "a" 2, "b" 2: a tie, "a" comes first (sample 0): correct
    assert maj_at_k(answers[:4], correct[:4], 4) == 0.0  # "b" 2 of 4
    assert maj_at_k(answers, correct, 2) == 0.5  # blocks [a,b] -> a (tie, first): 1; [b,c] -> b: 0; sample 4 unused
    assert maj_at_k(answers, correct, 1) == pytest.approx(2 / 5, abs=TOL)  # blocks of one sample: the share correct


def test_estimates_keys_and_values():
    correct = [[True, False, False, False], [True, True, False, True]]
    answers = [["1", "2", "2", "3"], ["5", "5", "6", "5"]]
    out = estimates(correct, answers)
    assert list(out) == ["mean@4", "pass@1", "pass@2", "pass@4", "maj@2", "maj@4"]
    assert out["mean@4"] == pytest.approx((1 / 4 + 3 / 4) / 2, abs=TOL)
    assert out["pass@1"] == pytest.approx(out["mean@4"], abs=TOL)  # pass@1 is the mean
    assert out["pass@2"] == pytest.approx((0.5 + (1 - 0)) / 2, abs=TOL)  # prompt 2: n - c = 1 < 2
    assert out["pass@4"] == 1.0
    # maj@2: prompt 1 blocks ["1","2"] -> "1" (correct), ["2","3"] -> "2" (wrong); prompt 2 ["5","5"] right, ["6","5"] -> "6" wrong
    assert out["maj@2"] == pytest.approx((0.5 + 0.5) / 2, abs=TOL)
    assert out["maj@4"] == pytest.approx((0 + 1) / 2, abs=TOL)  # "2" wins prompt 1, "5" prompt 2
    assert "maj@2" not in estimates(correct)  # no parsed answers: no maj@k
    assert ks_for(6) == [1, 2, 4, 6] and ks_for(1) == [1] and ks_for(8) == [1, 2, 4, 8]


def test_scorers_expose_the_answer_they_compare():
    assert gsm8k_score.answer("so #### 1,234") == "1234" and gsm8k_score.answer("no answer") is None
    assert gsm8k_flexible_score.answer("it is 18.") == "18."
    assert gsm8k_lenient_score.answer("####  1,234.") == "1234" and gsm8k_lenient_score("", "####  1,234.", "1234") == 1.0
    assert arith_score.answer(" 81\n") == "81" and arith_score.answer("  ") is None


def test_eval_command_end_to_end(tmp_path, capsys):
    """The embedded model on 4 val prompts x 4 samples: the printed numbers are the estimators of the jsonl's scores."""
    rlkit_eval = load_eval()
    cfg = rlkit_eval.Config(n=4, output=str(tmp_path / "s.jsonl"), num_threads=1)
    cfg.system.data.val_max_samples = 4
    metrics = rlkit_eval.main(cfg)
    rows = [json.loads(x) for x in (tmp_path / "s.jsonl").read_text().splitlines()]
    assert [(r["prompt_index"], r["sample_index"]) for r in rows] == [(p, s) for p in range(4) for s in range(4)]
    truths = [{r["ground_truth"] for r in rows if r["prompt_index"] == p} for p in range(4)]
    assert all(len(t) == 1 for t in truths) and len(set.union(*truths)) == 4  # each record under its own prompt (interleaved)
    for r in rows:  # the training reward, and its parsed answer
        assert r["score"] == arith_score("rlkit/arith", r["response"], r["ground_truth"])["score"]
        assert r["correct"] == (r["score"] >= 1.0) and r["answer"] == (r["response"].strip() or None)
    c = [sum(r["correct"] for r in rows if r["prompt_index"] == p) for p in range(4)]
    for k in (1, 2, 4):  # the binomial formula, by hand from the jsonl
        assert metrics[f"pass@{k}"] == pytest.approx(sum(1 - math.comb(4 - ci, k) / math.comb(4, k) for ci in c) / 4, abs=TOL)
    assert metrics["mean@4"] == pytest.approx(sum(c) / 16, abs=TOL) and metrics["score"] == pytest.approx(sum(c) / 16, abs=TOL)
    assert metrics == {"score": metrics["score"], **evaluation.from_records(rows, 4)}
    printed = capsys.readouterr().out
    for k, v in metrics.items():
        assert f"{k:<10} {v:.4f}" in printed


def test_eval_flags_match_the_recipes_and_mistakes_are_one_line():
    import tyro

    from rlkit.errors import ConfigError
    from rlkit.recipe import expand_aliases

    rlkit_eval = load_eval()

    args = expand_aliases(["--model", "m", "-n", "3", "--data.val-files", "a.parquet", "--rollout.temperature", "0.7"])
    cfg = tyro.cli(rlkit_eval.Config, args=args)
    assert (cfg.model.path, cfg.n, cfg.system.data.val_files, cfg.rollout.temperature) == ("m", 3, ["a.parquet"], 0.7)
    cases = [
        ({"n": 0}, "-n 0"),
        ({"rollout": rlkit_eval.RolloutConfig(temperature=0.0)}, "--rollout.temperature"),
        ({"system": rlkit_eval.EvalSystem(data=rlkit_eval.DataSystem(val_files=[]))}, "--data.val-files is empty"),
    ]
    for change, flag in cases:
        with pytest.raises(ConfigError, match=flag):
            rlkit_eval.check(rlkit_eval.Config(**change))


def test_training_validation_with_val_n(tmp_path):
    """--trainer.val-n 4 on the embedded model (2 steps, 4 val prompts): val/mean@4, pass@k, maj@k besides val/acc."""
    from test_grpo_recipe import load_recipe, read_jsonl, small_config

    grpo = load_recipe("grpo")
    cfg = small_config(grpo, tmp_path, steps=2, num_threads=1, val_n=4, save_freq=0)
    cfg.system.data.val_max_samples, cfg.data.train_batch_size, cfg.actor.ppo_mini_batch_size = 4, 4, 4
    grpo.main(cfg)
    rows = [r for r in read_jsonl(tmp_path / "metrics.jsonl") if "val/acc" in r]
    assert [r["step"] for r in rows] == [0, 2]
    for r in rows:
        assert {"val/score", "val/mean@4", "val/pass@1", "val/pass@2", "val/pass@4", "val/maj@2", "val/maj@4"} <= set(r)
        assert r["val/pass@1"] == pytest.approx(r["val/mean@4"], abs=TOL) and r["val/acc"] == pytest.approx(r["val/mean@4"], abs=1e-6)
        assert r["val/mean@4"] <= r["val/pass@2"] <= r["val/pass@4"]


def test_resume_accepts_another_val_n_and_checkpoints_saved_before_it():
    """--trainer.val-n changes what validation measures, not the run: a checkpoint saved with another value, or by an rlkit
    without the flag, resumes."""
    from test_grpo_recipe import load_recipe

    from rlkit import config
    from rlkit.checkpoint import check_config

    current = config.nested(config.flag_values(load_recipe("grpo").Config()))  # as recipe.Run saves it
    saved = json.loads(json.dumps(current, default=str))
    del saved["trainer"]["val_n"]  # an older checkpoint's config.json
    check_config(saved, current)
    saved["trainer"]["val_n"] = 8
    check_config(saved, current)


def test_an_unwritable_output_stops_before_the_model_loads(tmp_path, monkeypatch):
    """Issue #34 FAIL 11: --output where no file can be written (a folder, a path under a file) was a traceback after all
    the sampling, the samples lost; now one line before the model loads (root-proof: no permission bits involved)."""
    from rlkit import workers
    from rlkit.errors import ConfigError

    rlkit_eval = load_eval()

    monkeypatch.setattr(workers, "ActorRolloutRefWorker", lambda *a, **k: pytest.fail("the model loaded before --output was checked"))
    (tmp_path / "file").write_text("")
    for bad in (tmp_path, tmp_path / "file" / "s.jsonl"):
        with pytest.raises(ConfigError, match=rf"--output {bad}: cannot write there"):
            rlkit_eval.main(rlkit_eval.Config(n=2, output=str(bad), num_threads=1))


def test_no_parsed_answer_reports_no_maj_at_k():
    """maj@k exists only where some sample has a parsed answer: a scorer that parsed nothing is not a maj@k of 0."""
    correct = [[True, False, False, False], [True, True, False, True]]
    assert "maj@2" not in estimates(correct, [[None] * 4, [None] * 4])
    assert estimates(correct, [[None] * 4, ["5", "5", None, "5"]])["maj@4"] == 0.5  # prompt 1 has no answer: wrong


def test_chat_texts_greedy_and_sampled_on_the_shipped_model():
    """evaluation.chat_texts, the asset builders' sampling (a model in memory): greedy, the shipped tiny-arith answers
    its 512 held-out problems with its README's accuracy (0.295, measured when it was built); sampled, n texts per
    prompt, reproducible from the seed, decoded without the end-of-turn token."""
    import pandas as pd
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlkit import demos

    tok = AutoTokenizer.from_pretrained(demos.ARITH_MODEL)
    model = AutoModelForCausalLM.from_pretrained(demos.ARITH_MODEL).eval()
    val = pd.read_parquet(demos.ARITH_DATA / "val.parquet")
    prompts = [[dict(m) for m in p] for p in val["prompt"]]
    truth = [r["ground_truth"] for r in val["reward_model"]]
    greedy = evaluation.chat_texts(model, tok, prompts, max_new_tokens=6)
    assert len(greedy) == 512 and all(len(t) == 1 for t in greedy)
    assert sum(t.strip() == g for (t,), g in zip(greedy, truth)) / 512 == pytest.approx(0.295, abs=0.01)  # 151 of 512 here
    torch.manual_seed(0)
    sampled = evaluation.chat_texts(model, tok, prompts[:4], n=5, temperature=1.0, batch_size=3)
    torch.manual_seed(0)
    assert evaluation.chat_texts(model, tok, prompts[:4], n=5, temperature=1.0, batch_size=3) == sampled
    texts = [t for row in sampled for t in row]
    assert [len(row) for row in sampled] == [5] * 4 and len(set(texts)) > 4 and not any("<|im" in t for t in texts)
