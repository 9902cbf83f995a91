"""Vision-language models: images from verl's parquet to the model's forward pass (docs/vlm.md).

A row of verl's multimodal parquet has an `images` column (a list of PNG bytes, or of {"bytes": ...})
and `<image>` placeholders in its prompt's text. The model's processor (AutoProcessor) renders it:
each `<image>` becomes an image part of the message, the chat template writes the model's vision
tokens (Qwen2-VL: <|vision_start|><|image_pad|><|vision_end|>), and the processor repeats the pad
token once per merged patch and returns the pixels::

    input_ids           (L,)       the prompt, with grid.prod() / merge**2 image pad tokens per image
    pixel_values        (p, D)     p = sum over the row's images of t*h*w patches, D = 3*temporal*patch**2
    image_grid_thw      (k, 3)     (t, h, w) patches of each of the row's k images

The pixels travel with their row: `multi_modal_inputs` is a per-row column of dicts
{"pixel_values", "image_grid_thw", "images"} (a DataProto non-tensor; "images": the row's PIL images, which a
vLLM rollout hands to its engine), so repeat / index / split / shuffle keep
every row's images its own. A forward pass concatenates the rows' dicts (`model_inputs`), in row order,
which is how the model consumes them: pixel rows image after image, grid.prod() rows each.

M-RoPE. Qwen2-VL-style models place tokens with 3 rows of position ids (time, height, width) from
`get_rope_index`; rlkit's 1-D position ids would be wrong, so for these models every pass gives none
and the model computes its own from input_ids, attention_mask, image_grid_thw and mm_token_type_ids
(0 text, 1 image: `mm_token_type_ids`). Packing (rlkit/packing.py) and the shared-prompt prefill lay
sequences out with 1-D positions, so they are off for these models (said once at start).
"""

from __future__ import annotations

import io
import os
import re
import warnings

import numpy as np
import torch

PLACEHOLDER = "<image>"
MM_KEY = "multi_modal_inputs"  # the per-row column (verl's name)
_WARNED: set[str] = set()


def is_vlm(config) -> bool:
    """Whether a transformers config is a vision-language model's (it has a vision tower config)."""
    return getattr(config, "vision_config", None) is not None


def vision_token_ids(config) -> list[int]:
    """The ids a response must never contain: image/video pads and the vision start/end markers.

    Sampling one makes the next forward pass fail ("image features and image tokens do not match"):
    the pad count must equal the number of image features. Rollouts ban them (suppress_tokens)."""
    names = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
    ids = [getattr(config, n, None) for n in names]
    return sorted({int(i) for i in ids if i is not None})


def decode_image(value):
    """A PIL RGB image from PNG/JPEG bytes, {"bytes": ...} (datasets' Image feature), a path, or a PIL image.

    A path is opened as given (relative to the working directory) and must be a regular file. PIL's decompression-bomb
    warning (over Image.MAX_IMAGE_PIXELS, 89M pixels) is an error here: the processor would resize it in memory."""
    from PIL import Image

    if isinstance(value, dict):
        value = value.get("bytes") if value.get("bytes") is not None else value.get("path")
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        if isinstance(value, (bytes, bytearray)):
            return Image.open(io.BytesIO(value)).convert("RGB")
        if isinstance(value, str):
            if not os.path.isfile(value):
                raise FileNotFoundError("no such file")
            return Image.open(value).convert("RGB")
    if isinstance(value, Image.Image):
        return value.convert("RGB")
    raise TypeError(f"cannot read an image from a {type(value).__name__}; store PNG bytes or {{'bytes': ...}}")


def png_bytes(image) -> bytes:
    """A PIL image as PNG bytes (what the `images` column stores)."""
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def image_messages(messages: list) -> list:
    """verl's text with `<image>` placeholders -> messages with typed parts (what processors' chat templates take):
    "<image>How many?" -> [{"type": "image"}, {"type": "text", "text": "How many?"}]. Typed content passes through."""
    out = []
    for m in messages:
        content = m["content"]
        if isinstance(content, str) and PLACEHOLDER in content:
            parts = []
            for i, piece in enumerate(re.split(re.escape(PLACEHOLDER), content)):
                if i:
                    parts.append({"type": "image"})
                if piece:
                    parts.append({"type": "text", "text": piece})
            content = parts
        out.append({**m, "content": content})
    return out


