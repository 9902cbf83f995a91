"""Rollouts for the recipe's loop: generated here in turn (k = 0), or k steps ahead by a generation worker (k >= 1).

    rollouts = Rollouts(cfg, policy, prompts, run)   # prompts(i) -> the i-th batch of prompt rows (B*n, P)
    batch = rollouts.next()                          # the next generated batch, (B*n, ...)

k = --trainer.async-steps. With k = 0, next() is `policy.generate(prompts(i))`, the synchronous loop exactly.
With k >= 1 a generation worker -- another process with its own copy of the weights (and of the frozen
reference, when a KL term needs it) and its own rollout (hf or vllm, the turn loop of grpo_tools too) --
samples the batches of steps t+1 .. t+k while the trainer updates on step t's::

    trainer  | update t-1 |  update t  | update t+1 |          k = 1: batch t+1 is sampled by pi_{t-1}
    worker   |  gen t     |  gen t+1   |  gen t+2   |          while the trainer turns pi_{t-1} into pi_t

The worker is a spawned process (--trainer.backend local) or a Ray actor on a pool of its own
(--trainer.backend ray: the FSDP workers gather the full trainable weights for it); --trainer.async-workers N
starts N of them, each sampling an equal share of every batch's prompt groups (split_groups). Each call of next()
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

    def __init__(self, model_cfg, actor_cfg, rollout_cfg, data_cfg, trainer_cfg, need_ref: bool, agent=None, rank: int = 0):
        from rlkit.engine import TorchEngine, auto_micro_batch, set_threads
        from rlkit.workers import make_rollout, resolved

        set_threads(trainer_cfg.num_threads)
        model_cfg = resolved(model_cfg)
        torch.manual_seed(trainer_cfg.seed)  # the same fresh LoRA weights as the trainer (then overwritten anyway)
        self.engine = TorchEngine(model_cfg, None, trainer_cfg.device, need_ref=need_ref)
        self.tokenizer = self.engine.tokenizer  # the turn loop reads worker.tokenizer and worker.rollout
        seed = trainer_cfg.seed + 1 + 1000 * rank  # the sampling stream of worker `rank`
        self.rollout = make_rollout(self.engine, rollout_cfg, data_cfg, model_cfg.path, seed)
        torch.manual_seed(seed)
        self.rollout_cfg, self.max_len, self.need_ref, self.agent = rollout_cfg, data_cfg.max_response_length, need_ref, agent
        # the reference pass in the trainer's micro-batches (ActorRolloutRefWorker's rule: the update's, unless set)
        self.micro = rollout_cfg.log_prob_micro_batch_size or auto_micro_batch(actor_cfg.ppo_micro_batch_size, self.engine.model, 256, 8)
        self.gen_micro = auto_micro_batch(rollout_cfg.micro_batch_size, self.engine.model, None, 64)  # as the trainer's worker
        self.version = 0

    def generate(self, i: int, prompts: DataProto, weights=None) -> tuple[int, DataProto]:
        """Batch i: load `weights` (flat, layout, version) when given, sample, add the reference log-probs."""
        from rlkit.engine import unpack_weights
        from rlkit.rollout import HFRollout

        if weights is not None:
            flat, layout, self.version = weights
            unpack_weights(self.engine.model, flat, layout)
            if hasattr(self.rollout, "sync_weights"):  # vllm: into its engine
                self.rollout.sync_weights()
        r = self.rollout_cfg
        if self.agent is not None:  # grpo_tools: the multi-turn turn loop, on this worker's rollout
            batch = self.agent(self, prompts)
        else:
            hf = {"return_log_probs": True} if isinstance(self.rollout, HFRollout) else {}  # vllm: always
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


STOPPED_LIMIT_S = 60.0  # a worker seen stopped (SIGSTOP) this long fails the run, whatever --trainer.async-timeout-s says


def _is_stopped(pid: int) -> bool:
    """Whether process `pid` is stopped (state T, by SIGSTOP/SIGTSTP; t, by a tracer), from /proc/PID/stat (Linux; else False)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


def _died(w: int, pid: int, code: int | None, kind: str, k: int) -> str:
    """One line on how generation worker w ended, from its exit code (negative: the signal that killed it)."""
    import signal

    who = f"generation worker {w} (pid {pid}, --trainer.async-steps {k})"
    doing = "while starting" if kind == "ready" else "while generating"
    if code is not None and code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        hint = " (out of memory? see dmesg; or a kill -9)" if -code == signal.SIGKILL else ""
        return f"{who} was killed by {name}{hint} {doing}: the run stops; resume from its last checkpoint with --trainer.resume auto"
    if kind == "ready" and code == 1:  # a spawned process re-imports the script: without the guard it runs main() again and fails
        return (
            f"{who} exited with status 1 while starting; if a script calls a recipe's main(), it needs an "
            "`if __name__ == '__main__':` guard (the worker is a spawned process that imports the script)"
        )
    return f"{who} exited with status {code} {doing} without sending its batch: the run stops"


