"""RayWorkerGroup: dispatch modes and failures, on a local Ray with two CPU workers."""

import os
import sys

import pytest
import torch

ray = pytest.importorskip("ray")

from rlkit.protocol import DataProto  # noqa: E402
from rlkit.ray_group import RayWorkerGroup, dispatch, init_ray  # noqa: E402


class EchoWorker:
    def __init__(self, scale, rank, world_size, master_addr, master_port):
        self.scale, self.rank, self.world_size = scale, rank, world_size

    @dispatch("split")
    def work(self, data):
        return DataProto.from_dict(tensors={"y": data["x"] * self.scale, "rank": torch.full((len(data),), self.rank)})

    @dispatch("all")
    def ranks(self):
        return (self.rank, self.world_size)

    @dispatch("rank0")
    def who(self):
        return self.rank

    @dispatch("all")
    def fail(self):
        if self.rank == 1:
            raise ValueError("boom on rank 1")
        return "ok"

    @dispatch("all")
    def die(self):
        if self.rank == 1:
            os._exit(1)
        return "ok"


@pytest.fixture(scope="module")
def group():
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    init_ray(num_cpus=2)
    g = RayWorkerGroup(EchoWorker, 2, 10, cpus_per_worker=1, timeout_s=60)
    yield g
    g.close()
    ray.shutdown()


def test_split_dispatch_pads_splits_and_concatenates(group):
    out = group.work(DataProto.from_dict(tensors={"x": torch.arange(5.0)}))
    assert out["y"].tolist() == [0.0, 10.0, 20.0, 30.0, 40.0]  # 5 rows -> padded to 6 -> 3 per worker -> unpadded
    assert out["rank"].tolist() == [0, 0, 0, 1, 1]


def test_all_and_rank0_dispatch(group):
    assert group.ranks() == (0, 2)
    assert group.who() == 0


def test_a_raising_worker_ends_the_call_with_its_traceback(group):
    with pytest.raises(RuntimeError) as err:
        group.fail()
    text = str(err.value)
    assert "boom on rank 1" in text and "test_ray_group.py" in text and ", in fail" in text and "EchoWorker" in text  # the worker traceback


def test_a_dying_worker_ends_the_call_instead_of_hanging(group):
    with pytest.raises(RuntimeError, match="died"):
        group.die()
