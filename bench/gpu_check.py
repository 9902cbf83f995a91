"""One command that checks rlkit's CUDA path on a GPU, and with --dry the same code paths on CPU (CI runs that).

    python bench/gpu_check.py                    # one or more GPUs: a random-weight Qwen2-0.5B-shaped model, 512 + 512 tokens
    python bench/gpu_check.py --dry              # CPU (the default when CUDA is missing): the embedded model's size, short lengths
    python bench/gpu_check.py --skip ray,vllm    # leave parts out (CI's dry test does: they cost minutes on 2 cores)

No network and no download: the model is built from a config with random weights and the embedded model's
tokenizer, and neither has an EOS token (nor its generation config), so every response runs to the length cap: memory and speed are measured at the full 512 + 512 tokens. Rewards come from a small scoring
function written beside it (random tokens score unevenly), so GRPO's advantages and gradients are not zero.

What it checks, each a row of the PASS/FAIL table (each row in a subprocess of its own on a GPU, killed and
reported FAIL "timeout" past --timeout seconds, so a hung collective does not stop the check; in-process with a
SIGALRM timeout in --dry):

  env            CUDA works and supports bf16 (GPU); versions
  grpo-full      recipes/grpo.py, full parameters, bf16 compute over float32 masters (--dry too: CPU autocast),
                 --actor.ppo-mini-batch-size below the batch (old log-probs with entropy, two optimizer steps per
                 step), an entropy bonus: the start-of-run line and what the update's linear layers computed with
                 (float32 weights, bf16 outputs); full-length responses; finite, nonzero losses and gradients; on a GPU, with 24 GB emulated (torch.cuda.set_per_process_memory_fraction): the peak of
                 each phase against bench/gpu_memory.py's prediction (+-15 %); rollout tokens/s; update MFU
  grpo-lora      the same with LoRA rank 16 (float32 adapters on a bf16 base)
  checkpointing  one forward/backward with gradient checkpointing on and off: equal loss and gradients, each layer's
                 forward recomputed in the backward, less memory (GPU)
  logits-memory  a real vocabulary (V = 151,936, tiny body): the update pass (entropy in the loss) and the log-prob pass
                 peak as bench/gpu_memory.py predicts (+-30 %); bf16 over float32 masters (CPU autocast in --dry)
  bf16-learning  (GPU) weights move under bf16 compute as in float32 (5 AdamW steps), and a learnable toy reward rises
                 within 50 GRPO steps in bf16
  critic         recipes/ppo.py: the value model trains beside the policy (finite critic loss and gradients)
  moe-replay     the embedded MoE with --actor.router-replay r3 in bf16: every update forward dispatches the rollout's
                 recorded experts (disagreement 0); the routers' drift from them and the rollout-vs-trainer KL reported
  token-budget   --actor.max-token-len-per-micro-batch on a model whose EOS is sampled (unequal lengths, so ranks split
                 into unequal counts): every micro-batch within the budget (one rank); on 2+ GPUs under FSDP with 2
                 ranks, where unequal counts used to hang
  flash-attn     (GPU) flash_attention_2 and sdpa give the same log-probs (bf16 tolerance); SKIP when not installed
  ray            --trainer.backend ray --trainer.n-workers 1 (2 with two GPUs): two steps with a checkpoint each,
                 a resumed third step whose weights are an uninterrupted run's, the Hugging Face exports loaded back
  ray-vllm       (GPU, vLLM) Ray + vLLM with LoRA at lr 1e-3, the adapter sync and the merged sync: after two updates
                 vLLM's log-probs are within 1/5 of the trainer's distance to the base model
  async          --trainer.async-steps 1, three steps: staleness 0, 1, 1; the log-prob gap of the generation
                 process and the trainer on equal weights; the step time and the trainer's wait
  async-vllm     (GPU, vLLM) the same with vLLM in the worker; the whole GPU's use (torch.cuda.mem_get_info, both
                 processes) against bench/gpu_memory.py's async + vLLM prediction
  vllm           where vLLM is installed: its log-probs agree with the trainer's before and after an update that moved
                 the trainer's 5x more (the weight sync); on a GPU the free memory (mem_get_info) before and after vLLM sleeps
  tools          where vLLM is installed: recipes/grpo_tools.py (multi-turn) with vLLM + LoRA at lr 1e-3: the
                 trainer-vs-rollout gap within 1/5 of the trainer-vs-base gap (not in --loan)
  megatron       (GPU) --trainer.engine megatron, --trainer.tp-size 2 on 2+ GPUs, 1 on one: two steps, finite losses
  vlm            the shipped tiny Qwen2-VL, HF rollout, step-0 validation: generation sized from its text_config (N1)
  sft            recipes/sft.py: float32 weights, bf16 compute, a pass per micro-batch; on a GPU the update's peak
  rm             recipes/rm.py, its default 64 pairs: bf16 compute, a micro-batch of pairs a forward (N9); on a GPU, 24 GB
                 emulated, the peak against the memory model
  judge          rlkit.judge.Judge (p_yes), 32 prompts of ~1k tokens: the LM head on the last position only (N10)
  ulysses        --trainer.sp-size 2: the engine's sequence-parallel pass on 2 processes (gloo, CPU: NCCL with 2 ranks needs
                 2 GPUs) equals its padded pass on left-padded rows: log-probs, the gradients FSDP would average

--skip takes words: a row is left out when any dash-separated part of its name is listed (--skip ray,vllm leaves
out ray, ray-vllm, async-vllm and vllm; tools too: NEEDS).

MFU counts the FLOPs the update computes: 2 x (linear weights) per position computed -- each group's shared
prompt once plus every response token, as the packed layout runs them -- plus 2 x hidden x V per position the LM
head reads (the response positions), x3 for forward + backward (LoRA: x2, no weight gradients), +1 forward with
gradient checkpointing; the embedding is a lookup, not a matmul. Attention's own FLOPs are left out (a lower bound).
Exit status 1 on any FAIL.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(1, str(ROOT))  # rlkit from this checkout: on a loaned GPU machine it is not installed

from common import load_recipe, quiet, set_threads  # noqa: E402

# dense bf16 tensor-core peaks (FLOP/s), by a substring of torch.cuda.get_device_name(); first match wins
BF16_PEAK = [
    ("H100 PCIe", 756e12),
    ("H100", 989e12),
    ("H200", 989e12),
    ("GH200", 989e12),
    ("A100", 312e12),
    ("L40S", 362e12),
    ("L4", 121e12),
    ("A10", 125e12),
    ("RTX 4090", 165e12),
    ("RTX A6000", 155e12),
    ("A6000", 155e12),
]

REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """Random tokens score unevenly: GRPO gets advantages that are not zero."""
    return (sum(map(ord, solution_str)) % 7) / 6


def learnable(data_source, solution_str, ground_truth, extra_info=None):
    """A reward a policy can learn: the share of characters in the first half of the alphabet."""
    return sum(c in "abcdefghijklm" for c in solution_str) / max(len(solution_str), 1)
'''
# --loan: the rows that need neither vLLM nor Ray, each with its limit (seconds) on one GPU; they sum to <= 8 min with
# the set-up (building the 0.5B-shaped model), so a 15-minute loan (start-up included) holds the run and a rerun of
# what failed (--rows). In --dry the same limits hold on a 2-core CPU.
LOAN = {
    "setup": 30,  # the H200 run of 2026-11-27 (docs/gpu-runs/): 29 s
    "env": 15,  # 12 s
    "grpo-full": 85,  # one step: ~20 s to start and load, 49 s a step (42 s of it HF generation), the checkpoint
    "grpo-lora": 45,
    "checkpointing": 30,
    "logits-memory": 25,  # its result came at ~20 s
    "bf16-learning": 35,  # 28 s
    "critic": 35,
    "token-budget": 30,
    "flash-attn": 10,
    "async": 40,
    "vlm": 25,  # 18 s
    "sft": 25,  # 13 s
    "rm": 25,
    "judge": 20,  # 13 s
}
LOAN_PACKAGES = (
    "torch, transformers, peft, pyarrow, pandas, safetensors (preinstalled) + tyro and datasets with their missing dependencies (wheels)"
)
EOS_SCALE = 5  # make_model(eos=True): responses of 64 tokens then end anywhere from a few tokens to the cap
ROW_TIMEOUT = {
    "env": 120,
    "bf16-learning": 1200,
    "megatron": 900,
    "ray": 900,
    "ray-vllm": 1200,
    "async-vllm": 900,
    "vllm": 900,
    "tools": 900,
}


def update_flops(shape: dict, prompts: int, n: int, prompt: int, response: int, lora: bool, checkpointing: bool) -> float:
    """FLOPs one update pass computes over a batch of `prompts` groups of `n` responses (module docstring): the linear
    layers on each shared prompt once and on every response token, the LM head on the response positions only, the
    embedding not at all; backward 2x forward (LoRA: 1x, activations only), +1 forward with checkpointing."""
    h, inter, layers = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    kv = h // shape["num_attention_heads"] * shape["num_key_value_heads"]
    per_layer = h * (h + 2 * kv) + h * h + 3 * h * inter  # q, k, v, o and the gated MLP's weights
    positions = prompts * prompt + prompts * n * response  # packed: each prompt once
    forward = 2 * layers * per_layer * positions + 2 * h * shape["vocab_size"] * prompts * n * response
    return forward * ((2 if lora else 3) + (1 if checkpointing else 0))


def sizes(dry: bool) -> dict:
    """The model and batch shapes: Qwen2-0.5B-shaped on GPU, the embedded model's size on CPU."""
    if dry:
        model = dict(
            hidden_size=128, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, vocab_size=275
        )
        return dict(model=model, prompt=48, response=16, prompts=4, n=4, mini=2, micro=8)
    model = dict(
        hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, vocab_size=151936
    )
    return dict(model=model, prompt=512, response=512, prompts=8, n=8, mini=4, micro=8)


