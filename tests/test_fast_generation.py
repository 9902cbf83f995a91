"""--rollout.hf-impl fast (HFRollout.decode, rlkit/rollout.py) against transformers' generate: the same tokens, masks,
rollout log-probs and RNG state afterwards, bit for bit, for the same seed (~10 s on one CPU thread).

The fast loop runs the same forward passes (its KV cache, GrowingLayer, holds the same numbers in the same per-row
layout as DynamicLayer's concatenation, so attention computes the same bits) and the same sampling ops in the same
order (transformers' own warpers, softmax, torch.multinomial on the same (B, V) shape), so exact equality is the
contract on any CPU, not a tolerance: both paths round identically wherever they run.
"""

import pytest
import torch
from transformers import AutoModelForCausalLM, GenerationConfig, LlamaConfig, LlamaForCausalLM

from rlkit import demos
from rlkit.config import DataConfig, DataSystem
from rlkit.data import build_prompts
from rlkit.engine import load_tokenizer
from rlkit.errors import ConfigError
from rlkit.rollout import HFRollout, growing_cache, growing_layer_class

KEYS = ("prompts", "responses", "response_mask", "input_ids", "attention_mask", "position_ids")
SAMPLING = [(0.0, 1.0, 0), (1.0, 1.0, 0), (2.0, 1.0, 0), (0.7, 0.9, 20), (1.3, 0.8, 0)]  # (T, top-p, top-k); 0 = greedy


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(str(demos.ARITH_MODEL))


@pytest.fixture(scope="module")
def prompt_set(tok):
    return build_prompts(DataConfig().train_files, tok, DataConfig(), DataSystem(), max_samples=8)


@pytest.fixture(scope="module")
def tiny():
    return AutoModelForCausalLM.from_pretrained(demos.ARITH_MODEL).eval()


