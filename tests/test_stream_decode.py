"""The fast decoding loop's streaming foundations (issue #37; HFRollout.decode, rlkit/rollout.py):

- drop_finished: finished rows leave the batch (KV cache rows, tokens, positions, mask); the tokens and the RNG state
  afterwards are those of the loop that keeps every row, exactly (multinomial's Exp(1) draw is taken for all rows and
  indexed), the log-probs within rounding (same_rows).
- in-flight weight updates: on_new_weights() polled every swap_every tokens; keep_kv continues on the cache, reprefill
  recomputes it; token_version stamps each token with the version of the weights that sampled it.

A few seconds on one CPU thread.
"""

import pytest
import test_fast_generation as fast
import torch
from numerics import assert_within, log_prob_tol, max_abs_logit
from transformers import AutoModelForCausalLM, LlamaForCausalLM

from rlkit import demos
from rlkit.errors import ConfigError
from rlkit.protocol import DataProto
from rlkit.rollout import DROP_MIN_ROWS, HFRollout

# the fast loop's own test fixtures: the tokenizer, 8 task prompts, the tiny model, a random-weight GQA Llama
tok, prompt_set, tiny, gqa = fast.tok, fast.prompt_set, fast.tiny, fast.gqa


def skewed(rollout, frac=0.12):
    """A fixed random `frac` of the vocabulary ends a response: lengths geometric, most short, a few to the cap."""
    g = torch.Generator().manual_seed(7)
    rollout.eos = torch.randperm(rollout.model.config.vocab_size, generator=g)[: int(frac * rollout.model.config.vocab_size)].tolist()
    return rollout


def batch_sizes(model):
    """Record the rows of every forward (a pre-hook); returns the list and the handle."""
    seen = []
    handle = model.register_forward_pre_hook(lambda m, args, kw: seen.append(kw["input_ids"].shape[0]), with_kwargs=True)
    return seen, handle


def run(model, tok, rows, seed, R, skew=0.12, **kw):
    torch.manual_seed(seed)
    rollout = HFRollout(model, tok, "cpu")
    if skew:
        skewed(rollout, skew)
    out = rollout.generate(rows, R, return_log_probs=True, **kw)
    return out, torch.rand(4)


KEYS = ("responses", "response_mask", "input_ids", "attention_mask", "position_ids")


def same_rows(model, a, b, temperature):
    """Every token tensor equal, the log-probs within log_prob_tol: a forward over fewer rows may take another matmul
    kernel (measured on an AVX-512 CPU: one log-prob of 384 off by 4.8e-7; bit-equal with AVX2), so only rounding may
    differ. (A token could flip only if a sample fell within that rounding of a tie: none does on these seeds.)"""
    for k in KEYS:
        assert torch.equal(a[k], b[k]), k
    bound = log_prob_tol(model.config, max_abs_logit(model, a, temperature or 1.0))  # (T = 0: the untempered log-probs)
    assert_within(a["rollout_log_probs"], b["rollout_log_probs"], bound, "rollout log-probs, rows dropped vs kept")


@pytest.mark.parametrize("temperature,top_p,top_k", [(1.0, 1.0, 0), (0.7, 0.9, 20), (0.0, 1.0, 0)])
@pytest.mark.parametrize("groups", [False, True])
def test_dropping_finished_rows_samples_the_same_tokens_and_log_probs(gqa, tok, prompt_set, temperature, top_p, top_k, groups):
    """Skewed lengths (some rows end at step 1, some run to the cap, 16 rows): the loop that drops finished rows returns
    what the loop that keeps them returns, and leaves the generator where it left it; it did run on fewer rows."""
    rows = prompt_set.batch(list(range(8)), tok.pad_token_id)
    rows = rows.repeat(2, interleave=True) if groups else DataProto.concat([rows, rows])  # 16 rows
    R = 24
    a, ra = run(gqa, tok, rows, 2, R, temperature=temperature, top_p=top_p, top_k=top_k)
    seen, handle = batch_sizes(gqa)
    try:
        b, rb = run(gqa, tok, rows, 2, R, temperature=temperature, top_p=top_p, top_k=top_k, drop_finished=0.25)
    finally:
        handle.remove()
    same_rows(gqa, a, b, temperature)
    assert torch.equal(ra, rb)  # the same random numbers were drawn
    lengths = a["response_mask"].sum(1)
    if temperature > 0:
        assert lengths.min() <= (1 if temperature == 1.0 else 2) and lengths.max() == R, lengths  # skewed: ends at step 1 .. the cap
    assert min(seen) < len(rows) and min(seen) >= DROP_MIN_ROWS, seen  # later steps ran on fewer rows, never under 4


