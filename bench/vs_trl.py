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
    python bench/vs_trl.py --workload gsm8k                   # GSM8K-shaped: ~200-token prompts, forced 20-300-token responses

--workload gsm8k (equal work on both sides): a random Llama (--hidden/--layers) whose EOS is the tokenizer's own,
prompts padded with filler text to --prompt-tokens tokens (chat template included), --prompts x n = 8 rows. Nothing
is sampled: on training step k BOTH sides get the same pre-drawn responses (row i: L_i - 1 random tokens then EOS,
L_i uniform in [--min-new-tokens, --max-new-tokens], drawn once from (--seed, k)), in place of generation (TRL's
_generate_single_turn, rlkit's rollout.generate). So the token counts per step are identical, row by row; what is
timed and compared is scoring, the reference pass and the update (both sides skip the old-log-prob pass, on-policy).
The prompts' text differs between the sides (each samples its own) but every prompt has the same token length.

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
        help="also time rlkit variants: comma-separated from padded (rlkit before issue #15: padded passes, a prefill per row), mask (the dense block mask instead of split attention), and the older prototypes skip_old_lp, logits_to_keep, prefix, all; see docs/performance.md",
    )
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--workload", choices=["arith", "gsm8k"], default="arith", help="gsm8k: see the module docstring")
    p.add_argument("--prompt-tokens", type=int, default=200, help="--workload gsm8k: tokens per prompt, chat template included")
    p.add_argument("--min-new-tokens", type=int, default=20, help="--workload gsm8k: shortest forced response")
    args = p.parse_args(argv)
    if args.workload == "gsm8k":  # defaults of the GSM8K shape unless given
        given = set(argv if argv is not None else sys.argv[1:])
        for flag, attr, value in (("--model", "model", "random"), ("--prompts", "prompts", 2), ("--max-new-tokens", "max_new_tokens", 300)):
            if flag not in given:
                setattr(args, attr, value)
    return args


def long_prompts(path: Path, tok, prompt_tokens: int, rows: int = 64) -> str:
    """The embedded arithmetic questions behind filler text, each exactly prompt_tokens tokens with the chat
    template, written as a parquet file both libraries read (same columns as the embedded data)."""
    import pandas as pd

    from rlkit import demos

    df = pd.read_parquet(demos.ARITH_DATA / "train.parquet").head(rows).copy()
    filler = "Read the problem carefully, reason step by step and give the final number. "

    def length(text):
        return len(
            tok.apply_chat_template([{"role": "user", "content": text}], tokenize=True, add_generation_prompt=True, return_dict=False)
        )

    prompts = []
    for msgs in df["prompt"]:
        q = msgs[0]["content"]
        pad = filler
        while length(pad + q) <= prompt_tokens:  # enough filler to cut down to the length, whatever the tokenizer
            pad += filler
        while pad and length(pad + q) > prompt_tokens:  # cut the filler from the front, then top up
            pad = pad[1:]
        while length(pad + q) < prompt_tokens:  # a space, or (a chat template that strips them: SmolLM2's) a word
            grown = [x + pad for x in (" ", "so ", "a ") if length(pad + q) < length(x + pad + q) <= prompt_tokens]
            assert grown, f"cannot top up the prompt to {prompt_tokens} tokens"
            pad = grown[0]
        assert length(pad + q) == prompt_tokens, (length(pad + q), prompt_tokens)
        prompts.append([{"role": "user", "content": pad + q}])
    df["prompt"] = prompts
    df.to_parquet(path)
    return str(path)


