import json
import shutil

import datasets
import pytest
import torch
import transformers

from rlkit import demos
from rlkit.config import DataConfig, DataSystem
from rlkit.data import PromptLoader, PromptSet, _objects, build_prompts, load_parquet, read_table, render_prompts
from rlkit.errors import ConfigError, MissingFile

CHATML = "<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n"


def row(content, gt, i=0):
    return {
        "data_source": "test/src",
        "prompt": [{"role": "user", "content": content}],
        "ability": "arithmetic",
        "reward_model": {"style": "rule", "ground_truth": gt},
        "extra_info": {"split": "train", "index": i},
    }


def write(path, rows):
    datasets.Dataset.from_list(rows).to_parquet(str(path))
    return str(path)


@pytest.fixture(scope="module")
def tok():
    t = transformers.AutoTokenizer.from_pretrained(demos.ARITH_MODEL)
    t.padding_side = "left"
    return t


# -- load_parquet ------------------------------------------------------------------------------
def test_load_parquet_reads_verl_format(tmp_path):
    f = write(tmp_path / "d.parquet", [row("What is 2+3?", "5", 0), row("What is 1+1?", "2", 1)])
    ds = load_parquet([f])
    assert len(ds) == 2
    assert ds[0]["prompt"] == [{"role": "user", "content": "What is 2+3?"}]
    assert ds[1]["reward_model"] == {"style": "rule", "ground_truth": "2"}
    assert ds[1]["extra_info"] == {"split": "train", "index": 1}


def test_load_parquet_missing_reward_model_names_column_and_found_columns(tmp_path):
    rows = [{k: v for k, v in row("What is 2+3?", "5").items() if k != "reward_model"}]
    f = write(tmp_path / "d.parquet", rows)
    with pytest.raises(ValueError) as e:
        load_parquet([f])
    msg = str(e.value)
    assert "missing column 'reward_model'" in msg
    for col in ("data_source", "prompt", "ability", "extra_info"):
        assert col in msg


def test_load_parquet_missing_prompt_column_suggests_prompt_key(tmp_path):
    f = write(tmp_path / "d.parquet", [row("What is 2+3?", "5")])
    with pytest.raises(ValueError, match=r"missing column 'question'.*--data\.prompt-key"):
        load_parquet([f], prompt_key="question")


@pytest.mark.parametrize("rows_empty_with_columns", [True, False])
def test_load_parquet_empty(tmp_path, rows_empty_with_columns):
    ds = datasets.Dataset.from_list([row("What is 2+3?", "5")]).select([]) if rows_empty_with_columns else datasets.Dataset.from_list([])
    f = tmp_path / "empty.parquet"
    ds.to_parquet(str(f))
    with pytest.raises(ConfigError, match=r"^--data\.val-files .*empty\.parquet: no rows"):
        load_parquet([str(f)], flag="--data.val-files")


def test_load_parquet_missing_file_names_path(tmp_path):
    f = str(tmp_path / "nope.parquet")
    with pytest.raises(FileNotFoundError, match="nope.parquet"):
        load_parquet([f])


def test_read_table_names_the_flag_in_each_of_its_errors(tmp_path):
    """One message shape for every reader of the user's parquet (data.load_parquet, sft.py, rm.py): the flag first."""
    good = write(tmp_path / "good.parquet", [row("What is 2+3?", "5"), row("What is 1+1?", "2", 1)])
    assert read_table([good, good], "--x").num_rows == 4  # the files in order, one table
    with pytest.raises(MissingFile, match=r"^--x: no such file .*nope\.parquet$"):
        read_table([good, str(tmp_path / "nope.parquet")], "--x")
    (tmp_path / "t.csv").write_text("a,b\n1,2\n")
    with pytest.raises(ConfigError, match=r"^--x .*t\.csv: not a parquet file \(.*magic bytes"):
        read_table([good, str(tmp_path / "t.csv")], "--x")
    other = write(tmp_path / "other.parquet", [{"question": "q"}])
    with pytest.raises(ConfigError, match=r"^--x .*good\.parquet, .*other\.parquet: the files' columns differ"):
        read_table([good, other], "--x")
    empty = str(tmp_path / "empty.parquet")
    datasets.Dataset.from_list([row("What is 2+3?", "5")]).select([]).to_parquet(empty)
    with pytest.raises(ConfigError, match=r"^--x .*empty\.parquet: no rows"):
        read_table([empty], "--x")


