"""End-to-end: GSPO, CISPO, GMPO and ReMax (issue #13's forks of grpo.py) on the embedded model, a few steps each.

Learning itself is measured by the default runs recorded in docs/results.md (minutes each, too slow for CI).
"""

import math

import pytest
import torch
from safetensors.torch import load_file
from test_grpo_recipe import load_recipe, read_jsonl, small_config

from rlkit import algos, demos, recipe
from rlkit.protocol import DataProto


@pytest.mark.parametrize("name,extra", [("gspo", {}), ("gspo", {"gspo_token": True}), ("cispo", {}), ("gmpo", {})])
def test_new_recipe_runs_and_updates_the_policy(tmp_path, name, extra):
    recipe = load_recipe(name)
    cfg = small_config(recipe, tmp_path, steps=2)  # 8 prompts, mini-batches of 4: the second optimizer step is off-policy
    for k, v in extra.items():
        setattr(cfg, k, v)
    recipe.main(cfg)
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert {"critic/score/mean", "actor/pg_loss", "actor/pg_clipfrac", "actor/grad_norm", "val/acc"} <= set(rows[2])
    before = load_file(demos.ARITH_MODEL / "model.safetensors")
    after = load_file(tmp_path / "checkpoints/global_step_2/hf/model.safetensors")
    assert any(not torch.equal(before[k], after[k]) for k in before)


def test_new_recipes_default_to_the_papers_hyper_parameters():
    gspo, cispo, gmpo = (load_recipe(n).Config().actor for n in ("gspo", "cispo", "gmpo"))
    assert (gspo.clip_low, gspo.clip_high, gspo.loss_agg_mode, gspo.use_kl_loss) == (3e-4, 4e-4, "seq-mean-token-mean", False)
    assert (cispo.clip_low, cispo.clip_high, cispo.loss_agg_mode) == (1.0, 0.2, "token-mean")
    assert (gmpo.clip_low, gmpo.clip_high, gmpo.loss_agg_mode) == (0.4, 0.4, "seq-mean-token-mean")


@pytest.mark.parametrize("n", [4, 1])  # --rollout.n 1: the paper's setting (GRPO refuses it), A = s - b(x), not the raw score
def test_remax_uses_one_greedy_response_per_prompt_as_the_baseline(tmp_path, monkeypatch, n):
    remax = load_recipe("remax")
    cfg = small_config(remax, tmp_path, steps=2)
    cfg.rollout.n = n
    B, n = cfg.data.train_batch_size, cfg.rollout.n
    gens, scored, updates = [], [], []

    real_score = recipe.score

    def score_spy(batch, tok, reward_fn):  # training rows carry a group id; validation rows do not
        scores, metrics = real_score(batch, tok, reward_fn)
        if "uid" in batch.non_tensors:
            scored.append(scores.clone())
        return scores, metrics

    monkeypatch.setattr(recipe, "score", score_spy)
    build = remax.build_policy

    def build_spy(*a, **k):
        policy = build(*a, **k)
        generate, update = policy.generate, policy.update

        def generate_spy(batch, validate=False):
            if "uid" in batch.non_tensors:
                gens.append((validate, len(batch)))
            return generate(batch, validate=validate)

        def update_spy(batch, loss_fn):
            updates.append((batch["advantages"].clone(), batch["response_mask"].clone()))
            return update(batch, loss_fn)

        policy.generate, policy.update = generate_spy, update_spy
        return policy

    monkeypatch.setattr(remax, "build_policy", build_spy)
    remax.main(cfg)

    assert gens == [(True, B), (False, B * n)] * 2  # per step: one greedy call with B rows, then the B*n samples
    assert len(scored) == 4 and len(updates) == 2
    for step, (adv, mask) in enumerate(updates):
        greedy, samples = scored[2 * step], scored[2 * step + 1]  # (B,), (B*n,)
        assert greedy.shape == (B,) and samples.shape == (B * n,)
        expected = (samples - greedy.repeat_interleave(n))[:, None] * mask  # A = s - b(x) on every valid token
        assert torch.equal(adv, expected.to(adv.dtype))
    assert any(s.sum() > 0 for s in scored[::2]), "every greedy score was 0: the baseline check above proved little"


