"""Tests for rlkit/engine.py, rlkit/rollout.py and rlkit/workers.py on the embedded tiny model (CPU)."""

import importlib.util
import io
from pathlib import Path

import pytest
import torch
from numerics import assert_within, entropy_tol, grad_tol, log_prob_tol, max_abs_logit, tol
from transformers import AutoConfig, AutoModelForCausalLM

from rlkit import algos, demos
from rlkit.config import ActorConfig, ActorSystem, DataConfig, DataSystem, ModelConfig, ModelSystem
from rlkit.data import build_prompts
from rlkit.engine import TorchEngine, load_model, load_tokenizer, trim_padding
from rlkit.placement import build_policy
from rlkit.protocol import DataProto
from rlkit.rollout import HFRollout, assemble, response_mask

ROOT = Path(__file__).resolve().parents[1]
T = 0.7  # the temperature log-probs are computed at
B = 8  # rows per test batch
pytestmark = pytest.mark.numerics  # rerun with the scalar kernels by .ci/run (tests/numerics.py)
CONFIG = AutoConfig.from_pretrained(demos.ARITH_MODEL)  # the tiny model's sizes, for the rounding bounds (numerics.py)


def make_engine(lora_rank: int = 0, gradient_checkpointing: bool = False, nan_policy: str = "error", **actor) -> TorchEngine:
    return TorchEngine(
        ModelConfig(lora_rank=lora_rank),
        ActorConfig(**{"lr": 1e-3, **actor}),
        device="cpu",
        model_sys=ModelSystem(gradient_checkpointing=gradient_checkpointing),
        update_sys=ActorSystem(nan_policy=nan_policy),
    )


@pytest.fixture(scope="module")
def prompt_set():
    tok = load_tokenizer(str(demos.ARITH_MODEL))
    return build_prompts(DataConfig().train_files, tok, DataConfig(), DataSystem(), max_samples=16)


def prompts(prompt_set, tok, rows=B) -> DataProto:
    return prompt_set.batch(list(range(rows)), tok.pad_token_id)


def sample(engine, prompt_set, rows=B, temperature=2.0, seed=0, max_new_tokens=8) -> DataProto:
    """Sampled rollouts; a high temperature gives responses of several lengths (so trimming matters)."""
    torch.manual_seed(seed)
    rollout = HFRollout(engine.model, engine.tokenizer, engine.device)
    return rollout.generate(prompts(prompt_set, engine.tokenizer, rows), max_new_tokens, temperature=temperature)


def likelihood_loss(mb, log_prob, entropy, norm):
    """A simple nonzero loss: minus the token-mean log-likelihood of the responses."""
    return -algos.agg_loss(log_prob, mb["response_mask"], "token-mean", norm=norm), {}, {}


def params(engine) -> list[torch.Tensor]:
    return [p.detach().clone() for p in engine.model.parameters()]


def max_diff(a, b) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b))


def use_sgd(engine, lr: float) -> None:
    """Plain SGD instead of AdamW: the step is linear in the gradient, so gradient differences show."""
    engine.optimizer = torch.optim.SGD([p for p in engine.model.parameters() if p.requires_grad], lr=lr)
    engine.scheduler = torch.optim.lr_scheduler.LambdaLR(engine.optimizer, lambda s: 1.0)


# ----------------------------------------------------------------------------- response_mask / assemble


@pytest.mark.parametrize(
    "row, eos, expected",
    [
        ([5, 2, 0, 0], [2], [1, 1, 0, 0]),
        ([2, 2, 5, 5], [2], [1, 0, 0, 0]),  # only the first EOS counts
        ([5, 5, 5, 5], [2], [1, 1, 1, 1]),  # no EOS: truncated, all valid
        ([5, 5, 5, 2], [2], [1, 1, 1, 1]),
        ([5, 7, 3, 2], [3, 7], [1, 1, 0, 0]),  # several EOS ids: the first of any
        ([5, 3, 7, 7], [3, 7], [1, 1, 0, 0]),
        ([5, 6, 2, 9], [3, 7], [1, 1, 1, 1]),
    ],
)
def test_response_mask(row, eos, expected):
    assert response_mask(torch.tensor([row]), eos).tolist() == [expected]


def test_response_mask_batched():
    rows = torch.tensor([[5, 2, 0, 0], [2, 2, 5, 5], [5, 5, 5, 5]])
    assert response_mask(rows, [2]).tolist() == [[1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 1]]


def test_assemble_concatenates_and_pads_after_eos():
    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    batch = DataProto.from_dict(
        tensors={
            "input_ids": torch.tensor([[0, 0, 11, 12], [13, 14, 15, 16]]),
            "attention_mask": mask,
            "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
        },
        non_tensors={"uid": ["a", "b"]},
    )
    out = assemble(batch, torch.tensor([[21, 2, 23, 24], [25, 26, 27, 28]]), eos=[2], pad_id=0)
    assert out["prompts"].tolist() == [[0, 0, 11, 12], [13, 14, 15, 16]]
    assert out["responses"].tolist() == [[21, 2, 0, 0], [25, 26, 27, 28]]
    assert out["response_mask"].tolist() == [[1, 1, 0, 0], [1, 1, 1, 1]]
    assert out["input_ids"].tolist() == [[0, 0, 11, 12, 21, 2, 0, 0], [13, 14, 15, 16, 25, 26, 27, 28]]
    assert out["attention_mask"].tolist() == [[0, 0, 1, 1, 1, 1, 0, 0], [1] * 8]
    assert out["position_ids"].tolist() == [[0, 0, 0, 1, 2, 3, 3, 3], list(range(8))]
    assert list(out["uid"]) == ["a", "b"]  # per-row fields ride along


