"""recipes/rm.py: the Bradley-Terry loss against a hand computation, a tiny RM that learns, its export scored by the
RL reward path exactly as the trainer scores, resume, and one-line errors."""

import json
import math
import random
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from test_grpo_recipe import ROOT, load_recipe

from rlkit import demos
from rlkit.config import RewardConfig, set_flags
from rlkit.errors import ConfigError, MissingFile
from rlkit.rewards import RewardFn
from scripts.assets import tiny_arith

rm = load_recipe("rm")


def test_loss_margin_centring_and_accuracy_against_hand_values():
    # two pairs of a mini-batch of 4: chosen rewards (2, 0.5), rejected (1, 1.5), margins (0.5, 0), eta 0.1
    rewards = torch.tensor([2.0, 0.5, 1.0, 1.5])
    margin = torch.tensor([0.5, 0.0, 0.5, 0.0])  # (2b,): each pair's margin on its chosen and its rejected row
    loss, m = rm.bt_loss(rewards, margin, num_pairs=4, center_coef=0.1)
    # pair 1: -log sigmoid(2 - 1 - 0.5) = log(1 + e^-0.5) = 0.4740770, + 0.1 * (2 + 1)^2 = 0.9
    # pair 2: -log sigmoid(0.5 - 1.5)   = log(1 + e^1)    = 1.3132617, + 0.1 * (0.5 + 1.5)^2 = 0.4
    expected = (0.4740770 + 0.9 + 1.3132617 + 0.4) / 4
    assert abs(loss.item() - expected) < 1e-6  # float32 of O(1) values: ~1e-7 rounding, 7-digit constants
    assert m["rm/acc"] == 0.25 and abs(m["rm/margin"] - (1.0 - 1.0) / 4) < 1e-7  # one pair of 4 ranked right
    plain, _ = rm.bt_loss(rewards, torch.zeros(4), num_pairs=2)  # no margin, no centring: mean over the 2 pairs
    assert abs(plain.item() - (math.log(1 + math.exp(-1)) + math.log(1 + math.e)) / 2) < 1e-6


