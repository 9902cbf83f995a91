"""Workers for a group of processes: the model sharded with FSDP2 (actor/rollout/reference, and critic).

One instance runs in each process of a `RayWorkerGroup`. Every process holds 1/N of the
parameters, gradients and optimizer state (`torch.distributed.fsdp.fully_shard`, gloo on CPU,
NCCL + gloo on GPU); the model is loaded in CPU memory and sharding, one decoder layer at a time,
moves each process's share to its GPU, so no GPU ever holds the full model (or the reference copy); the batch is split across processes by the group (`@dispatch("split")`).

What changes against the single-process workers, and why:

- the update gets the whole batch and each process takes its 1/N of every mini-batch; losses are
  normalised by the token / sequence counts of the *global* mini-batch (all-reduced), so the update
  equals the one-process update (FSDP averages gradients over processes; the counts are divided by
  N to undo that average). With --actor.shuffle each process shuffles its own share;
- mixed precision (FSDP's MixedPrecisionPolicy): float32 master weights, sharded; each layer's
  weights are gathered in --trainer.fsdp-param-dtype (bfloat16 on GPU by default) for the forward
  and backward passes; gradients are reduced in float32. --trainer.fsdp-offload keeps the shards
  in CPU memory (CPUOffloadPolicy);
- generation (the "hybrid engine"): before each rollout every process gathers the full weights and
  keeps them for the whole of `generate` (processes stop at different lengths, and a sharded model
  would need every process in every forward pass); after it they are freed, back to 1/N;
- training checkpoints are sharded: each process writes its own shard of the weights and optimizer
  state (torch.distributed.checkpoint, DCP); DCP reshards on load, so a run may resume on another
  number of processes. The Hugging Face export (hf/) gathers the full weights and rank 0 writes it.
"""

from __future__ import annotations

import dataclasses
import os
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist

from rlkit.config import System, rows_per_mini_batch
from rlkit.errors import ConfigError, MissingFile
from rlkit.protocol import DataProto
from rlkit.ray_group import dispatch
from rlkit.workers import ActorRolloutRefWorker, CriticWorker, resolved


def process_group_backend(device: torch.device) -> str:
    """gloo on CPU; on GPU NCCL for CUDA tensors *and* gloo for CPU ones: the loss normalisers
    (engine.global_counts), the skip flag (engine.all_finite) and the metrics (_mean_over_ranks) are
    all-reduced as small CPU tensors, which NCCL alone cannot carry."""
    return "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"


def check_device(device: torch.device) -> None:
    """A worker told to use CUDA on a node where it sees no GPU fails with one line (not a CUDA traceback)."""
    if device.type == "cuda" and not torch.cuda.is_available():
        import socket

        raise ConfigError(
            f"--trainer.device {device}: this Ray worker (host {socket.gethostname()}) sees no GPU "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}). Give the cluster GPUs (ray start --num-gpus N) "
            "or use --trainer.device auto/cpu"
        )


def init_process_group(rank: int, world_size: int, master_addr: str, master_port: int, device: torch.device) -> None:
    """Join the group's torch.distributed process group (see process_group_backend)."""
    os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(process_group_backend(device), rank=rank, world_size=world_size)


