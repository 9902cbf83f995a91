"""The actor/rollout/reference worker for a group of processes: the model sharded with FSDP2.

One instance runs in each process of a `RayWorkerGroup`. Every process holds 1/N of the
parameters, gradients and optimizer state (`torch.distributed.fsdp.fully_shard`, gloo on CPU,
NCCL on GPU); the batch is split across processes by the group (`@dispatch("split")`).

What changes against the single-process worker, and why:

- the update gets the whole batch and each process takes its 1/N of every mini-batch; losses are
  normalised by the token / sequence counts of the *global* mini-batch (all-reduced), so the update
  equals the one-process update (FSDP averages gradients over processes; the counts are divided by
  N to undo that average). With --actor.shuffle each process shuffles its own share;
- generation runs on a full, unsharded copy of the policy (gathered before each rollout: the
  "hybrid engine"), because processes stop generating at different lengths and a sharded model
  would need every process in every forward pass;
- state for checkpoints is gathered to full tensors; `save_pretrained` writes from rank 0.
"""

from __future__ import annotations

import copy
import os

import torch
import torch.distributed as dist

from rlkit.protocol import DataProto
from rlkit.ray_group import dispatch
from rlkit.rollout import HFRollout
from rlkit.workers import ActorRolloutRefWorker


def init_process_group(rank: int, world_size: int, master_addr: str, master_port: int, device: torch.device) -> None:
    """Join the group's torch.distributed process group (gloo on CPU, NCCL on GPU)."""
    os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=world_size)


def shard(model, mesh=None):
    """FSDP2: shard every decoder layer, then the whole model (embeddings, head, norms)."""
    from torch.distributed.fsdp import fully_shard

    layers = [m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")]
    for layer in layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


class FSDPActorRolloutRefWorker(ActorRolloutRefWorker):
    """ActorRolloutRefWorker whose model is sharded across the processes of its group."""

    def __init__(self, model_cfg, actor_cfg, rollout_cfg, data_cfg, device: str = "auto", seed: int = 0,
                 need_ref: bool | None = None, *, rank: int, world_size: int, master_addr: str, master_port: int):
        from rlkit.engine import resolve_device, set_threads

        set_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        dev = resolve_device(device)
        if dev.type == "cuda":
            dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) if torch.cuda.device_count() > 1 else 0)
        init_process_group(rank, world_size, master_addr, master_port, dev)
        self.rank, self.world_size = rank, world_size
        torch.manual_seed(seed)  # the same initial weights (e.g. LoRA's) in every process
        super().__init__(model_cfg, actor_cfg, rollout_cfg, data_cfg, device=str(dev), seed=seed, need_ref=need_ref,
                         wrap=self._wrap)
        self.dp_size = world_size  # each process updates on its 1/N of every mini-batch
        # the rollout copy: the same structure, never sharded; weights copied in before each rollout
        self.rollout_model = copy.deepcopy(self._unsharded_template).eval()
        self.rollout = HFRollout(self.rollout_model, self.tokenizer, self.engine.device)

    def _wrap(self, model):
        """Called by the engine on the policy, then on the reference copy: shard it, keeping an
        unsharded twin of the policy to generate with."""
        if not hasattr(self, "_unsharded_template"):
            self._unsharded_template = copy.deepcopy(model)
        return shard(model)

    def _full_state(self) -> dict:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(self.engine.model, options=StateDictOptions(full_state_dict=True, cpu_offload=False))

    @dispatch("split")
    def generate(self, prompts: DataProto, validate: bool = False) -> DataProto:
        self.rollout_model.load_state_dict(self._full_state())
        torch.manual_seed(self.seed * 7919 + self.rank * 104729 + self.updates)  # different samples per process
        return super().generate(prompts, validate)

    @dispatch("split")
    def compute_log_prob(self, batch: DataProto) -> DataProto:
        return super().compute_log_prob(batch)

    @dispatch("split")
    def compute_ref_log_prob(self, batch: DataProto) -> DataProto:
        return super().compute_ref_log_prob(batch)

    @dispatch("all")
    def update(self, batch: DataProto, loss_fn) -> dict:
        """Every process gets the whole batch and takes its 1/N of each mini-batch, so that the k-th
        optimizer step sees the same trajectories as with one process."""
        m = self.actor_cfg.ppo_mini_batch_size * self.rollout_cfg.n
        share = m // self.world_size
        rows = [i for start in range(0, len(batch), m) for i in range(start + self.rank * share, start + (self.rank + 1) * share)]
        metrics = super().update(batch.index(rows), loss_fn)
        # average the metrics over processes so the controller sees the global picture
        keys = sorted(metrics)
        t = torch.tensor([metrics[k] for k in keys], dtype=torch.float64)
        dist.all_reduce(t)
        return {k: v / self.world_size for k, v in zip(keys, t.tolist())}

    @dispatch("all")
    def num_params(self) -> tuple[int, int]:
        return super().num_params()

    @dispatch("all")
    def state_dict(self) -> dict:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        model_sd, optim_sd = get_state_dict(self.engine.model, self.engine.optimizer, options=opts)
        if self.engine.lora:
            model_sd = {k: v for k, v in model_sd.items() if "lora_" in k}
        return {"model": model_sd, "optimizer": optim_sd, "scheduler": self.engine.scheduler.state_dict(), "updates": self.updates}

    @dispatch("all")
    def load_state_dict(self, state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        opts = StateDictOptions(full_state_dict=True, strict=not self.engine.lora)
        set_state_dict(self.engine.model, self.engine.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"], options=opts)
        self.engine.scheduler.load_state_dict(state["scheduler"])
        self.updates = state["updates"]

    @dispatch("all")
    def save_pretrained(self, path) -> None:
        self.rollout_model.load_state_dict(self._full_state())  # a collective: every rank takes part
        if self.rank == 0:
            model = self.rollout_model.merge_and_unload() if self.engine.lora else self.rollout_model
            model.save_pretrained(path)
            self.tokenizer.save_pretrained(path)
            if self.engine.lora:  # merge_and_unload changed the copy: rebuild it
                self.rollout_model = copy.deepcopy(self._unsharded_template).eval()
                self.rollout.model = self.rollout_model
        dist.barrier()
