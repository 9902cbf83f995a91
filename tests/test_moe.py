"""Router replay (rlkit/moe.py, docs/moe.md) on a tiny Qwen3-MoE built with transformers' own class: 4 experts, top-2,
hidden 32, 2 layers, over the embedded tokenizer."""

import pytest
import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from rlkit import demos
from rlkit.config import DataConfig, DataSystem
from rlkit.data import build_prompts
from rlkit.engine import load_tokenizer
from rlkit.errors import ConfigError
from rlkit.moe import RouterReplay, routers
from rlkit.rollout import HFRollout

EPS = torch.finfo(torch.float32).eps


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(str(demos.ARITH_MODEL))


def tiny_moe(tok, norm_topk_prob=True, seed=0):
    torch.manual_seed(seed)
    config = Qwen3MoeConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
        norm_topk_prob=norm_topk_prob, max_position_embeddings=128, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
    )  # fmt: skip
    return Qwen3MoeForCausalLM(config).eval()


def batch_of(tok, rows=4):
    """rows left-padded prompts of the embedded task (input_ids, attention_mask, position_ids)."""
    return build_prompts(DataConfig().train_files, tok, DataConfig(), DataSystem(), max_samples=rows).batch(range(rows), tok.pad_token_id)


def forward(model, b):
    return model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], position_ids=b["position_ids"]).logits


def seen_experts(model, at="experts"):
    """Hooks on each block's experts module (the top-k indices the block dispatched) or on its router after
    RouterReplay's hook (the indices it hands on, also in checkpointing's recompute): (N, k) per call, by layer."""
    seen, handles = {}, []
    for i, layer in enumerate(model.model.layers):
        if at == "experts":
            handles.append(layer.mlp.experts.register_forward_hook(lambda m, a, o, i=i: seen.setdefault(i, []).append(a[1].clone())))
        else:
            handles.append(layer.mlp.gate.register_forward_hook(lambda m, a, o, i=i: seen.setdefault(i, []).append(o[2].clone())))
    return seen, handles


def drift_router(model, scale=3.0, seed=1):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for r in routers(model):
            r.weight.add_(scale * r.weight.abs().mean() * torch.randn(r.weight.shape, generator=g))


def record(model, b):
    with torch.no_grad(), RouterReplay(model, "record") as rec:
        forward(model, b)
    return rec.routing()


def test_replay_forces_the_recorded_experts_after_the_router_changed_and_disagreement_is_zero(tok):
    model, b = tiny_moe(tok), batch_of(tok)
    routing = record(model, b)  # (rows, T, layers, k)
    assert routing.shape == (*b["input_ids"].shape, 2, 2)
    drift_router(model)
    with torch.no_grad(), RouterReplay(model, "compare", routing) as cmp:
        forward(model, b)
    assert (cmp.disagreement() > 0.2).all() and torch.equal(cmp.disagreement(), cmp.drift())  # drifted on purpose
    seen, handles = seen_experts(model)
    with torch.no_grad(), RouterReplay(model, "replay", routing) as rep:
        forward(model, b)
    for h in handles:
        h.remove()
    for layer in range(2):  # what each block dispatched, seen from outside rlkit/moe.py
        assert torch.equal(seen[layer][0], routing[:, :, layer].reshape(-1, 2))
    assert torch.equal(rep.disagreement(), torch.zeros(2)) and torch.equal(rep.drift(), cmp.drift())


def hand_block(block, x, idx, norm):
    """The replayed MoE block by hand: p = softmax(W_r x), w_j = p[idx_j] (/ sum when norm), y = sum_j w_j expert_j(x)."""
    p = torch.softmax(x @ block.gate.weight.T, dim=-1)
    w = p.gather(1, idx)
    if norm:
        w = w / w.sum(-1, keepdim=True)
    e = block.experts
    y = torch.zeros_like(x)
    for n in range(x.shape[0]):
        for j in range(idx.shape[1]):
            k = idx[n, j]
            gate, up = (e.gate_up_proj[k] @ x[n]).chunk(2)
            y[n] = y[n] + w[n, j] * (e.down_proj[k] @ (torch.nn.functional.silu(gate) * up))
    return y