def shard(model, param_dtype: torch.dtype | None = None, offload: bool = False):
    """FSDP2: shard every decoder layer, then the whole model (embeddings, head, norms).

    param_dtype: gather the weights in this dtype for compute (None: as stored); gradients are
    reduced in float32. offload: keep the shards in CPU memory between uses.
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    kw = {}
    if param_dtype is not None:
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    if offload:
        kw["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    for layer in [m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")]:
        fully_shard(layer, **kw)
    fully_shard(model, **kw)
    return model


class FSDPMixin:
    """What both FSDP workers add to their single-process class: joining the process group, sharding,
    each process's share of a mini-batch, and sharded checkpoints."""

    def _join(self, system, device: str, rank: int, world_size: int, master_addr: str, master_port: int, fsdp: dict | None):
        """Join the process group; returns (device, system) with system.model's master-weight dtype resolved (and, with
        sequence parallelism, its attention and checkpointing)."""
        from rlkit.engine import resolve_device, resolve_dtype, set_threads

        set_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        dev = resolve_device(device)
        check_device(dev)
        if dev.type == "cuda":  # Ray sets CUDA_VISIBLE_DEVICES to this worker's GPU
            dev = torch.device("cuda", 0)
        init_process_group(rank, world_size, master_addr, master_port, dev)
        self.rank, self.world_size = rank, world_size
        fsdp = fsdp or {}
        system = system or System()
        model_sys = self._sequence_parallel(int(fsdp.get("sp_size", 1)), dev, system.model)
        compute = resolve_dtype(fsdp.get("param_dtype", "auto"), dev)
        if model_sys.dtype == "auto":  # FSDP keeps float32 master weights; compute runs in `compute`
            model_sys = dataclasses.replace(model_sys, dtype="float32")
        self.compute_dtype = compute
        stored = getattr(torch, model_sys.dtype)
        self._shard_kw = {"param_dtype": compute if compute != stored else None, "offload": fsdp.get("offload", False)}
        return dev, dataclasses.replace(system, model=model_sys)

    def _sequence_parallel(self, sp: int, dev: torch.device, model_sys):
        """--trainer.sp-size S: a (dp, sp) mesh of D = N / S replicas of S ranks (ranks d S .. d S + S - 1 share rows,
        ray_group's split_dp); FSDP still shards over all N ranks, rlkit/ulysses.py gets the sp group and
        engine.global_counts the dp group (_wire_sp). sdpa, and no gradient checkpointing (its recompute would run
        plain attention on a shard) under `auto`; preflight refuses the rest."""
        self.sp, self.dp_rank, self.dp_world = sp, self.rank // sp, self.world_size // sp
        self.sp_group = self.dp_group = None
        if sp == 1:
            return model_sys
        if self.world_size % sp:
            raise ConfigError(f"--trainer.sp-size {sp} must divide --trainer.n-workers {self.world_size}")
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(dev.type, (self.dp_world, sp), mesh_dim_names=("dp", "sp"))
        self.sp_group, self.dp_group = mesh["sp"].get_group(), mesh["dp"].get_group()
        changes = {"attn_implementation": "sdpa"} if model_sys.attn_implementation == "auto" else {}
        if model_sys.gradient_checkpointing == "auto":
            changes["gradient_checkpointing"] = "off"
        return dataclasses.replace(model_sys, **changes)

    def _wire_sp(self) -> None:
        """Hand the groups to the engine (after it is built) and check what preflight checks, for a group built directly."""
        if self.sp == 1:
            return
        e = self.engine
        if e.value_head or e.remove_padding or e.attn_implementation != "sdpa" or e.gradient_checkpointing or e.vlm:
            raise ConfigError(
                f"--trainer.sp-size {self.sp} runs a causal LM, padded rows, sdpa, no gradient checkpointing: add "
                "--model.no-remove-padding --model.attn-implementation sdpa --model.gradient-checkpointing off (no critic, no VLM)"
            )
        from rlkit.rollout import text_config
        from rlkit.ulysses import kv_repeats

        c = text_config(e.model.config)
        kv_repeats(c.num_attention_heads, getattr(c, "num_key_value_heads", None) or c.num_attention_heads, self.sp)
        e.sp_group, e.sp_replica_group = self.sp_group, self.dp_group

    @dispatch("rank0")
    def sp_size(self) -> int:
        """S, the sequence-parallel size (ray_group's split_dp asks it)."""
        return self.sp

    def _shard(self, model):
        return shard(model, **self._shard_kw)

    def _my_rows(self, batch: DataProto, mini_batch_size: int) -> DataProto:
        """This process's 1/D of every mini-batch of `mini_batch_size` rows (the k-th optimizer step sees the same
        trajectories as with one process); D = N / S data-parallel replicas, the S ranks of one taking the same rows."""
        share = mini_batch_size // self.dp_world
        d = self.dp_rank
        rows = [i for start in range(0, len(batch), mini_batch_size) for i in range(start + d * share, start + (d + 1) * share)]
        return batch.index(rows)

    def _mean_over_ranks(self, metrics: dict) -> dict:
        """Average the metrics over processes so the controller sees the global picture (memory peaks: the largest)."""
        peaks = sorted(k for k in metrics if k.startswith("memory/"))
        keys = sorted(k for k in metrics if k not in peaks)
        t = torch.tensor([metrics[k] for k in keys], dtype=torch.float64)  # CPU tensors: gloo (process_group_backend)
        dist.all_reduce(t)
        out = {k: v / self.world_size for k, v in zip(keys, t.tolist())}
        if peaks:
            p = torch.tensor([metrics[k] for k in peaks], dtype=torch.float64)
            dist.all_reduce(p, op=dist.ReduceOp.MAX)
            out.update(zip(peaks, p.tolist()))
        return out

    @dispatch("all")
    def num_params(self) -> tuple[int, int]:
        return super().num_params()

    def _sharded_state(self, **options) -> dict:
        """{'model', 'optimizer'}: the trainable weights (what engine.in_checkpoint keeps; LoRA's frozen base is left
        out) and the optimizer state, as sharded DTensors, or with full_state_dict=True gathered to full tensors."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        model_sd, optim_sd = get_state_dict(
            self.engine.model, self.engine.optimizer, options=StateDictOptions(ignore_frozen_params=True, **options)
        )
        return {"model": {k: v for k, v in model_sd.items() if self.engine.in_checkpoint(k)}, "optimizer": optim_sd}

    def _full_state_dict(self) -> dict:
        """The whole trainable state gathered to full tensors in every process (tests compare it across group sizes)."""
        return {**self._sharded_state(full_state_dict=True, cpu_offload=True), "scheduler": self.engine.scheduler.state_dict()}

    def _load_full_state_dict(self, state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        set_state_dict(
            self.engine.model,
            self.engine.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optimizer"],
            options=StateDictOptions(full_state_dict=True, strict=False),
        )
        self.engine.scheduler.load_state_dict(state["scheduler"])

    def _save_sharded(self, folder, extra: dict) -> None:
        """Each process writes its shard into `folder` (DCP); rank 0 adds the small unsharded rest (scheduler, counters)."""
        import torch.distributed.checkpoint as dcp

        folder = Path(folder)
        if self.rank == 0:
            folder.mkdir(parents=True, exist_ok=True)
        dist.barrier()
        dcp.save(self._sharded_state(), checkpoint_id=str(folder))
        if self.rank == 0:
            torch.save({"scheduler": self.engine.scheduler.state_dict(), **extra}, folder / "extra_state.pt")
        dist.barrier()

    def _load_sharded(self, folder) -> dict:
        """Read a DCP checkpoint into this process's shards (any number of processes may have written it)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        folder = Path(folder)
        if not (folder / ".metadata").is_file():
            raise MissingFile(
                f"{folder} holds no sharded checkpoint (.metadata): was it saved with --trainer.backend local? "
                "Resume with the same --trainer.backend"
            )
        from rlkit.checkpoint import dcp_load, load_file

        state = self._sharded_state()
        dcp_load(state, folder)  # no code runs: .metadata unpickled safely, tensors and the non-tensor items weights-only
        set_state_dict(
            self.engine.model,
            self.engine.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optimizer"],
            options=StateDictOptions(strict=False),
        )
        extra = load_file(folder / "extra_state.pt")  # weights_only: a shared checkpoint cannot run code
        self.engine.scheduler.load_state_dict(extra.pop("scheduler"))
        return extra


