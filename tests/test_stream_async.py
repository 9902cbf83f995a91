"""In-flight weight updates in the async generation worker, per-token staleness, --trainer.max-staleness (issue #37).

The fast loop's own swap mechanics (tokens before/after t, keep_kv vs reprefill) are tests/test_stream_decode.py's; here:
the worker wiring (rlkit/async_rollout.py: the updates queue, Generator.on_new_weights), the metrics (staleness()), the
drop (sample_keep -> workers.update masks the rows out of the loss) and the flags' refusals. Two tiny grpo runs, ~1 min.
"""

import functools
import multiprocessing as mp

import pytest
import torch
from stream_hooks import slowed
from test_grpo_recipe import load_recipe, read_jsonl
from test_off_policy import quick_config

from rlkit import preflight
from rlkit.async_rollout import Rollouts, staleness
from rlkit.config import check_flags, set_flags
from rlkit.errors import ConfigError


def test_staleness_of_a_hand_built_batch():
    """Trainer at version 5; rows: [3, 3, 4, 4] (a swap 3 -> 4 after two tokens), [4, 4, 5, pad], [2, 2, pad, pad]
    (oldest token 3 behind), an empty row. s_it over the 9 tokens: 2,2,1,1, 1,1,0, 3,3 -> mean 14/9, max 3;
    spans 1, 1, 0 over the 3 rows with tokens -> mean 2/3, max 1. max_staleness 2 drops row 2 only (5 - 2 = 3 > 2)."""
    v = torch.tensor([[3, 3, 4, 4], [4, 4, 5, -1], [2, 2, -1, -1], [-1, -1, -1, -1]])
    mask = (v >= 0).long()
    sums, keep = staleness(v, mask, 5, max_staleness=2)
    assert sums["tokens"] == 9 and sums["stale_sum"] == 14 and sums["stale_max"] == 3
    assert sums["rows"] == 3 and sums["span_sum"] == 2 and sums["span_max"] == 1
    assert keep.tolist() == [True, True, False, True] and sums["dropped"] == 1
    _, keep = staleness(v, mask, 5, max_staleness=3)  # 3 behind is allowed
    assert keep.all()
    _, keep = staleness(v, mask, 5, max_staleness=1)  # row 0's oldest is 2 behind, row 1's 1
    assert keep.tolist() == [False, True, False, True]
    _, keep = staleness(v, mask, 5)  # 0: off
    assert keep.all()


def test_in_flight_swaps_stamp_several_versions_in_a_sample(tmp_path, monkeypatch):
    """k = 1, --trainer.swap-every 1, a slow generator (each poll sleeps 0.4 s, stream_hooks.slowed: generating a batch outlasts an update).
    Step 1's batch is all version 0 (trainer at 0). From step 2 on the trainer is at t-1 when it takes batch t, which
    the worker began on version t-2 (the newest pushed when it started): its first tokens are 1 behind, and once the
    trainer pushes t-1 (after update t-1) the tokens still to come are sampled by t-1, 0 behind: staleness max 1, mean
    in (0, 1), a sample spans at most 1 version, and some sample does span 1."""
    monkeypatch.setattr(Rollouts, "serve", staticmethod(functools.partial(slowed, poll_s=0.4)))
    grpo = load_recipe("grpo")
    cfg = quick_config(grpo, tmp_path, steps=3, async_steps=1, swap_every=1, swap_mode="reprefill")
    grpo.main(cfg)
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["async/staleness"] for r in rows] == [0, 1, 1]  # the version each batch started on: k-step's
    assert rows[0]["async/token_staleness_max"] == 0 and rows[0]["async/version_span_max"] == 0
    for r in rows[1:]:
        assert r["async/token_staleness_max"] == 1 and 0 <= r["async/token_staleness_mean"] <= 1
        assert r["async/version_span_max"] <= 1 and r["async/dropped_samples"] == 0
    assert max(r["async/version_span_max"] for r in rows) == 1  # weights changed inside a generation
    assert any(0 < r["async/token_staleness_mean"] < 1 for r in rows[1:])
    assert mp.active_children() == []