# -- build_prompts -----------------------------------------------------------------------------
def test_build_prompts_renders_chatml_and_tokenizes(tmp_path, tok):
    f = write(tmp_path / "d.parquet", [row("What is 2+3?", "5", 7)])
    assert render_prompts(tok, [row("What is 2+3?", "5")["prompt"]]) == [CHATML]
    ps = build_prompts([f], tok, DataConfig(), DataSystem())
    assert len(ps) == 1
    assert ps.input_ids[0] == tok(CHATML, add_special_tokens=False)["input_ids"]
    assert ps.ground_truth.tolist() == ["5"]
    assert ps.data_source.tolist() == ["test/src"]
    assert ps.extra_info[0] == {"split": "train", "index": 7}
    assert ps.raw_prompt[0] == [{"role": "user", "content": "What is 2+3?"}]


def test_embedded_prompt_ids_decode_to_the_chatml_text(tok):
    assert tok.decode(tok(CHATML, add_special_tokens=False)["input_ids"]) == CHATML


def test_build_prompts_max_samples(tmp_path, tok):
    f = write(tmp_path / "d.parquet", [row(f"What is {i}+1?", str(i + 1), i) for i in range(5)])
    ps = build_prompts([f], tok, DataConfig(), DataSystem(), max_samples=3)
    assert ps.ground_truth.tolist() == ["1", "2", "3"]


LONG = "What is " + "+".join(str(i % 10) for i in range(40)) + "?"


@pytest.fixture
def long_file(tmp_path):
    return write(tmp_path / "d.parquet", [row("What is 2+3?", "5", 0), row(LONG, "long", 1), row("What is 1+1?", "2", 2)])


def full_ids(files, tok):
    return build_prompts(files, tok, DataConfig(max_prompt_length=10_000), DataSystem()).input_ids


@pytest.mark.parametrize("mode", ["left", "right", "middle"])
def test_truncation_modes(long_file, tok, mode):
    full = full_ids([long_file], tok)
    k = 21
    assert len(full[0]) <= k < len(full[1])
    ps = build_prompts([long_file], tok, DataConfig(max_prompt_length=k), DataSystem(truncation=mode))
    expected = {"left": full[1][-k:], "right": full[1][:k], "middle": full[1][: k // 2] + full[1][-(k - k // 2) :]}[mode]
    assert len(expected) == k
    assert ps.input_ids[1] == expected
    assert ps.input_ids[0] == full[0] and ps.input_ids[2] == full[2]  # short prompts untouched
    assert ps.ground_truth.tolist() == ["5", "long", "2"]


def test_truncation_error_names_row_count_and_fixes(long_file, tok):
    n = len(full_ids([long_file], tok)[1])
    with pytest.raises(ValueError) as e:
        build_prompts([long_file], tok, DataConfig(max_prompt_length=21), DataSystem(truncation="error"))
    msg = str(e.value)
    assert "row 1" in msg and f"{n} tokens" in msg
    for fix in ("--data.max-prompt-length", "--data.filter-overlong-prompts", "--data.truncation"):
        assert fix in msg


def test_filter_overlong_drops_exactly_the_long_rows(long_file, tok):
    full = full_ids([long_file], tok)
    ps = build_prompts([long_file], tok, DataConfig(max_prompt_length=21), DataSystem(filter_overlong_prompts=True))
    assert ps.ground_truth.tolist() == ["5", "2"]
    assert ps.input_ids == [full[0], full[2]]
    assert [e["index"] for e in ps.extra_info] == [0, 2]


@pytest.fixture
def no_template_dir(tmp_path):
    d = tmp_path / "model"
    shutil.copytree(demos.ARITH_MODEL, d)
    (d / "chat_template.jinja").unlink(missing_ok=True)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    return d


def test_no_chat_template(tmp_path, no_template_dir):
    t = transformers.AutoTokenizer.from_pretrained(no_template_dir)
    assert not t.chat_template
    f = write(tmp_path / "chat.parquet", [row("What is 2+3?", "5")])
    with pytest.raises(ValueError, match="chat template"):
        build_prompts([f], t, DataConfig(), DataSystem())
    # plain-string prompts need no template and pass through unchanged
    plain = [{**row("x", "5"), "prompt": "What is 2+3? "}]
    g = write(tmp_path / "plain.parquet", plain)
    ps = build_prompts([g], t, DataConfig(), DataSystem())
    assert ps.input_ids[0] == t("What is 2+3? ", add_special_tokens=False)["input_ids"]
    assert t.decode(ps.input_ids[0]) == "What is 2+3? "


# -- PromptSet / PromptLoader ------------------------------------------------------------------
def make_set(lengths):
    n = len(lengths)
    return PromptSet(
        input_ids=[list(range(10 * i + 1, 10 * i + 1 + L)) for i, L in enumerate(lengths)],
        data_source=_objects(["s"] * n),
        ground_truth=_objects([str(i) for i in range(n)]),
        extra_info=_objects([{"i": i} for i in range(n)]),
        raw_prompt=_objects([f"p{i}" for i in range(n)]),
    )


def test_promptset_batch_left_pads():
    ps = make_set([2, 4])
    b = ps.batch([0, 1], pad_id=0)
    assert torch.equal(b["input_ids"], torch.tensor([[0, 0, 1, 2], [11, 12, 13, 14]]))
    assert torch.equal(b["attention_mask"], torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]]))
    assert torch.equal(b["position_ids"], torch.tensor([[0, 0, 0, 1], [0, 1, 2, 3]]))
    assert b["input_ids"].dtype == torch.long
    assert b["ground_truth"].tolist() == ["0", "1"]
    assert b["index"].tolist() == [0, 1]
    b = ps.batch([1, 0], pad_id=99)  # row order follows `rows`
    assert b["input_ids"].tolist() == [[11, 12, 13, 14], [99, 99, 1, 2]]
    assert b["extra_info"].tolist() == [{"i": 1}, {"i": 0}]


