"""Scale-out on Ray with FSDP2 (gloo on CPU): the same GRPO update on 1 and on 2 workers gives the same weights
(full and LoRA, and in bf16 compute within bf16's precision); sharded checkpoints reshard; PPO's critic runs
colocated or on its own pool, and a resumed run matches an uninterrupted one. (Ray in its own processes:
tests/test_ray_cluster.py.)"""

import copy
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

ray = pytest.importorskip("ray")

from test_grpo_recipe import load_recipe, read_jsonl, small_config  # noqa: E402

from rlkit import algos, config, demos  # noqa: E402
from rlkit.data import PromptLoader, build_prompts  # noqa: E402
from rlkit.placement import build_critic, build_policy  # noqa: E402


@pytest.fixture(scope="module")
def local_ray():
    from rlkit.ray_group import init_ray

    init_ray(num_cpus=2)
    yield
    ray.shutdown()


def _rollout_batch(grpo, cfg):
    """One step's batch, made exactly as recipes/grpo.py makes it, on the local (in-process) worker."""
    torch.manual_seed(0)
    policy = build_policy(cfg)
    tok = policy.tokenizer
    loader = PromptLoader(
        build_prompts(cfg.data.train_files, tok, cfg.data, cfg.system.data), cfg.data.train_batch_size, tok.pad_token_id, True, 0
    )
    batch = loader.next_batch()
    batch["uid"] = [str(i) for i in range(len(batch))]
    batch = policy.generate(batch.repeat(cfg.rollout.n))
    batch = batch.union(policy.compute_ref_log_prob(batch)).union(policy.compute_log_prob(batch))
    scores = torch.rand(len(batch))  # graded rewards so every group carries signal
    adv = algos.grpo_advantage(scores, batch["uid"])
    batch["advantages"] = adv[:, None] * batch["response_mask"]
    before = {k: v.clone() for k, v in policy.state_dict()["model"].items()}
    metrics = policy.update(batch, grpo.make_actor_loss(cfg))
    after_local = policy.state_dict()["model"]
    policy.save_pretrained(Path(cfg.system.trainer.default_local_dir) / "hf-local")
    return batch, before, after_local, metrics


def _update_on_ray(grpo, cfg, batch, n_workers, **trainer):
    """trainer: --trainer.* options by name (fsdp_param_dtype, fsdp_offload, ...)."""
    cfg = copy.deepcopy(cfg)
    config.set_flags(cfg, {"trainer.backend": "ray", "trainer.n_workers": n_workers} | {f"trainer.{k}": v for k, v in trainer.items()})
    group = build_policy(cfg)
    try:
        metrics = group.update(batch, grpo.make_actor_loss(cfg))
        group.save_pretrained(Path(cfg.system.trainer.default_local_dir) / f"hf-{n_workers}")
        return group.state_dict()["model"], metrics
    finally:
        group.close()


def _max_diff(a, b):
    return max((a[k] - b[k]).abs().max().item() for k in b)


@pytest.mark.parametrize("lora_rank", [0, 4])
def test_one_update_agrees_across_one_and_two_fsdp_workers(tmp_path, local_ray, lora_rank):
    grpo = load_recipe("grpo")
    cfg = small_config(grpo, tmp_path)  # 8 prompts x 4 samples, mini-batches of 4 prompts (2 optimizer steps), micro 4
    cfg.system.actor.ppo_micro_batch_size = 4
    cfg.model.lora_rank = lora_rank
    if lora_rank:
        cfg.actor.lr = 1e-3  # LoRA's B starts at 0: a larger step so that the adapter moves measurably
    batch, before, local, local_metrics = _rollout_batch(grpo, cfg)
    one, _ = _update_on_ray(grpo, cfg, batch, 1)
    two, two_metrics = _update_on_ray(grpo, cfg, batch, 2)
    assert set(two) == set(local)  # with LoRA: the adapter only, as in a single-process checkpoint
    assert not lora_rank or all("lora_" in k for k in two)
    moved = _max_diff(local, before)
    assert moved > 1e-5  # the update did something (two AdamW steps)
    # Tolerance: float32 sums reordered across processes; AdamW's first steps (~lr * sign(g)) amplify the
    # rounding only where a gradient is ~0, so we bound the difference by 1% of the largest parameter move.
    for name, ref in (("1 worker", one), ("2 workers", two)):
        assert _max_diff(ref, local) <= 0.01 * moved, (name, _max_diff(ref, local), moved)
    # the gradient norm (clipping's input) is the global one: each shard's norm alone would be smaller
    assert two_metrics["actor/grad_norm"] == pytest.approx(local_metrics["actor/grad_norm"], rel=1e-4)
    assert two_metrics["actor/pg_loss"] == pytest.approx(local_metrics["actor/pg_loss"], rel=1e-4, abs=1e-6)
    # the Hugging Face export (LoRA merged) gathered from the shards is the one-process export
    base = load_file(demos.ARITH_MODEL / "model.safetensors")
    hf_local, hf_two = (load_file(tmp_path / f"hf-{w}/model.safetensors") for w in ("local", 2))
    assert set(hf_two) == set(hf_local) == set(base)
    assert _max_diff(hf_two, hf_local) <= 0.01 * _max_diff(hf_local, base)


