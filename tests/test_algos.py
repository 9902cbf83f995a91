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

pytestmark = pytest.mark.numerics  # rerun with the scalar kernels by .ci/run (tests/numerics.py)

# Hand-derived values on short fp32 inputs: the worst-case rounding of a mean of n terms is n * u * mean|x|
# (u = 2^-24): <= 8 terms of |x| <= 4 in the hand-value tests (1.9e-6); the whitening test's 28 entries of mean |x| ~ 5
# give 8e-6 in the mean, 3e-6 after dividing by std 3. So 1e-5 holds in any summation order (any CPU), and a wrong
# formula (a missing Bessel factor, a wrong denominator) is off by >= 1e-2.
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
        ("token-sum", 7.0),  # 1+2+4 = 7, no normaliser
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


@pytest.mark.parametrize(
    "mode, default, given",
    [
        # row 0 valid [1, 2], row 1 fully masked.  default G = rows with a valid token = 1 (verl 0.9's local
        # fallback in agg_loss); a given G (verl's trainer passes the mini-batch's row count) is used as is.
        ("seq-mean-token-mean", 1.5, 0.75),  # row means 1.5, 0 -> 1.5/1 ; 1.5/2
        ("seq-mean-token-sum", 3.0, 1.5),  # row sums 3, 0 -> 3/1 ; 3/2
        ("seq-mean-token-sum-norm", 1.5, 0.75),  # 3/(1*T=2) ; 3/(2*2)  (verl 0.9, PR #5417, divides by G too)
        ("token-mean", 1.5, 1.5),  # 3/2 tokens either way
        ("token-sum", 3.0, 3.0),
    ],
)
def test_agg_loss_fully_masked_row_as_verl(mode, default, given):
    # Mirrors verl v0.9.0 (483b8a0) core_algos.agg_loss: default = its fallback (global_batch_size=None),
    # given = global_batch_size=2.
    loss, mask = t([[1.0, 2.0], [3.0, 4.0]]), t([[1, 1], [0, 0]])
    assert_close(algos.agg_loss(loss, mask, mode), t(default), atol=ATOL, rtol=0)
    assert_close(algos.agg_loss(loss, mask, mode, num_seqs=2), t(given), atol=ATOL, rtol=0)


def test_agg_loss_unknown_mode():
    with pytest.raises(ValueError, match="token-mean"):
        algos.agg_loss(L, M, "token-median")


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
    # row 0 backwards: t3 (m=0): ret 0, carry stays 0 (the 5 on padding is dropped)
    #                  t2: G=1+0.5*0=1; t1: G=0+0.5*1=0.5; t0: G=0.25
    # row 1 backwards: t3, t2 (m=0): 0, carry 0; t1: G=2; t0: G=0+0.5*2=1
    assert_close(ret, t([[0.25, 0.5, 1.0, 0.0], [1.0, 2.0, 0.0, 0.0]]), atol=ATOL, rtol=0)
    # valid returns 0.25, 0.5, 1, 1, 2: mean=4.75/5=0.95
    # deviations -0.7, -0.45, 0.05, 0.05, 1.05; squares sum 0.49+0.2025+0.0025+0.0025+1.1025=1.8
    # unbiased var=1.8/4=0.45, std=0.670820
    # -0.7/0.67082=-1.043498, -0.45/0.67082=-0.670820, 0.05/0.67082=0.074536, 1.05/0.67082=1.565248
    expected = t([[-1.043498, -0.670820, 0.074536, 0.0], [0.074536, 1.565248, 0.0, 0.0]])
    assert_close(adv, expected, atol=ATOL, rtol=0)


