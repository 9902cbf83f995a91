"""What every recipe shares around its loop: the command line (`cli`), `setup`, timing, scoring, metrics, and `Run`
(the step schedule, validation, checkpoints, resume).

Nothing here is an algorithm. A recipe calls these so that its own file can show only the steps
of the algorithm.
"""

from __future__ import annotations

import os
import resource
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from rlkit import checkpoint, evaluation, sandbox
from rlkit.async_rollout import Rollouts  # noqa: F401  (recipes call recipe.Rollouts)
from rlkit.config import flag_values, nested
from rlkit.errors import ConfigError, RunExists, UserError
from rlkit.protocol import DataProto
from rlkit.tracking import Tracker

CUDA_DEVICE: torch.device | None = None  # the trainer's GPU (--trainer.device cuda:N, set by setup; passed explicitly: the
# current device is per thread); None: the current one
_OPEN_PEAKS: list[float] = []  # the GPU memory peaks (bytes) of the timer blocks now open, outermost first


def _fold_peak() -> None:
    """Fold the allocator's peak since its last reset into every open block's peak (before a reset, and on exit)."""
    peak = torch.cuda.max_memory_allocated(CUDA_DEVICE)
    _OPEN_PEAKS[:] = [max(p, peak) for p in _OPEN_PEAKS]


@contextmanager
def timer(name: str, timings: dict):
    """Adds the seconds spent in the block to timings[name].

    In a process that uses CUDA (the local backend on a GPU) also the block's peak GPU memory,
    timings["memory/<name>_peak_gb"]: torch.cuda.max_memory_allocated, reset when the block starts, so each
    phase (gen, ref, old_log_prob, update) shows its own peak; an enclosing block (step) gets the largest.
    On CPU nothing more: the step's metrics carry the process's peak RSS (perf/max_rss_gb).
    """
    cuda = torch.cuda.is_initialized()  # never creates a CUDA context (a Ray driver leaves the GPUs to its workers)
    if cuda:
        _fold_peak()
        torch.cuda.reset_peak_memory_stats(CUDA_DEVICE)
        _OPEN_PEAKS.append(0.0)
    start = time.perf_counter()
    try:
        yield
    finally:
        timings[name] = timings.get(name, 0.0) + time.perf_counter() - start
        if cuda:
            _fold_peak()
            key = f"memory/{name}_peak_gb"
            timings[key] = max(timings.get(key, 0.0), _OPEN_PEAKS.pop() / 2**30)


def decode_responses(batch: DataProto, tokenizer) -> list[str]:
    """The response text of every row (padding and EOS removed)."""
    ids = batch["responses"].masked_fill(batch["response_mask"] == 0, tokenizer.pad_token_id)
    return tokenizer.batch_decode(ids, skip_special_tokens=True)


def score(batch: DataProto, tokenizer, reward_fn) -> tuple[torch.Tensor, dict]:
    """One scalar per trajectory from the reward function, plus its metrics (a @batched one sees the groups: uid).
    (A recipe then hands a training batch's scores to its loader: train.record, for --data.sampler difficulty.)"""
    groups = batch["uid"] if "uid" in batch else None  # (validation rows have none: each its own group)
    responses = decode_responses(batch, tokenizer)
    scores, metrics = reward_fn(
        batch["data_source"], responses, batch["ground_truth"], batch["extra_info"], prompts=batch["raw_prompt"], groups=groups
    )
    if "env_reward" in batch:  # an environment's episode reward (rlkit/envs.py) adds to the scorer's
        scores = scores + batch["env_reward"].to(scores)
        metrics["reward/env"] = batch["env_reward"].mean().item()
    return scores, metrics


