"""Rollouts for the recipe's loop: generated here in turn (k = 0), or k steps ahead by a generation worker (k >= 1).

    rollouts = Rollouts(cfg, policy, prompts, run)   # prompts(i) -> the i-th batch of prompt rows (B*n, P)
    batch = rollouts.next()                          # the next generated batch, (B*n, ...)

k = --trainer.async-steps. With k = 0, next() is `policy.generate(prompts(i))`, the synchronous loop exactly.
With k >= 1 a generation worker -- another process with its own copy of the weights (and of the frozen
reference, when a KL term needs it) and its own rollout (hf or vllm, the turn loop of grpo_tools too) --
samples the batches of steps t+1 .. t+k while the trainer updates on step t's::

    trainer  | update t-1 |  update t  | update t+1 |          k = 1: batch t+1 is sampled by pi_{t-1}
    worker   |  gen t     |  gen t+1   |  gen t+2   |          while the trainer turns pi_{t-1} into pi_t

The worker is a spawned process (--trainer.backend local) or a Ray actor on a one-bundle pool of its own
(--trainer.backend ray: the FSDP workers gather the full trainable weights for it). Each call of next()
(1) hands the worker the trainer's current weights when they changed (one flat float32 buffer: shared
memory, or Ray's object store), (2) queues the prompts of the batch k calls ahead, (3) waits for the
oldest queued batch. A job is always generated with the weights sent with it (or the last ones before
it), so a run is reproducible whatever the timing. Every batch comes back with `rollout_log_probs` (mu,
as sampled), `ref_log_prob` (when asked: the frozen reference pass leaves the trainer's critical path)
and meta["policy_version"], the number of updates behind its weights. staleness = updates now -
policy_version = k once the pipeline is full (less for the first k batches, all sampled by the starting
weights; never more than k); logged as async/staleness, _max.

The loss corrects for it with the recipe's decoupled PPO: pi_old = the trainer's log-probs before the
update (pi_prox), w = f(pi_prox / mu) (--actor.rollout-correction), see docs/off-policy.md.

With k >= 1 the trainer's own policy generates only for validation, with HF generate (build_policy gives it
no vLLM engine: the worker owns the one that samples). Not with --trainer.engine megatron (its weights are
not in Hugging Face layout). Checkpoints save the loader's position before the batches
still queued: a resumed run draws the same prompts as an uninterrupted one, sampled afresh by its weights.
"""

from __future__ import annotations

import atexit
import collections
import queue
import time
import traceback

import torch

from rlkit.errors import ConfigError, RunFailed
from rlkit.protocol import DataProto


class Generator:
    """What the generation worker holds: its own model (+ reference), the configured rollout, the turn loop if any."""

    def __init__(self, model_cfg, rollout_cfg, data_cfg, trainer_cfg, need_ref: bool, agent=None):
        from rlkit.engine import TorchEngine, auto_micro_batch, num_params, set_threads
        from rlkit.workers import make_rollout, resolved

        set_threads(trainer_cfg.num_threads)
        model_cfg = resolved(model_cfg)
        torch.manual_seed(trainer_cfg.seed)  # the same fresh LoRA weights as the trainer (then overwritten anyway)
        self.engine = TorchEngine(model_cfg, None, trainer_cfg.device, need_ref=need_ref)
        self.tokenizer = self.engine.tokenizer  # the turn loop reads worker.tokenizer and worker.rollout
        self.rollout = make_rollout(self.engine, rollout_cfg, data_cfg, model_cfg.path, trainer_cfg.seed + 1)
        torch.manual_seed(trainer_cfg.seed + 1)  # the sampling stream of the worker
        self.rollout_cfg, self.max_len, self.need_ref, self.agent = rollout_cfg, data_cfg.max_response_length, need_ref, agent
        self.micro = auto_micro_batch(rollout_cfg.log_prob_micro_batch_size, self.engine.model, 256, 16)
        self.gen_micro = rollout_cfg.micro_batch_size or (None if num_params(self.engine.model)[1] < 10_000_000 else 64)
        self.version = 0

    def generate(self, i: int, prompts: DataProto, weights=None) -> tuple[int, DataProto]:
        """Batch i: load `weights` (flat, layout, version) when given, sample, add the reference log-probs."""
        from rlkit.engine import unpack_weights

        if weights is not None:
            flat, layout, self.version = weights
            unpack_weights(self.engine.model, flat, layout)
            if hasattr(self.rollout, "sync_weights"):  # vllm: into its engine
                self.rollout.sync_weights()
        r = self.rollout_cfg
        if self.agent is not None:  # grpo_tools: the multi-turn turn loop, on this worker's rollout
            batch = self.agent(self, prompts)
        else:
            hf = {"return_log_probs": True} if not hasattr(self.rollout, "sync_weights") else {}  # vllm: always
            batch = self.rollout.generate(prompts, self.max_len, r.temperature, r.top_p, r.top_k, micro_batch_size=self.gen_micro, **hf)
        if self.need_ref:  # log pi_ref(y_t), here, off the trainer's critical path
            batch["ref_log_prob"] = self.engine.compute_log_prob(batch, r.temperature, self.micro, ref=True)[0]
        batch.meta["policy_version"] = self.version
        return i, batch

    def close(self) -> None:
        if hasattr(self.rollout, "close"):
            self.rollout.close()