class FSDPActorRolloutRefWorker(FSDPMixin, ActorRolloutRefWorker):
    """ActorRolloutRefWorker whose model is sharded across the processes of its group."""

    def __init__(
        self,
        model_cfg,
        actor_cfg,
        rollout_cfg,
        data_cfg,
        device: str = "auto",
        seed: int = 0,
        need_ref: bool | None = None,
        fsdp: dict | None = None,
        system=None,
        *,
        rank: int,
        world_size: int,
        master_addr: str,
        master_port: int,
    ):
        dev, system = self._join(system, device, rank, world_size, master_addr, master_port, fsdp)
        rollout_sys = system.rollout
        hf = dataclasses.replace(system, rollout=dataclasses.replace(rollout_sys, name="hf"))  # vLLM: made below, once sharded
        super().__init__(
            model_cfg, actor_cfg, rollout_cfg, data_cfg, device=str(dev), seed=seed, need_ref=need_ref, wrap=self._shard, system=hf
        )
        self.rollout_sys = rollout_sys
        self._wire_sp()
        self.dp_size = self.dp_world  # each replica (S processes with --trainer.sp-size) updates on its 1/D of every mini-batch
        if rollout_sys.name == "vllm":
            self._start_vllm(resolved(model_cfg).path, seed)

    def _start_vllm(self, model_path: str, seed: int) -> None:
        """One vLLM engine per process, in a child process of its own (vLLM sets up its own one-process
        torch.distributed there, apart from this group's), in the compute dtype, seeded per rank; it
        loads --model.path and gets the trained weights after every update (sync_rollout)."""
        from rlkit.vllm_rollout import VLLMRollout

        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
        max_len = self.data_cfg.max_prompt_length + self.data_cfg.max_response_length
        self.rollout = VLLMRollout(
            self.engine.model,
            self.tokenizer,
            model_path,
            self.compute_dtype,
            self.engine.device,
            self.rollout_sys,
            max_model_len=max_len,
            seed=seed + self.rank,
        )
        self.sync_rollout()  # LoRA's adapter, or weights loaded from a checkpoint, are not in the folder vLLM read

    @contextmanager
    def _full_weights(self):
        """The hybrid engine's switch: every process gathers the full weights (in the compute dtype) and keeps
        them across forward passes, so it can generate alone, at its own lengths; on exit they are freed. (Not for
        the vLLM sync, the inherited sync_rollout: vllm_rollout.hf_weights / adapter_state gather tensor by tensor, and
        state_dict() hands FSDP2's sharded parameters back anyway.)"""
        from torch.distributed.fsdp import FSDPModule

        modules = [m for m in self.engine.model.modules() if isinstance(m, FSDPModule)]
        for m in modules:
            m.set_reshard_after_forward(False, recurse=False)
            m.unshard()
        try:
            yield
        finally:
            for m in modules:
                m.reshard()
                m.set_reshard_after_forward(True, recurse=False)

    @dispatch("split")
    def generate(self, prompts: DataProto, validate: bool = False) -> DataProto:
        if self.rollout_sys.name == "vllm":  # its own engine holds full weights (synced after each update)
            return super().generate(prompts, validate)
        torch.manual_seed(self.seed * 7919 + self.rank * 104729 + self.updates)  # different samples per process
        with self._full_weights():
            return super().generate(prompts, validate)

    @dispatch("all")
    def set_agent(self, agent) -> None:
        super().set_agent(agent)  # every process runs the turn loop on its share of the rows

    @dispatch("split_dp")
    def compute_log_prob(self, batch: DataProto) -> DataProto:
        return super().compute_log_prob(batch)

    @dispatch("split_dp")
    def compute_ref_log_prob(self, batch: DataProto) -> DataProto:
        return super().compute_ref_log_prob(batch)

    @dispatch("all")
    def update(self, batch: DataProto, loss_fn) -> dict:
        """Every process gets the whole batch and takes its 1/N of each mini-batch."""
        mine = self._my_rows(batch, rows_per_mini_batch(self.actor_cfg, self.rollout_cfg))
        metrics = super().update(mine, loss_fn)
        if torch.cuda.is_initialized():  # this process's GPU peak over the step (generate .. update, weight sync), the largest rank's
            metrics["memory/worker_peak_gb"] = torch.cuda.max_memory_allocated() / 2**30
            torch.cuda.reset_peak_memory_stats()
        return self._mean_over_ranks(metrics)

    @dispatch("rank0")
    def weights_version(self) -> int:
        return self.updates

    @dispatch("all")
    def trainable_weights(self):
        """The full trainable weights (a collective: every process gathers), packed on rank 0 for the async generation
        worker; the other processes return None."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        from rlkit.engine import pack_weights

        options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
        full = get_model_state_dict(self.engine.model, options=options)
        if self.rank != 0:
            return None
        return pack_weights((n, full[n]) for n, p in self.engine.model.named_parameters() if p.requires_grad)

    @dispatch("all")
    def load_weights(self, flat: torch.Tensor, layout: list) -> None:
        """The inverse of trainable_weights: whole weights (every process gets them) into this process's shards, then
        into its vLLM engine (recipes/sft.py --init-from-scratch)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        state = {name: flat[offset : offset + torch.Size(shape).numel()].view(shape) for name, shape, offset in layout}
        set_model_state_dict(self.engine.model, state, options=StateDictOptions(full_state_dict=True, strict=False))
        self.sync_rollout()

    @dispatch("all")
    def state_dict(self) -> dict:
        return {**self._full_state_dict(), "updates": self.updates}

    @dispatch("all")
    def load_state_dict(self, state: dict) -> None:
        self._load_full_state_dict(state)
        self.updates = state["updates"]
        self.sync_rollout()

    @dispatch("all")
    def save_checkpoint(self, folder) -> None:
        self._save_sharded(folder, {"updates": self.updates})

    @dispatch("all")
    def load_checkpoint(self, folder) -> None:
        self.updates = self._load_sharded(folder)["updates"]
        self.sync_rollout()

    @dispatch("all")
    def save_pretrained(self, path) -> None:
        """A plain Hugging Face folder: the full weights are gathered to rank 0 (CPU), put into a fresh copy
        of --model.path (LoRA merged) and saved in the compute dtype."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        from rlkit.engine import add_lora, freeze_vision, load_model

        full = get_model_state_dict(self.engine.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if self.rank == 0:
            cfg = self.engine.model_cfg
            model = load_model(cfg.path, self.compute_dtype, torch.device("cpu"), cfg.trust_remote_code)
            if self.engine.lora:
                model = add_lora(model, cfg, frozen_vision=freeze_vision(model, self.engine.model_sys))
            model.load_state_dict(full)
            (model.merge_and_unload() if self.engine.lora else model).save_pretrained(path)
            self.tokenizer.save_pretrained(path)
            if getattr(self.engine, "vlm", False):  # the processor too (docs/vlm.md)
                from rlkit.vlm import load_processor, save_processor

                save_processor(load_processor(cfg.path, cfg.trust_remote_code), path)
        dist.barrier()


class FSDPCriticWorker(FSDPMixin, CriticWorker):
    """CriticWorker whose value model is sharded across the processes of its group."""

    def __init__(
        self,
        model_cfg,
        critic_cfg,
        rollout_cfg,
        actor_mini_batch_size: int,
        device: str = "auto",
        seed: int = 0,
        fsdp: dict | None = None,
        system=None,
        *,
        rank: int,
        world_size: int,
        master_addr: str,
        master_port: int,
    ):
        dev, system = self._join(system, device, rank, world_size, master_addr, master_port, fsdp)
        super().__init__(
            model_cfg, critic_cfg, rollout_cfg, actor_mini_batch_size, device=str(dev), seed=seed, wrap=self._shard, system=system
        )
        self._wire_sp()  # (refuses S > 1: the value head has no sequence-parallel pass yet)
        self.dp_size = world_size

    @dispatch("split")
    def compute_values(self, batch: DataProto) -> DataProto:
        return super().compute_values(batch)

    @dispatch("all")
    def update(self, batch: DataProto, loss_fn) -> dict:
        mine = self._my_rows(batch, rows_per_mini_batch(None, self.rollout_cfg, self.mini_batch_size))
        return self._mean_over_ranks(super().update(mine, loss_fn))

    @dispatch("all")
    def state_dict(self) -> dict:
        return self._full_state_dict()

    @dispatch("all")
    def load_state_dict(self, state: dict) -> None:
        self._load_full_state_dict(state)

    @dispatch("all")
    def save_checkpoint(self, folder) -> None:
        self._save_sharded(folder, {})

    @dispatch("all")
    def load_checkpoint(self, folder) -> None:
        self._load_sharded(folder)