def batch_metrics(batch: DataProto, scores: torch.Tensor, max_response_length: int) -> dict:
    """What people watch about a rollout batch: score, advantage (and values, returns), lengths, entropy, KL to the reference."""
    mask = batch["response_mask"].float()
    length = mask.sum(-1)
    out = {
        "critic/score/mean": scores.mean().item(),
        "critic/score/std": scores.std(unbiased=False).item(),
        "response_length/mean": length.mean().item(),
        "response_length/max": length.max().item(),
        "response_length/clip_ratio": (length >= max_response_length).float().mean().item(),
        "prompt_length/mean": batch["attention_mask"][:, : batch["prompts"].shape[1]].sum(-1).float().mean().item(),
    }
    tokens = mask.sum().clamp(min=1)
    if "advantages" in batch:
        adv = batch["advantages"][mask.bool()]
        out.update(
            {
                "critic/advantages/mean": adv.mean().item(),
                "critic/advantages/max": adv.max().item(),
                "critic/advantages/min": adv.min().item(),
            }
        )
    for key in ("values", "returns"):  # a critic's estimates and its regression targets (PPO)
        if key in batch:
            v = batch[key][mask.bool()]
            out.update({f"critic/{key}/mean": v.mean().item(), f"critic/{key}/max": v.max().item(), f"critic/{key}/min": v.min().item()})
    if "entropys" in batch:
        out["actor/entropy"] = ((batch["entropys"] * mask).sum() / tokens).item()
    if "ref_log_prob" in batch and "old_log_probs" in batch:
        out["actor/kl_to_ref_k1"] = (((batch["old_log_probs"] - batch["ref_log_prob"]) * mask).sum() / tokens).item()
    return out


def mean_metrics(batches: list[tuple[dict, int]]) -> dict:
    """The metrics of several batches as one: each name's mean over the batches that report it, weighted by their
    rows; a count (reward/errors, reward/timeouts) is summed instead.

    batches: [(metrics, number of rows), ...], e.g. the reward metrics of every generation batch of a DAPO step.
    """
    sums: dict[str, float] = {}
    rows: dict[str, int] = {}
    for metrics, n in batches:
        for k, v in metrics.items():
            weight = 1 if k in COUNTS else n
            sums[k] = sums.get(k, 0.0) + float(v) * weight
            rows[k] = rows.get(k, 0) + weight
    return {k: sums[k] / rows[k] if k not in COUNTS else sums[k] for k in sums}


COUNTS = {"reward/errors", "reward/timeouts"}  # metrics that count events in a batch (summed), rather than average over its rows


def validate(policy, prompts, reward_fn, batch_size: int) -> dict:
    """Generate on every validation prompt (rollout.val_temperature; 0 = greedy) and average the scores."""
    tok = policy.tokenizer
    scores, extra = [], {}
    for start in range(0, len(prompts), batch_size):
        rows = list(range(start, min(start + batch_size, len(prompts))))
        out = policy.generate(prompts.batch(rows, tok.pad_token_id), validate=True)
        s, m = score(out, tok, reward_fn)
        scores.append(s)
        for k, v in m.items():
            extra.setdefault(k, []).append((v, len(rows)))
    scores = torch.cat(scores)
    res = {"val/score": scores.mean().item()}
    for k, pairs in extra.items():
        res["val/" + k.split("/", 1)[-1]] = sum(v * n for v, n in pairs) / sum(n for _, n in pairs)
    if "val/acc" not in res:  # scorer reports no accuracy: count full marks
        res["val/acc"] = (scores >= 1.0).float().mean().item()
    return res


def max_rss_gb() -> float:
    """Peak resident memory of this process, GiB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def state_of(obj) -> dict:
    """obj.state_dict(), or for a plain object (a KL controller, ...) a copy of its attributes."""
    return obj.state_dict() if hasattr(obj, "state_dict") else dict(vars(obj))


def load_state_into(obj, state: dict) -> None:
    """The inverse of state_of."""
    if hasattr(obj, "load_state_dict"):
        obj.load_state_dict(state)
    else:
        vars(obj).update(state)


def async_steps_of(cfg) -> int:
    """--trainer.async-steps of a recipe's Config; 0 for one without an asynchronous rollout (recipes/rm.py)."""
    a = getattr(cfg.system, "async_rollout", None)
    return a.async_steps if a is not None else 0


def run_name(cfg) -> str:
    """The default --trainer.experiment-name: the recipe's file name (the module of its Config), then the model and
    the data when they are not the recipe's defaults. grpo.py on the defaults -> "grpo"; with --model
    Qwen/Qwen2.5-0.5B-Instruct and --data.train-files gsm8k/train.parquet -> "grpo-qwen2.5-0.5b-instruct-gsm8k"."""
    import sys

    defaults = type(cfg)()  # the recipe's own defaults (grpo_tools.py's model and data are not grpo.py's)
    module = sys.modules.get(type(cfg).__module__)
    parts = [Path(getattr(module, "__file__", None) or "run").stem]
    if cfg.model.path != defaults.model.path:
        parts.append(Path(cfg.model.path.rstrip("/")).name)
    d = cfg.data
    task = getattr(cfg.system.data, "task", None)  # (recipes/rm.py, its BaseDataSystem: no generated tasks)
    if task:
        parts.append(task.split(":")[-1])
    elif d.train_files != defaults.data.train_files and d.train_files:
        f = Path(d.train_files[0])
        parts.append(f.parent.name if f.stem in ("train", "training") and f.parent.name else f.stem)
    return "-".join(parts).lower()


