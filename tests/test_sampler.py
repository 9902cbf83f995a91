"""--data.sampler difficulty: pass-rate memory, pool weights, exact resume, and its refusals."""

import pytest
import torch
from test_grpo_recipe import load_recipe, read_jsonl, small_config

from rlkit.config import AsyncConfig, DataConfig, System
from rlkit.data import DifficultySampler
from rlkit.errors import ConfigError


def test_record_keeps_each_groups_mean_and_counts_zero_variance_groups():
    s = DifficultySampler(10)
    s.draws = 1  # a batch was drawn
    # prompts 3, 5, 7 in groups of 4: 0/4, 2/4 and 4/4 right
    m = s.record([3] * 4 + [5] * 4 + [7] * 4, torch.tensor([0.0] * 4 + [1, 0, 1, 0] + [1.0] * 4))
    assert s.pass_rate == {3: 0.0, 5: 0.5, 7: 1.0}
    assert m["sampler/zero_var_share"] == 2 / 3  # all-wrong and all-right groups: no GRPO gradient
    assert (m["sampler/hard"], m["sampler/normal"], m["sampler/easy"], m["sampler/seen"]) == (1 / 3, 1 / 3, 1 / 3, 3)
    s.draws = 2
    s.record([5, 5], torch.tensor([1.0, 1.0]))  # the latest group replaces the memory
    assert s.pass_rate[5] == 1.0
    assert [s.pool(p) for p in (0.0, 0.24, 0.25, 0.75, 0.76)] == [0, 0, 1, 1, 2]  # documented bounds


def test_zero_weight_pools_are_never_drawn_and_the_draws_follow_the_weights():
    s = DifficultySampler(8, weights=(0.0, 1.0, 0.0), seed=3)
    s.pass_rate = {0: 0.0, 1: 0.1, 2: 1.0, 3: 0.9}  # hard, hard, easy, easy; 4..7 unseen (normal)
    for _ in range(20):
        drawn = s.draw(4)
        s.recorded = s.draws
        assert sorted(drawn) == [4, 5, 6, 7]  # only the weighted prompts, each once per batch
    s = DifficultySampler(2, weights=(1.0, 3.0, 1.0), seed=0)
    s.pass_rate = {0: 0.0}  # prompt 0 hard (weight 1), prompt 1 unseen (weight 3): P(1 drawn) = 3/4
    ones = 0
    for _ in range(4000):
        ones += s.draw(1)[0]
        s.recorded = s.draws
    assert abs(ones / 4000 - 0.75) < 0.03  # binomial sd sqrt(.75*.25/4000) = 0.007: 4 sd


def test_state_dict_resumes_the_same_draws_and_an_unscored_batch_is_refused():
    a = DifficultySampler(50, seed=1)
    for step in range(3):
        rows = a.draw(5)
        a.record(rows, torch.tensor([float(step % 2)] * 5))
    b = DifficultySampler(50, seed=1)
    b.load_state_dict(a.state_dict())
    assert a.draw(5) == b.draw(5)
    with pytest.raises(ConfigError, match="the previous batch got no scores"):
        a.draw(5)  # drawn twice without a record: a recipe that scores nothing (sft.py, rm.py)


def test_a_resumed_grpo_run_equals_the_uninterrupted_one(tmp_path):
    grpo = load_recipe("grpo")

    def run(name, steps):
        cfg = small_config(grpo, tmp_path / name, steps=steps, num_threads=1, val_before_train=False, test_freq=0, resume="auto")
        cfg.system.data.val_max_samples = 8
        cfg.data.sampler = "difficulty"
        grpo.main(cfg)
        return read_jsonl(tmp_path / name / "metrics.jsonl")

    whole = run("whole", 4)
    run("split", 2)
    split = run("split", 4)  # resumes at step 2: the pass rates and the draw count come back
    keys = ("critic/score/mean", "sampler/zero_var_share", "sampler/seen", "sampler/hard", "actor/pg_loss")
    for w, s in zip(whole, split):
        assert w["step"] == s["step"]
        for k in keys:
            assert abs(w[k] - s[k]) < 1e-6, (w["step"], k, w[k], s[k])  # same draws and samples: rounding only
    state = [torch.load(tmp_path / n / "checkpoints" / "global_step_4" / "state.pt")["loader"] for n in ("whole", "split")]
    assert state[0] == state[1] and state[0]["sampler"]["draws"] == 4