def indices(loader, n):
    return [loader.next_batch()["index"].tolist() for _ in range(n)]


def test_loader_len_epoch_coverage_and_rollover():
    ps = make_set([3] * 10)
    loader = PromptLoader(ps, batch_size=3, pad_id=0, seed=0)
    assert len(loader) == 3
    first = [loader.next_batch() for _ in range(3)]
    rows = sum((b["index"].tolist() for b in first), [])
    assert len(rows) == 9 and len(set(rows)) == 9
    assert all(b.meta["epoch"] == 0 and len(b) == 3 for b in first)
    assert loader.next_batch().meta["epoch"] == 1
    assert PromptLoader(ps, 3, 0, shuffle=False).next_batch()["index"].tolist() == [0, 1, 2]


def test_loader_order_is_seeded():
    ps = make_set([3] * 20)
    a = indices(PromptLoader(ps, 4, 0, seed=1), 5)
    assert a == indices(PromptLoader(ps, 4, 0, seed=1), 5)
    assert a != indices(PromptLoader(ps, 4, 0, seed=2), 5)
    # epochs are reshuffled
    loader = PromptLoader(ps, 4, 0, seed=1)
    assert indices(loader, 5) != indices(loader, 5)


@pytest.mark.parametrize("consumed", [1, 2, 3, 4, 7])  # mid-epoch, exactly at the epoch boundary (3, 6), past it
def test_loader_resume_matches_uninterrupted(consumed):
    ps = make_set([3] * 10)
    reference = PromptLoader(ps, 3, 0, seed=5)
    expected = indices(reference, consumed + 4)
    first = PromptLoader(ps, 3, 0, seed=5)
    indices(first, consumed)
    state = json.loads(json.dumps(first.state_dict()))  # survives serialisation
    resumed = PromptLoader(ps, 3, 0, seed=5)
    resumed.load_state_dict(state)
    assert indices(resumed, 4) == expected[consumed:]
    resumed.load_state_dict(state)
    assert resumed.next_batch().meta["epoch"] == (consumed // 3)


def test_loader_batch_larger_than_dataset():
    with pytest.raises(ValueError, match=r"--data\.train-batch-size 11"):
        PromptLoader(make_set([3] * 10), batch_size=11, pad_id=0)
