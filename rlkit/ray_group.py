"""Worker groups on Ray: the single controller (the recipe) drives N worker processes.

verl's HybridFlow idea in a page: the recipe's loop is plain Python in one process; each role
(actor/rollout/reference, critic, ...) is a *group* of workers, each a Ray actor in its own
process. Calling a method on the group dispatches it to the workers according to the mode the
worker class declares for that method:

    @dispatch("split")   the DataProto argument is split into N equal chunks (padded if needed),
                         one per worker; the results are concatenated (and unpadded)
    @dispatch("all")     every worker gets the same arguments; rank 0's result is returned
    @dispatch("rank0")   only rank 0 runs it

so `policy.update(batch, loss_fn)` reads the same whether `policy` is a `LocalWorkerGroup` in
this process or a `RayWorkerGroup` of eight processes. A worker that raises or dies ends the call
with its error and traceback; nothing waits forever.
"""

from __future__ import annotations

import os
import socket

from rlkit.protocol import DataProto

DISPATCH_ATTR = "_rlkit_dispatch"


def dispatch(mode: str):
    """Declare how a worker method is called by a group: 'split', 'all' or 'rank0'."""
    if mode not in ("split", "all", "rank0"):
        raise ValueError(f"unknown dispatch mode {mode!r}: use 'split', 'all' or 'rank0'")

    def mark(fn):
        setattr(fn, DISPATCH_ATTR, mode)
        return fn

    return mark


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_ray(address: str | None = None, num_cpus: int | None = None) -> None:
    """Connect to a running cluster (address, or RAY_ADDRESS) or start a local one; quiet defaults."""
    import ray

    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=True)
    else:
        ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=True)


class RayWorkerGroup:
    """N Ray actors of `worker_cls`, placed on one placement group, called through `dispatch` modes.

    Each worker is constructed as worker_cls(*args, rank=i, world_size=N, master_addr=..., master_port=..., **kwargs),
    so it can join a torch.distributed process group (gloo on CPU, NCCL on GPU).
    """

    def __init__(self, worker_cls, n_workers: int, *args, cpus_per_worker: float = 1, gpus_per_worker: float = 0,
                 env: dict | None = None, timeout_s: float | None = None, **kwargs):
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.worker_cls, self.n, self.timeout_s = worker_cls, n_workers, timeout_s
        bundle = {"CPU": cpus_per_worker, **({"GPU": gpus_per_worker} if gpus_per_worker else {})}
        self.pg = placement_group([bundle] * n_workers, strategy="PACK")
        try:
            ray.get(self.pg.ready(), timeout=60)
        except Exception as e:
            raise RuntimeError(
                f"Ray could not place {n_workers} workers of {bundle}: the cluster has {ray.cluster_resources()}. "
                "Lower --trainer.n-workers or add nodes (ray start --address ...)"
            ) from e
        master_addr, master_port = "127.0.0.1", free_port()
        remote = ray.remote(worker_cls)
        self.workers = [
            remote.options(
                num_cpus=cpus_per_worker, num_gpus=gpus_per_worker, max_restarts=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=i),
                runtime_env={"env_vars": {"OMP_NUM_THREADS": str(max(int(cpus_per_worker), 1)), **(env or {})}},
            ).remote(*args, rank=i, world_size=n_workers, master_addr=master_addr, master_port=master_port, **kwargs)
            for i in range(n_workers)
        ]
        self._get([w.__ray_ready__.remote() for w in self.workers])

    def _get(self, refs):
        """ray.get that turns a worker's failure into one error carrying its traceback, and never hangs."""
        import ray

        try:
            return ray.get(refs, timeout=self.timeout_s)
        except ray.exceptions.RayTaskError as e:  # the worker raised: e's text holds the worker traceback
            raise RuntimeError(f"a {self.worker_cls.__name__} worker failed:\n{e}") from None
        except ray.exceptions.RayActorError as e:  # the worker process died (killed, OOM, segfault)
            raise RuntimeError(f"a {self.worker_cls.__name__} worker died: {e}") from None
        except ray.exceptions.GetTimeoutError:
            raise RuntimeError(f"{self.worker_cls.__name__} workers did not answer within {self.timeout_s} s") from None

    def __getattr__(self, name):
        method = getattr(self.worker_cls, name, None)
        if method is None or not callable(method):
            raise AttributeError(f"{self.worker_cls.__name__} has no method {name!r}")
        mode = getattr(method, DISPATCH_ATTR, "all")

        def call(*args, **kwargs):
            if mode == "rank0":
                return self._get(getattr(self.workers[0], name).remote(*args, **kwargs))
            if mode == "all":
                return self._get([getattr(w, name).remote(*args, **kwargs) for w in self.workers])[0]
            data, rest = args[0], args[1:]
            if not isinstance(data, DataProto):
                raise TypeError(f"{name} is dispatched with 'split': its first argument must be a DataProto")
            padded, pad = data.pad_to_divisor(self.n)
            chunks = padded.chunk(self.n)
            results = self._get([getattr(w, name).remote(c, *rest, **kwargs) for w, c in zip(self.workers, chunks)])
            if isinstance(results[0], DataProto):
                return DataProto.concat(results).unpad(pad)
            return results[0]  # e.g. metrics, already reduced across workers by the workers themselves

        return call

    def shutdown(self) -> None:
        """Kill the workers and free their placement group."""
        import ray
        from ray.util.placement_group import remove_placement_group

        for w in self.workers:
            ray.kill(w)
        remove_placement_group(self.pg)
