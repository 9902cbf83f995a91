"""Rollouts for the recipe's loop: generated here in turn (k = 0), or k steps ahead by a generation worker (k >= 1).

    rollouts = Rollouts(cfg, policy, train)          # train: the PromptLoader of B prompts per batch
    batch = rollouts.next()                          # the next generated batch, (B*n, ...)

Batch i is prompts(i): the loader's next B prompts, one group id uid = "i-j" per prompt, each repeated
--rollout.n times (a group's rows adjacent). k = --trainer.async-steps. With k = 0, next() is
`policy.generate(prompts(i))`, the synchronous loop exactly.
With k >= 1 a generation worker -- another process with its own copy of the weights (and of the frozen
reference, when a KL term needs it) and its own rollout (hf or vllm, the turn loop of grpo_tools too) --
samples the batches of steps t+1 .. t+k while the trainer updates on step t's::

    trainer  | update t-1 |  update t  | update t+1 |          k = 1: batch t+1 is sampled by pi_{t-1}
    worker   |  gen t     |  gen t+1   |  gen t+2   |          while the trainer turns pi_{t-1} into pi_t

The worker is a spawned process (--trainer.backend local) or a Ray actor on a pool of its own
(--trainer.backend ray: the FSDP workers gather the full trainable weights for it); --trainer.async-workers N
starts N of them, each sampling an equal share of every batch's prompt groups (split_groups). Each call of next()
(1) hands the worker the trainer's current weights when they changed (send_weights: one flat buffer in the dtype the
worker stores them in -- bf16 when it computes in bf16 -- through shared memory when /dev/shm has room for twice the
buffer, else a memory-mapped file in a temporary folder; Ray's object store on the Ray backend), (2) queues the prompts of the batch k calls ahead, (3) waits for the
oldest queued batch. A job is always generated with the weights sent with it (or the last ones before
it), so a run is reproducible whatever the timing. Every batch comes back with `rollout_log_probs` (mu,
as sampled), `ref_log_prob` (when asked: the frozen reference pass leaves the trainer's critical path)
and meta["policy_version"], the number of updates behind its weights. staleness = updates now -
policy_version = k once the pipeline is full (less for the first k batches, all sampled by the starting
weights; never more than k); logged as async/staleness, _max.

In-flight weight updates (--trainer.swap-every C > 0, local backend, the fast HF loop): the trainer pushes each new
version on a per-worker `updates` queue instead of with the job (the job says "start on version v or newer"), and the
worker's decoding loop polls it every C tokens (Generator.on_new_weights, non-blocking), loading a newer version in
place (--trainer.swap-mode keep_kv or reprefill); the batch carries token_version (B, R), staleness() turns it into
the async/token_staleness_*, async/version_span* metrics and, with --trainer.max-staleness s, the sample_keep mask
the update applies (docs/off-policy.md, "Three regimes").

The queue of groups (--trainer.queue-groups G, local backend): in place of each batch's fixed split, every draw of B
prompts goes on one job queue as jobs of G groups that whichever worker is free pulls (each job to start on the
trainer's version then or newer, pushed on the workers' updates queues), finished groups come back on one shared
queue, and each step takes the next B ready groups (Rollouts._next_groups), dropping those more than
--trainer.max-staleness versions behind; async/groups_stale_<s>, async/groups_from_<w>, async/dropped_groups,
async/gen_idle_s. A checkpoint saves the loader's position before the oldest draw with a group not yet taken.

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
import dataclasses
import os
import queue
import shutil
import tempfile
import time
import traceback
import uuid

import torch

from rlkit.errors import RunFailed
from rlkit.protocol import DataProto

ASYNC_KV_BUDGET_FRACTION = 0.25  # the generation worker's share of the free GPU memory for HF generation (the trainer's: 0.5)


class Generator:
    """The generation worker: the trainer's rollout worker (ActorRolloutRefWorker: the same rollout, turn loop,
    micro-batches and reference pass) as a generation-only copy, loaded with the trainer's weights job by job."""

    def __init__(self, model_cfg, actor_cfg, rollout_cfg, data_cfg, system, seed: int, need_ref: bool, agent=None, rank: int = 0):
        """system: the recipe's cfg.system (its trainer's device and threads, async_rollout's in-flight updates, the rest as
        the trainer's worker reads them); seed: --trainer.seed."""
        from rlkit.engine import set_threads
        from rlkit.workers import ActorRolloutRefWorker

        set_threads(system.trainer.num_threads)
        seed = seed + 1 + 1000 * rank  # the sampling stream of worker `rank` (its fresh LoRA: overwritten by job 1)
        system = dataclasses.replace(system, rollout=dataclasses.replace(system.rollout, log_probs=True))  # every batch carries mu
        device = system.trainer.device
        self.worker = ActorRolloutRefWorker(
            model_cfg, actor_cfg, rollout_cfg, data_cfg, device, seed, need_ref, trains=False, system=system
        )
        # Beside the trainer on one GPU, HF generation sizes its calls from a quarter of the free memory, not half: it
        # measures "free" while the trainer may be between passes, and the trainer's next update needs its peak back.
        self.worker.kv_budget_fraction = ASYNC_KV_BUDGET_FRACTION
        if agent is not None:  # grpo_tools: the multi-turn turn loop, on this worker's rollout
            self.worker.set_agent(agent)
        torch.manual_seed(seed)
        self.need_ref, self.version = need_ref, 0
        a = system.async_rollout
        self.swap_every, self.swap_mode = a.swap_every, a.swap_mode  # in-flight weight updates (0: off)
        self.updates = None  # --trainer.swap-every: the queue the trainer pushes each new version on (_serve sets it)

    def generate(self, i: int, prompts: DataProto, weights=None) -> tuple[int, DataProto]:
        """Batch i: load `weights` (flat, layout, version) when given, sample, add the reference log-probs.

        With --trainer.swap-every C the weights come on the updates queue instead and `weights` is ("await", v): the job
        starts on version v or newer (the newest pushed: a run's batches start no older than the k-step loop's), and
        every C tokens the fast loop asks on_new_weights for a newer one; the batch then holds token_version (B, R)."""
        stream = {}
        if isinstance(weights, tuple) and weights and weights[0] == "await":  # (--trainer.queue-groups without swap-every too)
            self._await(weights[1])
            if self.swap_every:
                stream = dict(
                    swap_every=self.swap_every, on_new_weights=self.on_new_weights, swap_mode=self.swap_mode, version=self.version
                )
        elif weights is not None:
            flat, layout, self.version = receive_weights(weights)
            self.worker.load_weights(flat, layout)
        start = self.version
        batch = self.worker.generate(prompts, **stream)
        if self.need_ref:  # log pi_ref(y_t), here, off the trainer's critical path
            batch = batch.union(self.worker.compute_ref_log_prob(batch))
        batch.meta["policy_version"] = start  # the version the job started on: its oldest tokens'
        return i, batch

    def newest(self):
        """The newest payload on the updates queue, without waiting (None: nothing new); older ones are discarded."""
        got = None
        while True:
            try:
                payload = self.updates.get_nowait()
            except queue.Empty:
                return got
            if got is not None:
                discard(got)
            got = payload

    def _load(self, payload) -> None:
        flat, layout, self.version = receive_weights(payload)
        self.worker.load_weights(flat, layout)

    def _await(self, version: int, timeout_s: float = 600.0) -> None:
        """Load pushed weights until this worker holds `version` or newer (the trainer pushed it before queuing the job)."""
        payload = self.newest()
        if payload is not None:
            self._load(payload)
        while self.version < version:
            self._load(self.updates.get(timeout=timeout_s))  # (queue.Empty after timeout_s: an error the trainer reports)
            payload = self.newest()
            if payload is not None:
                self._load(payload)

    def on_new_weights(self):
        """The fast loop's poll (HFRollout.decode, every --trainer.swap-every tokens): None when the trainer pushed nothing
        since this worker's last load, else (version, loader): loader(model) copies the weights into this worker's model
        in place (the rollout's model is the engine's) and the tokens from here on carry that version."""
        payload = self.newest()
        if payload is None:
            return None
        flat, layout, version = receive_weights(payload)
        self.version = version

        def loader(model) -> None:
            self.worker.load_weights(flat, layout)

        return version, loader

    def idle(self) -> None:
        """Between jobs, with none waiting (_serve): the vLLM engine sleeps (level 1: weights to CPU memory, KV cache
        freed; a no-op on CPU, VLLMRollout.sleep) and this process's cached CUDA blocks go back to the driver, so that the
        trainer's update on the same GPU has that memory. The next job wakes it: load_weights' sync the weights, generate
        the KV cache (VLLMRollout.wake_up). The cost: one wake per job that finds the worker idle."""
        if hasattr(self.worker.rollout, "sleep"):
            self.worker.rollout.sleep()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def close(self) -> None:
        self.worker.close()