def test_reinforce_pp_carries_return_across_mask_holes():
    # verl v0.9.0 (483b8a0) compute_reinforce_plus_plus_outcome_advantage, PR #7300 (issue #7278):
    # [action, action, obs, obs, action, action]; the 7 sits on an observation token and is dropped.
    r = t([[0.0, 0.0, 0.0, 7.0, 0.0, 1.0]])
    m = t([[1, 1, 0, 0, 1, 1]])
    _, ret = algos.reinforce_pp_advantage(r, m, gamma=1.0)
    # gamma=1: the outcome 1 reaches every action token (the old reset gave [0, 0, 0, 0, 1, 1])
    assert_close(ret, t([[1.0, 1.0, 0.0, 0.0, 1.0, 1.0]]), atol=ATOL, rtol=0)
    adv, ret = algos.reinforce_pp_advantage(r, m, gamma=0.5)
    # backwards: t5 G=1; t4 G=0.5; t3, t2 (obs): ret 0, carry 0.5; t1 G=0.5*0.5=0.25; t0 G=0.125
    # (gamma applied once per action token, not per observation token)
    assert_close(ret, t([[0.125, 0.25, 0.0, 0.0, 0.5, 1.0]]), atol=ATOL, rtol=0)
    # whiten valid [0.125, 0.25, 0.5, 1]: mean 1.875/4=0.46875; squared deviations
    # 0.1181640625+0.0478515625+0.0009765625+0.2822265625=0.44921875; unbiased var 0.1497396, std 0.3869620
    # -0.34375/0.386962=-0.888330, -0.21875/0.386962=-0.565301, 0.03125/0.386962=0.080757, 0.53125/0.386962=1.372874
    assert_close(adv, t([[-0.888330, -0.565301, 0.0, 0.0, 0.080757, 1.372874]]), atol=ATOL, rtol=0)


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
    # t2 (masked): A2 = the carry 0 (verl stores the carry at masked tokens); next_value, next_adv stay 0
    # t1: delta=1+0.9*0-0.2=0.8, A1=0.8+0.72*0=0.8; next_value=0.2, next_adv=0.8
    # t0: delta=0+0.9*0.2-0.5=-0.32, A0=-0.32+0.72*0.8=0.256
    # returns = A + V = [0.256+0.5, 0.8+0.2, 0+3] = [0.756, 1.0, 3.0]   (verl v0.9.0 compute_gae_advantage_return)
    assert_close(ret, t([[0.756, 1.0, 3.0]]), atol=ATOL, rtol=0)
    # whiten over valid [0.256, 0.8]: mean 0.528, deviations ∓0.272,
    # unbiased var=2*0.272^2/1=0.147968, std=0.384666 -> ∓0.272/0.384666=∓0.707107; padding -> 0
    assert_close(adv, t([[-0.707107, 0.707107, 0.0]]), atol=ATOL, rtol=0)


def test_gae_skips_masked_middle_token():
    r = t([[0.0, 0.0, 1.0]])
    v = t([[0.5, 0.2, 0.4]])
    m = t([[1, 0, 1]])
    adv, ret = algos.gae_advantage(r, v, m, gamma=0.9, lam=0.8)
    # t2: delta=1+0-0.4=0.6, A2=0.6; next_value=0.4, next_adv=0.6
    # t1 (masked): A1 = the carry 0.6; next_* unchanged (0.4, 0.6)
    # t0: delta=0+0.9*0.4-0.5=-0.14, A0=-0.14+0.72*0.6=0.292   (bypasses token 1)
    # returns = [0.292+0.5, 0.6+0.2, 0.6+0.4] = [0.792, 0.8, 1.0]   (verl v0.9.0 compute_gae_advantage_return)
    assert_close(ret, t([[0.792, 0.8, 1.0]]), atol=ATOL, rtol=0)
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


# ---------------------------------------------------------------------------
# ReMax
# ---------------------------------------------------------------------------


def test_remax_advantage():
    # verl v0.9.0 (483b8a0) compute_remax_outcome_advantage: returns = reverse cumsum of r*m, A = returns - b*m
    r = t([[0.0, 0.0, 1.0], [0.0, 0.5, 9.0]])  # the 9 sits on padding and is dropped
    m = t([[1, 1, 1], [1, 1, 0]])
    b = t([0.5, 1.0])  # each row's greedy-response reward
    adv, ret = algos.remax_advantage(r, b, m)
    assert_close(ret, t([[1.0, 1.0, 1.0], [0.5, 0.5, 0.0]]), atol=ATOL, rtol=0)
    # row 0: 1 - 0.5 = 0.5 on every valid token; row 1: 0.5 - 1 = -0.5, padding 0
    assert_close(adv, t([[0.5, 0.5, 0.5], [-0.5, -0.5, 0.0]]), atol=ATOL, rtol=0)


# ---------------------------------------------------------------------------
# GSPO / CISPO / GMPO
# ---------------------------------------------------------------------------


