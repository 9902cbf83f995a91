"""rlkit's GRPO step against TRL's GRPOTrainer step, alternated in one process, on the same work.

Both sides: the same model folder, the embedded arithmetic prompts (chat template), rlkit's reward function
(rlkit.rewards.RewardFn on the `rlkit/arith` scorer), P prompts x n samples per step, the same response length
cap, one AdamW step per training step on all P*n trajectories in one micro-batch (same lr, no weight decay,
grad-norm clip 1.0, constant lr), PPO clip 0.2, token-mean loss (TRL: loss_type="dapo"), group-std advantages,
k3 KL to a frozen reference with coefficient beta, fp32, no gradient checkpointing, no vLLM, CPU.

The steps alternate: TRL step, rlkit step, TRL step, ... (rlkit's runs inside a TrainerCallback at TRL's
on_step_end; a TRL step is timed from the end of the previous rlkit step to its own on_step_end, so it includes
TRL's data loading, generation, scoring, the forward passes, backward and optimizer step). The first
--warmup pairs are dropped. Prints the median seconds per step of each, the ratio rlkit/TRL and the generated
tokens per step on each side.

    python bench/vs_trl.py                                   # embedded model, 32 prompts x 8, 8 tokens
    python bench/vs_trl.py --model random --max-new-tokens 32 --prompts 16   # 4.3M random Llama, runs to the cap
    python bench/vs_trl.py --variants padded                  # also rlkit with its passes padded (before issue #15)

Needs the bench extra: pip install -e '.[bench]'   (trl==1.16.0)
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--model", default="embedded", help="'embedded' (0.56M), 'random' (random-weight Llama, --hidden/--layers) or a model folder"
    )
    p.add_argument("--hidden", type=int, default=256, help="hidden size of --model random")
    p.add_argument("--layers", type=int, default=4, help="layers of --model random")
    p.add_argument("--prompts", type=int, default=32, help="prompts per step (rlkit data.train_batch_size)")
    p.add_argument("--n", type=int, default=8, help="samples per prompt (rlkit rollout.n, TRL num_generations)")
    p.add_argument(
        "--max-new-tokens", type=int, default=8, help="response length cap (rlkit data.max_response_length, TRL max_completion_length)"
    )
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument(
        "--beta",
        type=float,
        default=0.001,
        help="KL coefficient (rlkit actor.kl_loss_coef, TRL beta); 0 = no reference model on either side",
    )
    p.add_argument("--steps", type=int, default=6, help="timed steps per side (after warm-up)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per side first")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1: on 2 shared cores, 2 threads are slower and noisy)")
    p.add_argument(
        "--variants",
        default="",
        metavar="A,B",
        help="also time rlkit variants: comma-separated from padded (rlkit before issue #15: padded passes, a prefill per row), and the older prototypes skip_old_lp, logits_to_keep, prefix, all; see docs/performance.md",
    )
    p.add_argument("--seed", type=int, default=1)
    return p.parse_args(argv)


def build_trl(args, model_path: str, tokenizer, out_dir: Path, reward_fn, on_step_end):
    import datasets
    import torch
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rlkit import embedded

    ds = datasets.load_dataset("parquet", data_files=str(embedded.DATA_DIR / "train.parquet"), split="train")

    def arith_reward(prompts, completions, data_source, reward_model, extra_info=None, **_):
        """rlkit's own RewardFn, on TRL's decoded completions."""
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        scores, _ = reward_fn(list(data_source), texts, [r["ground_truth"] for r in reward_model], list(extra_info or [None] * len(texts)))
        return scores.tolist()

    batch = args.prompts * args.n
    warnings.filterwarnings("ignore", category=FutureWarning)  # transformers 5.23 renames gradient_checkpointing
    config = GRPOConfig(
        output_dir=str(out_dir / "trl"),
        use_cpu=True,
        bf16=False,
        fp16=False,
        seed=args.seed,
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=1,
        num_generations=args.n,
        max_completion_length=args.max_new_tokens,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        optim="adamw_torch",
        beta=args.beta,
        loss_type="dapo",
        epsilon=0.2,
        scale_rewards="group",
        num_iterations=1,
        gradient_checkpointing=False,
        use_vllm=False,
        max_steps=args.warmup + args.steps,
        logging_strategy="no",
        save_strategy="no",
        eval_strategy="no",
        report_to="none",
        disable_tqdm=True,
        log_completions=False,
        dataloader_num_workers=0,
        model_init_kwargs={"dtype": torch.float32},
    )

    class Alternate(TrainerCallback):
        def on_step_end(self, _args, state, control, **kw):
            on_step_end(state.global_step)

    with common.quiet(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = GRPOTrainer(
            model=model_path, reward_funcs=arith_reward, args=config, train_dataset=ds, processing_class=tokenizer, callbacks=[Alternate()]
        )
    return trainer


def timed(fn, sink: list):
    """fn, appending its seconds to sink on every call (to see where TRL's step goes)."""

    def wrapper(*a, **kw):
        start = common.now()
        try:
            return fn(*a, **kw)
        finally:
            sink.append(common.now() - start)

    return wrapper


def main(argv=None):
    args = parse_args(argv)
    common.set_threads(args.threads)
    import torch
    import transformers
    import trl
    from transformers import PrinterCallback

    work = Path(tempfile.mkdtemp(prefix="rlkit-bench-"))
    model_path = common.resolve_model(args.model, work, args.hidden, args.layers)
    print(
        f"rlkit vs TRL {trl.__version__} (transformers {transformers.__version__}, torch {torch.__version__}), "
        f"{torch.get_num_threads()} thread(s)\nmodel {model_path}\n{args.prompts} prompts x {args.n} samples, "
        f"<= {args.max_new_tokens} new tokens, lr {args.lr}, beta {args.beta}, {args.warmup} warm-up + {args.steps} timed steps per side"
    )

    rl = {
        name: common.RlkitGRPO(
            model_path, args.prompts, args.n, args.max_new_tokens, args.lr, args.beta, args.threads, work / name, seed=args.seed, **kw
        )
        for name, kw in common.arms(args.variants).items()
    }
    first = next(iter(rl.values()))
    torch.set_num_threads(args.threads)

    times = {"trl": [], **{k: [] for k in rl}}
    tokens = {k: [] for k in times}
    widths = {k: [] for k in times}
    parts = {k: [] for k in rl}
    mark = [None]

    def on_trl_step_end(global_step):
        times["trl"].append(common.now() - mark[0])
        if torch.get_num_threads() != args.threads:
            print(f"warning: TRL's step ran with {torch.get_num_threads()} torch threads, not {args.threads}")
        for name, r in rl.items():  # then each rlkit arm once: TRL, rlkit, [variants], TRL, rlkit, ...
            torch.set_num_threads(args.threads)
            t = r.step()
            times[name].append(t["step"])
            tokens[name].append(t["gen_tokens"])
            widths[name].append(t["gen_width"])
            parts[name].append(t)
        line = " | ".join(f"{k} {v[-1]:.3f}s {tokens[k][-1] if tokens[k] else '?'} tok" for k, v in times.items())
        print(f"step {global_step}{' (warm-up)' if global_step <= args.warmup else ''}: {line}", flush=True)
        mark[0] = common.now()

    trainer = build_trl(args, model_path, first.tok, work, first.reward_fn, on_trl_step_end)
    trainer.remove_callback(PrinterCallback)  # its end-of-training summary is not ours to print
    original = trainer._generate_and_score_completions

    def counted(inputs):  # TRL's generated tokens per step, from its own completion mask
        out = original(inputs)
        tokens["trl"].append(int(out["completion_mask"].sum()))
        widths["trl"].append(int(out["completion_ids"].shape[1]))
        return out

    trainer._generate_and_score_completions = counted
    trl_parts = {k: [] for k in ("generate_and_score", "generate", "rewards", "compute_loss")}
    for attr, key in (
        ("_generate_and_score_completions", "generate_and_score"),
        ("_generate", "generate"),
        ("_calculate_rewards", "rewards"),
        ("compute_loss", "compute_loss"),
    ):
        setattr(trainer, attr, timed(getattr(trainer, attr), trl_parts[key]))
    torch.set_num_threads(args.threads)
    mark[0] = common.now()
    trainer.train()

    w = args.warmup
    med = {k: common.median(v[w:]) for k, v in times.items()}
    paired = {k: common.median([a / b for a, b in zip(v[w:], times["trl"][w:])]) for k, v in times.items()}
    rows = []
    for k in times:
        rows.append(
            [
                k,
                f"{med[k]:.3f}",
                f"{med[k] / med['trl']:.2f}",
                f"{paired[k]:.2f}",
                f"{common.median(tokens[k][w:]):.0f}",
                f"{common.median(widths[k][w:]):.0f}",
                f"{min(times[k][w:]):.3f}",
            ]
        )
    print()
    print(common.fmt_table(rows, ["side", "median s/step", "x TRL", "median paired ratio", "gen tokens/step", "gen width", "min s/step"]))
    for k, ps in parts.items():
        keys = ["gen", "reward", "ref", "old_log_prob", "update"]
        print(f"{k} timing/* medians: " + ", ".join(f"{x} {common.median([p[x] for p in ps[w:]]):.3f}s" for x in keys))
    m = {k: common.median(v[w:]) for k, v in trl_parts.items()}
    print(
        f"trl phases (medians): generation {m['generate']:.3f}s, rewards {m['rewards']:.3f}s, reference log-probs + "
        f"scoring bookkeeping {m['generate_and_score'] - m['generate'] - m['rewards']:.3f}s, update forward+loss "
        f"{m['compute_loss']:.3f}s, the rest (backward, optimizer, trainer) {med['trl'] - m['generate_and_score'] - m['compute_loss']:.3f}s"
    )
    tt, tr = sum(tokens["trl"][w:]), sum(tokens["rlkit"][w:])
    if tt != tr:
        print(
            f"generated tokens differ: TRL {tt} vs rlkit {tr} over the timed steps ({(tr - tt) / max(tt, 1):+.1%}): each side "
            "samples its own responses from its own (diverging) copy of the policy; with the embedded model responses stop "
            "at EOS after a few tokens. Use --model random for identical work (responses run to the cap)."
        )
    fastest = {k: min(v[w:]) for k, v in times.items()}
    print(
        f"\nrlkit / TRL = {med['rlkit'] / med['trl']:.2f}x (ratio of medians; median of per-step ratios {paired['rlkit']:.2f}x; "
        f"ratio of fastest steps {fastest['rlkit'] / fastest['trl']:.2f}x; target <= 0.5x)"
    )
    shutil.rmtree(work, ignore_errors=True)
    return {"median": med, "tokens": tokens, "times": times}


if __name__ == "__main__":
    main()