class Run:
    """Output folder, logging, validation schedule, checkpoints and resume for one training run.

    `stateful`: more things a checkpoint must hold besides the policy and the data position, by name
    (a critic worker, a KL controller, ...): saved with state_of, restored with load_state_into.
    `validate`: () -> metrics, the recipe's own validation of val_prompts in place of sampling them (rm.py: held-out
    pairs), on the same schedule; `val_metric` names the one the summary reports.
    """

    def __init__(
        self, cfg, policy, train_loader, val_prompts, reward_fn, stateful: dict | None = None, validate=None, val_metric="val/acc"
    ):
        t = cfg.system.trainer  # output, logging, checkpoints, the validation schedule
        self.cfg, self.policy, self.loader, self.val_prompts, self.reward_fn = cfg, policy, train_loader, val_prompts, reward_fn
        self.validate_fn, self.val_metric = validate, val_metric
        self.stateful = dict(stateful or {})
        self.rollouts = None  # the recipe's Rollouts, from steps(rollouts): its async/ metrics are logged, it is closed with the loop
        if {"policy", "loader", "val_history", "step", "rng"} & set(self.stateful):
            raise ValueError(f"Run(stateful=...): names {sorted(self.stateful)} clash with the checkpoint's own entries")
        if not t.experiment_name:  # resolved once, before the config is saved: a resumed run finds the same folder
            t.experiment_name = run_name(cfg)
        self.config = nested(flag_values(cfg))  # by flag name: --trainer.seed is config["trainer"]["seed"]
        self.out_dir = Path(t.default_local_dir.format(experiment_name=t.experiment_name, project_name=t.project_name))
        self.ckpt_dir = self.out_dir / "checkpoints"
        self.total_steps = cfg.trainer.total_training_steps or cfg.trainer.total_epochs * len(train_loader)
        self.start_step = 0
        self.val_history: list[tuple[int, float]] = []
        if getattr(cfg.data, "sampler", "uniform") == "difficulty":  # before resuming: its pass rates are in the checkpoint
            train_loader.use_sampler(cfg.data.sampler_weights)
        path = checkpoint.find_resume_path(t.resume, self.ckpt_dir)
        if path is not None:
            state, saved = checkpoint.load(path)
            checkpoint.check_config(saved, self.config)
            for name, obj in {"policy": policy, **self.stateful}.items():
                if hasattr(obj, "load_checkpoint"):  # a worker group: it reads its own folder (its shards)
                    if not (path / name).is_dir():
                        raise ConfigError(
                            f"cannot resume from {path}: it holds no {name}/ folder (saved by another recipe, or by an rlkit "
                            "older than per-worker checkpoint folders?)"
                        )
                    obj.load_checkpoint(path / name)
                elif name not in state:
                    raise ConfigError(f"cannot resume from {path}: it holds no {name!r} state (saved by another recipe?)")
                else:
                    load_state_into(obj, state[name])
            train_loader.load_state_dict(state["loader"])
            self.start_step = state["step"]
            checkpoint.set_aside_later(self.ckpt_dir, self.start_step)  # an older step: the later branch moves aside
            self.val_history = state.get("val_history", [])
        elif t.resume == "disable" and checkpoint.list_checkpoints(self.ckpt_dir):
            raise RunExists(
                f"{self.ckpt_dir} already holds checkpoints of an earlier run. Continue it with --trainer.resume auto, "
                "or start a new one with another --trainer.experiment-name (nothing was overwritten)"
            )
        self.tracker = Tracker(self.out_dir, t.logger, t.project_name, t.experiment_name, self.config, self.total_steps, self.start_step)
        trainable, total = policy.num_params()
        try:  # device, dtypes, attention implementation (a worker without describe: none)
            describe = policy.describe() + " | "
        except AttributeError:
            describe = ""
        describe += sandbox.start_clause(cfg) + " | "  # where model-written text runs, and how contained (docs/sandbox.md)
        async_steps = async_steps_of(cfg)
        if async_steps:  # the trainer's own rollout (above) only validates
            describe += f"async: a generation worker samples {async_steps} batch(es) ahead with {cfg.system.rollout.name} | "
        per_step = f"prompts x {cfg.rollout.n} samples" if hasattr(cfg, "rollout") else "rows"  # recipes/rm.py: pairs, no rollout
        self.tracker.message(
            f"model {cfg.model.path}: {total / 1e6:.2f}M parameters, {trainable / 1e6:.2f}M trainable | {describe}"
            f"{self.total_steps} steps of {cfg.data.train_batch_size} {per_step} | output {self.out_dir}"
            + (f" | resumed at step {self.start_step}" if self.start_step else "")
            + (
                " (async: the prompts an uninterrupted run draws, sampled afresh: the samples differ)"
                if self.start_step and async_steps
                else ""
            )
        )

    def steps(self, rollouts=None):
        """Step numbers still to run (1-based); validates before the first when asked. `rollouts`: the recipe's
        Rollouts, whose async/ metrics each step logs and whose loader position a checkpoint saves; when the loop
        ends, or stops on an error, they are closed (no generation process outlives the loop)."""
        t = self.cfg.system.trainer
        self.rollouts = rollouts
        if async_steps_of(self.cfg) and self.rollouts is None:
            raise ConfigError(
                f"--trainer.async-steps {async_steps_of(self.cfg)}: this recipe has no asynchronous loop (it makes no recipe.Rollouts); use 0"
            )
        if self.start_step == 0 and t.val_before_train and self.val_prompts is not None:
            self.validate(0)
        try:
            yield from range(self.start_step + 1, self.total_steps + 1)
        finally:
            if self.rollouts is not None:
                self.rollouts.close()

    def validate(self, step: int) -> dict:
        """Run validation, print it, remember it for the final summary."""
        args = (self.policy, self.val_prompts, self.reward_fn, self.cfg.system.data.val_batch_size)
        if self.validate_fn is not None:  # the recipe's own
            metrics = self.validate_fn()
        elif (n := self.cfg.system.trainer.val_n) > 1:  # n samples per prompt: + val/mean@n, val/pass@k, val/maj@k
            metrics = evaluation.validate_n(*args, n, self.cfg.system.rollout.val_temperature)
        else:
            metrics = validate(*args)
        self.val_history.append((step, metrics[self.val_metric]))
        self.tracker.message(f"validation at step {step}: " + ", ".join(f"{k} {v:.3f}" for k, v in metrics.items()))
        if step == 0:
            self.tracker.log(0, metrics)
        return metrics

    def end_of_step(self, step: int, metrics: dict, timings: dict, batch: DataProto) -> None:
        """Validate / log / checkpoint on their schedules."""
        t = self.cfg.system.trainer
        last = step == self.total_steps
        if self.val_prompts is not None and ((t.test_freq > 0 and step % t.test_freq == 0) or last):
            metrics.update(self.validate(step))
        tokens = int(batch["attention_mask"].sum())
        if self.rollouts is not None:
            metrics.update(self.rollouts.metrics())  # async/staleness, ... (--trainer.async-steps > 0)
        metrics.update({(k if k.startswith("memory/") else f"timing/{k}"): v for k, v in timings.items()})
        metrics["perf/throughput"] = tokens / max(timings.get("step", 0.0), 1e-9)
        metrics["perf/max_rss_gb"] = max_rss_gb()
        metrics["training/epoch"] = batch.meta.get("epoch", 0)
        self.tracker.log(step, metrics)
        if (t.save_freq > 0 and step % t.save_freq == 0) or last:
            self.save(step)

    def save(self, step: int) -> Path:
        """Checkpoint `step`: worker groups (the policy, a critic) write their own folders, the rest goes in state.pt."""
        groups = {name: obj for name, obj in {"policy": self.policy, **self.stateful}.items() if hasattr(obj, "save_checkpoint")}
        queued = self.rollouts.loader_state() if self.rollouts is not None else None  # async: before the batches still queued
        state = {"loader": queued or self.loader.state_dict(), "val_history": self.val_history}
        state.update({name: state_of(obj) for name, obj in self.stateful.items() if name not in groups})
        return checkpoint.save(
            self.ckpt_dir,
            step,
            state,
            self.config,
            save_hf=self.policy.save_pretrained,
            keep=self.cfg.system.trainer.max_ckpt_to_keep,
            parts={name: g.save_checkpoint for name, g in groups.items()},
        )

    def finish(self) -> dict:
        """Close the logs, draw the learning curve, close what the run was given (worker groups, the reward)
        and print the before/after summary."""
        png = self.tracker.finish()
        for part in [
            self.rollouts,
            *self.stateful.values(),
            self.reward_fn,
            self.policy,
        ]:  # worker groups: stop Ray workers, free pools, engines
            if hasattr(part, "close"):
                part.close()
        summary = {"out_dir": str(self.out_dir), "learning_curve": str(png)}
        if len(self.val_history) >= 2:
            (s0, a0), (s1, a1) = self.val_history[0], self.val_history[-1]
            summary.update(val_acc_before=a0, val_acc_after=a1)
            print(f"held-out accuracy: {a0:.3f} at step {s0} -> {a1:.3f} at step {s1} ({100 * (a1 - a0):+.1f} points)")
        print(f"metrics: {self.out_dir / 'metrics.jsonl'} | learning curve: {png} | checkpoints: {self.ckpt_dir}")
        return summary