class ForcedResponses:
    """Pre-drawn responses, the same for both sides: draw(k) -> rows lists of token ids for training step k, row
    i holding L_i - 1 random non-special tokens then EOS, L_i uniform in [lo, hi]."""

    def __init__(self, rows: int, lo: int, hi: int, vocab: int, eos: int, special: list[int], seed: int):
        self.rows, self.lo, self.hi, self.vocab, self.eos, self.special, self.seed = rows, lo, hi, vocab, eos, set(special), seed

    def draw(self, k: int) -> list[list[int]]:
        import torch

        g = torch.Generator().manual_seed(self.seed * 1_000_003 + k)
        lengths = torch.randint(self.lo, self.hi + 1, (self.rows,), generator=g).tolist()
        allowed = torch.tensor([t for t in range(self.vocab) if t not in self.special])
        return [allowed[torch.randint(len(allowed), (n - 1,), generator=g)].tolist() + [self.eos] for n in lengths]

    def rlkit_generate(self, rollout):
        """A stand-in for rollout.generate returning draw(k) on its k-th call (k = 1, 2, ...), as rlkit's rows."""
        import torch

        from rlkit.rollout import assemble

        calls = [0]

        def generate(prompts, max_new_tokens, *a, **kw):
            calls[0] += 1
            rows = self.draw(calls[0])
            assert len(rows) == len(prompts), (len(rows), len(prompts))
            pad = rollout.tokenizer.pad_token_id
            resp = torch.full((len(rows), max_new_tokens), pad, dtype=torch.long)
            for i, r in enumerate(rows):
                resp[i, : len(r)] = torch.tensor(r)
            return assemble(prompts, resp, rollout.eos, pad)

        return generate

    def trl_generate(self):
        """A stand-in for GRPOTrainer._generate_single_turn returning draw(k) on its k-th call."""
        calls = [0]

        def generate(prompt_ids, *a, **kw):
            calls[0] += 1
            rows = self.draw(calls[0])
            assert len(rows) == len(prompt_ids), (len(rows), len(prompt_ids))
            return rows, None

        return generate


class PeakRSS:
    """The peak resident memory of this process while each side runs, sampled every 5 ms by a thread
    (/proc/self/statm); `side` names who runs now."""

    def __init__(self):
        import os
        import threading

        self.page = os.sysconf("SC_PAGE_SIZE")
        self.side, self.peak, self.stop = None, {}, False
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def rss_mib(self) -> float:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self.page / 2**20

    def run(self):
        import time

        while not self.stop:
            if self.side is not None:
                self.peak[self.side] = max(self.peak.get(self.side, 0.0), self.rss_mib())
            time.sleep(0.005)


def build_trl(args, model_path: str, tokenizer, out_dir: Path, reward_fn, on_step_end, data_file: str | None = None):
    import datasets
    import torch
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rlkit import demos

    ds = datasets.load_dataset("parquet", data_files=data_file or str(demos.ARITH_DATA / "train.parquet"), split="train")

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


def roofline(args, config, parts, times, trl_parts, w: int, forced: bool, ceiling) -> str:
    """common.roofline_table for the timed steps: rlkit's phases from its timers, TRL's from the wrapped methods
    (its reference includes its scoring bookkeeping, its update the backward, optimizer and trainer). The FLOPs
    are counted on rlkit's batches; TRL's are the same tokens with --model random or --workload gsm8k (with the
    embedded model each side samples its own, ~the same count). Generation is left out when it is forced."""
    phases = ["ref", "old_log_prob", "update"] if forced else ["gen", "ref", "old_log_prob", "update"]
    sides = {k: [{x: p[x] for x in phases} for p in ps[w:]] for k, ps in parts.items()}
    trl = []
    for i in range(w, len(times["trl"])):
        gas, gen, rew = trl_parts["generate_and_score"][i], trl_parts["generate"][i], trl_parts["rewards"][i]
        trl.append({"gen": 0.0 if forced else gen, "ref": gas - gen - rew, "update": times["trl"][i] - gas})
    sides["trl"] = trl
    steps = [p["groups"] for p in parts["rlkit"][w:]]
    old_lp = parts["rlkit"][w]["ran_old_log_prob"]
    return common.roofline_table(config, steps, sides, ceiling, old_log_prob=old_lp)