def write_pairs(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def easy_pairs(tmp_path):
    """Right answers vs impossible ones (3 digits, >= 200: two-digit sums stop at 198), on the task's train/val split."""
    train, val = tiny_arith.arith_problems(0)
    rng = random.Random(0)

    def rows(problems):
        return [
            {"prompt": [{"role": "user", "content": f"What is {a}+{b}?"}], "chosen": str(a + b), "rejected": str(rng.randint(200, 999))}
            for a, b in problems
        ]

    return write_pairs(tmp_path / "train.parquet", rows(train[:400])), write_pairs(tmp_path / "val.parquet", rows(val[:64]))


def config(tmp_path, train, val, steps, name="rm", **fields):
    cfg = rm.Config()
    cfg.data.train_files, cfg.system.data.val_files = [train], [val] if val else []
    cfg.data.train_batch_size = 32
    cfg.actor.warmup_steps = 5
    cfg.trainer.total_training_steps = steps
    cfg.system.trainer.test_freq = steps
    cfg.system.trainer.num_threads = 1
    cfg.system.trainer.default_local_dir = str(tmp_path / "{experiment_name}")
    cfg.system.trainer.experiment_name = name
    for k, v in fields.items():
        setattr(cfg, k, v)
    return cfg


def rows_of(tmp_path, name):
    return [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]


def test_a_tiny_reward_model_learns_held_out_pairs(tmp_path):
    """~15 s: 30 steps of 32 pairs, full fine-tuning of the embedded model with a fresh head."""
    train, val = easy_pairs(tmp_path)
    summary = rm.main(config(tmp_path, train, val, steps=30))
    val_rows = [r for r in rows_of(tmp_path, "rm") if "val/pair_acc" in r]
    assert [r["step"] for r in val_rows] == [0, 30]
    assert val_rows[-1]["val/pair_acc"] >= 0.9, val_rows  # chance is 0.5; the fresh head starts near it
    assert val_rows[-1]["val/loss"] < 0.5 * val_rows[0]["val/loss"], val_rows
    assert summary["val_acc_after"] == val_rows[-1]["val/pair_acc"]


def test_the_export_scores_in_the_rl_reward_path_as_the_trainer_does_lora(tmp_path):
    """A LoRA run's hf/ export (merged, tokenizer and pad id included) through --reward.model-path: the same scores."""
    train, val = easy_pairs(tmp_path)
    cfg = config(tmp_path, train, None, steps=2)
    cfg.model.lora_rank = 4
    rm.main(cfg)
    export = tmp_path / "rm" / "checkpoints" / "global_step_2" / "hf"
    assert json.loads((export / "config.json").read_text())["pad_token_id"] is not None

    trainer = rm.RewardTrainer(cfg)  # the trained adapter and head back from the run's checkpoint
    trainer.load_checkpoint(tmp_path / "rm" / "checkpoints" / "global_step_2" / "policy")
    pairs = rm.read_pairs([val], cfg)[:8]
    data = rm.Pairs(pairs, trainer.tokenizer, cfg.data)
    mine = trainer.score(data.batch(range(8), trainer.tokenizer.pad_token_id))  # (16,): chosen, then rejected
    reward = RewardFn.from_config(RewardConfig(model_path=str(export)), "cpu")
    prompts = [p for p, *_ in pairs] * 2
    responses = [c for _, c, _, _ in pairs] + [r for _, _, r, _ in pairs]
    theirs, metrics = reward(["rlkit/arith"] * 16, responses, ["0"] * 16, prompts=prompts)
    # float32 on other batch widths and a merged LoRA (W + BA summed once): equal to a few hundred ulps of O(1) scores
    torch.testing.assert_close(theirs, mine, atol=1e-4, rtol=0)
    assert mine.std() > 0 and "reward/model_score" in metrics


def test_resume_equals_an_uninterrupted_run(tmp_path):
    train, _ = easy_pairs(tmp_path)

    def run(name, steps):
        cfg = config(tmp_path, train, None, steps, name=name)
        cfg.data.train_batch_size = 8
        cfg.system.trainer.save_freq, cfg.system.trainer.resume = 2, "auto"
        rm.main(cfg)

    run("whole", 4)
    run("split", 2)
    run("split", 4)  # resumes at step 2: weights, optimizer, scheduler, data position
    last = {n: [r for r in rows_of(tmp_path, n) if r["step"] == 4][-1] for n in ("whole", "split")}
    for key in ("rm/loss", "rm/margin", "actor/grad_norm"):
        assert abs(last["whole"][key] - last["split"][key]) < 1e-5, (key, last)  # same ops, same order: rounding only
    a, b = (torch.load(tmp_path / n / "checkpoints" / "global_step_4" / "policy" / "state.pt")["model"] for n in ("whole", "split"))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_bad_data_and_flags_fail_with_one_line(tmp_path):
    train, val = easy_pairs(tmp_path)
    with pytest.raises(ConfigError, match="no column 'better'.*--chosen-key"):
        rm.main(config(tmp_path, train, val, 1, chosen_key="better"))
    with pytest.raises(ConfigError, match="no column 'm'.*--margin-key"):
        rm.main(config(tmp_path, train, val, 1, margin_key="m"))
    with pytest.raises(MissingFile, match=r"--data\.train-files: no such file .*nope\.parquet"):
        rm.main(config(tmp_path, str(tmp_path / "nope.parquet"), val, 1))
    with pytest.raises(ConfigError, match=r"--data\.val-files .*empty\.parquet: no rows"):  # the flag of the files read
        rm.main(config(tmp_path, train, write_pairs(tmp_path / "empty.parquet", []), 1))
    msgs = [{"role": "user", "content": "hi"}]
    bad = write_pairs(tmp_path / "bad.parquet", [{"prompt": msgs, "chosen": msgs, "rejected": msgs}])
    with pytest.raises(ConfigError, match="must end with an assistant turn"):
        rm.main(config(tmp_path, bad, None, 1))
    no_prompt = write_pairs(tmp_path / "np.parquet", [{"chosen": "1", "rejected": "2"}])
    with pytest.raises(ConfigError, match="no prompt column; set --data.prompt-key"):
        rm.main(config(tmp_path, no_prompt, None, 1))
    cfg = config(tmp_path, train, val, 1)
    cfg.data.max_prompt_length = 4
    with pytest.raises(ConfigError, match=r"pair 0 renders to \d+ tokens.*raise them"):
        rm.main(cfg)
    for err in (ConfigError, MissingFile):  # one line each: recipe.cli prints the message alone
        assert err.__mro__[1].__name__ == "UserError"


def test_messages_pairs_and_implicit_prompts_render_as_the_scorer_renders():
    """chosen/rejected as messages (explicit prompt, or whole conversations): the same text as prompt + answer."""
    cfg = rm.Config()
    tok = __import__("rlkit.engine", fromlist=["load_tokenizer"]).load_tokenizer(str(demos.ARITH_MODEL))
    user = [{"role": "user", "content": "What is 1+2?"}]
    ans = [{"role": "assistant", "content": "3"}]
    for p, c in ((user, "3"), (user, ans), (None, user + ans)):
        prompt, text = rm.split_turn(p, c, 0, "f")
        assert (prompt, text) == (user, "3")
    assert (
        rm.Pairs([(user, "3", "4", 0.0)], tok, cfg.data).ids[0][0]
        == tok("<|im_start|>user\nWhat is 1+2?<|im_end|>\n<|im_start|>assistant\n3<|im_end|>\n", add_special_tokens=False)["input_ids"]
    )


def test_train_layers_trains_the_top_layers_and_the_head_only(tmp_path):
    """--train-layers 1 on the 2-layer embedded model: after 2 steps the top layer and the head moved, the embeddings and
    the bottom layer are bit-identical to the start; a bad count or LoRA with it is a one-line error."""
    from safetensors.torch import load_file

    train, _ = easy_pairs(tmp_path)
    rm.main(config(tmp_path, train, None, steps=2, train_layers=1))
    start = load_file(demos.ARITH_MODEL / "model.safetensors")
    after = load_file(tmp_path / "rm" / "checkpoints" / "global_step_2" / "hf" / "model.safetensors")
    for key in ("embed_tokens.weight", "layers.0.self_attn.q_proj.weight", "layers.0.mlp.down_proj.weight"):
        assert torch.equal(after[f"model.{key}"], start[f"model.{key}"]), key
    assert not torch.equal(after["model.layers.1.mlp.down_proj.weight"], start["model.layers.1.mlp.down_proj.weight"])
    assert "score.weight" in after
    with pytest.raises(ConfigError, match="--train-layers 3: give 1..2 decoder layers"):
        rm.main(config(tmp_path, train, None, 1, train_layers=3))
    cfg = config(tmp_path, train, None, 1, train_layers=1)
    cfg.model.lora_rank = 4
    with pytest.raises(ConfigError, match="without --model.lora-rank"):
        rm.main(cfg)


def _demo():
    """scripts/rm_demo.py as a module."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("rm_demo", ROOT / "scripts" / "rm_demo.py")
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    return demo


def test_the_demo_run_names_the_missing_mix_before_it_trains_anything(tmp_path, monkeypatch):
    """`rm_demo.py run` trains its RM in two stages; without stage 2's pairs it stops at once with the command that
    writes them, not after stage 1's minutes of training."""
    demo = _demo()
    monkeypatch.setattr(sys, "argv", ["rm_demo.py", "run", "--run-dir", str(tmp_path)])
    monkeypatch.setattr(demo, "train_rm", lambda *a, **k: pytest.fail("trained before checking its inputs"))
    with pytest.raises(SystemExit, match=r"no pairs in .*pairs-mix: write them first with `pairs --mirror --near-miss 6"):
        demo.main()


def test_the_demo_pairs_hold_the_policys_mistakes_and_their_mirror_images(monkeypatch):
    """scripts/rm_demo.py: each distinct wrong sample (at most 2) is a rejected answer; with mirror, each numeric
    mistake c + d also appears as c - d, so the direction of an error tells the RM nothing."""
    demo = _demo()
    assert [demo.mirrored("67", w) for w in ("70", "60", "67", "200", "7\x1c", "abc")] == ["64", "74", "67", None, None, None]
    answers = [["70", "67", "70", "64\x1c", "9"], ["5"]]
    monkeypatch.setattr(demo.tiny_arith, "sample_answers", lambda prompts, n, seed, model_dir: answers[: len(prompts)])
    rows = [tiny_arith.arith_row(30, 37, "train", 0), tiny_arith.arith_row(2, 3, "train", 1)]
    plain = demo.make_pairs(rows, 5, 0, 0)
    assert [(r["chosen"], r["rejected"]) for r in plain] == [("67", "70"), ("67", "64\x1c")]  # the first 2 distinct
    mirrored = demo.make_pairs(rows, 5, 0, 0, mirror=True)
    assert [r["rejected"] for r in mirrored] == ["70", "64\x1c", "64"]  # 64 mirrors 70; "64\x1c" is not a number
    # the mix of the demo's stage 2 (pairs --mirror --near-miss 6): the mistakes, their mirror images, and every near
    # miss +-1, +-10, +-20 that is not negative (the mirror image of a near miss is a near miss: no duplicates)
    mix = demo.make_pairs(rows, 5, 6, 0, mirror=True)
    by_problem = {c: sorted(r["rejected"] for r in mix if r["chosen"] == c) for c in ("67", "5")}
    assert by_problem == {"67": sorted(["70", "64\x1c", "64", "66", "68", "57", "77", "47", "87"]), "5": ["15", "25", "4", "6"]}


def test_flags_go_through_the_shared_setup_before_the_model_loads(tmp_path, monkeypatch):
    """Issue #34 FAIL 6: rm.py called no shared setup -- --actor.ppo-micro-batch-size -1 trained nothing with rc 0,
    --actor.lr -1 and a batch size of 0 were tracebacks. Now recipe.setup's checks, before the model loads."""
    train, val = easy_pairs(tmp_path)
    monkeypatch.setattr(rm, "RewardTrainer", lambda cfg: pytest.fail("the model loaded before the flags were checked"))
    for section, name, value, match in [
        ("actor", "ppo_micro_batch_size", -1, "--actor.ppo-micro-batch-size -1: must be 0"),
        ("actor", "lr", -1.0, "--actor.lr -1.0: a learning rate must be > 0"),
        ("data", "train_batch_size", 0, "--data.train-batch-size 0: must be at least 1"),
        (None, "center_coef", float("nan"), "--center-coef nan: must be a finite number"),  # config.check_values, first
        (None, "center_coef", -1.0, "--center-coef -1.0: must be a number >= 0"),
    ]:
        cfg = config(tmp_path, train, val, 1)
        set_flags(cfg, {f"{section}.{name}" if section else name: value})
        with pytest.raises(ConfigError, match=match):
            rm.main(cfg)


def test_non_finite_margins_and_identical_pairs_are_named_in_the_data(tmp_path):
    """Issue #34 WEAKs: a NaN/inf margin stopped with "lower --actor.lr" after the model loaded (the data was wrong, not
    the lr); pairs with chosen = rejected trained nothing silently (r_c - r_r = 0 whatever the weights)."""
    cfg = config(tmp_path, "x", None, 1, margin_key="m")
    user = [{"role": "user", "content": "What is 1+1?"}]
    for m in (float("nan"), float("inf")):
        bad = write_pairs(
            tmp_path / "m.parquet",
            [{"prompt": user, "chosen": "2", "rejected": "3", "m": 1.0}] * 3 + [{"prompt": user, "chosen": "2", "rejected": "3", "m": m}],
        )
        with pytest.raises(ConfigError, match=r"row 3: .*margin (nan|inf) that is not a finite number.*--margin-key"):
            rm.read_pairs([bad], cfg)
    cfg.margin_key = ""
    same = write_pairs(tmp_path / "s.parquet", [{"prompt": user, "chosen": "2", "rejected": "2"}] * 4)
    with pytest.raises(ConfigError, match="chosen = rejected in every pair; nothing to learn"):
        rm.read_pairs([same], cfg)
    some = write_pairs(tmp_path / "p.parquet", [{"prompt": user, "chosen": "2", "rejected": r} for r in ("2", "3", "2", "4")])
    with pytest.warns(UserWarning, match="2 of 4 pairs have chosen = rejected"):
        assert len(rm.read_pairs([some], cfg)) == 4


def test_a_tie_counts_as_ranked_wrong():
    """rm/acc (and val/pair_acc): a pair with r_c = r_r is not ranked right (docs/rm.md)."""
    _, m = rm.bt_loss(torch.tensor([1.0, 2.0, 1.0, 1.0]), torch.zeros(4), num_pairs=2)  # pair 1 tied, pair 2 right
    assert m["rm/acc"] == 0.5


def trainer(tmp_path, **model):
    train, _ = easy_pairs(tmp_path)
    cfg = config(tmp_path, train, None, 1)
    set_flags(cfg, {f"model.{k}": v for k, v in model.items()})
    t = rm.RewardTrainer(cfg)
    pairs = rm.Pairs(rm.read_pairs([train], cfg)[:8], t.tokenizer, cfg.data)
    return t, pairs.batch(range(8), t.tokenizer.pad_token_id)


def test_micro_batches_do_not_change_the_step(tmp_path):
    """Each micro-batch's loss is divided by the step's pair count, not its own: 8 pairs in micro-batches of 2 give the
    loss, accuracy and gradient norm of one micro-batch of 8 (to float32 rounding; divided by its own count, 4x)."""
    out = []
    for micro in (8, 2):
        t, batch = trainer(tmp_path)
        t.micro_batch = micro
        out.append(t.update(batch, rm.bt_loss))
    for key in ("rm/loss", "rm/acc", "actor/grad_norm"):
        assert out[0][key] == pytest.approx(out[1][key], rel=1e-5), key


def test_each_forward_is_one_micro_batch_at_its_own_width_with_checkpointing_and_bf16_when_asked(tmp_path, monkeypatch):
    """Issue #36 N9: rm.py ran fp32 only, kept the model in eval() so --model.gradient-checkpointing did nothing, and ran
    every micro-batch at the batch's longest width. Recorded here: each forward's shape (2 x micro-batch rows, cut to
    that micro-batch's longest sequence), the checkpoint calls of the update, and the compute dtype over fp32 weights."""
    from transformers import modeling_utils

    calls, real = [], modeling_utils.checkpoint
    monkeypatch.setattr(modeling_utils, "checkpoint", lambda f, *a, **k: calls.append(1) or real(f, *a, **k))
    t, batch = trainer(tmp_path, dtype="bfloat16", gradient_checkpointing="on")
    shapes, dtypes = [], []
    t.model.register_forward_hook(lambda mod, args, kw, out: shapes.append(tuple(kw["input_ids"].shape)), with_kwargs=True)
    t.model.score.register_forward_hook(lambda mod, args, out: dtypes.append(out.dtype))
    t.micro_batch = 2
    t.update(batch, rm.bt_loss)
    lengths = batch["attention_mask"].sum(-1)  # (16,): chosen rows, then rejected
    want = [(4, int(lengths[[s, s + 1, 8 + s, 9 + s]].max())) for s in range(0, 8, 2)]
    assert shapes == want and min(w for _, w in want) < batch["input_ids"].shape[1], (shapes, want)
    assert len(calls) == 4 * 2, calls  # 2 decoder layers, 4 micro-batches
    assert set(dtypes) == {torch.bfloat16} and all(p.dtype == torch.float32 for p in t.model.parameters())
    assert not any(m.training for m in t.model.modules())  # dropout off, the checkpointed layers back to eval after
    shapes.clear()
    t.score(batch)  # validation: the same micro-batches of rows, not one forward of the whole batch
    assert [rows for rows, _ in shapes] == [4, 4, 4, 4]
