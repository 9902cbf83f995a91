"""One command that checks rlkit's CUDA path on a GPU, and with --dry the same code paths on CPU (CI runs that).

    python bench/gpu_check.py                    # one or more GPUs: a random-weight Qwen2-0.5B-shaped model, 512 + 512 tokens
    python bench/gpu_check.py --dry              # CPU (the default when CUDA is missing): the embedded model's size, short lengths
    python bench/gpu_check.py --skip ray,vllm    # leave parts out (CI's dry test does: they cost minutes on 2 cores)

No network and no download: the model is built from a config with random weights and the embedded model's
tokenizer, and neither has an EOS token (nor its generation config), so every response runs to the length cap: memory and speed are measured at the full 512 + 512 tokens. Rewards come from a small scoring
function written beside it (random tokens score unevenly), so GRPO's advantages and gradients are not zero.

What it checks, each a row of the PASS/FAIL table:

  env            CUDA works and supports bf16 (GPU); versions
  grpo-full      recipes/grpo.py, full parameters, --actor.ppo-mini-batch-size below the batch (the off-policy
                 path: old log-probs with entropy, two optimizer steps per training step): the start-of-run line
                 says float32 master weights and bf16 compute; responses are full length; losses and gradient
                 norms finite and nonzero; GPU memory per phase (gen, ref, old_log_prob, update); rollout
                 tokens/s; update-phase model FLOP utilisation against the GPU's bf16 peak
  grpo-lora      the same with LoRA rank 16 (frozen base in bf16, float32 adapters)
  checkpointing  one forward/backward with gradient checkpointing on and off: equal loss and gradients, less memory
  ray            --trainer.backend ray --trainer.n-workers 1 (2 with two GPUs): two steps with a checkpoint each,
                 a resumed third step, and the Hugging Face export loaded back
  async          --trainer.async-steps 1, three steps: staleness 0, 1, 1; the log-prob gap of the generation
                 process and the trainer on equal weights; the step time and the trainer's wait
  vllm           where vLLM is installed: its log-probs agree with the trainer's before and after a large update
                 (the weight sync), within bf16 tolerance on GPU

MFU counts 2N FLOPs per token forward and 4N backward (LoRA: 2N, no weight gradients), +2N with gradient
checkpointing, N the parameter count; attention's own FLOPs are left out (they add ~10 % at 1k tokens), so it
is a lower bound. Exit status 1 on any FAIL.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

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
'''


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


def make_model(folder: Path, shape: dict) -> str:
    """A random-weight Qwen2 causal LM + the embedded tokenizer, without any EOS token: responses never stop early."""
    import torch
    from transformers import AutoTokenizer, GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    from rlkit import embedded

    if (folder / "config.json").exists():
        return str(folder)
    tok = AutoTokenizer.from_pretrained(embedded.MODEL_DIR)
    tok.eos_token = None  # never stop: every response is full length
    config = Qwen2Config(
        **shape, max_position_embeddings=4096, tie_word_embeddings=True, rope_theta=1e6, pad_token_id=tok.pad_token_id, eos_token_id=None
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(eos_token_id=None, pad_token_id=tok.pad_token_id)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return str(folder)


def make_data(folder: Path, prompt_tokens: int) -> str:
    """The embedded arithmetic prompts, each padded with filler text to about `prompt_tokens` tokens (1 char ~ 1 token)."""
    import pandas as pd

    from rlkit import embedded

    path = folder / "train.parquet"
    if not path.exists():
        df = pd.read_parquet(embedded.DATA_DIR / "train.parquet").head(64)
        filler = ("Think step by step. " * 64)[: max(prompt_tokens - 40, 0)]
        df["prompt"] = [[{"role": "user", "content": filler + m[0]["content"]}] for m in df["prompt"]]
        df.to_parquet(path)
    return str(path)


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


def grpo_cfg(ctx: dict, name: str, **over):
    """recipes/grpo.py's Config for a short run of the check's model."""
    grpo = load_recipe("grpo")
    s = ctx["sizes"]
    cfg = grpo.Config()
    cfg.model.path = ctx["model"]
    cfg.data.train_files = [ctx["data"]]
    cfg.data.val_files = []
    cfg.data.max_prompt_length = s["prompt"]
    cfg.data.max_response_length = s["response"]
    cfg.data.train_batch_size = s["prompts"]
    cfg.rollout.n = s["n"]
    cfg.actor.ppo_mini_batch_size = s["mini"]  # below the batch: old log-probs + two optimizer steps
    cfg.actor.ppo_micro_batch_size = s["micro"]
    cfg.actor.lr = 1e-5
    cfg.actor.entropy_coeff = 0.001  # the entropy enters the loss: its gradient path runs too
    cfg.reward.custom_fn = f"{ctx['reward']}:compute_score"
    cfg.trainer.total_training_steps = 2
    cfg.trainer.logger = []
    cfg.trainer.default_local_dir = str(ctx["out"] / name)
    cfg.trainer.experiment_name = name
    for key, value in over.items():
        section, field = key.split("__")
        setattr(getattr(cfg, section), field, value)
    return grpo, cfg


def run_recipe(grpo, cfg) -> tuple[str, list[dict]]:
    """Run the recipe; its console text and metrics rows."""
    from rlkit.tracking import read_metrics

    text = io.StringIO()
    with contextlib.redirect_stdout(text), quiet():
        grpo.main(cfg)
    sys.stdout.write(text.getvalue())
    out = Path(cfg.trainer.default_local_dir)
    return text.getvalue(), read_metrics(out / "metrics.jsonl")


def check_grpo(ctx: dict, lora: bool) -> str:
    import torch

    s = ctx["sizes"]
    name = "grpo-lora" if lora else "grpo-full"
    grpo, cfg = grpo_cfg(ctx, name, model__lora_rank=16 if lora else 0)
    text, rows = run_recipe(grpo, cfg)
    dtype = "float32" if ctx["dry"] else "bfloat16"
    params = f"params {dtype} (LoRA adapters float32)" if lora else f"params float32, compute {dtype}"
    expect(params in text, f"start-of-run line lacks {params!r}")
    if not ctx["dry"]:
        expect("device cuda" in text, "start-of-run line does not say device cuda")
    expect(len(rows) == 2, f"{len(rows)} metric rows, expected 2")
    last = rows[-1]
    expect(last["response_length/mean"] == s["response"], f"responses not full length: {last['response_length/mean']}")
    for key in ("actor/loss", "actor/grad_norm", "actor/entropy"):
        expect(key in last and math.isfinite(last[key]), f"{key} missing or not finite")
    expect(last["actor/grad_norm"] > 0, "zero gradient norm")
    expect("timing/old_log_prob" in last and last["timing/old_log_prob"] > 0, "no old log-prob pass (the off-policy path)")
    rows_n = s["prompts"] * s["n"]
    tokens_per_s = rows_n * s["response"] / last["timing/gen"]
    detail = f"gen {tokens_per_s:.0f} tok/s"
    if not ctx["dry"]:
        for phase in ("gen", "ref", "old_log_prob", "update"):
            key = f"memory/{phase}_peak_gb"
            expect(key in last, f"{key} missing from the metrics")
        detail += ", peak GiB " + " ".join(f"{p} {last[f'memory/{p}_peak_gb']:.1f}" for p in ("gen", "ref", "old_log_prob", "update"))
        _, peak = bf16_peak()
        if peak:
            n_params = ctx["n_params"]
            tokens = rows_n * (s["prompt"] + s["response"])  # an upper bound of the unpadded tokens; prompts are near full
            per_token = 2 * n_params + (2 if lora else 4) * n_params + (2 * n_params if ctx["checkpointing"] else 0)
            mfu = tokens * per_token / last["timing/update"] / peak
            detail += f", update MFU {100 * mfu:.0f} %"
    else:
        detail += f", max RSS {last['perf/max_rss_gb']:.1f} GiB"
    del torch
    return detail


def check_checkpointing(ctx: dict) -> str:
    """Loss and gradients of one forward/backward equal with gradient checkpointing on and off; less memory with it."""
    import torch

    from rlkit.config import ActorConfig, ModelConfig
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
    results = {}
    for gc in ("off", "on"):
        with quiet():
            eng = TorchEngine(
                ModelConfig(path=ctx["model"], gradient_checkpointing=gc), ActorConfig(use_kl_loss=False), device=ctx["device"]
            )
        expect(eng.gradient_checkpointing == (gc == "on"), f"gradient checkpointing {gc} was not applied")
        cuda = eng.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
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
    detail = f"loss {l0:.4f} = {l1:.4f}, gradient rel. diff {rel:.1e}"
    if ctx["device"] == "cuda":
        expect(m1 < m0, f"checkpointing did not lower the peak ({m1:.2f} vs {m0:.2f} GiB)")
        detail += f", backward peak {m0:.2f} -> {m1:.2f} GiB"
    return detail


def check_ray(ctx: dict) -> str:
    import torch
    from transformers import AutoModelForCausalLM

    from rlkit import checkpoint

    workers = 1 if ctx["dry"] else min(2, torch.cuda.device_count())
    over = dict(trainer__backend="ray", trainer__n_workers=workers, trainer__save_freq=1)
    grpo, cfg = grpo_cfg(ctx, "ray", **over)
    _, rows = run_recipe(grpo, cfg)
    expect(len(rows) == 2, f"{len(rows)} metric rows, expected 2")
    if not ctx["dry"]:
        expect("memory/worker_peak_gb" in rows[-1], "no worker GPU memory in the metrics")
    grpo, cfg = grpo_cfg(ctx, "ray", trainer__total_training_steps=3, trainer__resume="auto", **over)
    text, rows = run_recipe(grpo, cfg)
    expect("resumed at step 2" in text, "the second run did not resume at step 2")
    ckpts = checkpoint.list_checkpoints(Path(cfg.trainer.default_local_dir) / "checkpoints")
    expect(3 in ckpts, f"checkpoints {ckpts}, expected step 3")
    hf = Path(cfg.trainer.default_local_dir) / "checkpoints" / "global_step_3" / "hf"
    with quiet():
        model = AutoModelForCausalLM.from_pretrained(hf)
    expect(sum(p.numel() for p in model.parameters()) == ctx["n_params"], "the HF export has another parameter count")
    return f"{workers} worker(s): 2 steps, resumed at step 2, step 3 saved, HF export loads ({model.dtype})"


def check_async(ctx: dict) -> str:
    """--trainer.async-steps 1 on the check's model: a generation process beside the trainer (on one GPU, sharing it)."""
    grpo, cfg = grpo_cfg(ctx, "async", trainer__async_steps=1, trainer__total_training_steps=3)
    _, rows = run_recipe(grpo, cfg)
    expect([r["async/staleness"] for r in rows] == [0, 1, 1], f"staleness {[r['async/staleness'] for r in rows]}, expected [0, 1, 1]")
    first = rows[0]["rollout_corr/abs_diff_mean"]  # the same weights in both processes: the gap of two bf16 passes
    tol = 0.05 if ctx["device"] == "cuda" else 1e-5
    expect(first < tol, f"mean |log-prob gap| {first:.2e} on the starting weights (tolerance {tol})")
    for key in ("actor/loss", "actor/grad_norm"):
        expect(math.isfinite(rows[-1][key]), f"{key} not finite")
    step = sorted(r["timing/step"] for r in rows[1:])[0]
    return f"staleness 0, 1, 1; gap on equal weights {first:.1e}; fastest step {step:.2f} s (wait {rows[-1]['async/wait_s']:.2f} s)"