@pytest.mark.parametrize("norm", [True, False])
def test_router_gradient_under_replay_equals_the_hand_computed_one_through_the_dense_softmax(tok, norm):
    model = tiny_moe(tok, norm_topk_prob=norm)
    block = model.model.layers[0].mlp
    g = torch.Generator().manual_seed(2)
    x = torch.randn(6, 32, generator=g)
    c = torch.randn(6, 32, generator=g)
    with torch.no_grad():
        own = torch.softmax(x @ block.gate.weight.T, -1).topk(2, -1).indices
    bottom = torch.softmax(x @ block.gate.weight.T, -1).topk(2, -1, largest=False).indices
    idx = torch.cat([own[:3], bottom[3:]])  # rows 3..5: both recorded experts outside the router's top-2 (drifted)
    with RouterReplay(block, "replay", idx[None, :, None, :]) as rep:
        (block(x[None])[0] * c).sum().backward()
    got = block.gate.weight.grad.clone()
    block.zero_grad()
    (hand_block(block, x, idx, norm) * c).sum().backward()
    want = block.gate.weight.grad
    assert rep.drift()[0] == 0.5
    # float32, the same products summed in another order over at most H = 32 terms: |err| <= 64 eps max|grad|
    assert want.abs().max() > 1e-3
    torch.testing.assert_close(got, want, rtol=0, atol=64 * EPS * want.abs().max().item())
    # the drifted rows alone still reach the router (post-top-k scores would give them exactly 0)
    block.zero_grad()
    with RouterReplay(block, "replay", idx[3:][None, :, None, :]):
        (block(x[3:][None])[0] * c[3:]).sum().backward()
    assert block.gate.weight.grad.abs().max() > 1e-3


def test_replay_is_kept_under_gradient_checkpointing_recompute(tok):
    """The recompute calls each layer's router again, in reverse layer order (torch's checkpoint then stops early,
    before the experts: they are not recomputed here): it must hand on the same recorded experts."""
    model, b = tiny_moe(tok), batch_of(tok)
    routing = record(model, b)
    drift_router(model)
    grads = []
    for ckpt in (False, True):
        model.zero_grad()
        if ckpt:
            model.gradient_checkpointing_enable()
        model.train()
        with RouterReplay(model, "replay", routing):  # backward inside: the recompute runs the hooks again
            seen, handles = seen_experts(model, at="router")
            forward(model, b).float().logsumexp(-1).sum().backward()
        for h in handles:
            h.remove()
        calls = 2 if ckpt else 1
        for layer in range(2):
            assert len(seen[layer]) == calls and all(torch.equal(s, routing[:, :, layer].reshape(-1, 2)) for s in seen[layer])
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    model.gradient_checkpointing_disable()
    assert grads[0].keys() == grads[1].keys()
    for n in grads[0]:
        torch.testing.assert_close(grads[1][n], grads[0][n], rtol=0, atol=0, msg=n)  # the same ops recomputed: same bits


def test_routing_rides_in_the_batch_through_micro_batches(tok):
    model = tiny_moe(tok)
    b = batch_of(tok, rows=4)
    b["routed_experts"] = record(model, b)
    drift_router(model)
    with torch.no_grad(), RouterReplay(model, "replay", b["routed_experts"]):
        whole = forward(model, b)
    parts = []
    for mb in b.split(2):
        seen, handles = seen_experts(model)
        with torch.no_grad(), RouterReplay(model, "replay", mb["routed_experts"]) as rep:
            parts.append(forward(model, mb))
        for h in handles:
            h.remove()
        assert torch.equal(seen[0][0], mb["routed_experts"][:, :, 0].reshape(-1, 2)) and rep.disagreement().sum() == 0
    torch.testing.assert_close(torch.cat(parts), whole, rtol=1e-5, atol=1e-5)
    with pytest.raises(ConfigError, match="slice it like input_ids"), torch.no_grad():
        with RouterReplay(model, "replay", b["routed_experts"]):
            forward(model, b.index(slice(0, 2)))


@pytest.mark.parametrize("impl,n", [("fast", 1), ("fast", 2), ("generate", 2)])
def test_decode_loop_records_routing_step_by_step_as_the_teacher_forced_forward_routes(tok, impl, n):
    """R3 on the HF rollout (rlkit's fast loop and transformers' generate): the prefill (one per group of n when n > 1)
    then one column per step; the last sampled token is never fed, so its column is -1. On CPU float32 the full
    forward routes the same experts."""
    model = tiny_moe(tok)
    prompts = batch_of(tok, rows=3).repeat(n)
    with RouterReplay(model, "record") as rec:
        out = HFRollout(model, tok, "cpu", impl=impl).generate(prompts, 6, temperature=1.0)
    T = out["input_ids"].shape[1]
    routing = rec.routing(rows=len(out), length=T)
    assert len(rec.calls) == 6 + (n > 1) and (routing[:, -1] == -1).all()
    full = record(model, out)
    real = out["attention_mask"].bool()[:, : T - 1]
    assert (routing[:, : T - 1][real] >= 0).all()
    assert torch.equal(routing[:, : T - 1][real], full[:, : T - 1][real])
    with torch.no_grad(), RouterReplay(model, "replay", routing) as rep:
        forward(model, out)
    assert rep.disagreement().sum() == 0 and rep.counted.sum() > 0


def test_a_model_without_routers_is_refused():
    with pytest.raises(ConfigError, match="no MoE router"):
        RouterReplay(torch.nn.Linear(2, 2))
