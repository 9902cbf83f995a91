"""Vision-language models (rlkit/vlm.py, docs/vlm.md): images carried with their rows, the vision-token ban at
sampling, M-RoPE positions in the passes, and GRPO / RLOO steps on the embedded tiny Qwen2-VL and on a random tiny
Qwen2.5-VL. Every model here is tiny (~0.2M parameters); the file takes ~1-2 minutes on 2 shared cores."""

import random

import numpy as np
import pytest
import torch
from test_grpo_recipe import load_recipe, read_jsonl

from rlkit import demos, vlm
from rlkit.protocol import DataProto
from scripts.assets import tiny_vlm


@pytest.fixture(scope="module")
def processor():
    return tiny_vlm.build_processor()


@pytest.fixture(scope="module")
def model(processor):
    return tiny_vlm.build_model(tiny_vlm.tiny_config(processor.tokenizer), seed=0).eval()


def rows_with_distinct_images(n: int) -> list[dict]:
    return demos.task_rows(n, seed=7, split="train")


def test_placeholders_become_image_parts_and_pad_tokens_match_the_grid(processor):
    assert vlm.image_messages([{"role": "user", "content": "<image>How many?"}]) == [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "How many?"}]}
    ]
    rows = rows_with_distinct_images(2)
    ids, mm = vlm.render(processor, [r["prompt"] for r in rows], [r["images"] for r in rows])
    pad = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    for x, m in zip(ids, mm):
        # an 84x28 image: 2x6 patches of 14 px, merged 2x2 -> 3 image tokens, one per square
        assert m["image_grid_thw"].tolist() == [[1, 2, 6]]
        assert m["pixel_values"].shape == (12, 3 * 2 * 14 * 14)
        assert x.count(pad) == 3


def test_rows_keep_their_own_pixels_through_repeat_shuffle_split(processor):
    """Rows with distinct images, repeated per group, shuffled and split: each row's pixels are still its own, and the
    micro-batch's concatenated pixels split back by image_grid_thw.prod() give each row its own (TRL #6274's bug)."""
    rows = rows_with_distinct_images(6)
    _, mm = vlm.render(processor, [r["prompt"] for r in rows], [r["images"] for r in rows])
    assert len({m["pixel_values"].sum().item() for m in mm}) == 6  # the images differ
    batch = DataProto.from_dict(tensors={"row": torch.arange(6)}, non_tensors={vlm.MM_KEY: mm})
    seen = 0
    for micro in batch.repeat(4, interleave=True).shuffled(3).split(5):
        own = [mm[int(r)] for r in micro["row"]]
        for m, o in zip(micro[vlm.MM_KEY], own):
            assert torch.equal(m["pixel_values"], o["pixel_values"])
        cat = vlm.collate(micro[vlm.MM_KEY])
        back = vlm.split_by_image(cat["pixel_values"], cat["image_grid_thw"], [1] * len(micro))
        assert all(torch.equal(b["pixel_values"], o["pixel_values"]) for b, o in zip(back, own))
        seen += len(micro)
    assert seen == 24


def test_rollout_never_samples_a_vision_token(processor, model):
    """A model pushed to emit <|image_pad|> (its logit +100): the rollout's ban keeps it out of every response; without
    the ban every response would start with it (the control), and the next forward pass would fail (verl #1640)."""
    from rlkit.rollout import HFRollout

    tok = processor.tokenizer
    pad = tok.convert_tokens_to_ids("<|image_pad|>")
    rows = rows_with_distinct_images(4)
    input_ids, attn, mm = tiny_vlm.encode(processor, rows)
    prompts = DataProto.from_dict(tensors={"input_ids": input_ids, "attention_mask": attn}, non_tensors={vlm.MM_KEY: mm})
    hook = model.lm_head.register_forward_hook(
        lambda m, i, out: out.index_add(-1, torch.tensor([pad]), torch.full((*out.shape[:-1], 1), 100.0))
    )
    try:
        out = HFRollout(model, tok, torch.device("cpu")).generate(prompts.repeat(2), max_new_tokens=4, temperature=1.0)
        vision = ["<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>"]  # from the tokenizer, not vlm.py
        banned = torch.tensor(tok.convert_tokens_to_ids(vision))
        assert pad in banned.tolist() and not torch.isin(out["responses"], banned).any()
        assert vlm.vision_token_ids(model.config) == sorted(banned.tolist())
        extra = vlm.model_inputs(prompts, input_ids, model.config, "cpu")
        free = model.generate(
            input_ids=input_ids, attention_mask=attn, **extra, max_new_tokens=1, do_sample=True, pad_token_id=tok.pad_token_id
        )
        assert (free[:, -1] == pad).all()  # the control: unbanned, the pad token is what it samples
    finally:
        hook.remove()