def test_sample_keep_masks_samples_out_of_the_loss():
    """--trainer.max-staleness without the queue: staleness()'s keep mask reaches workers.update as sample_keep and
    masks those rows' tokens out of the loss: all masked -> no token in the loss, gradient norm exactly 0; half -> > 0.
    (k-step alone, s < k would mask every batch from step k+1 on: refused, see below and tests/test_stream_queue.py.)"""
    grpo = load_recipe("grpo")
    trainer, *_, prompts = worker_setup(temperature=2.0)
    batch = trainer.generate(prompts.repeat(2, interleave=True))  # (16, R)
    batch = batch.union(trainer.compute_log_prob(batch))
    batch["advantages"] = torch.randn(len(batch))[:, None] * batch["response_mask"]
    cfg = grpo.Config()
    cfg.actor.use_kl_loss = False  # (no reference pass here: the loss is the clipped surrogate alone)
    loss = grpo.make_actor_loss(cfg)
    batch["sample_keep"] = torch.zeros(len(batch), dtype=torch.bool)
    assert trainer.update(batch, loss)["actor/grad_norm"] == 0
    batch["sample_keep"] = torch.arange(len(batch)) % 2 == 0
    assert trainer.update(batch, loss)["actor/grad_norm"] > 0


@pytest.mark.parametrize(
    "sets,match",
    [
        ({"trainer.swap_every": 4}, "--trainer.swap-every applies to the asynchronous"),
        ({"trainer.max_staleness": 2}, "--trainer.max-staleness applies to the asynchronous"),
        ({"trainer.async_steps": 1, "trainer.swap_every": -1}, "--trainer.swap-every -1"),
        ({"trainer.async_steps": 1, "trainer.max_staleness": -2}, "--trainer.max-staleness -2"),
        ({"trainer.async_steps": 2, "trainer.max_staleness": 1}, "--trainer.max-staleness 1 < --trainer.async-steps 2 masks every batch"),
        ({"trainer.queue_groups": 2}, "--trainer.queue-groups applies to the asynchronous"),
        ({"trainer.async_steps": 1, "trainer.queue_groups": -1}, "--trainer.queue-groups -1"),
        ({"trainer.async_steps": 1, "trainer.queue_groups": 2, "trainer.backend": "ray"}, "--trainer.queue-groups 2 does not run with"),
        ({"trainer.async_steps": 1, "trainer.swap_mode": "reprefill"}, "--trainer.swap-mode reprefill applies"),
        ({"rollout.drop_finished": 1.5}, "--rollout.drop-finished 1.5"),
        ({"rollout.drop_finished": 0.5, "rollout.hf_impl": "generate"}, "--rollout.hf-impl generate keeps"),
        ({"rollout.drop_finished": 0.5, "rollout.name": "vllm"}, "--rollout.name vllm schedules"),
        ({"trainer.async_steps": 1, "trainer.swap_every": 4, "rollout.name": "vllm"}, "swap-every 4 does not run with --rollout.name vllm"),
        ({"trainer.async_steps": 1, "trainer.swap_every": 4, "rollout.hf_impl": "generate"}, "with --rollout.hf-impl generate"),
        ({"trainer.async_steps": 1, "trainer.swap_every": 4, "trainer.backend": "ray"}, "with --trainer.backend ray"),
    ],
)
def test_impossible_combinations_are_refused_in_one_line(tmp_path, sets, match):
    grpo = load_recipe("grpo")
    cfg = set_flags(quick_config(grpo, tmp_path), sets)
    with pytest.raises(ConfigError, match=match.replace("(", r"\(")) as e:
        check_flags(cfg)
        preflight.check_async(cfg)
    assert "\n" not in str(e.value)


def test_swap_is_refused_with_the_turn_loop(tmp_path):
    tools = load_recipe("grpo_tools")
    cfg = quick_config(tools, tmp_path, async_steps=1, swap_every=2)
    with pytest.raises(ConfigError, match="turn loop"):
        preflight.check_async(cfg)