# -- the weight hand-off (--trainer.backend local): shared memory, or a memory-mapped file when /dev/shm is small ---------
SHM = "/dev/shm"  # where torch.multiprocessing puts the storage of a tensor sent through a queue (Linux)


def handoff_dtype(model_cfg, model_sys, device: str) -> torch.dtype:
    """The dtype the generation worker stores its trainable weights in, hence the one to hand them off in: exact.

    The worker's engine does not train (no float32 masters): a full model is held in the compute dtype (bf16 on a GPU),
    so unpack_weights rounds float32 weights to it anyway -- sending bf16 (x.to(bf16), the same round-to-nearest) gives
    bit-identical weights for half the bytes. The worker only generates with them (and records the log-probs it sampled
    with); its reference pass uses its own frozen copy, the trainer computes pi_old itself. LoRA adapters are float32
    in both processes (peft's default): sent as float32.
    """
    from rlkit.engine import resolve_device, resolve_dtype

    return torch.float32 if model_cfg.lora_rank > 0 else resolve_dtype(model_sys.dtype, resolve_device(device))


def shm_free_bytes() -> int | None:
    """Free bytes in /dev/shm (None where there is no such folder: other systems, where torch shares differently)."""
    return shutil.disk_usage(SHM).free if os.path.isdir(SHM) else None