def test_dropping_every_finished_row_at_once_on_the_embedded_model(tiny, tok, prompt_set):
    """drop_finished=1e-9 drops as soon as one row ends (down to DROP_MIN_ROWS), on the embedded model's own EOS."""
    rows = prompt_set.batch(list(range(8)), tok.pad_token_id).repeat(4, interleave=True)
    a, ra = run(tiny, tok, rows, 3, 16, skew=False, temperature=2.0)
    b, rb = run(tiny, tok, rows, 3, 16, skew=False, temperature=2.0, drop_finished=1e-9)
    same_rows(tiny, a, b, 2.0)
    assert torch.equal(ra, rb)
    lengths = a["response_mask"].sum(1)
    assert lengths.min() == 1 and lengths.max() >= 10


def perturbed(model, seed, scale=0.05):
    """Weights B: model's state dict plus noise (a fixed seed)."""
    g = torch.Generator().manual_seed(seed)
    return {k: v + scale * torch.randn(v.shape, generator=g) if v.is_floating_point() else v.clone() for k, v in model.state_dict().items()}


SWAP_SKEW = 0.08  # the swap tests' stop tokens: most rows still running at t, a few ended


@pytest.fixture
def ab(gqa):
    """A fresh copy of the random Llama (weights A: swaps load into it) and its A and B state dicts."""
    model = LlamaForCausalLM(gqa.config).eval()
    model.load_state_dict(gqa.state_dict())
    a = {k: v.clone() for k, v in model.state_dict().items()}
    return model, a, perturbed(model, 11)


def once(version, weights, calls):
    """on_new_weights: (version, weights) the first time, None after; every call's step logged in `calls`."""

    def poll():
        calls.append(len(calls))
        return (version, weights) if len(calls) == 1 else None

    return poll


@pytest.mark.parametrize("drop", [None, 0.25])
def test_reprefill_swap_at_t_continues_as_weights_b_from_the_same_prefix(ab, tok, prompt_set, drop):
    """Swap forced at token t: tokens < t are A's alone; tokens >= t are what B samples from prompt + those t tokens
    with the generator where A left it, exactly; log-probs under the policy that sampled; versions stamped."""
    model, wa, wb = ab
    rows = prompt_set.batch(list(range(8)), tok.pad_token_id)  # distinct prompts: no shared prefill anywhere
    R, t, T, seed = 14, 4, 1.5, 2
    calls = []
    kw = dict(temperature=T, drop_finished=drop)
    swapped, _ = run(
        model, tok, rows, seed, R, skew=SWAP_SKEW, swap_every=t, on_new_weights=once(1, wb, calls), swap_mode="reprefill", **kw
    )
    assert calls == [0, 1, 2]  # polled at t, 2t, 3t (< R): B once, then nothing new
    model.load_state_dict(wa)
    alone, _ = run(model, tok, rows, seed, R, skew=SWAP_SKEW, temperature=T)  # A alone, all R tokens
    torch.manual_seed(seed)
    stop = skewed(HFRollout(model, tok, "cpu"), SWAP_SKEW).eos
    head = skewed(HFRollout(model, tok, "cpu"), SWAP_SKEW).generate(rows, t, temperature=T, return_log_probs=True)  # A's first t
    state = torch.get_rng_state()
    live = (head["response_mask"].sum(1) == t) & ~torch.isin(head["responses"][:, -1], torch.tensor(stop))  # not ended before t
    assert live.sum() >= 4 and not live.all()
    model.load_state_dict(wb)
    prefix = DataProto.from_dict(
        {
            "input_ids": torch.cat([rows["input_ids"], head["responses"]], 1),
            "attention_mask": torch.cat([rows["attention_mask"], torch.ones_like(head["responses"])], 1),
        }
    )
    torch.set_rng_state(state)  # B from the prefix, the generator where A's t steps left it
    tail = skewed(HFRollout(model, tok, "cpu"), SWAP_SKEW).generate(prefix, R - t, temperature=T, return_log_probs=True)
    model.load_state_dict(wa)

    assert torch.equal(swapped["responses"][:, :t], alone["responses"][:, :t])
    assert torch.equal(swapped["rollout_log_probs"][:, :t], alone["rollout_log_probs"][:, :t])
    assert torch.equal(swapped["responses"][live, t:], tail["responses"][live])
    assert torch.equal(swapped["rollout_log_probs"][live, t:], tail["rollout_log_probs"][live])
    assert not torch.equal(swapped["responses"][live, t:], alone["responses"][live, t:])  # B did sample something else
    mask = swapped["response_mask"].bool()
    version = swapped["token_version"]
    assert version.dtype == torch.long and version.shape == (len(rows), R)
    assert (version[:, :t][mask[:, :t]] == 0).all() and (version[:, t:][mask[:, t:]] == 1).all()
    assert (version[~mask] == -1).all() and mask[:, t:].any()