def test_trim_padding_drops_all_pad_prompt_columns_and_columns_past_the_longest_response():
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 0, 0], [0, 1, 1, 1, 1, 0, 0, 0]])
    ids = torch.arange(16).view(2, 8)
    trimmed, first, keep = trim_padding({"input_ids": ids, "attention_mask": mask}, prompt_len=4)
    assert (first, keep) == (1, 2)
    assert torch.equal(trimmed["input_ids"], ids[:, 1:6]) and torch.equal(trimmed["attention_mask"], mask[:, 1:6])


# ----------------------------------------------------------------------------- generation


def greedy_by_hand(model, ids: list[int], max_new_tokens: int, eos: list[int]) -> list[int]:
    """Argmax of the logits, one token at a time, on the unpadded prompt (no cache, no mask)."""
    out = []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            nxt = int(model(input_ids=torch.tensor([ids + out])).logits[0, -1].argmax())
            out.append(nxt)
            if nxt in eos:
                break
    return out


def check_greedy(engine, batch, max_new_tokens=8):
    rollout = HFRollout(engine.model, engine.tokenizer, engine.device)
    out = rollout.generate(batch, max_new_tokens, temperature=0)
    for i in range(len(batch)):
        ids = batch["input_ids"][i][batch["attention_mask"][i].bool()].tolist()
        expected = greedy_by_hand(engine.model, ids, max_new_tokens, rollout.eos)
        n = len(expected)
        assert out["responses"][i, :n].tolist() == expected
        assert out["response_mask"][i].tolist() == [1] * n + [0] * (max_new_tokens - n)
        assert (out["responses"][i, n:] == engine.tokenizer.pad_token_id).all()
    return out


def test_generate_shapes_and_greedy(prompt_set):
    eng = make_engine()
    batch = prompts(prompt_set, eng.tokenizer, rows=4)
    assert batch["attention_mask"].sum(1).unique().numel() > 1  # really left-padded
    rollout = HFRollout(eng.model, eng.tokenizer, eng.device)
    sampled = rollout.generate(batch, 6, temperature=1.0)
    P = batch["input_ids"].shape[1]
    assert sampled["responses"].shape == sampled["response_mask"].shape == (4, 6)
    assert sampled["input_ids"].shape == sampled["attention_mask"].shape == sampled["position_ids"].shape == (4, P + 6)
    assert torch.equal(sampled["prompts"], batch["input_ids"])

    greedy = check_greedy(eng, batch)  # every row equals a hand-written argmax loop
    again = rollout.generate(batch, 8, temperature=0)
    in_pairs = rollout.generate(batch, 8, temperature=0, micro_batch_size=2)
    for key in ("responses", "response_mask", "input_ids"):
        assert torch.equal(greedy[key], again[key]) and torch.equal(greedy[key], in_pairs[key])


def test_generate_ignores_sampling_defaults_of_the_model(prompt_set):
    """A hub generation_config.json (Qwen2.5 ships repetition_penalty=1.05) must not bend the samples."""
    eng = make_engine()
    eng.model.generation_config.repetition_penalty = 3.0
    eng.model.generation_config.no_repeat_ngram_size = 1
    check_greedy(eng, prompts(prompt_set, eng.tokenizer, rows=4))


# ----------------------------------------------------------------------------- log-probs


def plain_log_probs(model, batch, temperature):
    """log_softmax(logits / T) at the response tokens, the entropy, and max |logits / T|: one untrimmed forward pass."""
    P = batch["prompts"].shape[1]
    with torch.no_grad():
        logits = (
            model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], position_ids=batch["position_ids"]).logits[
                :, P - 1 : -1
            ]
            / temperature
        )
    logp_all = torch.log_softmax(logits, -1)
    lp, ent = logp_all.gather(-1, batch["responses"].unsqueeze(-1)).squeeze(-1), -(logp_all.exp() * logp_all).sum(-1)
    return lp, ent, logits.abs().max().item()


def test_log_prob_matches_plain_forward_and_is_micro_batch_invariant(prompt_set):
    eng = make_engine()
    batch = sample(eng, prompt_set)
    mask = batch["response_mask"].bool()
    assert mask.sum(1).unique().numel() > 1  # responses of several lengths

    lp, ent = eng.compute_log_prob(batch, T, micro_batch_size=B, with_entropy=True)
    ref_lp, ref_ent, max_logit = plain_log_probs(eng.model, batch, T)
    assert lp.shape == ent.shape == mask.shape
    # Other shapes (trimmed, packed), other kernels: rounding only. The bounds (numerics.py: the forward path's sums,
    # then the V-way log-softmax / entropy sums; ~9e-4 and ~4e-3 nats here) sit far below one bf16/fp16 rounding of
    # the logits (>= 6e-3 nats) and any mask/position/temperature bug (>= 1e-2): those still fail.
    lp_bound, ent_bound = log_prob_tol(eng.model.config, max_logit), entropy_tol(eng.model.config, max_logit, ref_ent[mask].max().item())
    assert_within(lp[mask], ref_lp[mask], lp_bound, "log-prob, engine vs plain forward")
    assert_within(ent[mask], ref_ent[mask], ent_bound, "entropy, engine vs plain forward")
    assert (lp[mask] < 0).all()

    one_lp, one_ent = eng.compute_log_prob(batch, T, micro_batch_size=1, with_entropy=True)  # trimmed per row
    assert_within(one_lp[mask], lp[mask], lp_bound, "log-prob, micro-batch 1 vs 8")
    assert_within(one_ent[mask], ent[mask], ent_bound, "entropy, micro-batch 1 vs 8")
    assert eng.compute_log_prob(batch, T, micro_batch_size=B)[1] is None


