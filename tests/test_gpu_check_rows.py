"""Every row of bench/gpu_check.py that runs in --dry can fail on the defect it names (issue #36): each test puts the
defect back (monkeypatch) and the row FAILs, and the row PASSes without it. (The vlm and judge rows:
tests/test_gpu_readiness.py.)"""

import contextlib
import sys
from pathlib import Path

import pytest
import torch

from rlkit import agent, algos, async_rollout, engine, ulysses
from rlkit.engine import TorchEngine

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))  # bench/gpu_check.py
import gpu_check  # noqa: E402


@pytest.fixture(scope="module")
def ctx(tmp_path_factory):
    """The context the rows get in --dry (gpu_check.make_ctx, as its main builds it), shared by this module's runs."""
    return gpu_check.make_ctx(tmp_path_factory.mktemp("gpu-check"), dry=True)


def run_row(name: str, ctx: dict) -> tuple[str, str]:
    """One row in this process: its status and detail."""
    check = gpu_check.Check()
    check.run(name, gpu_check.ROWS[name][0], ctx, *gpu_check.ROWS[name][1:])
    return check.rows[-1][1:]


def in_recipe(monkeypatch, recipe: str, change) -> None:
    """change(module) applied to recipes/<recipe>.py as the rows load it (each load is a fresh module)."""
    load = gpu_check.load_recipe

    def loaded(name):
        module = load(name)
        if name == recipe:
            change(module)
        return module

    monkeypatch.setattr(gpu_check, "load_recipe", loaded)


def after_init(cls, **attrs):
    """cls.__init__ followed by setting `attrs`: a trainer that decided otherwise."""
    init = cls.__init__

    def patched(self, *args, **kwargs):
        init(self, *args, **kwargs)
        for k, v in attrs.items():
            setattr(self, k, v)

    cls.__init__ = patched