def send_weights(flat: torch.Tensor, layout, version: int, workers: list[int], folder: str) -> dict[int, tuple]:
    """One payload per worker for a plain flat buffer (B,): shared memory when /dev/shm has room for twice the buffer
    (Docker and Kubernetes default to 64 MB: 2 GB of float32 weights of a 0.5B model do not fit), else a file in
    `folder` written once, memory-mapped by the workers, with one hard link per worker that it deletes once read
    (the bytes are freed when the last worker has its copy)."""
    free = shm_free_bytes()
    if free is None or free >= 2 * flat.nbytes:
        flat = flat.share_memory_()  # the queue then sends a handle, not the bytes
        return {w: ("shm", flat, layout, version) for w in workers}
    room = shutil.disk_usage(folder).free
    if room < flat.nbytes:
        raise RunFailed(
            f"no room for the async weight hand-off ({flat.nbytes / 2**20:.0f} MiB): /dev/shm has {free / 2**20:.0f} MiB free, "
            f"{folder} {room / 2**20:.0f} MiB. Give the container more shared memory (docker --shm-size 8g) or point TMPDIR at a larger disk"
        )
    path = os.path.join(folder, f"weights-v{version}-{uuid.uuid4().hex[:8]}")
    torch.from_file(path, shared=True, size=flat.numel(), dtype=flat.dtype).copy_(flat)  # written through the mapping
    payloads = {}
    for w in workers:
        os.link(path, f"{path}-w{w}")
        payloads[w] = ("file", f"{path}-w{w}", flat.dtype, flat.numel(), layout, version)
    os.unlink(path)
    return payloads


def discard(payload) -> None:
    """Drop a send_weights payload unread (a newer version came after it): a file payload's link is removed."""
    if isinstance(payload[0], str) and payload[0] == "file":
        try:
            os.unlink(payload[1])
        except FileNotFoundError:
            pass


def receive_weights(payload) -> tuple[torch.Tensor, list, int]:
    """(flat, layout, version) from a send_weights payload (or a plain (flat, layout, version): Ray's object store).
    A file is memory-mapped copy-on-write (read lazily by unpack_weights) and its link removed at once."""
    kind = payload[0] if isinstance(payload[0], str) else None
    if kind == "shm":
        return payload[1:]
    if kind != "file":
        return payload
    _, path, dtype, numel, layout, version = payload
    flat = torch.from_file(path, shared=False, size=numel, dtype=dtype)  # (B,) the mapping outlives the unlink
    os.unlink(path)
    return flat, layout, version


