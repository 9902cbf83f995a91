"""SmolLM2-135M-Instruct on guess-the-number: SFT on imperfect traces, then GRPO with turn-level credit (issue #39).

    python scripts/guess_sft_rl.py --out runs/guess_smol                       # data, SFT, RL: the whole pipeline
    python scripts/guess_sft_rl.py --out runs/guess_smol --sft-steps 8 --rl-steps 6 --traces 128   # a short one

The task (rlkit.envs.GuessEnv): a secret in a 15-number range [lo, lo + 14] named in the prompt ("Guess my number,
23 to 37."), 4 guesses, replies "higher: a to b" / "lower: a to b"; reward 1 for finding it. Binary search always
wins; a scan from the bottom wins only when the secret is among the range's first 4 numbers.

1. data (written by this script into --out, seeded): `sft.parquet` holds --traces games played by the tiny-guess
   demo's mixed strategy (scripts/assets/tiny_guess.py: the midpoint of what the replies leave on --midpoint-share
   of the turns, else the range's lowest number), rendered with GuessEnv's own replies: imperfect demonstrations
   (the strategy wins ~35 %); `train.parquet` the RL prompts (lo in one set of offsets), `val.parquet` the
   held-out games (lo in another: ranges never seen in SFT or RL);
2. SFT: recipes/sft.py on sft.parquet (the assistant's guesses trained, the replies masked);
3. RL: recipes/grpo_tools.py --agent.env guess on train.parquet from the SFT checkpoint, --turn-credit
   turn_baseline, validating on val.parquet before the first step (the SFT model) and after the last (greedy).

Each stage's command is printed, then run as a subprocess; its wall time and its children's user CPU time are
printed and written to --out/rl/timings.json (--rl-out names that folder). The held-out success before and after RL is
the run's val/score at its first and last validation (--out/rl/metrics.jsonl); --val-every K validates every K steps.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # rlkit and scripts.assets of this checkout

WIDTH, MAX_GUESSES = 15, 4


def row(lo: int, secret: int, split: str, index: int) -> dict:
    """A guess row on [lo, lo + 14] (the demo's own, scripts/assets/tiny_guess.py)."""
    from scripts.assets import tiny_guess

    return tiny_guess.guess_row(secret, split, index, lo, lo + WIDTH - 1)


def play(lo: int, secret: int, midpoint_share: float, rng: random.Random) -> list[int]:
    """The mixed strategy's guesses on [lo, lo + 14] (the demo's own, scripts/assets/tiny_guess.py)."""
    from scripts.assets import tiny_guess

    return tiny_guess.play(secret, midpoint_share, rng, lo, lo + WIDTH - 1)


def trace(r: dict, guesses: list[int]) -> list[dict]:
    """One game as chat messages with GuessEnv's replies, as the turn loop renders an episode."""
    from rlkit.envs import GuessEnv

    env = GuessEnv()
    conv = list(env.reset({"prompt": r["prompt"], "ground_truth": r["reward_model"]["ground_truth"], "extra_info": r["extra_info"]}))
    for k, g in enumerate(guesses):
        conv.append({"role": "assistant", "content": str(g)})
        obs, _, done = env.step(str(g))
        if done or k == len(guesses) - 1:
            break
        conv += obs
    return conv


def write_data(out: Path, traces: int, n_train: int, n_val: int, midpoint_share: float, seed: int) -> dict:
    """sft.parquet, train.parquet, val.parquet; train ranges start at lo = 1, 3, 5, ... (odd), held-out ones at even lo."""
    import datasets

    rng = random.Random(seed)
    train_lo, val_lo = range(1, 86, 2), range(2, 86, 2)
    out.mkdir(parents=True, exist_ok=True)

    def draw(los, split, n):
        rows = []
        for i in range(n):
            lo = rng.choice(los)
            rows.append(row(lo, rng.randint(lo, lo + WIDTH - 1), split, i))
        return rows

    sft_rows = draw(train_lo, "sft", traces)
    convs = [trace(r, play(r["extra_info"]["lo"], int(r["reward_model"]["ground_truth"]), midpoint_share, rng)) for r in sft_rows]
    wins = sum(c[-1]["role"] == "assistant" and c[-1]["content"] == r["reward_model"]["ground_truth"] for c, r in zip(convs, sft_rows))
    datasets.Dataset.from_list([{"messages": c} for c in convs]).to_parquet(str(out / "sft.parquet"))
    datasets.Dataset.from_list(draw(train_lo, "train", n_train)).to_parquet(str(out / "train.parquet"))
    datasets.Dataset.from_list(draw(val_lo, "val", n_val)).to_parquet(str(out / "val.parquet"))
    return {"traces": traces, "trace_win_rate": wins / traces}


def run(name: str, cmd: list[str], timings: dict) -> None:
    print(f"\n[{name}] " + " ".join(cmd), flush=True)
    before, start = resource.getrusage(resource.RUSAGE_CHILDREN), time.monotonic()
    subprocess.run(cmd, check=True, cwd=ROOT)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    timings[name] = {"wall_s": round(time.monotonic() - start, 1), "user_cpu_s": round(after.ru_utime - before.ru_utime, 1)}
    print(f"[{name}] {timings[name]}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("runs/guess_smol"))
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--traces", type=int, default=256, help="SFT games of the mixed strategy")
    p.add_argument("--midpoint-share", type=float, default=0.3, help="the share of the traces' turns that bisect")
    p.add_argument("--sft-steps", type=int, default=16)
    p.add_argument("--sft-lr", type=float, default=1e-4)
    p.add_argument("--rl-steps", type=int, default=24)
    p.add_argument("--rl-lr", type=float, default=1e-5)
    p.add_argument("--rl-prompts", type=int, default=8, help="prompts per RL step (x --rollout-n games)")
    p.add_argument("--rollout-n", type=int, default=4)
    p.add_argument("--turn-credit", default="turn_baseline")
    p.add_argument("--rollout-name", default="hf", choices=["hf", "vllm"])
    p.add_argument("--val", type=int, default=48, help="held-out games (greedy)")
    p.add_argument("--val-every", type=int, default=8, help="RL steps between validations (0: before the first and after the last)")
    p.add_argument("--max-prompt-length", type=int, default=96)
    p.add_argument("--max-response-length", type=int, default=128, help="sampled + reply tokens of a whole game")
    p.add_argument("--skip-sft", action="store_true", help="reuse --out/sft's checkpoint (a rerun of the RL stage)")
    p.add_argument("--rl-out", default="rl", help="the RL run's folder under --out (a rerun of the RL stage needs a new one)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    out = a.out.resolve()
    sft_model = out / "sft" / "checkpoints" / f"global_step_{a.sft_steps}" / "hf"
    if a.rl_out in ("", ".", "..", "sft") or Path(a.rl_out).name != a.rl_out:
        p.error(f"--rl-out {a.rl_out!r}: give a plain folder name under --out other than 'sft' (e.g. --rl-out rl2)")
    for flag, value in (("--traces", a.traces), ("--sft-steps", a.sft_steps), ("--rl-steps", a.rl_steps), ("--val", a.val)):
        if value < 1:
            p.error(f"{flag} {value}: must be at least 1")
    if not 0 <= a.midpoint_share <= 1:
        p.error(f"--midpoint-share {a.midpoint_share}: a share of turns, in [0, 1]")
    if a.skip_sft and not sft_model.is_dir():
        p.error(f"--skip-sft: no SFT checkpoint at {sft_model}; run once without --skip-sft, or pass that run's --out and --sft-steps")
    timings: dict = {}
    start = time.monotonic()
    info = write_data(out, a.traces, 512, a.val, a.midpoint_share, a.seed)
    timings["data"] = {"wall_s": round(time.monotonic() - start, 1), **info}
    py = sys.executable
    sft_batch = 16
    lengths = ["--data.max-prompt-length", str(a.max_prompt_length), "--data.max-response-length", str(a.max_response_length)]
    run(
        "sft",
        [py, "recipes/sft.py", "--model", a.model, "--messages-key", "messages",
         "--data.train-files", str(out / "sft.parquet"), "--data.val-files",
         *lengths, "--data.train-batch-size", str(sft_batch), "--actor.ppo-mini-batch-size", str(sft_batch),
         "--actor.lr", str(a.sft_lr), "--actor.warmup-steps", "0",
         "--trainer.total-training-steps", str(a.sft_steps), "--trainer.test-freq", "0",
         "--trainer.num-threads", str(a.threads), "--trainer.seed", str(a.seed),
         "--trainer.default-local-dir", str(out / "sft")],
        timings,
    ) if not a.skip_sft else None  # fmt: skip
    run(
        "rl",
        [py, "recipes/grpo_tools.py", "--agent.env", "guess", "--model", str(sft_model), "--rollout.name", a.rollout_name,
         "--data.train-files", str(out / "train.parquet"), "--data.val-files", str(out / "val.parquet"),
         *lengths, "--data.val-max-samples", str(a.val),
         "--data.train-batch-size", str(a.rl_prompts), "--actor.ppo-mini-batch-size", str(a.rl_prompts),
         "--rollout.n", str(a.rollout_n), "--actor.lr", str(a.rl_lr), "--actor.no-use-kl-loss",
         "--turn-credit", a.turn_credit, "--trainer.total-training-steps", str(a.rl_steps),
         "--trainer.test-freq", str(a.val_every or a.rl_steps), "--trainer.save-freq", "0",
         "--trainer.num-threads", str(a.threads), "--trainer.seed", str(a.seed),
         "--trainer.default-local-dir", str(out / a.rl_out)],
        timings,
    )  # fmt: skip
    timings["total"] = {
        "wall_s": round(time.monotonic() - start, 1),
        "user_cpu_s": round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_utime, 1),
    }
    rows = [json.loads(x) for x in (out / a.rl_out / "metrics.jsonl").read_text().splitlines()]
    val = [(r["step"], r["val/score"]) for r in rows if "val/score" in r]
    curve = [(r["step"], round(r.get("critic/score/mean", float("nan")), 3)) for r in rows if "critic/score/mean" in r]
    summary = {"timings": timings, "held_out": val, "train_score": curve, "args": {k: str(v) for k, v in vars(a).items()}}
    (out / a.rl_out / "timings.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
