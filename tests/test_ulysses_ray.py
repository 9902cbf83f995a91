"""--trainer.sp-size 2 on Ray (gloo on CPU): a GRPO update on 2 FSDP workers that split every row's positions (one
sequence-parallel group, D = 1 replica) equals the one-process update on the same batch: log-probs (split_dp dispatch,
left-padded rows shifted), the loss and gradient norm (counts over the dp group, FSDP's 1/S undone), the weights.

The batch is the rollout's (left-padded prompts, right-padded responses of different lengths), made once on the
in-process worker in the padded layout, which is the reference. One Ray group of 2 workers (~15 s on 2 CPU cores).
"""

import copy

import pytest
import torch
from numerics import tiny_log_prob_tol

ray = pytest.importorskip("ray")

from test_fsdp import _max_diff, local_ray  # noqa: E402,F401
from test_grpo_recipe import load_recipe, small_config  # noqa: E402

from rlkit import algos, config  # noqa: E402
from rlkit.data import PromptLoader, build_prompts  # noqa: E402
from rlkit.placement import build_policy  # noqa: E402


def _left_pad(batch, rows, k: int, pad_id: int):
    """Rows' prompts cut by their first k tokens, now padding: the demo prompts are all one length, the SP pass must
    see left padding of different widths (shift_left)."""
    ids, mask = batch["input_ids"].clone(), batch["attention_mask"].clone()
    ids[rows, :k], mask[rows, :k] = pad_id, 0
    batch["input_ids"], batch["attention_mask"] = ids, mask
    batch["prompts"] = ids[:, : batch["prompts"].shape[1]]
    batch["position_ids"] = (mask.cumsum(-1) - 1).clamp(min=0)
    return batch


def _rollout_batch(grpo, cfg):
    """One step's batch as recipes/grpo.py makes it (some prompts left-padded), scored and updated in-process."""
    torch.manual_seed(0)
    policy = build_policy(cfg)
    tok = policy.tokenizer
    loader = PromptLoader(
        build_prompts(cfg.data.train_files, tok, cfg.data, cfg.system.data), cfg.data.train_batch_size, tok.pad_token_id, True, 0
    )
    batch = loader.next_batch()
    batch["uid"] = [str(i) for i in range(len(batch))]
    batch = policy.generate(batch.repeat(cfg.rollout.n))
    batch = _left_pad(batch, slice(0, None, 3), 2, tok.pad_token_id)
    batch = _left_pad(batch, slice(1, None, 3), 5, tok.pad_token_id)
    batch = batch.union(policy.compute_ref_log_prob(batch)).union(policy.compute_log_prob(batch))
    adv = algos.grpo_advantage(torch.rand(len(batch)), batch["uid"])  # graded rewards so every group carries signal
    batch["advantages"] = adv[:, None] * batch["response_mask"]
    before = {k: v.clone() for k, v in policy.state_dict()["model"].items()}
    metrics = policy.update(batch, grpo.make_actor_loss(cfg))
    after = {k: v.clone() for k, v in policy.state_dict()["model"].items()}  # (the live tensors: the next update moves them)
    return batch, before, after, metrics, policy.update(batch, token_sum_loss(grpo, cfg))


def token_sum_loss(grpo, cfg):
    """The actor loss with --actor.loss-agg-mode token-sum: the one mode that reads the normaliser's dp_size (the
    replicas D, not the N = D S ranks: a count over the world group gets the token mean right but not this)."""
    cfg = copy.deepcopy(cfg)
    cfg.actor.loss_agg_mode = "token-sum"
    return grpo.make_actor_loss(cfg)