@pytest.fixture(scope="module")
def gqa(tok):
    """A random-weight Llama with grouped-query attention (4 heads, 2 KV heads) over the embedded tokenizer: its EOS is
    in the vocabulary but rarely sampled, so most rows run to the length cap."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
    )  # fmt: skip
    return LlamaForCausalLM(config).eval()


def both(model, tok, rows, max_new_tokens=10, seed=3, **kw):
    """(generate's batch, fast's batch, the next torch.rand after each): the same seed before each."""
    out, build = [], {k: kw.pop(k) for k in ("autocast", "kv_dtype") if k in kw}
    for impl in ("generate", "fast"):
        torch.manual_seed(seed)
        rollout = HFRollout(model, tok, "cpu", impl=impl, **build)
        batch = rollout.generate(rows, max_new_tokens, return_log_probs=True, **kw)
        out.append((batch, torch.rand(4)))
    return out[0][0], out[1][0], out[0][1], out[1][1]


def assert_same(a, b, rng_a, rng_b):
    for k in (*KEYS, "rollout_log_probs"):
        assert torch.equal(a[k], b[k]), k
    assert torch.equal(rng_a, rng_b)  # the same random draws were consumed


@pytest.mark.parametrize("temperature,top_p,top_k", SAMPLING)
def test_fast_equals_generate_on_the_embedded_model(tiny, tok, prompt_set, temperature, top_p, top_k):
    """Rows of one prompt each (prefill per row) and groups of 4 (each prompt prefilled once), greedy and sampled."""
    for rows in (
        prompt_set.batch(list(range(8)), tok.pad_token_id),
        prompt_set.batch([0, 1, 2, 3], tok.pad_token_id).repeat(4, interleave=True),
    ):
        a, b, ra, rb = both(tiny, tok, rows, temperature=temperature, top_p=top_p, top_k=top_k)
        assert_same(a, b, ra, rb)
        if temperature == 2.0:  # rows end at their EOS at different steps: pad after it, masks stop there
            lengths = b["response_mask"].sum(1)
            assert lengths.unique().numel() > 1 and lengths.max() <= 10


@pytest.mark.parametrize("temperature,top_p,top_k", SAMPLING[:3])
def test_fast_equals_generate_with_grouped_query_attention_to_the_cap(gqa, tok, prompt_set, temperature, top_p, top_k):
    rows = prompt_set.batch([0, 1, 2], tok.pad_token_id).repeat(3, interleave=True)
    a, b, ra, rb = both(gqa, tok, rows, max_new_tokens=12, temperature=temperature, top_p=top_p, top_k=top_k)
    assert_same(a, b, ra, rb)
    assert b["response_mask"].sum() > 0.8 * b["response_mask"].numel()  # mostly full-length responses


def test_fast_equals_generate_in_micro_batches_and_with_a_bf16_cache(tiny, tok, prompt_set):
    rows = prompt_set.batch(list(range(8)), tok.pad_token_id).repeat(2, interleave=True)
    assert_same(*both(tiny, tok, rows, temperature=1.5, micro_batch_size=6))  # chunks split groups: some prefill per row
    bf16 = dict(autocast=lambda: torch.autocast("cpu", dtype=torch.bfloat16), kv_dtype=torch.bfloat16)
    assert_same(*both(tiny, tok, rows, temperature=1.5, **bf16))


def test_growing_layer_holds_what_dynamic_layer_concatenates_in_one_buffer():
    from transformers.cache_utils import DynamicLayer

    torch.manual_seed(0)
    grow, dyn = growing_layer_class()(capacity=9), DynamicLayer()
    chunks = [torch.randn(2, 3, n, 4) for n in (4, 1, 1)]
    ptrs = set()
    for k in chunks:
        got, want = grow.update(k, -k), dyn.update(k, -k)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        ptrs |= {grow.key_buf.data_ptr(), got[0].data_ptr()}
    assert len(ptrs) == 1  # written in place, never reallocated: the keys are a view of the one buffer
    assert grow.get_seq_length() == dyn.get_seq_length() == 6
    grow.batch_repeat_interleave(3)
    dyn.batch_repeat_interleave(3)
    assert torch.equal(grow.keys, dyn.keys) and torch.equal(grow.values, dyn.values) and grow.keys.shape[0] == 6
    with pytest.raises(RuntimeError, match="capacity"):
        grow.update(torch.randn(6, 3, 4, 4), torch.randn(6, 3, 4, 4))  # 6 + 4 > 9
    half = growing_layer_class()(capacity=2, dtype=torch.bfloat16)
    assert half.update(chunks[1], chunks[1])[0].dtype == torch.bfloat16  # the cache's dtype, not the keys'


def test_fast_falls_back_to_generate_when_generation_config_asks_for_more(tiny, tok, prompt_set):
    """A generation_config option only generate applies (here suppress_tokens) sends fast to generate, with a warning."""
    model = AutoModelForCausalLM.from_pretrained(demos.ARITH_MODEL).eval()
    model.generation_config = GenerationConfig(**{**model.generation_config.to_dict(), "suppress_tokens": [tok.convert_tokens_to_ids("5")]})
    rows = prompt_set.batch(list(range(4)), tok.pad_token_id)
    with pytest.warns(UserWarning, match="suppress_tokens"):
        a, b, ra, rb = both(model, tok, rows, temperature=1.0)
    assert_same(a, b, ra, rb)
    assert growing_cache(model.config, 8) is not None  # the cache itself would have applied


def test_unknown_impl_is_refused(tiny, tok):
    with pytest.raises(ConfigError, match="--rollout.hf-impl"):
        HFRollout(tiny, tok, "cpu", impl="vllm")


def test_fast_equals_generate_on_a_lora_model(tok, prompt_set):
    """A peft LoRA model (the engine's, B perturbed so the adapter acts) under the engine's autocast."""
    from rlkit.config import ActorConfig, ModelConfig
    from rlkit.engine import TorchEngine

    eng = TorchEngine(ModelConfig(lora_rank=4), ActorConfig(lr=1e-3), device="cpu")
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in eng.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    rows = prompt_set.batch([0, 1, 2, 3], tok.pad_token_id).repeat(3, interleave=True)
    assert_same(*both(eng.model, eng.tokenizer, rows, temperature=1.5, autocast=eng.autocast))


def test_the_kv_cache_goes_by_the_name_the_models_forward_takes(tiny, tok, prompt_set):
    """transformers 5.24 renamed forward's `past_key_values` to `cache` (the old name warns on every call: issue 34's
    deprecation warning on the default run). A model whose forward takes `cache` only (refusing the old name) samples
    what the plain model does, with the fast loop and each group's shared prefill, so the cache reached it by its name."""
    from dataclasses import dataclass

    from transformers.utils import ModelOutput

    from rlkit.rollout import cache_arg

    @dataclass
    class Out(ModelOutput):
        logits: torch.Tensor | None = None
        cache: object = None

    class NewNames(LlamaForCausalLM):
        def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, use_cache=None, logits_to_keep=0, **kwargs):
            assert "past_key_values" not in kwargs, "the deprecated name was passed"
            kwargs.update(attention_mask=attention_mask, position_ids=position_ids, use_cache=use_cache, logits_to_keep=logits_to_keep)
            out = super().forward(input_ids=input_ids, past_key_values=cache, **kwargs)
            return Out(logits=out.logits, cache=out.past_key_values)

    new = NewNames(tiny.config).eval()
    new.load_state_dict(tiny.state_dict())
    assert (cache_arg(tiny), cache_arg(new)) == ("past_key_values", "cache")
    rows = prompt_set.batch([0, 1, 2, 3], tok.pad_token_id).repeat(4, interleave=True)
    torch.manual_seed(3)
    a = HFRollout(tiny, tok, "cpu").generate(rows, 10, temperature=1.0, return_log_probs=True)
    torch.manual_seed(3)
    b = HFRollout(new, tok, "cpu").generate(rows, 10, temperature=1.0, return_log_probs=True)
    for k in (*KEYS, "rollout_log_probs"):
        assert torch.equal(a[k], b[k]), k
