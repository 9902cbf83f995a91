"""Model-based reward: a tiny sequence-classification model built here scores (prompt, response) pairs."""

import pytest
import torch
from test_grpo_recipe import load_recipe, read_jsonl, small_config
from transformers import AutoTokenizer, LlamaConfig, LlamaForSequenceClassification

from rlkit import demos
from rlkit.config import RewardConfig
from rlkit.reward_model import RewardModel
from rlkit.rewards import RewardFn

OTHER_TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"


@pytest.fixture(scope="module")
def rm_path(tmp_path_factory):
    """A 1-output classifier with random weights and a chat template unlike the policy's."""
    path = tmp_path_factory.mktemp("rm")
    tok = AutoTokenizer.from_pretrained(demos.ARITH_MODEL)
    tok.chat_template = OTHER_TEMPLATE
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        num_labels=1,
        pad_token_id=tok.pad_token_id,
    )
    LlamaForSequenceClassification(config).save_pretrained(path)
    tok.save_pretrained(path)
    return path


PROMPTS = [[{"role": "user", "content": "What is 2+3?"}], [{"role": "user", "content": "What is 10+31?"}], "plain text prompt "]
RESPONSES = ["5", "41 is the answer", "x"]


def test_scores_equal_a_plain_forward_on_text_in_the_reward_models_own_template(rm_path):
    rm = RewardModel(str(rm_path), micro_batch_size=2)
    assert rm.render(PROMPTS[0], "5") == "[user] What is 2+3?\n[assistant] 5\n"  # its template, not the policy's ChatML
    scores = rm(PROMPTS, RESPONSES)
    model = LlamaForSequenceClassification.from_pretrained(rm_path).eval()
    tok = AutoTokenizer.from_pretrained(rm_path)
    for i, (p, r) in enumerate(zip(PROMPTS, RESPONSES)):  # one at a time: no padding at all
        ids = tok(rm.render(p, r), return_tensors="pt", add_special_tokens=False)
        with torch.no_grad():
            expected = model(**ids).logits[0, 0]
        torch.testing.assert_close(scores[i], expected, atol=1e-5, rtol=0)
    assert scores.std() > 0


def test_a_text_past_max_length_loses_its_prompts_start_and_is_scored_at_the_responses_end(rm_path):
    """Two long responses that differ only in their last token: scored on the last max_length tokens (the prompt's
    start cut), so at each response's own end. (Cut from the right, both were read at the same mid-response token.)"""
    rm = RewardModel(str(rm_path), max_length=48)
    prompt = [{"role": "user", "content": "What is 2+3? " * 8}]
    responses = ["so the answer is clearly " + end for end in ("5", "7")]
    model = LlamaForSequenceClassification.from_pretrained(rm_path).eval()
    scores = rm([prompt, prompt], responses)
    for i, r in enumerate(responses):
        ids = rm.tokenizer(rm.render(prompt, r), add_special_tokens=False)["input_ids"]
        assert len(ids) > 48 > len(rm.tokenizer(r)["input_ids"]) + 16  # the response and its role header fit
        with torch.no_grad():
            expected = model(input_ids=torch.tensor([ids[-48:]])).logits[0, 0]
        torch.testing.assert_close(scores[i], expected, atol=1e-5, rtol=0)
    assert scores[0] != scores[1]


def test_recipes_reward_model_reads_the_datas_lengths(tmp_path, rm_path):
    """build_reward gives the reward model --data.max-prompt-length + --data.max-response-length (what recipes/rm.py
    trains on), not a fixed 2048 tokens."""
    from rlkit.placement import build_reward

    cfg = small_config(load_recipe("grpo"), tmp_path)
    cfg.reward.model_path = str(rm_path)
    cfg.data.max_prompt_length, cfg.data.max_response_length = 3000, 1000
    assert build_reward(cfg).model.max_length == 4000


def test_reward_fn_replaces_or_adds_the_model_score(rm_path):
    rm_scores = RewardModel(str(rm_path))(PROMPTS[:2], ["5", "41"])
    replace = RewardFn.from_config(RewardConfig(model_path=str(rm_path)), device="cpu")
    scores, metrics = replace(["rlkit/arith"] * 2, ["5", "41"], ["5", "40"], prompts=PROMPTS[:2])
    torch.testing.assert_close(scores, rm_scores)
    add = RewardFn.from_config(RewardConfig(model_path=str(rm_path), combine="add"), device="cpu")
    scores, metrics = add(["rlkit/arith"] * 2, ["5", "41"], ["5", "40"], prompts=PROMPTS[:2])
    torch.testing.assert_close(scores, rm_scores + torch.tensor([1.0, 0.0]))  # arith: "5" right, "41" wrong
    assert metrics["reward/acc"] == 0.5 and "reward/model_score" in metrics
    with pytest.raises(ValueError, match="needs the prompts"):
        add(["rlkit/arith"], ["5"], ["5"])


def test_grpo_runs_with_a_reward_model(tmp_path, rm_path):
    grpo = load_recipe("grpo")
    cfg = small_config(grpo, tmp_path, steps=1)
    cfg.reward.model_path = str(rm_path)
    grpo.main(cfg)
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert "reward/model_score" in rows[1] and rows[1]["critic/score/std"] > 0


def test_reward_model_replicas_on_ray_score_like_the_local_model_and_a_ray_run_uses_them(tmp_path, rm_path):
    ray = pytest.importorskip("ray")
    from rlkit.ray_group import RayWorkerGroup, init_ray
    from rlkit.reward_model import RayRewardModel, RewardModelWorker

    init_ray(num_cpus=2)
    try:
        group = RayWorkerGroup(RewardModelWorker, 2, str(rm_path), "cpu", 2, cpus_per_worker=0.5)
        try:
            got = RayRewardModel(group)(PROMPTS, RESPONSES)  # 3 rows over 2 replicas: padded to 4, split, unpadded
        finally:
            group.close()
        torch.testing.assert_close(got, RewardModel(str(rm_path))(PROMPTS, RESPONSES), atol=1e-5, rtol=0)

        grpo = load_recipe("grpo")  # policy on 2 workers, the reward model on a pool of its own (1 replica)
        cfg = small_config(
            grpo, tmp_path, steps=1, backend="ray", n_workers=2, cpus_per_worker=0.5, reward_workers=1, val_before_train=False
        )
        cfg.system.data.val_max_samples = 8
        cfg.reward.model_path = str(rm_path)
        grpo.main(cfg)
        row = read_jsonl(tmp_path / "metrics.jsonl")[-1]
        assert "reward/model_score" in row and row["critic/score/std"] > 0
        assert all(pg["state"] == "REMOVED" for pg in ray.util.placement_group_table().values())  # all pools freed
    finally:
        ray.shutdown()
