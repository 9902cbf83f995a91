"""scripts/make_tool_traces.py: an SFT trace is, token for token, what the turn loop produces for the same turns,
and sft.py's assistant mask trains exactly the model's own turns (the tool call and the answer), not the tool result."""

import importlib.util
import json

import pyarrow.parquet as pq
import pytest
from test_grpo_recipe import ROOT
from test_sft import sft

from rlkit import agent, demos, tools
from rlkit.engine import load_tokenizer
from scripts.assets import tiny_calc

spec = importlib.util.spec_from_file_location("make_tool_traces", ROOT / "scripts" / "make_tool_traces.py")
make_tool_traces = importlib.util.module_from_spec(spec)
spec.loader.exec_module(make_tool_traces)
MODEL = ROOT / "rlkit" / "assets" / "tiny-arith"  # ChatML that ignores tools=, as SmolLM2's: the system-message path


def test_a_trace_is_what_the_turn_loop_renders_and_the_mask_covers_the_models_turns(tmp_path):
    paths = make_tool_traces.main(["--model", str(MODEL), "--out", str(tmp_path), "--traces", "3", "--train-size", "5", "--val-size", "4"])
    tok = load_tokenizer(str(MODEL))
    conv = pq.read_table(paths["sft"]).column("messages").to_pylist()[0]
    a, b = map(int, conv[1]["content"].removeprefix("What is ").removesuffix("?").split("*"))
    ids, mask = sft.assistant_mask(tok, conv)

    # the turn loop: the prompt as rendered for RL, the model's call + end of turn, the tool suffix, the answer + end
    enc = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    schemas = tools.Tools([tools.calculator]).schemas
    prompt = enc(tools.render_prompt(tok, tiny_calc.mult_row(a, b, "", 0)["prompt"], schemas))
    call, answer = enc(tiny_calc.call_text(a, b)) + [tok.eos_token_id], enc(f"={a * b}") + [tok.eos_token_id]
    suffix = agent.tool_suffix_ids(tok, [{"role": "tool", "name": "calculator", "content": str(a * b)}], tok.eos_token)
    loop = prompt + call + suffix + answer
    assert ids[: len(loop)] == loop and all(m == 0 for m in mask[len(loop) :])  # after it: the template's trailing text
    assert mask[: len(loop)] == [0] * len(prompt) + [1] * len(call) + [0] * len(suffix) + [1] * len(answer)

    # the RL rows: disjoint from the SFT problems, scored by the tool demo's scorer
    sft_q = {m[1]["content"] for m in pq.read_table(paths["sft"]).column("messages").to_pylist()}
    rl = pq.read_table(paths["train"]).to_pylist() + pq.read_table(paths["val"]).to_pylist()
    assert len(rl) == 9 and not sft_q & {r["prompt"][0]["content"] for r in rl}
    assert all(r["data_source"] == demos.MULT_SOURCE for r in rl)


def test_sft_trains_on_a_messages_only_parquet(tmp_path):
    """recipes/sft.py --messages-key on the traces: the preflight's prompt-row checks (a `prompt` column) do not apply
    to a file of whole conversations (they refused it before the model loaded)."""
    paths = make_tool_traces.main(["--model", str(MODEL), "--out", str(tmp_path), "--traces", "8", "--train-size", "1", "--val-size", "1"])
    cfg = sft.Config()
    cfg.model.path, cfg.messages_key = str(MODEL), "messages"
    cfg.data.train_files, cfg.system.data.val_files = [str(paths["sft"])], []
    cfg.data.max_prompt_length, cfg.data.max_response_length = 1024, 128  # a character-level tokenizer: long
    cfg.data.train_batch_size = cfg.actor.ppo_mini_batch_size = 8
    cfg.trainer.total_training_steps, cfg.system.trainer.test_freq, cfg.system.trainer.default_local_dir = 1, 0, str(tmp_path / "out")
    sft.main(cfg)
    row = [r for r in map(json.loads, (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()) if "actor/nll" in r][-1]
    assert row["step"] == 1 and row["actor/nll"] > 0


@pytest.mark.parametrize("flag", ["--traces", "--train-size", "--val-size"])
def test_an_empty_split_is_one_line_before_anything_is_written(tmp_path, flag, capsys):
    """--traces 0 wrote an empty sft.parquet that recipes/sft.py refused later; now the script refuses it first."""
    with pytest.raises(SystemExit):
        make_tool_traces.main(["--model", str(MODEL), "--out", str(tmp_path / "out"), flag, "0"])
    assert f"{flag} 0: must be at least 1" in capsys.readouterr().err and not (tmp_path / "out").exists()
