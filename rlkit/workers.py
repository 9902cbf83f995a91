"""Workers: what the recipe (the single controller) calls to generate, score log-probs and update.

A recipe never touches a model directly. It calls a worker group::

    policy.generate(prompts)             -> prompts + responses (+ masks)
    policy.compute_log_prob(batch)       -> old_log_probs, entropys
    policy.compute_ref_log_prob(batch)   -> ref_log_prob
    policy.update(batch, loss_fn)        -> metrics

`ActorRolloutRefWorker` is the actor (trained), the rollout (generation) and the reference
(frozen) roles on one model. `CriticWorker` is a value model (PPO's critic)::

    critic.compute_values(batch)         -> values
    critic.update(batch, loss_fn)        -> metrics

`LocalWorkerGroup` runs one such worker in this process; a group with workers on Ray answers the
same calls, so a recipe does not change when it scales out. Which group a recipe gets, and where its
workers go, is rlkit/placement.py's job (`build_policy`, `build_critic`, `build_reward`).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from rlkit.config import CriticSystem, System, rows_per_mini_batch
from rlkit.engine import TorchEngine, auto_micro_batch, num_params, unpack_weights
from rlkit.errors import ConfigError, MissingFile
from rlkit.models import resolve_model_path
from rlkit.protocol import DataProto
from rlkit.ray_group import dispatch
from rlkit.rollout import HFRollout, free_device_memory, generation_rows


def resolved(model_cfg):
    """model_cfg with a built-in model name (e.g. smollm2-135m-instruct) replaced by its local folder."""
    path = resolve_model_path(model_cfg.path)
    return model_cfg if path == model_cfg.path else dataclasses.replace(model_cfg, path=path)


def make_rollout(engine, rollout_sys, data_cfg, model_path: str, seed: int):
    """The generation backend named by --rollout.name (rollout_sys: a RolloutSystem): hf (generate on the training model) or vllm."""
    if rollout_sys.name == "hf":  # generates under the engine's autocast: in the compute dtype over float32 masters
        model = getattr(engine, "hf_model", engine.model)  # a Megatron engine generates on a gathered HF copy
        kv = engine.dtype if getattr(engine, "master_fp32", False) else None  # the KV cache in the compute dtype, not the masters'
        return HFRollout(model, engine.tokenizer, engine.device, autocast=engine.autocast, kv_dtype=kv, impl=rollout_sys.hf_impl)
    if rollout_sys.name == "vllm":
        from rlkit.vllm_rollout import VLLMRollout

        return VLLMRollout(
            engine.model,
            engine.tokenizer,
            model_path,
            engine.dtype,
            engine.device,
            rollout_sys,
            max_model_len=data_cfg.max_prompt_length + data_cfg.max_response_length,
            seed=seed,
        )
    raise ConfigError(f"unknown --rollout.name {rollout_sys.name!r}; available: hf, vllm")


class CheckpointFiles:
    """A worker's part of a training checkpoint, written into (and read from) a folder of its own.

    One process writes its state_dict() to folder/state.pt; the FSDP workers override both methods
    to write sharded files, each process its own shard (torch.distributed.checkpoint).
    """

    def save_checkpoint(self, folder: str | Path) -> None:
        Path(folder).mkdir(parents=True, exist_ok=True)
        torch.save(self.state_dict(), Path(folder) / "state.pt")

    def load_checkpoint(self, folder: str | Path) -> None:
        file = Path(folder) / "state.pt"
        if not file.is_file():
            raise MissingFile(f"{folder} holds no state.pt: was it saved with another --trainer.backend? Resume with the same backend")
        from rlkit.checkpoint import load_file

        self.load_state_dict(load_file(file))  # weights_only: a shared checkpoint cannot run code


class ActorRolloutRefWorker(CheckpointFiles):
    """Actor + rollout + reference on one model (one device)."""

    engine_class = TorchEngine  # a distributed worker may use another (rlkit/megatron_workers.py)

    def __init__(
        self,
        model_cfg,
        actor_cfg,
        rollout_cfg,
        data_cfg,
        device: str = "auto",
        seed: int = 0,
        need_ref: bool | None = None,
        wrap=None,
        trains: bool = True,
        system=None,
    ):
        """system: the recipe's cfg.system (default System()), of which the worker reads .model, .actor and .rollout.
        trains=False: a generation-only copy (the async generation worker, rlkit/async_rollout.py): no optimizer,
        weights from load_weights; system.actor still sets its log-prob micro-batches."""
        system = system or System()
        model_sys, update_sys, rollout_sys = system.model, system.actor, system.rollout
        if rollout_sys.name not in ("hf", "vllm"):
            raise ConfigError(f"unknown --rollout.name {rollout_sys.name!r}; available: hf, vllm")
        model_cfg = resolved(model_cfg)
        torch.manual_seed(seed)  # fresh weights (LoRA's) start the same in every process and on every backend
        self.trains = trains
        self.engine = self.engine_class(
            model_cfg, actor_cfg if trains else None, device, need_ref=need_ref, wrap=wrap, model_sys=model_sys, update_sys=update_sys
        )
        if not trains:  # no optimizer, but its log-prob passes keep the trainer's token budget
            self.engine.max_tokens = update_sys.max_token_len_per_micro_batch
        self.tokenizer = self.engine.tokenizer
        self.rollout = make_rollout(self.engine, rollout_sys, data_cfg, model_cfg.path, seed)
        self.actor_cfg, self.rollout_cfg, self.data_cfg, self.seed = actor_cfg, rollout_cfg, data_cfg, seed
        self.rollout_sys = rollout_sys
        self.router_replay = getattr(update_sys, "router_replay", "none")  # MoE: none, r2, r3 (docs/moe.md)
        self.updates = 0
        self.dp_size = 1  # processes sharing each mini-batch (FSDP workers set it)
        self.agent = None  # set_agent: generate() runs this turn loop instead of single-turn sampling
        self.micro_batch = auto_micro_batch(update_sys.ppo_micro_batch_size, self.engine.model, 256, 8)
        self.log_prob_micro_batch = rollout_sys.log_prob_micro_batch_size or self.micro_batch  # the update's, unless set
        self.gen_micro_batch = auto_micro_batch(rollout_sys.micro_batch_size, self.engine.model, None, 64)  # tiny: one generate call
        self.kv_budget_fraction = 0.5  # CUDA, --rollout.micro-batch-size 0: the share of free memory HF generation may fill

    def describe(self) -> str:
        """Device, dtypes, attention implementation, checkpointing and rollout backend, for the start-of-run line."""
        return f"{self.engine.describe()}, rollout {self.rollout_sys.name}"

    def set_agent(self, agent) -> None:
        """Make generate() multi-turn: agent(worker, prompts, validate) -> DataProto (rlkit/agent.py's TurnLoop; picklable, so
        that each Ray worker runs the turn loop, and the tools, on its own share of the rows)."""
        self.agent = agent

    def generate(self, prompts: DataProto, validate: bool = False, **stream) -> DataProto:
        """Sample one response per row (temperature rollout.temperature, or val_temperature when validating).
        stream: the fast loop's in-flight weight updates (swap_every, on_new_weights, swap_mode, version), from the async
        generation worker (async_rollout.Generator); --rollout.drop-finished is passed here."""
        if self.agent is not None:
            return self.agent(self, prompts, validate)
        r, s = self.rollout_cfg, self.rollout_sys
        extra = {"return_log_probs": True} if s.log_probs and not validate and isinstance(self.rollout, HFRollout) else {}
        if s.drop_finished and isinstance(self.rollout, HFRollout):  # (config: hf fast only)
            extra["drop_finished"] = s.drop_finished
        if self.router_replay == "r3" and not validate:  # R3: the routing of the forwards that sample (docs/moe.md)
            extra["record_routing"] = True
        extra.update(stream)
        return self.rollout.generate(
            prompts,
            self.data_cfg.max_response_length,
            temperature=s.val_temperature if validate else r.temperature,
            top_p=r.top_p,
            top_k=r.top_k,
            micro_batch_size=self.generation_rows(prompts),
            **extra,  # + rollout_log_probs (B, R): mu, for the mismatch metrics and the correction (vllm: always)
        )

    def generation_rows(self, prompts: DataProto) -> int | None:
        """Rows per HF generate call: --rollout.micro-batch-size; with 0 on CPU gen_micro_batch (64 rows, all for a tiny
        model), on CUDA as many rows as fit in kv_budget_fraction of the free memory (rollout.generation_rows: the KV
        cache of prompt + response tokens, the prefill's activations and a step's logits per row)."""
        if self.rollout_sys.micro_batch_size or self.engine.device.type != "cuda" or not isinstance(self.rollout, HFRollout):
            return self.gen_micro_batch
        tokens = (prompts["input_ids"].shape[1], self.data_cfg.max_response_length)
        model = self.rollout.model  # the model that generates (Megatron: its Hugging Face copy, whose config this reads)
        kv_dtype = self.rollout.kv_dtype or next(model.parameters()).dtype
        return generation_rows(model.config, *tokens, kv_dtype, self.kv_budget_fraction * free_device_memory(self.engine.device))

    def _trainer_pass(self) -> None:
        """Before a forward/backward pass of the trainer: a vLLM engine on a GPU sleeps (frees its memory) until the next generate.
        (A generation-only worker keeps it awake in its own passes; it sleeps between jobs instead: async_rollout.Generator.idle.)"""
        if self.trains and hasattr(self.rollout, "sleep"):
            self.rollout.sleep()

    def update_is_one_step(self) -> bool:
        """True when an update is one optimizer step (ppo_epochs 1, mini-batch = whole batch): then π_old is the
        policy before that step, the update's own log-probs (detached), and needs no pass of its own. (Not "the
        batch is on-policy": an asynchronous batch sampled k updates ago qualifies too; its correction compares
        those log-probs with the sampler's.)"""
        one = self.actor_cfg.ppo_epochs == 1 and self.actor_cfg.ppo_mini_batch_size >= self.data_cfg.train_batch_size
        return one and self.router_replay != "r2"  # R2 records in the old-log-prob pass: it runs (compute_log_prob)

    def compute_log_prob(self, batch: DataProto) -> DataProto:
        """Per-token log-probs of the responses under the current policy (π_old) and their entropy. Router replay
        (docs/moe.md): r2 records this pass's routing into the batch (routed_experts), r3 replays the rollout's."""
        self._trainer_pass()
        r2 = self.router_replay == "r2" and "routed_experts" not in batch
        out = self.engine.compute_log_prob(
            batch, self.rollout_cfg.temperature, self.log_prob_micro_batch, with_entropy=True, record_routing=r2
        )
        tensors = {"old_log_probs": out[0], "entropys": out[1]}
        if r2:
            tensors["routed_experts"] = out[2]  # (B, L, layers, k): replayed in every update forward
        return DataProto.from_dict(tensors=tensors)

    def compute_ref_log_prob(self, batch: DataProto) -> DataProto:
        """Per-token log-probs under the reference policy (LoRA: adapter disabled; else a frozen copy). A batch that
        carries them already (--trainer.async-steps: the generation worker computed them) gets its own back."""
        if "ref_log_prob" in batch:
            return DataProto.from_dict(tensors={"ref_log_prob": batch["ref_log_prob"]})
        self._trainer_pass()
        lp, _ = self.engine.compute_log_prob(batch, self.rollout_cfg.temperature, self.log_prob_micro_batch, ref=True)
        return DataProto.from_dict(tensors={"ref_log_prob": lp})

    def update(self, batch: DataProto, loss_fn) -> dict:
        """The policy update (ppo_mini_batch_size prompts × n trajectories per optimizer step: engine.update), then
        the weight sync: the rollout samples the new weights from the next batch on (sync_rollout)."""
        a = self.actor_cfg
        self._trainer_pass()
        if "sample_keep" in batch:  # --trainer.max-staleness: too-stale samples masked out of the loss (async_rollout.staleness)
            batch, mask = batch.select(), batch["response_mask"]  # (a new DataProto: the caller's batch keeps its mask)
            batch["response_mask"] = mask * batch["sample_keep"][:, None].to(mask.device, mask.dtype)  # (B, R) * (B, 1)
        metrics = self.engine.update(
            batch,
            loss_fn,
            mini_batch_size=rows_per_mini_batch(a, self.rollout_cfg) // self.dp_size,
            micro_batch_size=self.micro_batch,
            epochs=a.ppo_epochs,
            temperature=self.rollout_cfg.temperature,
            shuffle_seed=(self.seed * 100003 + self.updates) if a.shuffle else None,
        )
        self.updates += 1
        synced = self.sync_rollout()  # vllm: the new weights into its engine; hf samples this very model
        if synced is not None:
            metrics["timing/weight_sync"] = synced
        return metrics

    def close(self) -> None:
        """Shut down a separate inference engine (vllm), if any."""
        if hasattr(self.rollout, "close"):
            self.rollout.close()

    def sync_rollout(self) -> float | None:
        """Give a separate inference engine (vllm) the current weights; seconds taken, None without one."""
        return self.rollout.sync_weights() if hasattr(self.rollout, "sync_weights") else None

    def num_params(self) -> tuple[int, int]:
        return num_params(self.engine.model)

    def weights_version(self) -> int:
        """Updates applied so far: the version of the weights (--trainer.async-steps tags each batch with the one that sampled it)."""
        return self.updates

    def trainable_weights(self, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, list]:
        """The trainable weights in one flat buffer (B,) of `dtype` in ordinary CPU memory, and its (name, shape, offset)
        layout (engine.unpack_weights reads it), for the async generation worker: rlkit/async_rollout.py's send_weights
        moves it to shared memory, or to a file when /dev/shm is small. Each weight is cast on its device, then copied."""
        named = [(n, p) for n, p in self.engine.model.named_parameters() if p.requires_grad]
        flat = torch.empty(sum(p.numel() for _, p in named), dtype=dtype)  # (B,)
        layout, offset = [], 0
        for name, p in named:
            flat[offset : offset + p.numel()].copy_(p.detach().reshape(-1).to(dtype))
            layout.append((name, tuple(p.shape), offset))
            offset += p.numel()
        return flat, layout

    def load_weights(self, flat: torch.Tensor, layout: list) -> None:
        """The inverse of trainable_weights: copy such a buffer into this worker's model, and into its vllm engine if any."""
        with torch.no_grad():
            unpack_weights(self.engine.model, flat, layout)
        self.sync_rollout()

    def state_dict(self) -> dict:
        return {**self.engine.state_dict(), "updates": self.updates}

    def load_state_dict(self, state: dict) -> None:
        self.engine.load_state_dict(state)
        self.updates = state["updates"]
        self.sync_rollout()  # resumed weights differ from the folder vLLM loaded

    def save_pretrained(self, path: str | Path) -> None:
        self.engine.save_pretrained(path)