def count_images(messages: list) -> int:
    """Image parts (or `<image>` placeholders) in a prompt."""
    n = 0
    for m in messages:
        c = m["content"]
        n += c.count(PLACEHOLDER) if isinstance(c, str) else sum(p.get("type") == "image" for p in c if isinstance(p, dict))
    return n


def split_by_image(pixel_values: torch.Tensor, grid_thw: torch.Tensor, images_per_row: list[int]) -> list[dict]:
    """Batched processor output -> one dict per row: image j owns grid_thw[j].prod() consecutive pixel rows.

    pixel_values (sum_j t_j*h_j*w_j, D), grid_thw (K, 3), images_per_row: k_i with sum k_i = K."""
    patches = grid_thw.prod(-1).tolist()  # (K,) pixel rows per image
    rows, start, img = [], 0, 0
    for k in images_per_row:
        n = sum(patches[img : img + k])
        rows.append({"pixel_values": pixel_values[start : start + n], "image_grid_thw": grid_thw[img : img + k]})
        start, img = start + n, img + k
    if start != len(pixel_values) or img != len(grid_thw):
        raise ValueError(f"{len(pixel_values)} pixel rows / {len(grid_thw)} images do not match the rows' {img} images")
    return rows


def collate(rows) -> dict:
    """The model's image inputs for a batch: the rows' pixel_values and image_grid_thw concatenated in row order
    ({} when no row has an image)."""
    rows = [r for r in rows if r and len(r["image_grid_thw"])]
    if not rows:
        return {}
    return {
        "pixel_values": torch.cat([r["pixel_values"] for r in rows]),
        "image_grid_thw": torch.cat([r["image_grid_thw"] for r in rows]),
    }


def mm_token_type_ids(input_ids: torch.Tensor, config) -> torch.Tensor:
    """0 for text, 1 for image pad tokens, 2 for video pads (what get_rope_index groups by), shaped like input_ids."""
    out = torch.zeros_like(input_ids, dtype=torch.int32)
    out[input_ids == config.image_token_id] = 1
    video = getattr(config, "video_token_id", None)
    if video is not None:
        out[input_ids == video] = 2
    return out


def model_inputs(batch, input_ids: torch.Tensor, config, device) -> dict:
    """Extra forward() arguments for the rows of `batch` (a DataProto) whose ids are `input_ids` ({} for text rows)."""
    if MM_KEY not in batch:
        return {}
    mm = collate(batch[MM_KEY])
    if not mm:
        return {}
    mm = {k: v.to(device) for k, v in mm.items()}
    mm["mm_token_type_ids"] = mm_token_type_ids(input_ids, config).to(device)
    return mm


def render(processor, prompts: list, images: list) -> tuple[list[list[int]], np.ndarray]:
    """Chat messages + their images -> (token ids per row, per-row multi_modal_inputs), one processor call per row.

    prompts: chat messages with `<image>` placeholders (or typed parts); images: per row a list of images (bytes,
    {"bytes": ...}, PIL) in placeholder order."""
    from rlkit.errors import ConfigError

    ids, mm = [], np.empty(len(prompts), dtype=object)
    tokens = [t for t in (getattr(processor, "image_token", None), getattr(processor, "video_token", None)) if t]
    for i, (messages, imgs) in enumerate(zip(prompts, images)):
        messages = image_messages(list(messages))
        imgs = [_read(x, i, j) for j, x in enumerate(imgs if imgs is not None else [])]
        want = count_images(messages)
        if want != len(imgs):
            raise ConfigError(f"row {i}: the prompt has {want} {PLACEHOLDER} placeholder(s) but the images column holds {len(imgs)}")
        literal = next((t for t in tokens if t in str(messages)), None)
        if literal:  # the processor would expand it as an image with no pixels (StopIteration), or the model fail later
            raise ConfigError(
                f"row {i}: the prompt's text holds the model's vision token {literal}; remove it (mark an image with {PLACEHOLDER})"
            )
        text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        enc = processor(text=[text], images=imgs or None, return_tensors="pt")
        ids.append(enc["input_ids"][0].tolist())
        mm[i] = (  # "images": the decoded images themselves, what a vLLM rollout is given (multi_modal_data)
            {"pixel_values": enc["pixel_values"], "image_grid_thw": enc["image_grid_thw"], "images": imgs}
            if imgs
            else {"pixel_values": torch.zeros(0), "image_grid_thw": torch.zeros(0, 3, dtype=torch.long)}
        )
    return ids, mm