def test_log_probs_use_mrope_positions_and_do_not_depend_on_the_micro_batch(processor):
    """The embedded VLM's log-probs of sampled responses: the same in micro-batches of 1 and of all rows (pixels sliced
    per micro-batch), equal to a direct forward pass with the model's own 3-row M-RoPE positions, and different from
    one with rlkit's 1-D positions (so the positions matter: a pass that gave them would be wrong)."""
    from rlkit.config import ModelConfig
    from rlkit.engine import TorchEngine
    from rlkit.rollout import HFRollout

    engine = TorchEngine(ModelConfig(path=str(demos.VLM_MODEL)), None, "cpu", need_ref=False)
    assert engine.vlm and not engine.remove_padding
    rows = rows_with_distinct_images(5)
    input_ids, attn, mm = tiny_vlm.encode(processor, rows)
    mm_col = np.empty(len(mm), dtype=object)
    mm_col[:] = mm
    prompts = DataProto.from_dict(tensors={"input_ids": input_ids, "attention_mask": attn}, non_tensors={vlm.MM_KEY: mm_col})
    torch.manual_seed(0)
    batch = HFRollout(engine.model, engine.tokenizer, torch.device("cpu")).generate(prompts, max_new_tokens=4)
    whole, _ = engine.compute_log_prob(batch, 1.0, micro_batch_size=5)
    ones, _ = engine.compute_log_prob(batch, 1.0, micro_batch_size=1)
    # float32: the same rows in other batch shapes differ by rounding only (a few ulps of log-probs of size ~5)
    torch.testing.assert_close(whole, ones, atol=1e-4, rtol=1e-4)
    extra = vlm.model_inputs(batch, batch["input_ids"], engine.model.config, "cpu")
    with torch.no_grad():
        logits = engine.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], **extra).logits
        flat = engine.model(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], position_ids=batch["position_ids"], **extra
        ).logits
    R = batch["responses"].shape[1]

    def scored(lg):
        lp = torch.log_softmax(lg[:, -R - 1 : -1].float(), -1).gather(-1, batch["responses"][..., None])[..., 0]
        return lp * batch["response_mask"]

    torch.testing.assert_close(whole, scored(logits), atol=1e-4, rtol=1e-4)
    assert (whole - scored(flat)).abs().max() > 0.1


def vlm_config(recipe, out_dir, model_path, steps=1):
    cfg = recipe.Config()
    cfg.model.path = model_path
    cfg.system.data.task = "colour_codeword"
    cfg.system.data.task_train_size, cfg.system.data.task_val_size = 16, 8
    cfg.data.max_response_length = 5
    cfg.data.train_batch_size = 8
    cfg.actor.ppo_mini_batch_size = 8
    cfg.system.actor.ppo_micro_batch_size = 12  # 32 rows in 3 micro-batches: the images sliced per micro-batch
    cfg.rollout.n = 4
    cfg.trainer.total_training_steps = steps
    cfg.system.trainer.default_local_dir = str(out_dir)
    cfg.system.trainer.test_freq = 1
    cfg.system.trainer.save_freq = steps
    return cfg