def _gspo_case():
    # row 0: log-ratios 0.3, -0.1 (+ padding 0.4): mean 0.1 -> s0 = e^0.1 = 1.105171
    # row 1: log-ratios -0.2, 0.1, -0.5: mean -0.2 -> s1 = e^-0.2 = 0.818731
    logp = t([[0.3, -0.1, 0.4], [-0.2, 0.1, -0.5]]).requires_grad_(True)
    m = t([[1, 1, 0], [1, 1, 1]])
    adv = t([[2.0, 2.0, 2.0], [-1.0, -1.0, -1.0]])
    return logp, torch.zeros(2, 3), adv, m


@pytest.mark.parametrize("token_level", [False, True])
def test_gspo_unclipped_value_and_gradient(token_level):
    # Value equals verl v0.9.0 (483b8a0) compute_policy_loss_gspo with clip_ratio 0.2 (GSPO-token, seq-mean-token-mean).
    logp, old, adv, m = _gspo_case()
    loss, metrics = algos.gspo_loss(logp, old, adv, m, 0.2, 0.2, token_level=token_level)
    # row 0: A=2, s0 in [0.8, 1.2] -> L0 = -2*1.105171 = -2.210342; row 1: A=-1 -> L1 = 0.818731
    # seq-mean-token-mean: (-2.210342 + 0.818731)/2 = -0.695806
    assert_close(loss, t(-0.695806), atol=ATOL, rtol=0)
    assert metrics["pg_clipfrac"] == 0.0
    # ppo_kl = -mean(0.3, -0.1, -0.2, 0.1, -0.5) = 0.4/5 = 0.08
    assert math.isclose(metrics["ppo_kl"], 0.08, abs_tol=ATOL)
    loss.backward()
    # d/dlogp_0t = 1/2 * (-2) * s0/2 = -s0/2 = -0.552585 ; d/dlogp_1t = 1/2 * (-1)*(-1) * s1/3 = s1/6 = 0.136455
    expected = t([[-0.552585, -0.552585, 0.0], [0.136455, 0.136455, 0.136455]])
    assert_close(logp.grad, expected, atol=ATOL, rtol=0)


def test_gspo_clipped_sequences_have_no_gradient():
    logp, old, adv, m = _gspo_case()
    loss, metrics = algos.gspo_loss(logp, old, adv, m, 0.05, 0.05)
    # row 0: A>0, s0=1.105171 > 1.05 -> max(-2.210342, -2*1.05=-2.1) = -2.1
    # row 1: A<0, s1=0.818731 < 0.95 -> max(0.818731, 0.95) = 0.95 ; (-2.1+0.95)/2 = -0.575
    assert_close(loss, t(-0.575), atol=ATOL, rtol=0)
    assert metrics["pg_clipfrac"] == 1.0  # all 5 valid tokens
    loss.backward()
    assert torch.equal(logp.grad, torch.zeros(2, 3))


def test_gspo_token_variant_differs_only_with_per_token_advantages():
    logp, old, _, m = _gspo_case()
    adv = t([[2.0, 0.0, 0.0], [-1.0, -1.0, -1.0]])  # row 0: A varies along the response
    loss_tok, _ = algos.gspo_loss(logp, old, adv, m, 0.2, 0.2, token_level=True)
    (grad_tok,) = torch.autograd.grad(loss_tok, logp)
    loss_seq, _ = algos.gspo_loss(logp, old, adv, m, 0.2, 0.2, token_level=False)
    (grad_seq,) = torch.autograd.grad(loss_seq, logp)
    # values agree (linear in A): row 0 = mean(-2*s0, 0) = -1.105171, row 1 = 0.818731 -> -0.143220
    assert_close(loss_tok, t(-0.143220), atol=ATOL, rtol=0)
    assert_close(loss_seq, t(-0.143220), atol=ATOL, rtol=0)
    # GSPO-token: token t gets 1/2 * 1/2 * (-A_t s0): [-0.552585, 0]; GSPO: A_0 = mean = 1, both tokens
    # get 1/2 * (-1) * s0/2 = -0.276293
    assert_close(grad_tok[0], t([-0.552585, 0.0, 0.0]), atol=ATOL, rtol=0)
    assert_close(grad_seq[0], t([-0.276293, -0.276293, 0.0]), atol=ATOL, rtol=0)
    assert_close(grad_tok[1], grad_seq[1], atol=1e-7, rtol=0)  # constant A: same gradient