# -- the forks' own losses inside their recipes -------------------------------------------------------------------

# One micro-batch, on-policy (log pi = log pi_old): row 0 has 3 valid tokens with A = 1, row 1 has 4 with A = -2.
MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
ADV = torch.tensor([[1.0, 1.0, 1.0, 0.0], [-2.0, -2.0, -2.0, -2.0]])
OLD = torch.log(torch.tensor([[0.5, 0.2, 0.9, 1.0], [0.3, 0.6, 0.7, 0.4]]))
# token-sum of the policy term, by hand: GSPO and GMPO put -A_i s_i (s_i = 1) on each valid token of row i:
# -(3 * 1 + 4 * (-2)) = 5; CISPO puts -A_t log pi_t: -(ln .5 + ln .2 + ln .9) + 2 (ln .3 + ln .6 + ln .7 + ln .4) = -3.567582
TOKEN_SUM = {"gspo": 5.0, "cispo": -3.567582, "gmpo": 5.0}


@pytest.mark.parametrize("name", ["gspo", "cispo", "gmpo"])
def test_token_sum_policy_term_is_scaled_by_dp_size_like_the_other_terms(name):
    """Under data parallelism (gradients averaged over dp_size processes) "token-sum" is multiplied by dp_size (verl's
    agg_loss): the fork's policy term must be, like the entropy term, or it is dp_size times too small beside it."""
    recipe = load_recipe(name)
    cfg = recipe.Config()
    cfg.actor.loss_agg_mode, cfg.actor.entropy_coeff, cfg.actor.use_kl_loss = "token-sum", 0.1, False
    loss_fn = recipe.make_actor_loss(cfg)
    mb = DataProto.from_dict({"response_mask": MASK, "advantages": ADV, "old_log_probs": OLD})
    entropy = torch.full((2, 4), 0.5)
    for dp in (1, 2):
        _, parts, _ = loss_fn(mb, OLD.clone(), entropy, algos.Norm(num_tokens=7, num_seqs=2, dp_size=dp))
        # float32 sums of 7 terms of size <= 2.4: rounding below 1e-5
        assert parts["pg_loss"].item() == pytest.approx(dp * TOKEN_SUM[name], abs=1e-5), dp
        assert parts["entropy_loss"].item() == pytest.approx(-dp * 7 * 0.5, abs=1e-5), dp


NORM = algos.Norm(num_tokens=7, num_seqs=2)  # the micro-batch is the whole mini-batch: 7 tokens, 2 rows


def fork_loss(name, log_prob, old, adv, mask=MASK, norm=NORM, **actor):
    """The recipe's own make_actor_loss on one micro-batch (no KL, no entropy): (pg_loss, d pg_loss / d log pi)."""
    recipe = load_recipe(name)
    cfg = recipe.Config()
    cfg.actor.use_kl_loss, cfg.actor.entropy_coeff = False, 0.0
    for k, v in actor.items():
        setattr(cfg, k, v) if k == "gspo_token" else setattr(cfg.actor, k, v)
    log_prob = log_prob.clone().requires_grad_(True)
    mb = DataProto.from_dict({"response_mask": mask, "advantages": adv, "old_log_probs": old})
    _, parts, _ = recipe.make_actor_loss(cfg)(mb, log_prob, None, norm)
    parts["pg_loss"].backward()
    return parts["pg_loss"].item(), log_prob.grad