def make_model(folder: Path, shape: dict, eos: bool = False) -> str:
    """A random-weight Qwen2 causal LM + the embedded tokenizer, without any EOS token: responses never stop early.
    eos: with the tokenizer's EOS, its embedding row scaled up so that it is sampled now and then (responses of unequal
    lengths; the vocabulary must hold it, as the embedded tokenizer's 275 tokens do)."""
    import torch
    from transformers import AutoTokenizer, GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    from rlkit import demos

    if (folder / "config.json").exists():
        return str(folder)
    tok = AutoTokenizer.from_pretrained(demos.ARITH_MODEL)
    if not eos:
        tok.eos_token = None  # never stop: every response is full length
    eos_id = tok.eos_token_id if eos else None
    config = Qwen2Config(
        **shape, max_position_embeddings=4096, tie_word_embeddings=True, rope_theta=1e6, pad_token_id=tok.pad_token_id, eos_token_id=eos_id
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    if eos:
        with torch.no_grad():
            model.get_input_embeddings().weight[eos_id] *= EOS_SCALE
    model.generation_config = GenerationConfig(eos_token_id=eos_id, pad_token_id=tok.pad_token_id)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return str(folder)


def make_data(folder: Path, prompt_tokens: int) -> str:
    """The embedded arithmetic prompts, each padded with filler text to about `prompt_tokens` tokens (1 char ~ 1 token)."""
    import pandas as pd

    from rlkit import demos

    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "train.parquet"
    if not path.exists():
        df = pd.read_parquet(demos.ARITH_DATA / "train.parquet").head(64)
        filler = ("Think step by step. " * 64)[: max(prompt_tokens - 40, 0)]
        df["prompt"] = [[{"role": "user", "content": filler + m[0]["content"]}] for m in df["prompt"]]
        df.to_parquet(path)
    return str(path)


@contextlib.contextmanager
def module_calls(*kinds: str):
    """Every call with gradients on, in this process, of a module whose class name ends with one of `kinds`, inside the
    block: what a recipe's passes really computed. dict(kind, rows, tokens: of its input; weight, trainable: its
    weight's dtype and requires_grad; out: its output's dtype). Ray workers and the async generation process are not seen."""
    import torch

    calls = []

    def hook(module, args, kwargs, output):
        kind = type(module).__name__
        if not kind.endswith(kinds) or not torch.is_grad_enabled():
            return
        x = next((t for t in (*args, *kwargs.values()) if torch.is_tensor(t)), None)
        w = getattr(module, "weight", None)
        out = output if torch.is_tensor(output) else getattr(output, "logits", None)
        calls.append(
            dict(
                kind=kind,
                rows=x.shape[0] if x is not None else 0,
                tokens=x.shape[:2].numel() if x is not None else 0,
                weight=w.dtype if torch.is_tensor(w) else None,
                trainable=torch.is_tensor(w) and w.requires_grad,
                out=out.dtype if torch.is_tensor(out) else None,
            )
        )

    handle = torch.nn.modules.module.register_module_forward_hook(hook, with_kwargs=True)
    try:
        yield calls
    finally:
        handle.remove()


@contextlib.contextmanager
def update_micro_batches():
    """[packed positions] (responses + each group's prompt once: what the token budget counts) of every micro-batch that
    TorchEngine.micro_batches makes for an update (gradients on) in this process inside the block."""
    import torch

    from rlkit import packing
    from rlkit.engine import TorchEngine

    split, costs = TorchEngine.micro_batches, []

    def recorded(self, batch, micro_batch_size):
        out = split(self, batch, micro_batch_size)
        if torch.is_grad_enabled():
            width = batch["prompts"].shape[1]
            for mb in out:
                costs.append(packing.span_cost(packing.row_costs(mb["input_ids"], mb["attention_mask"], width, True), 0, len(mb)))
        return out

    TorchEngine.micro_batches = recorded
    try:
        yield costs
    finally:
        TorchEngine.micro_batches = split


def count_forwards(model, kind: str) -> list[int]:
    """[calls] of the forward of the model's modules whose class name ends with `kind`, recomputations in the backward
    included (module hooks do not see those): each forward wrapped as an instance attribute."""
    n = [0]

    def counted(*args, _forward, **kwargs):
        n[0] += 1
        return _forward(*args, **kwargs)

    for m in model.modules():
        if type(m).__name__.endswith(kind):
            m.forward = functools.partial(counted, _forward=m.forward)
    return n


def dtypes(calls: list[dict], trainable: bool, key: str = "weight") -> set[str]:
    """The dtypes (weights' or outputs') of the recorded Linear calls with trainable (or frozen) weights."""
    return {str(c[key]).removeprefix("torch.") for c in calls if c["kind"] == "Linear" and c["trainable"] == trainable}


class Check:
    """The table: name, PASS/FAIL/SKIP, what was seen."""

    def __init__(self):
        self.rows: list[tuple[str, str, str]] = []

    def run(self, name: str, fn, *args):
        start = time.perf_counter()
        print(f"[gpu_check] {name} ...", flush=True)
        try:
            detail = fn(*args)
            status = "PASS"
        except SkipCheck as e:
            status, detail = "SKIP", str(e)
        except Exception as e:  # a check that fails reports and the others still run
            traceback.print_exc()
            status, detail = "FAIL", f"{type(e).__name__}: {e}".splitlines()[0][:300]
        self.rows.append((name, status, f"{detail} ({time.perf_counter() - start:.0f} s)"))
        print(f"[gpu_check] {name}: {status} {detail}", flush=True)

    def table(self) -> str:
        w = max(len(r[0]) for r in self.rows)
        lines = [f"{'check'.ljust(w)}  PASS/FAIL  detail", "-" * (w + 60)]
        lines += [f"{n.ljust(w)}  {s.ljust(9)}  {d}" for n, s, d in self.rows]
        failed = any(s == "FAIL" for _, s, _ in self.rows)
        return "\n".join(lines + [f"RESULT: {'FAIL' if failed else 'PASS'}"])


class SkipCheck(Exception):
    pass


def expect(cond: bool, what: str) -> None:
    if not cond:
        raise AssertionError(what)


def bf16_peak() -> tuple[str, float | None]:
    import torch

    name = torch.cuda.get_device_name()
    return name, next((peak for key, peak in BF16_PEAK if key in name), None)


def check_env(ctx: dict) -> str:
    import peft
    import torch
    import transformers

    versions = f"torch {torch.__version__}, transformers {transformers.__version__}, peft {peft.__version__}"
    if ctx["dry"]:
        return f"dry run on CPU; {versions}"
    expect(torch.cuda.is_available(), "torch.cuda.is_available() is False: a CPU build of torch, or no driver")
    expect(torch.cuda.is_bf16_supported(), "this GPU has no bf16")
    x = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16)
    expect(torch.isfinite(x @ x).all().item(), "a bf16 matmul on the GPU gave non-finite values")
    name, peak = bf16_peak()
    return f"{torch.cuda.device_count()} x {name} (bf16 peak {peak / 1e12:.0f} TFLOP/s)" if peak else f"{name} (bf16 peak unknown)"


def grpo_cfg(ctx: dict, name: str, recipe: str = "grpo", **over):
    """recipes/grpo.py's (or another recipe's) Config for a short run of the check's model, bf16 compute. over: options by
    flag name, section__field (trainer__backend="ray": --trainer.backend, wherever the Config keeps it)."""
    from rlkit.config import set_flags

    grpo = load_recipe(recipe)
    s = ctx["sizes"]
    if not over.get("trainer__resume"):  # a fresh run each time the row runs (--rows reruns in the same --out)
        shutil.rmtree(ctx["out"] / name, ignore_errors=True)
    cfg = grpo.Config()
    cfg.model.path = ctx["model"]
    cfg.data.train_files = [ctx["data"]]
    cfg.system.data.val_files = []
    cfg.data.max_prompt_length = s["prompt"]
    cfg.data.max_response_length = s["response"]
    cfg.data.train_batch_size = s["prompts"]
    cfg.rollout.n = s["n"]
    cfg.actor.ppo_mini_batch_size = s["mini"]  # below the batch: old log-probs + two optimizer steps
    cfg.system.actor.ppo_micro_batch_size = s["micro"]
    cfg.system.model.dtype = "bfloat16"  # float32 masters under autocast, on CPU too (--dry): the GPU's precision path
    cfg.actor.lr = 1e-5
    cfg.actor.entropy_coeff = 0.001  # the entropy enters the loss: its gradient path runs too
    cfg.reward.custom_fn = f"{ctx['reward']}:compute_score"
    cfg.trainer.total_training_steps = 2
    cfg.system.trainer.logger = []
    cfg.system.trainer.default_local_dir = str(ctx["out"] / name)
    cfg.system.trainer.experiment_name = name
    set_flags(cfg, {key.replace("__", "."): value for key, value in over.items()})  # by flag name: --trainer.backend ...
    return grpo, cfg


class Tee(io.StringIO):
    """Keeps what is written and passes it on at once: a row killed at its limit still shows in its log how far it got."""

    def __init__(self, out):
        super().__init__()
        self.out = out

    def write(self, text):
        self.out.write(text)
        self.out.flush()
        return super().write(text)


