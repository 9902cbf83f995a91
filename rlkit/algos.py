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
                          reinforce_pp_baseline_advantage, gae_advantage, remax_advantage
    losses                ppo_clip_loss, value_loss, kl_penalty
    new policy losses     gspo_loss (and GSPO-token), cispo_loss, gmpo_loss
    off-policy            rollout_mismatch_metrics, token_tis_weights, token_mis_weights,
                          seq_tis_weights, seq_mis_weights, geo_mask, is_weight_metrics,
                          rollout_correction, rollout_weights, decoupled_ppo_loss
    logit helpers         entropy_from_logits, logprobs_from_logits
    KL coefficient        FixedKLController, AdaptiveKLController
    DAPO pieces           overlong_reward_penalty, informative_groups
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from rlkit.errors import ConfigError

__all__ = [
    "masked_sum",
    "masked_mean",
    "masked_var",
    "masked_whiten",
    "Norm",
    "agg_loss",
    "LOSS_AGG_MODES",
    "group_ids",
    "grpo_advantage",
    "rloo_advantage",
    "reinforce_pp_advantage",
    "reinforce_pp_baseline_advantage",
    "gae_advantage",
    "remax_advantage",
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
    "GSPO_CLIP_RATIO_LOW",
    "GSPO_CLIP_RATIO_HIGH",
    "gspo_loss",
    "CISPO_CLIP_RATIO_LOW",
    "CISPO_CLIP_RATIO_HIGH",
    "cispo_loss",
    "GMPO_CLIP_LOG_LOW",
    "GMPO_CLIP_LOG_HIGH",
    "gmpo_loss",
    "SAFETY_BOUND",
    "rollout_mismatch_metrics",
    "token_tis_weights",
    "token_mis_weights",
    "seq_tis_weights",
    "seq_mis_weights",
    "geo_mask",
    "is_weight_metrics",
    "CORRECTION_MODES",
    "CORRECTION_DEFAULTS",
    "rollout_correction",
    "rollout_weights",
    "decoupled_ppo_loss",
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

LOSS_AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


@dataclass(frozen=True)
class Norm:
    """The normalisers of a loss: N = num_tokens and G = num_seqs of the whole mini-batch (see agg_loss).

    The engine passes one to the loss function of every micro-batch, so that the micro-batch losses
    add up to the mini-batch loss, whatever the split.
    """

    num_tokens: float
    num_seqs: float
    dp_size: int = 1
    """processes whose gradients are averaged (data parallel): "token-sum" multiplies by it, so the average of the
    processes' sums is the global sum, as verl does with dp_size"""


def agg_loss(
    loss_mat: Tensor,
    mask: Tensor,
    mode: str = "token-mean",
    num_tokens=None,
    num_seqs=None,
    norm_len=None,
    norm: Norm | None = None,
) -> Tensor:
    """Reduce a per-token loss L (B, T) to a scalar.

    With m the mask, G = num_seqs and N = num_tokens:

        "token-mean"              sum_{i,t} L_it m_it / N
                                  (DAPO's token-level loss; N defaults to sum m)
        "token-sum"               sum_{i,t} L_it m_it
                                  (no normaliser: the gradient grows with the token count)
        "seq-mean-token-sum"      1/G sum_i sum_t L_it m_it
        "seq-mean-token-mean"     1/G sum_i [ sum_t L_it m_it / (sum_t m_it + 1e-8) ]
                                  (the original GRPO sample-level loss)
        "seq-mean-token-sum-norm" 1/(G * norm_len) sum_i sum_t L_it m_it
                                  (Dr.GRPO: divide by a constant length instead of
                                  each response's own length)

    Defaults: N = sum m of *this* tensor, G = the number of rows of this tensor
    with at least one valid token (both at least 1, so a fully-masked batch
    gives 0), norm_len = T = loss_mat.shape[-1].  These defaults are verl 0.9's
    local fallback (agg_loss without global batch info).

    Gradient accumulation: pass the token count N (or sequence count G) of the
    whole mini-batch, or both as `norm` (a Norm, as the engine gives it).  Then the losses of its micro-batches SUM to the loss of the
    mini-batch, and every token (or sequence) has the same weight no matter how
    the mini-batch was split.  A passed G is used as given: verl's trainer passes
    the mini-batch's row count, fully-masked rows included, and so does rlkit's
    engine.  "token-sum" needs no count; under data parallelism (gradients
    averaged over P processes) the caller multiplies it by P, as verl does with
    dp_size.

    Fully-masked rows contribute 0 to the numerator in every mode.  Unknown mode
    -> ValueError.
    """
    dp_size = 1
    if norm is not None:
        num_tokens, num_seqs, dp_size = norm.num_tokens, norm.num_seqs, norm.dp_size
    mask = mask.to(loss_mat.dtype)
    if mode == "token-mean":
        if num_tokens is None:
            num_tokens = mask.sum().clamp_min(1)
        return masked_sum(loss_mat, mask) / num_tokens
    if mode == "token-sum":
        return masked_sum(loss_mat, mask) * dp_size

    if num_seqs is None:
        num_seqs = (mask.sum(-1) > 0).sum().clamp_min(1)  # rows with a valid token
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


# --- turn-level credit for multi-turn episodes (recipes/grpo_tools.py --turn-credit, docs/agents.md) ---
# rewards (B, T): row i's reward for its turn k (rlkit.agent.turn_rewards: the env's step reward, plus the scorer's
# score on the last turn); exists (B, T): whether row i had a turn k (an episode's turns are 0..K_i-1);
# keys (B, T): a hash of the observation turn k answered. Each returns advantages (B, T), 0 where no turn;
# turn_token_advantages puts them on the tokens.


def turn_returns(rewards: Tensor, exists: Tensor, gamma: float = 1.0) -> Tensor:
    """Discounted return-to-go over turns: G_ik = r_ik + gamma * G_i,k+1, and 0 past the episode's last turn."""
    G, carry = torch.zeros_like(rewards), rewards.new_zeros(rewards.shape[0])
    for k in reversed(range(rewards.shape[1])):
        carry = (rewards[:, k] + gamma * carry) * exists[:, k]
        G[:, k] = carry
    return G


def _turn_groups(uid, exists: Tensor, keys: Tensor | None = None):
    """The existing turns (rows b, turns k) and their group ids: (uid, k), or (uid, key) when keys are given."""
    b, k = exists.nonzero(as_tuple=True)
    g = group_ids(uid)[b].tolist()
    second = (keys[b, k] if keys is not None else k).tolist()
    return b, k, list(zip(g, second))


def return_to_go_advantage(rewards: Tensor, exists: Tensor, uid, gamma: float = 1.0, norm_by_std: bool = True, eps: float = 1e-6):
    """Each turn's discounted return-to-go against its group's episode returns (GRPO's statistics):

        A_ik = (G_ik - mean_g(G_.0)) / (std_g(G_.0) + eps),   G_ik = sum_{l>=k} gamma^(l-k) r_il

    std_g unbiased, singleton groups mean 0 and std 1, as grpo_advantage; norm_by_std=False: no division. With gamma=1
    and a reward on the last turn only, G_ik = G_i0 and this is the outcome advantage on every turn."""
    G = turn_returns(rewards.float(), exists, gamma)
    G0 = G[:, 0]
    g = group_ids(uid).to(G.device)
    count = torch.bincount(g).to(G.dtype)
    mean = G0.new_zeros(len(count)).index_add_(0, g, G0) / count
    std = (G0.new_zeros(len(count)).index_add_(0, g, (G0 - mean[g]) ** 2) / (count - 1).clamp_min(1)).sqrt()
    mean, std = mean.masked_fill(count == 1, 0.0), std.masked_fill(count == 1, 1.0)
    adv = (G - mean[g][:, None]) / (std[g][:, None] + eps) if norm_by_std else G - mean[g][:, None]
    return adv * exists


def step_group_advantage(
    rewards: Tensor, exists: Tensor, uid, keys: Tensor, gamma: float = 1.0, omega: float = 1.0, norm_by_std: bool = True
):
    """GiGPO (Feng et al. 2025): the episode's group advantage plus a step advantage within its anchor-state group:

        A_ik = A^E_i + omega * A^S_ik
        A^E_i  = grpo_advantage(sum_l r_il over the uid group)
        A^S_ik = grpo_advantage(G_ik over the step group {(j, l): uid_j = uid_i, key_jl = key_ik}),  0 for a
                 step group of one (no other turn answered the same observation: no step-level comparison)

    G_ik is the discounted return-to-go (turn_returns); keys: the observation hashes (identical observations, one group)."""
    G = turn_returns(rewards.float(), exists, gamma)
    episode = grpo_advantage(rewards.float().mul(exists).sum(1), uid, norm_by_std)
    b, k, groups = _turn_groups(uid, exists, keys)
    step = grpo_advantage(G[b, k], groups, norm_by_std)
    size = torch.bincount(group_ids(groups))[group_ids(groups)]
    adv = torch.zeros_like(G)
    adv[b, k] = episode[b] + omega * torch.where(size > 1, step, torch.zeros_like(step))
    return adv


def per_turn_index_advantage(rewards: Tensor, exists: Tensor, uid, gamma: float = 1.0, norm_by_std: bool = True):
    """The natural per-turn-index normalisation, BIASED (verl RFC #7244); here to test against, not offered by a flag:

        A_ik = (G_ik - mean_{j in g, K_j > k} G_jk) / (std_{j in g, K_j > k} G_jk + eps)

    The baseline includes G_ik itself and is taken over the rows that reached turn k, so it depends on row i's own
    action at turn k: E[A_ik grad log pi(a_ik)] is not the policy gradient (tests/test_algos_turns.py derives a case)."""
    G = turn_returns(rewards.float(), exists, gamma)
    b, k, groups = _turn_groups(uid, exists)
    adv = torch.zeros_like(G)
    adv[b, k] = grpo_advantage(G[b, k], groups, norm_by_std)
    return adv


def per_turn_baseline_advantage(rewards: Tensor, exists: Tensor, uid, gamma: float = 1.0):
    """The unbiased per-turn baseline: leave-one-out over the OTHER rows of the group that reached turn k, no std:

        A_ik = G_ik - 1/(n_k - 1) sum_{j in g, j != i, K_j > k} G_jk      (n_k: the rows of g with a turn k)
        A_ik = G_ik                                                         (no other row reached turn k)

    The other rows are sampled independently of row i's action a_ik, so the baseline is too: E[A_ik grad log pi(a_ik)]
    = E[G_ik grad log pi(a_ik)], the policy gradient of turn k (rloo_advantage on the (uid, k) groups)."""
    G = turn_returns(rewards.float(), exists, gamma)
    b, k, groups = _turn_groups(uid, exists)
    adv = torch.zeros_like(G)
    adv[b, k] = rloo_advantage(G[b, k], groups)
    return adv


def turn_token_advantages(adv: Tensor, turn_index: Tensor, mask: Tensor) -> Tensor:
    """(B, T) per-turn advantages -> (B, R) per-token: each sampled token gets its turn's (turn_index: -1 off turns)."""
    on = turn_index >= 0
    return adv.gather(1, turn_index.clamp(min=0).clamp(max=adv.shape[1] - 1)) * on * mask


def reinforce_pp_advantage(token_rewards: Tensor, mask: Tensor, gamma: float = 1.0):
    """REINFORCE++ (Hu 2025): discounted return, whitened over the whole batch.

    Backwards over t with a carry G = 0 (as verl 0.9, PR #7300):

        m_t = 1:  returns_t = r_t + gamma * G,   G <- returns_t
        m_t = 0:  returns_t = 0,                 G unchanged
        advantages = whiten_m(returns) * m

    so the return flows through holes in the mask (tool-output tokens of a
    multi-turn response) and gamma is applied once per *action* token.  A reward
    placed on an m = 0 token is dropped (put outcome rewards on the last valid
    token).  Whitening uses the mean / unbiased variance of all valid tokens in
    the batch (no per-prompt grouping, no critic).

    token_rewards, mask (B, T) -> (advantages, returns), both (B, T).
    """
    mask = mask.to(token_rewards.dtype)
    returns = torch.zeros_like(token_rewards)
    carry = torch.zeros_like(token_rewards[:, 0])  # (B,)
    for t in reversed(range(token_rewards.shape[1])):
        m = mask[:, t]
        ret = token_rewards[:, t] + gamma * carry
        returns[:, t] = ret * m
        carry = ret * m + carry * (1 - m)
    advantages = masked_whiten(returns, mask) * mask
    return advantages, returns


def distill_advantage(log_prob: Tensor, teacher_log_prob: Tensor, mask: Tensor, kl_coef: float = 1.0, discount: float = 0.0):
    """On-policy distillation (Agarwal et al. 2024, GKD; Lu & Thinking Machines 2025): the student samples y, the
    teacher scores the sampled tokens, and the per-token reverse KL, estimated from the one sample,

        d_t = log pi_theta(y_t | x, y_<t) - log pi_T(y_t | x, y_<t)

    is a per-token penalty: A_t = -kl_coef * sum_{s >= t, m_s = 1} discount^(#action tokens from t to s) * d_s,
    i.e. with discount 0 (the default, as tinker-cookbook) A_t = -kl_coef * d_t: push up the tokens the teacher
    likes more than the student does. The carry skips m = 0 tokens (tool output) as reinforce_pp_advantage's does.

    log_prob, teacher_log_prob, mask (B, R) -> (advantages (B, R), d (B, R)), both zero where mask is 0.
    """
    mask = mask.to(log_prob.dtype)
    d = (log_prob - teacher_log_prob) * mask
    if not discount:
        return -kl_coef * d, d
    out, carry = torch.zeros_like(d), torch.zeros_like(d[:, 0])  # carry: (B,)
    for t in reversed(range(d.shape[1])):
        m = mask[:, t]
        ret = d[:, t] + discount * carry
        out[:, t] = ret * m
        carry = ret * m + carry * (1 - m)
    return -kl_coef * out, d


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
        m_t = 1:  A_t = delta_t + gamma * lam * A_next,  V_next <- V_t,  A_next <- A_t
        m_t = 0:  A_t = A_next (the carry),  V_next and A_next unchanged

    Masked tokens are skipped: they neither give a value nor a TD error, so the
    advantage flows through holes in the mask (as verl, PR #2337).  A reward on
    an m = 0 token is dropped.

    returns = A + V (with A *before* whitening, carries included, so at a masked
    position returns_t = A_next + V_t, exactly verl's numbers) is the critic's
    target; advantages = whiten_m(A) * m (whole-batch statistics).  The final
    "* m" zeroes padding (verl leaves whitened garbage there; losses mask it
    anyway).

    token_rewards, values, mask (B, T) -> (advantages, returns), both (B, T).
    """
    mask = mask.to(values.dtype)
    advantages = torch.zeros_like(values)
    next_value = torch.zeros_like(values[:, 0])  # (B,)
    next_adv = torch.zeros_like(values[:, 0])  # (B,)
    for t in reversed(range(values.shape[1])):
        m = mask[:, t]
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        adv = delta + gamma * lam * next_adv
        next_value = values[:, t] * m + (1 - m) * next_value
        next_adv = adv * m + (1 - m) * next_adv
        advantages[:, t] = next_adv
    returns = advantages + values
    return masked_whiten(advantages, mask) * mask, returns


def remax_advantage(token_rewards: Tensor, baseline: Tensor, mask: Tensor):
    """ReMax (Li et al. 2023, arXiv 2310.10505): the greedy response's reward is the baseline.

        returns_t = sum_{t' >= t} m_t' r_t'           (reverse cumulative sum)
        A_t       = returns_t - b * m_t

    b is the reward of one extra *greedy* response to the same prompt, shared
    by all samples of that prompt.  For an outcome reward on the last valid
    token, A_t = (s - b) m_t.  No whitening, no std normalisation.  As verl 0.9's
    compute_remax_outcome_advantage.

    token_rewards, mask (B, T), baseline (B,) -> (advantages, returns), both (B, T).
    """
    mask = mask.to(token_rewards.dtype)
    returns = (token_rewards * mask).flip(-1).cumsum(-1).flip(-1)
    return returns - baseline.to(token_rewards.dtype)[:, None] * mask, returns


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
    norm: Norm | None = None,
    weights: Tensor | None = None,
):
    """PPO clipped surrogate loss (Schulman et al. 2017) with clip-higher and dual-clip.

        rho_t = exp(clamp(log pi - log pi_old, -20, 20))
        L1 = -A rho
        L2 = -A clip(rho, 1 - eps_low, 1 + eps_high)
        C1 = max(L1, L2)                           (standard PPO, as a loss)
        C2 = min(-A c, C1)                         (dual-clip, Ye et al. 2020)
        loss_t = C2 if A < 0 else C1
        loss_t = sg(w_t) * loss_t                  (only if `weights` w is given)
        loss = agg_loss(loss_t, mask, loss_agg_mode, ...)

    eps_high > eps_low is DAPO's "clip-higher".  Dual-clip bounds the loss of
    a negative-advantage token whose ratio has exploded at -A c; pass
    clip_ratio_c=None to disable it.  c must be > 1 (ValueError otherwise).
    `weights` (B, T) are importance weights outside the clip (a rollout
    correction, see rollout_correction); they are detached here.

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
    if weights is not None:
        per_token = per_token * weights.detach()

    loss = agg_loss(per_token, mask, loss_agg_mode, num_tokens, num_seqs, norm_len, norm)
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
    norm: Norm | None = None,
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
    loss = 0.5 * agg_loss(torch.maximum(loss1, loss2), mask, loss_agg_mode, num_tokens, num_seqs, norm_len, norm)
    clipfrac = masked_mean((loss2 > loss1).to(loss1.dtype), mask).item()
    return loss, clipfrac


# ---------------------------------------------------------------------------
# Sequence-level and clipped-IS policy losses (GSPO, CISPO, GMPO)
# ---------------------------------------------------------------------------

# GSPO (Zheng et al. 2025, arXiv 2507.18071) §5.1: the sequence ratio is a geometric mean
# over tokens, so its clip range is two to three orders of magnitude below PPO's 0.2
# (the values verl's examples/gspo_trainer and TRL's docs use; taken from the paper).
GSPO_CLIP_RATIO_LOW = 3e-4
GSPO_CLIP_RATIO_HIGH = 4e-4


def gspo_loss(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_ratio_low: float = GSPO_CLIP_RATIO_LOW,
    clip_ratio_high: float = GSPO_CLIP_RATIO_HIGH,
    token_level: bool = False,
    weights: Tensor | None = None,
    loss_agg_mode: str = "seq-mean-token-mean",
    num_tokens=None,
    num_seqs=None,
    norm_len=None,
    norm: Norm | None = None,
):
    """GSPO: PPO's clip on the sequence-level ratio (Zheng et al. 2025, arXiv 2507.18071).

        log s_i = sum_t m_it (log pi_it - log pi_old_it) / max(|y_i|, 1)   (log of the geometric mean)

        GSPO (token_level=False), A_i = mean_t A_it:
            L_it = max(-A_i s_i, -A_i clip(s_i, 1 - eps_low, 1 + eps_high))     (same for every t)
        GSPO-token (token_level=True), per-token A_it:
            log s_it = sg(log s_i) + log pi_it - sg(log pi_it)                    (value s_i, gradient s_i grad log pi_it)
            L_it = max(-A_it s_it, -A_it clip(s_it, 1 - eps_low, 1 + eps_high))

        log s is clamped at <= 10 (as verl); then loss_t *= sg(w_t) if `weights`
        w are given, and loss = agg_loss(L, mask, loss_agg_mode, ..., norm).

    `norm` is the engine's Norm (mini-batch counts and dp_size), as for
    ppo_clip_loss: "token-sum" is multiplied by its dp_size like every other
    term of the loss.

    The default seq-mean-token-mean makes the loss mean_i L_i, the paper's
    objective.  With an advantage that is constant along each response (GRPO's)
    both variants give the same value and the same gradient
    s_i A_i mean_t grad log pi_it.  verl 0.9's compute_policy_loss_gspo is the
    GSPO-token variant and always aggregates with seq-mean-token-mean.

    Returns (loss, metrics): "pg_clipfrac" (fraction of tokens where the clip was
    active) and "ppo_kl" (mean of log pi_old - log pi), python floats.
    """
    mask = mask.to(log_prob.dtype)
    log_ratio = log_prob - old_log_prob  # (B, T)
    seq_log_ratio = masked_sum(log_ratio, mask, dim=-1) / mask.sum(-1).clamp_min(1)  # (B,)
    if token_level:
        log_s = seq_log_ratio.detach()[:, None] + log_prob - log_prob.detach()  # (B, T)
        adv = advantages  # (B, T)
    else:
        log_s = seq_log_ratio[:, None]  # (B, 1)
        adv = masked_mean(advantages, mask, dim=-1)[:, None]  # (B, 1)
    ratio = torch.exp(torch.clamp(log_s, max=10.0))
    loss1 = (-adv * ratio).expand_as(log_prob)  # (B, T)
    loss2 = (-adv * torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)).expand_as(log_prob)
    per_token = torch.maximum(loss1, loss2)
    if weights is not None:
        per_token = per_token * weights.detach()
    loss = agg_loss(per_token, mask, loss_agg_mode, num_tokens, num_seqs, norm_len, norm)
    with torch.no_grad():
        metrics = {
            "pg_clipfrac": masked_mean((loss2 > loss1).to(log_prob.dtype), mask).item(),
            "ppo_kl": masked_mean(-log_ratio, mask).item(),
        }
    return loss, metrics


# CISPO (MiniMax-M1, arXiv 2506.13585): the paper leaves the lower bound of the IS weight
# open (eps_low large); 1.0 puts it at 0, below every ratio (verl's example uses 10, same
# effect).  eps_high = 0.2 is verl's examples/cispo_trainer value; the paper's own is not
# verified.  TRL instead reads epsilon_high as an absolute cap (5.0 recommended by ScaleRL).
CISPO_CLIP_RATIO_LOW = 1.0
CISPO_CLIP_RATIO_HIGH = 0.2


def cispo_loss(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_ratio_low: float = CISPO_CLIP_RATIO_LOW,
    clip_ratio_high: float = CISPO_CLIP_RATIO_HIGH,
    weights: Tensor | None = None,
    loss_agg_mode: str = "token-mean",
    num_tokens=None,
    num_seqs=None,
    norm_len=None,
    norm: Norm | None = None,
):
    """CISPO: REINFORCE weighted by a clipped, stop-gradient IS ratio (MiniMax-M1, arXiv 2506.13585).

        r_t  = exp(clamp(log pi_t - log pi_old_t, -20, 20))
        L_t  = -sg(clip(r_t, 1 - eps_low, 1 + eps_high)) * A_t * log pi_t
        loss = agg_loss(L * sg(w), mask, loss_agg_mode, ..., norm)    (w = `weights`, if given)

    Unlike PPO, no token loses its gradient when the ratio leaves the range:
    only its weight is capped.  The loss *value* is not meaningful (it contains
    log pi), its gradient is: -clip(r) A grad log pi.  As verl 0.9's
    compute_policy_loss_cispo.

    Returns (loss, metrics): "pg_clipfrac" (fraction of tokens whose weight was
    clipped) and "ppo_kl", python floats.
    """
    log_ratio = torch.clamp(log_prob - old_log_prob, -20.0, 20.0)
    ratio = torch.exp(log_ratio)
    clipped = torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    per_token = -clipped.detach() * advantages * log_prob
    if weights is not None:
        per_token = per_token * weights.detach()
    loss = agg_loss(per_token, mask, loss_agg_mode, num_tokens, num_seqs, norm_len, norm)
    with torch.no_grad():
        metrics = {
            "pg_clipfrac": masked_mean((ratio != clipped).to(ratio.dtype), mask).item(),
            "ppo_kl": masked_mean(-log_ratio, mask).item(),
        }
    return loss, metrics


# GMPO (Zhao et al. 2025, arXiv 2507.20673): token log-ratios clipped to (-0.4, 0.4), i.e.
# ratios in (e^-0.4, e^0.4); the paper advises less for MoE models.  verl's
# examples/gmpo_trainer and TRL's experimental GMPO use 0.4 too (verl's actor default 0.2 is not it).
GMPO_CLIP_LOG_LOW = 0.4
GMPO_CLIP_LOG_HIGH = 0.4


def gmpo_loss(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_log_low: float = GMPO_CLIP_LOG_LOW,
    clip_log_high: float = GMPO_CLIP_LOG_HIGH,
    weights: Tensor | None = None,
    loss_agg_mode: str = "seq-mean-token-mean",
    num_tokens=None,
    num_seqs=None,
    norm_len=None,
    norm: Norm | None = None,
):
    """GMPO: maximise the geometric mean of the token ratios (Zhao et al. 2025, arXiv 2507.20673).

        l_t  = log pi_t - log pi_old_t,            sigma_t = sign(A_t)
        l~_t = sigma_t min(sigma_t l_t, sigma_t clip(l_t, -eps_low, eps_high))   (token clip, in log space)
        r_i  = exp( sum_t m_t l~_t / (|y_i| + 1e-8) )                          (geometric mean of clipped ratios)
        A_i  = sum_t m_t A_t / (|y_i| + 1e-8)                                  (sequence-level advantage)
        L_i  = -A_i r_i * w_i,   w_i = exp(sum_t m_t log(w_t + 1e-10) / (|y_i| + 1e-8))  (if `weights` w)

    The clip is pessimistic like PPO's: it only removes the incentive to move
    l_t further past the bound in the direction A favours.  L_i is put on every
    valid token of row i and reduced with agg_loss (seq-mean-token-mean, the
    default, gives mean_i L_i; `norm`: the engine's counts and dp_size).  As verl 0.9's compute_policy_loss_geo_mean,
    which takes a plain mean over the micro-batch's rows instead.

    Returns (loss, metrics): "pg_clipfrac" / "pg_clipfrac_lower" (fraction of
    tokens with a clipped log-ratio and A > 0 / A < 0) and "ppo_kl".
    """
    mask = mask.to(log_prob.dtype)
    log_ratio = log_prob - old_log_prob  # (B, T)
    sign = torch.sign(advantages)
    log_ratio_clipped = torch.clamp(log_ratio, -clip_log_low, clip_log_high)
    pessimistic = sign * torch.minimum(sign * log_ratio, sign * log_ratio_clipped)  # (B, T)
    length = mask.sum(-1) + 1e-8  # (B,)
    ratio = torch.exp(masked_sum(pessimistic, mask, dim=-1) / length)  # (B,)
    seq_adv = masked_sum(advantages, mask, dim=-1) / length  # (B,)
    seq_loss = -seq_adv * ratio  # (B,)
    if weights is not None:
        seq_loss = seq_loss * torch.exp(masked_sum(torch.log(weights.detach() + 1e-10), mask, dim=-1) / length)
    per_token = seq_loss[:, None].expand_as(log_prob)  # (B, T)
    loss = agg_loss(per_token, mask, loss_agg_mode, num_tokens, num_seqs, norm_len, norm)
    with torch.no_grad():
        clipped = (log_ratio != log_ratio_clipped).to(log_prob.dtype)
        metrics = {
            "pg_clipfrac": masked_mean(clipped * (advantages > 0), mask).item(),
            "pg_clipfrac_lower": masked_mean(clipped * (advantages < 0), mask).item(),
            "ppo_kl": masked_mean(-log_ratio, mask).item(),
        }
    return loss, metrics


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


LOGITS_CHUNK_BYTES = 2**24  # token_logprob_entropy's float32 buffers per chunk on CPU: 16 MiB (27 positions at V = 151,936)
LOGITS_CHUNK_BYTES_CUDA = 2**27  # on CUDA 128 MiB (220 positions): ~10 kernels a chunk, so 16 MiB chunks were launch-bound


def _chunk_rows(n: int, vocab: int, device: torch.device | None = None) -> int:
    budget = LOGITS_CHUNK_BYTES_CUDA if device is not None and device.type == "cuda" else LOGITS_CHUNK_BYTES
    return max(1, min(n, budget // (4 * max(vocab, 1))))


class _LogProbEntropy(torch.autograd.Function):
    """token_logprob_entropy's forward and backward, chunked over positions (see there). At most two chunk-sized
    buffers live at a time: z - m (then log p) and e (then p); everything else is (N,) or done in place."""

    @staticmethod
    def forward(ctx, logits, pos, labels, temperature, with_entropy):
        n, vocab = logits.shape
        work = torch.promote_types(logits.dtype, torch.float32)
        lse = torch.empty(n, dtype=work, device=logits.device)  # (N,)
        ent = torch.empty(n if with_entropy else 0, dtype=work, device=logits.device)  # (N,)
        step = _chunk_rows(n, vocab, logits.device)
        for a in range(0, n, step):
            zm = logits[a : a + step].to(work) / temperature  # (c, V), a new buffer
            m = zm.amax(-1, keepdim=True)  # (c, 1)
            zm.sub_(m)  # z - m
            e = zm.exp()  # (c, V)
            s = e.sum(-1)  # (c,)
            lse[a : a + step] = m.squeeze(-1) + s.log()
            if with_entropy:  # H = lse - sum_v p_v z_v = log s - sum_v e_v (z_v - m) / s; a -inf logit has e = 0: no NaN
                ent[a : a + step] = s.log() - torch.einsum("cv,cv->c", e, zm.clamp_min_(torch.finfo(work).min)) / s
            del zm, e
        logp = logits[pos, labels].to(work) / temperature - lse[pos]  # (T,)
        ctx.save_for_backward(logits, pos, labels, lse, ent)
        ctx.temperature, ctx.with_entropy = temperature, with_entropy
        ctx.set_materialize_grads(False)
        return logp, ent

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        logits, pos, labels, lse, ent = ctx.saved_tensors
        t = ctx.temperature
        n, vocab = logits.shape
        work = lse.dtype
        g_lse = torch.zeros(n, dtype=work, device=logits.device)  # d loss / d lse, (N,): -sum of g_lp over the tokens read there
        if g_lp is not None:
            g_lse.index_add_(0, pos, -g_lp)
        use_ent = ctx.with_entropy and g_ent is not None
        grad = torch.empty_like(logits)  # (N, V) in the logits' dtype: the pass's one gradient copy
        step = _chunk_rows(n, vocab, logits.device)
        if g_lp is not None:  # the tokens read in each chunk, found once (one host sync): their one-hot terms
            order = torch.argsort(pos)
            bounds = torch.searchsorted(pos[order], torch.arange(0, n + step, step, device=pos.device)).tolist()
        for i, a in enumerate(range(0, n, step)):
            b = min(n, a + step)
            logp = (logits[a:b].to(work) / t).sub_(lse[a:b, None])  # (c, V) log p
            if use_ent:  # dz = p * (g_lse - g_H * (log p + H)):  dlse/dz = p,  dH/dz_k = -p_k (log p_k + H)
                p = logp.exp()
                g = logp.clamp_min_(torch.finfo(work).min).add_(ent[a:b, None]).mul_(-g_ent[a:b, None]).add_(g_lse[a:b, None]).mul_(p)
                del p
            else:
                g = logp.exp_().mul_(g_lse[a:b, None])
            if g_lp is not None:  # d z_y / dz = onehot(y), added in the working dtype: one rounding to bf16, not two
                mine = order[bounds[i] : bounds[i + 1]]
                g.index_put_((pos[mine] - a, labels[mine]), g_lp[mine].to(work), accumulate=True)
            grad[a:b] = g.div_(t)
            del logp, g
        return grad, None, None, None, None


def token_logprob_entropy(
    logits: Tensor, pos: Tensor, labels: Tensor, temperature: float = 1.0, with_entropy: bool | str = False
) -> tuple[Tensor, Tensor | None]:
    """Log-probs of tokens read at positions, and (optionally) the entropy at every position, from one log-sum-exp:

        z = logits / T,   lse_i = logsumexp(z_i),   log p(y_t) = z[pos_t, y_t] - lse[pos_t],   H_i = lse_i - sum_v softmax(z_i)_v z_iv

    logits (N, V) in any float dtype (bf16 stays bf16: no float32 copy of the whole tensor), pos (T,) row of
    each token in logits (a position may serve several tokens: a shared prompt's last one), labels (T,)
    -> log-probs (T,) and entropy (N,) (None without with_entropy) in float32 (float64 for float64 logits).

    Memory: the passes run over chunks of positions (LOGITS_CHUNK_BYTES of float32 each) and the backward
    recomputes softmax chunk by chunk from the saved logits and lse, so a pass holds the logits, their
    gradient (backward only) and a few chunk-sized buffers: with U = one float32 copy of the logits read,
    about 1 U + chunks without gradient, 2 U + chunks with it, with or without entropy (tests/test_gpu_construction.py
    measures it at V = 151,936). with_entropy "metric": the entropy comes without gradient.
    """
    lp, ent = _LogProbEntropy.apply(logits, pos, labels, float(temperature), bool(with_entropy))
    if not with_entropy:
        return lp, None
    return lp, (ent.detach() if with_entropy == "metric" else ent)


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


# ---------------------------------------------------------------------------
# Off-policy: rollout-vs-trainer mismatch, importance-sampling correction, decoupled PPO
#
# mu = the rollout (behaviour) policy whose log-probs the inference engine returned,
# pi = the trainer's log-probs for the same sampled tokens,
# Delta_t = log pi_t - log mu_t,  rho_t = exp(Delta_t).
# ---------------------------------------------------------------------------

# Log-ratios are clamped to +-20 before exp (e^20 ~ 4.9e8), as verl and slime do.
SAFETY_BOUND = 20.0


def _log_ratio(log_prob: Tensor, rollout_log_prob: Tensor) -> Tensor:
    """Delta = log pi - log mu, detached and clamped to +-SAFETY_BOUND.  (B, T)"""
    return torch.clamp((log_prob - rollout_log_prob).detach(), -SAFETY_BOUND, SAFETY_BOUND)


def rollout_mismatch_metrics(
    log_prob: Tensor, rollout_log_prob: Tensor, mask: Tensor, threshold: float = 2.0, prefix: str = "rollout_corr/"
) -> dict:
    """How far the rollout engine's log-probs are from the trainer's, over the sampled tokens.

    With Delta_t = log pi_t - log mu_t over tokens with m_t = 1 (metric names after `prefix`):

        abs_diff_mean, abs_diff_max   mean_t and max_t |Delta_t|
        kl                            mean_t (-Delta_t)                  naive KL(mu || pi), can be < 0
        k3_kl                         mean_t (rho_t - Delta_t - 1)       >= 0, unbiased for KL(mu || pi)
        log_ppl_diff                  mean_i (mean_t log mu - mean_t log pi) = log(PPL_train / PPL_rollout)
        log_ppl_abs_diff              mean_i |...|
        ppl_ratio                     mean_i exp(...)                    per-sequence PPL ratio, 1 when equal
        chi2_token                    mean_t rho_t^2 - 1
        ratio_fraction_high / _low    mean_t 1[rho_t > C] / mean_t 1[rho_t < 1/C]   (C = threshold)

    Sequence means run over rows with at least one valid token.  As verl
    (compute_offpolicy_metrics), only chi2_token clamps Delta to +-20 before
    exp; the others use it as it is (a Delta beyond 88 makes k3_kl inf in
    float32: a mismatch no correction can rescue).  Names and formulas follow
    verl 0.9's rollout_corr/ metrics and TRL's sampling_logp_difference.  All
    values are python floats; 0.0 when no token is valid.  HF rollouts give
    zeros up to rounding (same model code; KV-cached decoding vs one forward).
    """
    mask = mask.to(log_prob.dtype)
    delta = torch.where(mask > 0, (log_prob - rollout_log_prob).detach(), 0.0)  # (B, T); padding: 0, never inf * 0
    rows = mask.sum(-1) > 0  # (B,)
    log_ppl_diff = -masked_mean(delta, mask, dim=-1)[rows]  # (B',)
    log_c = math.log(threshold)
    metrics = {
        "abs_diff_mean": masked_mean(delta.abs(), mask),
        "abs_diff_max": delta.abs().max() if mask.any() else delta.new_zeros(()),
        "kl": masked_mean(-delta, mask),
        "k3_kl": masked_mean(torch.exp(delta) - delta - 1, mask),
        "log_ppl_diff": log_ppl_diff.mean() if rows.any() else delta.new_zeros(()),
        "log_ppl_abs_diff": log_ppl_diff.abs().mean() if rows.any() else delta.new_zeros(()),
        "ppl_ratio": torch.exp(log_ppl_diff).mean() if rows.any() else delta.new_zeros(()),
        "chi2_token": masked_mean(torch.exp(2 * _log_ratio(log_prob, rollout_log_prob)), mask) - 1 if mask.any() else delta.new_zeros(()),
        "ratio_fraction_high": masked_mean((delta > log_c).to(delta.dtype), mask),
        "ratio_fraction_low": masked_mean((delta < -log_c).to(delta.dtype), mask),
    }
    return {prefix + k: v.item() for k, v in metrics.items()}


def token_tis_weights(log_prob: Tensor, rollout_log_prob: Tensor, mask: Tensor, cap: float = 2.0) -> Tensor:
    """Token-level truncated importance sampling (TIS):  w_t = min(rho_t, C) * m_t.

    Caps the top only, as verl (rollout_is="token", threshold 2.0) and slime
    (--tis-clip 2.0).  Detached: the weight rescales the gradient, it has none.
    (B, T) -> (B, T).
    """
    rho = torch.exp(_log_ratio(log_prob, rollout_log_prob))
    return torch.clamp(rho, max=cap) * mask.to(rho.dtype)


def token_mis_weights(log_prob: Tensor, rollout_log_prob: Tensor, mask: Tensor, low: float = 0.5, high: float = 2.0) -> Tensor:
    """Token-level masked importance sampling (MIS, "IcePop"):  w_t = rho_t * 1[low <= rho_t <= high] * m_t.

    A token whose ratio leaves [low, high] gets weight 0 (no gradient) but stays
    in the loss denominator.  As TRL's token_mask, verl's "low_high" threshold,
    slime's icepop.  Defaults 0.5 / 2.0 are slime's example bounds.  Detached.
    (B, T) -> (B, T).
    """
    rho = torch.exp(_log_ratio(log_prob, rollout_log_prob))
    keep = (rho >= low) & (rho <= high)
    return torch.where(keep, rho, torch.zeros_like(rho)) * mask.to(rho.dtype)


def _seq_ratio(log_prob: Tensor, rollout_log_prob: Tensor, mask: Tensor) -> Tensor:
    """rho_seq_i = exp(clamp(sum_t m_t Delta_t, +-20)), the product of the token ratios.  (B, 1)"""
    delta = (log_prob - rollout_log_prob).detach()
    return torch.exp(torch.clamp(masked_sum(delta, mask, dim=-1), -SAFETY_BOUND, SAFETY_BOUND))[:, None]


def seq_tis_weights(log_prob: Tensor, rollout_log_prob: Tensor, mask: Tensor, cap: float = 2.0) -> Tensor:
    """Sequence-level truncated IS:  w_it = min(prod_t rho_t, C) * m_it  (one weight per response).

    Unbiased before truncation, but the product grows like e^{|y| mean Delta}:
    long answers hit the cap.  As verl rollout_is="sequence" (cap 2.0).
    Detached.  (B, T) -> (B, T).
    """
    rho_seq = _seq_ratio(log_prob, rollout_log_prob, mask)  # (B, 1)
    return torch.clamp(rho_seq, max=cap) * mask.to(rho_seq.dtype)


def seq_mis_weights(log_prob: Tensor, rollout_log_prob: Tensor, mask: Tensor, low: float = 0.5, high: float = 2.0) -> Tensor:
    """Sequence-level masked IS:  w_it = rho_seq_i * 1[low <= rho_seq_i <= high] * m_it,  rho_seq = prod_t rho_t.

    A response whose product ratio leaves [low, high] gets weight 0.  As TRL's
    sequence_mask (its default, with high 3.0 and no low) and SkyRL's product
    mask [0.5, 2.0].  Beware the length trap: mean |Delta| ~ 0.012 over 100 tokens
    already exceeds 3.0.  Detached.  (B, T) -> (B, T).
    """
    rho_seq = _seq_ratio(log_prob, rollout_log_prob, mask)  # (B, 1)
    keep = (rho_seq >= low) & (rho_seq <= high)
    return torch.where(keep, rho_seq, torch.zeros_like(rho_seq)) * mask.to(rho_seq.dtype)


def geo_mask(log_prob: Tensor, rollout_log_prob: Tensor, mask: Tensor, low: float = 0.999, high: float = 1.001) -> Tensor:
    """Geometric-mean sequence mask (Geo-RS):  keep row i iff low <= exp(sum_t m_t Delta_t / |y_i|) <= high.

    Returns the edited mask m_it * keep_i (B, T), a filter, not a weight.  The
    per-token geometric mean does not grow with length, so the bounds are
    tight: verl's decoupled_geo_rs preset uses 0.999 / 1.001 (the default here),
    SkyRL 0.99 / 1.01.  Rows with no valid token stay all-zero.
    """
    mask = mask.to(log_prob.dtype)
    delta = (log_prob - rollout_log_prob).detach()
    mean_log = masked_sum(delta, mask, dim=-1) / mask.sum(-1).clamp_min(1)  # (B,)
    keep = (mean_log >= math.log(low)) & (mean_log <= math.log(high))
    return mask * keep[:, None].to(mask.dtype)


def is_weight_metrics(weights: Tensor, mask: Tensor, prefix: str = "rollout_corr/") -> dict:
    """Statistics of the importance weights w after correction, over valid tokens.

        is_mean, is_max, is_min    mean / max / min of w_t
        is_ess                     1 / mean_t (w_t / mean w)^2   (effective sample size fraction, 1 = uniform)
        is_zero_fraction           mean_t 1[w_t = 0]             (tokens masked by MIS)

    Python floats; 0.0 everywhere when no token is valid (is_ess 0 too).
    """
    mask = mask.to(weights.dtype)
    if not mask.any():
        return {prefix + k: 0.0 for k in ("is_mean", "is_max", "is_min", "is_ess", "is_zero_fraction")}
    valid = weights[mask > 0]
    mean = valid.mean()
    ess = 1.0 / ((valid / mean) ** 2).mean() if mean > 0 else valid.new_zeros(())
    return {
        prefix + "is_mean": mean.item(),
        prefix + "is_max": valid.max().item(),
        prefix + "is_min": valid.min().item(),
        prefix + "is_ess": ess.item(),
        prefix + "is_zero_fraction": (valid == 0).to(weights.dtype).mean().item(),
    }


CORRECTION_MODES = ("none", "token-tis", "token-mis", "seq-tis", "seq-mis", "geo-mask")
# Default caps / bounds per mode (see each function for the sources).
CORRECTION_DEFAULTS = {"token-tis": 2.0, "token-mis": (0.5, 2.0), "seq-tis": 2.0, "seq-mis": (0.5, 2.0), "geo-mask": (0.999, 1.001)}


def rollout_correction(
    log_prob: Tensor, rollout_log_prob: Tensor, mask: Tensor, mode: str = "none", threshold=None, prefix="rollout_corr/"
):
    """One flag for the correction of rollout-vs-trainer mismatch.

        mode         weights w (B, T)                      mask
        none         None                                  unchanged
        token-tis    token_tis_weights(cap=threshold)      unchanged
        token-mis    token_mis_weights(*threshold)         unchanged
        seq-tis      seq_tis_weights(cap=threshold)        unchanged
        seq-mis      seq_mis_weights(*threshold)           unchanged
        geo-mask     None                                  geo_mask(*threshold)

    threshold: a cap C for the -tis modes, a (low, high) pair for the others;
    None takes CORRECTION_DEFAULTS[mode].  The weights multiply the per-token
    policy loss, detached, outside any clip (the `weights` argument of the
    losses); the mask replaces the response mask.  Returns (weights, mask,
    metrics): the rollout_mismatch_metrics, plus is_weight_metrics of the weights
    and "<prefix>masked_fraction" (valid tokens removed by geo-mask).
    Unknown mode -> ConfigError.
    """
    if mode not in CORRECTION_MODES:
        raise ConfigError(f"unknown rollout correction {mode!r}; valid: {', '.join(CORRECTION_MODES)}")
    metrics = rollout_mismatch_metrics(log_prob, rollout_log_prob, mask, prefix=prefix)
    if mode == "none":
        return None, mask, metrics
    threshold = CORRECTION_DEFAULTS[mode] if threshold is None else threshold
    if mode == "geo-mask":
        new_mask = geo_mask(log_prob, rollout_log_prob, mask, *threshold)
        metrics[prefix + "masked_fraction"] = masked_mean(1 - new_mask, mask.to(new_mask.dtype)).item()
        return None, new_mask, metrics
    if mode.endswith("-tis"):
        fn = token_tis_weights if mode == "token-tis" else seq_tis_weights
        weights = fn(log_prob, rollout_log_prob, mask, threshold)
    else:
        fn = token_mis_weights if mode == "token-mis" else seq_mis_weights
        weights = fn(log_prob, rollout_log_prob, mask, *threshold)
    metrics.update(is_weight_metrics(weights, mask, prefix))
    return weights, mask, metrics


def rollout_weights(mb, actor_sys):
    """A recipe's rollout correction for one micro-batch: (weights, mask, metrics); a no-op on-policy.

    Without rollout log-probs in mb (HF generation, the default): (None, mb["response_mask"], {}), so the
    loss is exactly the uncorrected one. With them (mb["rollout_log_probs"] = log mu: --rollout.name vllm,
    --rollout.log-probs, --trainer.async-steps k >= 1): rollout_correction(mb["old_log_probs"], log mu,
    mask, --actor.rollout-correction, its cap/bounds). actor_sys: an ActorSystem (cfg.system.actor). docs/off-policy.md.
    """
    mask = mb["response_mask"]
    if "rollout_log_probs" not in mb:
        return None, mask, {}
    mode, threshold = actor_sys.rollout_correction, actor_sys.rollout_is_threshold
    return rollout_correction(mb["old_log_probs"], mb["rollout_log_probs"], mask, mode, threshold)


def decoupled_ppo_loss(
    log_prob: Tensor,
    prox_log_prob: Tensor,
    behav_log_prob: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float | None = 3.0,
    behav_cap: float | None = None,
    loss_agg_mode: str = "token-mean",
    num_tokens=None,
    num_seqs=None,
    norm_len=None,
):
    """Decoupled PPO (Hilton et al. 2021, arXiv 2110.00641; AReaL, arXiv 2505.24298) for stale batches.

        u_t    = pi_theta_t / pi_prox_t                       (the PPO ratio, anchored at the proximal policy)
        w_t    = sg(pi_prox_t / mu_t), min(w_t, C) if behav_cap C   (behaviour weight, log-ratio clamped to +-20)
        loss_t = w_t * ppo_clip_t(u_t, A_t)                   (ppo_clip_loss's per-token loss, dual clip included)
        loss   = agg_loss(loss_t, mask, loss_agg_mode, ...)

    pi_prox = the trainer's log-probs of the current weights before the update
    (recomputed), mu = the policy that generated the batch (k steps stale in
    asynchronous training, plus the engine's numeric mismatch).  The clip keeps
    the update near pi_prox; w corrects the sample distribution from mu to
    pi_prox.  With prox == behav the weight is 1 and this is ppo_clip_loss.

    Returns (loss, metrics): ppo_clip_loss's metrics plus "behav_weight_mean" and
    "behav_weight_max" (over valid tokens, after the cap).
    """
    weights = torch.exp(_log_ratio(prox_log_prob, behav_log_prob))
    if behav_cap is not None:
        weights = torch.clamp(weights, max=behav_cap)
    loss, metrics = ppo_clip_loss(
        log_prob,
        prox_log_prob,
        advantages,
        mask,
        clip_ratio_low,
        clip_ratio_high,
        clip_ratio_c,
        weights=weights,
        loss_agg_mode=loss_agg_mode,
        num_tokens=num_tokens,
        num_seqs=num_seqs,
        norm_len=norm_len,
    )
    mask = mask.to(weights.dtype)
    metrics["behav_weight_mean"] = masked_mean(weights, mask).item()
    metrics["behav_weight_max"] = (weights * mask).max().item() if mask.any() else 0.0
    return loss, metrics
