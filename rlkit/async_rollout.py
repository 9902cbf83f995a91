"""Rollouts for the recipe's loop: generated here in turn (k = 0), or k steps ahead by a worker process (k >= 1).

    rollouts = Rollouts(cfg, policy, prompts, run)   # prompts(i) -> the i-th batch of prompt rows (B*n, P)
    batch = rollouts.next()                          # the next generated batch, (B*n, ...)

k = --trainer.async-steps. With k = 0, next() is `policy.generate(prompts(i))`, the synchronous loop exactly.
With k >= 1 a generation worker -- a second process with its own copy of the weights (and of the frozen
reference, when the KL loss needs it) -- samples the batches of steps t+1 .. t+k while the trainer updates
on step t's::

    trainer  | update t-1 |  update t  | update t+1 |          k = 1: batch t+1 is sampled by pi_{t-1}
    worker   |  gen t     |  gen t+1   |  gen t+2   |          while the trainer turns pi_{t-1} into pi_t

Each call of next() (1) hands the worker the trainer's current weights when they changed (one flat
shared-memory buffer, sent with the job), (2) queues the prompts of the batch k calls ahead, (3) waits
for the oldest queued batch. A job is always generated with the weights sent with it (or the last
ones before it), so a run is reproducible whatever the timing. Every batch comes back with
`rollout_log_probs` (mu, as sampled), `ref_log_prob` (when the KL loss is on: the frozen reference
pass leaves the trainer's critical path) and meta["policy_version"], the number of updates behind
its weights. staleness = updates now - policy_version = k once the pipeline is full (less for the first
k batches, all sampled by the starting weights; never more than k); logged as async/staleness, _max.

The loss corrects for it with the recipe's decoupled PPO: pi_old = the trainer's log-probs before the
update (pi_prox), w = f(pi_prox / mu) (--actor.rollout-correction), see docs/off-policy.md.

Local backend with the hf rollout only (a Ray or vLLM run with k >= 1 stops with a ConfigError).
Checkpoints save the loader after the k batches already queued: a resumed run skips their prompts.
"""

from __future__ import annotations

import queue
import time
import traceback

import torch

from rlkit.errors import ConfigError, RunFailed
from rlkit.protocol import DataProto


def flat_weights(model) -> tuple[torch.Tensor, list[tuple[str, tuple, int]]]:
    """The trainable parameters as one flat float tensor in shared memory, and their (name, shape, offset) layout."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    flat = torch.cat([p.detach().reshape(-1).float().cpu() for _, p in named]).share_memory_()
    layout, offset = [], 0
    for name, p in named:
        layout.append((name, tuple(p.shape), offset))
        offset += p.numel()
    return flat, layout


@torch.no_grad()
def load_flat(model, flat: torch.Tensor, layout) -> None:
    """Copy a flat_weights buffer into the model's parameters of the same names."""
    params = dict(model.named_parameters())
    for name, shape, offset in layout:
        p = params[name]
        p.copy_(flat[offset : offset + p.numel()].view(shape))