def run_recipe(grpo, cfg) -> tuple[str, list[dict]]:
    """Run the recipe; its console text and metrics rows."""
    from rlkit.tracking import read_metrics

    text = Tee(sys.stdout)
    with contextlib.redirect_stdout(text), quiet():
        grpo.main(cfg)
    out = Path(cfg.system.trainer.default_local_dir)
    return text.getvalue(), read_metrics(out / "metrics.jsonl")


def emulate_24gb() -> str:
    """Cap this process's CUDA allocations at 24 GB (torch.cuda.set_per_process_memory_fraction): the documented
    "fits 24 GB" rows are checked as a 24 GB card would run them."""
    import torch

    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, 24e9 / total))
    return f"capped at 24 GB of {total / 1e9:.0f}"


def compare_memory(last: dict, lora: bool, response: int = 512) -> str:
    """The phases' measured peaks (torch.cuda.max_memory_allocated, GiB) against bench/gpu_memory.py's prediction for
    the documented settings (0.5B, 512 + `response`, n 8, micro-batch 8, an entropy bonus): within +-15 % (the first
    H200 run, 2026-11-27, measured 1-8 % off). Step 1's generation and log-prob passes run before AdamW allocates its
    moments (at the first optimizer step), so a one-step row is compared with the model's first_step prediction."""
    import gpu_memory as gm

    first = last["step"] == 1
    predicted = gm.predict(gm.Setup(model="0.5B", lora=lora, entropy=True, response=response, first_step=first), 24)
    out = []
    for phase, key in (("update", "update"), ("old_log_prob", "log_prob"), ("gen", "gen")):
        got, want = last[f"memory/{phase}_peak_gb"], predicted[key] / gm.GiB
        expect(abs(got - want) <= 0.15 * want, f"{phase} peak {got:.2f} GiB, the memory model predicts {want:.2f} (+-15 %)")
        out.append(f"{phase} {got:.2f}/{want:.2f}")
    return "peak GiB measured/predicted " + " ".join(out)


def check_grpo(ctx: dict, lora: bool) -> str:
    s = ctx["sizes"]
    name = "grpo-lora" if lora else "grpo-full"
    cap = "" if ctx["dry"] else emulate_24gb()
    # the loan profile: one step (HF generation at 512 + 512 took 42 s a step on an H200), LoRA at 128 response tokens
    steps = 1 if ctx.get("loan") else 2
    response = min(128, s["response"]) if lora and ctx.get("loan") else s["response"]
    grpo, cfg = grpo_cfg(ctx, name, model__lora_rank=16 if lora else 0, trainer__total_training_steps=steps)
    cfg.data.max_response_length = response
    with module_calls("Linear") as calls:
        text, rows = run_recipe(grpo, cfg)
    params = "params bfloat16 (LoRA adapters float32)" if lora else "params float32, compute bfloat16"  # masters + autocast
    expect(params in text, f"start-of-run line lacks {params!r}")
    # what the update's passes computed with (the line says what was asked): float32 masters under bf16 autocast; LoRA:
    # float32 adapters (bf16 ones lose small updates) on a bf16 base
    trained, frozen, out = dtypes(calls, True), dtypes(calls, False), dtypes(calls, True, "out")
    want = ({"float32"}, {"bfloat16"}, {"float32"}) if lora else ({"float32"}, set(), {"bfloat16"})
    expect((trained, frozen, out) == want, f"the update's linear layers: trained weights {trained}, frozen {frozen}, outputs {out}")
    if not ctx["dry"]:
        expect("device cuda" in text, "start-of-run line does not say device cuda")
    expect(len(rows) == steps, f"{len(rows)} metric rows, expected {steps}")
    last = rows[-1]
    expect(last["response_length/mean"] == response, f"responses not full length: {last['response_length/mean']}")
    for key in ("actor/loss", "actor/grad_norm", "actor/entropy"):
        expect(key in last and math.isfinite(last[key]), f"{key} missing or not finite")
    expect(last["actor/grad_norm"] > 0, "zero gradient norm")
    expect("timing/old_log_prob" in last and last["timing/old_log_prob"] > 0, "no old log-prob pass (the off-policy path)")
    rows_n = s["prompts"] * s["n"]
    tokens_per_s = rows_n * response / last["timing/gen"]
    detail = f"{params}; gen {tokens_per_s:.0f} tok/s"
    if ctx["dry"]:
        return detail + f", max RSS {last['perf/max_rss_gb']:.1f} GiB"
    for phase in ("gen", "ref", "old_log_prob", "update"):
        expect(f"memory/{phase}_peak_gb" in last, f"memory/{phase}_peak_gb missing from the metrics")
    detail += f"; {cap}; " + compare_memory(last, lora, response)
    _, peak = bf16_peak()
    if peak:
        flops = update_flops(s["model"], s["prompts"], s["n"], s["prompt"], response, lora, ctx["checkpointing"])
        first = " (step 1: with the first call's set-up)" if last["step"] == 1 else ""
        detail += f", update MFU {100 * flops / last['timing/update'] / peak:.1f} %{first}"
    return detail


def check_checkpointing(ctx: dict) -> str:
    """Loss and gradients of one forward/backward equal with gradient checkpointing on and off; less memory with it."""
    import torch

    from rlkit.config import ActorConfig, ModelConfig, ModelSystem
    from rlkit.engine import TorchEngine
    from rlkit.protocol import DataProto
    from rlkit.rollout import assemble

    s = ctx["sizes"]
    rows, P, R = s["micro"], s["prompt"], s["response"]
    g = torch.Generator().manual_seed(0)
    vocab = s["model"]["vocab_size"]
    prompts = DataProto.from_dict(
        tensors={
            "input_ids": torch.randint(3, min(vocab, 275), (rows, P), generator=g),
            "attention_mask": torch.ones(rows, P, dtype=torch.long),
            "position_ids": torch.arange(P).expand(rows, P),
        }
    )
    batch = assemble(prompts, torch.randint(3, min(vocab, 275), (rows, R), generator=g), [], 0)
    results, layer_calls = {}, {}
    for gc in ("off", "on"):
        with quiet():
            eng = TorchEngine(
                ModelConfig(path=ctx["model"]),
                ActorConfig(use_kl_loss=False),
                device=ctx["device"],
                model_sys=ModelSystem(gradient_checkpointing=gc),
            )
        expect(eng.gradient_checkpointing == (gc == "on"), f"gradient checkpointing {gc} was not applied")
        cuda = eng.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        layer_calls[gc] = count_forwards(eng.model, "DecoderLayer")
        with eng._checkpointing():
            logp, _ = eng.forward(eng.model, batch, 1.0, False)
            loss = -(logp * batch["response_mask"].to(logp.device)).sum() / batch["response_mask"].sum()
            loss.backward()
        peak = (torch.cuda.max_memory_allocated() - base) / 2**30 if cuda else float("nan")
        grads = torch.cat([p.grad.float().flatten() for p in eng.model.parameters()])
        results[gc] = (loss.item(), grads.cpu(), peak)
        del eng, logp, loss
        if cuda:
            torch.cuda.empty_cache()
    (l0, g0, m0), (l1, g1, m1) = results["off"], results["on"]
    tol = 1e-2 if ctx["device"] == "cuda" else 1e-6  # bf16 compute: a recomputed pass may round differently
    expect(abs(l0 - l1) <= tol * max(abs(l0), 1), f"loss differs: {l0} vs {l1}")
    rel = ((g0 - g1).norm() / g0.norm()).item()
    expect(rel <= tol * 5, f"gradients differ: relative {rel:.2e}")
    # checkpointing recomputes each layer's forward in the backward (HF does only for modules in training mode)
    calls = {gc: n[0] for gc, n in layer_calls.items()}
    expect(calls["on"] == 2 * calls["off"], f"decoder layer forwards {calls}: checkpointing recomputed nothing in the backward")
    detail = f"loss {l0:.4f} = {l1:.4f}, gradient rel. diff {rel:.1e}, layer forwards {calls['off']} -> {calls['on']}"
    if ctx["device"] == "cuda":
        expect(m1 < m0, f"checkpointing did not lower the peak ({m1:.2f} vs {m0:.2f} GiB)")
        detail += f", backward peak {m0:.2f} -> {m1:.2f} GiB"
    return detail


def check_ray(ctx: dict) -> str:
    """Ray: two steps with a checkpoint each, a resumed third step equal to the third step of a run never interrupted
    (a resume that restored nothing, or not the optimizer, trains on from elsewhere), the HF exports loaded back."""
    import torch
    from transformers import AutoModelForCausalLM

    workers = 1 if ctx["dry"] else min(2, torch.cuda.device_count())
    over = dict(trainer__backend="ray", trainer__n_workers=workers)
    grpo, cfg = grpo_cfg(ctx, "ray", trainer__save_freq=1, **over)
    _, rows = run_recipe(grpo, cfg)
    expect(len(rows) == 2, f"{len(rows)} metric rows, expected 2")
    if not ctx["dry"]:
        expect("memory/worker_peak_gb" in rows[-1], "no worker GPU memory in the metrics")
    grpo, cfg = grpo_cfg(ctx, "ray", trainer__total_training_steps=3, trainer__resume="auto", trainer__save_freq=1, **over)
    text, rows = run_recipe(grpo, cfg)
    expect("resumed at step 2" in text, "the second run did not resume at step 2")
    grpo, cfg = grpo_cfg(ctx, "ray-straight", trainer__total_training_steps=3, trainer__save_freq=3, **over)
    run_recipe(grpo, cfg)
    weights = []
    for run, step in (("ray", 2), ("ray", 3), ("ray-straight", 3)):
        hf = ctx["out"] / run / "checkpoints" / f"global_step_{step}" / "hf"
        expect(hf.is_dir(), f"no {hf}")
        with quiet():
            model = AutoModelForCausalLM.from_pretrained(hf)
        expect(sum(p.numel() for p in model.parameters()) == ctx["n_params"], f"the HF export {hf} has another parameter count")
        weights.append(torch.cat([p.detach().float().flatten() for p in model.parameters()]))
    gap, update = (weights[1] - weights[2]).norm().item(), (weights[2] - weights[0]).norm().item()
    tol = 0.25 if torch.cuda.is_available() else 0.01  # GPU kernels and sampling are not bit-reproducible
    expect(gap < tol * update, f"resumed step 3 is {gap:.1e} from an uninterrupted run's (whose step 3 moved {update:.1e}): not resumed")
    return f"{workers} worker(s): 2 steps, resumed at step 2: step 3 {gap:.1e} from an uninterrupted run's (its update {update:.1e}); HF exports load"


