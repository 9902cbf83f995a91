"""Split attention (rlkit/packing.py, --model.shared-prompt-attention split): the block mask's attention run per
sequence gives the dense mask's log-probs, entropy and gradients to float rounding (issue #25)."""

import pytest
import torch
from numerics import assert_within, entropy_tol, grad_tol, log_prob_tol, max_abs_logit
from test_packing import P, make_batch

from rlkit import packing
from rlkit.config import ActorConfig, ModelConfig, ModelSystem
from rlkit.engine import TorchEngine

pytestmark = pytest.mark.numerics  # rerun with the scalar kernels by .ci/run (tests/numerics.py)


def test_spans_of_a_packed_layout_by_hand():
    # one group: prompt [7, 8], responses [5, 6] and [9]; then a lone row: prompt [4], response [3] (as test_packing)
    ids = torch.tensor([[0, 7, 8, 5, 6], [0, 7, 8, 9, 0], [0, 0, 4, 3, 0]])
    attn = torch.tensor([[0, 1, 1, 1, 1], [0, 1, 1, 1, 0], [0, 0, 1, 1, 0]])
    p = packing.pack(ids, attn, (attn.cumsum(-1) - 1).clamp(min=0), prompt_len=3, share=True)
    s = packing.spans(p.segment_ids, p.sub_ids, "cpu")
    assert s.rows == [
        [("prompt", 0, 2), ("response", 2, 4, 0, 2), ("response", 4, 5, 0, 2)],
        [("prompt", 0, 1), ("response", 1, 2, 0, 1), ("pad", 2, 5)],
    ]
    assert s.masks[(2, 2)].int().tolist() == [[1, 1, 1, 0], [1, 1, 1, 1]]  # the prompt, then itself causal
    # every run's mask is the block mask's rows for its queries, restricted to the keys it is given
    full = p.attention_mask[0, 0]
    assert torch.equal(full[2:4][:, [0, 1, 2, 3]], s.masks[(2, 2)]) and torch.equal(full[4:5][:, [0, 1, 4]], s.masks[(1, 2)])


def test_split_pays_counts_pairs_and_calls_by_hand():
    # one row of 5: prompt 2 (4 pairs), responses 2 and 1 (2 x 4 and 1 x 3 pairs): 15 of the mask's 25, in 3 calls
    s = packing.Spans([[("prompt", 0, 2), ("response", 2, 4, 0, 2), ("response", 4, 5, 0, 2)]], {})
    saved = (25 - 15) * 4 * 8  # width 8: 320 FLOPs saved, against 3 calls
    assert packing.split_pays(s, 5, 8) == (saved >= 3 * packing.SPLIT_MIN_FLOPS_PER_CALL)
    assert not packing.split_pays(s, 5, 8)  # a few tokens: the mask's one call is cheaper
    # GSM8K-shaped: a 200-token prompt and 8 responses of 160 in one row of 1480, width 256: split
    runs = [("prompt", 0, 200)] + [("response", 200 + 160 * k, 360 + 160 * k, 0, 200) for k in range(8)]
    assert packing.split_pays(packing.Spans([runs], {}), 1480, 256)
    # the random 4.3M workload: a 19-token prompt and 8 responses of 32 (row of 275): ~7e6 FLOPs saved per call, the mask
    runs = [("prompt", 0, 19)] + [("response", 19 + 32 * k, 51 + 32 * k, 0, 19) for k in range(8)]
    assert not packing.split_pays(packing.Spans([runs], {}), 275, 256)


def test_split_pays_charges_each_response_its_prompt_keys(monkeypatch):
    """The by-hand row above at a threshold between its true saving (15 pairs computed: 320 FLOPs over 3 calls) and the
    saving with the responses' prompt keys forgotten (9 pairs: 512 FLOPs)."""
    s = packing.Spans([[("prompt", 0, 2), ("response", 2, 4, 0, 2), ("response", 4, 5, 0, 2)]], {})
    monkeypatch.setattr(packing, "SPLIT_MIN_FLOPS_PER_CALL", 100)  # 300 to beat: 320 does
    assert packing.split_pays(s, 5, 8)
    monkeypatch.setattr(packing, "SPLIT_MIN_FLOPS_PER_CALL", 110)  # 330 to beat: 320 does not (512 would)
    assert not packing.split_pays(s, 5, 8)


