"""The embedded default: a tiny arithmetic task and a tiny model that half-knows it.

`python recipes/grpo.py` with no arguments must run on a 2-core CPU with no network and visibly
learn. So rlkit ships (in `rlkit/assets/`):

- `arith/train.parquet`, `arith/val.parquet`: two-digit addition ("What is 23+58?" -> "81") in the
  verl parquet format, train and held-out splits with disjoint problems;
- `tiny-arith/`: a ~0.5M-parameter Llama-shaped causal LM in the ordinary Hugging Face format
  (config.json, model.safetensors, tokenizer.json with a chat template), loaded by the same
  `from_pretrained` call that loads Qwen. It was trained by a short supervised pass on the
  train split, stopped early on purpose, so it answers about 30% of held-out problems (0.295,
  greedy) correctly: the headroom that RL then closes.

Everything is rebuilt (the supervised pass is recipes/sft.py, see `run_sft`) by::

    python -m rlkit.embedded            # ~1 minute on 2 CPU cores

The step the pass stops at lies on the steep part of the learning curve, so float round-off (another CPU,
another torch) moves a rebuild's accuracy by tens of points: docs/sft.md has the measurements.
"""

from __future__ import annotations

import argparse
import json
import os
import random
from pathlib import Path

ASSETS = Path(__file__).resolve().parent / "assets"
MODEL_DIR = ASSETS / "tiny-arith"
DATA_DIR = ASSETS / "arith"
DATA_SOURCE = "rlkit/arith"

# A ChatML-style template (the format Qwen uses), so the embedded model is prompted the same way.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


# ---------------------------------------------------------------------------------------------
# The task
# ---------------------------------------------------------------------------------------------
def arith_problems(seed: int = 0, max_operand: int = 99, n_val: int = 512) -> tuple[list, list]:
    """All `a+b` with 0 <= a, b <= max_operand, shuffled with `seed`, split into (train, val)."""
    pairs = [(a, b) for a in range(max_operand + 1) for b in range(max_operand + 1)]
    random.Random(seed).shuffle(pairs)
    return pairs[n_val:], pairs[:n_val]


def arith_row(a: int, b: int, split: str, index: int) -> dict:
    """One verl-format row: data_source, prompt (chat messages), ability, reward_model, extra_info."""
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": f"What is {a}+{b}?"}],
        "ability": "arithmetic",
        "reward_model": {"style": "rule", "ground_truth": str(a + b)},
        "extra_info": {"split": split, "index": index},
    }


def write_task_parquet(out_dir: Path, train: list, val: list, row) -> tuple[Path, Path]:
    """Write train.parquet and val.parquet, one verl-format row(a, b, split, index) per (a, b) pair; returns their paths."""
    import datasets

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for split, pairs in (("train", train), ("val", val)):
        path = out_dir / f"{split}.parquet"
        datasets.Dataset.from_list([row(a, b, split, i) for i, (a, b) in enumerate(pairs)]).to_parquet(str(path))
        paths.append(path)
    return paths[0], paths[1]


def write_arith_parquet(out_dir: Path = DATA_DIR, seed: int = 0) -> tuple[Path, Path]:
    """Write train.parquet and val.parquet of the embedded task; returns their paths."""
    return write_task_parquet(out_dir, *arith_problems(seed), arith_row)


# ---------------------------------------------------------------------------------------------
# The tokenizer and the model
# ---------------------------------------------------------------------------------------------
def build_tokenizer(corpus: list[str]):
    """A byte-level BPE tokenizer trained with `tokenizers` on `corpus`: every byte is a token (so any
    text round-trips), plus merges learned from the corpus; digits stay single tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=SPECIAL_TOKENS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        chat_template=CHAT_TEMPLATE,
        padding_side="left",
    )


def build_model(vocab_size: int, pad_id: int, eos_id: int, hidden: int = 128, layers: int = 2, seed: int = 0):
    """A small Llama-shaped causal LM with random weights."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=hidden * 4,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=128,
        tie_word_embeddings=True,
        pad_token_id=pad_id,
        eos_token_id=eos_id,
        bos_token_id=None,
    )
    return LlamaForCausalLM(config)


def sft_traces(pairs, steps: int, batch_size: int, seed: int) -> list:
    """The supervised batches, in order: `steps` draws of `batch_size` problems (seeded, with replacement across
    draws): written as one file, read in order by recipes/sft.py (data.shuffle off), batch k = rows [kB, (k+1)B)."""
    rng = random.Random(seed)
    return [x for _ in range(steps) for x in rng.sample(pairs, batch_size)]


