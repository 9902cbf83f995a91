"""Worker groups on Ray: the single controller (the recipe) drives N worker processes.

verl's HybridFlow idea in a page: the recipe's loop is plain Python in one process; each role
(actor/rollout/reference, critic, ...) is a *group* of workers, each a Ray actor in its own
process. Calling a method on the group dispatches it to the workers according to the mode the
worker class declares for that method:

    @dispatch("split")   the DataProto argument is split into N equal chunks (padded if needed),
                         one per worker; the results are concatenated (and unpadded)
    @dispatch("all")     every worker gets the same arguments; rank 0's result is returned
    @dispatch("rank0")   only rank 0 runs it
    @dispatch("split_dp") as split, over the N / S data-parallel replicas: worker k gets chunk k // S, so the S
                         workers of one sequence-parallel group get the same rows (S: the workers' sp_size(),
                         --trainer.sp-size); each replica's first worker's results are concatenated

so `policy.update(batch, loss_fn)` reads the same whether `policy` is a `LocalWorkerGroup` in
this process or a `RayWorkerGroup` of eight processes. A worker that raises or dies ends the call
with its error and traceback; nothing waits forever.
"""

from __future__ import annotations

import os
import socket

from rlkit.errors import ConfigError, RunFailed, UserError
from rlkit.protocol import DataProto

DISPATCH_ATTR = "_rlkit_dispatch"


def dispatch(mode: str):
    """Declare how a worker method is called by a group: 'split', 'split_dp', 'all' or 'rank0'."""
    if mode not in ("split", "split_dp", "all", "rank0"):
        raise ValueError(f"unknown dispatch mode {mode!r}: use 'split', 'split_dp', 'all' or 'rank0'")

    def mark(fn):
        setattr(fn, DISPATCH_ATTR, mode)
        return fn

    return mark


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_ray(address: str | None = None, num_cpus: int | None = None) -> None:
    """Connect to a running cluster (address, or RAY_ADDRESS) or start a new local one; quiet defaults.

    Without an address the run gets a cluster of its own (`address="local"`): ray.init's default would join a cluster
    that `ray start` left on this machine (found through its temp folder) and then refuse `num_cpus`."""
    import ray

    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=True)
    else:
        ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=True)


def cluster_gpus() -> float:
    """GPUs in the Ray cluster (all nodes), from its resources: not whether this driver process sees CUDA
    (a CPU head node drives GPU workers)."""
    import ray

    return float(ray.cluster_resources().get("GPU", 0))


def gpus_per_worker(device: str, gpus_in_cluster: float) -> int:
    """A worker bundle's GPUs for --trainer.device: auto = 1 when the cluster has GPUs, cuda = 1 (an error when it
    has none), cpu = 0."""
    kind = device.split(":")[0]
    if kind == "auto":
        return 1 if gpus_in_cluster > 0 else 0
    if kind == "cuda":
        if gpus_in_cluster <= 0:
            raise ConfigError(
                f"--trainer.device {device}, but the Ray cluster has no GPUs (ray.cluster_resources() shows none): "
                "start its nodes with GPUs (ray start --num-gpus N) or use --trainer.device cpu"
            )
        return 1
    return 0


def _address_and_port() -> tuple[str, int]:
    import ray

    return ray.util.get_node_ip_address(), free_port()


