"""Off-policy training in the loop (issue #14): mismatch metrics, the correction flag, asynchronous k-step rollouts.

The math of each correction is tested value by value in test_algos.py; here: that the recipes wire it in
(HF rollouts are an exact control arm; an induced mismatch is seen and corrected as the formula says), that
--trainer.async-steps 0 is the synchronous loop bit for bit, and that k = 1 runs, tags and bounds staleness,
learns, and leaves no process behind.
"""

import math
import multiprocessing as mp

import pytest
import torch
from numerics import assert_within, log_prob_tol, max_abs_logit, tiny_log_prob_tol, tol
from safetensors.torch import load_file
from test_grpo_recipe import load_recipe, read_jsonl, small_config

from rlkit import algos, recipe
from rlkit.config import (
    ActorConfig,
    ActorSystem,
    DataConfig,
    DataSystem,
    ModelConfig,
    RolloutConfig,
    RolloutSystem,
    System,
    TrainerConfig,
    TrainerSystem,
)
from rlkit.errors import ConfigError
from rlkit.placement import build_policy, build_reward
from rlkit.protocol import DataProto
from rlkit.workers import ActorRolloutRefWorker


def quick_config(recipe, out_dir, steps=3, **trainer):
    cfg = small_config(recipe, out_dir, steps=steps, **{"save_freq": 0, "test_freq": 0, "val_before_train": False, **trainer})
    cfg.system.data.val_max_samples = 16
    return cfg


def comparable(rows):
    return [{k: v for k, v in r.items() if not k.startswith(("timing/", "perf/"))} for r in rows]


# -- 1. mismatch metrics -------------------------------------------------------------------------


@pytest.mark.numerics
def test_hf_rollout_log_probs_equal_the_trainers_in_fp32():
    """The exact control arm: HF generation's own log-probs are the trainer's (same model code, fp32)."""
    system = System(rollout=RolloutSystem(log_probs=True))
    worker = ActorRolloutRefWorker(ModelConfig(), ActorConfig(), RolloutConfig(n=4), DataConfig(), device="cpu", system=system)
    from rlkit.data import build_prompts

    prompts = build_prompts(DataConfig().train_files, worker.tokenizer, DataConfig(), DataSystem())
    batch = worker.generate(prompts.batch(list(range(16)), worker.tokenizer.pad_token_id).repeat(4, interleave=True))
    trainer = worker.compute_log_prob(batch)["old_log_probs"]
    m = algos.rollout_mismatch_metrics(trainer, batch["rollout_log_probs"], batch["response_mask"])
    assert batch["response_mask"].sum() > 100
    # incremental (KV-cache) vs teacher-forced forward: rounding only, |d| <= b (numerics.log_prob_tol); then
    # k3 = E[e^d - 1 - d] <= b^2 (e^b <= 1 + b + b^2 for b < 1) and |ppl_ratio - 1| = |e^{mean d} - 1| <= 2b
    b = log_prob_tol(worker.engine.model.config, max_abs_logit(worker.engine.model, batch))
    assert_within(m["rollout_corr/abs_diff_max"], 0.0, b, "log-prob, HF generation vs trainer")
    assert_within(m["rollout_corr/k3_kl"], 0.0, b**2 + tol(torch.float32, 3.0, 3), "k3 KL, HF generation vs trainer")  # + exp's rounding
    assert_within(m["rollout_corr/ppl_ratio"], 1.0, 2 * b, "perplexity ratio, HF generation vs trainer")
    assert m["rollout_corr/ratio_fraction_high"] == 0