def _serve(args, jobs, results) -> None:
    """The spawned generation process (--trainer.backend local): build a Generator, then generate every job it is sent."""
    import multiprocessing as mp

    try:
        gen = Generator(*args)
        results.put(("ready", None, None))
    except Exception:
        results.put(("error", None, traceback.format_exc()))
        return
    while True:
        try:
            job = jobs.get(timeout=2.0)
        except queue.Empty:
            if not mp.parent_process().is_alive():  # the trainer died without closing us
                return
            continue
        if job is None:
            gen.close()
            return
        try:
            results.put(("batch", *gen.generate(*job)))
        except Exception:
            results.put(("error", None, traceback.format_exc()))
            return


class Rollouts:
    """Generation batches for the loop; see the module docstring. Close it (loop.Run does) to stop the worker."""

    def __init__(self, cfg, policy, prompts, run=None, need_ref: bool | None = None):
        """prompts(i): the i-th generation batch's prompt rows (i = 1, 2, ...). run: a loop.Run that logs the
        async/ metrics and closes this at the end of the loop, or when it stops on an error. need_ref: whether
        the worker adds ref_log_prob (default: --actor.use-kl-loss)."""
        self.k, self.policy, self.prompts = cfg.trainer.async_steps, policy, prompts
        self.i = 0  # generation batches asked for so far
        self.submitted = 0  # ... and handed to the worker
        self.sent_version = None  # the policy version whose weights the worker last received
        self.stats: list[tuple[int, float]] = []  # (staleness, seconds waited) per batch since the last metrics()
        self.proc = self.actor = None
        self.loader = getattr(run, "loader", None)  # the train PromptLoader prompts(i) draws from
        self.drawn_from: dict[int, dict] = {}  # batch i -> the loader's state before prompts(i) drew it (i not yet taken)
        if run is not None:
            run.rollouts = self
        if self.k < 0:
            raise ConfigError(f"--trainer.async-steps {self.k}: must be >= 0 (0 = synchronous)")
        if self.k == 0:
            return
        t = cfg.trainer
        if t.backend == "ray" and t.engine == "megatron":
            raise ConfigError(f"--trainer.async-steps {self.k} does not run with --trainer.engine megatron yet; use --trainer.engine fsdp")
        need_ref = cfg.actor.use_kl_loss if need_ref is None else need_ref
        args = (cfg.model, cfg.rollout, cfg.data, t, need_ref, getattr(policy, "turn_loop", None))
        if t.backend == "ray":
            self._start_ray(args, t)
        else:
            self._start_process(args)
        atexit.register(self.close)  # a script that never reaches loop.Run's close still stops the worker

    # -- the worker: a spawned process (local backend) or a Ray actor ---------------------------------------------
    def _start_process(self, args) -> None:
        import torch.multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.jobs, self.results = ctx.Queue(), ctx.Queue()
        self.proc = ctx.Process(target=_serve, args=(args, self.jobs, self.results), daemon=True, name="rlkit-rollout")
        self.proc.start()
        self._receive("ready")

    def _start_ray(self, args, t) -> None:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from rlkit.ray_group import ResourcePool, cluster_gpus, gpus_per_worker

        gpus = gpus_per_worker(t.device, cluster_gpus())
        self.pool = ResourcePool(1, t.cpus_per_worker, gpus, name="async_rollout")  # a bundle of its own, beside the trainer's
        self.refs = collections.deque()  # the queued batches, oldest first (a Ray actor runs its calls in order)
        self.actor = (
            ray.remote(Generator)
            .options(
                num_cpus=t.cpus_per_worker,
                num_gpus=gpus,
                max_restarts=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.pool.pg, placement_group_bundle_index=0),
                runtime_env={"env_vars": {"OMP_NUM_THREADS": str(max(int(t.cpus_per_worker), 1))}},
            )
            .remote(*args)
        )
        self._ray_get(self.actor.__ray_ready__.remote())

    def _ray_get(self, ref):
        import ray

        try:
            return ray.get(ref)
        except (ray.exceptions.RayTaskError, ray.exceptions.RayActorError) as e:
            self.close()
            raise RunFailed(f"the generation worker (--trainer.async-steps {self.k}, a Ray actor) failed:\n{e}") from None

    def _receive(self, kind: str):
        """The worker process's next message, which must be `kind`; a crash or an error there raises RunFailed."""
        while True:
            try:
                got, i, payload = self.results.get(timeout=2.0)
                break
            except queue.Empty:
                if not self.proc.is_alive():
                    code = self.proc.exitcode
                    self.close()
                    raise RunFailed(
                        f"the generation worker (--trainer.async-steps {self.k}) died (exit code {code}); a script that calls a "
                        "recipe's main() needs an `if __name__ == '__main__':` guard (the worker is a spawned process)"
                    ) from None
        if got == "error":
            self.close()
            raise RunFailed(f"the generation worker (--trainer.async-steps {self.k}) failed:\n{payload}")
        assert got == kind, (got, kind)
        return i, payload

    def _submit(self) -> None:
        """Queue the next generation batch, with the trainer's weights when they changed since the last job."""
        self.submitted += 1
        if self.loader is not None:
            self.drawn_from[self.submitted] = self.loader.state_dict()
        version = self.policy.weights_version()  # updates applied so far: the version of the trainer's weights
        weights = None
        if version != self.sent_version:
            weights, self.sent_version = (*self.policy.trainable_weights(), version), version
        job = (self.submitted, self.prompts(self.submitted), weights)
        if self.actor is not None:
            self.refs.append(self.actor.generate.remote(*job))
        else:
            self.jobs.put(job)

    def next(self) -> DataProto:
        """The next generation batch: prompts(i) generated now (k = 0), or k batches ago by the worker."""
        self.i += 1
        if self.k == 0:
            return self.policy.generate(self.prompts(self.i))
        while self.submitted < self.i + self.k:  # keep k batches queued beyond this one
            self._submit()
        start = time.perf_counter()
        i, batch = self._ray_get(self.refs.popleft()) if self.actor is not None else self._receive("batch")
        assert i == self.i, (i, self.i)
        self.drawn_from.pop(i, None)
        self.stats.append((self.policy.weights_version() - batch.meta["policy_version"], time.perf_counter() - start))
        return batch

    def loader_state(self) -> dict | None:
        """What a checkpoint saves as the loader's position: the state before the oldest batch queued but not yet taken
        (a resumed run draws those prompts again, sampled by its own weights), or None when none is queued."""
        return self.drawn_from[min(self.drawn_from)] if self.drawn_from else None

    def metrics(self) -> dict:
        """async/ metrics of the batches taken since the last call (loop.Run logs them every step)."""
        if not self.stats:
            return {}
        stale, wait = zip(*self.stats, strict=True)
        self.stats = []
        return {
            "async/staleness": sum(stale) / len(stale),
            "async/staleness_max": max(stale),
            "async/wait_s": sum(wait),
            "async/steps": self.k,
        }

    def close(self) -> None:
        """Stop the worker (idempotent)."""
        atexit.unregister(self.close)  # (which would keep this object, and the policy, alive until exit)
        actor, self.actor = self.actor, None
        if actor is not None:
            import ray

            if ray.is_initialized():  # (at exit, Ray may have shut down first: its actors and pools went with it)
                ray.kill(actor)
                self.pool.remove()
        proc, self.proc = self.proc, None
        if proc is None:
            return
        try:
            self.jobs.put(None)
            proc.join(timeout=10)
        finally:
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=10)
            for q in (self.jobs, self.results):
                q.cancel_join_thread()
                q.close()
