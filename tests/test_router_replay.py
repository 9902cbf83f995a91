"""MoE router replay wired through the recipes (--actor.router-replay none|r2|r3; docs/moe.md): the routing rides in
the batch from the pass that records it (r3: the HF rollout, r2: the old-log-prob pass) through packing, the shared
prompt, token-budget micro-batches and the update's epochs, and every update forward dispatches exactly the recorded
experts. On the embedded MoE (rlkit/assets/tiny-moe: 8 experts, top-2, 2 layers), float32 CPU. The library's own tests
(the dense-softmax gradient, checkpointing's recompute on a bare model) are tests/test_moe.py."""

import pytest
import torch
from test_grpo_recipe import load_recipe, read_jsonl, small_config

from rlkit import algos, demos, packing
from rlkit.config import ActorConfig, ActorSystem, DataConfig, DataSystem, ModelConfig, ModelSystem
from rlkit.data import build_prompts
from rlkit.engine import TorchEngine
from rlkit.moe import routers
from rlkit.rollout import HFRollout


def engine(mode="none", lr=1e-4, **model):
    """model: ModelSystem options (remove_padding, gradient_checkpointing)."""
    torch.manual_seed(0)
    return TorchEngine(
        ModelConfig(path=str(demos.MOE_MODEL)),
        ActorConfig(lr=lr, use_kl_loss=False),
        "cpu",
        model_sys=ModelSystem(**model),
        update_sys=ActorSystem(router_replay=mode),
    )


def rollout(eng, impl="fast", groups=4, n=2, micro_batch_size=None):
    """groups prompts x n samples (rows of a group side by side: the shared-prompt layout), the routing recorded (R3)."""
    d = DataConfig()
    prompts = build_prompts(d.train_files, eng.tokenizer, d, DataSystem(), max_samples=groups).batch(
        range(groups), eng.tokenizer.pad_token_id
    )
    torch.manual_seed(1)
    out = HFRollout(eng.model, eng.tokenizer, eng.device, impl=impl).generate(
        prompts.repeat(n), 8, temperature=1.0, micro_batch_size=micro_batch_size, record_routing=True
    )
    assert out["routed_experts"].dtype == torch.int16 and out["routed_experts"].shape[:2] == out["input_ids"].shape
    return out


def left_pad(batch, cols, pad_id):
    """Two more prompt columns that are padding in every row (a prompt budget wider than the batch's prompts)."""
    out = batch.select()
    for key, fill in (("prompts", pad_id), ("input_ids", pad_id), ("attention_mask", 0), ("position_ids", 0), ("routed_experts", -1)):
        x = batch[key]
        out[key] = torch.cat([x.new_full((len(x), cols, *x.shape[2:]), fill), x], dim=1)
    return out


def drift_routers(model, scale=3.0):
    """Perturb every router so that most tokens would route elsewhere: only replay keeps the recorded experts."""
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for r in routers(model):
            r.weight.add_(scale * r.weight.abs().mean() * torch.randn(r.weight.shape, generator=g))


def dispatched(model):
    """The (N, k) expert indices each MoE block hands its experts, per layer and model call (after replay's hook)."""
    seen, handles = {}, []
    for i, layer in enumerate(model.model.layers):
        handles.append(layer.mlp.experts.register_forward_hook(lambda m, a, o, i=i: seen.setdefault(i, []).append(a[1].clone())))
    return seen, handles


