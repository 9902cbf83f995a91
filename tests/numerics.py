"""Tolerances for comparing two floating-point computations of one quantity, derived instead of tuned.

Two code paths (packed vs padded rows, micro-batches of 1 vs 8, gradient checkpointing on vs off) or one path on
two CPUs (AVX-512, AVX2, NEON, SVE or the scalar kernels: `ATEN_CPU_CAPABILITY=default`) add the same terms in
different orders, so their results differ by rounding. A bound tuned on one CPU fails on another (entropy of the
tiny model, packed vs plain: 7.5e-6 with AVX-512, 1.28e-5 with AVX2, against an old atol of 1e-5). So every bound
between two code paths in tests/ is derived from one rule:

    a sum of n terms, added in any order in a dtype of unit roundoff u, is within  lam * sqrt(n) * u * sum_i |x_i|
    of the exact sum, with probability >= 1 - 2n exp(-lam^2 / 2)

(probabilistic rounding-error analysis, Higham & Mary, SIAM J. Sci. Comput. 2019; the worst case n * u is never
approached: rounding errors of a long sum behave like a random walk). With lam = 6 the failure probability is
< 3e-8 per term, and two evaluations are within twice the bound of each other: `tol(dtype, magnitude, n)`.
A network's output is a chain of such sums; `forward_terms` counts the terms on the path from the input to one
logit and treats the chain as one sum of that length at the scale of the output.

What the bounds still catch: every bound here is far below one rounding of the same quantity to bfloat16
(u = 2^-8), float16 or TF32 (u = 2^-11), so a step that silently runs in reduced precision fails, as does any
semantic bug (a token attending across a packed boundary, a shifted position id, a missing temperature or
normalisation), which moves log-probs by 1e-2 or more.

Comparisons of one code path with itself on the same shapes (the same kernels, the same order) stay exact
(`torch.equal`). The tests marked `numerics` run a second time in `.ci/run` with `ATEN_CPU_CAPABILITY=default`
(the scalar kernels), so a bound that holds only with one SIMD width fails in CI, not on a user's machine.
Set RLKIT_NUMERICS_LOG=FILE to append every measured difference and its bound to FILE (one JSON line each).
"""

import json
import math
import os

import torch

LAM = 6.0  # the probabilistic bound's lambda: P(a sum exceeds it) < 2n exp(-18) = 3e-8 n
UNIT_ROUNDOFF = {torch.float64: 2.0**-53, torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


def tol(dtype: torch.dtype, magnitude: float, n_terms: int) -> float:
    """Bound on |a - b| for two evaluations of one sum of n_terms terms whose absolute values add to `magnitude`.

    2 * LAM * sqrt(n) * u * magnitude   (each evaluation within half of it of the exact sum)
    """
    return 2 * LAM * math.sqrt(n_terms) * UNIT_ROUNDOFF[dtype] * magnitude


def forward_terms(config) -> int:
    """Terms on the path from the input to one logit of a Llama-style decoder, one sum per stage in series.

    Per layer: q/k/v (d), attention scores (head_dim), the weighted sum of values (<= max positions),
    o_proj (d), gate/up (d), down_proj (d_ff); then the head (d).
    """
    d, d_ff, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    head_dim = getattr(config, "head_dim", None) or d // config.num_attention_heads
    return layers * (3 * d + head_dim + config.max_position_embeddings + d_ff) + d


def logit_tol(config, max_logit: float, dtype: torch.dtype = torch.float32) -> float:
    """Bound on |dz| between two forward passes of one model over the same tokens (any batching, any kernels)."""
    return tol(dtype, max_logit, forward_terms(config))


def log_prob_tol(config, max_logit: float, dtype: torch.dtype = torch.float32) -> float:
    """Bound on |d log p_t| for log p_t = z_t - logsumexp(z) between two forward passes.

    d log p_t = dz_t - sum_v p_v dz_v  (<= 2 max|dz|), plus logsumexp's own sum of V positive terms
    (relative error, so absolute after the log: magnitude 1).
    """
    return 2 * logit_tol(config, max_logit, dtype) + tol(dtype, 1.0, config.vocab_size)


def entropy_tol(config, max_logit: float, max_entropy: float, dtype: torch.dtype = torch.float32) -> float:
    """Bound on |dH| for H = logsumexp(z) - sum_v p_v z_v between two forward passes.

    dH/dz_v = -p_v (log p_v + H), so the logits' error moves H by <= max|dz| * sum_v p_v |log p_v + H| <= 2 H max|dz|;
    the sum over V terms of |p_v z_v| <= max|z| adds its own rounding (the old 1e-5 bound ignored it).
    """
    return 2 * max_entropy * logit_tol(config, max_logit, dtype) + tol(dtype, max_logit, config.vocab_size)


def grad_tol(config, max_grad: float, n_tokens: int, dtype: torch.dtype = torch.float32) -> float:
    """Bound on |dg| for one weight's gradient between two backward passes (other micro-batches, packing, checkpointing).

    A gradient is a sum over the n_tokens tokens of a chain as long as the forward path (backward mirrors it), at the
    scale of the largest gradient entry.
    """
    return tol(dtype, max_grad, forward_terms(config) + n_tokens)


def max_abs_logit(model, batch, temperature: float = 1.0) -> float:
    """max |logits / T| of one padded forward pass over batch's input_ids: the scale of the log-prob bounds."""
    with torch.no_grad():
        out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], position_ids=batch["position_ids"])
    return out.logits.abs().max().item() / temperature


def tiny_log_prob_tol(max_logit: float = 20.0) -> float:
    """log_prob_tol of the embedded tiny models where a test has no model at hand (a whole recipe run): their
    |logits| at temperature 1 stay below 10 on the test prompts (measured 9.3), 20 leaves room for training."""
    from transformers import AutoConfig

    from rlkit import demos

    return log_prob_tol(AutoConfig.from_pretrained(demos.ARITH_MODEL), max_logit)


def max_abs_diff(a, b) -> float:
    """max |a - b| over tensors, lists of tensors or floats."""
    if isinstance(a, (list, tuple)):
        return max(max_abs_diff(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, torch.Tensor):
        return (a.detach().double() - b.detach().double()).abs().max().item()
    return abs(float(a) - float(b))


def assert_within(actual, expected, bound: float, what: str) -> None:
    """max |actual - expected| <= bound, naming the quantity; logs the measured difference (RLKIT_NUMERICS_LOG)."""
    diff = max_abs_diff(actual, expected)
    if path := os.environ.get("RLKIT_NUMERICS_LOG"):
        with open(path, "a") as f:
            row = {"what": what, "diff": diff, "bound": bound, "cpu": torch.backends.cpu.get_cpu_capability()}
            f.write(json.dumps(row) + "\n")
    assert diff <= bound, f"{what}: max |difference| {diff:.3g} > bound {bound:.3g}"