# ----------------------------------------------------------------------------- reference policy


def test_reference_is_frozen_copy_for_full_parameter_training(prompt_set):
    eng = make_engine(use_kl_loss=True)
    assert eng.ref_model is not None
    batch = sample(eng, prompt_set)
    mask = batch["response_mask"].bool()
    before, _ = eng.compute_log_prob(batch, T, B)
    assert torch.equal(eng.compute_log_prob(batch, T, B, ref=True)[0], before)

    metrics = eng.update(batch, likelihood_loss, mini_batch_size=B, micro_batch_size=B, temperature=T)
    assert metrics["actor/loss"] != 0
    after, _ = eng.compute_log_prob(batch, T, B)
    assert (after[mask] - before[mask]).abs().max() > 1e-3  # the policy moved
    assert torch.equal(eng.compute_log_prob(batch, T, B, ref=True)[0], before)  # the reference did not


def test_reference_log_probs_need_a_reference(prompt_set):
    """Full-parameter training without use_kl_loss keeps no copy: asking for ref log-probs is an error,
    not silently the policy's own log-probs. An engine without an optimizer never trains: it is its own reference."""
    eng = make_engine(use_kl_loss=False)
    batch = sample(eng, prompt_set, rows=2)
    with pytest.raises(ValueError, match="--actor.use-kl-loss"):
        eng.compute_log_prob(batch, T, B, ref=True)
    frozen = TorchEngine(ModelConfig(), None, device="cpu")
    assert torch.equal(frozen.compute_log_prob(batch, T, B, ref=True)[0], eng.compute_log_prob(batch, T, B)[0])


def test_lora_reference_is_the_base_model_without_a_copy(prompt_set):
    eng = make_engine(lora_rank=4)
    assert eng.ref_model is None
    assert [v for v in vars(eng).values() if isinstance(v, torch.nn.Module)] == [eng.model]  # one model in memory
    base = AutoModelForCausalLM.from_pretrained(demos.ARITH_MODEL, dtype=torch.float32).eval()
    batch = sample(eng, prompt_set)
    mask = batch["response_mask"].bool()
    with torch.no_grad():
        base_lp, _ = eng.forward(base, batch, T, with_entropy=False)

    assert torch.equal(eng.compute_log_prob(batch, T, B, ref=True)[0], base_lp)
    lora = {k: v.clone() for k, v in eng.model.named_parameters() if v.requires_grad}
    assert lora and all("lora_" in k for k in lora)
    eng.update(batch, likelihood_loss, mini_batch_size=B, micro_batch_size=B, temperature=T)
    assert any(not torch.equal(v, dict(eng.model.named_parameters())[k]) for k, v in lora.items())
    policy, _ = eng.compute_log_prob(batch, T, B)
    assert (policy[mask] - base_lp[mask]).abs().max() > 1e-4
    assert torch.equal(eng.compute_log_prob(batch, T, B, ref=True)[0], base_lp)


# ----------------------------------------------------------------------------- the update


