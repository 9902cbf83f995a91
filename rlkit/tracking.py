"""Logging what RL users watch: metrics.jsonl (always), a console progress bar, optional wandb,
and a learning-curve PNG at the end.

    tracker = Tracker("runs/gsm8k", loggers=["console", "wandb"], config=cfg, total_steps=200)
    tracker.log(step, {"critic/score/mean": 0.41, "val/acc": 0.62, ...})
    tracker.finish()  # -> runs/gsm8k/learning_curve.png
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from tqdm.auto import tqdm

from rlkit.errors import ConfigError

LOGGERS = ["console", "wandb"]
# The metrics the console line shows (those present), in this order.
WATCHED = [
    "critic/score/mean",
    "critic/score/std",
    "val/acc",
    "response_length/mean",
    "actor/kl_loss",
    "actor/pg_clipfrac",
    "actor/entropy",
    "actor/grad_norm",
    "timing/step",
    "perf/throughput",
]
_SHORT = {
    "val/acc": "val/acc {}",
    "response_length/mean": "len {}",
    "actor/kl_loss": "kl {}",
    "actor/pg_clipfrac": "clip {}",
    "actor/entropy": "ent {}",
    "actor/grad_norm": "gnorm {}",
    "timing/step": "{}s/step",
    "perf/throughput": "{} tok/s",
}


def _fmt(x: float) -> str:
    return f"{x:.4g}"


def console_line(step: int, metrics: dict[str, float]) -> str:
    """One compact line of the watched metrics present, e.g. "step 3 | score 0.41±0.49 | kl 0.0012"."""
    parts = [f"step {step}"]
    if "critic/score/mean" in metrics:
        std = metrics.get("critic/score/std")
        parts.append(f"score {_fmt(metrics['critic/score/mean'])}" + (f"±{_fmt(std)}" if std is not None else ""))
    parts += [_SHORT[k].format(_fmt(metrics[k])) for k in WATCHED if k in _SHORT and k in metrics]
    return " | ".join(parts)


def read_metrics(path: str | Path) -> list[dict]:
    """Parse a metrics.jsonl into a list of dicts (a missing file, blank or half-written lines are skipped)."""
    path = Path(path)
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


class Tracker:
    """Writes out_dir/metrics.jsonl + config.json, and mirrors each step to the chosen loggers."""

    def __init__(
        self,
        out_dir: str | Path,
        loggers: list[str] | None = None,
        project: str = "rlkit",
        run_name: str = "run",
        config: dict | None = None,
        total_steps: int | None = None,
        resume_step: int = 0,
    ):
        if loggers is None:
            loggers = ["console"]
        unknown = [name for name in loggers if name not in LOGGERS]
        if unknown:
            raise ConfigError(f"unknown logger(s) {unknown}; choose from {LOGGERS}")
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.out_dir / "metrics.jsonl"
        self.title = run_name
        (self.out_dir / "config.json").write_text(json.dumps(config or {}, indent=2, default=str))
        # A fresh run starts an empty file; a resumed one keeps only steps <= resume_step, so replayed
        # steps are never duplicated. Rewriting the kept lines also drops a half-written last line.
        kept = [r for r in read_metrics(self.metrics_path) if resume_step > 0 and r.get("step", 0) <= resume_step]
        self.metrics_path.write_text("".join(json.dumps(r) + "\n" for r in kept))

        self.bar = None
        if "console" in loggers:
            self.bar = tqdm(total=total_steps, initial=resume_step, desc=run_name, unit="step", dynamic_ncols=True)
        self.wandb = None
        if "wandb" in loggers:
            import wandb  # lazy: only users of the wandb logger need it installed

            mode = None
            if "WANDB_MODE" not in os.environ and not os.environ.get("WANDB_API_KEY") and not _has_wandb_key(wandb):
                mode = "offline"
                self.message(f"wandb: no API key found, logging offline to {self.out_dir}/wandb (upload later with `wandb sync`)")
            # Keep the run id in out_dir so a resumed run continues the same wandb run (a fresh one gets a new id).
            id_file = self.out_dir / "wandb_run_id"
            if resume_step == 0 or not id_file.exists():
                from wandb.sdk.lib.runid import generate_id

                id_file.write_text(generate_id())
            self.wandb = wandb.init(
                project=project,
                name=run_name,
                config=config,
                dir=str(self.out_dir),
                id=id_file.read_text().strip(),
                resume="allow",
                mode=mode,
            )

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Record one step: a JSON line, a console line, a wandb point, and advance the progress bar."""
        metrics = {k: float(v) for k, v in metrics.items()}  # tensors / numpy scalars -> float
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps({"step": step, **metrics}) + "\n")
        if self.bar is not None:
            tqdm.write(console_line(step, metrics))
            if step > self.bar.n:
                self.bar.update(step - self.bar.n)
        if self.wandb is not None:
            self.wandb.log(metrics, step=step)

    def message(self, text: str) -> None:
        """Print a line above the progress bar, e.g. "validation before training: acc 0.23"."""
        tqdm.write(text)

    def finish(self) -> Path:
        """Close the bar and the wandb run, and write out_dir/learning_curve.png; returns the PNG path."""
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None
        return plot_learning_curve(self.metrics_path, self.out_dir / "learning_curve.png", title=self.title)