def test_new_loss_defaults_are_the_papers():
    assert (algos.GSPO_CLIP_RATIO_LOW, algos.GSPO_CLIP_RATIO_HIGH) == (3e-4, 4e-4)  # GSPO §5.1
    assert (algos.GMPO_CLIP_LOG_LOW, algos.GMPO_CLIP_LOG_HIGH) == (0.4, 0.4)  # GMPO: ratios in (e^-0.4, e^0.4)
    assert (algos.CISPO_CLIP_RATIO_LOW, algos.CISPO_CLIP_RATIO_HIGH) == (1.0, 0.2)  # no lower bound; verl example


def _cispo_case():
    # ratios 1.5, 0.5, 1.1 (+ padding); log pi = -1, -2, -0.5; A = 1, -1, 2
    logp = t([[-1.0, -2.0, -0.5, -3.0]]).requires_grad_(True)
    old = logp.detach() - t([[1.5, 0.5, 1.1, 7.0]]).log()
    return logp, old, t([[1.0, -1.0, 2.0, 1.0]]), t([[1, 1, 1, 0]])


def test_cispo_value_gradient_and_clipfrac():
    # Equals verl v0.9.0 (483b8a0) compute_policy_loss_cispo with the same clip ratios, token-mean.
    logp, old, adv, m = _cispo_case()
    loss, metrics = algos.cispo_loss(logp, old, adv, m)  # defaults: weight clipped to [0, 1.2]
    # w = [1.2 (clipped), 0.5, 1.1]; L = -w A log pi = [1.2, -1.0, 1.1] -> (1.2-1.0+1.1)/3 = 0.433333
    assert_close(loss, t(0.433333), atol=ATOL, rtol=0)
    assert math.isclose(metrics["pg_clipfrac"], 1 / 3, abs_tol=ATOL)
    # ppo_kl = -(ln1.5 + ln0.5 + ln1.1)/3 = -(0.405465-0.693147+0.095310)/3 = 0.064124
    assert math.isclose(metrics["ppo_kl"], 0.064124, abs_tol=ATOL)
    loss.backward()
    # dL/dlog pi = -sg(w) A / 3: [-0.4, 0.166667, -0.733333]; the clipped token KEEPS its gradient
    assert_close(logp.grad, t([[-0.4, 0.166667, -0.733333, 0.0]]), atol=ATOL, rtol=0)


def test_cispo_lower_bound():
    logp, old, adv, m = _cispo_case()
    loss, metrics = algos.cispo_loss(logp, old, adv, m, clip_ratio_low=0.2, clip_ratio_high=0.2)
    # w = [1.2, 0.8 (clipped up), 1.1]: L = [1.2, -0.8*(-1)*(-2) = -1.6, 1.1] -> 0.7/3 = 0.233333
    assert_close(loss, t(0.233333), atol=ATOL, rtol=0)
    assert math.isclose(metrics["pg_clipfrac"], 2 / 3, abs_tol=ATOL)


def test_gmpo_token_clip_in_log_space():
    # Equals verl v0.9.0 (483b8a0) compute_policy_loss_geo_mean with clip_ratio_low = clip_ratio_high = 0.4.
    logp = t([[0.5, -0.6, 0.1], [0.5, -0.6, 3.0]]).requires_grad_(True)
    old = torch.zeros(2, 3)
    adv = t([[1.0, 1.0, 1.0], [-2.0, -2.0, -2.0]])
    m = t([[1, 1, 1], [1, 1, 0]])
    loss, metrics = algos.gmpo_loss(logp, old, adv, m)
    # row 0, A>0: l~ = min(l, clip(l, -0.4, 0.4)) = [0.4, -0.6, 0.1] -> mean -0.1/3 -> r0 = e^-0.033333 = 0.967216
    # row 1, A<0: l~ = max(l, clip(l)) = [0.5, -0.4] -> mean 0.05 -> r1 = e^0.05 = 1.051271
    # L = [-1*0.967216, -(-2)*1.051271] = [-0.967216, 2.102542] -> mean 0.567663
    assert_close(loss, t(0.567663), atol=ATOL, rtol=0)
    # clipped log-ratios: row 0 tokens 0, 1 (A>0) and row 1 tokens 0, 1 (A<0), of 5 valid
    assert math.isclose(metrics["pg_clipfrac"], 0.4, abs_tol=ATOL)
    assert math.isclose(metrics["pg_clipfrac_lower"], 0.4, abs_tol=ATOL)
    assert math.isclose(metrics["ppo_kl"], 0.02, abs_tol=ATOL)  # -(0.5-0.6+0.1+0.5-0.6)/5
    loss.backward()
    # only the un-clipped terms move: row 0 tokens 1, 2: 1/2 * (-1) * r0/3 = -0.161203
    # row 1 token 0: 1/2 * 2 * r1/2 = 0.525636 ; token 1 sits at its clip value -0.4 -> 0
    assert_close(logp.grad, t([[0.0, -0.161203, -0.161203], [0.525636, 0.0, 0.0]]), atol=ATOL, rtol=0)


