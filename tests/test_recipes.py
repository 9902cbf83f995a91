"""End-to-end: every GRPO-family recipe runs a few steps on the embedded model, and DAPO's extras behave."""

import pytest
import torch
from safetensors.torch import load_file
from test_grpo_recipe import ROOT, load_recipe, read_jsonl, run_cli, small_config

from rlkit import demos


@pytest.mark.parametrize(
    "name,extra",
    [("dapo", {}), ("rloo", {}), ("reinforce_pp", {}), ("reinforce_pp", {"baseline": True}), ("grpo", {"norm_adv_by_std_in_grpo": False})],
)
def test_recipe_runs_and_updates_the_policy(tmp_path, name, extra):
    recipe = load_recipe(name)
    cfg = small_config(recipe, tmp_path, steps=2)
    for k, v in extra.items():
        setattr(cfg, k, v)
    if name == "dapo":
        cfg.gen_batch_size = 8
    recipe.main(cfg)
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert {"critic/score/mean", "actor/pg_loss", "actor/grad_norm", "val/acc"} <= set(rows[2])
    before = load_file(demos.ARITH_MODEL / "model.safetensors")
    after = load_file(tmp_path / "checkpoints/global_step_2/hf/model.safetensors")
    assert any(not torch.equal(before[k], after[k]) for k in before)


def test_dapo_keeps_only_informative_groups_and_shapes_overlong_rewards(tmp_path):
    dapo = load_recipe("dapo")
    cfg = small_config(dapo, tmp_path, steps=1)
    cfg.gen_batch_size = 8
    seen = {}
    real_update = None

    def spy(batch, loss_fn):  # record what reaches the update
        seen["scores"] = batch["scores"].clone()
        seen["uid"] = list(batch["uid"])
        seen["len"] = batch["response_mask"].sum(-1)
        return real_update(batch, loss_fn)

    import rlkit.placement as placement

    build = placement.build_policy

    def build_spy(*a, **k):
        nonlocal real_update
        policy = build(*a, **k)
        real_update = policy.worker.update
        policy.worker.update = spy
        return policy

    dapo.build_policy = build_spy
    dapo.main(cfg)
    assert len(seen["uid"]) == cfg.data.train_batch_size * cfg.rollout.n
    groups = {}
    for u, s in zip(seen["uid"], seen["scores"].tolist()):
        groups.setdefault(u, []).append(s)
    assert all(len(g) == cfg.rollout.n and max(g) != min(g) for g in groups.values())  # every kept group is informative
    # overlong shaping: max_response_length 8, buffer 2 -> a 7-token response loses 0.5, an 8-token one loses 1
    expected_penalty = torch.clamp(-(seen["len"].float() - 6) / 2, max=0)
    frac = seen["scores"] - expected_penalty
    assert torch.all((frac == 0) | (frac == 1))


def test_dapo_stops_with_a_clear_error_when_no_group_is_informative(tmp_path):
    out = run_cli(
        "--trainer.default-local-dir",
        str(tmp_path),
        "--trainer.total-training-steps",
        "1",
        "--data.val-files",
        "--reward.custom-fn",
        f"{ROOT}/tests/fixtures/my_reward.py:constant_score",
        "--max-num-gen-batches",
        "2",
        "--overlong-buffer-len",
        "0",
        "--gen-batch-size",
        "8",
        "--data.train-batch-size",
        "8",
        "--actor.ppo-mini-batch-size",
        "8",
        recipe="dapo",
    )
    assert out.returncode == 1
    assert "2 generation batches" in out.stderr and "--max-num-gen-batches" in out.stderr


def spy_on_updates(recipe, seen: list):
    """Make `recipe` build a policy whose update first records the batch it gets."""
    import rlkit.placement as placement

    def build_spy(*a, **k):
        policy = placement.build_policy(*a, **k)
        real_update = policy.worker.update

        def update(batch, loss_fn):
            seen.append(batch)
            return real_update(batch, loss_fn)

        policy.worker.update = update
        return policy

    recipe.build_policy = build_spy


def test_reinforce_pp_puts_the_kl_in_the_reward(tmp_path):
    """r_t = s [t last] - beta KL_t: the token rewards of step 2 (the policy has moved off the reference)
    are the 0/1 score minus beta times the KL of each token, and the KL is not in the loss."""
    rpp = load_recipe("reinforce_pp")
    cfg = small_config(rpp, tmp_path, steps=2)
    cfg.kl_coef, cfg.kl_penalty = 0.5, "kl"
    cfg.actor.use_kl_loss = False
    cfg.actor.lr = 1e-2  # a first step large enough that the KL of step 2 is far from 0
    seen = []
    spy_on_updates(rpp, seen)
    rpp.main(cfg)
    batch = seen[-1]
    mask = batch["response_mask"]
    kl = (batch["old_log_probs"] - batch["ref_log_prob"]) * mask  # (B*n, R), k1
    assert kl.abs().sum(-1).min() > 1e-3  # every response has a KL to pay
    score = batch["token_level_rewards"] + cfg.kl_coef * kl  # what is left: the score, on the last token
    last = mask.sum(-1).long() - 1
    on_last = score.gather(1, last[:, None])[:, 0]
    assert torch.all((on_last.abs() < 1e-5) | ((on_last - 1).abs() < 1e-5))  # scores are 0 or 1
    score.scatter_(1, last[:, None], 0.0)
    assert score.abs().max() < 1e-5  # nothing but the KL anywhere else
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert "actor/kl_loss" not in rows[-1]  # KL is in the reward, not the loss
