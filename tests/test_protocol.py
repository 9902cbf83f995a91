import numpy as np
import pytest
import torch

from rlkit.protocol import DataProto


def make(n=4):
    return DataProto.from_dict(
        tensors={"ids": torch.arange(n * 2).view(n, 2), "score": torch.arange(n, dtype=torch.float32)},
        non_tensors={"uid": [f"u{i}" for i in range(n)]},
        meta={"temperature": 1.0},
    )


def test_construction_converts_lists_and_validates_lengths():
    d = make(3)
    assert len(d) == 3
    assert isinstance(d["uid"], np.ndarray) and d["uid"].dtype == object
    assert d["uid"].tolist() == ["u0", "u1", "u2"]
    with pytest.raises(ValueError, match=r"'uid' has length 2, expected 3"):
        DataProto.from_dict(tensors={"x": torch.zeros(3, 2)}, non_tensors={"uid": ["a", "b"]})
    with pytest.raises(ValueError, match=r"'y' has length 4, expected 3"):
        DataProto.from_dict(tensors={"x": torch.zeros(3), "y": torch.zeros(4)})


def test_from_dict_does_not_mutate_callers_dict():
    nt = {"uid": ["a", "b"]}
    DataProto.from_dict(non_tensors=nt)
    assert nt["uid"] == ["a", "b"]


def test_lists_of_dicts_and_lists_stay_1d():
    d = DataProto.from_dict(non_tensors={"extra": [{"a": 1}, {"a": 2}], "pair": [[1, 2], [3, 4]]})
    assert d["extra"].shape == (2,) and d["pair"].shape == (2,)
    assert d["extra"][1] == {"a": 2} and d["pair"][0] == [1, 2]
    assert d[1]["extra"].tolist() == [{"a": 2}]


def test_empty_batch():
    d = DataProto()
    assert len(d) == 0 and d.keys() == [] and list(d) == []
    assert len(DataProto.from_dict(meta={"a": 1})) == 0


def test_getitem_str_and_keyerror_lists_keys():
    d = make(2)
    assert torch.equal(d["score"], torch.tensor([0.0, 1.0]))
    with pytest.raises(KeyError, match=r"available keys: \['ids', 'score', 'uid'\]"):
        d["nope"]


def test_int_indexing_returns_one_row_dataproto():
    d = make(4)
    row = d[2]
    assert isinstance(row, DataProto) and len(row) == 1
    assert row["ids"].tolist() == [[4, 5]] and row["uid"].tolist() == ["u2"]
    assert d[-1]["uid"].tolist() == ["u3"]
    assert row.meta == {"temperature": 1.0}
    with pytest.raises(IndexError):
        d[4]


def test_index_with_list_tensor_mask_array_slice():
    d = make(4)
    assert d[[3, 0]]["uid"].tolist() == ["u3", "u0"]
    assert d.index(torch.tensor([1, 1]))["score"].tolist() == [1.0, 1.0]
    mask = torch.tensor([True, False, True, False])
    sel = d[mask]
    assert sel["ids"].tolist() == [[0, 1], [4, 5]] and sel["uid"].tolist() == ["u0", "u2"]
    assert d[np.array([False, True, False, True])]["uid"].tolist() == ["u1", "u3"]
    assert d[np.array([2])]["score"].tolist() == [2.0]
    assert d[1:3]["uid"].tolist() == ["u1", "u2"]
    assert len(d[[]]) == 0


def test_slice_shares_storage():
    d = make(4)
    d[1:3]["score"][0] = 100.0
    assert d["score"][1].item() == 100.0


def test_setitem_contains_keys():
    d = make(2)
    d["reward"] = torch.tensor([0.5, 1.5])
    d["data_source"] = ["gsm8k", "math"]
    assert "reward" in d and "data_source" in d and "missing" not in d
    assert d.keys() == ["ids", "score", "reward", "uid", "data_source"]
    assert d["data_source"].dtype == object
    with pytest.raises(ValueError, match=r"'bad' has length 3, expected 2"):
        d["bad"] = torch.zeros(3)
    d["uid"] = torch.tensor([7, 8])  # moving a key between kinds leaves no duplicate
    assert "uid" in d.tensors and "uid" not in d.non_tensors


def test_repeat_interleave_and_tile():
    d = DataProto.from_dict(tensors={"x": torch.tensor([10, 20])}, non_tensors={"uid": ["a", "b"]})
    r = d.repeat(2, interleave=True)
    assert r["x"].tolist() == [10, 10, 20, 20] and r["uid"].tolist() == ["a", "a", "b", "b"]
    r = d.repeat(2, interleave=False)
    assert r["x"].tolist() == [10, 20, 10, 20] and r["uid"].tolist() == ["a", "b", "a", "b"]
    assert d.repeat(3)["uid"].tolist() == ["a", "a", "a", "b", "b", "b"]


def test_chunk_split_concat_round_trip():
    d = make(6)
    chunks = d.chunk(3)
    assert [len(c) for c in chunks] == [2, 2, 2]
    assert chunks[1]["uid"].tolist() == ["u2", "u3"]
    back = DataProto.concat(chunks)
    assert torch.equal(back["ids"], d["ids"]) and back["uid"].tolist() == d["uid"].tolist()
    assert back.meta == {"temperature": 1.0}
    parts = d.split(4)
    assert [len(p) for p in parts] == [4, 2]
    assert parts[1]["score"].tolist() == [4.0, 5.0]
    assert DataProto.concat(parts)["uid"].tolist() == [f"u{i}" for i in range(6)]