@pytest.mark.parametrize("drop", [None, 1e-9])
def test_keep_kv_swap_keeps_the_tokens_before_t_and_stamps_versions(ab, tok, prompt_set, drop):
    """keep_kv continues on A's cache: tokens before t are A's; from t the weights are B's (the log-probs change) and
    the tokens carry version 7; a callable loader works as well as a state dict."""
    model, wa, wb = ab
    rows = prompt_set.batch(list(range(4)), tok.pad_token_id).repeat(2, interleave=True)  # groups: shared prefill
    R, t, T = 12, 3, 1.5
    calls = []
    swapped, _ = run(model, tok, rows, 4, R, skew=SWAP_SKEW, temperature=T, swap_every=t,
                     on_new_weights=once(7, lambda m: m.load_state_dict(wb), calls), swap_mode="keep_kv", version=6, drop_finished=drop)  # fmt: skip
    model.load_state_dict(wa)
    alone, _ = run(model, tok, rows, 4, R, skew=SWAP_SKEW, temperature=T)
    assert torch.equal(swapped["responses"][:, :t], alone["responses"][:, :t])
    assert torch.equal(swapped["rollout_log_probs"][:, :t], alone["rollout_log_probs"][:, :t])
    mask = swapped["response_mask"].bool()
    assert mask[:, t].any()
    assert not torch.equal(swapped["rollout_log_probs"][:, t:], alone["rollout_log_probs"][:, t:])
    version = swapped["token_version"]
    assert (version[:, :t][mask[:, :t]] == 6).all() and (version[:, t:][mask[:, t:]] == 7).all() and (version[~mask] == -1).all()


def test_keep_kv_and_reprefill_differ_only_after_t(ab, tok, prompt_set):
    """The two modes share everything before the swap; after it keep_kv attends over A's keys and values, reprefill
    over B's, so their log-probs at t differ (the cache is all that differs)."""
    model, wa, wb = ab
    rows = prompt_set.batch(list(range(8)), tok.pad_token_id)
    R, t = 10, 3
    out = {}
    for mode in ("keep_kv", "reprefill"):
        model.load_state_dict(wa)
        out[mode], _ = run(
            model, tok, rows, 9, R, skew=SWAP_SKEW, temperature=1.0, swap_every=t, on_new_weights=once(1, wb, []), swap_mode=mode
        )
    k, r = out["keep_kv"], out["reprefill"]
    assert torch.equal(k["responses"][:, :t], r["responses"][:, :t])
    assert torch.equal(k["token_version"], r["token_version"]) or not torch.equal(k["response_mask"], r["response_mask"])
    live = k["response_mask"][:, t].bool()
    assert live.any() and not torch.equal(k["rollout_log_probs"][live, t], r["rollout_log_probs"][live, t])


def test_a_swap_carries_over_to_the_next_micro_batch(ab, tok, prompt_set):
    model, wa, wb = ab
    rows = prompt_set.batch(list(range(8)), tok.pad_token_id)
    out, _ = run(model, tok, rows, 1, 8, skew=SWAP_SKEW, temperature=1.0, micro_batch_size=4, swap_every=2, on_new_weights=once(3, wb, []))
    model.load_state_dict(wa)
    mask = out["response_mask"].bool()
    assert (out["token_version"][4:][mask[4:]] == 3).all()  # the second micro-batch starts with B's version
    assert (out["token_version"][:4, :2][mask[:4, :2]] == 0).all()


def test_swap_arguments_are_checked(tiny, tok, prompt_set):
    rows = prompt_set.batch([0, 1], tok.pad_token_id)
    rollout = HFRollout(tiny, tok, "cpu")
    with pytest.raises(ConfigError, match="swap_mode"):
        rollout.generate(rows, 4, swap_every=2, on_new_weights=lambda: None, swap_mode="keep")
    with pytest.raises(ConfigError, match="swap_every"):
        rollout.generate(rows, 4, on_new_weights=lambda: None)
    with pytest.raises(ConfigError, match="drop_finished"):
        rollout.generate(rows, 4, drop_finished=0)
    model = AutoModelForCausalLM.from_pretrained(demos.ARITH_MODEL).eval()
    model.generation_config.suppress_tokens = [5]  # an option only generate applies: no fast loop, no swaps
    with pytest.warns(UserWarning), pytest.raises(ConfigError, match="only the fast loop"):
        HFRollout(model, tok, "cpu").generate(rows, 4, swap_every=1, on_new_weights=lambda: None)
    with pytest.raises(ConfigError, match="does not have"):
        rollout.generate(rows, 4, temperature=0, swap_every=1, on_new_weights=lambda: (1, {"no.such.weight": torch.zeros(1)}))