@pytest.fixture(scope="module")
def engine():
    torch.manual_seed(0)
    split = ModelSystem(attn_implementation="sdpa", shared_prompt_attention="split")
    return TorchEngine(ModelConfig(), ActorConfig(lr=1e-3), device="cpu", model_sys=split)


def counted_sdpa(monkeypatch):
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def counting(*a, **kw):
        calls.append(1)
        return sdpa(*a, **kw)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counting)
    return calls


def run(engine, split: bool, b, fn):
    engine.split_attention = split
    try:
        return fn()
    finally:
        engine.split_attention = True


def test_split_log_probs_and_entropy_equal_the_mask(engine, monkeypatch):
    assert engine.split_attention
    b = make_batch(engine.model.config.vocab_size)
    calls = counted_sdpa(monkeypatch)
    lp0, ent0 = run(engine, False, b, lambda: engine.compute_log_prob(b, 0.7, 64, with_entropy=True))
    n_mask = len(calls)
    lp1, ent1 = run(engine, True, b, lambda: engine.compute_log_prob(b, 0.7, 64, with_entropy=True))
    layers = engine.model.config.num_hidden_layers
    assert n_mask <= 3 * layers < len(calls) - n_mask  # the mask: one call per layer; split: one per sequence and layer
    real = b["attention_mask"][:, P:].bool()
    z, cfg = max_abs_logit(engine.model, b, 0.7), engine.model.config
    # rounding only (numerics.py): a token seeing another response or missing its prompt moves log-probs by >= 1e-2
    assert_within(lp1[real], lp0[real], log_prob_tol(cfg, z), "log-prob, split vs mask")
    assert_within(ent1[real], ent0[real], entropy_tol(cfg, z, ent0[real].max().item()), "entropy, split vs mask")
    assert (lp1[~real] == 0).all()


def test_split_gradients_equal_the_mask(engine):
    b = make_batch(engine.model.config.vocab_size, seed=1)

    def grad():
        engine.model.zero_grad()
        logp, _ = engine.forward(engine.model, b, 1.0, False)
        (logp * b["advantages"] * b["response_mask"]).sum().backward()
        g = torch.cat([p.grad.flatten() for p in engine.model.parameters()])
        engine.model.zero_grad()
        return g

    g0, g1 = run(engine, False, b, grad), run(engine, True, b, grad)
    assert g0.norm() > 0
    bound = grad_tol(engine.model.config, g0.abs().max().item(), int(b["response_mask"].sum()))
    assert_within(g1, g0, bound, "gradient, split vs mask")


def test_mask_setting_keeps_the_dense_mask():
    eng = TorchEngine(ModelConfig(), device="cpu", model_sys=ModelSystem(attn_implementation="sdpa", shared_prompt_attention="mask"))
    assert not eng.split_attention
    assert eng.model.config._attn_implementation == "sdpa"  # split only swaps it in during a pass


def test_split_with_lora_equals_the_mask():
    """peft's wrapper passes the layout through to the attention (and the reference pass, adapter disabled, too)."""
    torch.manual_seed(0)
    split = ModelSystem(attn_implementation="sdpa", shared_prompt_attention="split")
    eng = TorchEngine(ModelConfig(lora_rank=4), ActorConfig(lr=1e-3), device="cpu", model_sys=split)
    assert eng.split_attention
    b = make_batch(eng.model.config.vocab_size, seed=3)
    real = b["attention_mask"][:, P:].bool()
    z, cfg = max_abs_logit(eng.model, b, 1.0), eng.model.config
    for ref in (False, True):
        lp0, _ = run(eng, False, b, lambda ref=ref: eng.compute_log_prob(b, 1.0, 64, ref=ref))
        lp1, _ = run(eng, True, b, lambda ref=ref: eng.compute_log_prob(b, 1.0, 64, ref=ref))
        assert_within(lp1[real], lp0[real], log_prob_tol(cfg, z), f"log-prob, split vs mask, LoRA (ref={ref})")


def test_gradient_checkpointing_keeps_the_mask():
    # checkpointing recomputes each layer in the backward, after the pass put sdpa back: split would lose its layout there
    eng = TorchEngine(ModelConfig(), device="cpu", model_sys=ModelSystem(attn_implementation="sdpa", gradient_checkpointing="on"))
    assert eng.share_prompt and not eng.split_attention