@pytest.mark.parametrize("name", ["grpo", "dapo", "rloo", "ppo", "reinforce_pp", "cispo"])
def test_actor_loss_weights_each_token_by_the_correction(name):
    """An induced mismatch mu = pi_old - delta: the recipe's loss logs it and scales each token's gradient by the
    correction's weight, by hand: on-policy (rho = 1) the token-mean loss is -sum_t w_t A_t / N (CISPO's gradient too:
    -sg(1) A_t grad log pi_t), so
    d loss / d log pi_t = -w_t A_t / N with w_t = min(e^delta_t, 2) for token-tis, and e^delta_t * 1[0.5 <= e^delta_t <= 2]
    for token-mis."""
    recipe = load_recipe(name)
    delta = torch.tensor([[0.1, 1.0, -0.2, 0.0], [0.0, -1.0, 0.3, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    adv = torch.tensor([[1.0, 1.0, 1.0, 0.0], [-2.0, -2.0, -2.0, -2.0]])
    old = torch.log(torch.tensor([[0.5, 0.2, 0.9, 1.0], [0.3, 0.6, 0.7, 0.4]]))
    for mode, w in (
        ("token-tis", torch.clamp(delta.exp(), max=2.0)),
        ("token-mis", torch.where((delta.exp() >= 0.5) & (delta.exp() <= 2.0), delta.exp(), torch.zeros(()))),
        ("none", torch.ones_like(delta)),
    ):
        cfg = recipe.Config()
        cfg.system.actor.rollout_correction, cfg.actor.use_kl_loss, cfg.actor.entropy_coeff = mode, False, 0.0
        loss_fn = recipe.make_actor_loss(cfg)
        log_prob = old.clone().requires_grad_(True)
        mb = DataProto.from_dict({"response_mask": mask, "advantages": adv, "old_log_probs": old, "rollout_log_probs": old - delta})
        if name == "ppo":
            mb["values"] = mb["returns"] = torch.zeros_like(old)
        out = loss_fn(mb, log_prob, None, algos.Norm(num_tokens=7, num_seqs=2))
        loss, metrics = out[0], out[-1]
        loss.backward()
        assert torch.allclose(log_prob.grad, -w * adv * mask / 7, atol=1e-7), (mode, log_prob.grad)
        assert metrics["rollout_corr/abs_diff_max"] == pytest.approx(1.0)
        assert metrics["rollout_corr/abs_diff_mean"] == pytest.approx((0.1 + 1 + 0.2 + 0 + 1 + 0.3 + 0) / 7)
        assert metrics["rollout_corr/ratio_fraction_high"] == pytest.approx(1 / 7)  # e^1 > 2
        if mode != "none":
            assert metrics["rollout_corr/is_max"] == pytest.approx(w[mask.bool()].max().item())


def test_actor_loss_without_rollout_log_probs_is_unchanged():
    grpo = load_recipe("grpo")
    mask, adv, old = torch.ones(2, 3), torch.tensor([[1.0] * 3, [-1.0] * 3]), torch.log(torch.full((2, 3), 0.5))
    mb = DataProto.from_dict({"response_mask": mask, "advantages": adv, "old_log_probs": old})
    cfg = grpo.Config()
    cfg.actor.use_kl_loss = False
    _, _, metrics = grpo.make_actor_loss(cfg)(mb, old.clone().requires_grad_(True), None, algos.Norm(6, 2))
    assert not any(k.startswith("rollout_corr/") for k in metrics)


def test_a_batch_with_reference_log_probs_gets_its_own_back_without_a_pass(monkeypatch):
    """The async generation worker computes ref_log_prob; the recipe's reference pass (no async clause) returns them
    as they are, without a forward pass; a batch without them gets the reference's."""
    worker = ActorRolloutRefWorker(ModelConfig(), ActorConfig(), RolloutConfig(n=2), DataConfig(), device="cpu")
    from rlkit.data import build_prompts

    prompts = build_prompts(DataConfig().train_files, worker.tokenizer, DataConfig(), DataSystem())
    batch = worker.generate(prompts.batch(list(range(4)), worker.tokenizer.pad_token_id).repeat(2, interleave=True))
    computed = worker.compute_ref_log_prob(batch)["ref_log_prob"]  # a pass of the frozen reference
    assert (computed * batch["response_mask"]).abs().sum() > 0
    batch["ref_log_prob"] = torch.full_like(computed, -1.5)  # as the generation worker would send them
    monkeypatch.setattr(worker.engine, "compute_log_prob", lambda *a, **k: pytest.fail("a reference pass was run"))
    assert torch.equal(worker.compute_ref_log_prob(batch)["ref_log_prob"], batch["ref_log_prob"])
    assert torch.equal(batch.union(worker.compute_ref_log_prob(batch))["ref_log_prob"], batch["ref_log_prob"])


def test_flag_thresholds_resolve_per_mode():
    a = ActorSystem()
    assert a.rollout_correction == "token-tis" and a.rollout_is_threshold == 2.0
    a.rollout_is_cap = 3.0
    assert a.rollout_is_threshold == 3.0
    a.rollout_correction = "seq-mis"
    assert a.rollout_is_threshold == (0.5, 3.0)
    a.rollout_correction, a.rollout_is_cap, a.rollout_is_low = "geo-mask", None, 0.99
    assert a.rollout_is_threshold == (0.99, 1.001)


def test_grpo_with_hf_rollout_log_probs_logs_zero_mismatch_and_trains_the_same_weights(tmp_path):
    """--rollout.log-probs with HF: rollout_corr/ metrics every step, ~0; token-tis weights are 1, so the weights
    trained are those of the run without rollout log-probs."""
    grpo = load_recipe("grpo")
    base = quick_config(grpo, tmp_path / "base", steps=2)
    grpo.main(base)
    cfg = quick_config(grpo, tmp_path / "lp", steps=2)
    cfg.system.rollout.log_probs = True
    grpo.main(cfg)
    rows = read_jsonl(tmp_path / "lp/metrics.jsonl")
    for r in rows[1:]:  # rounding only (numerics.py): |Delta| <= b, so the weight e^Delta is within 2b of 1
        assert r["rollout_corr/abs_diff_max"] <= tiny_log_prob_tol()
        assert r["rollout_corr/is_min"] == pytest.approx(1.0, abs=2 * tiny_log_prob_tol())
    a = load_file(tmp_path / "base/checkpoints/global_step_2/hf/model.safetensors")
    b = load_file(tmp_path / "lp/checkpoints/global_step_2/hf/model.safetensors")
    diff = max((a[k] - b[k]).abs().max().item() for k in a)
    assert diff < 1e-5, diff  # (lr 1e-4: Adam moves a weight by ~1e-4 a step; w = 1 +- 1e-7 leaves < 1e-5 of it)


# -- 3. asynchronous k-step training -----------------------------------------------------------------------


def synchronous_grpo(grpo, cfg):
    """The GRPO loop as it was before --trainer.async-steps (generation in turn, policy.generate): the reference."""
    recipe.setup(cfg)
    policy = build_policy(cfg)
    tok = policy.tokenizer
    from rlkit.data import PromptLoader, build_prompts

    train = PromptLoader(
        build_prompts(cfg.data.train_files, tok, cfg.data, cfg.system.data),
        cfg.data.train_batch_size,
        tok.pad_token_id,
        cfg.data.shuffle,
        cfg.trainer.seed,
    )
    val = build_prompts(cfg.system.data.val_files, tok, cfg.data, cfg.system.data, cfg.system.data.val_max_samples)
    reward_fn = build_reward(cfg, policy)
    run = recipe.Run(cfg, policy, train, val, reward_fn)
    actor_loss = grpo.make_actor_loss(cfg)
    for step in run.steps():
        timings = {}
        batch = train.next_batch()
        batch["uid"] = [f"{step}-{i}" for i in range(len(batch))]
        batch = policy.generate(batch.repeat(cfg.rollout.n, interleave=True))
        scores, reward_metrics = recipe.score(batch, tok, reward_fn)
        reward_metrics |= train.record(batch, scores)
        batch = batch.union(policy.compute_ref_log_prob(batch))
        if not policy.update_is_one_step():
            batch = batch.union(policy.compute_log_prob(batch))
        batch["advantages"] = algos.grpo_advantage(scores, batch["uid"])[:, None] * batch["response_mask"]
        actor_metrics = policy.update(batch, actor_loss)
        metrics = {**recipe.batch_metrics(batch, scores, cfg.data.max_response_length), **reward_metrics, **actor_metrics}
        run.end_of_step(step, metrics, timings, batch)
    return run.finish()


def test_async_steps_0_is_the_synchronous_loop_bit_for_bit(tmp_path):
    grpo = load_recipe("grpo")
    grpo.main(quick_config(grpo, tmp_path / "k0", steps=3, async_steps=0))
    synchronous_grpo(grpo, quick_config(grpo, tmp_path / "sync", steps=3))
    a, b = read_jsonl(tmp_path / "k0/metrics.jsonl"), read_jsonl(tmp_path / "sync/metrics.jsonl")
    assert [r["step"] for r in a] == [1, 2, 3] and comparable(a) == comparable(b)  # every float equal
    wa = load_file(tmp_path / "k0/checkpoints/global_step_3/hf/model.safetensors")
    wb = load_file(tmp_path / "sync/checkpoints/global_step_3/hf/model.safetensors")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


# One run per distinct path through the loop: rloo, gspo, cispo and gmpo differ from grpo.py only in their algorithm
# lines (tests/test_recipe_drift.py holds the rest identical), so their async run would repeat grpo's (~10 s each).
# dapo: several generation batches per step; ppo: a critic + KL in the reward; reinforce_pp: the KL in the
# reward; grpo_tools: the turn loop in the worker; remax: a greedy baseline generation beside the samples.
ASYNC_RECIPES = ["grpo", "dapo", "ppo", "reinforce_pp", "grpo_tools", "remax"]


@pytest.mark.parametrize("name", ASYNC_RECIPES)
def test_one_step_off_runs_tags_versions_and_leaves_no_process(tmp_path, name):
    recipe = load_recipe(name)
    cfg = quick_config(recipe, tmp_path, steps=3, async_steps=1)
    if name in ("ppo", "reinforce_pp"):  # the worker computes the reference for the KL in the reward as well
        cfg.use_kl_in_reward = True
    recipe.main(cfg)
    rows = read_jsonl(tmp_path / "metrics.jsonl")  # steps 1, 2, 3
    # step 1 trains on the starting weights' batch (staleness 0); every later one on the batch of the step before's
    # weights: pi_{t-2} sampled it while the trainer made pi_{t-1}
    assert [r["async/staleness_max"] for r in rows][:1] == [0] and all(r["async/staleness_max"] <= 1 for r in rows)
    if name != "dapo":  # one generation batch per step: exactly one step stale
        assert [r["async/staleness"] for r in rows] == [0, 1, 1]
    # same weights, HF in fp32: no mismatch (the turn loop samples each turn apart, the trainer scores the whole row)
    assert rows[0]["rollout_corr/abs_diff_max"] < (1e-4 if name == "grpo_tools" else 1e-5)
    assert rows[-1]["rollout_corr/abs_diff_mean"] > 1e-3  # one update of staleness: the correction sees it
    if name == "ppo":  # the KL in the reward: pi_prox (two updates in) against the worker's reference log-probs
        assert rows[-1]["actor/reward_kl_penalty"] > 1e-4 and abs(rows[0]["actor/reward_kl_penalty"]) < 1e-6
    if name == "grpo_tools":
        assert "agent/turns/mean" in rows[-1]  # the worker ran the turn loop
    assert mp.active_children() == []


def test_the_generation_worker_is_the_trainers_rollout_worker_loaded_with_its_weights():
    """The async Generator is an ActorRolloutRefWorker (generation only: no optimizer, its micro-batch rules): after
    load_weights of the trainer's (changed) weights it samples with mu = the trainer's log-probs, and its reference pass
    is the trainer's (HF, fp32: the same model code, so equal up to float rounding across batch shapes)."""
    from rlkit.async_rollout import Generator
    from rlkit.data import build_prompts

    actor, rollout, data = ActorConfig(), RolloutConfig(n=2), DataConfig()
    system = System(
        actor=ActorSystem(ppo_micro_batch_size=4), rollout=RolloutSystem(micro_batch_size=3), trainer=TrainerSystem(device="cpu")
    )
    trainer = ActorRolloutRefWorker(ModelConfig(), actor, rollout, data, device="cpu", need_ref=True, system=system)
    with torch.no_grad():
        for p in trainer.engine.model.parameters():
            p.add_(0.01 * torch.randn_like(p))  # weights the generation worker cannot start with
    gen = Generator(ModelConfig(), actor, rollout, data, system, TrainerConfig().seed, need_ref=True)
    assert isinstance(gen.worker, ActorRolloutRefWorker) and gen.worker.engine.optimizer is None
    assert (gen.worker.log_prob_micro_batch, gen.worker.gen_micro_batch) == (4, 3)  # the trainer's rules, not copies
    prompts = build_prompts(data.train_files, trainer.tokenizer, data, system.data).batch(list(range(8)), trainer.tokenizer.pad_token_id)
    i, batch = gen.generate(5, prompts, (*trainer.trainable_weights(), 3))
    assert i == 5 and batch.meta["policy_version"] == 3
    mask = batch["response_mask"].bool()
    mu, pi = batch["rollout_log_probs"][mask], trainer.compute_log_prob(batch)["old_log_probs"][mask]
    assert mask.sum() > 20 and (mu - pi).abs().max() < 1e-5  # fp32 rounding; unloaded, the worker is > 1 nat off
    assert torch.allclose(batch["ref_log_prob"], trainer.compute_ref_log_prob(batch)["ref_log_prob"], atol=1e-5)
    gen.close()


def module_bytes(obj) -> int:
    """Bytes of the parameters of every torch module an object holds as an attribute (an engine: its model, its reference)."""
    mods = [v for v in vars(obj).values() if isinstance(v, torch.nn.Module)]
    return sum(p.numel() * p.element_size() for m in mods for p in m.parameters())


def test_the_generation_worker_keeps_no_reference_it_does_not_use():
    """need_ref False (no KL loss, no KL in the reward): the generation worker holds its model and no frozen reference
    copy; need_ref True (full fine-tuning) holds exactly one more copy, in the compute dtype (float32 on CPU)."""
    from rlkit.async_rollout import Generator

    system = System(trainer=TrainerSystem(device="cpu"))
    args = (ModelConfig(), ActorConfig(use_kl_loss=False), RolloutConfig(), DataConfig(), system, TrainerConfig().seed)
    alone = Generator(*args, need_ref=False)
    model = sum(p.numel() * p.element_size() for p in alone.worker.engine.model.parameters())
    assert alone.worker.engine.ref_model is None and module_bytes(alone.worker.engine) == model
    with_ref = Generator(*args, need_ref=True)
    assert module_bytes(with_ref.worker.engine) == 2 * model
    alone.close()
    with_ref.close()


def test_an_async_trainer_keeps_no_reference_copy_the_worker_computes_it(tmp_path):
    """--trainer.async-steps 1 with --actor.use-kl-loss (full fine-tuning): every batch comes with the worker's ref_log_prob,
    so the trainer holds no frozen copy (one model's bytes, not two); synchronous, it keeps it."""
    grpo = load_recipe("grpo")
    sync, off = quick_config(grpo, tmp_path / "s"), quick_config(grpo, tmp_path / "a", async_steps=1)
    assert sync.actor.use_kl_loss and off.actor.use_kl_loss and sync.model.lora_rank == 0
    engines = [build_policy(cfg).worker.engine for cfg in (sync, off)]
    model = sum(p.numel() * p.element_size() for p in engines[0].model.parameters())
    assert [module_bytes(e) for e in engines] == [2 * model, model] and engines[1].ref_model is None


def test_the_generation_worker_keeps_the_trainers_token_budget():
    """--actor.max-token-len-per-micro-batch: the generation worker's log-prob passes (its reference pass) split a batch
    into the trainer's token-budget micro-batches, not into --rollout.log-prob-micro-batch-size rows."""
    from rlkit.async_rollout import Generator
    from rlkit.data import build_prompts

    actor, rollout, data = ActorConfig(), RolloutConfig(n=2), DataConfig()
    system = System(actor=ActorSystem(ppo_micro_batch_size=8, max_token_len_per_micro_batch=160), trainer=TrainerSystem(device="cpu"))
    trainer = ActorRolloutRefWorker(ModelConfig(), actor, rollout, data, device="cpu", need_ref=True, system=system)
    gen = Generator(ModelConfig(), actor, rollout, data, system, TrainerConfig().seed, need_ref=True)
    prompts = build_prompts(data.train_files, trainer.tokenizer, data, system.data).batch(list(range(8)), trainer.tokenizer.pad_token_id)
    passes, forward = [], gen.worker.engine.forward
    gen.worker.engine.forward = lambda model, mb, *a: passes.append(len(mb)) or forward(model, mb, *a)
    _, batch = gen.generate(1, prompts)
    want = [len(mb) for mb in trainer.engine.micro_batches(batch, trainer.log_prob_micro_batch)]
    assert passes == want and len(want) > 1 and want != [8]  # by tokens: not one pass of ppo_micro_batch_size 8 rows
    gen.close()


class ScriptedJobs:
    """A job queue for _serve whose jobs come (arrive=True: already waiting when asked) or not yet (arrive=False)."""

    def __init__(self, script):
        self.script = list(script)  # [(job, arrived)]

    def get(self, timeout=None):
        job, _ = self.script.pop(0)
        return job

    def empty(self) -> bool:
        return not self.script or not self.script[0][1]


def test_the_generation_worker_sleeps_between_jobs_only_when_none_waits(monkeypatch):
    """_serve: after a batch, with no job queued, the worker idles (Generator.idle: vLLM sleeps, CUDA cache freed) until
    the next job wakes it; with the next job already queued it goes straight on (a sleep would only cost a wake)."""
    import queue

    from rlkit import async_rollout

    events = []

    class FakeGenerator:
        def __init__(self, *args):
            pass

        def generate(self, i, prompts, weights=None):
            events.append(f"gen {i}")
            return i, None

        def idle(self):
            events.append("idle")

        def close(self):
            events.append("close")

    monkeypatch.setattr(async_rollout, "Generator", FakeGenerator)
    jobs = ScriptedJobs([((1, None, None), True), ((2, None, None), True), ((3, None, None), False), (None, True)])
    results = queue.Queue()
    async_rollout._serve((), jobs, results)
    assert events == ["gen 1", "gen 2", "idle", "gen 3", "close"]  # job 2 was waiting after job 1; job 3 came later
    assert [results.get()[0] for _ in range(4)] == ["ready", "batch", "batch", "batch"]


def test_an_idle_generation_worker_puts_its_vllm_engine_to_sleep_and_a_job_wakes_it():
    """Generator.idle calls the rollout's sleep (VLLMRollout: level 1 on CUDA, a no-op on CPU); the next job wakes what it
    needs (load_weights' sync: the weights; generate: the KV cache). Recorded on a stand-in rollout with vLLM's interface."""
    from rlkit.async_rollout import Generator
    from rlkit.data import build_prompts

    data = DataConfig()
    system = System(trainer=TrainerSystem(device="cpu"))
    gen = Generator(ModelConfig(), ActorConfig(), RolloutConfig(n=1), data, system, TrainerConfig().seed, need_ref=False)
    hf, calls = gen.worker.rollout, []

    class Recording:  # the calls VLLMRollout gets from the worker, sampling with the HF rollout
        tokenizer, eos = hf.tokenizer, hf.eos

        def sleep(self):
            calls.append("sleep")

        def sync_weights(self):
            calls.append("wake weights")

        def generate(self, prompts, *a, **k):
            calls.append("wake kv_cache")
            return hf.generate(prompts, *a, **k)

    gen.worker.rollout = Recording()
    prompts = build_prompts(data.train_files, hf.tokenizer, data, system.data).batch(list(range(2)), hf.tokenizer.pad_token_id)
    gen.idle()
    gen.generate(1, prompts, (*gen.worker.trainable_weights(), 1))
    assert calls == ["sleep", "wake weights", "wake kv_cache"]


def test_split_groups_gives_each_worker_whole_groups_in_order():
    from rlkit.async_rollout import split_groups

    assert split_groups(16, 4, 2) == [list(range(8)), list(range(8, 16))]
    assert split_groups(12, 4, 2) == [list(range(8)), list(range(8, 12))]  # 3 groups: the first share one larger
    assert split_groups(8, 4, 3) == [list(range(4)), list(range(4, 8)), []]  # fewer groups than workers
    assert split_groups(6, 2, 1) == [list(range(6))]


def test_two_generation_workers_share_each_batch(tmp_path, monkeypatch):
    """--trainer.async-workers 2: two processes, each sampling half of every batch's groups; the trainer gets the whole
    batch in row order (the groups intact), the same staleness, and both processes are gone at the end."""
    grpo = load_recipe("grpo")
    seen, real = [], recipe.score

    def watching(batch, tok, reward_fn):
        if "uid" in batch:  # a training batch (validation is scored here too)
            seen.append((len(mp.active_children()), len(batch), batch["uid"][::4].tolist()))
        return real(batch, tok, reward_fn)

    monkeypatch.setattr(recipe, "score", watching)
    grpo.main(quick_config(grpo, tmp_path, steps=3, async_steps=1, async_workers=2))
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["async/staleness"] for r in rows] == [0, 1, 1]
    assert rows[0]["rollout_corr/abs_diff_max"] <= tiny_log_prob_tol()  # step 0 on-policy: rounding only (numerics.py)
    assert rows[-1]["rollout_corr/abs_diff_mean"] > 1e-3
    assert [(n >= 2, b) for n, b, _ in seen] == [(True, 32)] * 3  # both workers alive; 8 prompts x 4 samples each step
    assert [uids for _, _, uids in seen] == [[f"{i}-{j}" for j in range(8)] for i in (1, 2, 3)]  # one group per 4 rows, in order
    assert mp.active_children() == []


def test_one_step_off_on_ray_samples_as_the_local_worker_does(tmp_path):
    """--trainer.backend ray: the generation worker is a Ray actor on a bundle of its own, fed the FSDP workers' gathered
    weights. Batches 1 and 2 (both sampled by the starting weights, same seed) equal the local backend's token for token;
    batch 3, sampled by pi_1, sees the update (staleness 1); the actor and its pool are gone at the end."""
    ray = pytest.importorskip("ray")
    from rlkit.ray_group import init_ray

    grpo = load_recipe("grpo")
    grpo.main(quick_config(grpo, tmp_path / "local", steps=3, async_steps=1))
    init_ray(num_cpus=2)
    try:
        grpo.main(quick_config(grpo, tmp_path / "ray", steps=3, async_steps=1, backend="ray", n_workers=1))
        assert all(pg["state"] == "REMOVED" for pg in ray.util.placement_group_table().values())
    finally:
        ray.shutdown()
    local, on_ray = read_jsonl(tmp_path / "local/metrics.jsonl"), read_jsonl(tmp_path / "ray/metrics.jsonl")
    assert [r["async/staleness"] for r in on_ray] == [0, 1, 1]
    for a, b in zip(local[:2], on_ray[:2], strict=True):
        assert a["critic/score/mean"] == b["critic/score/mean"] and a["response_length/mean"] == b["response_length/mean"]
        assert a["rollout_corr/abs_diff_mean"] == pytest.approx(b["rollout_corr/abs_diff_mean"], abs=1e-6)
    assert on_ray[0]["rollout_corr/abs_diff_max"] <= tiny_log_prob_tol()  # step 0 on-policy: rounding only (numerics.py)
    assert on_ray[-1]["rollout_corr/abs_diff_mean"] > 1e-3
    assert on_ray[0]["actor/grad_norm"] == pytest.approx(local[0]["actor/grad_norm"], rel=1e-4)  # the same first update


def test_one_step_off_stops_its_worker_when_the_loop_fails(tmp_path, monkeypatch):
    grpo = load_recipe("grpo")
    calls = []

    def failing_score(batch, tok, reward_fn):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("scorer broke")
        return real(batch, tok, reward_fn)

    real = recipe.score
    monkeypatch.setattr(recipe, "score", failing_score)
    with pytest.raises(RuntimeError, match="scorer broke"):
        grpo.main(quick_config(grpo, tmp_path, steps=3, async_steps=1))
    assert mp.active_children() == []


def test_a_resumed_one_step_off_run_draws_the_prompts_an_uninterrupted_run_draws(tmp_path, capsys):
    """A checkpoint of an async run saves the loader's position before the batch still queued (drawn, not trained on):
    the synchronous loop's position at the same step. A run resumed from step 2 goes on from there and ends where an
    uninterrupted run ends, no prompt skipped."""
    from rlkit import checkpoint

    grpo = load_recipe("grpo")

    def loader_at(run_dir, step):
        return checkpoint.load(run_dir / f"checkpoints/global_step_{step}")[0]["loader"]

    grpo.main(quick_config(grpo, tmp_path / "full", steps=3, save_freq=1, max_ckpt_to_keep=0, async_steps=1))
    part = tmp_path / "part"
    grpo.main(quick_config(grpo, part, steps=2, save_freq=1, max_ckpt_to_keep=0, async_steps=1))
    capsys.readouterr()
    grpo.main(quick_config(grpo, part, steps=3, save_freq=1, max_ckpt_to_keep=0, async_steps=1, resume="auto"))
    # the documented limit (#34), said at start: a resumed async run does not repeat the uninterrupted run's samples
    assert "resumed at step 2 (async: the prompts an uninterrupted run draws, sampled afresh" in capsys.readouterr().out
    # after step s the synchronous loop has drawn s batches (the async one s + 1: batch s + 1 is queued)
    assert [loader_at(tmp_path / "full", s) for s in (1, 2, 3)] == [{"epoch": 0, "position": s} for s in (1, 2, 3)]
    assert loader_at(part, 2) == loader_at(tmp_path / "full", 2) and loader_at(part, 3) == loader_at(tmp_path / "full", 3)
    rows = read_jsonl(part / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[-1]["async/staleness"] == 0  # resumed: its first batch is fresh


def test_async_steps_refused_by_a_loop_without_rollouts(tmp_path):
    """A recipe (a user's fork) whose loop generates in turn, without recipe.Rollouts, cannot honour the flag: it says so."""
    grpo = load_recipe("grpo")
    with pytest.raises(ConfigError, match="async-steps 1: this recipe has no asynchronous loop"):
        synchronous_grpo(grpo, quick_config(grpo, tmp_path, steps=1, async_steps=1))


def test_one_step_off_learns(tmp_path):
    """k = 1 on the embedded task: 60 steps of the default GRPO settings lift held-out accuracy."""
    grpo = load_recipe("grpo")
    cfg = grpo.Config()
    cfg.system.trainer.default_local_dir = str(tmp_path)
    cfg.trainer.total_training_steps, cfg.system.trainer.test_freq, cfg.system.async_rollout.async_steps = 60, 0, 1
    cfg.system.data.val_max_samples = 128
    summary = grpo.main(cfg)
    assert summary["val_acc_after"] - summary["val_acc_before"] >= 0.10, summary
    rows = read_jsonl(tmp_path / "metrics.jsonl")[1:]
    assert max(r["async/staleness_max"] for r in rows) == 1 and not math.isnan(rows[-1]["actor/pg_loss"])


def test_the_off_policy_lines_are_the_same_in_every_recipe():
    """The correction (every recipe's loss: one line, a no-op without rollout log-probs, its weights passed on and its
    metrics logged) and the Rollouts line (every loop) are the same everywhere."""
    from test_grpo_recipe import ROOT

    rl = sorted(p.stem for p in (ROOT / "recipes").glob("*.py") if p.stem not in ("sft", "rm"))  # every recipe with a policy loss
    assert len(rl) == 11 and set(ASYNC_RECIPES) < set(rl)
    for name in rl:
        code = [line.split("#")[0].strip() for line in (ROOT / "recipes" / f"{name}.py").read_text().splitlines()]
        assert "weights, mask, corr = algos.rollout_weights(mb, off)" in code, name
        assert "weights=weights," in code and "metrics.update(corr)" in code, name
        assert any(line.startswith("rollouts = recipe.Rollouts(cfg, policy, train") for line in code), name


def test_rollout_weights_is_a_no_op_without_rollout_log_probs_and_the_correction_with_them():
    mask, old = torch.tensor([[1, 1, 0]]), torch.log(torch.tensor([[0.5, 0.25, 1.0]]))
    a = ActorSystem()  # token-tis, cap 2
    assert algos.rollout_weights(DataProto.from_dict({"response_mask": mask, "old_log_probs": old}), a) == (None, mask, {})
    mu = old - torch.tensor([[1.0, -0.5, 0.0]])  # pi_old / mu = e, e^-0.5 on the two response tokens
    mb = DataProto.from_dict({"response_mask": mask, "old_log_probs": old, "rollout_log_probs": mu})
    weights, got_mask, metrics = algos.rollout_weights(mb, a)
    assert torch.allclose(weights[0, :2], torch.tensor([2.0, math.exp(-0.5)])) and got_mask is mask  # min(e, 2) = 2
    assert metrics["rollout_corr/abs_diff_max"] == pytest.approx(1.0)


def test_the_async_generation_worker_sizes_hf_generation_from_a_quarter_of_free_memory(monkeypatch):
    """N15 (issue #36): on one GPU the trainer and the async generation worker both sized HF generation from half of the
    memory free at that moment, so the worker could take what the trainer's next update needs. The worker now takes a
    quarter: at the same free memory it generates half the rows per call the trainer's own worker would (CUDA emulated:
    generation_rows reads only the device type and the free memory)."""
    from rlkit import workers
    from rlkit.async_rollout import Generator
    from rlkit.data import build_prompts
    from rlkit.workers import ActorRolloutRefWorker

    data = DataConfig(max_prompt_length=64, max_response_length=64)
    system = System(trainer=TrainerSystem(device="cpu"))
    gen = Generator(ModelConfig(), ActorConfig(), RolloutConfig(n=1), data, system, TrainerConfig().seed, need_ref=False)
    trainer = ActorRolloutRefWorker(ModelConfig(), ActorConfig(), RolloutConfig(n=1), data, device="cpu")
    monkeypatch.setattr(workers, "free_device_memory", lambda device: 2**30)
    prompts = build_prompts(data.train_files, trainer.tokenizer, data, system.data, max_samples=4).batch(
        list(range(4)), trainer.tokenizer.pad_token_id
    )
    rows = {}
    for name, w in (("worker", gen.worker), ("trainer", trainer)):
        w.engine.device = torch.device("cuda")  # the sizing path only
        rows[name] = w.generation_rows(prompts)
    assert rows["trainer"] > 100 and abs(rows["worker"] - rows["trainer"] / 2) <= 1, rows