def setup(cfg) -> None:
    """Before anything loads: quiet library defaults, torch threads, the seed, the GPU, and batch-size checks."""
    global CUDA_DEVICE
    from rlkit.engine import set_threads

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    t = cfg.system.trainer
    set_threads(t.num_threads)
    torch.manual_seed(cfg.trainer.seed)
    scale_out = getattr(cfg.system, "scale_out", None)  # (recipes/rm.py: none, always local)
    if (scale_out is None or scale_out.backend == "local") and t.device.startswith("cuda:"):  # this process trains on GPU N
        if getattr(getattr(cfg.system, "rollout", None), "name", "") == "vllm" and torch.device(t.device).index:
            raise ConfigError(  # vLLM's in-process engine takes the first visible GPU whatever the current one is
                f"--trainer.device {t.device} with --rollout.name vllm: vLLM would start on cuda:0; choose the GPU with "
                f"CUDA_VISIBLE_DEVICES={torch.device(t.device).index} and --trainer.device cuda"
            )
        CUDA_DEVICE = torch.device(t.device)
        torch.cuda.set_device(CUDA_DEVICE)
    preflight(cfg)


def preflight(cfg) -> None:
    """Flags, data files and the reward function, checked in seconds before any model loads (rlkit/errors.py messages);
    then rlkit/preflight.py's checks (the prompts tokenized, agent, async and Megatron flags: before Ray starts too)."""
    from rlkit import preflight as checks
    from rlkit.config import check_flags
    from rlkit.data import check_files
    from rlkit.rewards import load_function

    check_flags(cfg)
    if getattr(cfg, "rl_rows", True):  # sft.py, rm.py: conversations, pairs -- not RL prompt rows; they check their own
        check_files(cfg.data, cfg.system.data)
    if getattr(cfg, "reward", None) and cfg.reward.custom_fn:
        load_function(cfg.reward.custom_fn)
    checks.run(cfg)