class CriticWorker(CheckpointFiles):
    """A value model V(s_t) on one device: the policy's checkpoint (or critic.path) with a fresh 1-output head."""

    def __init__(
        self, model_cfg, critic_cfg, rollout_cfg, actor_mini_batch_size: int, device: str = "auto", seed: int = 0, wrap=None, system=None
    ):
        """system: the recipe's cfg.system, of which the worker reads .model, .critic (a CriticSystem) and .rollout."""
        system = system or System()
        critic_sys = getattr(system, "critic", None) or CriticSystem()
        model_cfg = dataclasses.replace(model_cfg, path=critic_cfg.path or model_cfg.path, lora_rank=critic_cfg.lora_rank)
        torch.manual_seed(seed)  # the fresh value head starts the same in every process and on every backend
        self.engine = TorchEngine(
            resolved(model_cfg), critic_cfg, device, value_head=True, wrap=wrap, model_sys=system.model, update_sys=critic_sys
        )
        self.critic_cfg, self.rollout_cfg = critic_cfg, rollout_cfg
        self.dp_size = 1  # processes sharing each mini-batch (FSDP workers set it)
        self.mini_batch_size = critic_cfg.ppo_mini_batch_size or actor_mini_batch_size  # prompts
        self.micro_batch = auto_micro_batch(critic_sys.ppo_micro_batch_size, self.engine.model, 256, 8)
        self.values_micro_batch = system.rollout.log_prob_micro_batch_size or self.micro_batch  # the update's, unless set

    def compute_values(self, batch: DataProto) -> DataProto:
        """V(s_t) for every response token t (the state before it): 'values', shaped like the responses."""
        values = self.engine.compute_values(batch, self.values_micro_batch)
        return DataProto.from_dict(tensors={"values": values})

    def update(self, batch: DataProto, loss_fn) -> dict:
        """The critic update: ppo_mini_batch_size prompts × n trajectories per optimizer step; loss_fn gets values."""
        c = self.critic_cfg
        return self.engine.update(
            batch,
            loss_fn,
            mini_batch_size=rows_per_mini_batch(None, self.rollout_cfg, self.mini_batch_size) // self.dp_size,
            micro_batch_size=self.micro_batch,
            epochs=c.ppo_epochs,
        )

    def num_params(self) -> tuple[int, int]:
        return num_params(self.engine.model)

    def state_dict(self) -> dict:
        return self.engine.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.engine.load_state_dict(state)