def _has_wandb_key(wandb) -> bool:
    try:  # wandb >= 0.2x: checks env, settings files and .netrc, without prompting or network
        return bool(wandb.login(prompt=False, verify=False))
    except Exception:
        return getattr(getattr(wandb, "api", None), "api_key", None) is not None


def rolling_mean(xs: list[float], window: int) -> list[float]:
    """Mean of the last `window` values at each point (fewer at the start)."""
    out, total = [], 0.0
    for i, x in enumerate(xs):
        total += x - (xs[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def plot_learning_curve(metrics_jsonl: str | Path, out_png: str | Path, title: str = "") -> Path:
    """Plot reward (left; with the tool-call rate of a tool-use run) and held-out accuracy (right; response length if
    no val/acc) to out_png."""
    from matplotlib.figure import Figure  # no pyplot: renders with Agg, never needs a display

    rows, out_png = read_metrics(metrics_jsonl), Path(out_png)

    def series(key):
        pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
        return [p[0] for p in pts], [p[1] for p in pts]

    if not rows:
        fig = Figure(figsize=(6, 3))
        ax = fig.subplots()
        ax.text(0.5, 0.5, "no metrics yet", ha="center", va="center", fontsize=14)
        ax.set_axis_off()
        fig.suptitle(title)
        fig.savefig(out_png, dpi=100)
        return out_png

    fig = Figure(figsize=(12, 4.5))
    left, right = fig.subplots(1, 2)
    steps, score = series("critic/score/mean")
    if steps:  # a 0/1 reward's std spans the plot and says nothing: the per-step mean, faint, and its rolling mean
        window = max(1, min(10, len(steps) // 5))
        left.plot(steps, score, color="C0", alpha=0.35 if window > 1 else 1, marker="" if len(steps) > 10 else "o", label="per step")
        if window > 1:
            left.plot(steps, rolling_mean(score, window), color="C0", lw=2, label=f"mean of the last {window} steps")
        tsteps, rate = series("agent/tool_call_rate")  # tool-use runs (recipes/grpo_tools.py)
        if tsteps:
            left.plot(tsteps, rate, color="C3", ls="--", label="tool-call rate")
        left.legend(loc="lower right")
    left.set(title="reward (training batch)", xlabel="step", ylabel="critic/score/mean")

    vsteps, vacc = series("val/acc")
    if vsteps:
        right.plot(vsteps, vacc, marker="o", color="C2")
        ends = {0, len(vsteps) - 1}  # labels on the first and last point only: more would overlap
        for i in sorted(ends):
            right.annotate(f"{vacc[i]:.2f}", (vsteps[i], vacc[i]), textcoords="offset points", xytext=(0, 8), ha="center")
        right.margins(y=0.15)  # room for the labels
        right.set(title="held-out accuracy", ylabel="val/acc")
        title = " — ".join(t for t in [title, f"val acc {vacc[0]:.2f} → {vacc[-1]:.2f}"] if t)
    else:
        lsteps, length = series("response_length/mean")
        right.plot(lsteps, length, color="C1", marker="o" if len(lsteps) <= 10 else "")
        right.set(title="response length", ylabel="response_length/mean")
    right.set_xlabel("step")
    for ax in (left, right):
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out_png, dpi=100)
    return out_png