def test_async_refuses_the_difficulty_sampler_in_one_line():
    from rlkit.preflight import check_async

    class Cfg:
        data = DataConfig(sampler="difficulty")
        system = System(async_rollout=AsyncConfig(async_steps=1))

    with pytest.raises(ConfigError, match="--data.sampler difficulty does not run with --trainer.async-steps 1"):
        check_async(Cfg())


def test_each_loader_takes_its_own_batches_scores_only_and_no_module_holds_the_samplers():
    """The feedback is the recipe's call train.record(batch, scores): two loaders in one process do not see each
    other's scores, a batch handed to the wrong loader is refused, and no module of rlkit keeps the samplers."""
    import sys
    from collections.abc import Mapping

    import numpy as np

    from rlkit.data import PromptLoader, PromptSet

    def loader():
        rows = np.array([None] * 6, dtype=object)
        prompts = PromptSet([[1, 2]] * 6, rows, rows, rows, rows)
        train = PromptLoader(prompts, batch_size=2, pad_id=0)
        train.use_sampler((0.2, 1.0, 0.2))
        return train

    a, b = loader(), loader()
    batch = a.next_batch().repeat(2, interleave=True)  # 2 prompts x 2 samples
    with pytest.raises(ValueError, match="drawn by another loader"):
        b.record(batch, torch.tensor([1.0, 0.0, 1.0, 1.0]))
    m = a.record(batch, torch.tensor([1.0, 0.0, 1.0, 1.0]))
    assert m["sampler/zero_var_share"] == 0.5 and m["sampler/seen"] == 2
    assert len(a.sampler.pass_rate) == 2 and b.sampler.pass_rate == {}  # b saw nothing
    b.next_batch()
    with pytest.raises(ConfigError, match="the previous batch got no scores"):
        b.next_batch()  # b's own batch was never recorded: a's record did not count for it
    held = [
        f"{name}.{var}"
        for name, mod in list(sys.modules.items())
        if name.startswith("rlkit")
        for var, v in vars(mod).items()
        if isinstance(v, Mapping) and any(x is a.sampler or x is a for x in list(v.values()))
    ]
    assert not held, f"a module-level registry holds the sampler: {held}"


def test_a_resume_on_changed_data_is_refused_in_one_line():
    """The data file shrank (or grew) at the same path, or the state names a prompt the set lacks: a ConfigError, not an
    IndexError at the first draw."""
    a = DifficultySampler(50, seed=1)
    a.draws = 1
    a.record([3, 3, 49, 49], torch.tensor([1.0, 0.0, 1.0, 1.0]))
    for size in (40, 60):  # shrank (prompt 49 gone) / grew (the indices name other prompts)
        with pytest.raises(ConfigError, match=f"the checkpoint holds 50 prompts, the training set has {size} prompts"):
            DifficultySampler(size, seed=1).load_state_dict(a.state_dict())
    old = {"pass_rate": {"3": 0.5, "70": 1.0}, "draws": 1}  # no size saved (an earlier checkpoint), a key out of range
    with pytest.raises(ConfigError, match="a pass rate of prompt 70, the training set has 50 prompts"):
        DifficultySampler(50).load_state_dict(old)
    with pytest.raises(ConfigError, match="a pass rate of prompt -1"):
        DifficultySampler(50).load_state_dict({"pass_rate": {-1: 0.5}, "draws": 1, "size": 50})


def test_hard_and_easy_weights_apply_to_their_pools_and_too_few_weighted_prompts_are_topped_up():
    s = DifficultySampler(4, weights=(1.0, 0.0, 0.0), seed=0)  # only the hard pool is drawn
    s.pass_rate = {0: 0.0, 1: 1.0, 2: 0.5}  # hard, easy, normal; 3 unseen (normal)
    for _ in range(10):
        assert s.draw(1) == [0]
        s.recorded = s.draws
    s = DifficultySampler(5, weights=(0.0, 0.0, 1.0), seed=0)
    s.pass_rate = {0: 0.0, 1: 1.0, 2: 0.5}  # 3, 4 unseen
    assert s.draw(1) == [1]
    s.recorded = s.draws
    seen = set()
    for _ in range(100):  # one prompt keeps a weight, three are asked for: the rest are topped up uniformly
        drawn = s.draw(3)
        s.recorded = s.draws
        assert 1 in drawn and len(set(drawn)) == 3
        seen.update(drawn)
    assert seen == {0, 1, 2, 3, 4}  # (torch alone fills with the same zero-weight prompts every time: the highest indices)
