"""The Megatron-core engine (--trainer.engine megatron) on CPU: tensor parallelism 2 over gloo in two Ray workers
agrees with the one-process engine (log-probs, loss, grad norm, the updated weights through the HF export), and a
checkpoint loaded back repeats the uninterrupted run's next step; the HF<->Megatron mapping round-trips and the mapped
model gives HF's logits. Skipped without megatron-core (`bash scripts/install.sh megatron`)."""

import copy
import shutil

import pytest
import torch
from safetensors.torch import load_file

ray = pytest.importorskip("ray")
pytest.importorskip("megatron.core", reason="megatron-core is not installed: bash scripts/install.sh megatron")

from test_fsdp import _max_diff, _rollout_batch  # noqa: E402
from test_grpo_recipe import load_recipe, read_jsonl, small_config  # noqa: E402

from rlkit import config, demos  # noqa: E402
from rlkit.placement import build_policy  # noqa: E402
from rlkit.ray_group import free_port  # noqa: E402


@pytest.fixture(scope="module")
def local_ray():
    from rlkit.ray_group import init_ray

    init_ray(num_cpus=2)
    yield
    ray.shutdown()


def megatron_cfg(cfg, tp=2, n_workers=2):
    cfg = copy.deepcopy(cfg)
    return config.set_flags(
        cfg, {"trainer.backend": "ray", "trainer.engine": "megatron", "trainer.tp_size": tp, "trainer.n_workers": n_workers}
    )


def test_megatron_engine_needs_the_ray_backend_and_a_dividing_tp_size(tmp_path):
    from rlkit.errors import ConfigError
    from rlkit.megatron_workers import build_gpt

    cfg = small_config(load_recipe("grpo"), tmp_path)
    cfg.system.scale_out.engine = "megatron"
    with pytest.raises(ConfigError, match="--trainer.backend ray"):
        build_policy(cfg)
    from transformers import AutoConfig

    with pytest.raises(ConfigError, match="--trainer.tp-size 3 must divide"):
        build_gpt(AutoConfig.from_pretrained(demos.ARITH_MODEL), 3)


def test_hf_megatron_mapping_round_trips_for_llama_and_qwen2_shapes():
    from transformers import LlamaConfig, Qwen2Config

    from rlkit.megatron_workers import hf_to_megatron, megatron_to_hf

    for c in (
        LlamaConfig(vocab_size=11, hidden_size=16, intermediate_size=24, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2),
        Qwen2Config(vocab_size=11, hidden_size=16, intermediate_size=24, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2),
    ):
        c.tie_word_embeddings = c.model_type == "llama"
        from transformers import AutoModelForCausalLM

        sd = AutoModelForCausalLM.from_config(c).state_dict()
        shards = [hf_to_megatron(sd, c, 2, r) for r in range(2)]
        assert shards[0]["embedding.word_embeddings.weight"].shape == (6, 16)  # 11 tokens padded to 12, 6 per rank
        assert shards[0]["self_attention.linear_qkv.weight".join(("decoder.layers.0.", ""))].shape == (
            16,
            16,
        )  # 1 group: 2 q + k + v heads of 4
        back = megatron_to_hf(shards, c)
        assert set(back) == set(sd) and all(torch.equal(back[k], sd[k]) for k in sd), c.model_type


def test_vocab_parallel_logprobs_equal_the_full_softmax_with_one_rank():
    """One rank (the formula with T=1) and a padded vocabulary: log-softmax and entropy as torch computes them."""
    import torch.distributed as dist

    from rlkit import algos
    from rlkit.megatron_workers import vocab_parallel_logprobs

    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        z = torch.randn(2, 3, 7, requires_grad=True)
        y = torch.tensor([[0, 4, 6], [1, 2, 3]])
        lp, ent = vocab_parallel_logprobs(torch.cat([z, torch.full((2, 3, 1), 5.0)], -1), y, 7, None, with_entropy=True)
        assert torch.allclose(lp, algos.logprobs_from_logits(z, y), atol=1e-6)
        assert torch.allclose(ent, algos.entropy_from_logits(z), atol=1e-6)
        lp.sum().backward()
        assert z.grad is not None and torch.isfinite(z.grad).all()
    finally:
        dist.destroy_process_group()