def check_async(ctx: dict) -> str:
    """--trainer.async-steps 1 on the check's model: a generation process beside the trainer (on one GPU, sharing it)."""
    grpo, cfg = grpo_cfg(ctx, "async", trainer__async_steps=1, trainer__total_training_steps=3)
    cfg.data.max_response_length = min(64, ctx["sizes"]["response"])  # three steps inside the loan's limit
    _, rows = run_recipe(grpo, cfg)
    expect([r["async/staleness"] for r in rows] == [0, 1, 1], f"staleness {[r['async/staleness'] for r in rows]}, expected [0, 1, 1]")
    first = rows[0]["rollout_corr/abs_diff_mean"]  # the same weights in both processes: the gap of two bf16 passes
    tol = 0.05  # bf16 compute (on CPU too): the worker holds bf16 weights, the trainer float32 masters under autocast
    expect(first < tol, f"mean |log-prob gap| {first:.2e} on the starting weights (tolerance {tol})")
    for key in ("actor/loss", "actor/grad_norm"):
        expect(math.isfinite(rows[-1][key]), f"{key} not finite")
    step = sorted(r["timing/step"] for r in rows[1:])[0]
    return f"staleness 0, 1, 1; gap on equal weights {first:.1e}; fastest step {step:.2f} s (wait {rows[-1]['async/wait_s']:.2f} s)"


def check_vllm(ctx: dict) -> str:
    import torch

    from rlkit.config import ActorConfig, DataConfig, DataSystem, ModelConfig, RolloutConfig, RolloutSystem, System
    from rlkit.data import build_prompts
    from rlkit.vllm_rollout import vllm_available
    from rlkit.workers import ActorRolloutRefWorker

    if not vllm_available():
        raise SkipCheck("vLLM is not installed (bash scripts/install.sh vllm)")
    s = ctx["sizes"]
    data = DataConfig(train_files=[ctx["data"]], max_prompt_length=s["prompt"], max_response_length=s["response"])
    rollout = RolloutConfig(n=1)
    system = System(rollout=RolloutSystem(name="vllm", gpu_memory_utilization=0.3, kv_cache_gb=1))
    with quiet():
        worker = ActorRolloutRefWorker(
            ModelConfig(path=ctx["model"]), ActorConfig(lr=1e-3, use_kl_loss=False), rollout, data, device=ctx["device"], system=system
        )
    tok = worker.tokenizer
    prompts = build_prompts(data.train_files, tok, data, DataSystem(), max_samples=16).batch(list(range(16)), tok.pad_token_id)

    def gap() -> float:
        out = worker.generate(prompts)
        mine = worker.compute_log_prob(out)["old_log_probs"]
        mask = out["response_mask"].bool()
        return (mine - out["rollout_log_probs"])[mask].abs().mean().item()

    def loss(mb, log_prob, entropy, norm):  # a large step: raise the likelihood of what was sampled
        nll = -(log_prob * mb["response_mask"]).sum() / norm.num_tokens
        return nll, {"nll": nll}, {}

    before = gap()
    freed = ""
    if not ctx["dry"] and hasattr(worker.rollout, "sleep"):  # the whole device's free memory, vLLM awake then asleep
        worker.rollout.wake_up()
        free_awake = torch.cuda.mem_get_info()[0]
        worker.rollout.sleep()
        free_asleep = torch.cuda.mem_get_info()[0]
        expect(free_asleep > free_awake + 2**30, f"vLLM's sleep freed {(free_asleep - free_awake) / 2**30:.2f} GiB (expected > 1)")
        freed = f"; sleep frees {(free_asleep - free_awake) / 2**30:.1f} GiB (mem_get_info)"
    out = worker.generate(prompts)
    out["old_log_probs"] = worker.compute_log_prob(out)["old_log_probs"]
    worker.update(out, loss)  # syncs the weights into vLLM
    mask = out["response_mask"].bool()
    moved = (worker.compute_log_prob(out)["old_log_probs"] - out["old_log_probs"])[mask].abs().mean().item()
    after = gap()
    tol = 0.05 if ctx["device"] == "cuda" else 1e-3
    expect(before < tol and after < tol, f"mean |log-prob gap| {before:.2e} before, {after:.2e} after the update (tolerance {tol})")
    # vLLM on the old weights would be as far from the trainer as the update moved it: a sync must be much closer
    expect(moved > 5 * after, f"the update moved the trainer's log-probs by {moved:.2e}, vLLM's gap after it {after:.2e}")
    return (
        f"mean |log-prob gap| {before:.1e} before, {after:.1e} after an update that moved the trainer by {moved:.1e}; "
        f"startup {worker.rollout.startup_s:.0f} s{freed}"
    )


def gpu_only(ctx: dict, what: str = "") -> None:
    if ctx["dry"]:
        raise SkipCheck(f"GPU only{what}")


def need_vllm() -> None:
    from rlkit.vllm_rollout import vllm_available

    if not vllm_available():
        raise SkipCheck("vLLM is not installed (bash scripts/install.sh vllm)")


def check_logits_memory(ctx: dict) -> str:
    """A real vocabulary (V = 151,936) on a tiny body: the update pass with the entropy in the loss and the log-prob pass
    peak as bench/gpu_memory.py predicts, bf16 over float32 masters (CPU autocast in --dry)."""
    import gpu_memory as gm

    path = gm.tiny_model(ctx["out"] / "model-v151936")
    out = []
    for phase, entropy in (("update", True), ("log_prob", False)):
        with quiet():
            got, want = gm.measure_pass(path, phase, entropy, dtype="bfloat16", device=ctx["device"])
        u = 8 * 48 * 151936 * 4
        expect(abs(got - want) <= 0.3 * got, f"{phase}: measured {got / u:.2f} U, the memory model predicts {want / u:.2f} U (+-30 %)")
        out.append(f"{phase}{' + entropy' if entropy else ''} {got / u:.2f} U (model {want / u:.2f})")
    return f"{gm.engine_code()} engine: " + ", ".join(out)


def check_bf16_learning(ctx: dict) -> str:
    """bf16 compute learns: every weight moves as in float32 over 5 AdamW steps of 1e-5, and GRPO raises a learnable toy
    reward within 50 steps (the tiny model, bf16 over float32 masters; on CPU autocast it went 0.13 -> 0.29)."""
    gpu_only(ctx, " (50 steps; tests/test_gpu_readiness.py checks on CPU that bf16 weights move as float32 ones)")
    tiny = make_model(ctx["out"] / "model-tiny", sizes(True)["model"])
    frac, cos = bf16_moves_as_fp32(tiny, "cuda")
    expect(frac["bfloat16"] >= frac["float32"] - 1e-3, f"bf16 moved {frac['bfloat16']:.3f} of the weights, float32 {frac['float32']:.3f}")
    expect(cos > 0.9, f"bf16 and float32 updates point apart (cosine {cos:.2f})")
    rows = learn_toy_reward(ctx, tiny, "cuda")
    first, last = (sum(r["critic/score/mean"] for r in part) / len(part) for part in (rows[:10], rows[-10:]))
    expect(last > first + 0.05, f"the toy reward went {first:.3f} -> {last:.3f} in 50 bf16 steps (expected a rise of 0.05+)")
    return f"moved {100 * frac['bfloat16']:.1f} % of weights (float32 {100 * frac['float32']:.1f} %), cosine {cos:.3f}; reward {first:.2f} -> {last:.2f}"


def bf16_moves_as_fp32(model: str, device: str) -> tuple[dict, float]:
    """5 AdamW steps (lr 1e-5) of a language-model loss in float32 and in bf16 over float32 masters: the share of weights
    that moved in each, and the cosine of the two updates."""
    import torch

    from rlkit.config import ActorConfig, ModelConfig, ModelSystem
    from rlkit.engine import TorchEngine

    moved = {}
    ids = torch.arange(3, 67, device=device)[None]  # (1, 64)
    for dtype in ("float32", "bfloat16"):
        torch.manual_seed(0)
        with quiet():
            eng = TorchEngine(
                ModelConfig(path=model), ActorConfig(lr=1e-5, use_kl_loss=False), device=device, model_sys=ModelSystem(dtype=dtype)
            )
        before = [p.detach().float().clone() for p in eng.model.parameters()]
        for _ in range(5):
            eng.optimizer.zero_grad()
            with eng.autocast():
                loss = eng.model(input_ids=ids, labels=ids).loss
            loss.backward()
            eng.optimizer.step()
        moved[dtype] = torch.cat([(p.detach().float() - b).flatten() for p, b in zip(eng.model.parameters(), before, strict=True)])
    frac = {k: (v != 0).float().mean().item() for k, v in moved.items()}
    return frac, torch.nn.functional.cosine_similarity(moved["float32"], moved["bfloat16"], dim=0).item()