def test_forked_losses_take_norm_with_dp_size():
    """token-sum under data parallelism: x dp_size, as agg_loss does for every other term (verl: x dp_size)."""
    norm = algos.Norm(num_tokens=5, num_seqs=2, dp_size=2)
    logp, old, adv, m = _gspo_case()  # L = -2 s0 on 2 tokens, +s1 on 3: -4.420684 + 2.456193 = -1.964491
    loss, _ = algos.gspo_loss(logp, old, adv, m, 0.2, 0.2, loss_agg_mode="token-sum", norm=norm)
    assert_close(loss, t(2 * -1.964491), atol=ATOL, rtol=0)
    logp, old, adv, m = _cispo_case()  # L = [1.2, -1.0, 1.1]: sum 1.3
    loss, _ = algos.cispo_loss(logp, old, adv, m, loss_agg_mode="token-sum", norm=norm)
    assert_close(loss, t(2 * 1.3), atol=ATOL, rtol=0)
    logp = t([[0.5, -0.6, 0.1], [0.5, -0.6, 3.0]])  # test_gmpo_token_clip_in_log_space's case: L = [-0.967216, 2.102542]
    m = t([[1, 1, 1], [1, 1, 0]])  # on 3 and 2 tokens: -2.901648 + 4.205084 = 1.303436
    loss, _ = algos.gmpo_loss(logp, torch.zeros(2, 3), t([[1.0] * 3, [-2.0] * 3]), m, loss_agg_mode="token-sum", norm=norm)
    assert_close(loss, t(2 * 1.303436), atol=ATOL, rtol=0)
    # seq-mean-token-mean takes G from norm: GSPO's -0.695806 over 2 rows becomes -1.391612 / 4 rows
    logp, old, adv, m = _gspo_case()
    loss, _ = algos.gspo_loss(logp, old, adv, m, 0.2, 0.2, norm=algos.Norm(num_tokens=5, num_seqs=4, dp_size=2))
    assert_close(loss, t(-1.391612 / 4), atol=ATOL, rtol=0)


# ---------------------------------------------------------------------------
# rollout-vs-trainer mismatch and its correction
# ---------------------------------------------------------------------------


def _mismatch_case():
    # Delta = log pi - log mu: row 0 [0.1, -0.2, 0.0]; row 1 [1.0, -1.0] + padding (Delta 5)
    mu = t([[-1.0, -2.0, -0.5], [-1.5, -0.3, -4.0]])
    pi = mu + t([[0.1, -0.2, 0.0], [1.0, -1.0, 5.0]])
    return pi, mu, t([[1, 1, 1], [1, 1, 0]])


def test_rollout_mismatch_metrics():
    # Formulas of verl v0.9.0 (483b8a0) rollout_corr_helper.compute_offpolicy_metrics / compute_is_metrics.
    pi, mu, m = _mismatch_case()
    got = algos.rollout_mismatch_metrics(pi, mu, m, threshold=2.0)
    expected = {
        "abs_diff_mean": 0.46,  # (0.1+0.2+0+1+1)/5
        "abs_diff_max": 1.0,  # padding's 5 ignored
        "kl": 0.02,  # -(0.1-0.2+0+1-1)/5
        # (e^0.1-1.1) + (e^-0.2-0.8) + 0 + (e-2) + (e^-1) = 0.005171+0.018731+0.718282+0.367879 -> /5
        "k3_kl": 0.222013,
        "log_ppl_diff": 1 / 60,  # rows: -mean Delta = 0.1/3 and 0 -> mean 0.016667
        "log_ppl_abs_diff": 1 / 60,
        "ppl_ratio": 1.016948,  # (e^(1/30) + e^0)/2
        "chi2_token": 1.083223,  # (e^0.2 + e^-0.4 + 1 + e^2 + e^-2)/5 - 1
        "ratio_fraction_high": 0.2,  # rho > 2: only e^1
        "ratio_fraction_low": 0.2,  # rho < 1/2: only e^-1
    }
    assert set(got) == {"rollout_corr/" + k for k in expected}
    for k, v in expected.items():
        assert math.isclose(got["rollout_corr/" + k], v, abs_tol=ATOL), k