class Scripted:
    """A stand-in for the updates queue: get_nowait returns the next scripted payload, or raises Empty at a None."""

    def __init__(self, *items):
        self.items = list(items)

    def get_nowait(self):
        import queue

        if not self.items or self.items[0] is None:
            self.items[:1] = []
            raise queue.Empty
        return self.items.pop(0)


def worker_setup(temperature: float, drop_finished: float = 0.0):
    from rlkit.config import ActorConfig, ActorSystem, DataConfig, ModelConfig, RolloutConfig, RolloutSystem, System
    from rlkit.data import build_prompts
    from rlkit.workers import ActorRolloutRefWorker

    actor, data = ActorConfig(), DataConfig(max_response_length=12)
    system = System(actor=ActorSystem(ppo_micro_batch_size=8), rollout=RolloutSystem(drop_finished=drop_finished))
    rollout = RolloutConfig(n=2, temperature=temperature)
    trainer = ActorRolloutRefWorker(ModelConfig(), actor, rollout, data, device="cpu", need_ref=False, system=system)
    prompts = build_prompts(data.train_files, trainer.tokenizer, data, system.data).batch(list(range(8)), trainer.tokenizer.pad_token_id)
    return trainer, actor, data, prompts


def test_the_generator_loads_weights_pushed_mid_generation():
    """In process, the updates queue scripted: the job awaits version 0 (weights A on the queue), the poll at token 2
    finds version 1 (weights B): tokens 0-1 carry 0, tokens from 2 on carry 1, the batch's policy_version is 0 (where
    it started), and the worker ends holding B exactly."""
    from rlkit.async_rollout import Generator
    from rlkit.config import AsyncConfig, ModelConfig, System, TrainerConfig, TrainerSystem

    trainer, actor, data, prompts = worker_setup(temperature=2.0)
    a = trainer.trainable_weights()
    with torch.no_grad():
        for p in trainer.engine.model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    b = trainer.trainable_weights()
    system = System(  # the trainer worker's own sections, with the generation worker's device and in-flight swaps
        actor=trainer.engine.update_sys,
        rollout=trainer.rollout_sys,
        trainer=TrainerSystem(device="cpu"),
        async_rollout=AsyncConfig(async_steps=1, swap_every=2),
    )
    gen = Generator(ModelConfig(), actor, trainer.rollout_cfg, data, system, TrainerConfig().seed, need_ref=False)
    gen.updates = Scripted(("shm", *a, 0), None, ("shm", *b, 1), None)
    _, batch = gen.generate(1, prompts, ("await", 0))
    mask, v = batch["response_mask"].bool(), batch["token_version"]
    assert mask[:, 2:].any() and (v[:, :2][mask[:, :2]] == 0).all() and (v[:, 2:][mask[:, 2:]] == 1).all() and (v[~mask] == -1).all()
    assert batch.meta["policy_version"] == 0 and gen.version == 1
    assert torch.equal(gen.worker.trainable_weights()[0], b[0])
    gen.close()


def test_drop_finished_reaches_the_fast_loop():
    """--rollout.drop-finished: the worker's generate passes it on; later decoding steps run on fewer rows, and the
    tokens are the ones the loop that keeps every row samples (same seed)."""
    out = {}
    for drop in (0.0, 1e-9):
        torch.manual_seed(0)
        worker, *_, prompts = worker_setup(temperature=2.0, drop_finished=drop)
        rows = []
        hook = worker.rollout.model.register_forward_pre_hook(
            lambda m, a, kw, rows=rows: rows.append(kw["input_ids"].shape[0]), with_kwargs=True
        )
        torch.manual_seed(1)
        out[drop] = (worker.generate(prompts.repeat(2, interleave=True)), rows)
        hook.remove()
    (full, rows_full), (dropped, rows_dropped) = out[0.0], out[1e-9]
    assert torch.equal(full["responses"], dropped["responses"])
    assert min(rows_full[1:]) == 16 and min(rows_dropped[1:]) < 16  # (the first forward: the 8 shared prompts' prefill)