@pytest.mark.parametrize("name,lora", [("grpo", 0), ("rloo", 8), ("dapo", 0)])
def test_vlm_recipe_step_updates_the_language_model_and_exports_the_processor(tmp_path, name, lora):
    """One step of GRPO (full parameters) / RLOO (LoRA) / DAPO on the embedded VLM: the language model moves, the frozen
    vision tower does not, and the HF export loads with its processor (images in, the same token count out)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForImageTextToText
    from transformers.video_processing_utils import BaseVideoProcessor

    recipe = load_recipe(name)
    cfg = vlm_config(recipe, tmp_path, "embedded-vlm")
    cfg.model.lora_rank = lora
    if name == "dapo":  # dynamic sampling: generation batches concatenated, rows (and their pixels) filtered
        cfg.gen_batch_size = 16
    recipe.main(cfg)
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1] and np.isfinite(rows[1]["actor/pg_loss"])
    hf = tmp_path / "checkpoints/global_step_1/hf"
    before = load_file(demos.VLM_MODEL / "model.safetensors")
    after = load_file(hf / "model.safetensors")
    moved = {k for k in before if not torch.equal(before[k], after[k])}
    assert moved and all("visual" not in k for k in moved)
    assert any(k.startswith("model.layers.") for k in moved)  # the language model (saved in the hub checkpoint's names)
    proc = vlm.load_processor(str(hf))
    ids, mm = vlm.render(proc, [[{"role": "user", "content": demos.QUESTION}]], [[vlm.png_bytes(demos.draw("RGB", random.Random(0)))]])
    assert mm[0]["image_grid_thw"].tolist() == [[1, 2, 6]]
    # Where torchvision is installed AutoProcessor also builds the video processor: transformers must find its
    # settings in the export (here the image processor's own file, as in hub checkpoints), or it stops with an OSError.
    video, _ = BaseVideoProcessor.get_video_processor_dict(str(hf))
    assert video["patch_size"] == 14 and video["merge_size"] == 2
    assert type(AutoModelForImageTextToText.from_pretrained(hf)).__name__ == "Qwen2VLForConditionalGeneration"


@pytest.mark.parametrize("kind", ["qwen2_5_vl", "qwen3_vl"])
def test_random_tiny_qwen25_and_qwen3_vl_run_a_grpo_step(tmp_path, kind):
    """A Qwen2.5-VL-shaped model (window-attention vision tower) and a Qwen3-VL-shaped one (patch 16, interleaved
    M-RoPE, deepstack), built from random configs, take the same path as a hub checkpoint
    (--model Qwen/Qwen2.5-VL-3B-Instruct): rollout, log-probs, update, export."""
    processor = tiny_vlm.build_processor(kind)
    model = tiny_vlm.build_model(tiny_vlm.tiny_config(processor.tokenizer, kind=kind), seed=0)
    folder = tmp_path / kind
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    grpo = load_recipe("grpo")
    cfg = vlm_config(grpo, tmp_path / "run", str(folder))
    cfg.actor.entropy_coeff = 0.01  # a random model scores 0 everywhere (no advantage): the entropy term gives a gradient
    grpo.main(cfg)
    rows = read_jsonl(tmp_path / "run/metrics.jsonl")
    assert rows[-1]["step"] == 1 and np.isfinite(rows[-1]["actor/grad_norm"]) and rows[-1]["actor/grad_norm"] > 0
    assert (tmp_path / "run/checkpoints/global_step_1/hf/model.safetensors").is_file()


def test_bad_vision_inputs_are_refused_with_one_line(processor, tmp_path):
    """docs/errors.md's vision-language rows."""
    from rlkit.config import DataConfig, DataSystem
    from rlkit.data import build_prompts
    from rlkit.engine import load_tokenizer
    from rlkit.errors import ConfigError

    rows = rows_with_distinct_images(2)
    with pytest.raises(ConfigError, match=r"row 1: the prompt has 2 <image> placeholder\(s\) but the images column holds 1"):
        vlm.render(processor, [rows[0]["prompt"], [{"role": "user", "content": "<image><image>Two?"}]], [r["images"] for r in rows])
    data_sys = DataSystem(task="colour_codeword", task_train_size=4, task_val_size=2, truncation="left")
    with pytest.raises(ConfigError, match="--data.truncation left would cut image tokens"):
        build_prompts([], load_tokenizer(str(demos.VLM_MODEL)), DataConfig(), data_sys, split="train")