def test_rollout_mismatch_metrics_use_the_log_ratio_unclamped_as_verl():
    """verl's compute_offpolicy_metrics clamps Delta to +-20 only for chi2 (and the weights): kl, k3_kl and the
    perplexity ratios see a token 30 nats off as 30, not 20."""
    mu = t([[-31.0, -1.0], [-2.0, -0.5]])
    pi = mu + t([[30.0, 0.0], [0.0, 7.0]])  # row 1's last token is padding (its Delta 7 is ignored)
    m = t([[1, 1], [1, 0]])
    got = {k.removeprefix("rollout_corr/"): v for k, v in algos.rollout_mismatch_metrics(pi, mu, m).items()}
    assert math.isclose(got["abs_diff_mean"], 10.0, rel_tol=1e-6) and got["abs_diff_max"] == 30.0  # 30/3
    assert math.isclose(got["kl"], -10.0, rel_tol=1e-6)  # -(30 + 0 + 0)/3 (clamped: -20/3)
    # (e^30 - 30 - 1 + 0 + 0)/3 = 3.5622e12 (clamped: (e^20 - 21)/3 = 1.6174e8); float32: 7 digits
    assert math.isclose(got["k3_kl"], (math.exp(30) - 31) / 3, rel_tol=1e-5)
    # rows: -mean Delta = -15 and 0 -> log_ppl_diff -7.5, abs 7.5, ppl_ratio (e^-15 + 1)/2 (clamped: -5, 5, (e^-10 + 1)/2)
    assert math.isclose(got["log_ppl_diff"], -7.5, rel_tol=1e-6) and math.isclose(got["log_ppl_abs_diff"], 7.5, rel_tol=1e-6)
    assert math.isclose(got["ppl_ratio"], (math.exp(-15) + 1) / 2, rel_tol=1e-6)
    assert math.isclose(got["chi2_token"], (math.exp(40) + 1 + 1) / 3 - 1, rel_tol=1e-5)  # chi2 keeps verl's clamp: e^(2*20)


def test_rollout_mismatch_metrics_zero_for_identical_log_probs():
    pi, _, m = _mismatch_case()
    got = algos.rollout_mismatch_metrics(pi, pi.clone(), m, prefix="mm/")
    assert got["mm/ppl_ratio"] == 1.0
    assert all(v == 0.0 for k, v in got.items() if k != "mm/ppl_ratio")


def test_token_tis_and_mis_weights():
    # verl v0.9.0 (483b8a0) compute_rollout_correction_weights(rollout_is="token", threshold 2.0 / "0.5_2.0")
    pi, mu, m = _mismatch_case()
    pi.requires_grad_(True)
    w = algos.token_tis_weights(pi, mu, m, cap=2.0)
    assert not w.requires_grad  # detached
    # rho = [e^0.1, e^-0.2, 1 | e^1 -> capped 2, e^-1, padding 0]
    assert_close(w, t([[1.105171, 0.818731, 1.0], [2.0, 0.367879, 0.0]]), atol=ATOL, rtol=0)
    w = algos.token_mis_weights(pi, mu, m, low=0.5, high=2.0)
    # e^1 > 2 and e^-1 < 0.5 are zeroed, the rest keep rho
    assert_close(w, t([[1.105171, 0.818731, 1.0], [0.0, 0.0, 0.0]]), atol=ATOL, rtol=0)


def test_sequence_is_weights_and_geo_mask():
    pi, mu, m = _mismatch_case()
    # product ratios: row 0 e^(0.1-0.2+0) = e^-0.1 = 0.904837; row 1 e^(1-1) = 1 (padding excluded)
    w = algos.seq_tis_weights(pi, mu, m, cap=0.95)
    assert_close(w, t([[0.904837] * 3, [0.95, 0.95, 0.0]]), atol=ATOL, rtol=0)
    w = algos.seq_mis_weights(pi, mu, m, low=0.95, high=2.0)
    assert_close(w, t([[0.0, 0.0, 0.0], [1.0, 1.0, 0.0]]), atol=ATOL, rtol=0)
    # geometric means: row 0 e^(-0.1/3) = 0.967216, row 1 e^0 = 1
    assert torch.equal(algos.geo_mask(pi, mu, m), t([[0, 0, 0], [1, 1, 0]]))  # [0.999, 1.001]
    assert torch.equal(algos.geo_mask(pi, mu, m, 0.95, 1.05), m)