def test_megatron_forward_equals_hf_for_a_qwen2_shape_with_gqa_qkv_bias_and_left_padding():
    """One process, T=1: the mapped GPTModel gives the HF model's logits at every real position (untied head,
    2 query heads per key/value group, qkv biases, a left-padded row whose RoPE positions are shifted)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from transformers import AutoModelForCausalLM, Qwen2Config

    from rlkit import megatron_shims
    from rlkit.megatron_workers import build_gpt, hf_to_megatron, local_params

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        megatron_shims.apply()
        ps.initialize_model_parallel(tensor_model_parallel_size=1)
        c = Qwen2Config(
            vocab_size=13, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
        )
        c.tie_word_embeddings = False
        torch.manual_seed(0)
        hf = AutoModelForCausalLM.from_config(c).eval()
        with torch.no_grad():
            for name, p in hf.named_parameters():
                if name.endswith("bias") or "norm" in name:  # zeros / ones at init would hide a misplaced bias or norm
                    p.normal_(0.5, 0.2)
        gpt = build_gpt(c, 1).eval()
        shards = hf_to_megatron(hf.state_dict(), c, 1, 0)
        with torch.no_grad():
            for k, p in local_params(gpt).items():
                p.copy_(shards[k])
        ids = torch.randint(1, 13, (2, 7))
        mask = torch.ones(2, 7, dtype=torch.long)
        mask[1, :3] = 0  # left padding
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        want = hf(input_ids=ids, attention_mask=mask, position_ids=pos).logits
        allowed = torch.ones(7, 7, dtype=torch.bool).tril() & mask.bool()[:, None, :]
        got = gpt(input_ids=ids, position_ids=pos, attention_mask=~allowed[:, None])
        real = mask.bool()
        assert got.shape == want.shape and (got - want)[real].abs().max() < 1e-4
    finally:
        ps.destroy_model_parallel()
        dist.destroy_process_group()


def test_tp2_agrees_with_one_process_exports_hf_and_resumes(tmp_path, local_ray):
    grpo = load_recipe("grpo")
    cfg = small_config(grpo, tmp_path)  # 8 prompts x 4 samples, mini-batches of 4 prompts (2 optimizer steps)
    cfg.system.actor.ppo_micro_batch_size = 4
    batch, before, local, local_metrics = _rollout_batch(grpo, cfg)
    group = build_policy(megatron_cfg(cfg))
    try:
        lp = group.compute_log_prob(batch)["old_log_probs"]
        metrics = group.update(batch, grpo.make_actor_loss(cfg))
        group.save_pretrained(tmp_path / "hf-megatron")
        group.save_checkpoint(tmp_path / "ckpt")
        straight = group.update(batch, grpo.make_actor_loss(cfg))  # the uninterrupted run's next step
        group.load_checkpoint(tmp_path / "ckpt")  # back to the saved step: weights, AdamW moments, scheduler, counter
        again = group.update(batch, grpo.make_actor_loss(cfg))  # (a fresh group would cost ~20 s of CI for the same check)
    finally:
        group.close()
    # same shards, optimizer moments and scheduler step: the resumed step is the uninterrupted one, bit for bit
    assert again == straight and straight["actor/grad_norm"] != metrics["actor/grad_norm"]
    mask = batch["response_mask"].bool()
    # Tolerance: float32, the vocabulary's logsumexp summed in two halves and every matmul split in two: ~1e-6 per token
    assert (lp - batch["old_log_probs"])[mask].abs().max() < 1e-4
    assert metrics["actor/pg_loss"] == pytest.approx(local_metrics["actor/pg_loss"], rel=1e-4, abs=1e-6)
    assert metrics["actor/grad_norm"] == pytest.approx(local_metrics["actor/grad_norm"], rel=1e-4)
    base = load_file(demos.ARITH_MODEL / "model.safetensors")
    hf_local, hf_meg = (load_file(tmp_path / f"hf-{w}/model.safetensors") for w in ("local", "megatron"))
    assert set(hf_meg) == set(hf_local)
    # AdamW's first steps are ~lr * sign(g): where a gradient is ~0 (rare tokens' rows of the tied embedding) float32
    # rounding of the split matmuls moves a weight differently. Measured: 2% of the largest move (FSDP's test: < 1%)
    assert _max_diff(hf_meg, hf_local) <= 0.05 * _max_diff(hf_local, base)
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(tmp_path / "hf-megatron").config.vocab_size == 275


def test_tp2_in_bf16_with_recompute_stays_within_bf16_rounding_of_float32(tmp_path, local_ray):
    """--model.dtype bfloat16 --model.gradient-checkpointing on at T = 2 (issue #36, N12): the row- and column-parallel
    layers' backward under CPU autocast (rlkit/megatron_shims.py), Megatron's recompute and the vocab-parallel
    log-softmax over 2 ranks; log-probs within bf16 rounding of the one-process float32 engine's, and one update."""
    from numerics import assert_within, max_abs_logit, tol
    from transformers import AutoModelForCausalLM

    grpo = load_recipe("grpo")
    cfg = small_config(grpo, tmp_path)
    cfg.system.actor.ppo_micro_batch_size = 4
    batch, _, _, local_metrics = _rollout_batch(grpo, cfg)
    meg = megatron_cfg(cfg)
    config.set_flags(meg, {"model.dtype": "bfloat16", "model.gradient_checkpointing": "on"})
    group = build_policy(meg)
    try:
        lp = group.compute_log_prob(batch)["old_log_probs"]
        metrics = group.update(batch, grpo.make_actor_loss(cfg))
        group.save_checkpoint(tmp_path / "ckpt")
    finally:
        group.close()
    for r in range(2):  # the shards the optimizer steps are float32 masters
        assert {v.dtype for v in torch.load(tmp_path / f"ckpt/rank{r}.pt", weights_only=True)["model"].values()} == {torch.float32}
    hf = AutoModelForCausalLM.from_pretrained(demos.ARITH_MODEL)
    # the bound of test_megatron_bf16_computes_over_float32_masters_and_matches_float32 (derived there)
    n = 9 * hf.config.num_hidden_layers + 2
    bound = tol(torch.bfloat16, max_abs_logit(hf, batch), n)
    mask = batch["response_mask"].bool()
    assert_within(lp[mask], batch["old_log_probs"][mask], bound, "bf16 T=2 vs float32 log-probs (Megatron)")
    # the gradient norm: the same chain of bf16 roundings, relative (measured 1.2e-3 against a bound of 0.21)
    assert metrics["actor/grad_norm"] == pytest.approx(local_metrics["actor/grad_norm"], rel=tol(torch.bfloat16, 1.0, n))


def _recipe_config(recipe, out_dir, steps, **trainer):
    """The recipes' small run (8 prompts x n samples, mini-batches of 4 prompts), every step checkpointed, no validation."""
    cfg = small_config(recipe, out_dir, steps, save_freq=1, test_freq=0, val_before_train=False, max_ckpt_to_keep=0, **trainer)
    cfg.system.actor.ppo_micro_batch_size = 4
    return cfg


def _comparable(rows):
    return [{k: v for k, v in r.items() if not k.startswith(("timing/", "perf/"))} for r in rows]


def _finite_metrics(row):
    nums = {k: v for k, v in row.items() if isinstance(v, (int, float)) and not k.startswith(("timing/", "perf/"))}
    bad = {k: v for k, v in nums.items() if not torch.isfinite(torch.tensor(float(v)))}
    assert not bad, bad
    return nums


def test_grpo_recipe_with_megatron_tp2_matches_fsdp_at_step_1_exports_hf_and_resumes(tmp_path, local_ray):
    """recipes/grpo.py --trainer.backend ray --trainer.engine megatron --trainer.tp-size 2 --trainer.n-workers 2, 2 steps."""
    from transformers import AutoModelForCausalLM

    grpo = load_recipe("grpo")
    full, part, fsdp = tmp_path / "full", tmp_path / "part", tmp_path / "fsdp"
    grpo.main(megatron_cfg(_recipe_config(grpo, full, 2)))
    rows = read_jsonl(full / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert {"actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "actor/entropy", "critic/score/mean"} <= set(_finite_metrics(r))
    assert rows[0]["actor/grad_norm"] > 0 and rows[1]["actor/kl_loss"] != 0  # step 2 starts from moved weights
    # the HF export: loads with from_pretrained, every tensor moved by the two updates
    base = load_file(demos.ARITH_MODEL / "model.safetensors")
    after = load_file(full / "checkpoints/global_step_2/hf/model.safetensors")
    assert set(after) == set(base) and all(not torch.equal(after[k], base[k]) for k in base)
    assert AutoModelForCausalLM.from_pretrained(full / "checkpoints/global_step_2/hf").config.vocab_size == 275

    # step 1 on the FSDP2 engine with 2 workers: the same split of the rollout (each process samples its half of the
    # rows from its own seed on the same weights), so the same responses; then one update on the full batch
    grpo.main(_recipe_config(grpo, fsdp, 1, backend="ray", n_workers=2))
    meg, ref = rows[0], read_jsonl(fsdp / "metrics.jsonl")[0]
    for k in ("critic/score/mean", "response_length/mean"):  # the rollout is the same
        assert meg[k] == ref[k], k
    # Tolerance: float32 with every matmul and the vocabulary's logsumexp split in two. Measured: 6e-6 relative at
    # most (kl_loss, after the first mini-batch's AdamW step), grad norm 3e-7
    for k in ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm", "actor/pg_clipfrac"):
        assert meg[k] == pytest.approx(ref[k], rel=1e-4, abs=1e-6), k

    # the run stopped after step 1 (its checkpoint and metrics, as a 1-step run writes them), then --trainer.resume
    # auto to step 2: the uninterrupted run's metrics and weights (a separate 1-step run would cost ~15 s of CI)
    shutil.copytree(full, part, ignore=shutil.ignore_patterns("global_step_2"))
    grpo.main(megatron_cfg(_recipe_config(grpo, part, 2, resume="auto")))
    assert _comparable(read_jsonl(part / "metrics.jsonl")) == _comparable(rows)
    resumed = load_file(part / "checkpoints/global_step_2/hf/model.safetensors")
    assert all(torch.equal(resumed[k], after[k]) for k in after)


def test_ppo_recipe_with_a_megatron_tp2_actor_and_an_fsdp_critic(tmp_path, local_ray):
    """recipes/ppo.py with the Megatron actor (T=2) and the FSDP2 critic colocated on the same 2 bundles, 2 steps."""
    from transformers import AutoModelForCausalLM

    ppo = load_recipe("ppo")
    cfg = megatron_cfg(_recipe_config(ppo, tmp_path, 2, cpus_per_worker=0.5))
    cfg.rollout.n = 2
    ppo.main(cfg)
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert {"actor/pg_loss", "actor/grad_norm", "critic/vf_loss", "critic/grad_norm", "critic/values/mean"} <= set(_finite_metrics(r))
        assert r["critic/vf_loss"] > 0 and r["critic/grad_norm"] > 0 and r["actor/grad_norm"] > 0
    base = load_file(demos.ARITH_MODEL / "model.safetensors")
    after = load_file(tmp_path / "checkpoints/global_step_2/hf/model.safetensors")
    assert all(not torch.equal(after[k], base[k]) for k in base)
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "checkpoints/global_step_2/hf").config.vocab_size == 275


# -- one process (T = 1) on gloo: precision, recompute, attention and the LM head's positions (issue #36, N12) -------------
@pytest.fixture
def one_process_tp():
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from rlkit import megatron_shims

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    megatron_shims.apply()
    ps.initialize_model_parallel(tensor_model_parallel_size=1)
    yield
    ps.destroy_model_parallel()
    dist.destroy_process_group()


def _engine(dtype: str, checkpointing: str = "off"):
    from rlkit.config import ActorConfig, ModelConfig, ModelSystem
    from rlkit.megatron_workers import MegatronEngine

    torch.manual_seed(0)
    model_sys = ModelSystem(dtype=dtype, gradient_checkpointing=checkpointing)
    return MegatronEngine(ModelConfig(path=str(demos.ARITH_MODEL)), ActorConfig(use_kl_loss=False), device="cpu", model_sys=model_sys)


def _padded_batch(rows=4, prompt=6, response=10):
    """Left-padded prompts (row 1 has 2 pads) + random responses, with advantages."""
    from rlkit.protocol import DataProto
    from rlkit.rollout import assemble

    g = torch.Generator().manual_seed(0)
    mask = torch.ones(rows, prompt, dtype=torch.long)
    mask[1, :2] = 0
    ids = torch.randint(3, 250, (rows, prompt), generator=g) * mask
    prompts = DataProto.from_dict(tensors={"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0)})
    batch = assemble(prompts, torch.randint(3, 250, (rows, response), generator=g), [], 0)
    batch["advantages"] = torch.randn(rows, response, generator=g)
    return batch


def _loss_and_grads(engine, batch):
    """One update micro-batch's loss and gradients (the engine's update context: recompute where it is on)."""
    engine.model.zero_grad(set_to_none=True)
    with engine._checkpointing():
        logp, _ = engine.forward(engine.model, batch, 1.0, False)
        loss = -(logp * batch["advantages"]).sum() / batch["response_mask"].sum()
        loss.backward()
    return loss.detach(), {k: p.grad for k, p in engine.model.named_parameters()}


def test_megatron_bf16_computes_over_float32_masters_and_matches_float32(one_process_tp):
    """--model.dtype bfloat16: float32 shards (the optimizer's), bf16 matmuls under autocast (the LM head's output is
    bf16), a bf16 HF generation copy; log-probs within bf16 rounding of the float32 engine's, float32 gradients."""
    from numerics import assert_within, max_abs_logit, tol

    e32, e16 = _engine("float32"), _engine("bfloat16")
    assert e16.master_fp32 and {p.dtype for p in e16.model.parameters()} == {torch.float32}
    assert next(e16.hf_model.parameters()).dtype == torch.bfloat16
    seen = []
    e16.model.output_layer.register_forward_hook(lambda m, args, out: seen.append(out[0].dtype))
    batch = _padded_batch()
    lp32, _ = e32.compute_log_prob(batch, 1.0, 4)
    lp16, _ = e16.compute_log_prob(batch, 1.0, 4)
    assert seen == [torch.bfloat16]
    # Tolerance (tests/numerics.py's rule): bf16 rounds the values on the path to a logit ~9 times per layer (the
    # matmuls' inputs and outputs, RoPE, the bf16 residual) and twice at the head, n relative errors <= u = 2^-8 adding
    # like a random walk: |dz| <= tol(bf16, max |z|, n) / 2 against float32 (whose own error is negligible), and
    # log p = z - logsumexp(z) moves by at most 2 max |dz| (the logsumexp is float32).
    n = 9 * e32.hf_config.num_hidden_layers + 2
    bound = tol(torch.bfloat16, max_abs_logit(e32.hf_model, batch), n)
    mask = batch["response_mask"].bool()
    assert_within(lp16[mask], lp32[mask], bound, "bf16 vs float32 log-probs (Megatron)")
    _, grads = _loss_and_grads(e16, batch)
    assert all(g.dtype == torch.float32 and torch.isfinite(g).all() for g in grads.values())


def test_megatron_recompute_follows_gradient_checkpointing_and_leaves_loss_and_gradients_unchanged(one_process_tp):
    """--model.gradient-checkpointing on: Megatron's full recompute, one layer at a time, applied in the update (each
    layer runs twice: forward and the backward's recomputation), under the forward's bf16 autocast: the same loss
    and gradients as without it, bit for bit (the recomputation repeats the same kernels on the same shapes)."""
    off, on = _engine("bfloat16", "off"), _engine("bfloat16", "on")
    assert off.model.config.recompute_granularity is None
    c = on.model.config
    assert (c.recompute_granularity, c.recompute_method, c.recompute_num_layers) == ("full", "uniform", 1)
    calls = {}
    batch = _padded_batch()
    results = []
    for name, engine in (("off", off), ("on", on)):
        engine.model.decoder.layers[0].register_forward_hook(lambda m, args, out, name=name: calls.update({name: calls.get(name, 0) + 1}))
        results.append(_loss_and_grads(engine, batch))
    assert calls == {"off": 1, "on": 2}
    (loss_off, g_off), (loss_on, g_on) = results
    assert torch.equal(loss_off, loss_on) and all(torch.equal(g_off[k], g_on[k]) for k in g_off)
    on.compute_log_prob(batch, 1.0, 4)  # outside the update: one forward, nothing to recompute
    assert calls["on"] == 3


def test_megatron_attention_keeps_no_scores_and_the_lm_head_reads_only_response_positions(one_process_tp):
    """Attention by SDPA (no (b, heads, L, L) tensor: Megatron's DotProductAttention keeps the scores and softmax per
    layer); the output layer on the keep + 1 positions that predict the response, not on every position."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    from rlkit.megatron_workers import sdpa_attention_class

    engine = _engine("bfloat16")
    assert all(isinstance(layer.self_attention.core_attention, sdpa_attention_class()) for layer in engine.model.decoder.layers)
    batch = _padded_batch()
    b, L, R, heads = len(batch), batch["input_ids"].shape[1], batch["responses"].shape[1], engine.hf_config.num_attention_heads

    class Shapes(TorchDispatchMode):
        big = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_flatten(out)[0]:  # scores or probabilities: (..., L, L) over every head (not the (b, 1, L, L) mask)
                if isinstance(t, torch.Tensor) and t.shape[-2:] == (L, L) and t.numel() >= b * heads * L * L:
                    self.big.append(tuple(t.shape))
            return out

    logits = []
    engine.model.output_layer.register_forward_hook(lambda m, args, out: logits.append(out[0].shape))
    with Shapes() as mode:
        engine.compute_log_prob(batch, 1.0, b)
    assert mode.big == [] and logits == [(R + 1, b, engine.hf_config.vocab_size)]