def test_a_critic_or_the_turn_loop_on_a_vlm_is_refused_in_one_line(tmp_path):
    """docs/errors.md's last vision-language rows: PPO's value model, and grpo_tools.py's turn loop (its samplers send
    token ids only: the rollout would sample without the images the update trains with), before any model loads."""
    from rlkit import preflight
    from rlkit.config import ModelConfig
    from rlkit.engine import TorchEngine
    from rlkit.errors import ConfigError

    with pytest.raises(ConfigError, match="a value model on a vision-language model is not supported yet"):
        TorchEngine(ModelConfig(path=str(demos.VLM_MODEL)), None, "cpu", value_head=True)
    ppo = load_recipe("ppo").Config()
    ppo.model.path = str(demos.VLM_MODEL)
    with pytest.raises(ConfigError, match="a value model on a vision-language model is not supported yet"):
        preflight.check_critic(ppo)
    cfg = load_recipe("grpo_tools").Config()
    cfg.model.path = str(demos.VLM_MODEL)
    with pytest.raises(ConfigError, match=r"the multi-turn turn loop \(--agent\.\*\) does not run on a vision-language model"):
        preflight.check_agent(cfg)


def test_colour_codeword_parquet_reads_back_as_the_generated_rows(tmp_path):
    """The shipped parquet is verl's format ({"bytes": PNG} images, <image> in the prompt) and renders like the
    generated task: same prompts, same pixels."""
    from rlkit.config import DataConfig, DataSystem
    from rlkit.data import build_prompts
    from rlkit.engine import load_tokenizer

    tok = load_tokenizer(str(demos.VLM_MODEL))
    files = [str(demos.COLOUR_DATA / "val.parquet")]
    from_file = build_prompts(files, tok, DataConfig(train_files=files), DataSystem(val_files=[]), max_samples=8)
    generated = build_prompts([], tok, DataConfig(), DataSystem(task="colour_codeword", task_val_size=8), split="val")
    assert from_file.input_ids == generated.input_ids
    assert list(from_file.ground_truth) == list(generated.ground_truth)
    for a, b in zip(from_file.multi_modal_inputs, generated.multi_modal_inputs):
        assert torch.equal(a["pixel_values"], b["pixel_values"])
    batch = from_file.batch([3, 1], tok.pad_token_id)
    assert torch.equal(batch[vlm.MM_KEY][0]["pixel_values"], from_file.multi_modal_inputs[3]["pixel_values"])


def test_vlm_grpo_step_on_ray_with_two_fsdp_workers(tmp_path):
    """--trainer.backend ray: two FSDP2 workers, each generating and scoring its half of the rows with their own images
    (the rows travel to the workers with their pixels); the language model moves, the frozen vision tower does not."""
    import ray
    from safetensors.torch import load_file

    from rlkit.ray_group import init_ray

    grpo = load_recipe("grpo")
    cfg = vlm_config(grpo, tmp_path, "embedded-vlm")
    cfg.system.scale_out.backend, cfg.system.scale_out.n_workers = "ray", 2
    init_ray(num_cpus=2)
    try:
        grpo.main(cfg)
    finally:
        ray.shutdown()
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert rows[-1]["step"] == 1 and rows[-1]["actor/grad_norm"] > 0
    before = load_file(demos.VLM_MODEL / "model.safetensors")
    after = load_file(tmp_path / "checkpoints/global_step_1/hf/model.safetensors")
    moved = {k for k in before if not torch.equal(before[k], after[k])}
    assert moved and all("visual" not in k for k in moved)
    assert vlm.load_processor(str(tmp_path / "checkpoints/global_step_1/hf")).image_processor.merge_size == 2