def test_is_weight_metrics():
    pi, mu, m = _mismatch_case()
    got = algos.is_weight_metrics(algos.token_tis_weights(pi, mu, m), m)
    # valid w = e^0.1, e^-0.2, 1, 2, e^-1: mean 5.291781/5 = 1.058356
    # ESS = mean^2 / mean(w^2) = 1.120118 / ((1.221403+0.670320+1+4+0.135335)/5 = 1.405412) = 0.797003
    expected = {"is_mean": 1.058356, "is_max": 2.0, "is_min": 0.367879, "is_ess": 0.797003, "is_zero_fraction": 0.0}
    for k, v in expected.items():
        assert math.isclose(got["rollout_corr/" + k], v, abs_tol=ATOL), k
    got = algos.is_weight_metrics(algos.token_mis_weights(pi, mu, m), m)
    assert math.isclose(got["rollout_corr/is_zero_fraction"], 0.4, abs_tol=ATOL)  # 2 of 5 masked
    assert math.isclose(got["rollout_corr/is_mean"], 0.584780, abs_tol=ATOL)  # (e^0.1 + e^-0.2 + 1)/5


def test_rollout_correction_modes():
    pi, mu, m = _mismatch_case()
    w, mask, metrics = algos.rollout_correction(pi, mu, m, "none")
    assert w is None and mask is m and "rollout_corr/k3_kl" in metrics and "rollout_corr/is_mean" not in metrics
    w, mask, metrics = algos.rollout_correction(pi, mu, m, "token-tis")
    assert torch.equal(w, algos.token_tis_weights(pi, mu, m, 2.0)) and mask is m
    assert math.isclose(metrics["rollout_corr/is_max"], 2.0)
    w, _, _ = algos.rollout_correction(pi, mu, m, "seq-mis", threshold=(0.95, 2.0))
    assert torch.equal(w, algos.seq_mis_weights(pi, mu, m, 0.95, 2.0))
    w, mask, metrics = algos.rollout_correction(pi, mu, m, "geo-mask")
    assert w is None and torch.equal(mask, t([[0, 0, 0], [1, 1, 0]]))
    assert math.isclose(metrics["rollout_corr/masked_fraction"], 0.6, abs_tol=ATOL)  # 3 of 5 valid tokens
    with pytest.raises(ValueError, match="token-tis"):
        algos.rollout_correction(pi, mu, m, "tis")


def test_rollout_correction_tis_modes_use_the_given_cap():
    """--actor.rollout-is-cap C reaches the -tis weights (a cap other than the default 2.0 changes them)."""
    pi, mu, m = _mismatch_case()  # token ratios e^0.1, e^-0.2, 1 | e^1, e^-1; sequence ratios e^-0.1, e^0
    w, _, metrics = algos.rollout_correction(pi, mu, m, "token-tis", threshold=1.5)
    assert_close(w, t([[math.exp(0.1), math.exp(-0.2), 1.0], [1.5, math.exp(-1), 0.0]]), atol=ATOL, rtol=0)
    assert math.isclose(metrics["rollout_corr/is_max"], 1.5, abs_tol=ATOL)
    w, _, _ = algos.rollout_correction(pi, mu, m, "seq-tis", threshold=0.95)
    assert_close(w, t([[math.exp(-0.1)] * 3, [0.95, 0.95, 0.0]]), atol=ATOL, rtol=0)


def test_cispo_loss_defaults_to_token_mean_over_rows_of_different_lengths():
    """The paper's 1/sum_i |y_i|: a 1-token row and a 3-token row weigh their tokens alike (seq-mean would not)."""
    logp = t([[-1.0, 0.0, 0.0], [-2.0, -0.5, -0.25]])
    m, adv = t([[1, 0, 0], [1, 1, 1]]), t([[1.0] * 3, [1.0] * 3])
    loss, _ = algos.cispo_loss(logp, logp, adv, m)  # on-policy: w = 1, L_t = -log pi_t
    assert_close(loss, t((1.0 + 2.0 + 0.5 + 0.25) / 4), atol=ATOL, rtol=0)  # seq-mean-token-mean: (1 + 2.75/3)/2 = 0.958333


