"""The embedded mixture-of-experts: a tiny Qwen3-MoE (transformers' own Qwen3MoeForCausalLM) that half-knows the
embedded arithmetic task, so MoE code paths (router replay, rlkit/moe.py, docs/moe.md) run on a 2-core CPU.

- `tiny-moe/`: the tiny-arith tokenizer, a Qwen3-MoE config of tiny-arith's size (hidden 128, 2 layers, 4 heads,
  8 experts of intermediate size 64 per layer, top-2, norm_topk_prob, tied embeddings), warm-started like tiny-arith
  by a short supervised pass (recipes/sft.py) on the arith train split, stopped early so RL has headroom.

Rebuilt (the arith data must exist: `python scripts/assets/tiny_arith.py` writes it) by::

    python scripts/assets/tiny_moe.py      # ~2 minutes on 2 CPU cores

Train it: `python recipes/grpo.py --model.path rlkit/assets/tiny-moe` (docs/moe.md has the measured run).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script: rlkit and scripts.assets of this checkout

from rlkit.demos import ARITH_MODEL, MOE_MODEL  # noqa: E402
from scripts.assets import common  # noqa: E402
from scripts.assets.tiny_arith import arith_problems, arith_row, greedy_accuracy  # noqa: E402

EXPERTS, TOP_K = 8, 2


def build_moe(vocab_size: int, pad_id: int, eos_id: int, hidden: int = 128, layers: int = 2, seed: int = 0):
    """A small Qwen3-MoE causal LM with random weights: every layer sparse, EXPERTS experts, TOP_K per token."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    config = Qwen3MoeConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=hidden * 4,  # unused: every layer is sparse (decoder_sparse_step 1, no mlp_only_layers)
        moe_intermediate_size=hidden // 2,
        num_experts=EXPERTS,
        num_experts_per_tok=TOP_K,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=hidden // 4,
        max_position_embeddings=128,
        tie_word_embeddings=True,
        pad_token_id=pad_id,
        eos_token_id=eos_id,
        bos_token_id=None,
    )
    return Qwen3MoeForCausalLM(config)


def build(steps: int = 200, seed: int = 0, out_dir: Path = MOE_MODEL, lr: float = 1e-3) -> Path:
    """Warm-start a fresh tiny Qwen3-MoE on the arith train split with recipes/sft.py and save it."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(ARITH_MODEL)  # the tiny-arith tokenizer, as shipped
    train, val = arith_problems(seed)
    model = build_moe(len(tokenizer), tokenizer.pad_token_id, tokenizer.eos_token_id, seed=seed)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    convs = [
        arith_row(a, b, "", 0)["prompt"] + [{"role": "assistant", "content": str(a + b)}]
        for a, b in common.sft_traces(train, steps, 64, seed)
    ]
    model = common.warm_start(model, tokenizer, convs, steps, lr=lr, warmup=100, seed=seed)
    acc = greedy_accuracy(model, tokenizer, val)
    print(f"held-out greedy accuracy after {steps} SFT steps: {acc:.3f}")
    c = model.config
    return common.save_asset(
        model,
        tokenizer,
        out_dir,
        f"rlkit's embedded mixture-of-experts: a Qwen3-MoE (Qwen3MoeForCausalLM) of {sum(p.numel() for p in model.parameters()):,} "
        f"parameters, {c.num_hidden_layers} layers of {c.num_experts} experts (top-{c.num_experts_per_tok}), the tiny-arith "
        f"tokenizer; {steps} SFT steps (recipes/sft.py, lr {lr:g}) on two-digit addition (seed {seed}), held-out greedy "
        f"accuracy {acc:.3f}. Rebuild with `python scripts/assets/tiny_moe.py --steps {steps}`.\n",
    )


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=200, help="SFT steps (fewer = weaker start)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--out", type=Path, default=MOE_MODEL)
    args = ap.parse_args()
    common.set_threads()
    print(json.dumps({"saved": str(build(args.steps, args.seed, args.out, args.lr))}))
