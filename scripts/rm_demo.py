"""SFT -> RM -> RL on the embedded task: preference pairs, a Bradley-Terry reward model, GRPO on it.

    python scripts/rm_demo.py pairs     # rlkit/assets/arith-prefs/{train,val}.parquet: the policy's mistakes (~90 s)
    python scripts/rm_demo.py pairs --mirror --near-miss 6 --out outputs/rm_demo/pairs-mix   # stage 2's mix (~90 s)
    python scripts/rm_demo.py init      # outputs/rm_demo/rm-init: the policy + 300 SFT steps (0.996 greedy; ~1.5 min)
    python scripts/rm_demo.py run --rm-init outputs/rm_demo/rm-init   # recipes/rm.py from it: 1500 steps on the
                                        # mistakes, 6000 on the mix; then recipes/grpo.py on the RM, one epoch, each
                                        # checkpoint scored by the exact scorer (~50 min)
    python scripts/rm_demo.py iterate --rm outputs/rm_demo/rm-mix/checkpoints/global_step_6000/hf   # online RLHF

Pairs: for a prompt "What is a+b?" the chosen response is the right answer; the rejected ones are the
distinct wrong answers (at most 2) among 8 the policy itself sampled (temperature 1: the mistakes it
makes); --near-miss adds near misses (the answer +-1, +-10, +-20: the units digit, and the tens digit where the
carry lands), --mirror each mistake mirrored about the truth (c + d -> c - d). Train pairs come from the task's
train split, val pairs from its held-out split.

`run` trains the RM in two stages (the policy's mistakes, lr 1e-3; then the mix, lr 3e-4: docs/rm.md says why),
then GRPO with --reward.model-path on its export, saving checkpoints along the way; each checkpoint is evaluated
greedily on the held-out prompts by the exact scorer (true accuracy) and by the RM (its reward): the curve RM
reward vs true accuracy (docs/rm.md), written to <out>/curve.json. `iterate` repeats [pairs from the current
policy -> the RM continues -> GRPO continues] (iterate.json).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rlkit import demos  # noqa: E402
from scripts.assets import common, tiny_arith  # noqa: E402

OUT = demos.PREFS_DATA


NEAR = (-1, 1, -10, 10, -20, 20)  # the units digit, the tens digit (where the carry lands) one and two off


def near_misses(answer: int, rng: random.Random, k: int) -> list[str]:
    """k distinct wrong answers one or two digits' steps away from `answer` (NEAR, never negative; k=6: all)."""
    cands = [answer + d for d in NEAR if answer + d >= 0]
    rng.shuffle(cands)
    return [str(c) for c in cands[:k]]


def mirrored(truth: str, wrong: str) -> str | None:
    """The same mistake on the other side of the truth: c - (w - c) for a numeric wrong answer w (None if not a
    number or negative). Mirrored negatives make the direction of an error carry no signal: without them the RM
    learns that the policy's mistakes run high (56 % of them), and GRPO walks every answer down."""
    w = wrong.strip()
    if w != wrong or not w.isdigit():
        return None
    m = 2 * int(truth) - int(w)
    return str(m) if m >= 0 else None


def make_pairs(split_rows, samples: int, near_miss: int, seed: int, mirror: bool = False, policy=None) -> list[dict]:
    """Rows (prompt, chosen, rejected): per problem, each distinct wrong sample of the policy (at most 2), `near_miss`
    near misses, and with `mirror` each numeric mistake mirrored about the truth."""
    rng = random.Random(seed)
    prompts = [r["prompt"] for r in split_rows]
    sampled = tiny_arith.sample_answers(prompts, samples, seed, model_dir=policy or demos.ARITH_MODEL)
    rows = []
    for r, answers in zip(split_rows, sampled):
        truth = r["reward_model"]["ground_truth"]
        wrong = list(dict.fromkeys(a for a in answers if a.strip() != truth))[:2]
        wrong += [w for w in near_misses(int(truth), rng, near_miss) if w not in wrong]
        if mirror:
            wrong += [m for m in (mirrored(truth, w) for w in wrong) if m not in (None, truth, *wrong)]
        rows += [{"prompt": r["prompt"], "chosen": truth, "rejected": w} for w in wrong]
    return rows