def main(argv=None):
    args = parse_args(argv)
    common.set_threads(args.threads)
    import torch
    import transformers
    import trl
    from transformers import PrinterCallback

    work = Path(tempfile.mkdtemp(prefix="rlkit-bench-"))
    gsm8k = args.workload == "gsm8k"
    if gsm8k and args.model == "random":
        model_path = common.make_random_model(work / "random-llama-eos", args.hidden, args.layers, sampled_eos=True)
    else:
        model_path = common.resolve_model(args.model, work, args.hidden, args.layers)
    data_file, forced = None, None
    if gsm8k:
        tok = transformers.AutoTokenizer.from_pretrained(model_path)
        data_file = long_prompts(work / "long-prompts.parquet", tok, args.prompt_tokens)
        special = [t for t in tok.all_special_ids if t is not None]
        vocab = transformers.AutoConfig.from_pretrained(model_path).vocab_size
        forced = ForcedResponses(
            args.prompts * args.n, args.min_new_tokens, args.max_new_tokens, vocab, tok.eos_token_id, special, args.seed
        )
        print(
            f"GSM8K-shaped: prompts of {args.prompt_tokens} tokens, forced responses of {args.min_new_tokens}-{args.max_new_tokens} "
            "tokens, the same on both sides (generation replaced; see the docstring)"
        )
    print(
        f"rlkit vs TRL {trl.__version__} (transformers {transformers.__version__}, torch {torch.__version__}), "
        f"{torch.get_num_threads()} thread(s)\nmodel {model_path}\n{args.prompts} prompts x {args.n} samples, "
        f"<= {args.max_new_tokens} new tokens, lr {args.lr}, beta {args.beta}, {args.warmup} warm-up + {args.steps} timed steps per side"
    )

    rl = {
        name: common.RlkitGRPO(
            model_path,
            args.prompts,
            args.n,
            args.max_new_tokens,
            args.lr,
            args.beta,
            args.threads,
            work / name,
            seed=args.seed,
            train_files=[data_file] if data_file else None,
            **kw,
        )
        for name, kw in common.arms(args.variants).items()
    }
    if forced:
        for r in rl.values():
            r.policy.worker.rollout.generate = forced.rlkit_generate(r.policy.worker.rollout)
    first = next(iter(rl.values()))
    ceiling = common.Ceiling(first.model.config, decode_rows=args.prompts * args.n)
    rss = PeakRSS()
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
            rss.side = name if global_step > args.warmup else None
            t = r.step()
            times[name].append(t["step"])
            tokens[name].append(t["gen_tokens"])
            widths[name].append(t["gen_width"])
            parts[name].append(t)
        if global_step > args.warmup:  # the matmul ceiling under the same load as the steps (common.Ceiling)
            ceiling.sample(parts["rlkit"][-1]["groups"])
        line = " | ".join(f"{k} {v[-1]:.3f}s {tokens[k][-1] if tokens[k] else '?'} tok" for k, v in times.items())
        print(f"step {global_step}{' (warm-up)' if global_step <= args.warmup else ''}: {line}", flush=True)
        rss.side = "trl" if global_step >= args.warmup else None
        mark[0] = common.now()

    trainer = build_trl(args, model_path, first.tok, work, first.reward_fn, on_trl_step_end, data_file)
    if forced:
        trainer._generate_single_turn = forced.trl_generate()
    trainer.remove_callback(PrinterCallback)  # its end-of-training summary is not ours to print
    original = trainer._generate_and_score_completions
    prompt_tokens = []

    def counted(inputs):  # TRL's generated tokens per step, from its own completion mask
        out = original(inputs)
        tokens["trl"].append(int(out["completion_mask"].sum()))
        prompt_tokens.append(int(out["prompt_mask"].sum()))
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
    rss.side = "trl" if args.warmup == 0 else None
    rss_start = rss.rss_mib()
    mark[0] = common.now()
    trainer.train()
    rss.stop = True

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
    print(
        f"peak RSS while each side stepped (timed steps, MiB; the process holds every side's model and optimizer; {rss_start:.0f} before the first step): "
        + ", ".join(f"{k} {v:.0f}" for k, v in rss.peak.items())
    )
    print(
        "tokens/s (generated or forced response tokens / median s/step): "
        + ", ".join(f"{k} {common.median(tokens[k][w:]) / med[k]:.0f}" for k in times)
    )
    if gsm8k:
        print(
            f"prompt tokens per step: TRL {common.median(prompt_tokens[w:]):.0f}, rlkit {common.median([p['prompt_tokens'] for p in parts['rlkit'][w:]]):.0f}"
        )
    print()
    print(roofline(args, first.model.config, parts, times, trl_parts, w, forced is not None, ceiling))
    fastest = {k: min(v[w:]) for k, v in times.items()}
    print(
        f"\nrlkit / TRL = {med['rlkit'] / med['trl']:.2f}x (ratio of medians; median of per-step ratios {paired['rlkit']:.2f}x; "
        f"ratio of fastest steps {fastest['rlkit'] / fastest['trl']:.2f}x; target <= 0.5x)"
    )
    shutil.rmtree(work, ignore_errors=True)
    return {"median": med, "tokens": tokens, "times": times}


if __name__ == "__main__":
    main()