def learn_toy_reward(ctx: dict, model: str, device: str, steps: int = 50) -> list[dict]:
    """GRPO in bf16 (float32 masters) on the tiny model, short prompts, the learnable toy reward: the metric rows."""
    s = sizes(True)
    grpo, cfg = grpo_cfg(ctx, "bf16-learning", trainer__total_training_steps=steps, trainer__device=device)
    cfg.model.path, cfg.actor.lr, cfg.reward.custom_fn = model, 3e-4, f"{ctx['reward']}:learnable"
    cfg.data.train_files = [make_data(ctx["out"] / "short", s["prompt"])]
    cfg.data.max_prompt_length, cfg.data.max_response_length = s["prompt"], s["response"]
    cfg.data.train_batch_size, cfg.rollout.n, cfg.actor.ppo_mini_batch_size, cfg.system.actor.ppo_micro_batch_size = 8, 8, 8, 64
    return run_recipe(grpo, cfg)[1]


def check_critic(ctx: dict) -> str:
    """recipes/ppo.py: a value model (the policy's body + a fresh head) trains beside the policy."""
    ppo, cfg = grpo_cfg(ctx, "critic", recipe="ppo")
    cfg.rollout.n = 1
    cfg.data.max_response_length = min(64, ctx["sizes"]["response"])  # the value model's path, not the shape (grpo-full)
    _, rows = run_recipe(ppo, cfg)
    last = rows[-1]
    for key in ("critic/vf_loss", "critic/grad_norm", "actor/loss"):
        expect(key in last and math.isfinite(last[key]), f"{key} missing or not finite")
    expect(last["critic/grad_norm"] > 0, "the critic got no gradient")
    return f"vf_loss {last['critic/vf_loss']:.3f}, critic grad norm {last['critic/grad_norm']:.2f}"


def check_moe_replay(ctx: dict) -> str:
    """The embedded MoE (rlkit/assets/tiny-moe: 8 experts, top-2) in recipes/grpo.py with --actor.router-replay r3 and
    --rollout.log-probs, bf16 compute over float32 masters, lr 1e-3 and 2 epochs of 2 optimizer steps (the routes move):
    every update forward dispatches the experts the rollout recorded (moe/disagreement 0 in every layer) while the
    routers' own top-k drifts from them (moe/drift: rollout vs trainer plus the update's steps, reported)."""
    from rlkit import demos

    grpo, cfg = grpo_cfg(ctx, "moe-replay", actor__router_replay="r3", actor__lr=1e-3, actor__ppo_epochs=2)
    defaults = grpo.Config()
    cfg.model.path = str(demos.MOE_MODEL)
    cfg.data.train_files, cfg.reward.custom_fn = defaults.data.train_files, defaults.reward.custom_fn  # its task and scorer
    cfg.data.max_prompt_length, cfg.data.max_response_length = defaults.data.max_prompt_length, defaults.data.max_response_length
    cfg.data.train_batch_size, cfg.actor.ppo_mini_batch_size, cfg.system.actor.ppo_micro_batch_size, cfg.rollout.n = 8, 4, 8, 4
    cfg.system.rollout.log_probs = True
    _, rows = run_recipe(grpo, cfg)
    layers = sorted(k for k in rows[-1] if k.startswith("moe/disagreement/layer_"))
    expect(len(layers) == 2, f"moe/ metrics {sorted(k for k in rows[-1] if k.startswith('moe/'))}: the update replayed nothing")
    dis = [r[k] for r in rows for k in layers]
    expect(max(dis) == 0, f"routing disagreement {dis} under replay: an update forward routed otherwise than the rollout")
    for key in ("actor/loss", "actor/grad_norm"):
        expect(all(math.isfinite(r[key]) for r in rows), f"{key} not finite")
    drift = ", ".join(f"{r['moe/drift']:.3f}" for r in rows)
    kl = ", ".join(f"{r['rollout_corr/kl']:.1e}" for r in rows)
    return f"disagreement 0 in {len(layers)} layers x {len(rows)} steps; routers' drift from the rollout's routing {drift}; rollout-vs-trainer KL {kl}"


def check_token_budget(ctx: dict) -> str:
    """--actor.max-token-len-per-micro-batch of one and a half groups at the full length (two groups of short responses fit
    in a micro-batch, two of full ones do not), on a tiny model whose EOS is sampled (make_model(eos=True)): responses end
    at unequal lengths, so each rank's share of a mini-batch splits into a count of its own; on 2+ GPUs under FSDP with
    two ranks (unequal counts used to hang: the row's timeout catches it). With one rank, every update pass holds at most
    the budget's tokens (micro-batches by rows would hold two groups)."""
    import torch

    s = ctx["sizes"]
    response = min(64, s["response"])
    budget = 3 * (s["prompt"] + s["n"] * response) // 2
    ranks = 1 if ctx["dry"] else min(2, torch.cuda.device_count())
    over = dict(trainer__backend="ray", trainer__n_workers=ranks) if ranks > 1 else {}
    grpo, cfg = grpo_cfg(ctx, "token-budget", actor__max_token_len_per_micro_batch=budget, **over)
    cfg.model.path = make_model(ctx["out"] / "model-eos", sizes(True)["model"], eos=True)
    cfg.data.max_response_length, cfg.system.actor.ppo_micro_batch_size = response, 2 * s["n"]  # by rows: two groups, over budget
    with update_micro_batches() as costs:
        _, rows = run_recipe(grpo, cfg)
    expect(len(rows) == 2 and all(math.isfinite(r["actor/loss"]) for r in rows), "losses missing or not finite")
    clipped = [r["response_length/clip_ratio"] for r in rows]
    expect(min(clipped) < 1, f"every response ran to the length cap (clip ratio {clipped}): equal lengths on every rank")
    detail = f"budget {budget} tokens, {ranks} rank(s): 2 steps, finite losses, {100 * (1 - min(clipped)):.0f} % of responses ended early"
    if ranks == 1:  # the update's micro-batches (Ray workers are other processes)
        expect(max(costs) <= budget, f"update micro-batches of {costs} packed positions, over the budget of {budget}")
        detail += f"; update micro-batches of {min(costs)}-{max(costs)} positions"
    return detail


def check_flash_attn(ctx: dict) -> str:
    """flash_attention_2 (when it imports) and sdpa give the same log-probs, in bf16 tolerance."""
    import importlib.util

    import torch

    from rlkit.config import ModelConfig, ModelSystem
    from rlkit.engine import TorchEngine

    gpu_only(ctx)
    if importlib.util.find_spec("flash_attn") is None:
        raise SkipCheck("flash-attn is not installed")
    from rlkit.protocol import DataProto
    from rlkit.rollout import assemble

    s, g = ctx["sizes"], torch.Generator().manual_seed(0)
    rows, P, R = s["n"], s["prompt"], s["response"]
    ids = torch.randint(3, 275, (1, P), generator=g).expand(rows, P)
    prompts = DataProto.from_dict(
        tensors={"input_ids": ids, "attention_mask": torch.ones(rows, P, dtype=torch.long), "position_ids": torch.arange(P).expand(rows, P)}
    )
    batch = assemble(prompts, torch.randint(3, 275, (rows, R), generator=g), [], 0)
    lp = {}
    for attn in ("sdpa", "flash_attention_2"):
        with quiet():
            eng = TorchEngine(ModelConfig(path=ctx["model"]), None, device="cuda", model_sys=ModelSystem(attn_implementation=attn))
        start = time.perf_counter()
        lp[attn] = eng.compute_log_prob(batch, 1.0, rows)[0]
        torch.cuda.synchronize()
        lp[attn + "_s"] = time.perf_counter() - start
        del eng
    gap = (lp["sdpa"] - lp["flash_attention_2"]).abs().mean().item()
    expect(gap < 0.05, f"mean |log-prob gap| {gap:.3f} between flash_attention_2 and sdpa (bf16 tolerance 0.05)")
    return f"mean |gap| {gap:.1e}; one pass sdpa {lp['sdpa_s']:.2f} s, flash {lp['flash_attention_2_s']:.2f} s"


def run_with_gaps(module, cfg) -> tuple[list[dict], float, float]:
    """Run the recipe; its metric rows and, over its last batch's response tokens, the mean |log-prob gap| of the trainer
    to the rollout (which sampled with the synced weights) and to the base model (the reference: LoRA disabled)."""
    from rlkit import recipe

    last, end = {}, recipe.Run.end_of_step

    def keep(self, step, metrics, timings, batch, *args, **kwargs):
        last["batch"] = batch
        return end(self, step, metrics, timings, batch, *args, **kwargs)

    recipe.Run.end_of_step = keep
    try:
        _, rows = run_recipe(module, cfg)
    finally:
        recipe.Run.end_of_step = end
    b = last["batch"]
    mask = b["response_mask"].bool()
    sync, base = ((b["old_log_probs"] - b[key])[mask].abs().mean().item() for key in ("rollout_log_probs", "ref_log_prob"))
    return rows, sync, base


def expect_synced(what: str, sync: float, base: float) -> str:
    """The trainer-vs-rollout gap well under the trainer-vs-base gap: the rollout sampled the trained weights (a rollout
    of the base model, an unsynced or lossy sync, would be about as far as the base)."""
    expect(sync < 0.2 * base, f"{what}: mean |log-prob gap| to the rollout {sync:.3f}, to the base model {base:.3f} (want < 1/5 of it)")
    return f"{what} gap {sync:.1e} (base {base:.1e})"