def routes_freely(mp):
    """A TorchEngine whose update compares the batch's routing instead of replaying it."""
    init = TorchEngine.__init__

    def patched(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.router_replay, self.compare_routing = "none", True

    mp.setattr(TorchEngine, "__init__", patched)


def float32_copy(logits, pos, labels, temperature=1.0, with_entropy=False):
    """token_logprob_entropy as it was before chunking: a float32 log-softmax of every logit read."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    entropy = -(logp.exp() * logp).sum(-1) if with_entropy else None
    return logp[pos, labels], entropy


def bf16_load(real):
    """engine.load_model that stores the weights in bf16 whatever the engine asked (full training without masters)."""
    return lambda path, dtype, *args, **kwargs: real(path, torch.bfloat16, *args, **kwargs)


def bf16_adapters(real):
    """engine.add_lora whose adapters are bf16 (as the base): small updates lost in the rounding."""
    return lambda *args: real(*args).to(torch.bfloat16)


def no_gradient(real):
    """algos.value_loss whose loss carries no gradient to the value model."""

    def value_loss(*args, **kwargs):
        loss, clipfrac = real(*args, **kwargs)
        return loss * 0, clipfrac

    return value_loss


def vllm_sampler(lora: bool):
    """agent.sampler_for for vLLM as it was before N6's fix: the engine's generate called directly, without the LoRA
    request (vLLM then samples the base model) unless `lora`."""

    def sampler_for(rollout, temperature, top_p=1.0, top_k=0, rows=None, drop_finished=0.0):
        def sample(contexts, max_new_tokens):
            rollout.wake_up()
            params = [rollout.sampling_params(n, temperature, top_p, top_k) for n in max_new_tokens]
            lora_request = rollout.lora_request if lora else None
            outs = rollout.llm.generate([{"prompt_token_ids": c} for c in contexts], params, use_tqdm=False, lora_request=lora_request)
            return [(list(s.token_ids), [lp[t].logprob for lp, t in zip(s.logprobs, s.token_ids)]) for s in (o.outputs[0] for o in outs)]

        return sample

    return sampler_for


# row -> (the defect put back, words of the FAIL detail)
DEFECTS = {
    "grpo-full": (lambda mp: mp.setattr(engine, "load_model", bf16_load(engine.load_model)), "trained weights {'bfloat16'}"),
    "grpo-lora": (lambda mp: mp.setattr(engine, "add_lora", bf16_adapters(engine.add_lora)), "trained weights {'bfloat16'}"),
    "checkpointing": (lambda mp: mp.setattr(TorchEngine, "_checkpointing", lambda self: contextlib.nullcontext()), "recomputed nothing"),
    "logits-memory": (lambda mp: mp.setattr(algos, "token_logprob_entropy", float32_copy), "the memory model predicts"),
    "critic": (lambda mp: mp.setattr(algos, "value_loss", no_gradient(algos.value_loss)), "no gradient"),
    "token-budget": (lambda mp: mp.setattr(TorchEngine, "micro_batches", lambda self, b, n: b.split(n)), "over the budget"),
    "moe-replay": (lambda mp: routes_freely(mp), "routing disagreement"),
    "async": (
        lambda mp: mp.setattr(async_rollout.Rollouts, "_pack_weights", lambda self, workers, version: {}),
        "staleness [0.0, 1.0, 2.0]",
    ),
    "sft": (lambda mp: mp.setattr(TorchEngine, "micro_batches", lambda self, b, n: [b]), "2 forward passes"),
    "rm-micro-batch": (lambda mp: in_recipe(mp, "rm", lambda rm: after_init(rm.RewardTrainer, micro_batch=10**6)), "a forward of 128"),
    "rm-float32": (lambda mp: in_recipe(mp, "rm", lambda rm: after_init(rm.RewardTrainer, dtype=torch.float32)), "outputs {'float32'}"),
}


@pytest.mark.parametrize("case", DEFECTS)
def test_row_fails_with_its_defect_back(ctx, monkeypatch, case):
    """grpo-full: the weights stored in bf16 (no float32 masters); grpo-lora: bf16 adapters; checkpointing: the layers
    left in eval mode (HF checkpoints none); logits-memory: a float32 copy of the logits instead of the chunked pass;
    critic: a value loss without gradient; token-budget: micro-batches by rows; moe-replay: the update routes freely; async: the trainer's weights never sent
    to the generation process; sft: one pass per mini-batch; rm (N9): a forward of the whole batch, float32 compute."""
    row = case.removesuffix("-micro-batch").removesuffix("-float32")
    status, detail = run_row(row, ctx)
    assert status == "PASS", detail
    DEFECTS[case][0](monkeypatch)
    status, detail = run_row(row, ctx)
    assert status == "FAIL" and DEFECTS[case][1] in detail, detail


def test_ray_row_fails_when_the_resume_restores_no_weights(ctx, monkeypatch):
    """The resumed run said "resumed at step 2" whether or not the workers loaded their checkpoint: the row now compares
    the resumed step 3 with the step 3 of a run never interrupted."""
    pytest.importorskip("ray")
    from rlkit.ray_group import RayWorkerGroup

    assert run_row("ray", ctx)[0] == "PASS"
    monkeypatch.setattr(RayWorkerGroup, "load_checkpoint", lambda self, folder: None, raising=False)
    status, detail = run_row("ray", ctx)
    assert status == "FAIL" and "not resumed" in detail, detail


@pytest.fixture
def vllm():
    from rlkit.vllm_rollout import vllm_available

    if not vllm_available():
        pytest.skip("vLLM is not installed")


def test_vllm_row_fails_when_the_weight_sync_is_skipped(ctx, monkeypatch, vllm):
    """The update must move the trainer's log-probs well past the trainer-vs-vLLM gap: a skipped sync leaves vLLM as far
    as the update moved the trainer."""
    from rlkit.vllm_rollout import VLLMRollout

    assert run_row("vllm", ctx)[0] == "PASS"
    monkeypatch.setattr(VLLMRollout, "sync_weights", lambda self: 0.0)
    status, detail = run_row("vllm", ctx)
    assert status == "FAIL" and "after the update" in detail, detail


def test_tools_row_fails_when_the_multi_turn_sampler_samples_the_base_model(ctx, monkeypatch, vllm):
    """N6: multi-turn + vLLM + LoRA without the LoRA request samples the base model: the trainer-vs-rollout gap is then
    the trainer-vs-base gap (lr 1e-3, two updates)."""
    status, detail = run_row("tools", ctx)  # rlkit's own sampler (VLLMRollout.sample: wakes, passes the LoRA request)
    assert status == "PASS", detail
    monkeypatch.setattr(agent, "sampler_for", vllm_sampler(lora=False))
    status, detail = run_row("tools", ctx)
    assert status == "FAIL" and "to the base model" in detail, detail


@pytest.mark.parametrize(
    "defect, change",
    [
        ("labels rolled after the split", lambda mp: mp.setattr(ulysses, "roll_labels", lambda ids: ids)),  # each shard's own next token
        ("left padding not shifted away", lambda mp: mp.setattr(ulysses, "shift_left", lambda i, m, p: (i, p, 0 * m[:, 0]))),
    ],
)
def test_ulysses_row_fails_when_labels_are_rolled_after_the_split_or_the_padding_is_attended(ctx, monkeypatch, defect, change):
    """The row's 2 processes are forked, so they run this process's rlkit with the defect planted."""
    if defect.startswith("labels"):  # the PASS once, for both cases (~10 s a run on 2 cores)
        status, detail = run_row("ulysses", ctx)
        assert status == "PASS", detail
    change(monkeypatch)
    status, detail = run_row("ulysses", ctx)
    assert status == "FAIL" and "log-probs differ from S = 1" in detail, (defect, detail)
