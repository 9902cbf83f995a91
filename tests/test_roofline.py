"""bench/common.py's roofline: the FLOPs a GRPO step's phases must do, against hand-derived counts (issue #25)."""

import sys
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import common  # noqa: E402

from rlkit import packing  # noqa: E402

# h 4, 2 query heads of 2 (a = 4), 1 key/value head (kv = 2), gated MLP of 8, 2 layers, vocabulary 10
TINY = SimpleNamespace(
    hidden_size=4, num_attention_heads=2, head_dim=2, num_key_value_heads=1, intermediate_size=8, num_hidden_layers=2, vocab_size=10
)


def test_body_params_by_hand():
    # per layer: q 4x4 + k 4x2 + v 4x2 + o 4x4 + gate 4x8 + up 4x8 + down 8x4 = 16 + 8 + 8 + 16 + 32 + 32 + 32 = 144
    assert common.body_params(common.model_dims(TINY)) == 2 * 144


def test_group_counts_by_hand():
    # prompt of 3, responses of 2 and 1 tokens: positions 3 + 1 + 0; reads: the prompt's last + 1 + 0;
    # keys: prompt 1 + 2 + 3, response 1's first token (position 3) sees 3 + 1
    assert common.group_counts(3, [2, 1]) == (4, 2, 10)
    # prompt of 2, one response of 3: positions 2 + 2, reads 1 + 2, keys 1 + 2 + (2 + 1) + (2 + 2)
    assert common.group_counts(2, [3]) == (4, 3, 10)


def test_phase_flops_by_hand():
    # forward = 2 N positions + 2 h V reads + 4 a layers keys, N = 288, h V = 40, 4 a layers = 32
    g1 = 2 * 288 * 4 + 2 * 40 * 2 + 32 * 10  # 2784
    g2 = 2 * 288 * 4 + 2 * 40 * 3 + 32 * 10  # 2864
    f = common.phase_flops(TINY, [(3, [2, 1]), (2, [3])])
    assert f == {"gen": g1 + g2, "ref": g1 + g2, "old_log_prob": g1 + g2, "update": 3 * (g1 + g2)}
    assert common.phase_flops(TINY, [(3, [2, 1])], old_log_prob=False)["old_log_prob"] == 0


def test_attention_keys_equal_the_engines_block_mask():
    """The keys counted are exactly the pairs the packed pass's block mask allows, for the queries whose output is
    needed (every position but each response's last token)."""
    P, responses = 5, [4, 1, 3]
    sub = torch.tensor([0] * P + [k for k, r in enumerate(responses, 1) for _ in range(r)])[None]
    mask = packing.block_mask(torch.zeros_like(sub), sub)[0]  # (C, C)
    ends = torch.tensor(responses).cumsum(0) + P - 1  # each response's last token
    needed = torch.ones(sub.shape[1], dtype=torch.bool)
    needed[ends] = False
    assert common.group_counts(P, responses)[2] == int(mask[needed].sum())
    assert common.group_counts(P, responses)[0] == int(needed.sum())


def test_groups_of_consecutive_uids():
    assert common.groups_of([3, 3, 2], [2, 1, 3], ["a", "a", "b"]) == [(3, [2, 1]), (2, [3])]


def test_matmul_ceiling_is_a_rate():
    rate = common.matmul_ceiling(TINY, rows=8, reps=1)
    assert 0 < rate < float("inf")


def test_mean_groups_by_hand():
    # 2 prompts of mean 3.4 tokens, n 2 responses of mean 1.6: 2 groups (3, [2, 2])
    assert common.mean_groups(2, 2, 3.4, 1.6) == [(3, [2, 2]), (3, [2, 2])]


def test_roofline_table_percent_by_hand():
    """% of ceiling = (phase FLOPs / seconds) / ceiling; a side with its own tokens is charged its own FLOPs."""
    ceiling = common.Ceiling(TINY, decode_rows=0)
    ceiling.passes = [2e9]  # a pass ceiling of 2 GFLOP/s
    steps = [[(3, [2, 1])]]  # forward 2784 FLOPs (test_phase_flops_by_hand), update 3 x 2784
    sides = {"a": [{"ref": 2784e-9, "update": 8352e-9}], "b": [{"ref": 2864e-9}]}
    table = common.roofline_table(TINY, steps, sides, ceiling, side_steps={"b": [[(2, [3])]]})  # b: forward 2864
    rows = [line.split() for line in table.splitlines()[3:]]
    # a: 1 GFLOP/s in each phase, 50 % of 2; b charged its own 2864 FLOPs in 2864 ns: 50 % (2784 would read 49 %)
    assert [(r[0], r[1], r[-2], r[-1]) for r in rows] == [
        ("a", "ref", "1.00", "50%"),
        ("a", "update", "1.00", "50%"),
        ("b", "ref", "1.00", "50%"),
    ]


def test_metrics_roofline_rebuilds_groups_from_the_logged_means():
    """A step of 2 rows (n 2) with prompts of 3 and responses of 2 tokens logs 10 tokens: one group (3, [2, 2]),
    forward = 2 N 5 positions + 2 h V 3 reads + 4 a layers 14 keys = 2880 + 240 + 448 = 3568 FLOPs."""
    assert common.group_counts(3, [2, 2]) == (5, 3, 14)
    ceiling = common.Ceiling(TINY, decode_rows=0)
    ceiling.passes = [2e6]  # 2 MFLOP/s, so that the pass takes over the 1 ms below which a timer means "skipped"
    row = {"prompt_length/mean": 3.0, "response_length/mean": 2.0, "perf/throughput": 1000.0, "timing/step": 0.01, "timing/ref": 3568e-6}
    tiny = {**row, "timing/ref": 5e-4}  # under 1 ms
    small = {**row, "perf/throughput": 100.0, "timing/step": 0.1, "timing/ref": 1.5e-3}  # over 1 ms, under 2 % of the step
    sides = {"local": [row], "async": [tiny], "ray": [small]}
    lines = common.metrics_roofline(TINY, sides, n=2, ceiling=ceiling, phases=("ref",)).splitlines()
    assert lines[3].split()[0] == "local" and lines[3].split()[-1] == "50%"
    assert not any(line.startswith(("async", "ray")) for line in lines)  # their timers wrapped a skipped pass