def test_mixed_precision_update_keeps_float32_master_weights_and_lands_near_the_float32_one(tmp_path, local_ray):
    grpo = load_recipe("grpo")
    cfg = small_config(grpo, tmp_path)
    cfg.system.actor.ppo_micro_batch_size = 4
    batch, before, local, _ = _rollout_batch(grpo, cfg)
    bf16, _ = _update_on_ray(grpo, cfg, batch, 2, fsdp_param_dtype="bfloat16", fsdp_offload=True)
    assert all(v.dtype == torch.float32 for v in bf16.values())  # master weights stay float32
    # bf16 compute perturbs each gradient by ~0.4%; AdamW's first steps are ~lr * sign(g), so single weights whose
    # gradient is ~0 may step the other way, but the update as a whole must point where the float32 one does
    d32 = torch.cat([(local[k] - before[k]).flatten() for k in before])
    d16 = torch.cat([(bf16[k] - before[k]).flatten() for k in before])
    cos = torch.nn.functional.cosine_similarity(d32, d16, dim=0).item()
    print(f"cosine(bf16 update, float32 update) = {cos:.4f}")
    assert d16.abs().max() > 0 and not torch.equal(d16, d32)  # it moved, and not bit-identically (bf16 was used)
    assert cos > 0.9, cos


def test_sharded_checkpoint_of_two_workers_loads_into_one(tmp_path, local_ray):
    grpo = load_recipe("grpo")
    cfg = small_config(grpo, tmp_path)
    batch, *_ = _rollout_batch(grpo, cfg)
    config.set_flags(cfg, {"trainer.backend": "ray", "trainer.n_workers": 2})
    two = build_policy(cfg)
    try:
        two.update(batch, grpo.make_actor_loss(cfg))
        saved = two.state_dict()
        two.save_checkpoint(tmp_path / "policy")
    finally:
        two.close()
    files = sorted(p.name for p in (tmp_path / "policy").iterdir())
    assert files == [".metadata", "__0_0.distcp", "__1_0.distcp", "extra_state.pt"]  # one shard per process
    cfg.system.scale_out.n_workers = 1
    one = build_policy(cfg)
    try:
        fresh = one.state_dict()
        one.load_checkpoint(tmp_path / "policy")
        loaded = one.state_dict()
    finally:
        one.close()
    assert _max_diff(fresh["model"], saved["model"]) > 0  # loading changes something
    assert all(torch.equal(loaded["model"][k], saved["model"][k]) for k in saved["model"])
    a, b = saved["optimizer"]["state"], loaded["optimizer"]["state"]
    assert set(a) == set(b) and all(torch.equal(a[k][s], b[k][s]) for k in a for s in ("exp_avg", "exp_avg_sq", "step"))
    assert loaded["scheduler"] == saved["scheduler"] and loaded["updates"] == saved["updates"] == 1


def _ppo_config(ppo, out_dir, steps, **trainer):
    cfg = ppo.Config()
    cfg.data.train_batch_size = 8
    cfg.system.data.val_max_samples = 16
    cfg.actor.ppo_mini_batch_size = 4
    cfg.rollout.n = 2
    cfg.trainer.total_training_steps = steps
    cfg.system.trainer.default_local_dir = str(out_dir)
    cfg.system.trainer.test_freq = 0
    cfg.system.trainer.val_before_train = False
    cfg.system.trainer.save_freq = 1
    cfg.system.trainer.max_ckpt_to_keep = 0
    cfg.system.scale_out.backend, cfg.system.scale_out.n_workers, cfg.system.scale_out.cpus_per_worker = "ray", 2, 0.5
    return config.set_flags(cfg, {f"trainer.{k}": v for k, v in trainer.items()})  # resume, critic_workers, ...


def _comparable(rows):
    return [{k: v for k, v in r.items() if not k.startswith(("timing/", "perf/"))} for r in rows]