def check_vllm(ctx: dict) -> str:
    import torch

    from rlkit.config import ActorConfig, DataConfig, ModelConfig, RolloutConfig
    from rlkit.data import build_prompts
    from rlkit.vllm_rollout import vllm_available
    from rlkit.workers import ActorRolloutRefWorker

    if not vllm_available():
        raise SkipCheck("vLLM is not installed (bash scripts/install.sh vllm)")
    s = ctx["sizes"]
    data = DataConfig(train_files=[ctx["data"]], max_prompt_length=s["prompt"], max_response_length=s["response"])
    rollout = RolloutConfig(name="vllm", n=1, gpu_memory_utilization=0.3, kv_cache_gb=1)
    with quiet():
        worker = ActorRolloutRefWorker(
            ModelConfig(path=ctx["model"]), ActorConfig(lr=1e-3, use_kl_loss=False), rollout, data, device=ctx["device"]
        )
    tok = worker.tokenizer
    prompts = build_prompts(data.train_files, tok, data, max_samples=16).batch(list(range(16)), tok.pad_token_id)

    def gap() -> float:
        out = worker.generate(prompts)
        mine = worker.compute_log_prob(out)["old_log_probs"]
        mask = out["response_mask"].bool()
        return (mine - out["rollout_log_probs"])[mask].abs().mean().item()

    def loss(mb, log_prob, entropy, norm):  # a large step: raise the likelihood of what was sampled
        nll = -(log_prob * mb["response_mask"]).sum() / norm.num_tokens
        return nll, {"nll": nll}, {}

    before = gap()
    out = worker.generate(prompts)
    out["old_log_probs"] = worker.compute_log_prob(out)["old_log_probs"]
    worker.update(out, loss)  # syncs the weights into vLLM
    after = gap()
    tol = 0.05 if ctx["device"] == "cuda" else 1e-3
    expect(before < tol and after < tol, f"mean |log-prob gap| {before:.2e} before, {after:.2e} after the update (tolerance {tol})")
    del torch
    return f"mean |log-prob gap| {before:.1e} before, {after:.1e} after a large update; startup {worker.rollout.startup_s:.0f} s"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dry", action="store_true", help="CPU, the embedded model's size, short lengths (default when CUDA is missing)")
    p.add_argument("--skip", default="", help="comma-separated checks to leave out: grpo-full,grpo-lora,checkpointing,ray,async,vllm")
    p.add_argument("--out", default=None, help="work folder (default: a new temporary one)")
    args = p.parse_args()
    set_threads(1 if args.dry else 8)
    import tempfile

    import torch

    dry = args.dry or not torch.cuda.is_available()
    out = Path(args.out or tempfile.mkdtemp(prefix="rlkit-gpu-check-"))
    out.mkdir(parents=True, exist_ok=True)
    shape = sizes(dry)
    ctx = {"dry": dry, "device": "cpu" if dry else "cuda", "sizes": shape, "out": out}
    ctx["model"] = make_model(out / ("model-tiny" if dry else "model-qwen2-0.5b-shape"), shape["model"])
    ctx["data"] = make_data(out, shape["prompt"])
    (out / "reward.py").write_text(REWARD)
    ctx["reward"] = str(out / "reward.py")
    with open(Path(ctx["model"]) / "model.safetensors", "rb") as f:  # parameter count from the safetensors header
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    ctx["n_params"] = sum(math.prod(v["shape"]) for k, v in header.items() if k != "__metadata__")
    ctx["checkpointing"] = not dry and ctx["n_params"] >= 10_000_000  # what gradient_checkpointing=auto picks
    print(f"[gpu_check] {'dry run on CPU' if dry else 'GPU run'}: model {ctx['model']} ({ctx['n_params'] / 1e6:.1f}M), out {out}")

    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    check = Check()
    check.run("env", check_env, ctx)
    for name, fn, *rest in [
        ("grpo-full", check_grpo, False),
        ("grpo-lora", check_grpo, True),
        ("checkpointing", check_checkpointing),
        ("ray", check_ray),
        ("async", check_async),
        ("vllm", check_vllm),
    ]:
        if name in skip:
            check.rows.append((name, "SKIP", "--skip"))
        else:
            check.run(name, fn, ctx, *rest)
    print("\n" + check.table())
    return 1 if any(s == "FAIL" for _, s, _ in check.rows) else 0


if __name__ == "__main__":
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    sys.exit(main())
