"""The algorithm math of RL post-training, one short function per formula.

Everything here is pure torch and stateless (except the two KL controllers), so
each function can be read, tested and reused on its own.

Shape conventions
-----------------
    B  batch size (number of sampled responses)
    T  response length (padded)
    V  vocabulary size
    mask  (B, T), 1 for response tokens that count, 0 for padding.  Masks may be
          bool, int or float; they are cast to the dtype of the data.
    uid   (B,) group id of each sample: all responses to the same prompt share one
          id.  Any hashable values work (strings, ints, a numpy array, a tensor).
    scores (B,) one scalar outcome reward per response, s_i = sum_t r_{i,t}.

Float math is done in the dtype of the inputs (float32 or float64); only the
logit helpers upcast half-precision logits to float32.

Contents
--------
    masked statistics     masked_sum, masked_mean, masked_var, masked_whiten
    loss aggregation      agg_loss
    advantage estimators  grpo_advantage, rloo_advantage, reinforce_pp_advantage,
                          reinforce_pp_baseline_advantage, gae_advantage
    losses                ppo_clip_loss, value_loss, kl_penalty
    logit helpers         entropy_from_logits, logprobs_from_logits
    KL coefficient        FixedKLController, AdaptiveKLController
    DAPO pieces           overlong_reward_penalty, informative_groups
"""

from __future__ import annotations

import torch
from torch import Tensor

from rlkit.errors import ConfigError

__all__ = [
    "masked_sum",
    "masked_mean",
    "masked_var",
    "masked_whiten",
    "agg_loss",
    "LOSS_AGG_MODES",
    "group_ids",
    "grpo_advantage",
    "rloo_advantage",
    "reinforce_pp_advantage",
    "reinforce_pp_baseline_advantage",
    "gae_advantage",
    "ppo_clip_loss",
    "KL_KINDS",
    "kl_penalty",
    "value_loss",
    "entropy_from_logits",
    "logprobs_from_logits",
    "FixedKLController",
    "AdaptiveKLController",
    "overlong_reward_penalty",
    "informative_groups",
]


# ---------------------------------------------------------------------------
# Masked statistics
# ---------------------------------------------------------------------------


def masked_sum(x: Tensor, mask: Tensor, dim=None) -> Tensor:
    """sum_i x_i * m_i, over all entries (dim=None) or along `dim`.

    Entries where the mask is 0 contribute exactly 0, even if x holds inf/NaN
    there (padding positions often do).
    """
    mask = mask.to(x.dtype)
    x = torch.where(mask != 0, x * mask, torch.zeros_like(x))
    return x.sum() if dim is None else x.sum(dim)


def masked_mean(x: Tensor, mask: Tensor, dim=None) -> Tensor:
    """mean_m(x) = sum_i x_i m_i / (sum_i m_i + 1e-8).

    The 1e-8 makes a fully-masked tensor (or row, when `dim` is given) give 0
    instead of NaN.
    """
    mask = mask.to(x.dtype)
    count = mask.sum() if dim is None else mask.sum(dim)
    return masked_sum(x, mask, dim) / (count + 1e-8)


def masked_var(x: Tensor, mask: Tensor, unbiased: bool = True) -> Tensor:
    """Variance of the valid entries of x (whole tensor), as a 0-d tensor.

        var = sum_i m_i (x_i - mean_m(x))^2 / N          (unbiased=False)
        var = sum_i m_i (x_i - mean_m(x))^2 / (N - 1)    (unbiased=True, Bessel)

    with N = sum_i m_i.  Edge case: with N <= 1 valid entries the variance is
    not defined; we return 0 instead of raising (verl raises).  Whitening such a
    tensor then just subtracts the mean.
    """
    mask = mask.to(x.dtype)
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)  # already 0 when N <= 1
    if unbiased:
        n = mask.sum()
        var = var * n / (n - 1).clamp_min(1)  # N/(N-1); N<=1 keeps var = 0
    return var