@pytest.mark.parametrize("impl", ["fast", "generate"])
def test_the_rollout_records_what_the_trainers_packed_pass_routes_and_replay_follows_it_through_every_layout(impl):
    """R3's record (the decode loop, 2 generate calls of 4 rows) equals R2's (the trainer's packed pass, shared prompts)
    at every fed token; after the routers drift, the replayed pass gives the same log-probs in the packed layout with
    token-budget micro-batches as in the padded layout in one pass, and the padded pass dispatches the recorded experts."""
    eng = engine("r3")
    eng.max_tokens = 40  # token-budget micro-batches: several per batch, cut inside the groups
    assert eng.remove_padding and eng.share_prompt
    batch = left_pad(rollout(eng, impl, micro_batch_size=4), 2, eng.tokenizer.pad_token_id)
    rec = batch["routed_experts"].long()
    # R2's record: the trainer's own packed pass (share_prompt: each group's prompt once, unpacked to every row)
    _, _, r2 = eng.compute_log_prob(batch.select([k for k in batch.tensors if k != "routed_experts"]), 1.0, 8, record_routing=True)
    fed = rec[:, :, 0, 0] >= 0  # the rollout fed every real token but the last sampled one (never fed back: -1)
    real = batch["attention_mask"].bool()
    assert fed.sum() > 100 and (fed <= real).all() and ((real & ~fed).sum(1) <= 1).all() and (real & ~fed).any()
    assert torch.equal(r2.long()[fed], rec[fed]) and (r2[~real] == -1).all() and (r2[real] >= 0).all()
    assert len(eng.micro_batches(batch, 8)) >= 3

    drift_routers(eng.model)
    lp_drifted, _ = eng.compute_log_prob(batch.select([k for k in batch.tensors if k != "routed_experts"]), 1.0, 8)
    lp_packed, _ = eng.compute_log_prob(batch, 1.0, 8)  # replayed: packed rows, shared prompts, 3+ micro-batches
    padded = engine("r3", remove_padding=False)
    padded.model.load_state_dict(eng.model.state_dict())
    seen, handles = dispatched(padded.model)
    lp_padded, _ = padded.compute_log_prob(batch, 1.0, len(batch))  # replayed: padded rows, one pass
    for h in handles:
        h.remove()
    mask = batch["response_mask"].bool()
    # float32: packed vs padded differ by summation order only (docs/moe.md measured 4.8e-6 on this model)
    torch.testing.assert_close(lp_packed[mask], lp_padded[mask], rtol=0, atol=1e-4)
    # the drifted routers' own choice routes elsewhere: the layout must carry the routing for the two to agree
    assert (lp_drifted[mask] - lp_packed[mask]).abs().max() > 1e-2
    first = int(real[:, : batch["prompts"].shape[1]].any(0).nonzero()[0])  # forward_padded trims all-pad prompt columns
    for layer in (0, 1):
        (got,) = seen[layer]
        width = len(got) // len(batch)  # ... and the response columns past the longest response
        want = rec[:, first : first + width, layer].reshape(-1, 2)
        known = (want >= 0).all(-1)
        assert torch.equal(got[known], want[known]), layer


def simple_loss(mb, log_prob, entropy, norm):
    """A policy-gradient loss on the batch's advantages (the update's loop and replay do not depend on which)."""
    loss = -algos.agg_loss(log_prob * mb["advantages"], mb["response_mask"], "token-mean", norm=norm)
    return loss, {"pg_loss": loss}, {}


def update(eng, batch, epochs=2, **kw):
    """ppo_epochs x mini-batches of 4 rows x micro-batches of 2: 4 optimizer steps, 16 forwards at lr 1e-2 (routes move)."""
    batch = batch.union(as_columns(eng.compute_log_prob(batch, 1.0, 8, **kw), batch))
    torch.manual_seed(3)
    batch["advantages"] = torch.randn(len(batch), 1) * batch["response_mask"]
    return eng.update(batch, simple_loss, mini_batch_size=4, micro_batch_size=2, epochs=epochs)


def as_columns(out, batch):
    """compute_log_prob's tuple as batch columns: old_log_probs (+ routed_experts when recorded: R2)."""
    from rlkit.protocol import DataProto

    tensors = {"old_log_probs": out[0]}
    if len(out) == 3:
        tensors["routed_experts"] = out[2]
    return DataProto.from_dict(tensors=tensors)