def check_ray_vllm(ctx: dict) -> str:
    """Ray + vLLM with LoRA at lr 1e-3, the adapter sync and the merged sync (bf16(W + BA) used to lose most of a small
    delta): after two updates vLLM's log-probs are far closer to the trainer's than the base model's are."""
    gpu_only(ctx)
    need_vllm()
    out = []
    for adapter in (True, False):
        over = dict(trainer__backend="ray", rollout__name="vllm", model__lora_rank=16, trainer__total_training_steps=3)
        grpo, cfg = grpo_cfg(ctx, f"ray-vllm-{'adapter' if adapter else 'merged'}", actor__lr=1e-3, actor__use_kl_loss=True, **over)
        cfg.system.rollout.lora_adapter_sync, cfg.system.rollout.gpu_memory_utilization = adapter, 0.3
        _, sync, base = run_with_gaps(grpo, cfg)
        out.append(expect_synced("adapter" if adapter else "merged", sync, base))
    return ", ".join(out)


def check_tools(ctx: dict) -> str:
    """recipes/grpo_tools.py (multi-turn, tool calls; the embedded tool model) with vLLM + LoRA at lr 1e-3: after two
    updates the trainer's log-probs of what vLLM sampled stay far closer than the base model's (a multi-turn sampler
    without the LoRA request samples the base model, N6)."""
    need_vllm()
    tools, cfg = grpo_cfg(ctx, "tools", recipe="grpo_tools", rollout__name="vllm", model__lora_rank=16, trainer__total_training_steps=3)
    default = tools.Config()
    cfg.model.path, cfg.data, cfg.reward.custom_fn = default.model.path, default.data, None  # its own model, data, reward
    cfg.system.data.val_files, cfg.data.train_batch_size, cfg.rollout.n = [], 8, 4
    cfg.actor.lr, cfg.actor.use_kl_loss = 1e-3, True  # mini-batches below the batch (grpo_cfg): an old log-prob pass
    cfg.system.rollout.gpu_memory_utilization = 0.3
    _, sync, base = run_with_gaps(tools, cfg)
    return expect_synced("multi-turn vLLM + LoRA", sync, base)


def check_async_vllm(ctx: dict) -> str:
    """--trainer.async-steps 1 with vLLM in the generation worker, on one GPU: staleness 0, 1, 1, and the whole device's
    use (both processes, torch.cuda.mem_get_info sampled through the run) within the memory model's prediction."""
    import threading

    import gpu_memory as gm
    import torch

    gpu_only(ctx)
    need_vllm()
    grpo, cfg = grpo_cfg(ctx, "async-vllm", trainer__async_steps=1, trainer__total_training_steps=3, rollout__name="vllm")
    free0, total = torch.cuda.mem_get_info()
    used, stop = [0], threading.Event()

    def sample():
        while not stop.wait(0.5):
            used[0] = max(used[0], free0 - torch.cuda.mem_get_info()[0])

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        _, rows = run_recipe(grpo, cfg)
    finally:
        stop.set()
        thread.join()
    expect([r["async/staleness"] for r in rows] == [0, 1, 1], f"staleness {[r['async/staleness'] for r in rows]}, expected [0, 1, 1]")
    want = gm.predict(gm.Setup(model="0.5B", rollout="vllm", async_=True, entropy=True), total / 1e9)["peak"] + 2 * 0.5 * gm.GiB
    got = used[0]
    expect(got <= 1.3 * want, f"the GPU held {got / gm.GiB:.1f} GiB, the memory model predicts {want / gm.GiB:.1f} (+ 30 %)")
    return f"staleness 0, 1, 1; device use {got / gm.GiB:.1f} GiB (model {want / gm.GiB:.1f}, both processes with contexts)"


def check_megatron(ctx: dict) -> str:
    """--trainer.engine megatron, tensor parallel 2 on 2+ GPUs, 1 on one (every Megatron path but the TP split):
    two GRPO steps with finite losses and nonzero gradients."""
    import torch

    gpu_only(ctx)
    tp = min(2, torch.cuda.device_count())
    over = dict(trainer__backend="ray", trainer__engine="megatron", trainer__tp_size=tp, trainer__n_workers=tp)
    grpo, cfg = grpo_cfg(ctx, "megatron", **over)
    _, rows = run_recipe(grpo, cfg)
    expect(len(rows) == 2 and all(math.isfinite(r["actor/loss"]) and r["actor/grad_norm"] > 0 for r in rows), "losses or gradients bad")
    return f"TP {tp}: 2 steps, loss {rows[-1]['actor/loss']:.3f}, grad norm {rows[-1]['actor/grad_norm']:.2f}"


def cuda_peak_since(base: int) -> float:
    """GiB allocated at the peak since the last reset, above `base` bytes (what was held before the pass)."""
    import torch

    return (torch.cuda.max_memory_allocated() - base) / 2**30


def check_vlm(ctx: dict) -> str:
    """The shipped tiny Qwen2-VL (embedded-vlm), HF rollout: generation sizes its calls from the VLM's text config (a
    Qwen2-VL config keeps heads and vocabulary in text_config: reading them from the top crashed the first generate on
    CUDA), then two GRPO steps with step-0 validation, bf16."""
    import torch
    from transformers import AutoConfig

    from rlkit import demos
    from rlkit.engine import vocab_size
    from rlkit.rollout import generation_rows

    config = AutoConfig.from_pretrained(demos.VLM_MODEL)
    rows = generation_rows(config, 64, 8, torch.bfloat16, 2**30)  # what the CUDA path calls at every generate
    grpo, cfg = grpo_cfg(ctx, "vlm")
    cfg.model.path, cfg.system.data.task = "embedded-vlm", "colour_codeword"
    cfg.data.train_files = type(cfg.data)().train_files  # any: the task makes the rows
    cfg.system.data.val_files = type(cfg.system.data)().val_files
    cfg.system.data.task_train_size, cfg.system.data.task_val_size = 16, 8
    cfg.data.max_prompt_length, cfg.data.max_response_length = 512, 5
    cfg.data.train_batch_size, cfg.rollout.n, cfg.actor.ppo_mini_batch_size, cfg.system.actor.ppo_micro_batch_size = 8, 4, 8, 12
    cfg.system.trainer.test_freq, cfg.actor.lr, cfg.reward.custom_fn = 2, 1e-3, None  # the task's own reward; validation at 0 and 2
    text, metrics = run_recipe(grpo, cfg)
    train = [r for r in metrics if "actor/loss" in r]
    expect(len(train) == 2 and all(math.isfinite(r["actor/loss"]) for r in train), "losses missing or not finite")
    val = [k for r in metrics for k in r if k.startswith("val")]
    expect(val, "no validation metrics (step-0 validation generates first on CUDA)")
    with quiet():
        from transformers import AutoModelForImageTextToText

        model = AutoModelForImageTextToText.from_pretrained(demos.VLM_MODEL)
    expect(vocab_size(model) == config.get_text_config().vocab_size, f"engine.vocab_size gives {vocab_size(model)} for the VLM")
    return f"{rows} generation rows a GiB from the VLM config; 2 steps, loss {train[-1]['actor/loss']:.3f}; validated"


def check_sft(ctx: dict) -> str:
    """recipes/sft.py at the check's shape (0.5B on a GPU): two steps of 16 conversations (prompt ~P tokens), bf16 over
    float32 masters, micro-batches of 8; finite NLL; on a GPU the update's peak within the memory model's full-parameter
    update at this shape (no reference copy, n = 1) + 30 %."""
    s = ctx["sizes"]
    sft = load_recipe("sft")
    cfg = sft.Config()
    cfg.model.path, cfg.system.model.dtype, cfg.data.train_files, cfg.system.data.val_files = ctx["model"], "bfloat16", [ctx["data"]], []
    cfg.data.max_prompt_length, cfg.data.max_response_length = s["prompt"], 16
    cfg.data.train_batch_size = cfg.actor.ppo_mini_batch_size = 2 * s["micro"]
    cfg.system.actor.ppo_micro_batch_size, cfg.actor.lr = s["micro"], 1e-5
    cfg.trainer.total_training_steps, cfg.system.trainer.logger, cfg.system.trainer.test_freq = 2, [], 0
    cfg.system.trainer.default_local_dir, cfg.system.trainer.experiment_name = str(ctx["out"] / "sft-run"), "sft"
    shutil.rmtree(cfg.system.trainer.default_local_dir, ignore_errors=True)
    with module_calls("Linear", "ForCausalLM") as calls:
        _, rows = run_recipe(sft, cfg)
    expect(len(rows) >= 2 and all(math.isfinite(r["actor/nll"]) for r in rows if "actor/nll" in r), "NLL missing or not finite")
    trained, out = dtypes(calls, True), dtypes(calls, True, "out")
    expect((trained, out) == ({"float32"}, {"bfloat16"}), f"the update's linear layers: weights {trained}, outputs {out}")
    passes = sum(c["kind"].endswith("ForCausalLM") for c in calls)  # one a micro-batch: the peak's size
    want = 2 * cfg.data.train_batch_size // s["micro"]
    expect(passes >= want, f"{passes} forward passes in 2 steps of {cfg.data.train_batch_size} rows, micro-batches of {s['micro']}: {want}")
    detail = f"2 steps, nll {rows[-1]['actor/nll']:.3f}, {passes} micro-batches, float32 weights, bfloat16 compute"
    if not ctx["dry"]:
        want = full_update_gib(s)
        got = max(r.get("memory/update_peak_gb", 0) for r in rows)
        expect(0 < got <= 1.3 * want, f"update peak {got:.1f} GiB, the memory model's full update at this shape {want:.1f} (+30 %)")
        detail += f"; update peak {got:.1f} GiB (model {want:.1f})"
    return detail


