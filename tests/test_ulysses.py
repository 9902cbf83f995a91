"""Ulysses sequence parallelism (rlkit/ulysses.py) on 2 gloo processes: S = 2 equals S = 1.

Each process builds the same tiny models (same seed) and the same rows, computes the S = 1 reference (the whole
sequence, plain sdpa) and the S = 2 values (its half of the sequence, heads swapped around attention), and sends
both back. Compared: per-token log-probs, entropy, a loss, and every parameter's gradient (each rank's gradient
summed over the SP group). Two GQA shapes: Qwen2 with 4 query / 2 KV heads (no replication: each rank gets one KV
head), Llama with 4 query / 1 KV head (S = 2 > 1 KV head: the head is replicated, r = 2) and Llama with 6 query / 3
KV heads (S does not divide 3: each KV head repeated twice, so the order of the copies matters). The row length 13 is
odd, so the right padding to a multiple of S is exercised too.

Tolerances come from tests/numerics.py (float32 sums reordered: attention over the whole sequence is the same sum
either way, but the LM head, the log-sum-exp and the gradient sums run on other shapes and so in other orders); a
semantic bug (a label not rolled before the split, an all_to_all on the wrong dims, a KV head given to the wrong
query heads) moves log-probs by 1e-2 or more, far above them.
"""

import io

import pytest
import torch
from numerics import entropy_tol, grad_tol, log_prob_tol, tol
from test_gpu_construction import _join, _spawn

from rlkit import algos, ulysses
from rlkit.errors import ConfigError

B, T, V = 2, 13, 64
KINDS = ("qwen2", "llama", "llama-3kv")  # KV heads 2 (one per rank), 1 (replicated to S = 2), 3 (replicated to 6)


def _model(kind: str):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    common = dict(
        vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64
    )
    if kind == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(num_key_value_heads=2, **common, attn_implementation="sdpa"))
    elif kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(num_key_value_heads=1, **common, attn_implementation="sdpa"))
    else:  # 6 query heads, 3 KV heads: S = 2 does not divide 3, each KV head is repeated twice (in order) to 6
        model = LlamaForCausalLM(
            LlamaConfig(**{**common, "hidden_size": 48, "num_attention_heads": 6}, num_key_value_heads=3, attn_implementation="sdpa")
        )
    return model.float()


def _loss(lp, ent):
    """A policy-gradient-shaped loss with an entropy bonus: -mean(A_t log p_t) - 0.01 mean(H_t), fixed A_t in [-1, 1]."""
    adv = torch.linspace(-1, 1, lp.numel()).view_as(lp)
    return -(adv * lp).mean() - 0.01 * ent.mean()


def _compare(rank, port, out):
    import torch.distributed as dist

    _join(rank, port)
    group = dist.group.WORLD
    # the swap itself: this rank's sequence half of x becomes all positions of its head half, exactly, and back
    x = torch.randn(2, 6, 4, 3, generator=torch.Generator().manual_seed(5))
    heads = ulysses.SeqToHead.apply(ulysses.shard(x, group), group)
    layout = torch.equal(heads, x[:, :, 2 * rank : 2 * rank + 2]) and torch.equal(
        ulysses.HeadToSeq.apply(heads, group), ulysses.shard(x, group)
    )
    results = {}
    for kind in KINDS:
        model = _model(kind)
        ids = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(1))
        # S = 1: the whole rows, plain sdpa
        logits = model(input_ids=ids, use_cache=False).logits[:, :-1]
        lp, ent = algos.token_logprob_entropy(logits.reshape(-1, V), torch.arange(B * (T - 1)), ids[:, 1:].reshape(-1), 1.0, True)
        lp, ent = lp.view(B, T - 1), ent.view(B, T - 1)
        loss = _loss(lp, ent)
        loss.backward()
        ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad()
        # S = 2: this rank's half of the sequence; gradients summed over the SP group
        sp_lp, sp_ent = ulysses.sp_token_logprobs(model, ids, group, with_entropy=True)
        sp_loss = _loss(sp_lp, sp_ent)
        sp_loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad, group=group)
        sp_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        max_logit = logits.abs().max().item()
        results[kind] = (
            model.config,
            max_logit,
            [t.detach() for t in (lp, ent, loss, sp_lp, sp_ent, sp_loss)],
            ref_grads,
            sp_grads,
        )
    buf = io.BytesIO()  # tensors as bytes: a tensor in a queue lives in this process's shared memory, gone at exit
    torch.save(results, buf)
    out.put((rank, layout, buf.getvalue()))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks():
    return [(r, layout, torch.load(io.BytesIO(data), weights_only=False)) for r, layout, data in _spawn(_compare, 2, timeout=120)]


def test_the_all_to_all_swaps_a_sequence_shard_for_a_head_shard_and_back_exactly(two_ranks):
    assert [layout for _, layout, _ in two_ranks] == [True, True]


@pytest.mark.parametrize("kind", KINDS)
def test_sequence_parallel_log_probs_entropy_loss_and_gradients_equal_one_process(two_ranks, kind):
    for rank, _, results in two_ranks:
        config, max_logit, (lp, ent, loss, sp_lp, sp_ent, sp_loss), ref_grads, sp_grads = results[kind]
        assert sp_lp.shape == lp.shape == (B, T - 1)
        assert (sp_lp - lp).abs().max() <= log_prob_tol(config, max_logit), (rank, (sp_lp - lp).abs().max())
        h_max = ent.max().item()  # <= log V
        assert (sp_ent - ent).abs().max() <= entropy_tol(config, max_logit, h_max), (rank, (sp_ent - ent).abs().max())
        # the loss averages B (T-1) log-probs and entropies: each within its bound, plus the mean's own rounding
        n = B * (T - 1)
        loss_tol = (
            log_prob_tol(config, max_logit) + 0.01 * entropy_tol(config, max_logit, h_max) + tol(torch.float32, abs(loss.item()) + 1, n)
        )
        assert abs(sp_loss.item() - loss.item()) <= loss_tol
        assert set(sp_grads) == set(ref_grads)
        g_max = max(g.abs().max().item() for g in ref_grads.values())
        bound = grad_tol(config, g_max, n)
        worst = max((sp_grads[k] - ref_grads[k]).abs().max().item() for k in ref_grads)
        assert worst <= bound, (rank, worst, bound)
        assert all(g.abs().max() > 0 for g in sp_grads.values())  # every weight (the KV projections too) got a gradient


def test_kv_repeats_gives_every_rank_whole_kv_heads_and_refuses_s_not_dividing_the_heads():
    assert ulysses.kv_repeats(4, 2, 2) == 1  # each rank one KV head
    assert ulysses.kv_repeats(4, 1, 2) == 2  # 1 KV head, S = 2: replicated twice
    assert ulysses.kv_repeats(8, 2, 4) == 2  # lcm(2, 4) = 4 KV heads, one per rank
    assert ulysses.kv_repeats(12, 4, 3) == 3  # lcm(4, 3) = 12: 4 per rank, 4 query heads each (no GQA left)
    with pytest.raises(ConfigError, match="must divide the model's 4 attention heads"):
        ulysses.kv_repeats(4, 2, 3)


def test_labels_are_rolled_before_the_split():
    ids = torch.tensor([[10, 11, 12, 13]])
    assert ulysses.roll_labels(ids).tolist() == [[11, 12, 13, 10]]  # shard 0's last position (11) gets 12, shard 1's
    assert ulysses.pad_to_multiple(torch.tensor([[1, 2, 3]]), 2, 0).tolist() == [[1, 2, 3, 0]]