@pytest.mark.parametrize("mode", ["r2", "r3", "none"])
def test_every_update_forward_replays_the_record_and_without_replay_routes_drift(mode):
    """lr 1e-2, 2 epochs x 2 mini-batches x 2 micro-batches, gradient checkpointing on (the recompute routes inside the
    replay). r2 records in the old-log-prob pass, r3 at rollout: disagreement exactly 0 in every layer while the routers'
    own top-k drifts; none (the rollout's record kept only to compare) routes the drifted experts: disagreement = drift."""
    eng = engine(mode, lr=1e-2, gradient_checkpointing="on")
    eng.compare_routing = mode == "none"  # measure the record without forcing it
    assert eng.gradient_checkpointing
    batch = rollout(eng)
    if mode == "r2":
        batch = batch.select([k for k in batch.tensors if k != "routed_experts"])
    m = update(eng, batch, record_routing=mode == "r2")
    for layer in (0, 1):
        drift, dis = m[f"moe/drift/layer_{layer}"], m[f"moe/disagreement/layer_{layer}"]
        assert drift > 0.02, (layer, drift)  # lr 1e-2 moves routes (docs/moe.md: ~50 % after one step at this lr)
        if mode == "none":
            assert dis == drift
        else:
            assert dis == 0.0, (layer, dis)
    assert m["moe/disagreement"] == (m["moe/drift"] if mode == "none" else 0.0)


def test_without_replay_a_batch_s_routing_is_ignored_and_no_moe_metrics_are_logged():
    """--actor.router-replay none (and a critic's, a teacher's engine): the routers pick, whatever the batch carries."""
    eng = engine("none")
    m = update(eng, rollout(eng), epochs=1)
    assert not any(k.startswith("moe/") for k in m)


@pytest.mark.parametrize("mode", ["r2", "r3"])
def test_one_grpo_step_replays_with_zero_disagreement(tmp_path, mode):
    """recipes/grpo.py on the embedded MoE with 2 epochs (4 optimizer steps) and micro-batches of 4: the routing rides from
    the rollout (r3) or the old-log-prob pass (r2, which runs though the update is on-policy) into every update forward."""
    grpo = load_recipe("grpo")
    cfg = small_config(grpo, tmp_path, steps=1, test_freq=0, save_freq=0, val_before_train=False)
    cfg.model.path = str(demos.MOE_MODEL)
    cfg.system.actor.router_replay, cfg.actor.ppo_epochs, cfg.system.actor.ppo_micro_batch_size = mode, 2, 4
    cfg.actor.lr = 1e-2
    grpo.main(cfg)
    (row,) = read_jsonl(tmp_path / "metrics.jsonl")
    assert row["moe/disagreement/layer_0"] == row["moe/disagreement/layer_1"] == 0.0
    assert row["moe/drift"] > 0  # the routers moved over the update's 4 steps: replay held the routes
    assert row["timing/old_log_prob"] > 0


def test_grpo_runs_the_old_log_prob_pass_for_r2_only():
    grpo = load_recipe("grpo")
    from rlkit.workers import ActorRolloutRefWorker

    cfg = grpo.Config()
    cfg.data.train_batch_size = cfg.actor.ppo_mini_batch_size = 32
    worker = ActorRolloutRefWorker.__new__(ActorRolloutRefWorker)
    worker.actor_cfg, worker.data_cfg = cfg.actor, cfg.data
    for mode, one_step in (("none", True), ("r3", True), ("r2", False)):
        worker.router_replay = mode
        assert worker.update_is_one_step() is one_step, mode


def test_pack_like_lays_a_per_token_tensor_out_like_input_ids_and_unpack_like_inverts_it():
    eng = engine()
    batch = rollout(eng, groups=3, n=3)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    x = torch.where(mask.bool(), ids, -1)
    for share, one_row in ((True, False), (False, False), (False, True)):
        p = packing.pack(ids, mask, batch["position_ids"], batch["prompts"].shape[1], share, one_row=one_row)
        assert torch.equal(packing.pack_like(p, x), torch.where(p.segment_ids >= 0, p.input_ids, -1))
        assert torch.equal(packing.unpack_like(p, packing.pack_like(p, x)), x)