def _worker(model_cfg, rollout_cfg, data_cfg, trainer_cfg, need_ref: bool, jobs, results) -> None:
    """The generation process: build the same model as the trainer, then generate every job it is sent."""
    import multiprocessing as mp

    from rlkit.engine import TorchEngine, auto_micro_batch, set_threads
    from rlkit.rollout import HFRollout
    from rlkit.workers import resolved

    try:
        set_threads(trainer_cfg.num_threads)
        torch.manual_seed(trainer_cfg.seed)  # the same fresh LoRA weights as the trainer (then overwritten anyway)
        engine = TorchEngine(resolved(model_cfg), None, trainer_cfg.device, need_ref=need_ref)
        rollout = HFRollout(engine.model, engine.tokenizer, engine.device)
        torch.manual_seed(trainer_cfg.seed + 1)  # the sampling stream of the worker
        micro = auto_micro_batch(rollout_cfg.log_prob_micro_batch_size, engine.model, 256, 16)
        results.put(("ready", None, None))
    except Exception:
        results.put(("error", None, traceback.format_exc()))
        return
    r, version = rollout_cfg, 0
    while True:
        try:
            job = jobs.get(timeout=2.0)
        except queue.Empty:
            if not mp.parent_process().is_alive():  # the trainer died without closing us
                return
            continue
        if job is None:
            return
        try:
            i, prompts, weights = job
            if weights is not None:
                flat, layout, version = weights
                load_flat(engine.model, flat, layout)
                del flat
            batch = rollout.generate(prompts, data_cfg.max_response_length, r.temperature, r.top_p, r.top_k, return_log_probs=True)
            if need_ref:  # log pi_ref(y_t), here, off the trainer's critical path
                batch["ref_log_prob"] = engine.compute_log_prob(batch, r.temperature, micro, ref=True)[0]
            batch.meta["policy_version"] = version
            results.put(("batch", i, batch))
        except Exception:
            results.put(("error", None, traceback.format_exc()))
            return


class Rollouts:
    """Generation batches for the loop; see the module docstring. Close it (loop.Run does) to stop the worker."""

    def __init__(self, cfg, policy, prompts, run=None):
        """prompts(i): the i-th generation batch's prompt rows (i = 1, 2, ...). run: a loop.Run that logs the
        async/ metrics and closes this at the end of the loop, or when it stops on an error."""
        self.k, self.policy, self.prompts = cfg.trainer.async_steps, policy, prompts
        self.i = 0  # generation batches asked for so far
        self.submitted = 0  # ... and handed to the worker
        self.sent_version = None  # the policy version whose weights the worker last received
        self.stats: list[tuple[int, float]] = []  # (staleness, seconds waited) per batch since the last metrics()
        self.proc = None
        if run is not None:
            run.rollouts = self
        if self.k < 0:
            raise ConfigError(f"--trainer.async-steps {self.k}: must be >= 0 (0 = synchronous)")
        if self.k == 0:
            return
        if cfg.trainer.backend != "local" or cfg.rollout.name != "hf":
            raise ConfigError(
                f"--trainer.async-steps {self.k} needs --trainer.backend local and --rollout.name hf (got {cfg.trainer.backend}, "
                f"{cfg.rollout.name}); use --trainer.async-steps 0"
            )
        import torch.multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.jobs, self.results = ctx.Queue(), ctx.Queue()
        need_ref = cfg.actor.use_kl_loss
        self.proc = ctx.Process(
            target=_worker,
            args=(cfg.model, cfg.rollout, cfg.data, cfg.trainer, need_ref, self.jobs, self.results),
            daemon=True,
            name="rlkit-rollout",
        )
        self.proc.start()
        self._receive("ready")

    def _receive(self, kind: str):
        """The worker's next message, which must be `kind`; a crash or an error there raises RunFailed."""
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
        version = self.policy.updates  # updates applied so far: the version of the trainer's weights
        weights = None
        if version != self.sent_version:
            flat, layout = flat_weights(self.policy.engine.model)
            weights, self.sent_version = (flat, layout, version), version
        self.jobs.put((self.submitted, self.prompts(self.submitted), weights))

    def next(self) -> DataProto:
        """The next generation batch: prompts(i) generated now (k = 0), or k batches ago by the worker."""
        self.i += 1
        if self.k == 0:
            return self.policy.generate(self.prompts(self.i))
        while self.submitted < self.i + self.k:  # keep k batches queued beyond this one
            self._submit()
        start = time.perf_counter()
        i, batch = self._receive("batch")
        assert i == self.i, (i, self.i)
        self.stats.append((self.policy.updates - batch.meta["policy_version"], time.perf_counter() - start))
        return batch

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
        """Stop the worker process (idempotent)."""
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