def _serve(args, jobs, results, updates=None, stop=None) -> None:
    """The spawned generation process (--trainer.backend local): build a Generator, then generate every job it is sent.
    updates: the queue of pushed weights (--trainer.swap-every, --trainer.queue-groups), read by the Generator between and
    inside jobs. stop (--trainer.queue-groups): the trainer's event; then `jobs` and `results` are shared by all workers,
    so each message names this worker -- ("took", job, (w, idle s)) when it takes a job, ("groups", job, (w, batch)).

    Ctrl-C in a terminal reaches the whole process group: the worker ignores SIGINT, the trainer's close() stops it. It
    also stops on its own when the trainer is gone (SIGKILL), checked before every job and every 2 s while idle."""
    import multiprocessing as mp
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    w = args[-1] if args else None  # (a test may call this in-process, with no Generator arguments)
    parent = mp.parent_process()  # None when called in-process
    try:
        gen = Generator(*args)
        gen.updates = updates
        results.put(("ready", None, w))
    except Exception:
        results.put(("error", None, traceback.format_exc()))
        return
    idle_from = time.monotonic()
    while True:
        if (parent is not None and not parent.is_alive()) or (stop is not None and stop.is_set()):  # the trainer died, or closes us
            results.cancel_join_thread()  # (nobody reads what is still buffered: do not wait to flush it at exit)
            return
        try:
            job = jobs.get(timeout=2.0)
        except queue.Empty:
            continue
        if job is None:
            gen.close()
            return
        if stop is not None:
            if stop.is_set():
                continue
            results.put(("took", job[0], (w, time.monotonic() - idle_from)))
        try:
            i, batch = gen.generate(*job)
            results.put(("batch", i, batch) if stop is None else ("groups", i, (w, batch)))
            if jobs.empty():  # no job queued: idle until one comes (sleeping while one waits would only cost a wake)
                gen.idle()
            idle_from = time.monotonic()
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


def staleness(token_version: torch.Tensor, mask: torch.Tensor, version: int, max_staleness: int = 0) -> tuple[dict, torch.Tensor]:
    """Per-token staleness of a batch taken when the trainer is at `version` (the weights its update starts from, pi_prox):

        s_it    = version - v_it                     over response tokens (mask m_it = 1); v_it = token_version
        mean    = sum_it s_it m_it / sum_it m_it,  max = max_it s_it
        span_i  = max_t v_it - min_t v_it            (versions inside sample i; 0 without an in-flight swap)
        keep_i  = version - min_t v_it <= s          (its oldest token at most s = --trainer.max-staleness behind; s = 0: all)

    Returns ({sums for Rollouts.metrics}, keep (B,) bool). A row without response tokens is kept and not counted."""
    m = mask.bool()
    valid = m.any(1)  # (B,)
    big = torch.iinfo(torch.long).max
    oldest = torch.where(m, token_version, big).min(1).values  # (B,) min_t v_it
    newest = torch.where(m, token_version, -1).max(1).values  # (B,) max_t v_it
    s = (version - token_version)[m]  # (tokens,) s_it
    keep = torch.ones(len(m), dtype=torch.bool)
    if max_staleness > 0:
        keep = ~valid.cpu() | (version - oldest.cpu() <= max_staleness)
    sums = {
        "tokens": int(m.sum()),
        "stale_sum": float(s.sum()) if len(s) else 0.0,
        "stale_max": int(s.max()) if len(s) else 0,
        "span_sum": float((newest - oldest)[valid].sum()),
        "span_max": int((newest - oldest)[valid].max()) if valid.any() else 0,
        "rows": int(valid.sum()),
        "dropped": int((~keep).sum()),
    }
    return sums, keep


