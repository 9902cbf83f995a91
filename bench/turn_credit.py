"""Turn-level credit vs the summed outcome on guess-the-number with shaped per-turn rewards (issue #39, item 1).

The env is GuessEnv with a shaping reward on every guess: 0.5 x the share of the remaining range the guess rules
out (a bisecting guess earns ~0.25, a scan from the bottom ~0.5/n), and 1 for finding the secret. The policy is the
embedded tiny-guess model (scripts/assets/tiny_guess.py: it scans on 70 % of its turns, bisects on 30 %), trained by
recipes/grpo_tools.py with each --turn-credit for the same steps and seeds. Reported: per step, the share of the
training batch's sampled games that found the secret (the shaping aside), and the first step whose 3-step moving
average reaches --target.

    python bench/turn_credit.py --credits outcome,return_to_go,step_group,turn_baseline --seeds 0,1 --steps 20
"""

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rlkit import agent, envs  # noqa: E402

sys.path.insert(0, str(ROOT / "bench"))
import common  # noqa: E402

CREDITS = ("outcome", "return_to_go", "step_group", "turn_baseline")  # recipes/grpo_tools.py's --turn-credit choices

MAX_GUESSES = 4  # --agent.max-turns of --agent.env guess

FOUND: list[float] = []  # 1/0 per finished training game since the last step's metrics


def found() -> list[float]:
    """FOUND of the script run as __main__ (--agent.env loads this file again, as another module)."""
    return getattr(sys.modules["__main__"], "FOUND", FOUND)


class ShapedGuess(envs.GuessEnv):
    """GuessEnv + 0.5 x the share of the range [lo, hi] a wrong guess rules out."""

    def step(self, action):
        before = self.hi - self.lo + 1
        obs, reward, done = super().step(action)
        if done:
            found().append(1.0)
            return obs, reward, done
        self.turns_left = getattr(self, "turns_left", MAX_GUESSES) - 1
        if self.turns_left <= 0:
            found().append(0.0)
        return obs, 0.5 * (before - (self.hi - self.lo + 1)) / before, done


def make_env():
    return ShapedGuess()


def run(credit: str, seed: int, steps: int, out: Path, batch: int = 16) -> list[float]:
    sys.path.insert(0, str(ROOT / "recipes"))
    import grpo_tools

    cfg = grpo_tools.GuessConfig()  # --agent.env guess's defaults, with this file's env
    assert cfg.agent.max_turns == MAX_GUESSES
    cfg.agent.env = f"{Path(__file__).resolve()}:make_env"
    cfg.turn_credit = credit
    cfg.data.train_batch_size = cfg.actor.ppo_mini_batch_size = batch
    cfg.rollout.n = 8
    cfg.trainer.total_training_steps = steps
    cfg.system.trainer.test_freq = 0
    cfg.system.trainer.save_freq = 0
    cfg.trainer.seed = seed
    cfg.system.trainer.default_local_dir = str(out)
    cfg.system.data.val_files = []
    success = []
    original = agent.agent_metrics

    def metrics(batch):  # the share of this batch's games that found the secret (games cut by the token budget: not)
        m = original(batch)
        success.append(sum(FOUND) / len(batch["agent_turns"]))
        FOUND.clear()
        return m

    agent.agent_metrics = metrics
    try:
        grpo_tools.main(cfg)
    finally:
        agent.agent_metrics = original
    return success


def first_at(curve: list[float], target: float, window: int = 3) -> int | None:
    for i in range(window, len(curve) + 1):
        if sum(curve[i - window : i]) / window >= target:
            return i
    return None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--credits", default="outcome,return_to_go,step_group,turn_baseline", help="comma-separated --turn-credit values")
    p.add_argument("--seeds", type=common.ints, default="0,1", help="comma-separated seeds")
    p.add_argument("--steps", type=int, default=20, help="training steps per run")
    p.add_argument("--batch", type=int, default=16, help="prompts per step (x 8 games each)")
    p.add_argument("--target", type=float, default=0.55, help="the training find rate (3-step moving average) to reach")
    p.add_argument("--out", default="outputs/bench_turn_credit", help="where the runs write")
    a = p.parse_args(argv)
    credits = common.names(p, "--credits", a.credits, CREDITS)
    rows = []
    for credit in credits:
        for seed in a.seeds:
            start = time.monotonic()
            curve = run(credit, seed, a.steps, Path(a.out) / f"{credit}-{seed}", a.batch)
            rows.append({"credit": credit, "seed": seed, "curve": curve, "steps_to_target": first_at(curve, a.target)})
            rows[-1]["seconds"] = round(time.monotonic() - start, 1)
            print(json.dumps(rows[-1]), flush=True)
    print(f"\n| --turn-credit | seed | steps to {a.target} | first 3 | last 3 | s |\n|---|---|---|---|---|---|")
    for r in rows:
        c = r["curve"]
        print(
            f"| {r['credit']} | {r['seed']} | {r['steps_to_target'] or f'> {a.steps}'} | {sum(c[:3]) / 3:.3f} | {sum(c[-3:]) / 3:.3f} | {r['seconds']:.0f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