def write_pairs(
    out: Path, train_problems: int, val_problems: int, samples: int, near_miss: int, seed: int, mirror: bool = False, policy=None
) -> tuple[Path, Path]:
    import datasets

    out.mkdir(parents=True, exist_ok=True)
    train, val = tiny_arith.arith_problems(0)  # the task's own split: val problems are held out
    paths = []
    for split, problems, n in (("train", train, train_problems), ("val", val, val_problems)):
        rows = [tiny_arith.arith_row(a, b, split, i) for i, (a, b) in enumerate(problems[:n])]
        pairs = make_pairs(rows, samples, near_miss, seed + (split == "val"), mirror, policy)
        path = out / f"{split}.parquet"
        datasets.Dataset.from_list(pairs).to_parquet(str(path))
        print(f"{path}: {len(pairs)} pairs from {len(rows)} problems")
        paths.append(path)
    return paths[0], paths[1]


def grow(model, extra_layers: int, seed: int):
    """`model` (a Llama-shaped causal LM) with `extra_layers` fresh decoder layers on top, each the identity at first
    (its attention and MLP output projections zero: the residual stream passes through unchanged)."""
    import copy

    import torch
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(model.config)
    config.num_hidden_layers += extra_layers
    torch.manual_seed(seed)
    grown = AutoModelForCausalLM.from_config(config)
    missing, unexpected = grown.load_state_dict(model.state_dict(), strict=False)
    assert not unexpected and all(".layers." in k for k in missing), (missing, unexpected)
    for layer in grown.model.layers[config.num_hidden_layers - extra_layers :]:
        torch.nn.init.zeros_(layer.self_attn.o_proj.weight)
        torch.nn.init.zeros_(layer.mlp.down_proj.weight)
    return grown


def rm_init(out: Path, sft_steps: int, extra_layers: int, seed: int, layers: int = 0, hidden: int = 128) -> Path:
    """The RM's starting point (a causal LM folder that recipes/rm.py loads with --model): the embedded policy after
    `sft_steps` more SFT steps (recipes/sft.py, lr 1e-3: it then generates the sums ~99 % right), grown by
    `extra_layers` fresh decoder layers on top (0 by default: grown RMs learned no better, docs/results.md), each
    starting as the identity (output projections zero). Why grow: in the policy the digit it predicts next is formed
    by its last layer, so no layer can compare that prediction with the digit that follows; a layer above can
    (attend to the previous position's prediction, compare with its own token), and one more can gather the
    mismatches at the last token, where the head reads.
    layers > 0: a fresh model of `layers` x `hidden` instead (common.build_model, the embedded tokenizer), trained
    from scratch by the same SFT: an RM larger than the policy, as RLHF pipelines use."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(demos.ARITH_MODEL)
    if layers:
        model = common.build_model(len(tok), tok.pad_token_id, tok.eos_token_id, hidden, layers, seed)
        model.generation_config.eos_token_id, model.generation_config.pad_token_id = tok.eos_token_id, tok.pad_token_id
    else:
        model = AutoModelForCausalLM.from_pretrained(demos.ARITH_MODEL)
    train, val = tiny_arith.arith_problems(0)
    convs = [
        tiny_arith.arith_row(a, b, "", 0)["prompt"] + [{"role": "assistant", "content": str(a + b)}]
        for a, b in common.sft_traces(train, sft_steps, 64, seed + 1)
    ]
    if sft_steps:
        model = common.warm_start(model, tok, convs, sft_steps, lr=1e-3, warmup=100 if layers else 10, seed=seed + 1)
    acc = tiny_arith.greedy_accuracy(model, tok, val[:256])
    grown = grow(model, extra_layers, seed) if extra_layers else model
    readme = (
        f"The RM demo's starting point (scripts/rm_demo.py init): "
        f"{f'a fresh {layers} x {hidden} model' if layers else 'the embedded policy'} + {sft_steps} SFT steps "
        f"(held-out greedy accuracy {acc:.3f} on 256) + {extra_layers} identity-initialised layers.\n"
    )
    common.save_asset(grown, tok, out, readme)
    print(readme.strip())
    return out


def greedy_eval(model_dir, rm_dir, n_val: int) -> dict:
    """Greedy answers of the policy at model_dir on the first n_val held-out problems: accuracy by the exact scorer and
    the RM's mean reward on the same answers."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlkit import evaluation
    from rlkit.reward_model import RewardModel
    from rlkit.rewards import RewardFn

    _, val = tiny_arith.arith_problems(0)
    rows = [tiny_arith.arith_row(a, b, "val", i) for i, (a, b) in enumerate(val[:n_val])]
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    answers = [t for (t,) in evaluation.chat_texts(model, tok, [r["prompt"] for r in rows], max_new_tokens=8)]
    exact = RewardFn(sandbox="off")
    truth = [r["reward_model"]["ground_truth"] for r in rows]
    acc, _ = exact([demos.ARITH_SOURCE] * len(rows), answers, truth)
    rm = RewardModel(str(rm_dir), "cpu")([r["prompt"] for r in rows], answers)
    return {"acc": acc.mean().item(), "rm_reward": rm.mean().item(), "examples": answers[:8]}