@pytest.fixture(scope="module")
def sp_run(tmp_path_factory, local_ray):  # noqa: F811
    grpo = load_recipe("grpo")
    cfg = small_config(grpo, tmp_path_factory.mktemp("sp"))  # 8 prompts x 4 samples, 2 mini-batches of 16 rows: 2 AdamW steps
    cfg.system.actor.ppo_micro_batch_size = 8  # 2 micro-batches per mini-batch per worker: the counts span micro-batches
    cfg.system.model.remove_padding = False  # SP takes padded rows (packed ones are refused: docs/scaling.md)
    batch, before, local, local_metrics, local_sum = _rollout_batch(grpo, cfg)
    sp_cfg = config.set_flags(copy.deepcopy(cfg), {"trainer.backend": "ray", "trainer.n_workers": 2, "trainer.sp_size": 2})
    group = build_policy(sp_cfg)
    try:
        assert group._sp_size() == 2
        rows = batch.select([k for k in batch.tensors if k not in ("old_log_probs", "ref_log_prob", "entropys")])
        fresh = group.compute_log_prob(rows)  # before the update: the weights the local batch was scored with
        ref = group.compute_ref_log_prob(rows)  # (a batch carrying ref_log_prob would get its own back)
        metrics = group.update(batch, grpo.make_actor_loss(cfg))
        after = group.state_dict()["model"]
        sp_sum = group.update(batch, token_sum_loss(grpo, cfg))  # a second update, from the weights compared above
    finally:
        group.close()
    return batch, before, local, local_metrics, fresh, ref, after, metrics, local_sum, sp_sum


def test_sp_log_probs_equal_the_padded_one_process_ones(sp_run):
    batch, _, local, _, fresh, ref, *_ = sp_run
    mask = batch["response_mask"].bool()
    assert fresh["old_log_probs"].shape == batch["old_log_probs"].shape
    assert sorted(set((batch["attention_mask"][:, : batch["prompts"].shape[1]] == 0).sum(1).tolist())) == [0, 2, 5]  # left padding
    assert len(set(batch["response_mask"].sum(1).tolist())) > 1  # responses of different lengths (right padding)
    # float32, the same attention sums over another layout (shard + all-to-all): tests/numerics.py's bound for the
    # tiny model (|logits| <= 20); a row read at the wrong offset or a padding token attended to moves log-probs by 1e-2+
    bound = tiny_log_prob_tol()
    for key, got in (("old_log_probs", fresh), ("ref_log_prob", ref)):
        diff = (got[key] - batch[key])[mask].abs().max().item()
        print(f"{key}: max |SP - one process| = {diff:.2e} (bound {bound:.1e})")
        assert diff <= bound, (key, diff, bound)


def test_sp_update_equals_the_one_process_update(sp_run):
    _, before, local, local_metrics, _, _, after, metrics, *_ = sp_run
    moved = _max_diff(local, before)
    assert moved > 1e-5
    d = torch.cat([(after[k] - local[k]).abs().flatten() for k in local])  # every weight entry, SP vs one process
    diff, outliers, total = d.max().item(), int((d > 0.01 * moved).sum()), d.numel()
    print(f"weights: max |SP - one process| = {diff:.2e}, the update's largest move {moved:.2e}, {outliers} of {total} beyond 1 %")
    # float32 sums reordered (the gradient summed over 2 ranks' shares, FSDP's reduce-scatter). AdamW's first steps
    # (~lr * g / (|g| + eps)) turn a gradient's rounding into a move of up to lr where the gradient itself is within
    # rounding of 0: such entries may differ by up to the largest move (measured on an AVX-512 CPU: one entry at 1.7 %
    # of it), every other one by rounding. So: no entry beyond the largest move, and at most 1 in 1000
    # beyond 1 % of it (a wrong shard, offset or normalisation moves most entries by far more)
    assert diff <= moved and outliers <= total // 1000, (diff, moved, outliers, total)
    # Adam is nearly blind to a gradient scaled by a constant, so the loss and the gradient norm pin the normalisation:
    # counts over the world group (2x) or FSDP's 1/S left in would move them by a factor 2; float32 rounding ~1e-6
    for key in ("actor/grad_norm", "actor/pg_loss", "actor/loss"):
        print(f"{key}: SP {metrics[key]:.6g}, one process {local_metrics[key]:.6g}")
        assert metrics[key] == pytest.approx(local_metrics[key], rel=1e-4, abs=1e-6), key


def test_sp_token_sum_update_counts_the_replicas_not_the_ranks(sp_run):
    *_, local_sum, sp_sum = sp_run
    # token-sum multiplies the loss by the normaliser's dp_size: the replicas (1 here), not the 2 ranks (a factor 2)
    for key in ("actor/grad_norm", "actor/pg_loss"):
        print(f"token-sum {key}: SP {sp_sum[key]:.6g}, one process {local_sum[key]:.6g}")
        assert sp_sum[key] == pytest.approx(local_sum[key], rel=1e-4, abs=1e-6), key
