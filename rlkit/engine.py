"""Training engine for one device (CPU or one GPU): a Hugging Face causal LM, optionally with LoRA.

It knows how to (1) compute per-token log-probs (and entropy) of responses in micro-batches,
(2) run the policy update: epochs × mini-batches, each accumulated over micro-batches, with a
loss function the *recipe* supplies, then grad-norm clipping and an AdamW step, and (3) save and
load itself. It knows nothing about any RL algorithm.

The reference policy costs no memory with LoRA: it is the same model with the adapter disabled.
Full-parameter training keeps a frozen copy instead.

With value_head=True the same engine is a critic: the checkpoint is loaded as
AutoModelForTokenClassification with one output (transformers' own value head), and wherever the
policy gives log π(y_t) the critic gives V(s_t), the value of the state before response token t,
read at the same positions. The update loop is shared: the loss function gets values instead of
log-probs.

Layout. The passes run on real tokens only (rlkit/packing.py): sequences packed into rows with a block attention
mask (built on the device from segment ids), each group's shared prompt computed once (GRPO's n rows of a prompt),
position ids per sequence, the LM head on the positions read. Same log-probs as the padded rows to float rounding;
--model.no-remove-padding keeps the padded layout. flash_attention_2 takes no 4D mask: its passes pack every
prompt ++ response end to end in one row (varlen, no shared prompt). Micro-batches hold
--actor.ppo-micro-batch-size rows, or with --actor.max-token-len-per-micro-batch > 0 as many rows as fit in that
many positions, in as many micro-batches as the data-parallel process that needs the most (agreed_count); the
loss's Norm is the mini-batch's either way.

Logits. Log-probs and entropy come from one log-sum-exp per position, in chunks, with a backward that recomputes
softmax chunk by chunk (algos.token_logprob_entropy): a pass holds the logits, in the backward their gradient,
and a few 16 MiB buffers; no float32 copy of the whole logits, with or without an entropy term.

Dropout stays off (eval mode) in every pass, so the log-probs of the update equal the old
log-probs when the weights have not moved: the PPO ratio is exactly 1 on-policy.

Precision. --model.dtype names the *compute* dtype (auto: bfloat16 on GPU, float32 on CPU). Full-parameter
training in bfloat16/float16 keeps float32 master weights and runs every pass under
`torch.autocast(device, dtype)`: AdamW's update lr * m / sqrt(v) is often below half a bf16 ulp of the
weight, so bf16 weights updated in place mostly do not move at all (1e-5 on a weight of 0.02 is 1/8 of an
ulp); in float32 every step lands. Autocast rather than a second float32 copy for the optimizer: one copy of
the weights (4 bytes/param instead of 2 + 4), the matmuls still run in bf16, and it is what FSDP's
MixedPrecisionPolicy does on the Ray backend (float32 shards, bf16 compute): both backends train alike.
The frozen reference copy is stored in the compute dtype. LoRA keeps the base in the compute dtype (it is
frozen) and peft's adapters in float32, as before.
"""

from __future__ import annotations

import copy
import importlib.util
import inspect
import os
import warnings
from collections.abc import Callable
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch

from rlkit import algos, packing
from rlkit.config import ModelSystem, UpdateSystem
from rlkit.errors import ConfigError, MissingFile, NonFinite, RunFailed
from rlkit.protocol import DataProto
from rlkit.rollout import text_config

# The loss contract. The engine calls loss_fn once per micro-batch:
#
#     loss, parts, metrics = loss_fn(mb, log_prob, entropy, norm)
#
#   mb        the micro-batch (a DataProto on the device): response_mask (b, R), advantages (b, R),
#             old_log_probs (b, R) (filled in by the engine on the one-step path), whatever the recipe put in
#   log_prob  (b, R) log pi(y_t | x, y_<t) with its gradient; a value model gets V(s_t) instead
#   entropy   (b, R) with its gradient when the loss asks for it (loss_fn.needs_entropy = True), else None
#   norm      algos.Norm(num_tokens, num_seqs) of the whole mini-batch: normalise by it (algos.agg_loss(..., norm=norm))
#             and the micro-batch losses add up to the mini-batch loss, whatever the micro-batch split
# and returns
#   loss      the scalar to backpropagate
#   parts     {name: scalar tensor}: named terms of the loss, normalised like it; summed over the micro-batches
#             of a mini-batch (the mini-batch's value), logged as actor/<name> (critic/<name>)
#   metrics   {name: float}: diagnostics, averaged over micro-batches (a name ending in _max / _min: their max / min),
#             logged as actor/<name> unless the name has a "/"
Norm = algos.Norm
LossFn = Callable[[DataProto, torch.Tensor, "torch.Tensor | None", Norm], "tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, float]]"]


def resolve_device(name: str = "auto") -> torch.device:
    """'auto' -> cuda if available else cpu; otherwise torch.device(name)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """'auto' -> bfloat16 on GPU, float32 on CPU."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


def flash_attn_problem() -> str | None:
    """None when flash-attn imports with its compiled kernel (what transformers' flash_attention_2 calls), else why not.

    Finding the package is not enough: a wheel built against another torch (common once vLLM pins its own) is found
    but fails to import (undefined symbol), and then every forward pass would crash."""
    if importlib.util.find_spec("flash_attn") is None:
        return "not installed"
    try:
        from flash_attn import flash_attn_varlen_func  # imports flash_attn_2_cuda, the compiled extension
    except Exception as e:  # noqa: BLE001 -- ImportError, OSError (a missing .so), RuntimeError: all mean "unusable"
        return f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else 'no message'}"
    if not callable(flash_attn_varlen_func):
        return "flash_attn.flash_attn_varlen_func is missing"
    return None


def resolve_attn_implementation(name: str, device: torch.device, dtype: torch.dtype = torch.bfloat16) -> str:
    """'auto' -> flash_attention_2 on CUDA with 16-bit compute when flash-attn imports with its kernel (flash_attn_problem),
    else sdpa (with one line saying why when flash-attn is installed but broken); otherwise as given. FlashAttention
    refuses float32 inputs: float32 compute (--model.dtype float32, the Megatron engine's HF generation copy) gets sdpa."""
    if name != "auto":
        return name
    if device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
        return "sdpa"
    why = flash_attn_problem()
    if why is None:
        return "flash_attention_2"
    if why != "not installed":
        warnings.warn(
            f"flash-attn is installed but unusable ({why}); attention sdpa. Reinstall it for this torch, or uninstall it", stacklevel=2
        )
    return "sdpa"