def sh(cmd: list[str], log: Path) -> None:
    print("$", " ".join(cmd), flush=True)
    with open(log, "w") as f:
        if subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT) != 0:
            raise SystemExit(f"failed: see {log}")


def train_rm(args, model, pairs: Path, out: Path, name: str, steps: int, lr: float, *flags: str) -> Path:
    """recipes/rm.py from `model` on pairs/{train,val}.parquet for `steps` steps at `lr`; returns its last export."""
    sh(
        [sys.executable, "recipes/rm.py", "--model", str(model), "--data.train-files", str(pairs / "train.parquet"),
         "--data.val-files", str(pairs / "val.parquet"), "--trainer.total-training-steps", str(steps),
         "--actor.lr", str(lr), "--data.train-batch-size", str(args.rm_batch),
         "--trainer.default-local-dir", str(out / "{experiment_name}"), "--trainer.experiment-name", name, *flags],
        out / f"{name}.log",
    )  # fmt: skip
    return out / name / "checkpoints" / f"global_step_{steps}" / "hf"


def train_grpo(args, rm: Path, out: Path, name: str, *flags: str) -> Path:
    """recipes/grpo.py on the RM `rm` for --rl-steps steps (then --rl-args); returns its checkpoints folder."""
    sh(
        [sys.executable, "recipes/grpo.py", "--reward.model-path", str(rm), "--trainer.total-training-steps", str(args.rl_steps),
         "--trainer.test-freq", "0", "--trainer.no-val-before-train", "--data.val-max-samples", "64", "--actor.kl-loss-coef", str(args.kl),
         "--trainer.default-local-dir", str(out / "{experiment_name}"), "--trainer.experiment-name", name, *flags,
         *shlex.split(args.rl_args)],
        out / f"{name}.log",
    )  # fmt: skip
    return out / name / "checkpoints"


