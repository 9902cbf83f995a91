"""Padding-free passes (rlkit/packing.py): the packed layout by hand, and the same log-probs, values, gradients
and update metrics as the padded layout (float tolerance: the sums run in another order)."""

import dataclasses

import pytest
import torch
from numerics import assert_within, entropy_tol, grad_tol, log_prob_tol, max_abs_logit, tol

from rlkit import algos, packing
from rlkit.config import ActorConfig, CriticConfig, ModelConfig, ModelSystem
from rlkit.engine import TorchEngine
from rlkit.protocol import DataProto

pytestmark = pytest.mark.numerics  # rerun with the scalar kernels by .ci/run (tests/numerics.py)

P, R, N = 6, 7, 3  # prompt width, response width, rows per group


def make_batch(vocab: int, seed: int = 0) -> DataProto:
    """3 prompts (3, 6 and 4 tokens, left-padded) x N rows each, responses of 1..R tokens right-padded;
    row 4's response_mask has a hole (a tool token: attended, not trained on)."""
    g = torch.Generator().manual_seed(seed)
    prompt_lens, rows = [3, 6, 4], []
    for plen in prompt_lens:
        prompt = torch.randint(3, vocab, (plen,), generator=g)
        for _ in range(N):
            rlen = int(torch.randint(1, R + 1, (1,), generator=g))
            resp = torch.randint(3, vocab, (rlen,), generator=g)
            ids = torch.cat([torch.zeros(P - plen, dtype=torch.long), prompt, resp, torch.zeros(R - rlen, dtype=torch.long)])
            attn = torch.cat([torch.zeros(P - plen), torch.ones(plen + rlen), torch.zeros(R - rlen)]).long()
            rows.append((ids, attn))
    ids = torch.stack([r[0] for r in rows])
    attn = torch.stack([r[1] for r in rows])
    mask = attn[:, P:].clone()
    mask[4, 0] = 0  # a hole
    return DataProto.from_dict(
        {
            "prompts": ids[:, :P],
            "responses": ids[:, P:],
            "response_mask": mask,
            "input_ids": ids,
            "attention_mask": attn,
            "position_ids": (attn.cumsum(-1) - 1).clamp(min=0),
            "advantages": torch.randn(len(ids), R, generator=g),
        }
    )


def test_pack_lays_out_a_shared_prompt_once_and_masks_other_responses():
    # one group: prompt [7, 8] (left-padded to 3), responses [5, 6] and [9]; then a lone row: prompt [4], response [3]
    ids = torch.tensor([[0, 7, 8, 5, 6], [0, 7, 8, 9, 0], [0, 0, 4, 3, 0]])
    attn = torch.tensor([[0, 1, 1, 1, 1], [0, 1, 1, 1, 0], [0, 0, 1, 1, 0]])
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    p = packing.pack(ids, attn, pos, prompt_len=3, share=True)
    # segment 0 = 7 8 | 5 6 | 9 (5 positions, one row); segment 1 = 4 | 3 fits in a second row of length 5
    assert p.input_ids.tolist() == [[7, 8, 5, 6, 9], [4, 3, 0, 0, 0]]
    assert p.position_ids.tolist() == [[0, 1, 2, 3, 2], [0, 1, 0, 0, 0]]  # the second response restarts after the prompt
    m = p.attention_mask[0, 0].int().tolist()
    assert m[4] == [1, 1, 0, 0, 1]  # token 9 sees the prompt and itself, not the other response
    assert m[3] == [1, 1, 1, 1, 0]
    # labels: 5 <- position 1 (prompt end), 6 <- 2, 9 <- 1 (prompt end again), 3 <- row 1 position 0
    got = sorted(zip(p.dst_row.tolist(), p.dst_col.tolist(), p.labels.tolist(), p.src_row.tolist(), p.read[p.src_k].tolist()))
    assert got == [(0, 0, 5, 0, 1), (0, 1, 6, 0, 2), (1, 0, 9, 0, 1), (2, 0, 3, 1, 0)]
    assert p.num_positions == 10  # 15 in the padded layout
    unshared = packing.pack(ids, attn, pos, prompt_len=3, share=False)
    assert unshared.input_ids.shape == (3, 4)  # 7 8 5 6 | 7 8 9 + 4 3 | ...: three segments, first fit into rows of 4


