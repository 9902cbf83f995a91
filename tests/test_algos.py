"""Tests for rlkit.algos against numbers worked out by hand.

Every expected value carries its arithmetic in a comment; none is produced by
calling the function under test or a re-implementation of it.
"""

import math

import numpy as np
import pytest
import torch
from torch.testing import assert_close

from rlkit import algos

ATOL = 1e-5


def t(x, dtype=torch.float32):
    return torch.tensor(x, dtype=dtype)


# ---------------------------------------------------------------------------
# masked statistics
# ---------------------------------------------------------------------------


def test_masked_sum_and_mean():
    x = t([[1.0, 2.0, float("inf")], [4.0, 5.0, float("nan")]])
    m = t([[1, 1, 0], [0, 0, 0]])
    # valid entries: 1, 2  (inf / nan sit on padding and must not leak)
    assert_close(algos.masked_sum(x, m), t(3.0), atol=ATOL, rtol=0)  # 1+2=3
    assert_close(algos.masked_mean(x, m), t(1.5), atol=ATOL, rtol=0)  # 3/2
    assert_close(algos.masked_sum(x, m, dim=-1), t([3.0, 0.0]), atol=ATOL, rtol=0)
    # row 0: 3/2=1.5; row 1 fully masked: 0/(0+1e-8)=0, not NaN
    assert_close(algos.masked_mean(x, m, dim=-1), t([1.5, 0.0]), atol=ATOL, rtol=0)
    # bool masks work the same
    assert_close(algos.masked_mean(x, m.bool()), t(1.5), atol=ATOL, rtol=0)


def test_masked_mean_fully_masked_is_zero():
    x = t([[1.0, 2.0]])
    out = algos.masked_mean(x, torch.zeros(1, 2))
    assert torch.isfinite(out)
    assert_close(out, t(0.0), atol=ATOL, rtol=0)


def test_masked_var():
    x = t([1.0, 2.0, 3.0, 100.0])
    m = t([1, 1, 1, 0])
    # mean=(1+2+3)/3=2; squared deviations 1+0+1=2
    assert_close(algos.masked_var(x, m), t(1.0), atol=ATOL, rtol=0)  # unbiased: 2/(3-1)=1
    assert_close(algos.masked_var(x, m, unbiased=False), t(2.0 / 3.0), atol=ATOL, rtol=0)  # 2/3=0.66667
    # one valid element: variance undefined -> 0 by convention (no raise)
    assert_close(algos.masked_var(t([5.0, 7.0]), t([1, 0])), t(0.0), atol=ATOL, rtol=0)
    # no valid element -> 0
    assert_close(algos.masked_var(t([5.0, 7.0]), t([0, 0])), t(0.0), atol=ATOL, rtol=0)


def test_masked_whiten_hand_values():
    x = t([0.0, 2.0, 4.0, 50.0])
    m = t([1, 1, 1, 0])
    # mean=(0+2+4)/3=2; unbiased var=(4+0+4)/2=4, std=2 -> (x-2)/2
    w = algos.masked_whiten(x, m)
    assert_close(w[:3], t([-1.0, 0.0, 1.0]), atol=ATOL, rtol=0)
    # shift_mean=False adds the mean 2 back: [-1,0,1]+2
    w = algos.masked_whiten(x, m, shift_mean=False)
    assert_close(w[:3], t([1.0, 2.0, 3.0]), atol=ATOL, rtol=0)


def test_masked_whiten_gives_zero_mean_unit_var():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 7, generator=g) * 3.0 + 5.0
    m = (torch.rand(4, 7, generator=g) > 0.3).float()
    w = algos.masked_whiten(x, m)
    valid = w[m.bool()]
    assert_close(valid.mean(), t(0.0), atol=1e-5, rtol=0)
    assert_close(valid.var(unbiased=True), t(1.0), atol=1e-5, rtol=0)