def rendezvous(pool: ResourcePool) -> tuple[str, int]:
    """An address and free port on the node of the pool's first bundle, where rank 0 will run (torch.distributed's MASTER_ADDR/PORT)."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    task = ray.remote(_address_and_port).options(
        num_cpus=0, scheduling_strategy=PlacementGroupSchedulingStrategy(pool.pg, placement_group_bundle_index=0)
    )
    return ray.get(task.remote(), timeout=120)


class ResourcePool:
    """A Ray placement group of `n` bundles of {CPU: cpus, GPU: gpus}: the machines a role runs on.

    As verl's ResourcePoolManager does, a recipe's roles map to pools: several worker groups on one
    pool are *colocated* (worker i of each group runs on bundle i: the same node, the same GPU),
    each group taking a share of every bundle; a role on a pool of its own gets its own devices.
    """

    def __init__(self, n: int, cpus: float = 1, gpus: float = 0, name: str = "global"):
        import ray
        from ray.util.placement_group import placement_group

        if n < 1:
            raise ConfigError(f"resource pool {name!r}: needs at least one bundle, got {n}")
        self.n, self.cpus, self.gpus, self.name = n, cpus, gpus, name
        bundle = {"CPU": cpus, **({"GPU": gpus} if gpus else {})}
        self.pg = placement_group([bundle] * n, strategy="PACK")
        try:
            ray.get(self.pg.ready(), timeout=60)
        except Exception as e:
            self.remove()
            raise RunFailed(
                f"Ray could not place resource pool {name!r} ({n} x {bundle}): the cluster has {ray.cluster_resources()} "
                f"and {ray.available_resources()} free. Use fewer workers (--trainer.n-workers, --trainer.critic-workers), "
                "fewer --trainer.cpus-per-worker, or add nodes (ray start --address ...)"
            ) from e

    def remove(self) -> None:
        from ray.util.placement_group import remove_placement_group

        remove_placement_group(self.pg)


class RayWorkerGroup:
    """N Ray actors of `worker_cls`, one per bundle of a resource pool, called through `dispatch` modes.

    pool: a ResourcePool (shared with other groups: this group takes `share` of each bundle), or a
    number of workers (a pool of its own with cpus_per_worker / gpus_per_worker per bundle, removed
    with the group). Each worker is constructed as
    worker_cls(*args, rank=i, world_size=N, master_addr=..., master_port=..., **kwargs),
    so it can join a torch.distributed process group (gloo on CPU, NCCL on GPU).
    """

    def __init__(
        self,
        worker_cls,
        pool: ResourcePool | int,
        *args,
        share: float = 1.0,
        cpus_per_worker: float = 1,
        gpus_per_worker: float = 0,
        env: dict | None = None,
        timeout_s: float | None = None,
        **kwargs,
    ):
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        own_pool = not isinstance(pool, ResourcePool)
        if own_pool:
            pool = ResourcePool(pool, cpus_per_worker, gpus_per_worker, name=worker_cls.__name__)
        self.pool, self.worker_cls, self.n, self.timeout_s = pool, worker_cls, pool.n, timeout_s
        self.owned_pools = [pool] if own_pool else []  # removed by close()
        self.sp = None  # the workers' sp_size, asked by the first split_dp call
        cpus, gpus = pool.cpus * share, pool.gpus * share
        master_addr, master_port = rendezvous(pool)
        remote = ray.remote(worker_cls)
        self.workers = [
            remote.options(
                num_cpus=cpus,
                num_gpus=gpus,
                max_restarts=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(pool.pg, placement_group_bundle_index=i),
                runtime_env={"env_vars": {"OMP_NUM_THREADS": str(max(int(cpus), 1)), **(env or {})}},
            ).remote(*args, rank=i, world_size=self.n, master_addr=master_addr, master_port=master_port, **kwargs)
            for i in range(self.n)
        ]
        self._get([w.__ray_ready__.remote() for w in self.workers])

    def _get(self, refs):
        """ray.get that turns a worker's failure into one error carrying its traceback, and never hangs."""
        import ray

        try:
            return ray.get(refs, timeout=self.timeout_s)
        except ray.exceptions.RayTaskError as e:  # the worker raised: e's text holds the worker traceback
            if isinstance(e.cause, UserError):  # the user's to fix: the worker's own one-line message
                raise e.cause from None
            died = self._died(refs)  # a dead peer fails the others' collectives first (gloo: connection reset)
            if died is not None:
                raise RunFailed(f"a {self.worker_cls.__name__} worker died: {died}") from None
            raise RuntimeError(f"a {self.worker_cls.__name__} worker failed:\n{e}") from None
        except ray.exceptions.RayActorError as e:  # the worker process died (killed, OOM, segfault)
            raise RunFailed(f"a {self.worker_cls.__name__} worker died: {e}") from None
        except ray.exceptions.GetTimeoutError:
            raise RunFailed(f"{self.worker_cls.__name__} workers did not answer within {self.timeout_s} s") from None

    @staticmethod
    def _died(refs, wait_s: float = 10.0):
        """The death (RayActorError) among `refs` once they settle (at most wait_s), else None: when a worker is killed,
        its peers' collectives can fail before Ray reports the death, and the death is the error to name."""
        import ray

        ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=wait_s)
        for ref in ready:
            try:
                ray.get(ref, timeout=0)
            except ray.exceptions.RayActorError as e:
                return e
            except Exception:  # the peers' own failures, or results: not a death
                pass
        return None

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
            s = self._sp_size() if mode == "split_dp" else 1
            padded, pad = data.pad_to_divisor(self.n // s)
            chunks = padded.chunk(self.n // s)
            results = self._get([getattr(w, name).remote(chunks[k // s], *rest, **kwargs) for k, w in enumerate(self.workers)])
            results = results[::s]  # the S workers of a replica return the same rows
            if isinstance(results[0], DataProto):
                return DataProto.concat(results).unpad(pad)
            return results[0]  # e.g. metrics, already reduced across workers by the workers themselves

        return call

    def _sp_size(self) -> int:
        """The workers' sequence-parallel size S (asked once): the workers of one replica are ranks d S .. d S + S - 1."""
        if self.sp is None:
            self.sp = self._get(self.workers[0].sp_size.remote())
        return self.sp

    def close(self) -> None:
        """Kill the workers and free the pools they own (their own pool, or the pools made for them)."""
        import ray

        for w in self.workers:
            ray.kill(w)
        self.workers = []
        for pool in self.owned_pools:
            pool.remove()
        self.owned_pools = []

    shutdown = close  # the older name