def run(args) -> None:
    """RM training, then GRPO on the RM with checkpoints every --save-freq steps, each evaluated (curve.json)."""
    out = args.run_dir
    out.mkdir(parents=True, exist_ok=True)
    rm_dir = args.rm
    if rm_dir is None:
        if args.mix_steps and not (args.mix / "train.parquet").exists():  # checked before stage 1 trains
            raise SystemExit(f"run: no pairs in {args.mix}: write them first with `pairs --mirror --near-miss 6 --out {args.mix}`")
        # stage 1: the policy's mistakes (the shipped pairs)
        rm_dir = train_rm(
            args, args.rm_init or demos.ARITH_MODEL, args.out, out, "rm", args.rm_steps, args.rm_lr,
            "--trainer.test-freq", str(args.rm_steps // 4), "--train-layers", str(args.rm_train_layers),
        )  # fmt: skip
        if args.mix_steps:  # stage 2: the mix (mistakes, their mirror images, near misses), from stage 1's RM
            rm_dir = train_rm(args, rm_dir, args.mix, out, "rm-mix", args.mix_steps, args.mix_lr, "--trainer.test-freq", "500")
    ckpts = train_grpo(args, rm_dir, out, "grpo-rm", "--trainer.save-freq", str(args.save_freq), "--trainer.max-ckpt-to-keep", "0")
    curve = []
    for step in range(0, args.rl_steps + 1, args.save_freq):
        policy = demos.ARITH_MODEL if step == 0 else ckpts / f"global_step_{step}" / "hf"
        point = {"step": step, **greedy_eval(policy, rm_dir, args.eval_problems)}
        print(json.dumps(point), flush=True)
        curve.append(point)
    (out / "curve.json").write_text(json.dumps(curve, indent=1))


def iterate(args) -> None:
    """Iterated (online) RLHF: rounds of [the current policy's mistakes -> new pairs (labelled by the task's answer,
    the stand-in for a human) -> the RM continues training on them -> GRPO continues on the RM], each round's
    policy evaluated greedily on held-out problems (iterate.json). Each round's GRPO starts from the last round's
    policy, which is also its KL anchor. What a round's pairs catch is what GRPO found in the RM the round before."""
    out = args.run_dir / "iterate"
    out.mkdir(parents=True, exist_ok=True)
    policy, rm = Path(demos.ARITH_MODEL), args.rm
    if rm is None:
        raise SystemExit("iterate: pass --rm, a trained RM export (e.g. from `run`)")
    curve = [{"round": 0, **greedy_eval(policy, rm, args.eval_problems)}]
    print(json.dumps(curve[-1]), flush=True)
    for k in range(1, args.rounds + 1):
        pairs = out / f"pairs{k}"
        write_pairs(pairs, args.iter_problems, args.eval_problems, args.samples, 0, args.seed + k, args.mirror, policy)
        rm = train_rm(
            args, rm, pairs, out, f"rm{k}", args.rm_steps, args.rm_lr, "--trainer.test-freq", str(args.rm_steps), "--trainer.seed", str(k)
        )
        ckpts = train_grpo(
            args, rm, out, f"grpo{k}", "--model", str(policy), "--trainer.save-freq", str(args.rl_steps), "--trainer.seed", str(k)
        )
        policy = ckpts / f"global_step_{args.rl_steps}" / "hf"
        logged = [json.loads(line) for line in (out / f"rm{k}" / "metrics.jsonl").read_text().splitlines()]
        rm_val = {m["step"]: round(m["val/pair_acc"], 3) for m in logged if "val/pair_acc" in m}  # before and after
        curve.append({"round": k, **greedy_eval(policy, rm, args.eval_problems), "rm_pair_acc": rm_val})
        print(json.dumps(curve[-1]), flush=True)
        (out / "iterate.json").write_text(json.dumps(curve, indent=1))


def parser() -> argparse.ArgumentParser:
    """One subcommand per stage, each with only the flags it reads."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    stages = ap.add_subparsers(dest="stage", required=True)
    run_dir = argparse.ArgumentParser(add_help=False)
    run_dir.add_argument("--run-dir", type=Path, default=ROOT / "outputs" / "rm_demo", help="where the runs go")
    seed = argparse.ArgumentParser(add_help=False)
    seed.add_argument("--seed", type=int, default=0)
    sampled = argparse.ArgumentParser(add_help=False)  # the pairs of the policy's mistakes
    sampled.add_argument("--samples", type=int, default=8, help="samples per problem to find wrong answers in")
    sampled.add_argument("--mirror", action="store_true", help="add each numeric mistake mirrored about the truth")
    rl = argparse.ArgumentParser(add_help=False)  # the RM's training and GRPO on it
    rl.add_argument("--rm-steps", type=int, default=1500, help="RM steps on the policy's mistakes (iterate: per round)")
    rl.add_argument("--rm-lr", type=float, default=1e-3)
    rl.add_argument("--rm-batch", type=int, default=64, help="pairs per RM step")
    rl.add_argument("--rl-steps", type=int, default=296, help="GRPO steps (296: one epoch, as the default run)")
    rl.add_argument("--rl-args", default="", help="more recipes/grpo.py flags, e.g. '--no-norm-adv-by-std-in-grpo'")
    rl.add_argument("--kl", type=float, default=0.001, help="GRPO's --actor.kl-loss-coef")
    rl.add_argument("--eval-problems", type=int, default=256, help="held-out problems answered greedily")

    p = stages.add_parser("pairs", parents=[seed, sampled], help="write preference pairs from the policy's mistakes")
    p.add_argument("--out", type=Path, default=OUT, help="where the pair parquet files go")
    p.add_argument("--train-problems", type=int, default=9488, help="train problems (the task has 9,488)")
    p.add_argument("--val-problems", type=int, default=512, help="held-out problems")
    p.add_argument("--near-miss", type=int, default=0, help="near-miss negatives per problem (of +-1, +-10, +-20; 6: all)")
    p.add_argument("--policy", type=Path, default=None, help="the policy whose mistakes are sampled (default: the embedded one)")

    p = stages.add_parser("init", parents=[run_dir, seed], help="the RM's starting point: <run-dir>/rm-init")
    p.add_argument("--init-sft-steps", type=int, default=300, help="SFT steps on the policy before growing it")
    p.add_argument("--extra-layers", type=int, default=0, help="fresh identity layers on top of the policy's")
    p.add_argument("--layers", type=int, default=0, help="a fresh model this deep instead of the policy (0: the policy)")
    p.add_argument("--hidden", type=int, default=128, help="its width, with --layers")

    p = stages.add_parser("run", parents=[run_dir, rl], help="train the RM in two stages, then GRPO on it (curve.json)")
    p.add_argument("--out", type=Path, default=OUT, help="stage 1's pairs (pairs --out)")
    p.add_argument("--rm", type=Path, default=None, help="an RM export to use instead of training one")
    p.add_argument("--rm-train-layers", type=int, default=0, help="recipes/rm.py --train-layers (0: all)")
    p.add_argument("--rm-init", type=Path, default=None, help="the RM's starting point (init's output; default: the policy)")
    p.add_argument("--mix", type=Path, default=None, help="the mixed pairs of stage 2 (default: <run-dir>/pairs-mix)")
    p.add_argument("--mix-steps", type=int, default=6000, help="RM steps on the mix after stage 1 (0: no stage 2)")
    p.add_argument("--mix-lr", type=float, default=3e-4)
    p.add_argument("--save-freq", type=int, default=37, help="GRPO checkpoints (each evaluated) every this many steps")

    p = stages.add_parser("iterate", parents=[run_dir, seed, sampled, rl], help="online RLHF: rounds of pairs -> RM -> GRPO")
    p.add_argument("--rm", type=Path, default=None, help="the RM to start from (a trained RM export, e.g. from `run`)")
    p.add_argument("--rounds", type=int, default=4, help="rounds of pairs -> RM -> GRPO")
    p.add_argument("--iter-problems", type=int, default=3000, help="train problems sampled per round")
    return ap


def main() -> None:
    args = parser().parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    start = time.time()
    if args.stage == "pairs":
        write_pairs(args.out, args.train_problems, args.val_problems, args.samples, args.near_miss, args.seed, args.mirror, args.policy)
    elif args.stage == "init":
        rm_init(args.run_dir / "rm-init", args.init_sft_steps, args.extra_layers, args.seed, args.layers, args.hidden)
    elif args.stage == "iterate":
        iterate(args)
    else:
        args.mix = args.mix or args.run_dir / "pairs-mix"
        run(args)
    print(f"done in {time.time() - start:.0f} s")


if __name__ == "__main__":
    main()