def full_update_gib(s: dict) -> float:
    """The memory model's full-parameter update at the check's shape for sft and rm (GiB): micro-batches of s["micro"]
    rows of a prompt + 16 response tokens each, n = 1, no reference copy."""
    import gpu_memory as gm

    return gm.predict(gm.Setup(model="0.5B", kl=False, n=1, micro=s["micro"], prompt=s["prompt"], response=16), 24)["update"] / gm.GiB


def make_pairs(folder: Path, prompt_tokens: int, response_chars: int = 16) -> str:
    """Preference pairs for recipes/rm.py: the check's long prompts, a right and a wrong answer each."""
    import pandas as pd

    path = folder / "pairs.parquet"
    if not path.exists():
        df = pd.read_parquet(make_data(folder, prompt_tokens))
        truth = [str(r["ground_truth"]) for r in df["reward_model"]]
        pad = "." * max(response_chars - 8, 0)
        df = pd.DataFrame({"prompt": df["prompt"], "chosen": [t + pad for t in truth], "rejected": [t + "1" + pad for t in truth]})
        df.to_parquet(path)
    return str(path)


def check_rm(ctx: dict) -> str:
    """recipes/rm.py at the check's shape (0.5B on a GPU), its default batch (64 pairs): two steps; on a GPU with 24 GB
    emulated, the peak within the memory model's full-parameter update (no reference, no LM head) + 30 % (128
    float32 sequences in one forward without checkpointing needed hundreds of GiB)."""
    import torch

    s = ctx["sizes"]
    rm = load_recipe("rm")
    cap = "" if ctx["dry"] else emulate_24gb()
    cfg = rm.Config()
    pairs = make_pairs(ctx["out"] / "rm", s["prompt"])
    cfg.model.path, cfg.data.train_files, cfg.system.data.val_files = ctx["model"], [pairs], []
    cfg.data.max_prompt_length, cfg.data.max_response_length = s["prompt"], 16
    cfg.actor.lr, cfg.actor.warmup_steps = 1e-5, 0
    cfg.trainer.total_training_steps, cfg.system.trainer.logger, cfg.system.trainer.test_freq = 2, [], 0
    cfg.system.trainer.default_local_dir, cfg.system.trainer.experiment_name = str(ctx["out"] / "rm-run"), "rm"
    if ctx["dry"]:  # the GPU's defaults: bf16 compute, a few pairs a pass (rm.py: 4 on CUDA, all 64 on CPU)
        cfg.system.model.dtype, cfg.system.actor.ppo_micro_batch_size = "bfloat16", s["micro"]
    micro = cfg.system.actor.ppo_micro_batch_size or 4
    shutil.rmtree(cfg.system.trainer.default_local_dir, ignore_errors=True)
    if not ctx["dry"]:
        torch.cuda.reset_peak_memory_stats()
    with module_calls("Linear", "ForSequenceClassification") as calls:
        _, rows = run_recipe(rm, cfg)
    losses = [r["rm/loss"] for r in rows if "rm/loss" in r]
    expect(len(losses) == 2 and all(map(math.isfinite, losses)), f"rm/loss {losses}")
    trained, out = dtypes(calls, True), dtypes(calls, True, "out")
    expect((trained, out) == ({"float32"}, {"bfloat16"}), f"the update's linear layers: weights {trained}, outputs {out}")
    most = max(c["rows"] for c in calls if c["kind"].endswith("ForSequenceClassification"))
    expect(most <= 2 * micro, f"a forward of {most} sequences (micro-batches of {micro} pairs: {2 * micro})")
    detail = f"2 steps of {cfg.data.train_batch_size} pairs, loss {losses[-1]:.3f}, <= {most} sequences a pass in bfloat16"
    if not ctx["dry"]:
        want = full_update_gib(s)
        got = torch.cuda.max_memory_allocated() / 2**30
        expect(got <= 1.3 * want, f"peak {got:.1f} GiB, the memory model's full update at this shape {want:.1f} (+30 %)")
        detail += f"; {cap}; peak {got:.1f} GiB (model {want:.1f})"
    return detail


