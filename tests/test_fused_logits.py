"""algos.token_logprob_entropy (one chunked log-sum-exp for the log-probs and the entropy, a recomputing backward)
against the unfused formulas (log_softmax gather, softmax-weighted entropy, autograd) in float32, with bounds
derived from the dtype and the vocabulary (tests/numerics.py), forward and backward, with chunks that cut the
positions unevenly (issue #25)."""

import pytest
import torch
from numerics import assert_within, tol

from rlkit import algos

pytestmark = pytest.mark.numerics  # rerun with the scalar kernels by .ci/run (tests/numerics.py)


@pytest.mark.parametrize("vocab", [275, 4099])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_fused_equals_unfused_forward_and_backward(monkeypatch, vocab, temperature):
    monkeypatch.setattr(algos, "LOGITS_CHUNK_BYTES", 4 * vocab * 7)  # 7 positions a chunk: 40 positions in 6 chunks
    g = torch.Generator().manual_seed(vocab)
    z = (4 * torch.randn(40, vocab, generator=g)).requires_grad_()  # |z| up to ~20, as a trained model's logits
    pos = torch.randint(0, 40, (60,), generator=g)  # positions serve several tokens (a shared prompt's last one)
    lab = torch.randint(0, vocab, (60,), generator=g)
    g_lp, g_ent = torch.randn(60, generator=g), torch.randn(40, generator=g)

    lp, ent = algos.token_logprob_entropy(z, pos, lab, temperature, True)
    (lp * g_lp).sum().add((ent * g_ent).sum()).backward()
    fused_grad, z.grad = z.grad, None
    zt = z / temperature
    want_lp = torch.log_softmax(zt, -1)[pos, lab]
    want_ent = algos.entropy_from_logits(zt)
    (want_lp * g_lp).sum().add((want_ent * g_ent).sum()).backward()

    # Bounds (numerics.tol: two evaluations of a sum of n terms of absolute total M differ by <= 12 sqrt(n) u M).
    # lse = m + log sum_v e^(z_v - m): the sum has V terms <= 1, total s >= 1, so log s moves by tol(V terms, total 1)
    # relative; then m + log s and z_y - lse each round once at the scale of |z|.
    zmax = zt.abs().max().item()
    spread = (zt.amax(-1) - zt.amin(-1)).max().item()
    lp_bound = tol(torch.float32, 1.0, vocab) + tol(torch.float32, 2 * zmax, 2)
    # H = log s - sum_v p_v (z_v - m): a second sum of V terms of total <= max(z - m) = the spread
    ent_bound = tol(torch.float32, 1.0, vocab) + tol(torch.float32, spread, vocab)
    assert_within(lp.detach(), want_lp.detach(), lp_bound, "log-prob, fused vs unfused")
    assert_within(ent.detach(), want_ent.detach(), ent_bound, "entropy, fused vs unfused")
    # dz_iv = (sum_{t at i} g_lp_t (1[v = y_t] - p_iv) - g_H_i p_iv (log p_iv + H_i)) / T, p_iv <= 1: p and log p
    # carry the log-prob bound (relative in p), H the entropy bound, |log p_iv + H_i| <= spread + log V
    g_pos = torch.zeros(40).index_add_(0, pos, g_lp.abs())
    log_v = torch.log(torch.tensor(float(vocab))).item()
    per_pos = lp_bound * (g_pos + g_ent.abs() * (spread + log_v)) + g_ent.abs() * (ent_bound + lp_bound)
    grad_bound = per_pos.max().item() / temperature + tol(torch.float32, fused_grad.abs().max().item(), 2)
    assert_within(fused_grad, z.grad, grad_bound, "gradient, fused vs unfused")
    assert grad_bound < 0.05 * fused_grad.abs().max()  # far below the gradient itself: a wrong term fails


def test_fused_without_entropy_equals_the_gather(monkeypatch):
    monkeypatch.setattr(algos, "LOGITS_CHUNK_BYTES", 4 * 275 * 3)
    g = torch.Generator().manual_seed(0)
    z = 4 * torch.randn(10, 275, generator=g)
    pos, lab = torch.arange(10), torch.randint(0, 275, (10,), generator=g)
    lp, ent = algos.token_logprob_entropy(z, pos, lab, 1.0, False)
    assert ent is None
    bound = tol(torch.float32, 1.0, 275) + tol(torch.float32, 2 * z.abs().max().item(), 2)
    assert_within(lp, algos.logprobs_from_logits(z, lab), bound, "log-prob without entropy, fused vs gather")


def test_bf16_gradient_of_a_confident_token_is_rounded_once(monkeypatch):
    """N8 (issue #36): the label's one-hot term used to be added after the chunk's gradient was rounded to bf16, so a
    token with p ~ 0.99 got bf16(bf16(-g p) + g): the true g (1 - p) ~ 0.01 g off by up to 2^-9 |g| (~40 %). Now the
    term joins in float32 and the entry is rounded once: within bf16's half-ulp, 2^-9 relative, of the exact value."""
    monkeypatch.setattr(algos, "LOGITS_CHUNK_BYTES", 4 * 64 * 3)  # 3 positions a chunk: the tokens cross chunks
    g = torch.Generator().manual_seed(0)
    z = torch.randn(8, 64, generator=g)
    pos = torch.arange(8)
    lab = torch.randint(0, 64, (8,), generator=g)
    z[pos, lab] += 9.0  # p(label) ~ 0.99 at every position
    z16 = z.to(torch.bfloat16).requires_grad_()
    g_lp = torch.linspace(1.0, 3.0, 8)
    lp, _ = algos.token_logprob_entropy(z16, pos, lab)
    (lp * g_lp).sum().backward()
    exact = z16.detach().double()
    exact = (torch.nn.functional.one_hot(lab, 64).double() - torch.softmax(exact, -1)) * g_lp.double()[:, None]  # dlp/dz
    got = z16.grad.double()[pos, lab]
    want = exact[pos, lab]
    assert (want.abs() < 0.05 * g_lp.double()).all()  # the confident case: g (1 - p) is a few % of g
    assert ((got - want).abs() <= 2**-8 * want.abs()).all(), ((got - want) / want).tolist()  # one rounding (+ float32 slack)


def test_cuda_chunks_are_larger_than_cpu_chunks():
    """N13: at V = 151,936 a 16 MiB chunk holds 27 positions (~150 chunks x ~10 kernels a pass: launch-bound on a GPU);
    on CUDA chunks are 128 MiB: 220 positions."""
    assert algos._chunk_rows(10**6, 151936, torch.device("cpu")) == 27
    assert algos._chunk_rows(10**6, 151936, torch.device("cuda")) == 220
    assert algos._chunk_rows(5, 151936, torch.device("cuda")) == 5