class Rollouts:
    """Generation batches for the loop; see the module docstring. Close it (recipe.Run does) to stop the workers."""

    def __init__(self, cfg, policy, train, need_ref: bool | None = None, prepare=None):
        """train: the PromptLoader that prompts(i) draws B prompts from (next_batch(); its position is what a
        checkpoint saves). The recipe hands this to its recipe.Run, `for step in run.steps(rollouts)`: the run logs
        the async/ metrics and closes this at the end of the loop, or when it stops on an error. need_ref: whether
        the workers add ref_log_prob (default: --actor.use-kl-loss).
        prepare: prepare(prompts) -> prompts with more columns, on the B prompts (uid set) before they are repeated,
        here, when the batch is queued (remax.py: its greedy baseline b(x))."""
        a = cfg.system.async_rollout
        self.k, self.policy, self.loader, self.prepare = a.async_steps, policy, train, prepare
        self.timeout_s = a.async_timeout_s  # seconds without a message from a worker (0 = no limit)
        self.n_workers, self.group_size = a.async_workers, cfg.rollout.n
        self.worker_vllm = cfg.system.rollout.name == "vllm"
        self.swap_every, self.max_staleness = a.swap_every, a.max_staleness  # (swap_mode: the workers')
        self.token_stats: list[dict] = []  # staleness() sums per batch since the last metrics() (swap-every / max-staleness)
        self.update_queues = []  # per worker process: the pushed weights (--trainer.swap-every)
        self.i = 0  # generation batches asked for so far
        self.submitted = 0  # ... and handed to the workers
        self.sent = {}  # worker -> the policy version whose weights it last received
        self.stats: list[tuple[int, float]] = []  # (staleness, seconds waited) per batch since the last metrics()
        self.procs, self.actors = [], []
        self.weights_dir = None  # the weight hand-off's file folder, when /dev/shm lacks room (send_weights)
        self.handoff_dtype = handoff_dtype(cfg.model, cfg.system.model, cfg.system.trainer.device)
        self.pending = collections.deque()  # per queued batch: the workers that got a share of it, in row order
        self.drawn_from: dict[int, dict] = {}  # batch i -> the loader's state before prompts(i) drew it (i not yet taken)
        # --trainer.queue-groups G: a queue of groups in place of the fixed split (Rollouts._next_groups)
        self.queue_groups = a.queue_groups
        self.batch_groups = cfg.data.train_batch_size if self.queue_groups else None  # B: the groups a step takes
        self.shared = None  # (jobs, results, stop): the queues every worker pulls from and pushes to, the stop event
        self.ready = collections.deque()  # finished groups not yet taken, in arrival order: (group (n rows), worker, oldest version)
        self.outstanding = 0  # groups queued, generating or ready, not yet taken or dropped
        self.jobs_out: dict[int, list] = {}  # job id -> [worker (None until taken), time taken, its uids]
        self.n_jobs = 0  # jobs queued so far
        self.draws: dict[int, tuple] = {}  # draw d -> (the loader's state before prompts(d), its uids not yet taken or dropped)
        self.pushed = None  # the version last pushed to every worker's updates queue
        self.qstats = collections.Counter()  # since the last metrics(): dropped_groups, gen_idle_s, stale_<s>, from_<w>
        if self.k == 0:  # (the flags' ranges and what cannot run beside them: config.AsyncConfig.check, preflight.check_async)
            return
        need_ref = cfg.actor.use_kl_loss if need_ref is None else need_ref
        args = (cfg.model, cfg.actor, cfg.rollout, cfg.data, cfg.system, cfg.trainer.seed, need_ref, getattr(policy, "turn_loop", None))
        atexit.register(self.close)  # a script that never reaches recipe.Run's close still stops the workers
        if cfg.system.scale_out.backend == "ray":
            self._start_ray(args, cfg.system.scale_out, cfg.system.trainer.device)
        else:
            self._start_processes(args)

    def prompts(self, i: int) -> DataProto:
        """Generation batch i (1, 2, ...): the loader's next B prompts, uid "i-j" for prompt j, each repeated n times."""
        batch = self.loader.next_batch()  # B prompts: input_ids, attention_mask, position_ids (B, P), ground_truth, ...
        batch["uid"] = [f"{i}-{j}" for j in range(len(batch))]  # one group id per prompt
        if self.prepare is not None:
            batch = self.prepare(batch)
        return batch.repeat(self.group_size, interleave=True)  # (B*n, P), a group's rows adjacent

    # -- the workers: spawned processes (local backend) or Ray actors ---------------------------------------------
    serve = staticmethod(_serve)  # what a spawned worker runs: a test wraps it (a slow or hung worker), see tests/test_stream_queue.py

    def _start_processes(self, args) -> None:
        import torch.multiprocessing as mp

        ctx = mp.get_context("spawn")
        if self.queue_groups:  # one queue of jobs all workers pull from, one of finished groups they all push to
            self.shared = (ctx.Queue(), ctx.Queue(), ctx.Event())
        for w in range(self.n_workers):
            jobs, results = self.shared[:2] if self.shared else (ctx.Queue(), ctx.Queue())
            updates = ctx.Queue() if self.swap_every or self.queue_groups else None
            self.update_queues.append(updates)
            extra = (self.shared[2],) if self.shared else ()
            proc = ctx.Process(target=self.serve, args=((*args, w), jobs, results, updates, *extra), daemon=True, name=f"rlkit-rollout-{w}")
            proc.start()
            self.procs.append((proc, jobs, results))
        if self.shared:
            for _ in range(self.n_workers):
                self._take_message("ready")
            return
        for w in range(self.n_workers):
            self._receive(w, "ready")

    def _start_ray(self, args, t, device: str) -> None:
        """The generation workers as Ray actors (t: cfg.system.scale_out), on a pool beside the trainer's."""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from rlkit.ray_group import ResourcePool, cluster_gpus, gpus_per_worker

        gpus = gpus_per_worker(device, cluster_gpus())
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
        self.drawn_from[self.submitted] = self.loader.state_dict()
        version = self.policy.weights_version()  # updates applied so far: the version of the trainer's weights
        batch = self.prompts(self.submitted)  # (B*n, P)
        shares = split_groups(len(batch), self.group_size, self.n_workers)
        workers = [w for w, rows in enumerate(shares) if rows]
        handles = []  # Ray: the result refs; processes: the worker numbers
        stale = [w for w in workers if self.sent.get(w) != version]
        payloads = self._pack_weights(stale, version) if stale else {}  # packed once, held only by the jobs that carry it
        for w in workers:
            weights = payloads.get(w)
            if weights is not None:
                self.sent[w] = version
            if self.swap_every:  # in flight: the weights go on the updates queue, where a running job polls for them
                if weights is not None:
                    self.update_queues[w].put(weights)
                weights = ("await", version)  # the job starts on this version or a newer one
            job = (self.submitted, batch if len(workers) == 1 else batch.index(shares[w]), weights)
            if self.actors:
                handles.append(self.actors[w].generate.remote(*job))
            else:
                self.procs[w][1].put(job)
                handles.append(w)
        self.pending.append(handles)  # in row order

    def _pack_weights(self, workers: list[int], version: int) -> dict:
        """The trainer's weights for `workers`: Ray actors share one copy in the object store (float32, gathered by the FSDP
        workers); worker processes get send_weights payloads in the dtype they store the weights in (handoff_dtype)."""
        if self.actors:
            import ray

            ref = ray.put((*self.policy.trainable_weights(), version))
            return {w: ref for w in workers}
        if self.weights_dir is None:  # the file fallback's folder, removed by close()
            self.weights_dir = tempfile.mkdtemp(prefix="rlkit-weights-")
        if self.worker_vllm and torch.cuda.is_available():  # on one GPU: the worker's vLLM engine wakes on these weights
            torch.cuda.empty_cache()  # and takes its KV cache back; the trainer's cached, unused blocks must be free for it
        flat, layout = self.policy.trainable_weights(self.handoff_dtype)
        return send_weights(flat, layout, version, workers, self.weights_dir)

    # -- --trainer.queue-groups G: workers pull G prompts' groups at a time, the trainer takes the next B ready groups ---------
    def _push_weights(self, version: int) -> None:
        """Every worker's updates queue gets the trainer's weights when they changed: a job starts on the newest there."""
        if self.pushed != version:
            for w, payload in self._pack_weights(list(range(self.n_workers)), version).items():
                self.update_queues[w].put(payload)
            self.pushed = version

    def _submit_draw(self) -> None:
        """Draw the loader's next B prompts (draw d, uids "d-j") and queue them as jobs of G groups, each to start on the
        trainer's version now or newer."""
        self.submitted += 1
        d, state, version = self.submitted, self.loader.state_dict(), self.policy.weights_version()
        self._push_weights(version)
        batch, n = self.prompts(d), self.group_size  # (B*n, P)
        uids = [str(u) for u in batch["uid"][::n]]
        self.draws[d] = (state, set(uids))
        for start in range(0, len(uids), self.queue_groups):
            stop = min(start + self.queue_groups, len(uids))
            self.n_jobs += 1
            self.jobs_out[self.n_jobs] = [None, None, uids[start:stop]]
            self.shared[0].put((self.n_jobs, batch.index(list(range(start * n, stop * n))), ("await", version)))
        self.outstanding += len(uids)

    def _take_message(self, kind: str | None = None) -> None:
        """The next message on the shared results queue: a worker ready, a job taken (who, after how long idle) or its
        finished groups (split into self.ready); an error, a dead worker, a job held or a wait past
        --trainer.async-timeout-s raise RunFailed naming the worker."""
        results, start = self.shared[1], time.monotonic()
        while True:
            self._check_workers(kind, start)  # (before every message too: a fast worker's stream must not hide a dead one)
            try:
                got, j, payload = results.get(timeout=2.0)
                break
            except queue.Empty:
                continue
            except (OSError, EOFError):  # a message's tensors come by fd from its worker: it died mid-hand-off
                for _ in range(20):  # the death, named by _check_workers, once the process is seen gone (at most 5 s)
                    time.sleep(0.25)
                    self._check_workers(kind, start)
                raise
        if got == "error":
            self.close()
            raise RunFailed(f"a generation worker (--trainer.async-steps {self.k}) failed:\n{payload}")
        assert kind is None or got == kind, (got, kind)
        if got == "took":
            w, idle = payload
            self.jobs_out[j][:2] = [w, time.monotonic()]
            self.qstats["gen_idle_s"] += idle
        elif got == "groups":
            w, batch = payload
            self.jobs_out.pop(j)
            n, mask = self.group_size, batch["response_mask"].bool()
            if "token_version" not in batch:  # k-step: every token the version its job started on
                batch["token_version"] = torch.where(mask, batch.meta["policy_version"], -1)  # (G*n, R)
            for g in range(len(batch) // n):
                rows = list(range(g * n, (g + 1) * n))
                v = batch["token_version"][rows][mask[rows]]
                oldest = int(v.min()) if len(v) else batch.meta["policy_version"]  # its oldest token's version
                self.ready.append((batch.index(rows), w, oldest))

    def _check_workers(self, kind: str | None, start: float) -> None:
        """RunFailed, the workers stopped, when one has died, holds a job past --trainer.async-timeout-s, or none has
        sent anything for that long since `start`."""
        now = time.monotonic()
        for w, (proc, _, _) in enumerate(self.procs):
            if not proc.is_alive():
                code = proc.exitcode
                self.close()
                raise RunFailed(_died(w, proc.pid, code, kind or "batch", self.k))
        held = [(now - t0, w, j) for j, (w, t0, _) in self.jobs_out.items() if w is not None]
        if self.timeout_s and held and (max(held)[0] >= self.timeout_s or now - start >= self.timeout_s):  # name who holds it
            waited, w, j = max(held)
            pid = self.procs[w][0].pid
            self._kill(self.procs[w][0])
            raise RunFailed(
                f"generation worker {w} (pid {pid}, --trainer.queue-groups {self.queue_groups}) took job {j} {waited:.0f} s ago and "
                f"never delivered it (--trainer.async-timeout-s {self.timeout_s:g}): it is hung or stopped. Raise the flag if "
                "a job really takes that long, or lower --trainer.queue-groups (fewer groups per job)"
            )
        if self.timeout_s and now - start >= self.timeout_s:
            self.close()
            raise RunFailed(
                f"no generation worker (--trainer.async-workers {self.n_workers}) sent anything for {now - start:.0f} s "
                f"(--trainer.async-timeout-s {self.timeout_s:g}): they are hung. Raise the flag if a job really takes that long"
            )

    def _next_groups(self) -> DataProto:
        """The next B ready groups, whoever generated them, with at least (k+1)B groups kept outstanding; a group whose
        oldest token is more than --trainer.max-staleness s updates behind is dropped (counted) and the next one taken."""
        start, now, B = time.perf_counter(), self.policy.weights_version(), self.batch_groups
        self._push_weights(now)  # a worker's next job starts on these
        taken = []  # (group, worker, staleness)
        while len(taken) < B:
            while self.outstanding < (self.k + 1) * B - len(taken):
                self._submit_draw()
            if not self.ready:
                self._take_message()
                continue
            group, w, oldest = self.ready.popleft()
            self.outstanding -= 1
            uid = str(group["uid"][0])
            d = int(uid.split("-")[0])
            self.draws[d][1].discard(uid)
            if not self.draws[d][1]:
                del self.draws[d]
            if self.max_staleness and now - oldest > self.max_staleness:
                self.qstats["dropped_groups"] += 1
                continue
            taken.append((group, w, now - oldest))
        wait = time.perf_counter() - start
        for _, w, s in taken:
            self.qstats[f"from_{w}"] += 1
            self.qstats[f"stale_{s}"] += 1
            self.stats.append((s, 0.0))
        self.stats[-1] = (self.stats[-1][0], wait)  # (async/wait_s: the step's, once)
        batch = DataProto.concat([g for g, _, _ in taken])  # (B*n, ...)
        batch.meta["policy_version"] = now - max(s for _, _, s in taken)  # the oldest group's
        sums, _ = staleness(batch["token_version"], batch["response_mask"], now)
        self.token_stats.append(sums)
        return batch

    def next(self) -> DataProto:
        """The next generation batch: prompts(i) generated now (k = 0), or k batches ago by the workers."""
        self.i += 1
        if self.k == 0:
            return self.policy.generate(self.prompts(self.i))
        if self.queue_groups:
            return self._next_groups()
        while self.submitted < self.i + self.k:  # keep k batches queued beyond this one
            self._submit()
        start = time.perf_counter()
        shares = self.pending.popleft()
        got = self._ray_get(shares) if self.actors else [self._receive(w, "batch") for w in shares]
        assert all(i == self.i for i, _ in got), ([i for i, _ in got], self.i)
        batch = got[0][1] if len(got) == 1 else DataProto.concat([b for _, b in got])  # (meta: the first share's)
        self.drawn_from.pop(self.i, None)
        now = self.policy.weights_version()
        self.stats.append((now - batch.meta["policy_version"], time.perf_counter() - start))
        if self.swap_every or self.max_staleness:  # per-token versions: stamped by the fast loop, or the batch's own
            mask = batch["response_mask"]
            if "token_version" not in batch:
                batch["token_version"] = torch.where(mask.bool(), batch.meta["policy_version"], -1)  # (B, R)
            sums, keep = staleness(batch["token_version"], mask, now, self.max_staleness)
            self.token_stats.append(sums)
            if self.max_staleness:
                batch["sample_keep"] = keep  # (B,) the update masks the others out of the loss (workers.update)
        return batch

    def loader_state(self) -> dict | None:
        """What a checkpoint saves as the loader's position: the state before the oldest batch queued but not yet taken
        (a resumed run draws those prompts again, sampled by its own weights), or None when none is queued."""
        if self.queue_groups:  # the oldest draw with a group not yet taken or dropped
            return self.draws[min(self.draws)][0] if self.draws else None
        return self.drawn_from[min(self.drawn_from)] if self.drawn_from else None

    def metrics(self) -> dict:
        """async/ metrics of the batches taken since the last call (recipe.Run logs them every step)."""
        if not self.stats:
            return {}
        stale, wait = zip(*self.stats, strict=True)
        self.stats = []
        out = {
            "async/staleness": sum(stale) / len(stale),
            "async/staleness_max": max(stale),
            "async/wait_s": sum(wait),
            "async/steps": self.k,
        }
        if self.token_stats:  # staleness() of the step's batches, pooled
            t, self.token_stats = self.token_stats, []
            tokens, rows = sum(x["tokens"] for x in t), sum(x["rows"] for x in t)
            out.update({
                "async/token_staleness_mean": sum(x["stale_sum"] for x in t) / max(tokens, 1),
                "async/token_staleness_max": max(x["stale_max"] for x in t),
                "async/version_span": sum(x["span_sum"] for x in t) / max(rows, 1),
                "async/version_span_max": max(x["span_max"] for x in t),
                "async/dropped_samples": sum(x["dropped"] for x in t),
            })  # fmt: skip
        if self.queue_groups:  # the groups' staleness histogram, who generated them, what was dropped, the workers' idle time
            q, self.qstats = self.qstats, collections.Counter()
            out["async/dropped_groups"] = q.pop("dropped_groups", 0)
            out["async/gen_idle_s"] = q.pop("gen_idle_s", 0.0)
            for w in range(self.n_workers):
                out["async/" + f"groups_from_{w}"] = q.pop(f"from_{w}", 0)  # (docs/metrics.md: async/groups_from_<w>)
            for key, count in sorted(q.items()):  # stale_<s>
                out["async/" + f"groups_{key}"] = count  # async/groups_stale_<s>
        return out

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
        updates, self.update_queues = self.update_queues, []
        shared, self.shared = self.shared, None
        if shared is not None:  # the shared queue: the workers stop before their next job, one None each wakes an idle one
            shared[2].set()
            for _ in procs:
                shared[0].put(None)
        for q in updates:
            if q is not None:
                q.cancel_join_thread()
                q.close()
        for _, jobs, _ in procs if shared is None else []:
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
        if self.weights_dir is not None:  # files of weights still queued when the workers stopped
            shutil.rmtree(self.weights_dir, ignore_errors=True)
            self.weights_dir = None