def split_groups(rows: int, group_size: int, parts: int) -> list[list[int]]:
    """Row indices of `parts` shares of a batch of `rows` rows in groups of `group_size` adjacent rows: whole groups,
    as even as can be, in order (the first shares one group larger); empty shares when there are fewer groups."""
    groups = rows // group_size
    sizes = [groups // parts + (1 if w < groups % parts else 0) for w in range(parts)]
    out, start = [], 0
    for size in sizes:
        out.append(list(range(start * group_size, (start + size) * group_size)))
        start += size
    return out


class Rollouts:
    """Generation batches for the loop; see the module docstring. Close it (loop.Run does) to stop the workers."""

    def __init__(self, cfg, policy, prompts, run=None, need_ref: bool | None = None):
        """prompts(i): the i-th generation batch's prompt rows (i = 1, 2, ...), groups of --rollout.n adjacent rows.
        run: a loop.Run that logs the async/ metrics and closes this at the end of the loop, or when it stops on an
        error. need_ref: whether the workers add ref_log_prob (default: --actor.use-kl-loss)."""
        self.k, self.policy, self.prompts = cfg.trainer.async_steps, policy, prompts
        self.timeout_s = getattr(cfg.trainer, "async_timeout_s", 0) or 0  # seconds without a message from a worker (0 = no limit)
        self.n_workers, self.group_size = getattr(cfg.trainer, "async_workers", 1), cfg.rollout.n
        self.i = 0  # generation batches asked for so far
        self.submitted = 0  # ... and handed to the workers
        self.sent = {}  # worker -> the policy version whose weights it last received
        self.stats: list[tuple[int, float]] = []  # (staleness, seconds waited) per batch since the last metrics()
        self.procs, self.actors = [], []
        self.pending = collections.deque()  # per queued batch: the workers that got a share of it, in row order
        self.loader = getattr(run, "loader", None)  # the train PromptLoader prompts(i) draws from
        self.drawn_from: dict[int, dict] = {}  # batch i -> the loader's state before prompts(i) drew it (i not yet taken)
        if run is not None:
            run.rollouts = self
        if self.k < 0:
            raise ConfigError(f"--trainer.async-steps {self.k}: must be >= 0 (0 = synchronous)")
        if self.k == 0:
            return
        if self.n_workers < 1:
            raise ConfigError(f"--trainer.async-workers {self.n_workers}: must be >= 1")
        t = cfg.trainer
        if t.backend == "ray" and t.engine == "megatron":
            raise ConfigError(f"--trainer.async-steps {self.k} does not run with --trainer.engine megatron yet; use --trainer.engine fsdp")
        need_ref = cfg.actor.use_kl_loss if need_ref is None else need_ref
        args = (cfg.model, cfg.actor, cfg.rollout, cfg.data, t, need_ref, getattr(policy, "turn_loop", None))
        atexit.register(self.close)  # a script that never reaches loop.Run's close still stops the workers
        if t.backend == "ray":
            self._start_ray(args, t)
        else:
            self._start_processes(args)

    # -- the workers: spawned processes (local backend) or Ray actors ---------------------------------------------
    def _start_processes(self, args) -> None:
        import torch.multiprocessing as mp

        ctx = mp.get_context("spawn")
        for w in range(self.n_workers):
            jobs, results = ctx.Queue(), ctx.Queue()
            proc = ctx.Process(target=_serve, args=((*args, w), jobs, results), daemon=True, name=f"rlkit-rollout-{w}")
            proc.start()
            self.procs.append((proc, jobs, results))
        for w in range(self.n_workers):
            self._receive(w, "ready")

    def _start_ray(self, args, t) -> None:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from rlkit.ray_group import ResourcePool, cluster_gpus, gpus_per_worker

        gpus = gpus_per_worker(t.device, cluster_gpus())
        self.pool = ResourcePool(self.n_workers, t.cpus_per_worker, gpus, name="async_rollout")  # beside the trainer's
        remote = ray.remote(Generator)
        for w in range(self.n_workers):
            strategy = PlacementGroupSchedulingStrategy(self.pool.pg, placement_group_bundle_index=w)
            env = {"env_vars": {"OMP_NUM_THREADS": str(max(int(t.cpus_per_worker), 1))}}
            options = dict(num_cpus=t.cpus_per_worker, num_gpus=gpus, max_restarts=0, scheduling_strategy=strategy, runtime_env=env)
            self.actors.append(remote.options(**options).remote(*args, rank=w))
        self._ray_get([a.__ray_ready__.remote() for a in self.actors])

    def _ray_get(self, refs):
        import ray

        try:
            return ray.get(refs, timeout=self.timeout_s or None)
        except ray.exceptions.GetTimeoutError:
            self.close()
            raise RunFailed(
                f"a generation worker (--trainer.async-steps {self.k}, a Ray actor) sent nothing for {self.timeout_s:g} s "
                f"(--trainer.async-timeout-s {self.timeout_s:g}): it is hung or stopped. Raise the flag if a batch really takes "
                "that long (0 = wait forever)"
            ) from None
        except (ray.exceptions.RayTaskError, ray.exceptions.RayActorError) as e:
            self.close()
            raise RunFailed(f"a generation worker (--trainer.async-steps {self.k}, a Ray actor) failed:\n{e}") from None

    def _receive(self, w: int, kind: str):
        """Worker process w's next message, which must be `kind`; a crash, an error, a stop (SIGSTOP) or silence for
        --trainer.async-timeout-s there raises RunFailed naming the worker."""
        proc, _, results = self.procs[w]
        start = time.monotonic()
        stopped_since = None  # when the worker was first seen stopped (state T), in this wait
        while True:
            try:
                got, i, payload = results.get(timeout=2.0)
                break
            except queue.Empty:
                if not proc.is_alive():
                    code = proc.exitcode
                    self.close()
                    raise RunFailed(_died(w, proc.pid, code, kind, self.k)) from None
                now = time.monotonic()
                stopped_since = (stopped_since or now) if _is_stopped(proc.pid) else None
                waited = now - start
                stop_limit = min(self.timeout_s or STOPPED_LIMIT_S, STOPPED_LIMIT_S)
                timed_out = bool(self.timeout_s) and waited >= self.timeout_s
                if stopped_since is not None and (now - stopped_since >= stop_limit or timed_out):
                    self._kill(proc)
                    raise RunFailed(
                        f"generation worker {w} (pid {proc.pid}, --trainer.async-steps {self.k}) has been stopped (SIGSTOP/SIGTSTP, "
                        f"state T) and sent nothing for {waited:.0f} s, so its batch never comes: the run stops (kill -CONT {proc.pid} "
                        "within the wait lets it go on; --trainer.async-timeout-s bounds every wait)"
                    ) from None
                if timed_out:
                    self._kill(proc)
                    raise RunFailed(
                        f"generation worker {w} (pid {proc.pid}, --trainer.async-steps {self.k}) sent nothing for {waited:.0f} s "
                        f"(--trainer.async-timeout-s {self.timeout_s:g}): it is hung. Raise the flag if a batch really takes that long "
                        "(0 = wait forever)"
                    ) from None
        if got == "error":
            self.close()
            raise RunFailed(f"a generation worker (--trainer.async-steps {self.k}) failed:\n{payload}")
        assert got == kind, (got, kind)
        return i, payload

    def _kill(self, proc) -> None:
        """SIGKILL a hung or stopped worker process (SIGTERM stays pending in a stopped one), then close the rest."""
        proc.kill()
        proc.join(timeout=10)
        self.close()

    def _submit(self) -> None:
        """Queue the next generation batch, a share of its groups per worker, each with the trainer's weights when they
        changed since that worker's last job."""
        self.submitted += 1
        if self.loader is not None:
            self.drawn_from[self.submitted] = self.loader.state_dict()
        version = self.policy.weights_version()  # updates applied so far: the version of the trainer's weights
        batch = self.prompts(self.submitted)  # (B*n, P)
        shares = split_groups(len(batch), self.group_size, self.n_workers)
        workers = [w for w, rows in enumerate(shares) if rows]
        handles, packed = [], None  # Ray: the result refs; processes: the worker numbers. packed: this call's weights
        for w in workers:
            weights = None
            if self.sent.get(w) != version:
                if packed is None:  # packed once for the workers of this batch, held only by the jobs that carry it
                    packed = (*self.policy.trainable_weights(), version)
                    if self.actors:  # one copy in Ray's object store for every actor
                        import ray

                        packed = ray.put(packed)
                weights, self.sent[w] = packed, version
            job = (self.submitted, batch if len(workers) == 1 else batch.index(shares[w]), weights)
            if self.actors:
                handles.append(self.actors[w].generate.remote(*job))
            else:
                self.procs[w][1].put(job)
                handles.append(w)
        self.pending.append(handles)  # in row order

    def next(self) -> DataProto:
        """The next generation batch: prompts(i) generated now (k = 0), or k batches ago by the workers."""
        self.i += 1
        if self.k == 0:
            return self.policy.generate(self.prompts(self.i))
        while self.submitted < self.i + self.k:  # keep k batches queued beyond this one
            self._submit()
        start = time.perf_counter()
        shares = self.pending.popleft()
        got = self._ray_get(shares) if self.actors else [self._receive(w, "batch") for w in shares]
        assert all(i == self.i for i, _ in got), ([i for i, _ in got], self.i)
        batch = got[0][1] if len(got) == 1 else DataProto.concat([b for _, b in got])  # (meta: the first share's)
        self.drawn_from.pop(self.i, None)
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
        """Stop the workers (idempotent)."""
        atexit.unregister(self.close)  # (which would keep this object, and the policy, alive until exit)
        actors, self.actors = self.actors, []
        if actors:
            import ray

            if ray.is_initialized():  # (at exit, Ray may have shut down first: its actors and pools went with it)
                for actor in actors:
                    ray.kill(actor)
                self.pool.remove()
        procs, self.procs = self.procs, []
        for _, jobs, _ in procs:
            jobs.put(None)
        for proc, jobs, results in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=10)
            if proc.is_alive():  # stopped (SIGSTOP): SIGTERM stays pending, and multiprocessing's exit handler would join it forever
                proc.kill()
                proc.join(timeout=10)
            for q in (jobs, results):
                q.cancel_join_thread()
                q.close()