# ---------------------------------------------------------------------------
# agg_loss
# ---------------------------------------------------------------------------

L = t([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
M = t([[1, 1, 0], [1, 0, 0]])


@pytest.mark.parametrize(
    "mode, expected",
    [
        ("token-mean", 7.0 / 3.0),  # valid 1,2,4 -> (1+2+4)/3 = 2.33333
        ("seq-mean-token-sum", 3.5),  # row sums 3, 4 -> (3+4)/2 = 3.5
        ("seq-mean-token-mean", 2.75),  # row means 1.5, 4 -> (1.5+4)/2 = 2.75
        ("seq-mean-token-sum-norm", 7.0 / 6.0),  # (3+4)/(G=2 * T=3) = 1.16667
    ],
)
def test_agg_loss_modes(mode, expected):
    assert_close(algos.agg_loss(L, M, mode), t(expected), atol=ATOL, rtol=0)


@pytest.mark.parametrize(
    "mode, expected",
    [
        # micro-batch 0 = row 0, micro-batch 1 = row 1, global counts N=3 tokens, G=2 seqs
        ("token-mean", 7.0 / 3.0),  # 3/3 + 4/3 = 7/3
        ("seq-mean-token-sum", 3.5),  # 3/2 + 4/2 = 3.5
        ("seq-mean-token-mean", 2.75),  # 1.5/2 + 4/2 = 2.75
        ("seq-mean-token-sum-norm", 7.0 / 6.0),  # 3/(2*3) + 4/(2*3) = 7/6
    ],
)
def test_agg_loss_micro_batches_sum_to_whole(mode, expected):
    parts = [algos.agg_loss(L[i : i + 1], M[i : i + 1], mode, num_tokens=3, num_seqs=2, norm_len=3) for i in range(2)]
    assert_close(parts[0] + parts[1], t(expected), atol=ATOL, rtol=0)


def test_agg_loss_norm_len_override():
    # (3+4)/(2 * 10) = 0.35
    assert_close(algos.agg_loss(L, M, "seq-mean-token-sum-norm", norm_len=10), t(0.35), atol=ATOL, rtol=0)


def test_agg_loss_fully_masked_gives_zero():
    loss = t([[1.0, 2.0], [3.0, 4.0]])
    for mode in algos.LOSS_AGG_MODES:
        out = algos.agg_loss(loss, torch.zeros(2, 2), mode)
        assert torch.isfinite(out), mode
        assert_close(out, t(0.0), atol=ATOL, rtol=0)
    # a fully masked row counts as a zero-loss sequence: (1.5 + 0)/2 = 0.75
    out = algos.agg_loss(loss, t([[1, 1], [0, 0]]), "seq-mean-token-mean")
    assert_close(out, t(0.75), atol=ATOL, rtol=0)


def test_agg_loss_unknown_mode():
    with pytest.raises(ValueError, match="token-mean"):
        algos.agg_loss(L, M, "token-sum")


# ---------------------------------------------------------------------------
# group ids and outcome advantages
# ---------------------------------------------------------------------------


def test_group_ids():
    assert algos.group_ids(["b", "a", "b", "c"]).tolist() == [0, 1, 0, 2]
    assert algos.group_ids(np.array(["x", "x", "y"], dtype=object)).tolist() == [0, 0, 1]
    assert algos.group_ids(np.array(["x", "y", "x"])).tolist() == [0, 1, 0]
    assert algos.group_ids(torch.tensor([5, 5, 3])).tolist() == [0, 0, 1]
    assert algos.group_ids(["p"]).dtype == torch.long


def test_grpo_single_group():
    s = t([1.0, 0.0, 1.0, 0.0])
    # mean=(1+0+1+0)/4=0.5; unbiased std=sqrt(4*0.25/3)=0.577350
    # A=±0.5/(0.577350+1e-6)=±0.866024
    expected = t([0.866024, -0.866024, 0.866024, -0.866024])
    assert_close(algos.grpo_advantage(s, ["q"] * 4), expected, atol=ATOL, rtol=0)


def test_grpo_std_nostd_singleton_allequal():
    s = t([1.0, 2.0, 3.0, 5.0, 5.0, 7.0])
    uid = ["a", "a", "a", "b", "b", "c"]
    # a: mean 2, unbiased std sqrt((1+0+1)/2)=1 -> [-1,0,1]/(1+1e-6) = [-0.999999, 0, 0.999999]
    # b: all equal -> (5-5)/(0+1e-6) = 0
    # c: singleton -> mean 0, std 1 -> 7/(1+1e-6) = 6.999993
    expected = t([-0.999999, 0.0, 0.999999, 0.0, 0.0, 6.999993])
    assert_close(algos.grpo_advantage(s, uid), expected, atol=ATOL, rtol=0)
    # Dr.GRPO, no std: a: [1-2, 2-2, 3-2]; b: 0, 0; c: 7-0
    expected = t([-1.0, 0.0, 1.0, 0.0, 0.0, 7.0])
    assert_close(algos.grpo_advantage(s, uid, norm_by_std=False), expected, atol=ATOL, rtol=0)


def test_grpo_interleaved_string_uids():
    s = t([1.0, 3.0, 2.0, 5.0])
    uid = np.array(["x", "y", "x", "y"])
    # x: {1,2} mean 1.5, std sqrt((0.25+0.25)/1)=0.707107 -> ∓0.5/0.707108 = ∓0.707106
    # y: {3,5} mean 4, std sqrt((1+1)/1)=1.414214 -> ∓1/1.414215 = ∓0.707106
    expected = t([-0.707106, -0.707106, 0.707106, 0.707106])
    assert_close(algos.grpo_advantage(s, uid), expected, atol=ATOL, rtol=0)


def test_rloo():
    s = t([1.0, 2.0, 3.0, 4.0, 10.0, 7.0])
    uid = ["a", "a", "a", "b", "b", "c"]
    # a: 1-(2+3)/2=-1.5; 2-(1+3)/2=0; 3-(1+2)/2=1.5
    # b: 4-10=-6; 10-4=6
    # c: singleton -> baseline 0 -> 7
    expected = t([-1.5, 0.0, 1.5, -6.0, 6.0, 7.0])
    assert_close(algos.rloo_advantage(s, uid), expected, atol=ATOL, rtol=0)


def test_reinforce_pp_reset_after_eos_and_whitening():
    r = t([[0.0, 0.0, 1.0, 5.0], [0.0, 2.0, 0.0, 0.0]])
    m = t([[1, 1, 1, 0], [1, 1, 0, 0]])
    adv, ret = algos.reinforce_pp_advantage(r, m, gamma=0.5)
    # row 0 backwards: t3: G=5 -> ret 5, then G*=m3=0 (reset: the 5 on padding does not leak)
    #                  t2: G=1+0.5*0=1; t1: G=0+0.5*1=0.5; t0: G=0.25
    # row 1 backwards: t3: 0; t2: 0 (reset); t1: G=2; t0: G=0+0.5*2=1
    assert_close(ret, t([[0.25, 0.5, 1.0, 5.0], [1.0, 2.0, 0.0, 0.0]]), atol=ATOL, rtol=0)
    # valid returns 0.25, 0.5, 1, 1, 2: mean=4.75/5=0.95
    # deviations -0.7, -0.45, 0.05, 0.05, 1.05; squares sum 0.49+0.2025+0.0025+0.0025+1.1025=1.8
    # unbiased var=1.8/4=0.45, std=0.670820
    # -0.7/0.67082=-1.043498, -0.45/0.67082=-0.670820, 0.05/0.67082=0.074536, 1.05/0.67082=1.565248
    expected = t([[-1.043498, -0.670820, 0.074536, 0.0], [0.074536, 1.565248, 0.0, 0.0]])
    assert_close(adv, expected, atol=ATOL, rtol=0)


def test_reinforce_pp_fully_masked_gives_zero():
    adv, _ = algos.reinforce_pp_advantage(t([[1.0, 2.0]]), torch.zeros(1, 2), gamma=1.0)
    assert torch.isfinite(adv).all()
    assert_close(adv, torch.zeros(1, 2), atol=ATOL, rtol=0)


def test_reinforce_pp_baseline():
    s = t([1.0, 0.0, 3.0])
    uid = ["a", "a", "b"]
    m = t([[1, 1], [1, 0], [1, 1]])
    # a: mean 0.5 -> 0.5, -0.5; b singleton: mean 0 -> 3
    # tiled x mask: [[0.5,0.5],[-0.5,0],[3,3]]; valid 0.5,0.5,-0.5,3,3: mean=6.5/5=1.3
    # deviations -0.8,-0.8,-1.8,1.7,1.7; squares 0.64+0.64+3.24+2.89+2.89=10.3; var=10.3/4=2.575; std=1.604681
    # -0.8/1.604681=-0.498541, -1.8/1.604681=-1.121718, 1.7/1.604681=1.059400
    expected = t([[-0.498541, -0.498541], [-1.121718, 0.0], [1.059400, 1.059400]])
    assert_close(algos.reinforce_pp_baseline_advantage(s, uid, m), expected, atol=ATOL, rtol=0)


# ---------------------------------------------------------------------------
# GAE
# ---------------------------------------------------------------------------


def test_gae_masked_last_token():
    r = t([[0.0, 1.0, 5.0]])
    v = t([[0.5, 0.2, 3.0]])
    m = t([[1, 1, 0]])
    adv, ret = algos.gae_advantage(r, v, m, gamma=0.9, lam=0.8)
    # t2 (masked): delta=5+0.9*0-3=2, A2=2; mask 0 -> next_value, next_adv stay 0
    # t1: delta=1+0.9*0-0.2=0.8, A1=0.8+0.72*0=0.8; next_value=0.2, next_adv=0.8
    # t0: delta=0+0.9*0.2-0.5=-0.32, A0=-0.32+0.72*0.8=0.256
    # returns = A + V = [0.256+0.5, 0.8+0.2, 2+3] = [0.756, 1.0, 5.0]
    assert_close(ret, t([[0.756, 1.0, 5.0]]), atol=ATOL, rtol=0)
    # whiten over valid [0.256, 0.8]: mean 0.528, deviations ∓0.272,
    # unbiased var=2*0.272^2/1=0.147968, std=0.384666 -> ∓0.272/0.384666=∓0.707107; padding -> 0
    assert_close(adv, t([[-0.707107, 0.707107, 0.0]]), atol=ATOL, rtol=0)


def test_gae_skips_masked_middle_token():
    r = t([[0.0, 0.0, 1.0]])
    v = t([[0.5, 0.2, 0.4]])
    m = t([[1, 0, 1]])
    adv, ret = algos.gae_advantage(r, v, m, gamma=0.9, lam=0.8)
    # t2: delta=1+0-0.4=0.6, A2=0.6; next_value=0.4, next_adv=0.6
    # t1 (masked): delta=0+0.9*0.4-0.2=0.16, A1=0.16+0.72*0.6=0.592; next_* unchanged (0.4, 0.6)
    # t0: delta=0+0.9*0.4-0.5=-0.14, A0=-0.14+0.72*0.6=0.292   (bypasses token 1)
    # returns = [0.292+0.5, 0.592+0.2, 0.6+0.4] = [0.792, 0.792, 1.0]
    assert_close(ret, t([[0.792, 0.792, 1.0]]), atol=ATOL, rtol=0)
    # whiten over valid [0.292, 0.6]: two values -> ∓1/sqrt(2) = ∓0.707107
    assert_close(adv, t([[-0.707107, 0.0, 0.707107]]), atol=ATOL, rtol=0)


# ---------------------------------------------------------------------------
# PPO clipped loss
# ---------------------------------------------------------------------------


def _ppo_case():
    # tokens: a no-clip, b upper clip, c lower clip, d dual clip, e padding
    ratio = t([[1.1, 1.5, 0.5, 5.0, 10.0]])
    adv = t([[1.0, 1.0, -1.0, -1.0, 1.0]])
    m = t([[1, 1, 1, 1, 0]])
    return ratio.log(), torch.zeros(1, 5), adv, m


def test_ppo_clip_no_clip_clip_and_dual_clip():
    logp, old, adv, m = _ppo_case()
    logp.requires_grad_(True)
    loss, metrics = algos.ppo_clip_loss(logp, old, adv, m, 0.2, 0.2, 3.0)
    # a: A=+1, rho=1.1: L1=-1.1, L2=-1.1 -> -1.1 (no clip)
    # b: A=+1, rho=1.5: L1=-1.5, L2=-1.2 -> max=-1.2 (clipped)
    # c: A=-1, rho=0.5: L1=0.5, L2=0.8 -> 0.8 (clipped); dual min(3, 0.8)=0.8 (inactive)
    # d: A=-1, rho=5:   L1=5, L2=1.2 -> 5; dual min(3, 5)=3 (active)
    # token-mean = (-1.1 - 1.2 + 0.8 + 3)/4 = 1.5/4 = 0.375
    assert_close(loss, t(0.375), atol=ATOL, rtol=0)
    assert metrics["pg_clipfrac"] == pytest.approx(0.5, abs=ATOL)  # b, c -> 2/4
    assert metrics["pg_clipfrac_lower"] == pytest.approx(0.25, abs=ATOL)  # d -> 1/4
    # ppo_kl = mean(-log rho) = -ln(1.1*1.5*0.5*5)/4 = -ln(4.125)/4 = -1.417066/4 = -0.354267
    assert metrics["ppo_kl"] == pytest.approx(-0.354267, abs=ATOL)
    assert all(isinstance(v, float) for v in metrics.values())
    # gradient: only token a is unclipped: d(-A rho)/dlogp = -A rho = -1.1, /4 = -0.275
    loss.backward()
    assert_close(logp.grad, t([[-0.275, 0.0, 0.0, 0.0, 0.0]]), atol=ATOL, rtol=0)


def test_ppo_clip_dual_clip_disabled():
    logp, old, adv, m = _ppo_case()
    loss, metrics = algos.ppo_clip_loss(logp, old, adv, m, clip_ratio_c=None)
    # d keeps its PPO loss 5: (-1.1 - 1.2 + 0.8 + 5)/4 = 3.5/4 = 0.875
    assert_close(loss, t(0.875), atol=ATOL, rtol=0)
    assert metrics["pg_clipfrac_lower"] == 0.0


def test_ppo_clip_global_token_count():
    logp, old, adv, m = _ppo_case()
    loss, _ = algos.ppo_clip_loss(logp, old, adv, m, num_tokens=8)
    # same per-token losses, divided by the global count: 1.5/8 = 0.1875
    assert_close(loss, t(0.1875), atol=ATOL, rtol=0)


def test_ppo_clip_higher_asymmetry():
    ratio = t([[1.25, 1.5, 0.75]])
    adv = t([[1.0, 1.0, -1.0]])
    m = torch.ones(1, 3)
    logp, old = ratio.log(), torch.zeros(1, 3)
    loss, metrics = algos.ppo_clip_loss(logp, old, adv, m, 0.2, 0.2)
    # symmetric [0.8, 1.2]: a: max(-1.25,-1.2)=-1.2; b: max(-1.5,-1.2)=-1.2; c: max(0.75,0.8)=0.8
    # (-1.2 - 1.2 + 0.8)/3 = -1.6/3 = -0.533333, all three clipped
    assert_close(loss, t(-1.6 / 3), atol=ATOL, rtol=0)
    assert metrics["pg_clipfrac"] == pytest.approx(1.0, abs=ATOL)
    loss, metrics = algos.ppo_clip_loss(logp, old, adv, m, 0.2, 0.28)
    # clip-higher [0.8, 1.28]: a: 1.25 inside -> -1.25; b: max(-1.5,-1.28)=-1.28; c: still 0.8
    # (-1.25 - 1.28 + 0.8)/3 = -1.73/3 = -0.576667, b and c clipped -> 2/3
    assert_close(loss, t(-1.73 / 3), atol=ATOL, rtol=0)
    assert metrics["pg_clipfrac"] == pytest.approx(2.0 / 3.0, abs=ATOL)


@pytest.mark.parametrize("c", [1.0, 0.5])
def test_ppo_clip_bad_dual_clip_constant(c):
    logp, old, adv, m = _ppo_case()
    with pytest.raises(ValueError, match="clip_ratio_c"):
        algos.ppo_clip_loss(logp, old, adv, m, clip_ratio_c=c)


# ---------------------------------------------------------------------------
# KL estimators
# ---------------------------------------------------------------------------

# d = logp - ref = [0.5, -1.0]
KL_EXPECTED = {
    "kl": [0.5, -1.0],
    "k1": [0.5, -1.0],
    "abs": [0.5, 1.0],
    "mse": [0.125, 0.5],  # 0.5*0.25, 0.5*1
    "k2": [0.125, 0.5],
    # k=-d=[-0.5, 1]: e^-0.5+0.5-1 = 0.606531-0.5 = 0.106531; e^1-1-1 = 0.718282
    "low_var_kl": [0.106531, 0.718282],
    "k3": [0.106531, 0.718282],
}


@pytest.mark.parametrize("kind", list(KL_EXPECTED))
def test_kl_penalty_values(kind):
    logp, ref = t([0.5, -1.0]), t([0.0, 0.0])
    assert_close(algos.kl_penalty(logp, ref, kind), t(KL_EXPECTED[kind]), atol=ATOL, rtol=0)


@pytest.mark.parametrize("kind", list(KL_EXPECTED))
def test_kl_penalty_straight_through(kind):
    logp = t([0.5, -1.0]).requires_grad_(True)
    ref = t([0.0, 0.0])
    out = algos.kl_penalty(logp, ref, kind + "+")
    # value of the named estimator ...
    assert_close(out.detach(), t(KL_EXPECTED[kind]), atol=ATOL, rtol=0)
    # ... gradient of k2 = d(0.5 d^2)/d logp = d = [0.5, -1.0]
    out.sum().backward()
    assert_close(logp.grad, t([0.5, -1.0]), atol=ATOL, rtol=0)


def test_kl_low_var_clamps():
    logp, ref = t([-30.0, 30.0]), t([0.0, 0.0])
    # d=-30: k=clamp(30)=20, e^20-21 = 4.85e8 -> clamp 10
    # d=+30: k=clamp(-30)=-20, e^-20+20-1 = 19.0 -> clamp 10
    assert_close(algos.kl_penalty(logp, ref, "low_var_kl"), t([10.0, 10.0]), atol=ATOL, rtol=0)


@pytest.mark.parametrize("kind", ["k4", "full", "low_var", "+"])
def test_kl_penalty_unknown_kind(kind):
    with pytest.raises(ValueError, match="low_var_kl"):
        algos.kl_penalty(t([0.0]), t([0.0]), kind)


# ---------------------------------------------------------------------------
# value loss
# ---------------------------------------------------------------------------


def test_value_loss_clipping():
    v = t([[1.0, 2.0, 2.0, 5.0]])
    R = t([[1.5, 0.0, 2.0, 100.0]])
    old = t([[1.2, 1.0, 0.0, 0.0]])
    m = t([[1, 1, 1, 0]])
    loss, clipfrac = algos.value_loss(v, R, old, m, cliprange_value=0.5)
    # t0: clip(1.0,[0.7,1.7])=1.0: (1-1.5)^2=0.25 both -> 0.25
    # t1: clip(2.0,[0.5,1.5])=1.5: (2-0)^2=4, (1.5-0)^2=2.25 -> 4 (unclipped wins)
    # t2: clip(2.0,[-0.5,0.5])=0.5: (2-2)^2=0, (0.5-2)^2=2.25 -> 2.25 (clipped wins)
    # 0.5*(0.25+4+2.25)/3 = 0.5*6.5/3 = 1.083333
    assert_close(loss, t(1.083333), atol=ATOL, rtol=0)
    assert clipfrac == pytest.approx(1.0 / 3.0, abs=ATOL)  # only t2
    loss, clipfrac = algos.value_loss(v, R, old, m, cliprange_value=None)
    # 0.5*(0.25+4+0)/3 = 0.708333
    assert_close(loss, t(0.708333), atol=ATOL, rtol=0)
    assert clipfrac == 0.0


# ---------------------------------------------------------------------------
# logits helpers
# ---------------------------------------------------------------------------


def test_entropy_uniform_and_peaked():
    # uniform over V=5 (any constant logit): H = ln 5 = 1.609438
    logits = torch.full((2, 3, 5), 7.0)
    assert_close(algos.entropy_from_logits(logits), torch.full((2, 3), 1.609438), atol=ATOL, rtol=0)
    # one-hot-ish [100, 0, 0]: p≈[1, e^-100, e^-100] -> H ≈ 2*101*e^-100 ≈ 0
    assert_close(algos.entropy_from_logits(t([100.0, 0.0, 0.0])), t(0.0), atol=1e-6, rtol=0)


def test_entropy_two_class_and_neg_inf():
    # logits [0, ln 3] -> p=[1/4, 3/4]: H = 0.25*ln4 + 0.75*ln(4/3) = 0.346574 + 0.215762 = 0.562335
    assert_close(algos.entropy_from_logits(t([0.0, math.log(3.0)])), t(0.562335), atol=ATOL, rtol=0)
    # a -inf logit has p=0 and contributes nothing (not NaN)
    z = t([0.0, math.log(3.0), float("-inf")]).requires_grad_(True)
    h = algos.entropy_from_logits(z)
    assert_close(h.detach(), t(0.562335), atol=ATOL, rtol=0)
    h.backward()
    assert torch.isfinite(z.grad).all()
    # half-precision logits are computed (and returned) in float32
    assert algos.entropy_from_logits(torch.zeros(4, dtype=torch.bfloat16)).dtype == torch.float32


def test_logprobs_from_logits():
    logits = t([[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]])
    labels = torch.tensor([0, 2])
    # row 0: logsumexp = 3 + ln(1 + e^-1 + e^-2) = 3 + ln(1.503215) = 3.407606 -> log p_0 = 1 - 3.407606
    # row 1: uniform -> -ln 3 = -1.098612
    expected = t([-2.407606, -1.098612])
    assert_close(algos.logprobs_from_logits(logits, labels), expected, atol=ATOL, rtol=0)
    # every class of row 0: [1,2,3] - 3.407606
    all_labels = torch.tensor([[0, 1, 2]])
    out = algos.logprobs_from_logits(logits[:1, None, :].expand(1, 3, 3), all_labels)
    assert_close(out, t([[-2.407606, -1.407606, -0.407606]]), atol=ATOL, rtol=0)


def test_logprobs_from_low_precision_logits_are_computed_in_float32():
    """bfloat16 logits (a GPU policy's) are upcast before logsumexp: over 1000 equal logits log p = -ln 1000 =
    -6.907755, which bfloat16 (8 bits of mantissa: steps of 0.03 near 7) can only round to -6.90625 or -6.9375."""
    for dtype in (torch.bfloat16, torch.float16):
        logits = torch.zeros(2, 1000, dtype=dtype)
        out = algos.logprobs_from_logits(logits, torch.tensor([0, 999]))
        assert out.dtype == torch.float32
        assert_close(out, torch.full((2,), -math.log(1000.0)), atol=1e-6, rtol=0)


# ---------------------------------------------------------------------------
# KL controllers
# ---------------------------------------------------------------------------


def test_fixed_kl_controller():
    ctl = algos.FixedKLController(0.05)
    ctl.update(123.0, 64)
    assert ctl.value == pytest.approx(0.05)


def test_adaptive_kl_controller_two_updates():
    ctl = algos.AdaptiveKLController(init_kl_coef=0.2, target_kl=0.1, horizon=100)
    ctl.update(0.15, 10)
    # e = clip(0.15/0.1 - 1 = 0.5, ±0.2) = 0.2; 0.2*(1 + 0.2*10/100) = 0.2*1.02 = 0.204
    assert ctl.value == pytest.approx(0.204, abs=1e-9)
    ctl.update(torch.tensor(0.09), 10)
    # e = 0.09/0.1 - 1 = -0.1; 0.204*(1 - 0.1*10/100) = 0.204*0.99 = 0.20196
    assert ctl.value == pytest.approx(0.20196, abs=1e-9)


def test_adaptive_kl_controller_bad_horizon():
    with pytest.raises(ValueError):
        algos.AdaptiveKLController(0.1, 0.1, horizon=0)


# ---------------------------------------------------------------------------
# DAPO pieces
# ---------------------------------------------------------------------------


def test_overlong_reward_penalty():
    lengths = torch.tensor([10, 16, 17, 18, 20])
    # expected = 20 - 4 = 16; exceed = [-6, 0, 1, 2, 4]
    # -exceed/4 = [1.5, 0, -0.25, -0.5, -1] -> min(., 0) = [0, 0, -0.25, -0.5, -1]
    out = algos.overlong_reward_penalty(lengths, max_response_length=20, buffer_len=4)
    assert_close(out, t([0.0, 0.0, -0.25, -0.5, -1.0]), atol=ATOL, rtol=0)
    # factor 0.5 at length 18: -2/4*0.5 = -0.25
    out = algos.overlong_reward_penalty(torch.tensor([18]), 20, 4, penalty_factor=0.5)
    assert_close(out, t([-0.25]), atol=ATOL, rtol=0)
    # buffer == max length is allowed: expected 0, length 5 -> -5/20 = -0.25
    assert_close(algos.overlong_reward_penalty([5], 20, 20), t([-0.25]), atol=ATOL, rtol=0)


@pytest.mark.parametrize("buffer_len", [0, -1, 21])
def test_overlong_reward_penalty_bad_buffer(buffer_len):
    with pytest.raises(ValueError):
        algos.overlong_reward_penalty(torch.tensor([1]), 20, buffer_len)


def test_informative_groups():
    uid = ["a", "a", "b", "b", "c", "d", "d", "d"]
    metric = t([1.0, 0.0, 1.0, 1.0, 0.0, 0.3, 0.3, 0.3], dtype=torch.float64)
    # a: {1,0} std 0.5 > 0 -> keep; b: {1,1} std 0 -> drop; c: singleton -> keep; d: {0.3}x3 -> drop
    expected = [True, True, False, False, True, False, False, False]
    out = algos.informative_groups(uid, metric)
    assert out.dtype == torch.bool
    assert out.tolist() == expected
    # integer accuracies in a plain list / numpy uids work too: x {1,1} drop, y {0,1} keep
    assert algos.informative_groups(np.array(["x", "x", "y", "y"]), [1, 1, 0, 1]).tolist() == [
        False,
        False,
        True,
        True,
    ]
