"""Scale-out: the same GRPO update on 1 and on 2 FSDP2 workers (Ray, gloo on CPU) gives the same weights,
and a run joins a Ray cluster started separately with `ray start --head`."""

import os
import shutil
import subprocess
import sys

import pytest
import torch

ray = pytest.importorskip("ray")

from rlkit import algos  # noqa: E402
from rlkit.data import PromptLoader, build_prompts  # noqa: E402
from rlkit.ray_group import free_port  # noqa: E402
from rlkit.workers import build_policy  # noqa: E402
from test_grpo_recipe import ROOT, load_recipe, read_jsonl, small_config  # noqa: E402


def _rollout_batch(grpo, cfg):
    """One step's batch, made exactly as recipes/grpo.py makes it, on the local (in-process) worker."""
    torch.manual_seed(0)
    policy = build_policy(cfg)
    tok = policy.tokenizer
    loader = PromptLoader(build_prompts(cfg.data.train_files, tok, cfg.data), cfg.data.train_batch_size, tok.pad_token_id, True, 0)
    batch = loader.next_batch()
    batch["uid"] = [str(i) for i in range(len(batch))]
    batch = policy.generate(batch.repeat(cfg.rollout.n))
    batch = batch.union(policy.compute_ref_log_prob(batch)).union(policy.compute_log_prob(batch))
    scores = torch.rand(len(batch))  # graded rewards so every group carries signal
    adv = algos.grpo_advantage(scores, batch["uid"])
    batch["advantages"] = adv[:, None] * batch["response_mask"]
    before = {k: v.clone() for k, v in policy.state_dict()["model"].items()}
    policy.update(batch, grpo.make_actor_loss(cfg))
    after_local = policy.state_dict()["model"]
    return batch, before, after_local


def _update_on_ray(grpo, cfg, batch, n_workers):
    cfg.trainer.backend, cfg.trainer.n_workers = "ray", n_workers
    group = build_policy(cfg)
    try:
        group.update(batch, grpo.make_actor_loss(cfg))
        return group.state_dict()["model"]
    finally:
        group.shutdown()


def test_one_update_agrees_across_one_and_two_fsdp_workers(tmp_path):
    grpo = load_recipe("grpo")
    cfg = small_config(grpo, tmp_path)  # 8 prompts x 4 samples, mini-batches of 4 prompts (2 optimizer steps), micro 16
    cfg.actor.ppo_micro_batch_size = 4
    batch, before, local = _rollout_batch(grpo, cfg)
    try:
        from rlkit.ray_group import init_ray

        init_ray(num_cpus=2)
        one = _update_on_ray(grpo, cfg, batch, 1)
        two = _update_on_ray(grpo, cfg, batch, 2)
    finally:
        ray.shutdown()
    moved = max((local[k] - before[k]).abs().max().item() for k in before)
    assert moved > 1e-5  # the update did something (two AdamW steps of lr 1e-4)
    # Tolerance: float32 sums reordered across processes; AdamW's first steps (~lr * sign(g)) amplify the
    # rounding only where a gradient is ~0, so we bound the difference by 1% of the largest parameter move.
    for name, ref in (("1 worker", one), ("2 workers", two)):
        diff = max((ref[k] - local[k]).abs().max().item() for k in local)
        assert diff <= 0.01 * moved, (name, diff, moved)


@pytest.mark.skipif(shutil.which("ray") is None and not os.path.exists(os.path.join(os.path.dirname(sys.executable), "ray")),
                    reason="the ray command-line tool is not installed")
def test_a_run_joins_a_ray_cluster_started_separately(tmp_path):
    ray_cli = os.path.join(os.path.dirname(sys.executable), "ray")
    port = free_port()
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled", "OMP_NUM_THREADS": "1"}
    env.pop("RAY_ADDRESS", None)
    start = subprocess.run([ray_cli, "start", "--head", "--node-ip-address", "127.0.0.1", "--port", str(port), "--num-cpus", "2",
                            "--include-dashboard", "false", "--disable-usage-stats"], capture_output=True, text=True, env=env, timeout=120)
    assert start.returncode == 0, start.stderr[-2000:]
    try:
        out = subprocess.run(
            [sys.executable, str(ROOT / "recipes/grpo.py"), "--trainer.backend", "ray", "--trainer.n-workers", "2",
             "--trainer.ray-address", f"127.0.0.1:{port}", "--trainer.total-training-steps", "2", "--data.train-batch-size", "8",
             "--actor.ppo-mini-batch-size", "8", "--rollout.n", "4", "--data.val-max-samples", "16",
             "--trainer.default-local-dir", str(tmp_path)],
            capture_output=True, text=True, env=env, timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        assert "Connecting to existing Ray cluster" in out.stderr + out.stdout
        assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [0, 1, 2]
        assert (tmp_path / "checkpoints/global_step_2/hf/model.safetensors").is_file()
    finally:
        subprocess.run([ray_cli, "stop", "--force"], capture_output=True, env=env, timeout=120)