def test_split_by_tokens_counts_real_tokens_and_a_prompt_once_per_micro_batch():
    b = make_batch(50)
    costs_resp = b["attention_mask"][:, P:].sum(-1).tolist()
    plen = b["attention_mask"][:, :P].sum(-1).tolist()
    cut_mid_group = 0
    for budget in range(4, 40):  # every budget: some cut a group, and the next micro-batch pays its prompt again
        spans = packing.split_by_tokens(b["input_ids"], b["attention_mask"], P, True, budget=budget)
        assert spans[0][0] == 0 and spans[-1][1] == len(b) and all(a < c for a, c in spans)
        assert all(c == a2 for (_, c), (a2, _) in zip(spans, spans[1:]))
        for a, c in spans:  # every micro-batch within the budget, the shared prompt counted once per group present
            groups = {i // N for i in range(a, c)}
            cost = sum(costs_resp[a:c]) + sum(plen[g * N] for g in groups)
            assert cost <= budget or c - a == 1, (budget, a, c, cost)
            cut_mid_group += a % N != 0
    assert cut_mid_group > 10
    assert packing.split_by_tokens(b["input_ids"], b["attention_mask"], P, True, budget=10**6) == [(0, len(b))]


@pytest.fixture(scope="module", params=["sdpa", "eager"])
def engines(request):
    sys = ModelSystem(attn_implementation=request.param)
    torch.manual_seed(0)
    padded = TorchEngine(ModelConfig(), ActorConfig(lr=1e-3), device="cpu", model_sys=dataclasses.replace(sys, remove_padding=False))
    packed = TorchEngine(ModelConfig(), ActorConfig(lr=1e-3), device="cpu", model_sys=sys)
    packed.model.load_state_dict(padded.model.state_dict())
    return padded, packed


@pytest.mark.parametrize("share,one_by_one", [(True, False), (False, False), (False, True)])
def test_packed_log_probs_and_entropy_equal_the_padded_ones(engines, share, one_by_one):
    padded, packed = engines
    packed.share_prompt = share
    packed.union_logits_bytes = 0 if one_by_one else 2**28  # 0: every packed row its own forward
    b = make_batch(padded.model.config.vocab_size)
    lp0, ent0 = padded.compute_log_prob(b, 0.7, 64, with_entropy=True)
    calls = []
    hook = packed.model.register_forward_pre_hook(lambda m, a: calls.append(1))
    lp1, ent1 = packed.compute_log_prob(b, 0.7, 64, with_entropy=True)
    hook.remove()
    assert (len(calls) > 1) == one_by_one
    real = b["attention_mask"][:, P:].bool()
    # rounding only (numerics.py); a token seeing another packed response moves log-probs by >= 1e-2, above the bounds
    z, cfg = max_abs_logit(padded.model, b, 0.7), padded.model.config
    assert_within(lp1[real], lp0[real], log_prob_tol(cfg, z), "log-prob, packed vs padded")
    assert_within(ent1[real], ent0[real], entropy_tol(cfg, z, ent0[real].max().item()), "entropy, packed vs padded")
    assert (lp1[~real] == 0).all()
    packed.union_logits_bytes = 2**28


def test_packed_gradients_equal_the_padded_ones(engines):
    padded, packed = engines
    b = make_batch(padded.model.config.vocab_size, seed=1)
    grads = []
    for eng in (padded, packed):
        eng.model.zero_grad()
        logp, _ = eng.forward(eng.model, b, 1.0, False)
        (logp * b["advantages"] * b["response_mask"]).sum().backward()
        grads.append(torch.cat([p.grad.flatten() for p in eng.model.parameters()]))
        eng.model.zero_grad()
    assert grads[0].norm() > 0
    # every entry within the gradient chain's rounding at the scale of the largest entry (numerics.grad_tol)
    bound = grad_tol(padded.model.config, grads[0].abs().max().item(), int(b["response_mask"].sum()))
    assert_within(grads[1], grads[0], bound, "gradient, packed vs padded")


def ppo_loss(mb, log_prob, entropy, norm):
    ratio = torch.exp(log_prob - mb["old_log_probs"])
    loss = algos.agg_loss(-ratio * mb["advantages"], mb["response_mask"], "token-mean", norm=norm)
    return loss, {"pg_loss": loss}, {}


def test_update_with_a_token_budget_gives_the_padded_update(engines):
    """One optimizer step: packed passes in micro-batches of <= 24 positions vs padded rows, 9 at a time.
    Same loss (the mini-batch's Norm), same gradient norm, same step."""
    padded, packed = engines
    packed.share_prompt = True
    b = make_batch(padded.model.config.vocab_size, seed=2)
    state = {k: v.clone() for k, v in padded.model.state_dict().items()}
    out = []
    for eng, budget in ((padded, 0), (packed, 24)):
        eng.model.load_state_dict(state)
        w_start = torch.cat([p.detach().flatten() for p in eng.model.parameters()])
        eng.optimizer = torch.optim.SGD(eng.model.parameters(), lr=0.1)  # the step is the gradient (AdamW's sign-like first step is not)
        eng.scheduler = torch.optim.lr_scheduler.LambdaLR(eng.optimizer, lambda s: 1.0)
        eng.max_tokens = budget
        assert len(eng.micro_batches(b, 9)) == (1 if budget == 0 else 3)
        batch = b.union(DataProto.from_dict({"old_log_probs": eng.compute_log_prob(b, 1.0, 9)[0]}))
        metrics = eng.update(batch, ppo_loss, mini_batch_size=len(b), micro_batch_size=9)
        out.append((metrics, torch.cat([p.detach().flatten() for p in eng.model.parameters()])))
        eng.max_tokens = 0
    assert len(packed.micro_batches(b, 9)) == 1
    (m0, w0), (m1, w1) = out
    # loss = token-mean of -ratio * A, ratio = 1 up to rounding (each engine's own old log-probs): the log-probs'
    # bound times max|A|, plus the mean's own sum. Catches a wrong Norm across micro-batches (a factor ~3 here).
    cfg, real = padded.model.config, b["response_mask"].bool()
    scale = b["advantages"][real].abs().max().item()
    loss_bound = 2 * scale * log_prob_tol(cfg, max_abs_logit(padded.model, b)) + tol(torch.float32, scale, int(real.sum()))
    assert_within(m1["actor/loss"], m0["actor/loss"], loss_bound, "loss, token budget vs padded")
    assert_within(m1["actor/pg_loss"], m0["actor/pg_loss"], loss_bound, "pg_loss, token budget vs padded")
    # the norm of the gradient moves by at most the entries' bound times sqrt(#entries); the step is lr x gradient
    g_bound = grad_tol(cfg, (w0 - w_start).abs().max().item() / 0.1, int(real.sum()))
    assert_within(m1["actor/grad_norm"], m0["actor/grad_norm"], g_bound * len(w0) ** 0.5, "grad_norm, token budget vs padded")
    assert_within(w1, w0, 0.1 * g_bound + tol(torch.float32, w_start.abs().max().item(), 1), "weights after a step, token budget vs padded")
    padded.model.load_state_dict(state), packed.model.load_state_dict(state)


def test_packed_values_equal_the_padded_ones():
    torch.manual_seed(0)
    padded = TorchEngine(ModelConfig(), CriticConfig(), device="cpu", value_head=True, model_sys=ModelSystem(remove_padding=False))
    packed = TorchEngine(ModelConfig(), CriticConfig(), device="cpu", value_head=True)
    packed.model.load_state_dict(padded.model.state_dict())
    b = make_batch(padded.model.config.vocab_size)
    real = b["attention_mask"][:, P:].bool()
    v0, v1 = padded.compute_values(b, 64), packed.compute_values(b, 64)
    torch.testing.assert_close(v1[real], v0[real], atol=2e-5, rtol=0)


def test_generation_prefills_each_group_once_and_samples_the_same_tokens():
    from rlkit.config import DataConfig, DataSystem
    from rlkit.data import build_prompts
    from rlkit.rollout import HFRollout

    eng = TorchEngine(ModelConfig(), None, device="cpu")
    prompts = build_prompts(DataConfig().train_files, eng.tokenizer, DataConfig(), DataSystem(), max_samples=4).batch(
        [0, 1, 2, 3], eng.tokenizer.pad_token_id
    )
    rows = prompts.repeat(4, interleave=True)
    shared, plain = HFRollout(eng.model, eng.tokenizer, eng.device), HFRollout(eng.model, eng.tokenizer, eng.device)
    plain.shared_prefill = lambda ids, mask, cache=None: None
    calls = []
    eng.model.register_forward_pre_hook(lambda m, a, kw: calls.append(kw["input_ids"].shape), with_kwargs=True)
    for temperature in (1.0, 0.0):
        out = []
        for rollout in (shared, plain):
            calls.clear()
            torch.manual_seed(0)
            out.append(rollout.generate(rows, 8, temperature=temperature))
            if rollout is shared:  # the 4 distinct prompts but their last token, then 16 rows of one token each
                assert calls[0] == (4, rows["input_ids"].shape[1] - 1) and calls[1] == (16, 1)
        assert torch.equal(out[0]["responses"], out[1]["responses"])
    assert shared.shared_prefill(prompts["input_ids"], prompts["attention_mask"]) is None  # no groups: plain generate