def ppo_batch(eng, prompt_set, seed=0) -> DataProto:
    """Rollouts with old log-probs nudged off-policy (so some ratios clip) and random advantages."""
    batch = sample(eng, prompt_set, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    old, _ = eng.compute_log_prob(batch, T, B)
    batch["old_log_probs"] = old + 0.3 * torch.randn(old.shape, generator=gen)
    batch["advantages"] = torch.randn(B, 1, generator=gen) * batch["response_mask"]
    return batch


def ppo_loss(mode, use_norm=True):
    def loss_fn(mb, log_prob, entropy, norm):
        loss, metrics = algos.ppo_clip_loss(
            log_prob, mb["old_log_probs"], mb["advantages"], mb["response_mask"], loss_agg_mode=mode, norm=norm if use_norm else None
        )
        return loss, {}, metrics

    return loss_fn


def one_step(batch, loss_fn, micro_batch_size, sgd_lr=None, **engine_kw):
    torch.manual_seed(0)
    eng = make_engine(**engine_kw)
    if sgd_lr is not None:
        use_sgd(eng, sgd_lr)
    eng.update(batch, loss_fn, mini_batch_size=B, micro_batch_size=micro_batch_size, temperature=T)
    return params(eng)


@pytest.mark.parametrize("mode", algos.LOSS_AGG_MODES)
def test_update_is_micro_batch_invariant(prompt_set, mode):
    batch = ppo_batch(make_engine(), prompt_set)
    start = params(make_engine())
    whole = one_step(batch, ppo_loss(mode), B, sgd_lr=1.0)
    quarters = one_step(batch, ppo_loss(mode), B // 4, sgd_lr=1.0)
    assert max_diff(whole, start) > 1e-3  # the step is large enough for the check to mean something
    # SGD lr 1: the step is the gradient, so the weights differ by the gradients' rounding (numerics.grad_tol, ~1e-5
    # of the largest entry); a per-micro-batch normalisation moves weights by > 1e-4 (the control test below)
    bound = grad_tol(CONFIG, max_diff(whole, start), int(batch["response_mask"].sum()))
    assert_within(whole, quarters, bound, f"weights after one step ({mode}), micro-batch 2 vs 8")


def test_loss_parts_add_up_over_micro_batches(prompt_set):
    """A loss part is summed over micro-batches, so it does not depend on their size (averaging would report a
    quarter of the loss with four micro-batches); the engine prefixes it with the role."""
    batch = ppo_batch(make_engine(), prompt_set)

    def loss_fn(mb, log_prob, entropy, norm):
        loss, _, metrics = ppo_loss("token-mean")(mb, log_prob, entropy, norm)
        return loss, {"pg_loss": loss}, metrics

    def metrics(micro):
        torch.manual_seed(0)
        return make_engine().update(batch, loss_fn, mini_batch_size=B, micro_batch_size=micro, temperature=T)

    whole, quarters = metrics(B), metrics(B // 4)
    assert abs(whole["actor/pg_loss"]) > 1e-4
    assert whole["actor/pg_loss"] == whole["actor/loss"]  # one micro-batch: the same tensor, summed once
    # 4 micro-batches vs 1: the log-probs' rounding (numerics.log_prob_tol) times |d loss / d log p| <= max|A * ratio|,
    # plus the token-mean's own sum; reporting the micro-batch mean instead of the sum would be off by 3/4 of the loss
    real = batch["response_mask"].bool()
    lp, _ = make_engine().compute_log_prob(batch, T, B)
    scale = (batch["advantages"][real].abs().max() * (lp - batch["old_log_probs"])[real].exp().max()).item()
    bound = scale * log_prob_tol(CONFIG, max_abs_logit(make_engine().model, batch, T)) + tol(torch.float32, scale, int(real.sum()))
    assert bound < abs(whole["actor/pg_loss"]) / 4  # the check can see the bug
    assert_within(quarters["actor/pg_loss"], whole["actor/pg_loss"], bound, "pg_loss, micro-batch 2 vs 8")
    assert_within(quarters["actor/loss"], whole["actor/loss"], bound, "loss, micro-batch 2 vs 8")


def test_entropy_reaches_the_loss_with_its_gradient_only_when_asked(prompt_set):
    eng = make_engine()
    batch = ppo_batch(eng, prompt_set)
    seen = []

    def loss_fn(mb, log_prob, entropy, norm):
        seen.append(entropy)
        loss, parts, metrics = ppo_loss("token-mean")(mb, log_prob, entropy, norm)
        return (loss if entropy is None else loss - algos.agg_loss(entropy, mb["response_mask"], norm=norm)), parts, metrics

    eng.update(batch, loss_fn, mini_batch_size=B, micro_batch_size=B, temperature=T)
    loss_fn.needs_entropy = True
    eng.update(batch, loss_fn, mini_batch_size=B, micro_batch_size=B, temperature=T)
    assert seen[0] is None
    assert seen[1].shape == batch["responses"].shape and seen[1].requires_grad and seen[1].max() > 0


def test_micro_batch_invariance_check_detects_wrong_normalisation(prompt_set):
    """Control: normalising each micro-batch by its own token count is not invariant, and the check sees it.

    (SGD, not AdamW: Adam's first step is about lr * g / (|g| + eps), which blows up float noise in
    gradients that nearly cancel, so parameters would differ by ~1e-5 even though the gradients agree.)
    """
    batch = ppo_batch(make_engine(), prompt_set)
    right = one_step(batch, ppo_loss("token-mean"), B // 4, sgd_lr=1.0)
    wrong = one_step(batch, ppo_loss("token-mean", use_norm=False), B // 4, sgd_lr=1.0)
    assert max_diff(right, wrong) > 1e-4


def test_ratio_is_exactly_one_on_policy(prompt_set):
    eng = make_engine(use_kl_loss=False)
    batch = sample(eng, prompt_set)
    batch["old_log_probs"], _ = eng.compute_log_prob(batch, T, micro_batch_size=B // 4)
    batch["advantages"] = torch.randn(B, 1, generator=torch.Generator().manual_seed(0)) * batch["response_mask"]
    seen = []

    def loss_fn(mb, log_prob, entropy, norm):
        loss, parts, metrics = ppo_loss("token-mean")(mb, log_prob, entropy, norm)
        seen.append((log_prob.detach(), mb["old_log_probs"], metrics))
        return loss, parts, metrics

    # two mini-batches of two micro-batches: the second mini-batch comes after one optimizer step
    metrics = eng.update(batch, loss_fn, mini_batch_size=B // 2, micro_batch_size=B // 4, temperature=T)
    for log_prob, old, m in seen[:2]:  # the whole first mini-batch, before any step
        assert torch.equal(log_prob, old)
        assert m["ppo_kl"] == 0 and m["pg_clipfrac"] == 0 and m["pg_clipfrac_lower"] == 0
    assert seen[2][2]["ppo_kl"] != 0  # after the step the ratio moves, so the check above can fail
    assert {"actor/loss", "actor/grad_norm", "actor/lr", "actor/ppo_kl", "actor/pg_clipfrac"} <= set(metrics)


def test_ratio_is_one_up_to_rounding_when_micro_batches_differ(prompt_set):
    """Exactly 1 needs the same micro-batches (same shapes, same float rounding) in both passes."""
    eng = make_engine(use_kl_loss=False)
    batch = sample(eng, prompt_set)
    batch["old_log_probs"], _ = eng.compute_log_prob(batch, T, micro_batch_size=B)
    batch["advantages"] = torch.ones(B, 1) * batch["response_mask"]
    seen = []

    def loss_fn(mb, log_prob, entropy, norm):
        seen.append((log_prob.detach() - mb["old_log_probs"])[mb["response_mask"].bool()].abs().max().item())
        return ppo_loss("token-mean")(mb, log_prob, entropy, norm)

    metrics = eng.update(batch, loss_fn, mini_batch_size=B, micro_batch_size=1, temperature=T)
    assert_within(
        max(seen), 0.0, log_prob_tol(CONFIG, max_abs_logit(eng.model, batch, T)), "log-prob, update (1 row) vs compute_log_prob (8)"
    )
    assert metrics["actor/pg_clipfrac"] == 0  # the ratio stays far inside 1 +- 0.2


def test_gradient_checkpointing_is_active_and_changes_nothing(prompt_set):
    batch = ppo_batch(make_engine(), prompt_set)
    saved_in_forward = {}
    for gc in (False, True):
        eng = make_engine(gradient_checkpointing=gc)
        counter = [0]

        def pack(t, counter=counter):
            counter[0] += t.numel()
            return t

        def loss_fn(mb, log_prob, entropy, norm, gc=gc, counter=counter):
            saved_in_forward.setdefault(gc, counter[0])  # activations kept for backward by the first forward
            return ppo_loss("token-mean")(mb, log_prob, entropy, norm)

        with eng._checkpointing():  # the loss and every gradient of one backward pass
            logp, _ = eng.forward(eng.model, batch, T, False)
            loss = likelihood_loss(batch, logp, None, algos.Norm(num_tokens=int(batch["response_mask"].sum()), num_seqs=B))[0]
            loss.backward()
        saved_in_forward[f"loss{gc}"] = loss.item()
        saved_in_forward[f"grads{gc}"] = [p.grad.clone() for p in eng.model.parameters()]
        eng.optimizer.zero_grad(set_to_none=True)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            metrics = eng.update(batch, loss_fn, mini_batch_size=B, micro_batch_size=B, temperature=T)
        saved_in_forward[f"update_loss{gc}"] = metrics["actor/loss"]
        saved_in_forward[f"params{gc}"] = params(eng)
        assert eng.gradient_checkpointing is gc
        assert not any(m.training for m in eng.model.modules())  # back to eval mode for generation
    assert saved_in_forward[True] < saved_in_forward[False] / 4
    # Exact: recomputation replays the same kernels on the same shapes and autograd accumulates in the same order
    # (measured bit-identical with the default, AVX2 and AVX-512 kernels); a tolerance would hide a replay that differs
    assert saved_in_forward["lossTrue"] == saved_in_forward["lossFalse"]
    assert saved_in_forward["update_lossTrue"] == saved_in_forward["update_lossFalse"]
    assert max_diff(saved_in_forward["gradsFalse"], saved_in_forward["gradsTrue"]) == 0
    assert max_diff(saved_in_forward["paramsFalse"], saved_in_forward["paramsTrue"]) == 0


# ----------------------------------------------------------------------------- the update loop, step by step


def grads_at_each_step(eng) -> list[list[torch.Tensor]]:
    """Record the gradients every optimizer step of `eng` applies (after clipping)."""
    seen, step = [], eng.optimizer.step

    def recording_step(*a, **k):
        seen.append([p.grad.clone() for p in eng.model.parameters() if p.requires_grad])
        return step(*a, **k)

    eng.optimizer.step = recording_step
    return seen


def mini_batch_gradient(eng, batch, mode="token-mean") -> list[torch.Tensor]:
    """The gradient of the mini-batch loss, from one forward pass over the whole batch on a copy of the model."""
    import copy

    model = copy.deepcopy(eng.model)
    logp, _ = eng.forward(model, batch, T, with_entropy=False)
    loss, _ = algos.ppo_clip_loss(logp, batch["old_log_probs"], batch["advantages"], batch["response_mask"], loss_agg_mode=mode)
    loss.backward()
    return [p.grad for p in model.parameters() if p.requires_grad]


@pytest.mark.parametrize("mode", algos.LOSS_AGG_MODES)
def test_update_step_is_the_mini_batch_gradient_without_clipping(prompt_set, mode):
    """SGD with lr 1 and no clipping: the weights move by exactly minus the mini-batch loss's gradient, whatever the
    micro-batches (with clipping on, a wrong constant factor in the loss would be rescaled away: e.g. seq-mean modes
    dividing by the micro-batch's row count instead of the mini-batch's)."""
    batch = ppo_batch(make_engine(), prompt_set)
    torch.manual_seed(0)
    eng = make_engine(grad_clip=1e9)
    use_sgd(eng, 1.0)
    want = mini_batch_gradient(eng, batch, mode)
    before = params(eng)
    eng.update(batch, ppo_loss(mode), mini_batch_size=B, micro_batch_size=B // 4, temperature=T)
    step = [a - b for a, b in zip(params(eng), before)]
    g_max = max(g.abs().max().item() for g in want)
    assert g_max > 1e-3
    # micro-batches of 2 vs one pass: the gradients' rounding (numerics.grad_tol), plus rounding p - g at |p| (~0.1);
    # a wrong loss factor (e.g. 1/4 per micro-batch) moves the step by ~g_max, far above it
    p_max = max(p.abs().max().item() for p in before)
    bound = grad_tol(CONFIG, g_max, int(batch["response_mask"].sum())) + tol(torch.float32, p_max, 1)
    assert_within(step, [-g for g in want], bound, "SGD step vs minus the mini-batch gradient")


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_a_mini_batch_without_response_tokens_is_a_zero_loss_not_nan(prompt_set, mode):
    """Every response empty (e.g. all cut by a mask): the normaliser is at least 1 token, so the loss is 0 and the step
    takes no gradient (0 / 0 would be NaN and stop the run, or with nan-policy skip drop the step)."""
    batch = ppo_batch(make_engine(), prompt_set)
    batch["response_mask"] = torch.zeros_like(batch["response_mask"])
    torch.manual_seed(0)
    eng = make_engine(grad_clip=1e9)
    use_sgd(eng, 1.0)
    before = params(eng)
    metrics = eng.update(batch, ppo_loss(mode), mini_batch_size=B, micro_batch_size=B // 2, temperature=T)
    assert metrics["actor/loss"] == 0.0 and metrics["actor/grad_norm"] == 0.0 and "actor/skipped_steps" not in metrics
    assert max_diff(params(eng), before) == 0.0


def test_gradient_clipping_bounds_the_step_and_the_norm_is_reported_before_clipping(prompt_set):
    batch = ppo_batch(make_engine(), prompt_set)
    torch.manual_seed(0)
    eng = make_engine(grad_clip=1e-3)
    use_sgd(eng, 1.0)
    full_norm = torch.cat([g.flatten() for g in mini_batch_gradient(eng, batch)]).norm().item()
    before = params(eng)
    metrics = eng.update(batch, ppo_loss("token-mean"), mini_batch_size=B, micro_batch_size=B // 2, temperature=T)
    moved = torch.cat([(a - b).flatten() for a, b in zip(params(eng), before)]).norm().item()
    assert full_norm > 0.1  # far above the clip, so clipping matters
    # the norm before clipping: 2 micro-batches vs one pass, entries within grad_tol (3.5e-5 of the largest entry,
    # numerics.py), which dominate the norm; clipping to 1e-3 instead would be off by a factor > 100
    assert metrics["actor/grad_norm"] == pytest.approx(full_norm, rel=1e-4)
    # the step: lr x the clipped norm = 1e-3 * |g| / (|g| + 1e-6) (rel 1e-5); the weights' own rounding (u |w| ~ 6e-9
    # per entry, against ~1e-6 per entry of the step) averages out of the norm
    assert moved == pytest.approx(1e-3, rel=1e-3)


@pytest.mark.filterwarnings("ignore:Seems like `optimizer.step\\(\\)` has been overridden")  # the recording wrapper
def test_gradients_are_reset_between_mini_batches(prompt_set):
    """Each optimizer step applies its own mini-batch's gradient (lr 0: the weights stay put, so each mini-batch's
    gradient can be computed on its own and compared)."""
    batch = ppo_batch(make_engine(), prompt_set)
    torch.manual_seed(0)
    eng = make_engine(grad_clip=1e9)
    use_sgd(eng, 0.0)
    seen = grads_at_each_step(eng)
    eng.update(batch, ppo_loss("token-mean"), mini_batch_size=B // 2, micro_batch_size=B // 4, temperature=T)
    assert len(seen) == 2
    for got, mini in zip(seen, batch.split(B // 2)):
        want = mini_batch_gradient(eng, mini)  # one pass vs two micro-batches: rounding (numerics.grad_tol)
        bound = grad_tol(CONFIG, max(w.abs().max().item() for w in want), int(mini["response_mask"].sum()))
        assert_within(got, want, bound, "gradient of each mini-batch, accumulated vs one pass")


def test_warmup_raises_the_learning_rate_linearly_over_the_first_steps(prompt_set):
    batch = ppo_batch(make_engine(), prompt_set)
    eng = make_engine(lr=1e-3, warmup_steps=3)
    lrs = []

    def loss_fn(mb, log_prob, entropy, norm):
        lrs.append(eng.optimizer.param_groups[0]["lr"])
        return ppo_loss("token-mean")(mb, log_prob, entropy, norm)

    metrics = eng.update(batch, loss_fn, mini_batch_size=B // 4, micro_batch_size=B // 4, temperature=T, epochs=2)
    assert lrs == pytest.approx([1e-3 / 3, 2e-3 / 3, 1e-3, 1e-3, 1e-3, 1e-3, 1e-3, 1e-3], rel=1e-9)
    assert metrics["actor/lr"] == pytest.approx(sum(lrs) / len(lrs), rel=1e-9)  # the mean over the optimizer steps


def test_each_epoch_reshuffles_the_mini_batches(prompt_set):
    batch = ppo_batch(make_engine(), prompt_set)
    batch["row"] = torch.arange(B)
    eng = make_engine()
    order = []

    def loss_fn(mb, log_prob, entropy, norm):
        order.append(mb["row"].tolist())
        return ppo_loss("token-mean")(mb, log_prob, entropy, norm)

    eng.update(batch, loss_fn, mini_batch_size=B // 2, micro_batch_size=B // 2, temperature=T, epochs=2, shuffle_seed=5)
    first, second = order[0] + order[1], order[2] + order[3]
    assert sorted(first) == sorted(second) == list(range(B))  # each epoch sees every row once
    assert first != list(range(B)) and second != first  # shuffled, and anew in the second epoch
    order.clear()
    eng.update(batch, loss_fn, mini_batch_size=B // 2, micro_batch_size=B // 2, temperature=T, epochs=1, shuffle_seed=5)
    assert order[0] + order[1] == first  # the order is the seed's, so a resumed run repeats it


# ----------------------------------------------------------------------------- non-finite losses


def nan_loss(mb, log_prob, entropy, norm):
    return log_prob.sum() * float("nan"), {}, {}


def nan_grad_loss(mb, log_prob, entropy, norm):
    return torch.sqrt(log_prob * 0).sum(), {}, {}  # value 0, gradient NaN


@pytest.mark.parametrize("loss_fn, message", [(nan_loss, "non-finite loss"), (nan_grad_loss, "non-finite gradient")])
def test_non_finite_loss_or_gradient(prompt_set, loss_fn, message):
    eng = make_engine()
    batch = sample(eng, prompt_set)
    before = params(eng)
    with pytest.raises(FloatingPointError, match="--actor.nan-policy") as info:
        eng.update(batch, loss_fn, mini_batch_size=B, micro_batch_size=B // 2, temperature=T)
    assert message in str(info.value)
    assert max_diff(params(eng), before) == 0

    eng = make_engine(nan_policy="skip")
    metrics = eng.update(batch, loss_fn, mini_batch_size=B, micro_batch_size=B // 2, temperature=T)
    assert metrics["actor/skipped_steps"] == 1
    assert max_diff(params(eng), before) == 0
    assert not eng.optimizer.state and eng.scheduler.last_epoch == 0  # no optimizer or scheduler step either


# ----------------------------------------------------------------------------- loading and state


def test_load_model_missing_local_path(tmp_path):
    path = str(tmp_path / "no-such-model")
    with pytest.raises(FileNotFoundError, match="hub id") as info:
        load_model(path, torch.float32, torch.device("cpu"))
    assert path in str(info.value)
    with pytest.raises(FileNotFoundError, match="hub id"):  # the engine checks the model before the tokenizer
        TorchEngine(ModelConfig(path=path), ActorConfig(), device="cpu")


@pytest.mark.parametrize("lora_rank", [0, 4])
def test_state_dict_round_trip(prompt_set, lora_rank):
    a = make_engine(lora_rank=lora_rank)
    batch = ppo_batch(a, prompt_set)
    loss_fn = ppo_loss("token-mean")

    def step(eng):
        return eng.update(batch, loss_fn, mini_batch_size=B // 2, micro_batch_size=B // 4, temperature=T)

    step(a)
    buf = io.BytesIO()  # through bytes, as a checkpoint is (in memory, optimizer state tensors would be shared)
    torch.save(a.state_dict(), buf)
    buf.seek(0)
    b = make_engine(lora_rank=lora_rank)
    assert max_diff(params(a), params(b)) > 0
    b.load_state_dict(torch.load(buf, weights_only=False))
    assert max_diff(params(a), params(b)) == 0
    assert b.scheduler.last_epoch == a.scheduler.last_epoch == 2
    sa, sb = a.optimizer.state_dict()["state"], b.optimizer.state_dict()["state"]
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k]["exp_avg_sq"], sb[k]["exp_avg_sq"]) for k in sa)

    step(a)
    step(b)
    assert max_diff(params(a), params(b)) == 0


# ----------------------------------------------------------------------------- workers


def load_recipe(name="grpo"):
    spec = importlib.util.spec_from_file_location(f"recipe_{name}", ROOT / "recipes" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_workers_with_the_grpo_recipe_config():
    grpo = load_recipe()
    cfg = grpo.Config()
    cfg.system.trainer.device = "cpu"
    cfg.rollout.n = 2
    cfg.data.max_response_length = 6
    cfg.actor.ppo_mini_batch_size, cfg.system.actor.ppo_micro_batch_size = 2, 2
    policy = build_policy(cfg)
    tok = policy.tokenizer
    batch = build_prompts(cfg.data.train_files, tok, cfg.data, cfg.system.data, max_samples=2).batch([0, 1], tok.pad_token_id)
    batch["uid"] = ["p0", "p1"]
    batch = batch.repeat(cfg.rollout.n)

    out = policy.generate(batch)
    assert {"prompts", "responses", "response_mask", "input_ids", "attention_mask", "position_ids"} <= set(out.tensors)
    assert out["responses"].shape == out["response_mask"].shape == (4, 6)
    assert list(out["uid"]) == ["p0", "p0", "p1", "p1"] and "ground_truth" in out
    val = policy.generate(batch, validate=True)  # val_temperature 0: greedy, so the two samples of a prompt agree
    assert torch.equal(val["responses"][0::2], val["responses"][1::2])

    ref = policy.compute_ref_log_prob(out)
    old = policy.compute_log_prob(out)
    assert ref.keys() == ["ref_log_prob"] and old.keys() == ["old_log_probs", "entropys"]
    assert ref["ref_log_prob"].shape == old["old_log_probs"].shape == old["entropys"].shape == (4, 6)
    assert torch.equal(ref["ref_log_prob"], old["old_log_probs"])  # nothing trained yet

    out = out.union(ref).union(old)
    adv = algos.grpo_advantage(torch.tensor([1.0, 0.0, 0.0, 1.0]), out["uid"])
    out["advantages"] = adv[:, None] * out["response_mask"]
    metrics = policy.update(out, grpo.make_actor_loss(cfg))
    expected = {
        "actor/loss",
        "actor/grad_norm",
        "actor/lr",
        "actor/pg_loss",
        "actor/kl_loss",
        "actor/ppo_kl",
        "actor/pg_clipfrac",
        "actor/pg_clipfrac_lower",
    }
    assert expected <= set(metrics)
    assert metrics["actor/ppo_kl"] == 0 and metrics["actor/kl_loss"] == 0  # one on-policy step from the reference
    assert metrics["actor/lr"] == cfg.actor.lr and policy.updates == 1
    assert policy.state_dict()["updates"] == 1
    assert (policy.compute_log_prob(out)["old_log_probs"] - old["old_log_probs"]).abs().max() > 0


def test_hf_rollout_log_probs_match_the_trainers():
    """`rollout_log_probs` from generation's raw logits equal the engine's teacher-forced log-probs."""
    from rlkit.config import ActorConfig, DataConfig, DataSystem, ModelConfig
    from rlkit.data import build_prompts
    from rlkit.engine import TorchEngine
    from rlkit.rollout import HFRollout

    torch.manual_seed(0)
    engine = TorchEngine(ModelConfig(), ActorConfig())
    prompts = build_prompts([str(demos.ARITH_DATA / "val.parquet")], engine.tokenizer, DataConfig(), DataSystem(), max_samples=6)
    batch = HFRollout(engine.model, engine.tokenizer, engine.device).generate(
        prompts.batch(list(range(6)), engine.tokenizer.pad_token_id).repeat(2), 8, temperature=0.7, return_log_probs=True
    )
    trainer_lp, _ = engine.compute_log_prob(batch, temperature=0.7, micro_batch_size=4)
    mask = batch["response_mask"].bool()
    assert mask.sum() > 12
    # generation's incremental (KV-cache) forward vs the teacher-forced one: rounding only (numerics.log_prob_tol)
    bound = log_prob_tol(engine.model.config, max_abs_logit(engine.model, batch, 0.7))
    assert_within(batch["rollout_log_probs"][mask], trainer_lp[mask], bound, "log-prob, generation vs teacher-forced")
    assert torch.all(batch["rollout_log_probs"][~mask] == 0)


def test_on_policy_update_without_old_log_probs_equals_the_update_with_them():
    """One optimizer step: reusing the update's own detached log-probs as log pi_old gives the same weights
    as computing them in a separate pass; with several optimizer steps it is refused."""
    from rlkit.config import ActorConfig, DataConfig, DataSystem, ModelConfig
    from rlkit.data import build_prompts
    from rlkit.engine import TorchEngine
    from rlkit.rollout import HFRollout

    def loss_fn(mb, logp, ent, norm):
        loss, metrics = algos.ppo_clip_loss(logp, mb["old_log_probs"], mb["advantages"], mb["response_mask"], norm=norm)
        return loss, {}, metrics

    torch.manual_seed(0)
    a, b = TorchEngine(ModelConfig(), ActorConfig(lr=1e-3)), TorchEngine(ModelConfig(), ActorConfig(lr=1e-3))
    prompts = build_prompts([str(demos.ARITH_DATA / "val.parquet")], a.tokenizer, DataConfig(), DataSystem(), max_samples=8)
    batch = HFRollout(a.model, a.tokenizer, a.device).generate(prompts.batch(list(range(8)), a.tokenizer.pad_token_id).repeat(2), 8)
    batch["advantages"] = torch.randn(len(batch), 1) * batch["response_mask"]
    with_old = batch.union(DataProto.from_dict(tensors={"old_log_probs": a.compute_log_prob(batch, 1.0, 16)[0]}))
    a.update(with_old, loss_fn, mini_batch_size=16, micro_batch_size=16)
    metrics = b.update(batch, loss_fn, mini_batch_size=16, micro_batch_size=16)
    assert metrics["actor/entropy"] > 0  # the entropy metric comes from the update's own pass
    for (name, p), q in zip(a.model.named_parameters(), b.model.parameters()):
        # same micro-batch, same shapes: the separate pass and the update's own pass are one computation (ratio exactly 1),
        # so the gradients and AdamW steps agree: 1e-7 is under one ulp of a weight near 1 (1.2e-7), i.e. near-exact
        torch.testing.assert_close(p, q, atol=1e-7, rtol=0, msg=name)
    with pytest.raises(ValueError, match="compute them with policy.compute_log_prob"):
        b.update(batch, loss_fn, mini_batch_size=8, micro_batch_size=8)


@pytest.mark.parametrize("clip", [0.0, -1.0, float("nan")])
def test_an_engine_built_directly_refuses_a_grad_clip_that_is_not_positive(clip, monkeypatch):
    """The recipes' preflight refuses --actor.grad-clip <= 0; an engine built in a notebook or a new recipe gets the same
    one line, before its model loads (0 would zero every update: clip_grad_norm_ scales the gradient to norm 0)."""
    import rlkit.engine as engine_module

    monkeypatch.setattr(engine_module, "load_model", lambda *a, **k: pytest.fail("the model loaded"))
    from rlkit.errors import ConfigError

    with pytest.raises(ConfigError, match=r"--actor.grad-clip .*must be > 0"):
        make_engine(grad_clip=clip)
