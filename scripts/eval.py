"""Evaluate a model with n samples per prompt: mean@n, unbiased pass@k, maj@k (docs/eval.md).

    python scripts/eval.py -n 4                                   # the embedded model on its val set
    python scripts/eval.py --model outputs/grpo/checkpoints/global_step_296/hf \\
        --data.val-files gsm8k/test.parquet --data.max-response-length 512 -n 16

Samples every prompt of --data.val-files (at most --data.val-max-samples) n times at --rollout.temperature,
scores them with the training reward (--reward.*), writes one jsonl row per sample (--output) and prints the
estimators of rlkit/evaluation.py. The flags are the recipes' (--model, --data.*, --rollout.*, --reward.*).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated

import torch
import tyro

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rlkit import evaluation  # noqa: E402
from rlkit.config import (  # noqa: E402
    ActorConfig,
    DataConfig,
    DataSystem,
    ModelConfig,
    ModelSystem,
    RewardConfig,
    RewardSystem,
    RolloutConfig,
    RolloutSystem,
    System,
)
from rlkit.errors import ConfigError  # noqa: E402


@dataclass
class EvalSystem:
    """The system sections eval reads (cfg.system): their flags keep the recipes' names (--model.dtype, --data.val-files,
    --rollout.name, --reward.timeout-s, ...)."""

    model: ModelSystem = field(default_factory=ModelSystem)
    data: DataSystem = field(default_factory=DataSystem)
    rollout: RolloutSystem = field(default_factory=RolloutSystem)
    reward: RewardSystem = field(default_factory=RewardSystem)


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    n: Annotated[int, tyro.conf.arg(aliases=("-n",))] = 16
    """samples per prompt (pass@k is reported for k = 1, 2, 4, ... <= n and n)"""
    output: str = "outputs/eval/samples.jsonl"
    """the per-sample jsonl: prompt_index, sample_index, response, score, correct, answer (the scorer's parsed answer), ground_truth"""
    device: str = "auto"
    """cpu, cuda, cuda:1, ... (auto = cuda when available)"""
    seed: int = 1
    """seed of the sampling"""
    num_threads: int = 0
    """torch CPU threads (0 = 1 thread on a machine with <= 4 cores, else torch's default)"""
    system: EvalSystem = field(default_factory=EvalSystem)
    """how the model runs and what is evaluated (dtype, the files, vLLM, the scorer's sandbox)"""


def check(cfg: Config) -> None:
    """Flag mistakes in one line each, before the model loads."""
    from rlkit.data import check_files

    if cfg.n < 1:
        raise ConfigError(f"-n {cfg.n}: must be at least 1")
    if cfg.rollout.temperature <= 0 and cfg.n > 1:
        raise ConfigError(f"--rollout.temperature {cfg.rollout.temperature} with -n {cfg.n}: greedy samples are all the same; use > 0")
    if not cfg.system.data.val_files and not cfg.system.data.task:
        raise ConfigError("--data.val-files is empty: name the parquet file(s) to evaluate on")
    if cfg.system.data.val_batch_size < 1:
        raise ConfigError(f"--data.val-batch-size {cfg.system.data.val_batch_size}: must be at least 1")
    check_files(dataclasses.replace(cfg.data, train_files=[]), cfg.system.data)  # only the files evaluated
    out = Path(cfg.output)
    try:  # writable before the sampling, not after it (the samples would be lost)
        out.parent.mkdir(parents=True, exist_ok=True)
        with open(out, "a"):
            pass
    except OSError as e:
        raise ConfigError(f"--output {cfg.output}: cannot write there ({e.strerror or e}); pass a writable path") from e


def main(cfg: Config) -> dict[str, float]:
    """Sample, score, write the jsonl, print and return the estimators (plus "score": the mean score)."""
    from tqdm import tqdm

    from rlkit.data import build_prompts
    from rlkit.engine import set_threads
    from rlkit.rewards import RewardFn
    from rlkit.workers import ActorRolloutRefWorker

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    check(cfg)
    set_threads(cfg.num_threads)
    torch.manual_seed(cfg.seed)
    s = cfg.system
    reward_fn = RewardFn.from_config(cfg.reward, cfg.device, system=s.reward)
    # a generation-only worker (no optimizer, no reference copy); --rollout.name vllm gives it a vLLM engine
    system = System(model=s.model, data=s.data, rollout=s.rollout, reward=s.reward)  # the worker's: the rest at their defaults
    policy = ActorRolloutRefWorker(
        cfg.model, ActorConfig(), cfg.rollout, cfg.data, device=cfg.device, seed=cfg.seed, need_ref=False, trains=False, system=system
    )
    prompts = build_prompts(s.data.val_files, policy.tokenizer, cfg.data, s.data, s.data.val_max_samples, split="val")
    try:
        with tqdm(total=len(prompts) * cfg.n, desc=f"eval {len(prompts)} prompts x {cfg.n}", unit="sample", file=sys.stderr) as bar:
            records, _ = evaluation.sample(policy, prompts, reward_fn, s.data.val_batch_size, cfg.n, validate=False, progress=bar)
    finally:
        policy.close()
        reward_fn.close()
    out = Path(cfg.output)
    out.write_text("".join(json.dumps(r) + "\n" for r in records))
    metrics = {"score": sum(r["score"] for r in records) / len(records), **evaluation.from_records(records, cfg.n)}
    print(f"{cfg.model.path}: {len(prompts)} prompts x {cfg.n} samples at temperature {cfg.rollout.temperature} | samples: {out}")
    for k, v in metrics.items():
        print(f"  {k:<10} {v:.4f}")
    return metrics


def cli() -> None:
    """tyro over Config, with --model short for --model.path; a UserError ends in one line (as the recipes)."""
    from rlkit.errors import UserError
    from rlkit.recipe import expand_aliases

    cfg = tyro.cli(Config, description=__doc__, args=expand_aliases(sys.argv[1:]))
    try:
        main(cfg)
    except UserError as e:
        if os.environ.get("RLKIT_TRACEBACK"):
            raise
        print(f"\nrlkit: error: {e}\n(set RLKIT_TRACEBACK=1 for the full traceback)", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    cli()
