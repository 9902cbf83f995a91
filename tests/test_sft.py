"""recipes/sft.py: the assistant mask, the loss against a hand computation, a short run that learns."""

import importlib.util
import json
from pathlib import Path

import torch

from rlkit.engine import global_counts, load_tokenizer

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("sft", ROOT / "recipes" / "sft.py")
sft = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sft)


def test_assistant_mask_covers_assistant_turns_only_tool_results_masked():
    tok = load_tokenizer(str(ROOT / "rlkit" / "assets" / "tiny-arith"))
    conv = [
        {"role": "user", "content": "What is 12+30?"},
        {"role": "assistant", "content": "call 12+30"},
        {"role": "tool", "content": "42"},
        {"role": "assistant", "content": "42"},
    ]
    ids, mask = sft.assistant_mask(tok, conv)
    assert len(ids) == len(mask)
    # hand-checked: the template renders "<|im_start|>ROLE\nCONTENT<|im_end|>\n" per message, so the trained
    # text is each assistant CONTENT + "<|im_end|>" (the "\n" after it is the template's: generation stops at
    # <|im_end|>, so it is never sampled) -- two runs of 1s, the tool's "42" outside them
    runs, cur = [], []
    for i, m in zip(ids, mask):
        if m:
            cur.append(i)
        elif cur:
            runs.append(cur)
            cur = []
    runs += [cur] if cur else []
    assert [tok.decode(r) for r in runs] == ["call 12+30<|im_end|>", "42<|im_end|>"]
    untrained = tok.decode([i for i, m in zip(ids, mask) if not m])
    assert "<|im_start|>tool\n42<|im_end|>" in untrained and "<|im_start|>assistant\n" in untrained


def test_loss_is_token_mean_nll_over_the_mini_batch():
    log_prob = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -4.0, -9.0]])
    mask = torch.tensor([[1, 1, 0], [0, 1, 1]])
    # a micro-batch of a mini-batch holding 8 assistant tokens: sum over this micro-batch / 8
    loss, parts, _ = sft.sft_loss({"response_mask": mask}, log_prob, None, global_counts(8, 4))
    assert abs(loss.item() - (1 + 2 + 4 + 9) / 8) < 1e-6  # float32 sums of 4 small integers: exact
    assert parts["nll"] is loss


def test_a_short_run_from_scratch_learns(tmp_path):
    cfg = sft.Config()
    cfg.init_from_scratch = True
    cfg.data.train_batch_size = cfg.actor.ppo_mini_batch_size = 32
    cfg.data.val_max_samples = 128
    cfg.actor.warmup_steps = 10
    cfg.trainer.total_training_steps = 60
    cfg.trainer.test_freq = 60
    cfg.trainer.logger = ["console"]
    cfg.trainer.default_local_dir = str(tmp_path / "{experiment_name}")
    cfg.trainer.experiment_name = "sft"
    sft.main(cfg)
    rows = [json.loads(x) for x in (tmp_path / "sft" / "metrics.jsonl").read_text().splitlines()]
    nll = [r["actor/nll"] for r in rows if "actor/nll" in r]
    acc = [r["val/acc"] for r in rows if "val/acc" in r]
    assert nll[-1] < 0.5 * nll[0], nll  # from ~ln(vocab) per token to well under half
    assert rows[-1]["val/loss"] < 0.5 * nll[0]
    assert acc[0] == 0.0 and acc[-1] >= acc[0]


def small(tmp_path, name, steps):
    cfg = sft.Config()
    cfg.data.train_batch_size = cfg.actor.ppo_mini_batch_size = 8
    cfg.data.val_files = []
    cfg.trainer.total_training_steps = steps
    cfg.trainer.save_freq = 2
    cfg.trainer.logger = ["console"]
    cfg.trainer.default_local_dir = str(tmp_path / "{experiment_name}")
    cfg.trainer.experiment_name = name
    cfg.trainer.resume = "auto"
    return cfg


def test_resume_equals_an_uninterrupted_run(tmp_path):
    sft.main(small(tmp_path, "whole", 4))
    sft.main(small(tmp_path, "split", 2))
    sft.main(small(tmp_path, "split", 4))  # resumes at step 2: the optimizer, the data position
    rows = {n: [json.loads(x) for x in (tmp_path / n / "metrics.jsonl").read_text().splitlines()] for n in ("whole", "split")}
    last = {n: [r["actor/nll"] for r in rows[n] if r.get("step") == 4][-1] for n in rows}
    assert abs(last["whole"] - last["split"]) < 1e-5, last  # float32, same ops in the same order: equal to rounding