def expand_aliases(argv: list[str]) -> list[str]:
    """`--model X` (and `--model=X`) is short for `--model.path X`."""
    out = []
    for i, arg in enumerate(argv):
        if arg == "--model" and i + 1 < len(argv) and not argv[i + 1].startswith("-"):
            out.append("--model.path")
        elif arg.startswith("--model="):
            out.append("--model.path=" + arg.split("=", 1)[1])
        else:
            out.append(arg)
    return out


def preset(config_cls, flag: str, presets: dict, argv: list[str] | None = None):
    """The Config class a command line starts from: presets[value] when it gives `flag value` (or flag=value; the
    last one counts), else config_cls. Chosen before parsing, so a flag given explicitly always wins over a preset's
    defaults (recipes/grpo_tools.py: --agent.env guess)."""
    import sys

    argv = sys.argv[1:] if argv is None else argv
    value = None
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
    return presets.get(value, config_cls)


def cli(main, config_cls):
    """Parse the command line into `config_cls` with tyro and run `main(cfg)`.

    A `UserError` (a mistake in the input: rlkit/errors.py) ends with one line naming the problem and the
    fix and exit status 1 (set RLKIT_TRACEBACK=1 to see its traceback); any other exception is a bug and
    keeps its traceback.
    """
    import sys

    import tyro

    cfg = tyro.cli(config_cls, description=sys.modules[main.__module__].__doc__, args=expand_aliases(sys.argv[1:]))
    try:
        return main(cfg)
    except UserError as e:
        if os.environ.get("RLKIT_TRACEBACK"):
            raise
        print(f"\nrlkit: error: {e}\n(set RLKIT_TRACEBACK=1 for the full traceback)", file=sys.stderr)
        sys.exit(1)