def run_sft(
    init_dir: Path,
    convs: list,
    steps: int,
    batch_size: int,
    lr: float,
    warmup: int,
    work_dir: Path,
    seed: int = 0,
    tools: str = "",
    max_response_length: int = 8,
    weight_decay: float = 0.0,
) -> Path:
    """Warm-start the model saved in `init_dir` with recipes/sft.py on the conversations `convs` (in order, see
    sft_traces): AdamW, linear warm-up then constant lr, clip 1, weight decay (0: none), loss on the assistant's tokens.
    Returns the final checkpoint's Hugging Face folder."""
    import importlib.util

    import pyarrow as pa
    import pyarrow.parquet as pq

    from rlkit.errors import MissingFile

    recipe = Path(__file__).resolve().parents[1] / "recipes" / "sft.py"
    if not recipe.exists():
        raise MissingFile(f"{recipe} not found: the asset builders run recipes/sft.py from a source checkout of rlkit")
    spec = importlib.util.spec_from_file_location("rlkit_recipe_sft", recipe)
    sft = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sft)
    work_dir = Path(work_dir)
    work_dir.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist([{"messages": c} for c in convs]), work_dir / "sft.parquet")
    cfg = sft.Config(messages_key="messages", tools=tools)
    cfg.model.path = str(init_dir)
    cfg.data.train_files, cfg.data.val_files, cfg.data.shuffle = [str(work_dir / "sft.parquet")], [], False
    cfg.data.train_batch_size = cfg.actor.ppo_mini_batch_size = batch_size
    cfg.data.max_response_length, cfg.trainer.seed = max_response_length, seed
    cfg.actor.lr, cfg.actor.warmup_steps, cfg.actor.weight_decay, cfg.actor.grad_clip = lr, warmup, weight_decay, 1.0
    t = cfg.trainer
    t.total_training_steps, t.test_freq, t.val_before_train, t.save_freq, t.max_ckpt_to_keep = steps, 0, False, 0, 1
    t.default_local_dir, t.experiment_name = str(work_dir / "run"), "sft"
    sft.main(cfg)
    return work_dir / "run" / "checkpoints" / f"global_step_{steps}" / "hf"


def warm_start(model, tokenizer, convs: list, steps: int, lr: float, warmup: int, seed: int = 0, **options):
    """`model` (in memory, with `tokenizer`) after recipes/sft.py on `convs` (run_sft in batches of 64, in a
    temporary folder): the asset builders' supervised pass. options: run_sft's tools, max_response_length, weight_decay."""
    import tempfile

    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(Path(tmp) / "init")
        tokenizer.save_pretrained(Path(tmp) / "init")
        hf = run_sft(Path(tmp) / "init", convs, steps, 64, lr, warmup, work_dir=Path(tmp), seed=seed, **options)
        return AutoModelForCausalLM.from_pretrained(hf)


def save_asset(model, tokenizer, out_dir: Path, readme: str | None = None) -> Path:
    """Write a built model and its tokenizer as a Hugging Face folder (and its README.md)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    if readme is not None:
        (out_dir / "README.md").write_text(readme)
    return out_dir


def greedy_accuracy(model, tokenizer, pairs) -> float:
    """Fraction of `pairs` whose greedy answer is exactly a+b (the held-out metric of the default run)."""
    import torch

    prompts = [
        tokenizer.apply_chat_template(arith_row(a, b, "", 0)["prompt"], add_generation_prompt=True, tokenize=False) for a, b in pairs
    ]
    enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(
            **enc, max_new_tokens=6, do_sample=False, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id
        )
    texts = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    return sum(t.strip() == str(a + b) for t, (a, b) in zip(texts, pairs)) / len(pairs)


def sample_answers(prompts: list[list[dict]], n: int, seed: int, model_dir=MODEL_DIR) -> list[list[str]]:
    """n responses per prompt from the embedded model at temperature 1, decoded as the RL loop decodes them."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    torch.manual_seed(seed)
    out = []
    for s in range(0, len(prompts), 256):
        texts = [tok.apply_chat_template(p, add_generation_prompt=True, tokenize=False) for p in prompts[s : s + 256]]
        enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            gen = model.generate(
                **enc,
                do_sample=True,
                temperature=1.0,
                top_k=0,
                max_new_tokens=8,
                num_return_sequences=n,
                pad_token_id=tok.pad_token_id,
                eos_token_id=tok.eos_token_id,
            )
        dec = tok.batch_decode(gen[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
        out += [dec[i * n : (i + 1) * n] for i in range(len(texts))]
    return out


def build(steps: int = 300, seed: int = 0, out_dir: Path = MODEL_DIR, data_dir: Path = DATA_DIR) -> Path:
    """Write the task parquet files, then warm-start a fresh model with recipes/sft.py and save it."""
    import torch

    torch.manual_seed(seed)
    write_arith_parquet(data_dir, seed)
    train, val = arith_problems(seed)
    corpus = [f"What is {a}+{b}? {a + b}" for a, b in train[:2000]] + ["user assistant"]
    tokenizer = build_tokenizer(corpus)
    model = build_model(len(tokenizer), tokenizer.pad_token_id, tokenizer.eos_token_id, seed=seed)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    convs = [
        arith_row(a, b, "", 0)["prompt"] + [{"role": "assistant", "content": str(a + b)}] for a, b in sft_traces(train, steps, 64, seed)
    ]
    model = warm_start(model, tokenizer, convs, steps, lr=1e-3, warmup=100, seed=seed)
    acc = greedy_accuracy(model, tokenizer, val)
    print(f"held-out greedy accuracy after {steps} SFT steps: {acc:.3f}")
    return save_asset(
        model,
        tokenizer,
        out_dir,
        f"rlkit's embedded starting checkpoint: {sum(p.numel() for p in model.parameters()):,} parameters, "
        f"{steps} SFT steps (recipes/sft.py) on two-digit addition (seed {seed}), held-out greedy accuracy {acc:.3f}. "
        "Rebuild with `python -m rlkit.embedded`.\n",
    )


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300, help="SFT steps (fewer = weaker start)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=MODEL_DIR)
    args = ap.parse_args()
    import torch

    torch.set_num_threads(int(os.environ.get("RLKIT_THREADS", "1")))
    print(json.dumps({"saved": str(build(args.steps, args.seed, args.out))}))