def test_ppo_on_ray_critic_colocated_resumes_from_sharded_checkpoints_like_an_uninterrupted_run(tmp_path, local_ray):
    ppo = load_recipe("ppo")
    full, part = tmp_path / "full", tmp_path / "part"
    ppo.main(_ppo_config(ppo, full, 2))  # actor and critic: 2 workers each, sharing 2 bundles of 0.5 CPU
    step1 = full / "checkpoints/global_step_1"
    for role in ("policy", "critic"):
        assert {"__0_0.distcp", "__1_0.distcp", ".metadata"} <= {p.name for p in (step1 / role).iterdir()}
    ppo.main(_ppo_config(ppo, part, 2, resume=str(step1)))
    a, b = read_jsonl(full / "metrics.jsonl"), read_jsonl(part / "metrics.jsonl")
    assert [r["step"] for r in b] == [2]
    assert "critic/vf_loss" in a[-1] and "actor/pg_loss" in a[-1]
    assert _comparable(a)[-1] == _comparable(b)[-1]
    wa = load_file(full / "checkpoints/global_step_2/hf/model.safetensors")
    wb = load_file(part / "checkpoints/global_step_2/hf/model.safetensors")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert not ray.util.placement_group_table() or all(
        pg["state"] == "REMOVED" for pg in ray.util.placement_group_table().values()
    )  # the runs freed their pools


def test_the_critic_starts_from_the_same_value_head_on_both_backends(tmp_path, local_ray):
    ppo = load_recipe("ppo")
    cfg = _ppo_config(ppo, tmp_path, 1, critic_workers=1)
    on_ray = build_critic(cfg)  # built alone: on pools made for it, freed when it is closed
    try:
        ray_head = on_ray.state_dict()["model"]["score.weight"]
    finally:
        on_ray.close()
    assert all(pg["state"] == "REMOVED" for pg in ray.util.placement_group_table().values())
    cfg.system.scale_out.backend = "local"
    local_head = build_critic(cfg).state_dict()["model"]["score.weight"]
    assert torch.equal(ray_head, local_head) and local_head.abs().max() > 0


def test_ppo_critic_on_a_pool_of_its_own(tmp_path, local_ray):
    ppo = load_recipe("ppo")
    ppo.main(_ppo_config(ppo, tmp_path, 1, critic_workers=1))  # actor: 2 x 0.5 CPU; critic: 1 x 0.5 CPU, own pool
    row = read_jsonl(tmp_path / "metrics.jsonl")[-1]
    assert row["critic/vf_loss"] > 0 and "actor/pg_loss" in row
    critic_files = {p.name for p in (tmp_path / "checkpoints/global_step_1/critic").iterdir()}
    assert "__0_0.distcp" in critic_files and "__1_0.distcp" not in critic_files  # one critic process


def test_hybrid_engine_generates_on_gathered_weights_like_one_process_then_frees_them(tmp_path, local_ray):
    grpo = load_recipe("grpo")
    cfg = small_config(grpo, tmp_path)
    local = build_policy(cfg)
    tok = local.tokenizer
    prompts = build_prompts(cfg.system.data.val_files, tok, cfg.data, cfg.system.data, 32).batch(list(range(32)), tok.pad_token_id)
    want = local.generate(prompts, validate=True)  # greedy
    config.set_flags(cfg, {"trainer.backend": "ray", "trainer.n_workers": 2})
    group = build_policy(cfg)
    try:
        got = group.generate(prompts, validate=True)  # 16 prompts per worker, each on its own full weights
        # afterwards every parameter is a shard (a DTensor) again: FSDP2 swaps in plain full tensors while unsharded
        sharded = lambda worker: all(type(p).__name__ == "DTensor" for p in worker.engine.model.parameters())  # noqa: E731
        assert group._get([w.__ray_call__.remote(sharded) for w in group.workers]) == [True, True]
        sampled = group.generate(prompts.repeat(2))
    finally:
        group.close()
    assert torch.equal(got["responses"], want["responses"]) and torch.equal(got["response_mask"], want["response_mask"])
    assert sampled["response_mask"].sum() > 0 and not torch.equal(sampled["responses"][:32], sampled["responses"][32:])


def test_bad_scale_out_settings_fail_before_ray_starts_and_name_the_flag(tmp_path):
    grpo, ppo = load_recipe("grpo"), load_recipe("ppo")
    cfg = small_config(grpo, tmp_path, backend="ray", n_workers=3)  # mini-batch: 4 prompts x 4 samples = 16 trajectories
    with pytest.raises(ValueError, match="16 trajectories .* --trainer.n-workers 3"):
        build_policy(cfg)
    cfg = _ppo_config(ppo, tmp_path, 1, critic_workers=3)  # critic mini-batch: 4 prompts x 2 samples = 8
    with pytest.raises(ValueError, match="critic mini-batch of 8 trajectories .* --trainer.critic-workers 3"):
        build_policy(cfg, critic=cfg.critic)
    assert (
        not ray.is_initialized()
        or not ray.util.placement_group_table()
        or all(pg["state"] == "REMOVED" for pg in ray.util.placement_group_table().values())
    )  # nothing was placed