def test_chunk_error_suggests_padding():
    with pytest.raises(ValueError, match=r"size 5 into 2 .*pad_to_divisor\(2\)"):
        make(5).chunk(2)


def test_concat_key_mismatch_names_key():
    a, b = make(2), make(2)
    b.pop(tensor_keys=["score"])
    with pytest.raises(ValueError, match=r"'score' is missing from item 1"):
        DataProto.concat([a, b])
    with pytest.raises(ValueError, match=r"'score' is missing from item 0"):
        DataProto.concat([b, a])


def test_pad_to_divisor_then_unpad():
    d = make(5)
    padded, pad = d.pad_to_divisor(4)
    assert len(padded) == 8 and pad == 3
    assert torch.equal(padded["ids"][5:8], d["ids"][0:3])
    assert padded["uid"].tolist()[5:] == ["u0", "u1", "u2"]
    un = padded.unpad(pad)
    assert torch.equal(un["ids"], d["ids"]) and un["uid"].tolist() == d["uid"].tolist()
    same, pad = d.pad_to_divisor(5)
    assert pad == 0 and len(same) == 5 and len(same.unpad(0)) == 5
    tiny, pad = make(1).pad_to_divisor(3)  # cycling repeats the only row
    assert pad == 2 and tiny["uid"].tolist() == ["u0", "u0", "u0"]


def test_union_success_and_conflicts():
    d = make(2)
    other = DataProto.from_dict(
        tensors={"score": d["score"].clone(), "adv": torch.tensor([1.0, -1.0])}, non_tensors={"uid": ["u0", "u1"]}, meta={"step": 3}
    )
    u = d.union(other)
    assert u.keys() == ["ids", "score", "adv", "uid"]
    assert u.meta == {"temperature": 1.0, "step": 3}
    assert "adv" not in d  # original untouched
    with pytest.raises(ValueError, match="'score'"):
        d.union(DataProto.from_dict(tensors={"score": torch.tensor([9.0, 9.0])}))
    with pytest.raises(ValueError, match="'uid'"):
        d.union(DataProto.from_dict(non_tensors={"uid": ["x", "y"]}))
    with pytest.raises(ValueError, match="size 2 and 3"):
        d.union(make(3))
    assert d.union(DataProto.from_dict(meta={"m": 1})).meta["m"] == 1


def test_select_and_pop():
    d = make(3)
    s = d.select(tensor_keys=["ids"], non_tensor_keys=[])
    assert s.keys() == ["ids"] and s.meta == {"temperature": 1.0}
    assert s["ids"] is d["ids"]  # no copy
    assert d.select().keys() == d.keys()
    assert d.select(meta_keys=[]).meta == {}
    popped = d.pop(tensor_keys=["score"], non_tensor_keys=["uid"])
    assert popped.keys() == ["score", "uid"] and popped["uid"].tolist() == ["u0", "u1", "u2"]
    assert d.keys() == ["ids"]
    with pytest.raises(KeyError):
        d.pop(tensor_keys=["score"])


def test_to_cpu():
    d = make(2).to("cpu")
    assert d["ids"].device.type == "cpu" and d["uid"].tolist() == ["u0", "u1"]
    assert d.meta == {"temperature": 1.0}


def test_shuffled_is_deterministic_and_keeps_rows_aligned():
    d = make(8)
    a, b = d.shuffled(seed=0), d.shuffled(seed=0)
    assert a["uid"].tolist() == b["uid"].tolist()
    assert sorted(a["uid"].tolist()) == sorted(d["uid"].tolist())
    assert a["uid"].tolist() != d.shuffled(seed=1)["uid"].tolist()
    for i in range(8):
        k = int(a["uid"][i][1:])
        assert a["ids"][i].tolist() == [2 * k, 2 * k + 1] and a["score"][i].item() == k


def test_permute():
    d = make(3)
    assert d.permute([2, 0, 1])["uid"].tolist() == ["u2", "u0", "u1"]
    with pytest.raises(ValueError, match="permutation"):
        d.permute([0, 0, 1])


def test_repr_is_compact():
    r = repr(make(2))
    assert r == ("DataProto(batch_size=2, tensors={ids: (2, 2) int64, score: (2,) float32}, non_tensors=['uid'], meta=['temperature'])")


def test_meta_travels_through_union_and_concat():
    """union merges meta (the other side wins on a shared key), concat keeps the first item's, and neither
    shares the dict with its inputs."""
    a = DataProto.from_dict(tensors={"x": torch.zeros(2)}, meta={"epoch": 1, "temperature": 0.7})
    b = DataProto.from_dict(tensors={"y": torch.ones(2)}, meta={"epoch": 2, "step": 5})
    u = a.union(b)
    assert u.meta == {"epoch": 2, "temperature": 0.7, "step": 5}
    c = DataProto.concat([a, DataProto.from_dict(tensors={"x": torch.ones(3)}, meta={"epoch": 9})])
    assert c.meta == {"epoch": 1, "temperature": 0.7} and len(c) == 5
    u.meta["epoch"] = c.meta["epoch"] = 42
    assert a.meta["epoch"] == 1 and b.meta["epoch"] == 2