def masked_whiten(x: Tensor, mask: Tensor, shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
    """Normalise x to zero mean, unit variance using statistics of its valid entries.

        x' = (x - mean_m(x)) / sqrt(var_m(x) + eps)        (shift_mean=True)
        x' = (x - mean_m(x)) / sqrt(var_m(x) + eps) + mean_m(x)  (shift_mean=False)

    Mean and (unbiased) variance are taken over the whole tensor, not per row.
    Padding positions are transformed too (not zeroed): multiply by the mask
    afterwards if you need zeros there.
    """
    mean = masked_mean(x, mask)
    var = masked_var(x, mask, unbiased=True)
    whitened = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return whitened


# ---------------------------------------------------------------------------
# Loss aggregation
# ---------------------------------------------------------------------------

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def agg_loss(
    loss_mat: Tensor,
    mask: Tensor,
    mode: str = "token-mean",
    num_tokens=None,
    num_seqs=None,
    norm_len=None,
) -> Tensor:
    """Reduce a per-token loss L (B, T) to a scalar.

    With m the mask, G = num_seqs and N = num_tokens:

        "token-mean"              sum_{i,t} L_it m_it / N
                                  (DAPO's token-level loss; N defaults to sum m)
        "seq-mean-token-sum"      1/G sum_i sum_t L_it m_it
        "seq-mean-token-mean"     1/G sum_i [ sum_t L_it m_it / (sum_t m_it + 1e-8) ]
                                  (the original GRPO sample-level loss)
        "seq-mean-token-sum-norm" 1/(G * norm_len) sum_i sum_t L_it m_it
                                  (Dr.GRPO: divide by a constant length instead of
                                  each response's own length)

    Defaults: N = sum m of *this* tensor (at least 1, so a fully-masked batch
    gives 0), G = B, norm_len = T = loss_mat.shape[-1].

    Gradient accumulation: pass the token count N (or sequence count G) of the
    whole mini-batch.  Then the losses of its micro-batches SUM to the loss of the
    mini-batch, and every token (or sequence) has the same weight no matter how
    the mini-batch was split.

    Note on "seq-mean-token-sum-norm": verl divides by norm_len only.  We also
    divide by G, as the Dr.GRPO paper does (1/G sum_i ...), so the loss scale
    does not grow with the batch size.

    Fully-masked rows contribute 0 in every mode.  Unknown mode -> ValueError.
    """
    mask = mask.to(loss_mat.dtype)
    if mode == "token-mean":
        if num_tokens is None:
            num_tokens = mask.sum().clamp_min(1)
        return masked_sum(loss_mat, mask) / num_tokens

    if num_seqs is None:
        num_seqs = loss_mat.shape[0]
    if mode == "seq-mean-token-sum":
        return masked_sum(loss_mat, mask, dim=-1).sum() / num_seqs
    if mode == "seq-mean-token-mean":
        return masked_mean(loss_mat, mask, dim=-1).sum() / num_seqs
    if mode == "seq-mean-token-sum-norm":
        if norm_len is None:
            norm_len = loss_mat.shape[-1]
        return masked_sum(loss_mat, mask, dim=-1).sum() / (num_seqs * norm_len)
    raise ValueError(f"unknown loss_agg_mode {mode!r}; valid modes: {', '.join(LOSS_AGG_MODES)}")


# ---------------------------------------------------------------------------
# Advantage estimators
# ---------------------------------------------------------------------------


def group_ids(uid) -> Tensor:
    """Map group ids to 0..G-1 in order of first appearance.

    `uid` is a list / tuple / numpy array / tensor of hashable values, e.g.
    ["a", "b", "a"] -> tensor([0, 1, 0]).  Returns a LongTensor (B,) on the CPU.
    """
    if hasattr(uid, "tolist"):  # numpy array or torch tensor
        uid = uid.tolist()
    index: dict = {}
    return torch.tensor([index.setdefault(u, len(index)) for u in uid], dtype=torch.long)


def _group_sums(scores: Tensor, uid):
    """Per-sample group index g (B,), and per-group count n_g and sum of scores (G,)."""
    if not scores.is_floating_point():
        scores = scores.float()
    g = group_ids(uid).to(scores.device)
    if g.numel() != scores.shape[0]:
        raise ValueError(f"got {g.numel()} uids for {scores.shape[0]} scores")
    num_groups = int(g.max()) + 1 if g.numel() else 0
    count = torch.bincount(g, minlength=num_groups).to(scores.dtype)
    total = scores.new_zeros(num_groups).index_add_(0, g, scores)
    return scores, g, count, total


def grpo_advantage(scores: Tensor, uid, norm_by_std: bool = True, eps: float = 1e-6) -> Tensor:
    """GRPO outcome advantage (Shao et al. 2024), one value per sample.

        A_i = (s_i - mean_g) / (std_g + eps)     (norm_by_std=True)
        A_i =  s_i - mean_g                      (norm_by_std=False, Dr.GRPO)

    where g is the group of sample i and std_g is the unbiased (N-1) standard
    deviation, as torch.std computes it.

    Edge cases: a singleton group uses mean=0, std=1, so its advantage is the
    raw score (/(1+eps)), as verl does.  A group whose scores are all equal
    gets advantage 0 (it carries no learning signal).

    scores (B,) -> advantages (B,).  Multiply by the mask after broadcasting,
    `A[:, None] * mask`, to get per-token advantages.
    """
    scores, g, count, total = _group_sums(scores, uid)
    mean = total / count
    sq_dev = scores.new_zeros(len(count)).index_add_(0, g, (scores - mean[g]) ** 2)
    std = (sq_dev / (count - 1).clamp_min(1)).sqrt()
    singleton = count == 1
    mean = mean.masked_fill(singleton, 0.0)
    std = std.masked_fill(singleton, 1.0)
    if norm_by_std:
        return (scores - mean[g]) / (std[g] + eps)
    return scores - mean[g]


def rloo_advantage(scores: Tensor, uid) -> Tensor:
    """REINFORCE leave-one-out advantage (Ahmadian et al. 2024).

        A_i = s_i - 1/(n-1) sum_{j in g, j != i} s_j

    i.e. the baseline of each sample is the mean score of the *other* n-1
    samples of its group.  Edge case: a singleton group (n=1) has no other
    samples; we use baseline 0, so A_i = s_i (verl's loop version does the same,
    its vectorised version returns 0).

    scores (B,) -> advantages (B,).
    """
    scores, g, count, total = _group_sums(scores, uid)
    n = count[g]
    leave_one_out_mean = (total[g] - scores) / (n - 1).clamp_min(1)
    return torch.where(n > 1, scores - leave_one_out_mean, scores)


def reinforce_pp_advantage(token_rewards: Tensor, mask: Tensor, gamma: float = 1.0):
    """REINFORCE++ (Hu 2025): discounted return, whitened over the whole batch.

        G_t = r_t + gamma * G_{t+1}      (computed backwards; G is reset to 0
                                          after the end of the response, so
                                          rewards on padding do not leak back)
        returns_t    = G_t
        advantages   = whiten_m(returns) * m

    A hole in the mask (m = 0 before the row's last valid token: a tool response
    in a multi-turn rollout) is skipped: G carries across it unchanged, so the
    earlier turns get the later turns' rewards (verl#7278).

    Whitening uses the mean / unbiased variance of all valid tokens in the batch
    (no per-prompt grouping, no critic).

    token_rewards, mask (B, T) -> (advantages, returns), both (B, T).
    """
    mask = mask.to(token_rewards.dtype)
    returns = torch.zeros_like(token_rewards)
    inside = mask.flip(-1).cumsum(-1).flip(-1).clamp(max=1)  # 1 up to the row's last valid token: holes, not padding
    running = torch.zeros_like(token_rewards[:, 0])
    for t in reversed(range(token_rewards.shape[1])):
        step = token_rewards[:, t] + gamma * running
        returns[:, t] = step
        running = step * mask[:, t] + running * (1 - mask[:, t]) * inside[:, t]  # valid: step; hole: carry; padding: reset
    advantages = masked_whiten(returns, mask) * mask
    return advantages, returns


def reinforce_pp_baseline_advantage(scores: Tensor, uid, mask: Tensor) -> Tensor:
    """REINFORCE++-baseline: subtract the group mean, then whiten over the batch.

        a_i      = s_i - mean_g           (mean_g = 0 for a singleton group)
        A_{i,t}  = a_i * m_{i,t}          (tile over the response)
        A        = whiten_m(A) * m        (whole-batch statistics over valid tokens)

    Because whitening is over tokens, longer responses weigh more in the
    statistics.  scores (B,), mask (B, T) -> advantages (B, T).
    """
    scores, g, count, total = _group_sums(scores, uid)
    mean = torch.where(count > 1, total / count, torch.zeros_like(total))
    mask = mask.to(scores.dtype)
    advantages = (scores - mean[g])[:, None] * mask
    return masked_whiten(advantages, mask) * mask


def gae_advantage(token_rewards: Tensor, values: Tensor, mask: Tensor, gamma: float = 1.0, lam: float = 1.0):
    """Generalised advantage estimation (Schulman et al. 2016) over valid tokens.

    Backwards over t, starting from V_next = 0 and A_next = 0 (no bootstrap
    past the last token):

        delta_t = r_t + gamma * V_next - V_t
        A_t     = delta_t + gamma * lam * A_next
        V_next  <- V_t if m_t else V_next       (masked tokens are skipped: they
        A_next  <- A_t if m_t else A_next        neither give a value nor a TD error)

    returns = A + V (with A *before* whitening) is the critic's target;
    advantages = whiten_m(A) * m (whole-batch statistics).  The final "* m"
    zeroes padding (verl leaves whitened garbage there; losses mask it anyway).

    token_rewards, values, mask (B, T) -> (advantages, returns), both (B, T).
    """
    mask = mask.to(values.dtype)
    advantages = torch.zeros_like(values)
    next_value = torch.zeros_like(values[:, 0])
    next_adv = torch.zeros_like(values[:, 0])
    for t in reversed(range(values.shape[1])):
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        adv = delta + gamma * lam * next_adv
        advantages[:, t] = adv
        m = mask[:, t]
        next_value = values[:, t] * m + (1 - m) * next_value
        next_adv = adv * m + (1 - m) * next_adv
    returns = advantages + values
    return masked_whiten(advantages, mask) * mask, returns


# ---------------------------------------------------------------------------
# Losses
# ---------------------------------------------------------------------------


def ppo_clip_loss(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float | None = 3.0,
    loss_agg_mode: str = "token-mean",
    num_tokens=None,
    num_seqs=None,
    norm_len=None,
):
    """PPO clipped surrogate loss (Schulman et al. 2017) with clip-higher and dual-clip.

        rho_t = exp(clamp(log pi - log pi_old, -20, 20))
        L1 = -A rho
        L2 = -A clip(rho, 1 - eps_low, 1 + eps_high)
        C1 = max(L1, L2)                           (standard PPO, as a loss)
        C2 = min(-A c, C1)                         (dual-clip, Ye et al. 2020)
        loss_t = C2 if A < 0 else C1
        loss = agg_loss(loss_t, mask, loss_agg_mode, ...)

    eps_high > eps_low is DAPO's "clip-higher".  Dual-clip bounds the loss of
    a negative-advantage token whose ratio has exploded at -A c; pass
    clip_ratio_c=None to disable it.  c must be > 1 (ValueError otherwise).

    Returns (loss, metrics) with metrics as python floats (masked means over
    this tensor's valid tokens):
        "pg_clipfrac"        fraction of tokens where the clip was active (L2 > L1)
        "pg_clipfrac_lower"  fraction where the dual clip was active (A < 0, C1 > -A c)
        "ppo_kl"             mean of log pi_old - log pi (approx. KL(pi_old || pi))
    """
    if clip_ratio_c is not None and not clip_ratio_c > 1.0:
        raise ConfigError(f"clip_ratio_c must be > 1 for dual-clip PPO (or None to disable), got {clip_ratio_c}")
    log_ratio = torch.clamp(log_prob - old_log_prob, -20.0, 20.0)
    ratio = torch.exp(log_ratio)

    loss1 = -advantages * ratio
    loss2 = -advantages * torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    clipped = torch.maximum(loss1, loss2)
    per_token = clipped
    dual_active = torch.zeros_like(clipped, dtype=torch.bool)
    if clip_ratio_c is not None:
        loss3 = -advantages * clip_ratio_c
        negative = advantages < 0
        per_token = torch.where(negative, torch.minimum(loss3, clipped), clipped)
        dual_active = negative & (clipped > loss3)

    loss = agg_loss(per_token, mask, loss_agg_mode, num_tokens=num_tokens, num_seqs=num_seqs, norm_len=norm_len)
    with torch.no_grad():
        metrics = {
            "pg_clipfrac": masked_mean((loss2 > loss1).to(ratio.dtype), mask).item(),
            "pg_clipfrac_lower": masked_mean(dual_active.to(ratio.dtype), mask).item(),
            "ppo_kl": masked_mean(-log_ratio, mask).item(),
        }
    return loss, metrics


KL_KINDS = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")


def kl_penalty(log_prob: Tensor, ref_log_prob: Tensor, kind: str = "low_var_kl") -> Tensor:
    """Per-token estimate of KL(pi || pi_ref) from sampled log-probs (Schulman 2020).

    With d = log pi - log pi_ref (tokens sampled from pi):

        "kl"  / "k1"          d                        unbiased, high variance, can be < 0
        "abs"                 |d|
        "mse" / "k2"          d^2 / 2                  biased, low variance
        "low_var_kl" / "k3"   clamp(e^k - k - 1, -10, 10) with k = clamp(-d, -20, 20)
                              unbiased, low variance, always >= 0

    Suffix "+" (e.g. "k3+", "low_var_kl+"): straight-through estimator.  The
    value is that of the named estimator, the gradient is that of k2 (d/dx of
    d^2/2 is d), which is an unbiased gradient of the KL:

        out = k2 - stopgrad(k2) + stopgrad(named)

    Returns a tensor shaped like log_prob.  Unknown kind -> ValueError.
    """
    straight_through = kind.endswith("+")
    base = kind[:-1] if straight_through else kind
    d = log_prob - ref_log_prob
    if base in ("kl", "k1"):
        value = d
    elif base == "abs":
        value = d.abs()
    elif base in ("mse", "k2"):
        value = 0.5 * d**2
    elif base in ("low_var_kl", "k3"):
        k = torch.clamp(-d, -20.0, 20.0)
        value = torch.clamp(torch.exp(k) - k - 1, -10.0, 10.0)
    else:
        valid = ", ".join(KL_KINDS)
        raise ConfigError(f"unknown KL kind {kind!r}; valid kinds: {valid} (each also with a '+' suffix)")
    if straight_through:
        k2 = 0.5 * d**2
        value = k2 - k2.detach() + value.detach()
    return value


def value_loss(
    vpreds: Tensor,
    returns: Tensor,
    old_values: Tensor,
    mask: Tensor,
    cliprange_value: float | None = 0.5,
    loss_agg_mode: str = "token-mean",
    num_tokens=None,
    num_seqs=None,
    norm_len=None,
):
    """Clipped value (critic) loss.

        v_clip = clip(v, v_old - c, v_old + c)
        loss   = 1/2 agg( max((v - R)^2, (v_clip - R)^2) )

    Taking the max means the clipped term can only make the loss larger: the
    critic gets no credit for moving further than c from its old prediction.
    cliprange_value=None disables clipping (plain 1/2 (v - R)^2).

    Returns (loss, clipfrac) where clipfrac is the fraction of valid tokens
    where the clipped term was strictly larger (a python float).
    """
    if cliprange_value is None:
        vpreds_clipped = vpreds
    else:
        vpreds_clipped = torch.clamp(vpreds, old_values - cliprange_value, old_values + cliprange_value)
    loss1 = (vpreds - returns) ** 2
    loss2 = (vpreds_clipped - returns) ** 2
    loss = 0.5 * agg_loss(torch.maximum(loss1, loss2), mask, loss_agg_mode, num_tokens=num_tokens, num_seqs=num_seqs, norm_len=norm_len)
    clipfrac = masked_mean((loss2 > loss1).to(loss1.dtype), mask).item()
    return loss, clipfrac


# ---------------------------------------------------------------------------
# Logit helpers
# ---------------------------------------------------------------------------


def _upcast(logits: Tensor) -> Tensor:
    """float16/bfloat16 -> float32; float32/float64 unchanged."""
    return logits if logits.dtype in (torch.float32, torch.float64) else logits.float()


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of softmax(z) at every position.

        H(z) = -sum_v p_v log p_v = logsumexp(z) - sum_v p_v z_v,   p = softmax(z)

    Both terms are computed stably (logsumexp and softmax subtract the max).
    -inf logits (masked vocabulary entries) contribute 0 instead of NaN.

    logits (..., V) -> entropy (...).
    """
    logits = _upcast(logits)
    logits = logits.clamp_min(torch.finfo(logits.dtype).min)  # -inf -> finite, so 0 * z = 0
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)


def logprobs_from_logits(logits: Tensor, labels: Tensor) -> Tensor:
    """log softmax(z)[y] = z_y - logsumexp(z), at every position.

    Computed without materialising the full log-softmax tensor.
    logits (..., V), labels (...) integer -> log-probs (...).
    """
    logits = _upcast(logits)
    picked = logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


# ---------------------------------------------------------------------------
# KL coefficient controllers (for a KL penalty inside the reward)
# ---------------------------------------------------------------------------


class FixedKLController:
    """Constant KL coefficient beta: `value` never changes."""

    def __init__(self, kl_coef: float):
        self.value = float(kl_coef)

    def update(self, current_kl, n_steps) -> None:
        pass


class AdaptiveKLController:
    """Adaptive KL coefficient (Ziegler et al. 2019, arXiv 1909.08593).

        e      = clip(KL_current / KL_target - 1, -0.2, 0.2)
        beta  <- beta * (1 + e * n_steps / horizon)

    beta grows when the measured KL is above target and shrinks when below;
    the clip bounds the proportional error at +-20%.
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: float):
        if target_kl <= 0 or horizon <= 0:
            raise ConfigError(f"target_kl and horizon must be > 0, got {target_kl} and {horizon}")
        self.value = float(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = float(horizon)

    def update(self, current_kl, n_steps) -> None:
        error = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon


# ---------------------------------------------------------------------------
# DAPO pieces (Yu et al. 2025)
# ---------------------------------------------------------------------------


def overlong_reward_penalty(response_length, max_response_length: int, buffer_len: int, penalty_factor: float = 1.0) -> Tensor:
    """DAPO soft overlong punishment, added to the outcome reward.

        L_expected = L_max - L_buffer
        penalty    = min( -(L - L_expected) / L_buffer * factor, 0 )

    So 0 up to L_expected, then a linear ramp down to -factor at L = L_max.
    response_length: (B,) numbers of valid response tokens -> penalty (B,) float.
    ValueError if buffer_len <= 0 or buffer_len > max_response_length.
    """
    if buffer_len <= 0 or buffer_len > max_response_length:
        raise ConfigError(
            f"need 0 < buffer_len <= max_response_length, got buffer_len={buffer_len}, max_response_length={max_response_length}"
        )
    length = torch.as_tensor(response_length)
    if not length.is_floating_point():
        length = length.float()
    exceed = length - (max_response_length - buffer_len)
    return torch.clamp(-exceed / buffer_len * penalty_factor, max=0.0)


def informative_groups(uid, metric) -> Tensor:
    """DAPO dynamic sampling filter: which samples to keep.

    A group whose metric (accuracy, score, ...) is the same for every sample has
    zero advantage under GRPO and so no gradient.  Keep sample i iff

        std_g(metric) > 0   (population std)   or   group g has one sample.

    "std > 0" is tested as max_g != min_g, which is the same condition but
    immune to rounding in the mean.  uid (B,), metric (B,) -> BoolTensor (B,).
    """
    metric = torch.as_tensor(metric)
    if not metric.is_floating_point():
        metric = metric.double()
    _, g, count, _ = _group_sums(metric, uid)
    num_groups = len(count)
    group_max = metric.new_zeros(num_groups).scatter_reduce(0, g, metric, "amax", include_self=False)
    group_min = metric.new_zeros(num_groups).scatter_reduce(0, g, metric, "amin", include_self=False)
    keep = (group_max > group_min) | (count == 1)
    return keep[g]
