"""The PPO recipe: end to end on the embedded model, resume, the KL-in-reward controller, and the critic's values."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rlkit import algos, config, demos
from rlkit.protocol import DataProto
from rlkit.rollout import HFRollout

ROOT = Path(__file__).resolve().parents[1]


def load_recipe(name: str = "ppo"):
    spec = importlib.util.spec_from_file_location(f"recipe_{name}", ROOT / "recipes" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


ppo = load_recipe()


def small_config(out_dir, steps=3, n=2, **over):
    cfg = ppo.Config()
    cfg.data.train_batch_size = 8
    cfg.system.data.val_max_samples = 32
    cfg.actor.ppo_mini_batch_size = 4
    cfg.system.actor.ppo_micro_batch_size = 16
    cfg.system.critic.ppo_micro_batch_size = 16
    cfg.rollout.n = n
    cfg.system.trainer.device = "cpu"
    cfg.trainer.total_training_steps = steps
    cfg.system.trainer.default_local_dir = str(out_dir)
    cfg.system.trainer.test_freq = 2
    cfg.system.trainer.save_freq = 2
    options = set(config.flag_values(cfg))  # a trainer option by its flag (--trainer.resume), else PPO's own
    return config.set_flags(cfg, {f"trainer.{k}" if f"trainer.{k}" in options else k: v for k, v in over.items()})


def read_jsonl(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def test_ppo_trains_actor_and_critic_with_n_1_and_checkpoints_both(tmp_path):
    summary = ppo.main(small_config(tmp_path, n=1))

    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    for key in (
        "critic/vf_loss",
        "critic/vf_clipfrac",
        "critic/vpred_mean",
        "critic/values/mean",
        "critic/returns/mean",
        "critic/grad_norm",
        "critic/advantages/mean",
        "actor/reward_kl_penalty",
        "actor/reward_kl_coef",
        "actor/pg_loss",
        "actor/pg_clipfrac",
        "actor/grad_norm",
        "timing/values",
        "timing/update_critic",
    ):
        assert key in rows[1], key
    assert rows[1]["actor/reward_kl_coef"] == 0.001 and rows[1]["actor/reward_kl_penalty"] == 0  # nothing trained yet
    assert rows[3]["actor/reward_kl_penalty"] != 0
    assert set(summary) >= {"val_acc_before", "val_acc_after"}

    # the actor: every parameter moved
    before = load_file(demos.ARITH_MODEL / "model.safetensors")
    after = load_file(tmp_path / "checkpoints/global_step_3/hf/model.safetensors")
    assert all(not torch.equal(before[k], after[k]) for k in before)
    # the critic: in the checkpoint, its body moved away from the policy checkpoint it started from, and it has a value head
    critic = torch.load(tmp_path / "checkpoints/global_step_3/critic/state.pt", weights_only=False)
    assert {"model", "optimizer", "scheduler"} <= set(critic)
    weights = critic["model"]
    assert weights["score.weight"].shape == (1, before["model.embed_tokens.weight"].shape[1])
    shared = [k for k in before if k in weights]
    assert len(shared) == len(before) - ("lm_head.weight" in before)
    assert all(not torch.equal(before[k], weights[k]) for k in shared)
    assert critic["scheduler"]["last_epoch"] == 3 * 8 // 4  # B/M optimizer steps per training step


def _comparable(rows):
    return [{k: v for k, v in r.items() if not k.startswith(("timing/", "perf/"))} for r in rows]


def test_resume_with_critic_warmup_and_adaptive_kl_matches_an_uninterrupted_run(tmp_path):
    over = dict(kl_ctrl="adaptive", kl_penalty="low_var_kl", kl_coef=0.05, target_kl=1e-4, horizon=16, critic_warmup=1)
    full, part = tmp_path / "full", tmp_path / "part"
    ppo.main(small_config(full, steps=4, **over))
    ppo.main(small_config(part, steps=2, **over))  # "interrupted" after step 2 (checkpoint at 2)
    ppo.main(small_config(part, steps=4, resume="auto", **over))

    a, b = read_jsonl(full / "metrics.jsonl"), read_jsonl(part / "metrics.jsonl")
    assert [r["step"] for r in b] == [0, 1, 2, 3, 4]
    assert _comparable(a) == _comparable(b)
    assert "actor/pg_loss" not in a[1] and "critic/vf_loss" in a[1] and "actor/pg_loss" in a[2]  # step 1: critic only
    # beta: n_steps = 16 trajectories = horizon, so each step multiplies it by 1 +- 0.2. KL is 0 at steps 1 and 2
    # (the actor first moves at step 2) and above target after (k3 >= 0): beta shrinks twice, then grows.
    kls = [r["actor/reward_kl_penalty"] for r in a[1:]]
    assert kls[:2] == [0, 0] and min(kls[2:]) > 1e-4
    coefs = [r["actor/reward_kl_coef"] for r in a[1:]]
    assert coefs == pytest.approx([0.05, 0.04, 0.032, 0.0384])
    sa = torch.load(full / "checkpoints/global_step_4/state.pt", weights_only=False)
    sb = torch.load(part / "checkpoints/global_step_4/state.pt", weights_only=False)
    assert sa["kl_ctrl"]["value"] == sb["kl_ctrl"]["value"] == pytest.approx(0.0384 * 1.2)
    ca, cb = (torch.load(d / "checkpoints/global_step_4/critic/state.pt", weights_only=False)["model"] for d in (full, part))
    assert all(torch.equal(ca[k], cb[k]) for k in ca)
    wa = load_file(full / "checkpoints/global_step_4/hf/model.safetensors")
    wb = load_file(part / "checkpoints/global_step_4/hf/model.safetensors")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_kl_in_reward_by_hand():
    # kl (k1) = old - ref = [[.5, 0, .5], [.2, 0, -]]; per-response means 1/3 and 0.1; current KL = 13/60
    batch = DataProto.from_dict(
        tensors={
            "old_log_probs": torch.tensor([[-1.0, -2.0, -0.5], [-1.0, -1.0, 0.0]]),
            "ref_log_prob": torch.tensor([[-1.5, -2.0, -1.0], [-1.2, -1.0, 5.0]]),
            "response_mask": torch.tensor([[1, 1, 1], [1, 1, 0]]),
        }
    )
    scores = torch.tensor([1.0, 0.0])

    up = algos.AdaptiveKLController(0.1, target_kl=0.1, horizon=10)  # 13/60 > 0.1: e = clip(1.1667) = 0.2
    rewards, metrics = ppo.kl_in_reward(scores, batch, up, "kl")
    torch.testing.assert_close(rewards, torch.tensor([[-0.05, 0.0, 0.95], [-0.02, 0.0, 0.0]]))
    assert metrics["actor/reward_kl_coef"] == 0.1  # the beta that was applied
    assert metrics["actor/reward_kl_penalty"] == pytest.approx(13 / 60)
    assert up.value == pytest.approx(0.1 * (1 + 0.2 * 2 / 10))  # n_steps = 2 trajectories

    down = algos.AdaptiveKLController(0.1, target_kl=1.0, horizon=10)  # 13/60 < 1: e = clip(-0.783) = -0.2
    ppo.kl_in_reward(scores, batch, down, "kl")
    assert down.value == pytest.approx(0.1 * (1 - 0.2 * 2 / 10))

    fixed = algos.FixedKLController(0.1)
    ppo.kl_in_reward(scores, batch, fixed, "kl")
    assert fixed.value == 0.1


@pytest.mark.parametrize("lora_rank", [0, 4])
def test_critic_values_sit_at_the_response_positions(lora_rank):
    from transformers import AutoModelForTokenClassification

    from rlkit.placement import build_critic

    cfg = small_config("unused")
    cfg.critic.lora_rank = lora_rank
    critic = build_critic(cfg)
    eng = critic.engine
    torch.manual_seed(0)
    head = torch.randn(1, eng.model.config.hidden_size) * 0.1  # a head that reads the state, whatever its init
    with torch.no_grad():
        for name, p in eng.model.named_parameters():  # with LoRA: score.original_module and score.modules_to_save
            if "score" in name:
                p.copy_(head if name.endswith("weight") else torch.zeros_like(p))

    # a batch with prompts and responses of several lengths (left-padded prompts, right-padded responses)
    from rlkit.config import DataConfig, DataSystem
    from rlkit.data import build_prompts
    from rlkit.engine import load_model

    tok = eng.tokenizer
    prompts = build_prompts(DataConfig().train_files, tok, DataConfig(), DataSystem(), max_samples=6).batch(
        list(range(6)), tok.pad_token_id
    )
    policy_model = load_model(str(demos.ARITH_MODEL), torch.float32, torch.device("cpu"))
    batch = HFRollout(policy_model, tok, torch.device("cpu")).generate(prompts, 8, temperature=2.0)
    lengths = batch["response_mask"].sum(-1)
    assert len(set(lengths.tolist())) > 1

    values = critic.compute_values(batch)["values"]
    assert values.shape == batch["responses"].shape

    manual = AutoModelForTokenClassification.from_pretrained(demos.ARITH_MODEL, num_labels=1).eval()
    with torch.no_grad():
        manual.score.weight.copy_(head)
        manual.score.bias.zero_()
    prompt_mask = batch["attention_mask"][:, : batch["prompts"].shape[1]].bool()
    for i in range(len(batch)):
        p = batch["prompts"][i][prompt_mask[i]]
        r = batch["responses"][i][: lengths[i]]
        with torch.no_grad():
            v = manual(input_ids=torch.cat([p, r])[None]).logits[0, :, 0]
        expected = v[len(p) - 1 : len(p) - 1 + len(r)]  # V(s_t): the state after the prompt and y_<t
        torch.testing.assert_close(values[i, : lengths[i]], expected, atol=1e-5, rtol=1e-4)
        assert torch.all(values[i, lengths[i] :] == 0)

    # one critic step moves the head (with LoRA too: it is saved with the adapter) and reports the critic's metrics
    batch = batch.union(critic.compute_values(batch))
    batch["returns"] = torch.ones_like(values) * batch["response_mask"]
    before = {k: v.clone() for k, v in critic.state_dict()["model"].items()}
    metrics = critic.update(batch, ppo.make_critic_loss(cfg))
    assert {"critic/vf_loss", "critic/vf_clipfrac", "critic/grad_norm", "critic/lr"} <= set(metrics)
    after = critic.state_dict()["model"]
    heads = [k for k in after if "score" in k]
    assert heads and all(not torch.equal(before[k], after[k]) for k in heads)
    if lora_rank:
        assert all("lora_" in k or "modules_to_save" in k for k in after)