def _read(value, row: int, index: int):
    """decode_image, with a one-line error naming the row, the image and the file (or the bytes' size)."""
    from rlkit.errors import ConfigError

    try:
        return decode_image(value)
    except Exception as e:  # noqa: BLE001 - PIL raises many types on bad data; every one is the data's problem
        v = value.get("bytes") if isinstance(value, dict) and value.get("bytes") is not None else value
        v = v.get("path") if isinstance(v, dict) else v
        what = f"{len(v)} bytes" if isinstance(v, (bytes, bytearray)) else str(v)[:200]
        why = " ".join(f"{type(e).__name__}: {e}".split())[:200]
        raise ConfigError(f"row {row}: image {index} ({what}) is not a readable image ({why}); store PNG or JPEG bytes") from None


def _image_only(cls):
    """`cls` (a processor class with a video processor) without it: same name, so its saved files are the original's."""

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        cls.__init__(self, image_processor, tokenizer, None, chat_template=chat_template, **kwargs)

    return type(cls.__name__, (cls,), {"__init__": __init__, "__module__": cls.__module__})


def load_processor(path: str, trust_remote_code: bool = False):
    """AutoProcessor.from_pretrained(path); where transformers cannot build the video processor (it needs torchvision,
    which rlkit's CPU install removes), the same processor class without it (images only; same saved files)."""
    from transformers import AutoProcessor

    try:
        return AutoProcessor.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (AttributeError, TypeError, ValueError, ImportError, OSError) as e:
        import transformers

        if hasattr(transformers, "VideoProcessorMixin"):  # not the missing-torchvision case: a real error
            raise
        name = _processor_class(path, trust_remote_code)
        if name is None or not hasattr(transformers, name):
            raise
        base = getattr(transformers, name)
        if "video_processor" not in base.get_attributes():
            raise
        if name not in _WARNED:  # once per process
            _WARNED.add(name)
            warnings.warn(f"{name}: no video processor without torchvision ({type(e).__name__}); images only", stacklevel=2)
        return _image_only(base).from_pretrained(path, trust_remote_code=trust_remote_code)


def save_processor(processor, path) -> None:
    """processor.save_pretrained(path), so that AutoProcessor.from_pretrained(path) loads the export where torchvision is
    installed. A processor built without torchvision has no video processor, and its nested processor_config.json
    then has nothing transformers can build one from; the image processor's own file (preprocessor_config.json, the
    file hub checkpoints such as Qwen2-VL ship) is written beside it: transformers reads a video processor's settings
    from there when no other config names them."""
    processor.save_pretrained(path)
    if getattr(processor, "video_processor", None) is None and getattr(processor, "image_processor", None) is not None:
        processor.image_processor.save_pretrained(path)


def _processor_class(path: str, trust_remote_code: bool) -> str | None:
    """The processor class a model folder names (processor_config.json, else its model type's default), or None."""
    import json
    from pathlib import Path

    file = Path(path) / "processor_config.json"
    if file.is_file():
        name = json.loads(file.read_text()).get("processor_class")
        if name:
            return name
    from transformers import AutoConfig
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES

    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError):
        return None
    return PROCESSOR_MAPPING_NAMES.get(config.model_type)