class TeacherWorker:
    """A frozen model that only scores tokens: on-policy distillation's teacher (recipes/opd.py). No optimizer,
    no rollout, no reference; log-probs at the rollout's temperature, in the policy's micro-batches.

    On Ray (`--trainer.backend ray`) each bundle holds one replica beside the policy's worker; it does not train,
    so the replicas need no process group (rank/world_size are accepted and unused) and the group splits every
    batch across them (data parallel)."""

    def __init__(self, model_cfg, rollout_cfg, device: str = "auto", system=None, **ray_rank):
        """system: the recipe's cfg.system (its .model, the policy's .actor micro-batches, .rollout's log-prob batches)."""
        system = system or System()
        if ray_rank:  # a Ray worker: its bundle's threads, and the one GPU Ray made visible to it
            import os

            from rlkit.engine import resolve_device, set_threads

            set_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
            device = "cuda:0" if resolve_device(device).type == "cuda" else "cpu"
        self.engine = TorchEngine(resolved(model_cfg), None, device, need_ref=False, model_sys=system.model)
        self.engine.model.requires_grad_(False)
        self.engine.max_tokens = system.actor.max_token_len_per_micro_batch  # the trainer's token budget per pass
        self.tokenizer = self.engine.tokenizer
        self.temperature = rollout_cfg.temperature
        self.micro_batch = system.rollout.log_prob_micro_batch_size or auto_micro_batch(
            system.actor.ppo_micro_batch_size, self.engine.model, 256, 8
        )

    @dispatch("split")
    def compute_log_prob(self, batch: DataProto) -> DataProto:
        """log pi_T(y_t | x, y_<t) of the batch's responses: teacher_log_prob (B, R)."""
        lp, _ = self.engine.compute_log_prob(batch, self.temperature, self.micro_batch)
        return DataProto.from_dict(tensors={"teacher_log_prob": lp})

    def num_params(self) -> tuple[int, int]:
        return num_params(self.engine.model)


class LocalWorkerGroup:
    """One worker in this process. Method calls go straight to it; same interface as a Ray group."""

    def __init__(self, worker):
        self.worker = worker

    def __getattr__(self, name):
        return getattr(self.worker, name)

    def close(self) -> None:
        """Free what the worker holds beside its model (a vLLM engine); the model goes with the group."""
        if hasattr(self.worker, "close"):
            self.worker.close()
