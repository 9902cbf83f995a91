"""bench/gpu_memory.py, the memory model behind docs/gpu.md's table (issue #23): its counting tool on hand-made
tensors, its parameter counts against the published model sizes, its pass peaks against the engine's measured on
CPU at a real vocabulary (V = 151,936), and the docs table equal to what it writes now."""

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import gpu_memory as gm  # noqa: E402


def test_live_bytes_counts_storages_while_they_live():
    counter = gm.LiveBytes()
    with counter:
        a = torch.zeros(1000, 1000)  # 4 MB
        b = a * 2  # 8 MB live
        b.view(-1).add_(1)  # a view and an in-place op: no new storage
        del a
        c = b.exp()  # 8 MB again: a was freed
        del b, c
    assert counter.peak == 2 * 4_000_000 and counter.now == 0


def test_parameter_counts_from_the_meta_device_are_the_published_ones():
    # Qwen2.5-{0.5B,1.5B,7B}-Instruct: 494,032,768 / 1,543,714,304 / 7,615,616,512 parameters (their safetensors indexes)
    assert [gm.counts(m)["n"] for m in ("0.5B", "1.5B", "7B")] == [494_032_768, 1_543_714_304, 7_615_616_512]
    c = gm.counts("0.5B")
    # KV cache per token: K and V x 24 layers x 2 KV heads x head dim 64
    assert c["kv"] == 2 * 24 * 2 * 64
    # LoRA rank 16 on q, k, v, o, gate, up, down of 24 layers: 16 x (in + out) each
    h, kv, i = 896, 128, 4864
    assert c["lora"] == 24 * 16 * ((h + h) + 2 * (h + kv) + (h + h) + 2 * (h + i) + (i + h))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return gm.tiny_model(tmp_path_factory.mktemp("tiny-v151936"))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("entropy", [False, True])
@pytest.mark.parametrize("phase", ["log_prob", "update"])
def test_model_predicts_the_engines_measured_peak_within_30_percent(tiny, phase, entropy, dtype):
    """The engine's real pass on CPU (bf16: float32 masters under CPU autocast), its peak counted by LiveBytes, against
    the model's logits term for the engine code installed (gm.engine_code()): 8 rows x 48 response tokens x V = 151,936,
    U = 117 MiB, the logits term dominates (the weights are 2.4 M parameters). +-30 % is what docs/gpu.md promises."""
    measured, predicted = gm.measure_pass(tiny, phase, entropy, dtype=dtype)
    u = 8 * 48 * 151936 * 4
    assert measured > 0.5 * u  # the pass did hold its logits
    assert abs(predicted - measured) <= 0.3 * measured, (
        f"{gm.engine_code()}: predicted {predicted / u:.2f} U, measured {measured / u:.2f} U"
    )


def test_the_docs_table_is_what_the_model_writes_now():
    """docs/gpu.md's table between the markers is `python bench/gpu_memory.py --write-docs`'s: a change of the model (or
    of the engine code it follows) that is not written into the docs fails here."""
    text = gm.DOC.read_text()
    start, end = text.index(gm.BEGIN), text.index(gm.END) + len(gm.END)
    assert text[start:end] == gm.doc_block(), "docs/gpu.md's memory table is stale: run python bench/gpu_memory.py --write-docs"