def test_rows_with_two_one_and_no_images_collate_and_split_back(processor):
    """Images per row 2, 0, 1: the batch's pixels are the rows' in order (image j owns grid_thw[j].prod() rows), a row
    without images adds none, and split_by_image returns each row's own."""
    rng = random.Random(0)
    imgs = [[vlm.png_bytes(demos.draw(s, rng)) for s in seqs] for seqs in (["RGB", "CMY"], [], ["BBB"])]
    prompts = [
        [{"role": "user", "content": "<image>then<image>Name the colours."}],
        [{"role": "user", "content": "Name the colours."}],
        [{"role": "user", "content": demos.QUESTION}],
    ]
    ids, mm = vlm.render(processor, prompts, imgs)
    pad = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert [x.count(pad) for x in ids] == [6, 0, 3]
    cat = vlm.collate(mm)
    assert cat["image_grid_thw"].tolist() == [[1, 2, 6]] * 3 and cat["pixel_values"].shape[0] == 36
    back = vlm.split_by_image(cat["pixel_values"], cat["image_grid_thw"], [2, 0, 1])
    for b, m in zip(back, mm):
        assert torch.equal(b["pixel_values"], m["pixel_values"].reshape(-1, cat["pixel_values"].shape[1]))


def test_undecodable_images_and_literal_vision_tokens_are_one_line_errors_naming_the_row(processor, tmp_path):
    """FAIL 13/14 of issue 34: garbage bytes, a decompression-bomb header, a path to a non-image or to no file, and a
    prompt holding the literal <|image_pad|> end in a ConfigError naming the row (and the file), not a PIL traceback
    or a bare StopIteration from the processor."""
    import struct
    import zlib

    from rlkit.errors import ConfigError

    rows = rows_with_distinct_images(2)
    prompts, good = [r["prompt"] for r in rows], [r["images"] for r in rows]
    text_file = tmp_path / "notes.txt"
    text_file.write_text("not an image")
    ihdr = struct.pack(">IIBBBBB", 20000, 20000, 8, 2, 0, 0, 0)  # a PNG header claiming 20000 x 20000 = 400M pixels
    chunk = lambda kind, data: struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))  # noqa: E731
    bomb = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IEND", b"")
    cases = [
        (b"\x00garbage" * 10, r"image 0 \(80 bytes\) is not a readable image"),
        ({"bytes": bomb}, r"image 0 \(\d+ bytes\) is not a readable image \(DecompressionBomb"),
        (str(text_file), rf"image 0 \({text_file}\) is not a readable image"),
        (
            {"bytes": None, "path": str(tmp_path / "gone.png")},
            r"image 0 \(.*gone.png\) is not a readable image \(FileNotFoundError: no such file\)",
        ),
    ]
    for bad, match in cases:
        with pytest.raises(ConfigError, match=rf"^row 1: {match}"):
            vlm.render(processor, prompts, [good[0], [bad]])
    pad = [{"role": "user", "content": "<image>Name the colours.<|image_pad|>"}]
    with pytest.raises(ConfigError, match=r"^row 1: the prompt's text holds the model's vision token <\|image_pad\|>"):
        vlm.render(processor, [prompts[0], pad], good)
    with pytest.raises(ConfigError, match=r"^row 0: the prompt's text holds .*<\|video_pad\|>"):
        vlm.render(processor, [[{"role": "user", "content": "What is <|video_pad|>?"}]], [[]])


def test_an_image_column_not_named_images_is_refused_with_a_hint(tmp_path):
    import datasets

    from rlkit.config import DataConfig, DataSystem
    from rlkit.data import build_prompts
    from rlkit.engine import load_tokenizer
    from rlkit.errors import ConfigError

    rows = rows_with_distinct_images(2)
    path = tmp_path / "train.parquet"
    datasets.Dataset.from_list([{**{k: v for k, v in r.items() if k != "images"}, "image": r["images"][0]} for r in rows]).to_parquet(
        str(path)
    )
    with pytest.raises(ConfigError, match="column 'image' is not read; name it 'images'"):
        build_prompts([str(path)], load_tokenizer(str(demos.VLM_MODEL)), DataConfig(train_files=[str(path)]), DataSystem(val_files=[]))
