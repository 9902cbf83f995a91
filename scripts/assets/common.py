"""What the demo builders share: a byte-level tokenizer, a tiny Llama, the supervised warm start (recipes/sft.py, run
from this checkout) and saving a model folder."""

from __future__ import annotations

import os
import random
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the source checkout: recipes/sft.py is run from there

# A ChatML-style template (the format Qwen uses), so the embedded model is prompted the same way.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def set_threads() -> None:
    """A builder's torch threads: $RLKIT_THREADS, else 1 (the numbers in the assets' READMEs were measured so)."""
    import torch

    torch.set_num_threads(int(os.environ.get("RLKIT_THREADS", "1")))


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

    spec = importlib.util.spec_from_file_location("rlkit_recipe_sft", ROOT / "recipes" / "sft.py")
    sft = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sft)
    work_dir = Path(work_dir)
    work_dir.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist([{"messages": c} for c in convs]), work_dir / "sft.parquet")
    cfg = sft.Config(messages_key="messages", tools=tools)
    cfg.model.path = str(init_dir)
    cfg.data.train_files, cfg.system.data.val_files, cfg.data.shuffle = [str(work_dir / "sft.parquet")], [], False
    cfg.data.train_batch_size = cfg.actor.ppo_mini_batch_size = batch_size
    cfg.data.max_response_length, cfg.trainer.seed = max_response_length, seed
    cfg.actor.lr, cfg.actor.warmup_steps, cfg.actor.weight_decay, cfg.actor.grad_clip = lr, warmup, weight_decay, 1.0
    t = cfg.system.trainer  # validation, output, checkpoints
    cfg.trainer.total_training_steps, t.test_freq, t.val_before_train, t.save_freq, t.max_ckpt_to_keep = steps, 0, False, 0, 1
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