def resolve_gradient_checkpointing(setting, device: torch.device, n_params: int) -> bool:
    """on/off (or True/False) as given; 'auto' -> on for a real model (>= 10M parameters) on a GPU.

    Checkpointing trades a second forward pass per layer in the backward (~30 % slower update) for not keeping
    every layer's activations: on a GPU memory decides, on CPU (tiny models) speed does.
    """
    setting = {True: "on", False: "off"}.get(setting, setting)
    if setting == "auto":
        return device.type == "cuda" and n_params >= 10_000_000
    if setting not in ("on", "off"):
        raise ConfigError(f"--model.gradient-checkpointing {setting!r}: use auto, on or off")
    return setting == "on"


def load_tokenizer(path: str, trust_remote_code: bool = False):
    """AutoTokenizer with left padding and a pad token (falls back to EOS)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    tok.padding_side = "left"
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


VLM_VALUE_MODEL = "a value model on a vision-language model is not supported yet: use a critic-free recipe (grpo, rloo, dapo)"


def load_model(
    path: str,
    dtype: torch.dtype,
    device: torch.device,
    trust_remote_code: bool = False,
    value_head: bool = False,
    attn_implementation: str | None = None,
):
    """AutoModelForCausalLM.from_pretrained with errors that say what to do.

    value_head: AutoModelForTokenClassification with num_labels=1 instead (a critic: one value per position).
    attn_implementation: sdpa, flash_attention_2, eager (None: transformers' default).
    """
    attn = {"attn_implementation": attn_implementation} if attn_implementation else {}
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    local = Path(path).expanduser()
    looks_local = path.startswith((".", "/", "~")) or os.sep in path.strip("/").split("/", 1)[-1]
    if looks_local and not local.exists():
        raise MissingFile(
            f"--model.path {path}: no such folder. Pass a local Hugging Face model folder or a hub id such as Qwen/Qwen2.5-0.5B-Instruct"
        )
    try:
        if value_head:  # the new head is missing from a policy checkpoint, as expected: report only other gaps
            from transformers.utils import logging as hf_logging

            if is_vlm_folder(path, trust_remote_code):  # (transformers has no token-classification class for one)
                raise ConfigError(VLM_VALUE_MODEL)

            level = hf_logging.get_verbosity()
            hf_logging.set_verbosity_error()
            try:
                model, info = AutoModelForTokenClassification.from_pretrained(
                    path, num_labels=1, dtype=dtype, trust_remote_code=trust_remote_code, output_loading_info=True, **attn
                )
            finally:
                hf_logging.set_verbosity(level)
            body = sorted(k for k in info["missing_keys"] if k.split(".")[0] not in ("score", "classifier"))
            if body:
                warnings.warn(
                    f"value model from {path}: {len(body)} weights missing from the checkpoint, freshly initialised: {body[:5]}",
                    stacklevel=2,
                )
        else:
            auto = AutoModelForCausalLM
            if is_vlm_folder(path, trust_remote_code):  # a vision-language model (rlkit/vlm.py): its own auto class
                from transformers import AutoModelForImageTextToText as auto
            model = auto.from_pretrained(path, dtype=dtype, trust_remote_code=trust_remote_code, **attn)
    except ValueError as e:
        if "trust_remote_code" in str(e) and not trust_remote_code:
            raise ConfigError(f"{path} ships its own modelling code; if you trust it, pass --model.trust-remote-code") from e
        raise
    except OSError as e:
        raise RunFailed(
            f"could not load a model from {path!r}: {e}\nPass a local folder with config.json and weights, or a hub id "
            "(downloads need network; set HF_HUB_OFFLINE=1 to use only the local cache)"
        ) from e
    return model.to(device)


def is_vlm_folder(path: str, trust_remote_code: bool = False) -> bool:
    """Whether the model at `path` is a vision-language model (its config has a vision tower)."""
    from transformers import AutoConfig

    from rlkit.vlm import is_vlm

    try:
        return is_vlm(AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code))
    except (OSError, ValueError):  # the model load reports it
        return False


VISION_MODULES = r"(.*\.)?visual(\..*)?"  # Qwen2-VL-style vision towers (model.visual.*)


def add_lora(model, model_cfg, value_head: bool = False, frozen_vision: bool = False):
    """peft's LoRA adapter on `model` (rank, alpha and target modules from model_cfg); a value model's head trains in full;
    frozen_vision: no adapters on a VLM's vision tower (freeze_vision)."""
    from peft import LoraConfig, get_peft_model

    targets = model_cfg.target_modules
    return get_peft_model(
        model,
        LoraConfig(
            r=model_cfg.lora_rank,
            lora_alpha=model_cfg.lora_alpha,
            lora_dropout=0.0,
            task_type="TOKEN_CLS" if value_head else "CAUSAL_LM",  # TOKEN_CLS trains the value head in full
            target_modules=targets if targets == "all-linear" else [t.strip() for t in targets.split(",")],
            # the head gets no adapter; a VLM's vision tower none with --model.freeze-vision-tower
            exclude_modules=["score", "classifier"] if value_head else (VISION_MODULES if frozen_vision else None),
        ),
    )


def freeze_vision(model, model_sys) -> bool:
    """Whether `model` is a vision-language model whose vision tower stays frozen (--model.freeze-vision-tower;
    model_sys: a ModelSystem, or recipes/rm.py's BaseModelSystem, which always freezes it)."""
    from rlkit.vlm import is_vlm

    return is_vlm(model.config) and getattr(model_sys, "freeze_vision_tower", True)


def trim_padding(tensors: dict[str, torch.Tensor], prompt_len: int) -> tuple[dict[str, torch.Tensor], int, int]:
    """Drop prompt columns that are padding in every row and response columns past the longest response.

    Returns (trimmed tensors over the whole sequence, number of prompt columns dropped, response columns kept).
    """
    mask = tensors["attention_mask"]
    first = int((mask[:, :prompt_len].sum(0) > 0).nonzero()[0]) if prompt_len else 0
    resp = mask[:, prompt_len:]
    keep = int((resp.sum(0) > 0).nonzero().max()) + 1 if resp.any() else 1
    end = prompt_len + keep
    return {k: v[:, first:end] for k, v in tensors.items()}, first, keep


@contextmanager
def attention(model, name: str | None):
    """The model's transformers attention implementation set to `name` for the block (None: unchanged)."""
    if name is None:
        yield
        return
    config = model.config
    before = config._attn_implementation
    config._attn_implementation = name
    try:
        yield
    finally:
        config._attn_implementation = before


def attention_width(model) -> int:
    """Query heads x head dim of the model's attention (its config; a VLM's text_config)."""
    c = text_config(model.config)
    return c.num_attention_heads * (getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads)


def accepts_logits_to_keep(model) -> bool:
    """Whether the model's forward computes the LM head on the last N positions only (transformers' `logits_to_keep`)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return "logits_to_keep" in inspect.signature(base.forward).parameters


def vocab_size(model) -> int:
    """The model config's vocabulary size (a VLM's: its text_config's; 0 when it has none)."""
    config = getattr(model, "config", None)
    return int(getattr(text_config(config), "vocab_size", 0) or 0) if config is not None else 0


def all_finite(x: torch.Tensor) -> bool:
    """isfinite(x).all(), agreed over all data-parallel processes: with --actor.nan-policy skip every process
    skips the same step (a process leaving a collective alone would hang the others)."""
    import torch.distributed as dist

    ok = bool(torch.isfinite(x).all())
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        t = torch.tensor([1.0 if ok else 0.0])  # on CPU: the process group serves CPU tensors (gloo) beside NCCL
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        ok = bool(t.item() == 1.0)
    return ok


def agreed_count(n: int) -> int:
    """The largest n over all data-parallel processes (n itself with one process).

    Each process splits its own rows by tokens (--actor.max-token-len-per-micro-batch), so the counts differ; but FSDP
    gathers weights in every forward and backward pass and all_finite is agreed per micro-batch, so a process with
    fewer passes would leave the others waiting in a collective until the timeout. All run the largest count
    instead (packing.split_to_count), as verl does."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        t = torch.tensor([n], dtype=torch.int64)  # on CPU: gloo serves it beside NCCL
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t.item())
    return n


def global_counts(num_tokens: int, num_seqs: int, group=None) -> Norm:
    """The loss normalisers of a mini-batch: its token and sequence counts, over all data-parallel processes.

    With N processes each one's loss is divided by (global count / N): data parallelism (FSDP, DDP)
    averages gradients over processes, so the result is the gradient of the global mini-batch loss,
    whatever the split. One process: the local counts. group: the data-parallel group when it is not the
    world (sequence parallelism: the S ranks of a replica hold the same rows, so they are counted once;
    N is then the replicas, D = world / S, and forward_sp undoes FSDP's extra 1/S).
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        t = torch.tensor([num_tokens, num_seqs], dtype=torch.float64)
        dist.all_reduce(t, group=group)
        n = dist.get_world_size(group)
        return Norm(num_tokens=max(t[0].item(), 1.0) / n, num_seqs=t[1].item() / n, dp_size=n)
    return Norm(num_tokens=max(num_tokens, 1), num_seqs=num_seqs)


def check_grad_clip_value(name: str, value) -> None:
    """One section's grad_clip (None: the section has none); checked by the preflight and by TorchEngine when built directly."""
    if value is not None and not value > 0:  # (also NaN)
        raise ConfigError(
            f"--{name}.grad-clip {value}: must be > 0 (the gradient is scaled to at most this norm: 0 would zero every update, "
            "a negative value reverse it). 1.0 is usual; to clip only rare spikes pass a large value such as 1e6"
        )


class UpdateMetrics:
    """An update's metrics: each name's mean over the times it is added (micro-batches, optimizer steps), a name ending
    in _max / _min its max / min, skipped_steps a count; a name without a "/" gets the role's prefix (actor/...)."""

    def __init__(self, role: str):
        self.role, self.sums, self.counts = role, {}, {}

    def add(self, key: str, value) -> None:
        key = key if "/" in key else f"{self.role}/{key}"
        if key.endswith(("_max", "_min")) and key in self.sums:  # a max (min) over micro-batches and steps stays one
            self.sums[key] = (max if key.endswith("_max") else min)(self.sums[key], float(value))
            return
        self.sums[key] = self.sums.get(key, 0.0) + float(value)
        self.counts[key] = self.counts.get(key, 0) + 1

    def result(self) -> dict:
        count = f"{self.role}/skipped_steps"
        return {k: v / self.counts[k] if k != count else v for k, v in self.sums.items()}


class TorchEngine:
    """A causal LM (or, value_head=True, a value model) on one device with its optimizer; see the module docstring."""

    masters_under_wrap = False  # float32 masters + autocast with a `wrap` too (not FSDP2's: it has its own mixed precision)

    def __init__(
        self,
        model_cfg,
        actor_cfg=None,
        device: str = "auto",
        need_ref: bool | None = None,
        value_head: bool = False,
        wrap: Callable | None = None,
        model_sys=None,
        update_sys=None,
    ):
        """need_ref: keep a reference policy (default: when actor_cfg.use_kl_loss); free with LoRA.

        model_cfg: what to load (path, LoRA); model_sys: how it runs (a config.ModelSystem: dtype, attention, packing,
        checkpointing; default ModelSystem()).
        actor_cfg: the optimizer settings (lr, weight_decay, warmup_steps, grad_clip); None = no training.
        update_sys: the update's system options (a config.UpdateSystem or ActorSystem: the token budget per pass,
        nan_policy, router_replay; a critic's CriticSystem; default UpdateSystem()).
        value_head: a critic, see the module docstring (actor_cfg is then a CriticConfig; no reference).
        wrap: applied to the model (then to the reference copy) before the optimizer is built, e.g. FSDP2
        sharding (rlkit/fsdp_workers.py): how a distributed engine plugs in.
        """
        model_sys = model_sys or ModelSystem()
        update_sys = update_sys or UpdateSystem()
        if actor_cfg is not None:  # before the model loads, as the recipes' preflight does (an engine built directly)
            check_grad_clip_value("critic" if value_head else "actor", actor_cfg.grad_clip)
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(model_sys.dtype, self.device)  # the compute dtype
        self.value_head = value_head
        self.role = "critic" if value_head else "actor"  # metric prefix and flag names in messages
        self.lora = model_cfg.lora_rank > 0
        # full-parameter training in 16 bits: float32 master weights, compute under autocast (module docstring), on one device
        # or behind the Megatron engine's wrap; FSDP (wrap) has its own mixed precision policy, LoRA float32 adapters
        self.master_fp32 = (
            actor_cfg is not None
            and not self.lora
            and (wrap is None or self.masters_under_wrap)
            and self.dtype in (torch.bfloat16, torch.float16)
        )
        self.param_dtype = torch.float32 if self.master_fp32 else self.dtype
        self.attn_implementation = resolve_attn_implementation(model_sys.attn_implementation, self.device, self.dtype)
        # FSDP: load in CPU memory; sharding moves each process's 1/N to its GPU (no full copy, no reference copy on the GPU)
        load_on = torch.device("cpu") if wrap is not None else self.device
        model = load_model(
            model_cfg.path, self.param_dtype, load_on, model_cfg.trust_remote_code, value_head, self.attn_implementation
        )  # first: its errors say what to do
        self.tokenizer = load_tokenizer(model_cfg.path, model_cfg.trust_remote_code)
        self.gradient_checkpointing = resolve_gradient_checkpointing(model_sys.gradient_checkpointing, self.device, num_params(model)[1])
        if self.gradient_checkpointing:  # non-reentrant: gradients reach LoRA adapters behind frozen embeddings
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.model_cfg, self.model_sys, self.update_sys = model_cfg, model_sys, update_sys
        self.ref_model = None
        from rlkit.vlm import is_vlm

        self.vlm = is_vlm(model.config)  # images: padded layout, M-RoPE positions from the model (rlkit/vlm.py)
        if freeze_vision(model, model_sys) and not self.lora:
            for name, param in model.named_parameters():
                if ".visual." in f".{name}":
                    param.requires_grad_(False)
        if self.lora:
            model = add_lora(model, model_cfg, value_head, freeze_vision(model, model_sys))
        elif not value_head and (need_ref if need_ref is not None else (actor_cfg is not None and actor_cfg.use_kl_loss)):
            self.ref_model = copy.deepcopy(model).requires_grad_(False).to(self.dtype)  # frozen: the compute dtype is enough
        self.keep_logits = accepts_logits_to_keep(model)
        # padding-free passes (rlkit/packing.py): sdpa/eager take the 4D block mask (a shared prompt computed once);
        # flash_attention_2 takes packed sequences without a mask (varlen: each response with its own copy of its prompt)
        self.varlen = self.attn_implementation == "flash_attention_2"
        self.remove_padding = model_sys.remove_padding and self.attn_implementation in ("sdpa", "eager", "flash_attention_2")
        self.remove_padding = self.remove_padding and not self.vlm  # packing lays out 1-D positions; M-RoPE needs 3 rows
        self.share_prompt = self.remove_padding and model_sys.share_prompt and not self.varlen
        # the shared prompt's attention per sequence instead of a dense (row length)^2 mask (packing.split_attention); not
        # with gradient checkpointing: its backward recomputes the layers after the pass has put sdpa back (engine.attention)
        self.split_attention = (
            self.share_prompt
            and self.attn_implementation == "sdpa"
            and model_sys.shared_prompt_attention != "mask"
            and not self.gradient_checkpointing
        )
        if self.split_attention:
            packing.register_split_attention()
        if model_sys.remove_padding and not self.remove_padding and not self.vlm:  # a VLM's layout: describe() says it
            warnings.warn(
                f"--model.remove-padding: attention {self.attn_implementation} takes neither a 4D mask nor packed sequences; "
                "passes use the padded layout",
                stacklevel=2,
            )
        # --trainer.sp-size > 1: set by the FSDP workers (forward_sp; global_counts over the replicas). Named apart from
        # MegatronEngine.dp_group, set before this __init__ runs and read by its gradient averaging
        self.sp_group = self.sp_replica_group = None
        self.union_logits_bytes = 2**28  # forward_packed: past this, rows whose read positions differ run one by one
        self.max_tokens = update_sys.max_token_len_per_micro_batch if actor_cfg is not None else 0
        # MoE router replay (docs/moe.md): a batch's routed_experts (B, L, layers, k) is forced in the policy's passes
        self.router_replay = getattr(update_sys, "router_replay", "none") if actor_cfg is not None else "none"
        self.compare_routing = False  # with router_replay none: measure a batch's routing without forcing it (tests)
        self._route = None  # the RouterReplay of the pass now running (_routing), or None
        if wrap is not None:
            model = wrap(model)
            self.ref_model = wrap(self.ref_model) if self.ref_model is not None else None
        self.model = model.eval()
        self.actor_cfg = actor_cfg
        self.optimizer = self.scheduler = None
        if actor_cfg is not None:
            params = [p for p in model.parameters() if p.requires_grad]
            self.optimizer = torch.optim.AdamW(params, lr=actor_cfg.lr, weight_decay=actor_cfg.weight_decay)
            warm = max(actor_cfg.warmup_steps, 0)
            self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: min(1.0, (s + 1) / warm) if warm else 1.0)

    def autocast(self):
        """torch.autocast in the compute dtype when the weights are float32 masters (module docstring); else nothing."""
        return torch.autocast(self.device.type, dtype=self.dtype) if self.master_fp32 else nullcontext()

    def describe(self) -> str:
        """Device, dtypes, attention and checkpointing, for the start-of-run line."""
        params = str(self.param_dtype).removeprefix("torch.")
        compute = str(self.dtype).removeprefix("torch.")
        if self.lora:
            params = f"{params} (LoRA adapters float32)"
        ckpt = "on" if self.gradient_checkpointing else "off"
        attn = self.attn_implementation + (" (varlen packing, prompts not shared)" if self.varlen and self.remove_padding else "")
        if self.vlm:
            attn += " (vision-language: padded layout, no shared-prompt prefill, M-RoPE positions from the model)"
        return f"device {self.device}, params {params}, compute {compute}, attention {attn}, gradient checkpointing {ckpt}"

    # -- forward passes ------------------------------------------------------------------------
    def _reference(self):
        """Context + module that compute the reference policy's log-probs."""
        if self.lora:
            return self.model.disable_adapter(), self.model
        if self.ref_model is None and self.optimizer is not None:  # the policy trains: it is no reference
            raise ConfigError("no reference policy: full-parameter training keeps a frozen copy only with --actor.use-kl-loss")
        return nullcontext(), (self.ref_model if self.ref_model is not None else self.model)

    def micro_batches(self, batch: DataProto, micro_batch_size: int) -> list[DataProto]:
        """`micro_batch_size` rows each, or with --actor.max-token-len-per-micro-batch > 0 consecutive rows costing at most
        that many positions (packed: real tokens only, a shared prompt once; padded: rows x their trimmed width)."""
        if self.max_tokens <= 0:
            return batch.split(micro_batch_size)
        prompt_len = batch["prompts"].shape[1]
        mask, share = batch["attention_mask"], self.share_prompt
        if not self.remove_padding:  # padded: a row costs the longest sequence; approximate it by its own length
            mask = mask.clone()
            mask[:, :prompt_len] = 1
            share = False
        spans = packing.split_by_tokens(batch["input_ids"], mask, prompt_len, share, self.max_tokens)
        count = agreed_count(len(spans))
        if count != len(spans):
            spans = packing.split_to_count(spans, packing.row_costs(batch["input_ids"], mask, prompt_len, share), count)
        return [batch[a:b] for a, b in spans]

    @contextmanager
    def _routing(self, model, mb: DataProto, record: bool = False):
        """Router replay around one micro-batch's passes (docs/moe.md): `record` records the routing of this forward
        (R2's old-log-prob pass); a micro-batch carrying routed_experts is replayed (--actor.router-replay r2/r3) or,
        with compare_routing, only compared. Other engines (a critic, a teacher, a generation-only copy: router_replay
        none) route with their own routers. The forward lays the routing out like the model's input (forward_packed:
        packed rows and shared prompts, packing.pack_like; forward_padded: trimmed columns). In the update the backward
        runs inside too: gradient checkpointing's recompute calls the routers again and must route the same. Yields
        the RouterReplay (None: nothing to do)."""
        carries = "routed_experts" in mb
        mode = (
            "record" if record
            else "replay" if carries and self.router_replay != "none"
            else "compare" if carries and self.compare_routing
            else None
        )  # fmt: skip
        if mode is None:
            yield None
            return
        from rlkit.moe import RouterReplay

        rep = RouterReplay(model, mode, None if record else mb["routed_experts"])
        self._route = rep
        try:
            with rep:
                yield rep
        finally:
            self._route = None

    def _route_input(self, routing: torch.Tensor) -> None:
        """The routing of the model call about to run (its rows and positions: laid out like its input_ids)."""
        if self._route is not None and self._route.mode != "record":
            self._route.routing_in = routing.long()

    def forward(self, model, mb: DataProto, temperature: float, with_entropy: bool):
        """Per-token log-probs (and entropy) of mb['responses'] given the prompts: shapes (b, R).

        A value model returns (values, None) instead: V(s_t) read where the logits predicting y_t are.
        Padding-free (rlkit/packing.py) unless --model.no-remove-padding; 0 past each response.
        """
        if self.sp_group is not None:  # Ulysses sequence parallelism: padded rows, positions split over the group
            return self.forward_sp(model, mb, temperature, with_entropy)
        if self.remove_padding:
            return self.forward_packed(model, mb, temperature, with_entropy)
        return self.forward_padded(model, mb, temperature, with_entropy)

    def forward_packed(self, model, mb: DataProto, temperature: float, with_entropy: bool):
        """forward() in the packed layout: only real tokens, each group's prompt once (rlkit/packing.py).

        The layout's indices are worked out on the host (small (T,) tensors, no device sync); the (rows, C, C) mask
        is built on the device from the segment ids (packing.block_mask); flash_attention_2 gets no mask at all
        (varlen: one row, sequences cut where the position ids restart)."""
        b, resp_len = len(mb), mb["responses"].shape[1]
        p = packing.pack(
            mb["input_ids"].cpu(),
            mb["attention_mask"].cpu(),
            mb["position_ids"].cpu(),
            mb["prompts"].shape[1],
            self.share_prompt,
            one_row=self.varlen,
        )
        dev = self.device
        mask, runs = None, None
        if self.split_attention:  # no mask: the layout goes to packing.split_attention (auto: where it pays)
            runs = packing.spans(p.segment_ids, p.sub_ids, dev)
            if self.model_sys.shared_prompt_attention == "auto" and not packing.split_pays(
                runs, p.input_ids.shape[1], attention_width(model)
            ):
                runs = None
        if runs is None and not self.varlen:
            mask = packing.block_mask(p.segment_ids.to(dev, non_blocking=True), p.sub_ids.to(dev, non_blocking=True))[:, None]
            if self.attn_implementation == "eager":  # eager adds the mask to the scores
                mask = torch.zeros(mask.shape, device=dev).masked_fill(~mask, torch.finfo(torch.float32).min)
        pos = p.read[p.src_k]  # (T,) on the host: the position read for each token
        out_lp = torch.zeros(b, resp_len, device=dev)
        out_ent = torch.zeros(b, resp_len, device=dev) if with_entropy else None
        rows, vocab = p.input_ids.shape[0], 1 if self.value_head else vocab_size(model)
        # the LM head reads the union of the rows' read positions (rows, K, V); when that union wastes much memory
        # (rows x K >> T at a real vocabulary) run the rows one by one, each on its own positions
        one_by_one = rows > 1 and rows * len(p.read) > 2 * len(p.labels) and rows * len(p.read) * vocab * 4 > self.union_logits_bytes
        one_by_one = one_by_one and self._route is None  # router replay: one model call, so a recompute replays its routing
        if self._route is not None:
            self._route_input(packing.pack_like(p, mb["routed_experts"]) if "routed_experts" in mb else None)
        # FSDP: each model call gathers every layer, so every process makes as many calls (agreed_count): its rows in
        # that many consecutive groups, row 0 again where it has fewer rows than calls (same values, written twice)
        calls = agreed_count(rows if one_by_one else 1)
        groups = [(i * rows // calls, (i + 1) * rows // calls) for i in range(calls)]
        for r0, r1 in [(a, b) if b > a else (0, 1) for a, b in groups]:
            sel = (p.src_row >= r0) & (p.src_row < r1)  # (T,) the tokens read in these rows
            read, k = torch.unique(pos[sel], sorted=True, return_inverse=True)  # (K,), (t,)
            row = p.src_row[sel] - r0
            dst = (p.dst_row[sel].to(dev), p.dst_col[sel].to(dev))
            only = {"logits_to_keep": read.to(dev)} if self.keep_logits else {}  # the LM head on the K positions read, not on all C
            split = {"rlkit_spans": packing.Spans(runs.rows[r0:r1], runs.masks)} if runs is not None else {}
            with self.autocast(), attention(model, packing.SPLIT_ATTENTION if split else None):
                out = model(
                    input_ids=p.input_ids[r0:r1].to(dev),
                    attention_mask=None if mask is None else mask[r0:r1],
                    position_ids=p.position_ids[r0:r1].to(dev),
                    use_cache=False,
                    **only,
                    **split,
                ).logits  # (rows, K, V)
            if not self.keep_logits:
                out = out[:, read.to(dev)]
            if self._route is not None and self._route.mode == "record":  # the packed rows' routing back in the batch's layout
                self._route.recorded = packing.unpack_like(p, self._route.routing())
            if self.value_head:
                out_lp[dst] = out[row.to(dev), k.to(dev), 0].float()
                continue
            # one log-sum-exp per position read, chunked (algos.token_logprob_entropy): the prompt's last position serves n tokens
            at = (row * out.shape[1] + k).to(dev)  # (t,) flat index into the (rows * K) positions
            lp, ent = algos.token_logprob_entropy(out.reshape(-1, out.shape[-1]), at, p.labels[sel].to(dev), temperature, with_entropy)
            out_lp[dst] = lp.float()
            if with_entropy:
                out_ent[dst] = ent[at].float()
        return out_lp, (None if self.value_head else out_ent)

    def forward_padded(self, model, mb: DataProto, temperature: float, with_entropy: bool):
        """forward() on the rollout's padded rows (prompt columns that are padding everywhere trimmed)."""
        prompt_len = mb["prompts"].shape[1]
        resp_len = mb["responses"].shape[1]
        t, first, keep = trim_padding({k: mb[k].to(self.device) for k in ("input_ids", "attention_mask", "position_ids")}, prompt_len)
        # the LM head only where it is read (the last keep+1 positions), not over the prompt: (b, keep+1, V), not (b, L, V)
        only = {"logits_to_keep": keep + 1} if self.keep_logits else {}
        if self.vlm:  # the rows' own images; no position ids: the model computes its 3-row M-RoPE ones (rlkit/vlm.py)
            from rlkit import vlm

            only.update(vlm.model_inputs(mb, t["input_ids"], model.config, self.device))
            t.pop("position_ids")
        if self._route is not None and "routed_experts" in mb:
            self._route_input(mb["routed_experts"][:, first : first + t["input_ids"].shape[1]])  # the columns kept
        with self.autocast():
            out = model(**t, use_cache=False, **only).logits
        if self._route is not None and self._route.mode == "record":  # (b, L, layers, k): -1 at padding
            got = self._route.routing()
            rec = got.new_full((len(mb), mb["input_ids"].shape[1], *got.shape[2:]), -1)
            rec[:, first : first + got.shape[1]] = got
            self._route.recorded = rec.masked_fill(~mb["attention_mask"].bool()[:, :, None, None], -1)
        if self.value_head:
            values = torch.zeros(len(mb), resp_len, device=self.device)
            values[:, :keep] = out[:, -keep - 1 : -1, 0].float()  # position t-1 values state y_<t
            return values, None
        out = out[:, -keep - 1 :]  # (b, keep+1, V): position t-1 predicts y_t; the last one predicts nothing
        b, width = out.shape[0], out.shape[1]
        at = (torch.arange(b, device=self.device)[:, None] * width + torch.arange(keep, device=self.device)).reshape(-1)  # (b*keep,)
        labels = mb["responses"][:, :keep].to(self.device).reshape(-1)
        flat = out.reshape(-1, out.shape[-1])  # (b*(keep+1), V): a view when the model computed only these positions
        lp, ent = algos.token_logprob_entropy(flat, at, labels, temperature, with_entropy)
        logp = torch.zeros(len(mb), resp_len, device=self.device)
        logp[:, :keep] = lp.float().view(b, keep)
        if not with_entropy:
            return logp, None
        out_ent = torch.zeros(len(mb), resp_len, device=self.device)
        out_ent[:, :keep] = ent.float().view(b, width)[:, :keep]
        return logp, out_ent

    def forward_sp(self, model, mb: DataProto, temperature: float, with_entropy: bool):
        """forward() with the sequence split over self.sp_group (--trainer.sp-size, rlkit/ulysses.py): equal to
        forward_padded's (tests/test_ulysses_ray.py). Every rank of the group holds the same rows (ray_group's split_dp).
        The rollout's rows are left-padded and ulysses attention takes no mask: each row is shifted left
        (ulysses.shift_left), run through sp_token_logprobs, and its response read at its own offset. The outputs'
        gradient is multiplied by S: FSDP averages over all N = D S ranks, but the S ranks of a replica hold one
        replica's gradient between them (their sum), so the plain average would be 1/S of the data-parallel one;
        global_counts over the dp group divides by D to match."""
        import torch.distributed as dist

        from rlkit import ulysses

        group, dev = self.sp_group, self.device
        prompt_len, resp_len = mb["prompts"].shape[1], mb["responses"].shape[1]
        t, first, keep = trim_padding({k: mb[k].to(dev) for k in ("input_ids", "attention_mask", "position_ids")}, prompt_len)
        ids, pos, lead = ulysses.shift_left(t["input_ids"], t["attention_mask"], t["position_ids"])
        with self.autocast():
            lp, ent = ulysses.sp_token_logprobs(model, ids, group, temperature, with_entropy, position_ids=pos)  # (b, T-1)
        # response token k sits at column (prompt_len - first) + k - lead of the shifted row; the position before predicts it
        at = (prompt_len - first - lead - 1)[:, None] + torch.arange(keep, device=dev)
        s, b = dist.get_world_size(group), len(mb)
        logp = torch.zeros(b, resp_len, device=dev)
        logp[:, :keep] = ulysses.ScaleGrad.apply(lp.gather(1, at).float(), s)
        if not with_entropy:
            return logp, None
        out_ent = torch.zeros(b, resp_len, device=dev)
        out_ent[:, :keep] = ulysses.ScaleGrad.apply(ent.gather(1, at).float(), s)
        return logp, out_ent

    @torch.no_grad()
    def compute_log_prob(
        self,
        batch: DataProto,
        temperature: float,
        micro_batch_size: int,
        ref: bool = False,
        with_entropy: bool = False,
        record_routing: bool = False,
    ):
        """Log-probs of the current (or, with ref=True, the reference) policy, without gradients.

        MoE router replay (docs/moe.md): a batch carrying routed_experts is replayed in the policy's pass (R3: the
        rollout's routing); the reference routes with its own routers (it is another network: its KL term compares it
        as it is). record_routing (R2): also return the routing of this pass, (B, L, layers, k) int16, -1 = no token."""
        ctx, model = self._reference() if ref else (nullcontext(), self.model)
        out_lp, out_ent, routing = [], [], []
        with ctx:
            for mb in self.micro_batches(batch, micro_batch_size):
                if ref:  # the reference's own routing
                    mb = mb.select([k for k in mb.tensors if k != "routed_experts"])
                with self._routing(model, mb, record=record_routing) as rep:
                    lp, ent = self.forward(model, mb, temperature, with_entropy)
                if record_routing:
                    routing.append(rep.recorded.to(torch.int16))
                out_lp.append(lp.cpu())
                if with_entropy:
                    out_ent.append(ent.cpu())
        out = torch.cat(out_lp), (torch.cat(out_ent) if with_entropy else None)
        return (*out, torch.cat(routing)) if record_routing else out

    def compute_values(self, batch: DataProto, micro_batch_size: int) -> torch.Tensor:
        """A value model's V(s_t) at every response position, (B, R), without gradients; 0 past each response's end."""
        return self.compute_log_prob(batch, 1.0, micro_batch_size)[0] * batch["response_mask"]

    # -- the update ----------------------------------------------------------------------------
    @contextmanager
    def _checkpointing(self):
        """Hugging Face checkpoints a layer's activations only in training mode: put just the checkpointed
        modules in it for the update; their attention/dropout submodules stay in eval mode (Llama, Qwen, ...)."""
        flagged = [m for m in self.model.modules() if getattr(m, "gradient_checkpointing", False)]
        for m in flagged:
            m.training = True
        try:
            yield
        finally:
            for m in flagged:
                m.training = False

    def update(
        self,
        batch: DataProto,
        loss_fn: LossFn,
        mini_batch_size: int,
        micro_batch_size: int,
        epochs: int = 1,
        temperature: float = 1.0,
        shuffle_seed: int | None = None,
    ) -> dict:
        """ppo_epochs × mini-batches of `mini_batch_size` trajectories, each accumulated over micro-batches:

            for epoch in range(epochs):
                for mini in batch.split(mini_batch_size):             # one optimizer step each
                    zero_grad()
                    for micro in mini.split(micro_batch_size):       # memory only: the same gradient
                        loss_fn(micro, log_prob, entropy, norm).backward()   # norm: the mini-batch's counts
                    clip_grad_norm(grad_clip); optimizer.step()

        loss_fn follows the contract above (LossFn). A non-finite loss or gradient norm stops the run before
        the step (NonFinite), or with nan_policy skip skips that step (counted, actor/skipped_steps). Returns
        metrics averaged over optimizer steps, each prefixed with the role (actor/..., critic/... for a value
        model): loss, grad_norm (before clipping), lr, the loss's parts (summed over the micro-batches of a
        mini-batch, so they do not depend on the micro-batch size) and its metrics (averaged).
        """
        # One optimizer step on a batch without old log-probs: pi_old = pi, so log pi_old is this step's own
        # log-probs, detached (rho = 1, the gradient unchanged), and needs no pass of its own.
        reuse_old = not self.value_head and "old_log_probs" not in batch
        if reuse_old and (epochs != 1 or len(batch) > mini_batch_size):
            raise ValueError(
                "the batch has no old_log_probs, but its update takes more than one optimizer step "
                "(ppo_epochs > 1 or several mini-batches): compute them with policy.compute_log_prob first"
            )
        log = UpdateMetrics(self.role)
        self._moe_counts = None  # router replay's per-layer counts over the update's forwards (_count_routing)
        with self._checkpointing():
            for epoch in range(epochs):
                data = batch.shuffled(shuffle_seed + epoch) if shuffle_seed is not None else batch
                for mini in data.split(mini_batch_size):  # one optimizer step per mini-batch
                    self.optimizer.zero_grad(set_to_none=True)
                    summed = self._backward(mini, loss_fn, micro_batch_size, temperature, reuse_old, log)
                    if summed is not None:  # None: a non-finite loss, the step skipped
                        self._step(*summed, log)
        self.optimizer.zero_grad(set_to_none=True)
        return log.result() | self._routing_metrics()

    def _count_routing(self, rep) -> None:
        """Add one micro-batch's router replay counts (recorded tokens, those routed otherwise, those whose router drifted)."""
        counts = torch.stack([rep.counted, rep.used, rep.drifted])  # (3, layers)
        self._moe_counts = counts if self._moe_counts is None else self._moe_counts + counts

    def _routing_metrics(self) -> dict:
        """moe/disagreement/layer_<i>: the share of recorded tokens the update's forwards routed through other experts
        than the record (0 under replay); moe/drift/layer_<i>: the share whose router's own top-k differs from the record
        (what replay overrides: R3, rollout vs trainer and the update's own steps; R2, the update's steps); moe/disagreement
        and moe/drift: their means over the layers. Counted over every forward of the update (micro-batches, epochs)."""
        if self._moe_counts is None:
            return {}
        counted, used, drifted = self._moe_counts
        dis, drift = used / counted.clamp(min=1), drifted / counted.clamp(min=1)
        out = {"moe/disagreement": dis.mean().item(), "moe/drift": drift.mean().item()}
        for i in range(len(counted)):
            out[f"moe/disagreement/layer_{i}"] = dis[i].item()
            out[f"moe/drift/layer_{i}"] = drift[i].item()
        return out

    def _backward(self, mini: DataProto, loss_fn: LossFn, micro_batch_size: int, temperature: float, reuse_old: bool, log):
        """loss -> backward on each micro-batch of a mini-batch, the gradients accumulating. Returns the mini-batch's
        loss and loss parts (each summed over the micro-batches), or None after a non-finite loss (nan_policy skip)."""
        with_entropy = bool(getattr(loss_fn, "needs_entropy", False))  # (an attribute of the loss, not a config field)
        norm = global_counts(int(mini["response_mask"].sum()), len(mini), self.sp_replica_group)  # the mini-batch's, whatever the split
        total, part_sums = 0.0, {}
        for mb in self.micro_batches(mini, micro_batch_size):
            with self._routing(self.model, mb) as rep:  # router replay: forward and backward (checkpointing's recompute)
                logp, ent = self.forward(self.model, mb, temperature, with_entropy or ("metric" if reuse_old else False))
                mb = mb.to(self.device)
                if reuse_old:  # the old log-probs and the entropy metric, from this very pass
                    mb["old_log_probs"] = logp.detach()
                    log.add("entropy", algos.masked_mean(ent.detach(), mb["response_mask"]).item())
                loss, parts, metrics = loss_fn(mb, logp, ent if with_entropy else None, norm)
                if not self._finite(loss, "loss", log):
                    return None
                loss.backward()
            if rep is not None:
                self._count_routing(rep)
            total += loss.item()
            for k, v in parts.items():
                part_sums[k] = part_sums.get(k, 0.0) + float(v.detach())
            for k, v in metrics.items():
                log.add(k, v)
        return total, part_sums

    def _step(self, total: float, part_sums: dict, log) -> None:
        """Clip the accumulated gradient's global norm and take the optimizer (and scheduler) step; a non-finite norm
        skips it (nan_policy skip)."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        grad_norm = self.clip_grad_norm(params, self.actor_cfg.grad_clip)  # the norm before clipping
        if not self._finite(grad_norm, "gradient norm", log):
            self.optimizer.zero_grad(set_to_none=True)
            return
        log.add("lr", self.optimizer.param_groups[0]["lr"])
        self.optimizer.step()
        self.scheduler.step()
        self.skips_in_a_row = 0
        log.add("loss", total)
        for k, v in part_sums.items():
            log.add(k, v)
        log.add("grad_norm", grad_norm.item())

    def _finite(self, x: torch.Tensor, what: str, log) -> bool:
        """Whether x (a loss, a gradient norm) is finite on every process; if not, with nan_policy skip count a
        skipped step (too many in a row stop the run), else stop with NonFinite before any weight changes."""
        if all_finite(x):
            return True
        role = self.role
        if self.update_sys.nan_policy != "skip":
            value, rewards = (f" ({x.item()})", ", check rewards for NaN/inf,") if what == "loss" else ("", "")
            raise NonFinite(
                f"non-finite {what}{value} in the {role} update; no step was taken and no checkpoint written. "
                f"Lower --{role}.lr{rewards} or pass --{role}.nan-policy skip"
            )
        log.add("skipped_steps", 1)
        self.skips_in_a_row = getattr(self, "skips_in_a_row", 0) + 1
        limit = self.update_sys.max_skipped_steps
        if limit and self.skips_in_a_row >= limit:
            raise NonFinite(
                f"{self.skips_in_a_row} optimizer steps in a row skipped for a non-finite {what} in the {role} update "
                f"(--{role}.max-skipped-steps {limit}): the run no longer trains. Lower --{role}.lr, check rewards for NaN/inf, "
                f"or resume from an earlier checkpoint"
            )
        return False

    def clip_grad_norm(self, params: list, max_norm: float) -> torch.Tensor:
        """Clip the gradients to a total norm of max_norm; returns the norm before clipping (a distributed engine
        overrides it: rlkit/megatron_workers.py)."""
        return torch.nn.utils.clip_grad_norm_(params, max_norm)

    # -- state ---------------------------------------------------------------------------------
    def save_pretrained(self, path: str | Path) -> None:
        """A Hugging Face folder that `from_pretrained` loads; LoRA is merged into the weights: layer by layer in float32,
        each weight cast once to the base's dtype and moved to the CPU (vllm_rollout.hf_weights), with no second copy of
        the model on the device (a value model's head, kept by peft's modules_to_save, is merged by a copy of the model)."""
        model = self.model
        if self.lora and not any("modules_to_save" in k for k in model.state_dict()):
            from rlkit.vllm_rollout import hf_name, hf_weights

            base = model.get_base_model()
            dtypes = {hf_name(k): v.dtype for k, v in base.state_dict().items()}
            state = {k: v.detach().to(dtypes[k]).cpu() for k, v in hf_weights(model)}
            base.save_pretrained(path, state_dict=state)
        elif self.lora:
            model = copy.deepcopy(model).merge_and_unload()
            model.save_pretrained(path)
        elif self.master_fp32:  # exported in the compute dtype, as the FSDP workers do
            stored, model.config.dtype = model.config.dtype, self.dtype
            try:
                model.save_pretrained(path, state_dict={k: v.to(self.dtype) for k, v in model.state_dict().items()})
            finally:
                model.config.dtype = stored
        else:
            model.save_pretrained(path)
        self.tokenizer.save_pretrained(path)
        if self.vlm:  # the processor too: AutoProcessor.from_pretrained(path) renders images for the export
            from rlkit.vlm import load_processor, save_processor

            save_processor(load_processor(self.model_cfg.path, self.model_cfg.trust_remote_code), path)

    def in_checkpoint(self, key: str) -> bool:
        """Whether a weight is saved for resumption: all of them, or with LoRA the adapter plus a value model's
        head (peft keeps it in "modules_to_save"); the frozen base comes from --model.path."""
        return not self.lora or "lora_" in key or "modules_to_save" in key

    def state_dict(self) -> dict:
        """Trainable weights (+ optimizer and scheduler) for exact resumption."""
        weights = {k: v for k, v in self.model.state_dict().items() if self.in_checkpoint(k)}
        return {"model": weights, "optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        missing = self.model.load_state_dict(state["model"], strict=False)
        if self.lora and missing.unexpected_keys:
            raise ConfigError(f"checkpoint does not match this model: unexpected keys {missing.unexpected_keys[:5]}")
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])


def auto_micro_batch(requested: int, model, small: int | None, large: int) -> int | None:
    """`requested`, or when it is 0: `small` rows for a tiny model (< 10M parameters), else `large` (None: no split)."""
    return requested or (small if num_params(model)[1] < 10_000_000 else large)


def num_params(model) -> tuple[int, int]:
    """(trainable, total) parameter counts."""
    total = sum(p.numel() for p in model.parameters())
    return sum(p.numel() for p in model.parameters() if p.requires_grad), total


def pack_weights(named) -> tuple[torch.Tensor, list[tuple[str, tuple, int]]]:
    """[(name, tensor)] -> one flat float32 tensor in ordinary host memory, and its (name, shape, offset) layout: weights in
    one piece for another process (the Ray async generation actors: ray.put copies it into the object store, so no
    /dev/shm segment is needed, which containers often cap at 64 MB)."""
    named = list(named)
    flat = torch.cat([t.detach().reshape(-1).float().cpu() for _, t in named])
    layout, offset = [], 0
    for name, t in named:
        layout.append((name, tuple(t.shape), offset))
        offset += t.numel()
    return flat, layout


@torch.no_grad()
def unpack_weights(model, flat: torch.Tensor, layout) -> None:
    """Copy a pack_weights buffer into the model's parameters of the same names."""
    params = dict(model.named_parameters())
    for name, shape, offset in layout:
        p = params[name]
        p.copy_(flat[offset : offset + p.numel()].view(shape))


def set_threads(num_threads: int = 0) -> int:
    """torch CPU threads: 0 = 1 on small machines (≤ 4 cores), where 2 threads often run slower, else torch's default."""
    if num_threads <= 0:
        num_threads = 1 if (os.cpu_count() or 1) <= 4 else torch.get_num_threads()
    torch.set_num_threads(num_threads)
    return num_threads