def test_group_advantages_refuse_a_uid_list_of_another_length():
    with pytest.raises(ValueError, match="got 3 uids for 4 scores"):
        algos.grpo_advantage(t([1.0, 0.0, 1.0, 0.0]), ["a", "a", "b"])
    with pytest.raises(ValueError, match="got 5 uids for 4 scores"):
        algos.rloo_advantage(t([1.0, 0.0, 1.0, 0.0]), ["a", "a", "b", "b", "b"])


# ---------------------------------------------------------------------------
# decoupled PPO (proximal vs behaviour policy)
# ---------------------------------------------------------------------------


def test_decoupled_ppo_loss():
    logp, prox, adv, m = _ppo_case()  # u = pi/pi_prox = [1.1, 1.5, 0.5, 5.0, 10.0]
    logp.requires_grad_(True)
    behav = prox - t([[2.0, 0.5, 1.0, 4.0, 1.0]]).log()  # behaviour weights pi_prox/mu = 2, 0.5, 1, 4
    loss, metrics = algos.decoupled_ppo_loss(logp, prox, behav, adv, m, 0.2, 0.2, 3.0)
    # per-token PPO losses (see test_ppo_clip_no_clip_clip_and_dual_clip): [-1.1, -1.2, 0.8, 3.0]
    # times w: [-2.2, -0.6, 0.8, 12.0] -> 10/4 = 2.5
    assert_close(loss, t(2.5), atol=ATOL, rtol=0)
    assert math.isclose(metrics["behav_weight_mean"], 1.875, abs_tol=ATOL)  # (2+0.5+1+4)/4
    (grad,) = torch.autograd.grad(loss, logp)
    # only token a is unclipped: d/dlogp (-A u w)/4 = -1*1.1*2/4 = -0.55
    assert_close(grad, t([[-0.55, 0.0, 0.0, 0.0, 0.0]]), atol=ATOL, rtol=0)
    loss, metrics = algos.decoupled_ppo_loss(logp, prox, behav, adv, m, 0.2, 0.2, 3.0, behav_cap=3.0)
    # w_d capped at 3: [-2.2, -0.6, 0.8, 9.0] -> 7/4 = 1.75
    assert_close(loss, t(1.75), atol=ATOL, rtol=0)
    assert metrics["behav_weight_max"] == 3.0


def test_decoupled_ppo_is_ppo_when_behaviour_is_proximal():
    logp, prox, adv, m = _ppo_case()
    loss, _ = algos.decoupled_ppo_loss(logp, prox, prox.clone(), adv, m, 0.2, 0.28, 3.0)
    ref, _ = algos.ppo_clip_loss(logp, prox, adv, m, 0.2, 0.28, 3.0)
    assert torch.equal(loss, ref)


def test_loss_weights_are_detached():
    logp, old, adv, m = _ppo_case()
    logp.requires_grad_(True)
    w = t([[2.0, 1.0, 1.0, 1.0, 1.0]]).requires_grad_(True)
    for loss_fn in (algos.ppo_clip_loss, algos.cispo_loss, algos.gspo_loss, algos.gmpo_loss):
        loss, _ = loss_fn(logp, old, adv, m, weights=w)
        loss.backward()
        assert w.grad is None, loss_fn.__name__  # the weight rescales the gradient, it gets none
    # and it rescales: token a (unclipped, A=+1, u=1.1) with w=2 -> d/dlogp = -2*1.1/4 = -0.55
    logp.grad = None
    loss, _ = algos.ppo_clip_loss(logp, old, adv, m, 0.2, 0.2, 3.0, weights=w)
    loss.backward()
    assert_close(logp.grad, t([[-0.55, 0.0, 0.0, 0.0, 0.0]]), atol=ATOL, rtol=0)


def test_token_sum_counts_every_data_parallel_process_once():
    """Gradients are averaged over P processes: token-sum multiplies by P (verl's dp_size) so the average of the
    processes' sums is the global sum; the token and sequence means do not change."""
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    assert algos.agg_loss(loss, mask, "token-sum", norm=algos.Norm(5, 2)).item() == 12.0
    assert algos.agg_loss(loss, mask, "token-sum", norm=algos.Norm(5, 2, dp_size=2)).item() == 24.0
    assert algos.agg_loss(loss, mask, "token-mean", norm=algos.Norm(5, 2, dp_size=2)).item() == pytest.approx(12.0 / 5)