def test_cispo_recipe_normalises_its_policy_term_by_tokens():
    """cispo.py's default: -1/N sum_{i,t} A_t log pi_t with N = the mini-batch's 7 tokens (by sequences it would be
    (0.802649 - 1.493883) / 2 = -0.345617)."""
    loss, grad = fork_loss("cispo", OLD, OLD, ADV)
    assert loss == pytest.approx(TOKEN_SUM["cispo"] / 7, abs=1e-6)  # -0.509655
    assert torch.allclose(grad, -ADV * MASK / 7, atol=1e-7)  # on-policy: w = 1 on every token


def test_gspo_token_flag_changes_the_gradient_with_per_token_advantages():
    """On-policy (s_i = 1), seq-mean-token-mean over G = 2 rows: GSPO puts row 0's mean advantage 1 on each of its
    3 tokens, -1 / 3 / 2 = -0.166667; GSPO-token each token's own, -[2, 1, 0] / 3 / 2. Row 1 (A = -2 throughout):
    2 / 4 / 2 = 0.25 either way."""
    adv = torch.tensor([[2.0, 1.0, 0.0, 0.0], [-2.0, -2.0, -2.0, -2.0]])
    loss_seq, grad_seq = fork_loss("gspo", OLD, OLD, adv)
    loss_tok, grad_tok = fork_loss("gspo", OLD, OLD, adv, gspo_token=True)
    assert loss_seq == pytest.approx(loss_tok, abs=1e-6) == pytest.approx((-1.0 + 2.0) / 2, abs=1e-6)  # same value
    assert torch.allclose(grad_seq[0], torch.tensor([-1 / 6, -1 / 6, -1 / 6, 0.0]), atol=1e-6)
    assert torch.allclose(grad_tok[0], torch.tensor([-2 / 6, -1 / 6, 0.0, 0.0]), atol=1e-6)
    assert torch.allclose(grad_seq[1], torch.full((4,), 0.25), atol=1e-6) and torch.allclose(grad_tok[1], grad_seq[1], atol=1e-6)


def test_cispo_clip_flags_bound_the_weight():
    """Ratios 1.5 (A = 1) and 0.5 (A = -2) on two tokens, 1 elsewhere: the gradient is -w A / 7 with w the ratio clipped to
    [1 - low, 1 + high]: 1.2 and 0.5 by default (low 1.0: no lower bound); 1.5 and 0.8 with high 0.6, low 0.2."""
    ratio = torch.ones(2, 4)
    ratio[0, 0], ratio[1, 0] = 1.5, 0.5
    old = OLD - ratio.log()
    for flags, w0, w1 in (({}, 1.2, 0.5), ({"clip_ratio_high": 0.6, "clip_ratio_low": 0.2}, 1.5, 0.8)):
        _, grad = fork_loss("cispo", OLD, old, ADV, **flags)
        assert grad[0, 0].item() == pytest.approx(-w0 * 1 / 7, abs=1e-6), flags
        assert grad[1, 0].item() == pytest.approx(-w1 * -2 / 7, abs=1e-6), flags
        assert grad[0, 1].item() == pytest.approx(-1 / 7, abs=1e-6)  # ratio 1: weight 1 whatever the flags


def test_gmpo_clip_flags_bound_the_log_ratio():
    """Row 0 (A = 1, 3 tokens) with log-ratios [0.3, 0, 0]: inside the default +-0.4 every token keeps its gradient
    -A r / 3 / 2 with r = e^(0.3 / 3); with --actor.clip-ratio-high 0.2 token 0 is clipped to 0.2 (no gradient) and
    r = e^(0.2 / 3)."""
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    shift = torch.zeros(2, 4)
    shift[0, 0] = 0.3
    for flags, clipped, r in (({}, False, math.exp(0.1)), ({"clip_ratio_high": 0.2}, True, math.exp(0.2 / 3))):
        _, grad = fork_loss("gmpo", OLD, OLD - shift, ADV, mask=mask, **flags)
        g = -r / 3 / 2
        want = torch.tensor([0.0 if clipped else g, g, g, 0.0])
        assert torch.allclose(grad[0], want, atol=1e-6), (flags, grad[0])