def _ulysses_rank(rank: int, port: int, path: str, out) -> None:
    """One of check_ulysses's two gloo processes: the engine's padded pass at S = 1 and its sequence-parallel pass at
    S = 2 (TorchEngine.forward_sp) on rows left-padded by 0..3 tokens with responses of different lengths; the log-probs
    and a loss's gradients (summed over the two ranks, then averaged as FSDP does) put on `out`."""
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", rank=rank, world_size=2)
        from rlkit.config import ModelConfig, ModelSystem
        from rlkit.engine import TorchEngine
        from rlkit.protocol import DataProto
        from rlkit.rollout import assemble

        model_sys = ModelSystem(dtype="float32", remove_padding=False, attn_implementation="sdpa", gradient_checkpointing="off")
        engine = TorchEngine(ModelConfig(path=path), None, device="cpu", model_sys=model_sys)
        g = torch.Generator().manual_seed(0)
        rows, prompt, response = 4, 24, 16
        ids = torch.randint(3, 250, (rows, prompt), generator=g)
        mask = (torch.arange(prompt) >= torch.arange(rows)[:, None]).long()  # row i: i padding tokens on the left
        prompts = DataProto.from_dict(
            tensors={"input_ids": ids * mask, "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0)}
        )
        resp = torch.randint(3, 250, (rows, response), generator=g)
        resp[torch.arange(rows), torch.tensor([15, 9, 12, 4])] = 2  # EOS (id 2) at different places: right padding
        batch = assemble(prompts, resp, [2], 0)
        adv = torch.linspace(-1, 1, rows * response).view(rows, response)

        def loss_and_grads(lp):
            m = batch["response_mask"]
            (-(adv * lp * m).sum() / m.sum()).backward()
            grads = {n: p.grad.clone() for n, p in engine.model.named_parameters()}
            engine.model.zero_grad()
            return grads

        ref_lp, _ = engine.forward(engine.model, batch, 1.0, False)
        ref = loss_and_grads(ref_lp)
        engine.sp_group = dist.group.WORLD
        lp, _ = engine.forward(engine.model, batch, 1.0, False)
        sp = loss_and_grads(lp)
        for grad in sp.values():  # FSDP's reduce: the ranks' gradients averaged
            dist.all_reduce(grad)
            grad /= 2
        m = batch["response_mask"].bool()
        lp_diff = (lp.detach() - ref_lp.detach())[m].abs().max().item()
        g_max = max(v.abs().max().item() for v in ref.values())
        g_diff = max((sp[k] - ref[k]).abs().max().item() for k in ref)
        out.put((rank, lp_diff, g_diff / g_max, None))
        dist.destroy_process_group()
    except Exception as e:  # reported by the row, not lost in a child's stderr
        out.put((rank, None, None, f"{type(e).__name__}: {e}"))


def check_ulysses(ctx: dict) -> str:
    """--trainer.sp-size 2 (Ulysses): the engine's sequence-parallel pass on 2 processes equals its padded one-process
    pass (log-probs, and the gradients FSDP would average). On CPU processes over gloo in both modes: NCCL with 2 ranks
    needs 2 GPUs and a loan has one, and gloo's all_to_all takes CPU tensors; the GPU run of SP needs a 2-GPU machine.
    Forked (not spawned), so the processes run this process's rlkit as it is (tests/test_gpu_check_rows.py plants
    defects)."""
    import queue

    import torch.multiprocessing as mp

    from rlkit.ray_group import free_port

    fork = mp.get_context("fork")
    out, port = fork.Queue(), free_port()
    procs = [fork.Process(target=_ulysses_rank, args=(r, port, ctx["model"], out)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        results = sorted((out.get(timeout=240) for _ in procs), key=lambda x: x[0])
    except queue.Empty:
        results = None
    for p in procs:
        p.join(timeout=30 if results else 1)
        if p.is_alive():
            p.kill()
    expect(results is not None, "the 2 gloo processes did not answer within 240 s (a hang in a collective)")
    errors = [r[3] for r in results if r[3]]
    expect(not errors, f"a rank failed: {errors[0] if errors else ''}")
    lp_diff = max(r[1] for r in results)
    g_rel = max(r[2] for r in results)
    # float32: the same sums in another order (the shard's LM head, the gathered log-sum-exp): ~1e-6; a row read at the
    # wrong offset, left padding attended to or labels rolled after the split move log-probs by 1e-2 or more
    expect(lp_diff <= 1e-4, f"S = 2 log-probs differ from S = 1 by {lp_diff:.2e} (> 1e-4)")
    expect(g_rel <= 1e-4, f"S = 2 gradients (averaged as FSDP does) differ from S = 1 by {g_rel:.2e} of the largest (> 1e-4)")
    return (
        f"S = 2 on 2 CPU processes over gloo (NCCL with 2 ranks needs 2 GPUs): left-padded rows, log-probs within {lp_diff:.1e} "
        f"of S = 1, gradients within {g_rel:.1e} of the largest"
    )


def check_judge(ctx: dict) -> str:
    """rlkit.judge.Judge in p_yes mode, 32 prompts of ~1k tokens in one batch: the LM head runs on the last position
    only ((32, 1, V), not (32, W, V): 19 GiB in float32 at V = 151,936); on a GPU the pass's peak above the weights."""
    import torch

    from rlkit.judge import Judge

    s = ctx["sizes"]
    words = 2 * s["prompt"]
    judge = Judge(ctx["model"], template="{question} {response} {reference} y or n?", yes="y", no="n", device=ctx["device"], chat=False)
    with quiet():
        judge.load()
    shapes = []
    judge.model.get_output_embeddings().register_forward_hook(lambda m, i, o: shapes.append(tuple(o.shape)))
    cuda = ctx["device"] == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    qs = [("abc " * words)[:words] for _ in range(32)]
    scores = judge.score(qs, ["12"] * 32, ["12"] * 32)
    expect(len(scores) == 32 and all(0 <= x <= 1 for x in scores), "scores missing or outside [0, 1]")
    expect(all(sh[1] == 1 for sh in shapes), f"the LM head ran on {shapes[0][1]} positions a row (expected 1): {shapes[0]}")
    detail = f"LM head output {shapes[0]}"
    if cuda:
        got = cuda_peak_since(base)
        width = judge.model.get_output_embeddings().weight.element_size()
        every = 32 * words * judge.model.config.vocab_size * width / 2**30  # the LM head at every position: (32, W, V)
        expect(
            got < every / 2, f"the judge's pass took {got:.1f} GiB above its weights; the LM head at every position alone is {every:.1f}"
        )
        detail += f"; peak {got:.2f} GiB above the weights (the LM head at every position alone: {every:.1f} GiB)"
    return detail


ROWS = {
    "env": (check_env,),
    "grpo-full": (check_grpo, False),
    "grpo-lora": (check_grpo, True),
    "checkpointing": (check_checkpointing,),
    "logits-memory": (check_logits_memory,),
    "bf16-learning": (check_bf16_learning,),
    "critic": (check_critic,),
    "token-budget": (check_token_budget,),
    "moe-replay": (check_moe_replay,),
    "flash-attn": (check_flash_attn,),
    "ray": (check_ray,),
    "ray-vllm": (check_ray_vllm,),
    "async": (check_async,),
    "async-vllm": (check_async_vllm,),
    "vllm": (check_vllm,),
    "tools": (check_tools,),
    "megatron": (check_megatron,),
    "vlm": (check_vlm,),
    "sft": (check_sft,),
    "rm": (check_rm,),
    "judge": (check_judge,),
    "ulysses": (check_ulysses,),
}
LOAN_SKIP = {
    "ulysses": "not in the loan profile (its 8 minutes are spent; the row runs on CPU processes over gloo: --dry covers it)",
    "moe-replay": "not in the loan profile (its 8 minutes are spent; --dry runs the same path on CPU)",
}


NEEDS = {"tools": ["vllm"]}  # what a row needs that its name does not say


def skipped(name: str, skip: set[str]) -> bool:
    """Whether --skip leaves the row out: any dash-separated part of its name (or the name, or what it NEEDS) is listed."""
    return name in skip or any(part in skip for part in name.split("-") + NEEDS.get(name, []))


class Timeout(Exception):
    pass


def run_in_process(check: Check, name: str, ctx: dict, limit: int) -> None:
    """--dry: the row here, with a SIGALRM timeout (enough for Python code; a hang inside C code needs the subprocess)."""

    def alarm(signum, frame):
        raise Timeout(f"timeout after {limit} s")

    old = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(limit)
    try:
        check.run(name, ROWS[name][0], ctx, *ROWS[name][1:])
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def run_in_subprocess(check: Check, name: str, ctx: dict, limit: int) -> None:
    """A GPU row in a process of its own: killed past `limit` seconds and reported FAIL "timeout" (a hung NCCL collective
    never returns to Python); its output goes to <out>/<row>.log."""
    log = Path(ctx["out"]) / f"{name}.log"
    result = Path(ctx["out"]) / f"{name}.json"
    result.unlink(missing_ok=True)
    cmd = [sys.executable, __file__, "--row", name, "--ctx", str(Path(ctx["out"]) / "ctx.json")]
    start = time.perf_counter()
    print(f"[gpu_check] {name} ... (log {log})", flush=True)
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)  # its own process group
        try:
            proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the row and what it started (Ray, vLLM, NCCL ranks)
            proc.wait()
            if not result.exists():  # (a row that reported in time but was slow to exit keeps its result)
                lines = [x for x in log.read_text(errors="replace").splitlines() if x.strip()]
                last = lines[-1][-160:] if lines else "no output"
                check.rows.append((name, "FAIL", f"timeout after {limit} s; its log ended: {last!r} (log {log})"))
                print(f"[gpu_check] {name}: FAIL timeout", flush=True)
                return
    if result.exists():
        check.rows.append(tuple(json.loads(result.read_text())))
    else:
        tail = log.read_text()[-300:].strip().splitlines()
        check.rows.append(
            (name, "FAIL", f"the row's process died: {tail[-1] if tail else 'no output'} ({time.perf_counter() - start:.0f} s)")
        )
    print(f"[gpu_check] {name}: {check.rows[-1][1]} {check.rows[-1][2]}", flush=True)


def make_ctx(out: Path, dry: bool, loan: bool = False) -> dict:
    """What every row gets: the model (the tiny one in --dry, the 0.5B-shaped one on a GPU), the data, the scoring file,
    the sizes and what gradient_checkpointing=auto picks for that model."""
    shape = sizes(dry)
    ctx = {"dry": dry, "device": "cpu" if dry else "cuda", "sizes": shape, "out": out, "loan": loan}
    ctx["model"] = make_model(out / ("model-tiny" if dry else "model-qwen2-0.5b-shape"), shape["model"])
    ctx["data"] = make_data(out, shape["prompt"])
    (out / "reward.py").write_text(REWARD)
    ctx["reward"] = str(out / "reward.py")
    with open(Path(ctx["model"]) / "model.safetensors", "rb") as f:  # parameter count from the safetensors header
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    ctx["n_params"] = sum(math.prod(v["shape"]) for k, v in header.items() if k != "__metadata__")
    ctx["checkpointing"] = not dry and ctx["n_params"] >= 10_000_000  # what gradient_checkpointing=auto picks
    return ctx


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dry", action="store_true", help="CPU, the embedded model's size, short lengths (default when CUDA is missing)")
    p.add_argument("--loan", action="store_true", help=f"the loan profile: rows that need neither vLLM nor Ray, <= 8 min ({LOAN_PACKAGES})")
    p.add_argument("--rows", default="", help="comma-separated row names: run only these (a rerun of what failed)")
    p.add_argument("--skip", default="", help=f"comma-separated words: rows whose name has one are left out ({', '.join(ROWS)})")
    p.add_argument("--out", default=None, help="work folder (default: a new temporary one)")
    p.add_argument("--timeout", type=int, default=600, help="seconds per row (some rows get more: ROW_TIMEOUT); past it a row FAILs")
    p.add_argument("--isolate", action="store_true", help="--dry: each row in a process of its own, as on a GPU")
    p.add_argument("--row", help=argparse.SUPPRESS)  # internal: run one row (a subprocess of the check)
    p.add_argument("--ctx", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.row:  # one row in its own process: the result as JSON beside the log
        ctx = json.loads(Path(args.ctx).read_text())
        ctx["out"] = Path(ctx["out"])
        set_threads(8)
        if ctx.get("loan") and args.row != "grpo-full":  # a 0.5B checkpoint is ~6 GB: grpo-full writes one, the rest skip it
            from rlkit import recipe

            recipe.Run.save = lambda self, step: None
        check = Check()
        check.run(args.row, ROWS[args.row][0], ctx, *ROWS[args.row][1:])
        (ctx["out"] / f"{args.row}.json").write_text(json.dumps(check.rows[-1]))
        return 0
    start = time.perf_counter()
    set_threads(1 if args.dry else 8)
    import tempfile

    import torch

    dry = args.dry or not torch.cuda.is_available()
    out = Path(args.out or tempfile.mkdtemp(prefix="rlkit-gpu-check-"))
    out.mkdir(parents=True, exist_ok=True)
    ctx = make_ctx(out, dry, args.loan)
    (out / "ctx.json").write_text(json.dumps({**ctx, "out": str(out)}))
    setup_s = time.perf_counter() - start
    print(f"[gpu_check] {'dry run on CPU' if dry else 'GPU run'}: model {ctx['model']} ({ctx['n_params'] / 1e6:.1f}M), out {out}")
    if args.loan:
        print(f"[gpu_check] loan profile: {len(LOAN) - 1} rows, limits {sum(LOAN.values())} s in all with the set-up ({setup_s:.0f} s)")

    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    only = {s.strip() for s in args.rows.split(",") if s.strip()}
    unknown = only - set(ROWS)
    if unknown:
        p.error(f"--rows: no row named {', '.join(sorted(unknown))} (rows: {', '.join(ROWS)})")
    check = Check()
    for name in ROWS:
        if args.loan:
            limit = LOAN.get(name)
        else:
            limit = max(args.timeout, ROW_TIMEOUT.get(name, 0)) if not dry else args.timeout
        if only and name not in only:
            continue
        if limit is None:
            check.rows.append((name, "SKIP", LOAN_SKIP.get(name, "not in the loan profile (needs vLLM or Ray)")))
        elif skipped(name, skip):
            check.rows.append((name, "SKIP", "--skip"))
        elif dry and not args.isolate:
            run_in_process(check, name, ctx, limit)
        else:
            run_in_subprocess(check, name, ctx, limit)
            for folder in out.glob("*/checkpoints"):  # the disk: a 0.5B run's checkpoint is ~6 GB
                shutil.rmtree(folder, ignore_errors=True)
    print("\n" + check.table())
    print(f"[gpu_check] wall {time.perf_counter() - start:.0f} s")
    return 1 if any(s == "FAIL" for _, s, _ in check.rows) else 0


if __name__ == "__main__":
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    sys.exit(main())
