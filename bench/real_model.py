"""A real model against TRL, each side in its own process, processes alternated: SmolLM2-135M-Instruct, GSM8K-shaped.

Sides: TRL 1.16's GRPOTrainer (HF generate), rlkit with `--rollout.name hf` and rlkit with `--rollout.name vllm` (the
CPU build, in-process). Each round starts one process per side in turn (trl, rlkit-hf, rlkit-vllm, trl, ...), so load
from other jobs hits all alike; a process loads its side, runs --warmup untimed then --steps timed GRPO steps and
prints them as JSON. The workload: --prompts prompts of exactly --prompt-tokens tokens (the embedded arithmetic
question behind filler text asking to reason step by step, chat template included: bench/vs_trl.py's long_prompts),
n samples each, natural answers (the model's own EOS) up to --max-new-tokens, rlkit's reward function on both sides,
the optimizer, loss and KL settings of bench/vs_trl.py (one AdamW step per batch, exactly on-policy: no old-log-prob
pass on either side). The sides sample their own answers, so the work differs: compare per generated token as well
as per step. Ends with the roofline (bench/common.py: each side's FLOPs on its own tokens, % of a matmul ceiling each
process samples after every timed step).

    python bench/real_model.py                          # SmolLM2-135M, 1 prompt x 4, 150-token prompts, <= 128 tokens
    python bench/real_model.py --rounds 2 --prompts 2 --max-new-tokens 192 --sides trl,hf
    python bench/real_model.py --report-from /tmp/rlkit-real-XXXX   # the processes of a run that finished (result-*.json)
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

SIDES = ("trl", "hf", "vllm")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct", help="a built-in name (rlkit.models) or a model folder")
    p.add_argument("--sides", default=",".join(SIDES), help="comma-separated: trl, hf (rlkit --rollout.name hf), vllm (rlkit, vLLM)")
    p.add_argument("--prompts", type=int, default=1, help="prompts per step")
    p.add_argument("--n", type=int, default=4, help="samples per prompt")
    p.add_argument("--prompt-tokens", type=int, default=150, help="tokens per prompt, chat template included")
    p.add_argument("--max-new-tokens", type=int, default=128, help="answer length cap")
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--beta", type=float, default=0.001, help="KL coefficient (a reference pass on both sides)")
    p.add_argument("--steps", type=int, default=1, help="timed steps per process")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per process first")
    p.add_argument("--rounds", type=int, default=2, help="processes per side, alternated")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--side", choices=SIDES, help="internal: run one side in this process")
    p.add_argument("--work", help="internal: the folder holding the prompts")
    p.add_argument("--report-from", metavar="DIR", help="report the processes' results saved in DIR (a run's work folder)")
    args = p.parse_args(argv)
    args.sides = common.names(p, "--sides", args.sides, SIDES)
    runs = [args.side] if args.side else [] if args.report_from else args.sides  # the sides this process will start
    if "trl" in runs and importlib.util.find_spec("trl") is None:
        p.error("--sides trl: TRL is not installed; pip install -e '.[bench]' (trl==1.16.0), or --sides hf,vllm")
    return args


def run_side(args) -> dict:
    """One side's process: --warmup + --steps steps; per timed step its seconds, phases, tokens and groups."""
    common.set_threads(args.threads)
    import torch
    import transformers
    import vs_trl

    from rlkit.models import resolve_model_path

    path = resolve_model_path(args.model)
    work = Path(args.work)
    data = str(work / "prompts.parquet")
    n, out = args.n, []
    groups_of = lambda p, r: common.groups_of(p, r, [i // n for i in range(len(p))])  # noqa: E731
    config = transformers.AutoConfig.from_pretrained(path)
    ceiling = common.Ceiling(config, decode_rows=args.prompts * n)
    if args.side in ("hf", "vllm"):
        r = common.RlkitGRPO(
            path, args.prompts, n, args.max_new_tokens, args.lr, args.beta, args.threads, work / args.side, seed=args.seed,
            train_files=[data], rollout=args.side,
        )  # fmt: skip
        torch.set_num_threads(args.threads)
        for i in range(args.warmup + args.steps):
            t = r.step()
            if i >= args.warmup:
                out.append({k: t[k] for k in ("step", "gen", "ref", "old_log_prob", "update", "gen_tokens", "groups")})
                ceiling.sample(t["groups"])
        if hasattr(r.policy.worker.rollout, "close"):
            r.policy.worker.rollout.close()
    else:
        from transformers import PrinterCallback

        from rlkit.engine import load_tokenizer
        from rlkit.placement import build_reward

        tok = load_tokenizer(path)
        cfg = common.load_recipe("grpo").Config()
        reward_fn = build_reward(cfg, SimpleNamespace(tokenizer=tok))
        ns = SimpleNamespace(**{k: getattr(args, k) for k in ("prompts", "n", "max_new_tokens", "lr", "beta", "warmup", "steps", "seed")})
        parts = {k: [] for k in ("gas", "gen", "rew")}
        mark, info = [common.now()], []

        def on_step_end(step):
            if step > args.warmup:
                s = common.now() - mark[0]
                gas, gen, rew = parts["gas"][-1], parts["gen"][-1], parts["rew"][-1]
                out.append({"step": s, "gen": gen, "ref": gas - gen - rew, "update": s - gas, **info[-1]})
                ceiling.sample(info[-1]["groups"])
            torch.set_num_threads(args.threads)
            mark[0] = common.now()

        trainer = vs_trl.build_trl(ns, path, tok, work / "trl", reward_fn, on_step_end, data)
        trainer.remove_callback(PrinterCallback)
        gas = trainer._generate_and_score_completions

        def counted(inputs):
            o = gas(inputs)
            p, c = o["prompt_mask"].sum(-1).tolist(), o["completion_mask"].sum(-1).tolist()
            info.append({"gen_tokens": int(sum(c)), "groups": groups_of(p, c)})
            return o

        trainer._generate_and_score_completions = vs_trl.timed(counted, parts["gas"])
        trainer._generate = vs_trl.timed(trainer._generate, parts["gen"])
        trainer._calculate_rewards = vs_trl.timed(trainer._calculate_rewards, parts["rew"])
        torch.set_num_threads(args.threads)
        mark[0] = common.now()
        trainer.train()
    return {"side": args.side, "steps": out, "ceiling_gen": ceiling.gen, "ceiling_passes": ceiling.passes, "pass_rows": ceiling.pass_rows}


def main(argv=None):
    args = parse_args(argv)
    if args.side:
        result = json.dumps(run_side(args))
        (Path(args.work) / f"result-{args.side}-{os.getpid()}.json").write_text(result)  # for --report-from
        print("RESULT " + result, flush=True)
        return None
    if args.report_from:  # the processes that finished, e.g. of a run stopped before its last round
        res = {}
        for f in sorted(Path(args.report_from).glob("result-*.json"), key=os.path.getmtime):
            r = json.loads(f.read_text())
            res.setdefault(r["side"], []).append(r)
        return report(args, resolve_model_path_lazy(args.model), res, [s for s in args.sides if s in res])
    sides = args.sides
    common.set_threads(args.threads)
    import torch
    import transformers
    import vs_trl

    from rlkit.models import resolve_model_path

    against = f"TRL {importlib.import_module('trl').__version__}" if "trl" in sides else "no TRL side"

    path = resolve_model_path(args.model)
    work = Path(tempfile.mkdtemp(prefix="rlkit-real-"))  # kept: its result-*.json serve --report-from
    vs_trl.long_prompts(work / "prompts.parquet", transformers.AutoTokenizer.from_pretrained(path), args.prompt_tokens)
    print(
        f"{Path(path).name} vs {against}, torch {torch.__version__}, {args.threads} thread(s): {args.prompts} prompts x {args.n}, "
        f"prompts of {args.prompt_tokens} tokens, answers <= {args.max_new_tokens}; {args.rounds} rounds of one process per side "
        f"({', '.join(sides)}), each {args.warmup} warm-up + {args.steps} timed steps; load average {os.getloadavg()}",
        flush=True,
    )
    skip = ("side", "work", "sides", "rounds", "report_from")
    flags = [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in vars(args) if k not in skip]
    res = {s: [] for s in sides}
    for rnd in range(args.rounds):
        for side in sides:
            start = common.now()
            done = subprocess.run(
                [sys.executable, __file__, f"--side={side}", f"--work={work}", *flags],
                capture_output=True,
                text=True,
                env={**os.environ, "TOKENIZERS_PARALLELISM": "false"},
            )
            lines = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
            if done.returncode or not lines:
                sys.exit(f"{side} failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
            res[side].append(json.loads(lines[-1][7:]))
            steps = res[side][-1]["steps"]
            print(
                f"round {rnd + 1} {side}: " + ", ".join(f"{s['step']:.1f}s {s['gen_tokens']} tok" for s in steps)
                + f" (process {common.now() - start:.0f} s, load {os.getloadavg()[0]:.1f})",
                flush=True,
            )  # fmt: skip
    report(args, path, res, sides)
    return res


def resolve_model_path_lazy(name: str) -> str:
    from rlkit.models import resolve_model_path

    return resolve_model_path(name)


def report(args, path, res, sides):
    import transformers

    steps = {s: [st for r in res[s] for st in r["steps"]] for s in sides}
    base = "trl" if "trl" in sides else sides[0]
    rows = []
    for s in sides:
        per_step = common.median([st["step"] for st in steps[s]])
        per_tok = common.median([st["step"] / max(st["gen_tokens"], 1) for st in steps[s]])
        b_step = common.median([st["step"] for st in steps[base]])
        b_tok = common.median([st["step"] / max(st["gen_tokens"], 1) for st in steps[base]])
        phases = ", ".join(f"{p} {common.median([st[p] for st in steps[s]]):.1f}" for p in ("gen", "ref", "update"))
        rows.append(
            [s, f"{per_step:.2f}", f"{per_step / b_step:.2f}", f"{1e3 * per_tok:.1f}", f"{per_tok / b_tok:.2f}",
             f"{common.median([st['gen_tokens'] for st in steps[s]]):.0f}", phases]
        )  # fmt: skip
    print()
    print(
        common.fmt_table(
            rows, ["side", "median s/step", f"x {base}", "ms / generated token", f"x {base} per token", "gen tokens/step", "phases s"]
        )
    )
    ceiling = common.Ceiling(transformers.AutoConfig.from_pretrained(path), decode_rows=args.prompts * args.n)
    ceiling.gen = [c for s in sides for r in res[s] for c in r["ceiling_gen"]]
    ceiling.passes = [c for s in sides for r in res[s] for c in r["ceiling_passes"]]
    ceiling.pass_rows = res[sides[0]][0]["pass_rows"]
    timed = {s: [{p: st[p] for p in ("gen", "ref", "update")} for st in steps[s]] for s in sides}
    own = {s: [st["groups"] for st in steps[s]] for s in sides}
    print(common.roofline_table(ceiling.config, own[base], timed, ceiling, old_log_prob=False, side_steps=own))
    print(f"load average at the end: {os.getloadavg()}")


if __name__ == "__main__":
    main()
