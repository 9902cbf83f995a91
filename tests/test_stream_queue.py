"""The queue of groups (--trainer.queue-groups G, issue #37): generation workers pull G prompts' groups at a time from one
shared queue and push them back finished; each step takes the next B ready groups, whoever made them, and
--trainer.max-staleness s drops (and counts) a group whose oldest token is more than s updates behind.

The drop on a fixed case runs Rollouts._next_groups in process on hand-made groups; the rest are tiny grpo runs with
real worker processes, slowed or hung from outside (stream_hooks.slowed), killed or interrupted in a subprocess.
"""

import collections
import functools
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest
import torch
from stream_hooks import slowed
from test_grpo_recipe import load_recipe, read_jsonl
from test_off_policy import quick_config

from rlkit import checkpoint
from rlkit.async_rollout import Rollouts
from rlkit.errors import RunFailed
from rlkit.protocol import DataProto

ROOT = Path(__file__).resolve().parents[1]


# -- 1. the drop, on a fixed case -------------------------------------------------------------------------------------
def group(uid: str, versions: list[int], n: int = 2) -> DataProto:
    """One group of n rows whose response tokens carry `versions` (token_version, -1 = padding)."""
    v = torch.tensor([versions] * n)
    return DataProto.from_dict(
        tensors={"token_version": v, "response_mask": (v >= 0).long(), "responses": torch.zeros_like(v)},
        non_tensors={"uid": [uid] * n},
    )


def fixed_rollouts(ready, version: int, max_staleness: int, B: int = 3, k: int = 1):
    """A Rollouts without workers: `ready` = [(group, worker)] already arrived, the trainer at `version`; a new draw
    (when the queue runs short) is recorded, not generated."""
    r = object.__new__(Rollouts)
    r.k, r.batch_groups, r.group_size, r.max_staleness, r.n_workers, r.queue_groups = k, B, 2, max_staleness, 2, 1
    r.policy = SimpleNamespace(weights_version=lambda: version)
    r.stats, r.token_stats, r.qstats, r.pushed = [], [], collections.Counter(), version
    r.ready = collections.deque()
    r.draws = {}
    for g, w in ready:
        oldest = int(g["token_version"][g["response_mask"].bool()].min())
        r.ready.append((g, w, oldest))
        r.draws.setdefault(int(str(g["uid"][0]).split("-")[0]), ({"position": 0}, set()))[1].add(str(g["uid"][0]))
    r.outstanding = len(ready) + 100  # enough queued: no draw unless the test lowers it
    r.drawn = []
    r._submit_draw = lambda: (r.drawn.append(1), setattr(r, "outstanding", r.outstanding + B))
    return r


def test_stale_groups_are_dropped_counted_and_the_next_ready_ones_taken():
    """Trainer at version 5, s = 2. Ready, in arrival order: 1-0 (tokens 4,5: 1 behind), 1-1 (2,3: oldest 3 behind ->
    dropped), 1-2 (3,5: 2 behind, kept: <= s), 2-0 (1: 4 behind -> dropped), 2-1 (5), 2-2 (5: not needed). B = 3: the
    step takes 1-0, 1-2, 2-1 -- whole groups, the next ready ones -- drops 2, leaves 2-2 ready; staleness histogram
    {1: 1, 2: 1, 0: 1}; who made them: worker 0 twice, worker 1 once; version span 2 in group 1-2 (3 -> 5)."""
    ready = [
        (group("1-0", [4, 5]), 0),
        (group("1-1", [2, 3]), 1),
        (group("1-2", [3, 5]), 0),
        (group("2-0", [1, -1]), 1),
        (group("2-1", [5, 5]), 1),
        (group("2-2", [5, -1]), 0),
    ]
    r = fixed_rollouts(ready, version=5, max_staleness=2)
    batch = r._next_groups()
    assert list(batch["uid"]) == ["1-0", "1-0", "1-2", "1-2", "2-1", "2-1"]
    assert [str(g["uid"][0]) for g, _, _ in r.ready] == ["2-2"]
    assert batch.meta["policy_version"] == 3  # the oldest group's: 5 - 2
    assert r.outstanding == 100 + 6 - 5  # 3 taken + 2 dropped leave the queue
    assert 1 not in r.draws and r.draws[2][1] == {"2-2"}  # draw 1 is all taken or dropped: a checkpoint skips it
    m = r.metrics()
    assert m["async/dropped_groups"] == 2
    assert (m["async/groups_stale_0"], m["async/groups_stale_1"], m["async/groups_stale_2"]) == (1, 1, 1)
    assert (m["async/groups_from_0"], m["async/groups_from_1"]) == (2, 1)
    assert m["async/staleness"] == 1 and m["async/staleness_max"] == 2
    assert m["async/version_span_max"] == 2 and m["async/token_staleness_max"] == 2
    assert r.drawn == []


def test_dropped_groups_are_replaced_by_new_draws():
    """Every ready group too stale (s = 1, trainer at 4, groups at 0): all dropped, counted, and with the queue short of
    (k+1)B the step draws more prompts (here recorded) instead of training on fewer groups."""
    ready = [(group(f"1-{j}", [0, 0]), 0) for j in range(3)] + [(group(f"2-{j}", [4, 4]), 1) for j in range(3)]
    r = fixed_rollouts(ready, version=4, max_staleness=1)
    r.outstanding = 6  # exactly (k+1)B
    batch = r._next_groups()
    assert list(batch["uid"])[::2] == ["2-0", "2-1", "2-2"]
    assert r.metrics()["async/dropped_groups"] == 3
    assert len(r.drawn) == 1  # the 3 dropped groups left (k+1)B - taken short: one more draw of B


# -- 2. real workers --------------------------------------------------------------------------------------------------
def test_a_slowed_worker_does_not_hold_the_step(tmp_path, monkeypatch):
    """2 workers, G = 2 (4 jobs per draw of B = 8); worker 1 sleeps 3 s before each job (stream_hooks.slowed, from
    outside). Every step still trains on B = 8 whole groups (8 * n rows), and most come from the fast worker 0."""
    monkeypatch.setattr(Rollouts, "serve", staticmethod(functools.partial(slowed, workers=(1,), generate_s=3.0)))
    grpo = load_recipe("grpo")
    cfg = quick_config(grpo, tmp_path, steps=2, async_steps=1, async_workers=2, queue_groups=2)
    grpo.main(cfg)
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    for r in rows:
        assert r["async/groups_from_0"] + r["async/groups_from_1"] == 8
        assert sum(v for k, v in r.items() if k.startswith("async/groups_stale_")) == 8
        assert r["async/dropped_groups"] == 0  # (no --trainer.max-staleness)
    fast, slow = sum(r["async/groups_from_0"] for r in rows), sum(r["async/groups_from_1"] for r in rows)
    assert fast > slow, (fast, slow)
    assert mp.active_children() == []


def test_a_worker_that_never_delivers_stops_the_run_in_one_line(tmp_path, monkeypatch):
    """Worker 1 takes a job and hangs: the fast worker cannot make up for a job that never comes back, so after
    --trainer.async-timeout-s the run stops naming the worker and the flag, and no process is left. (The limit is
    lowered to 4 s once the workers are up: starting them on a loaded machine can take longer than that; worker 0's
    jobs of 4 groups take ~0.2 s; the 200 steps take 24 s on an idle fast CPU, far longer than 4 s: 20 once took less.)"""
    monkeypatch.setattr(Rollouts, "serve", staticmethod(functools.partial(slowed, workers=(1,), hang=True)))
    start = Rollouts._start_processes

    def started(self, args):
        start(self, args)
        self.timeout_s = 4.0

    monkeypatch.setattr(Rollouts, "_start_processes", started)
    grpo = load_recipe("grpo")
    cfg = quick_config(grpo, tmp_path, steps=200, async_steps=1, async_workers=2, queue_groups=4, async_timeout_s=600)
    with pytest.raises(RunFailed, match=r"generation worker 1 .* never delivered it \(--trainer.async-timeout-s 4\)") as e:
        grpo.main(cfg)
    assert "\n" not in str(e.value)
    assert mp.active_children() == []


# -- 3. shutdown: Ctrl-C or SIGKILL of either side leaves no process and no /dev/shm entry ----------------------------
RUN = """
import signal
import sys
sys.path.insert(0, {tests!r})
from test_grpo_recipe import load_recipe
from test_off_policy import quick_config

if __name__ == "__main__":  # (the workers are spawned: they import this file)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal: CI runs us as a background job of a
    # shell without job control, which starts every child with SIGINT ignored (the trainer then ran on to exit 0)
    grpo = load_recipe("grpo")
    grpo.main(quick_config(grpo, sys.argv[1], steps=200, async_steps=1, async_workers=2, queue_groups=2))
"""


def shm_leaks(before: set[str]) -> list[str]:
    """/dev/shm entries made since `before` that still exist and that no live process maps or holds open (the other
    users of the machine make and hold their own): what our processes left behind."""
    new = set(os.listdir("/dev/shm")) - before
    for proc in psutil.process_iter():
        if not new:
            break
        try:
            held = {m.path for m in proc.memory_maps(grouped=True)} | {f.path for f in proc.open_files()}
        except (psutil.Error, OSError):
            continue
        new -= {os.path.basename(p) for p in held if p.startswith("/dev/shm/")}
    return sorted(new)


def alive(procs) -> list[int]:
    return [p.pid for p in procs if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="Linux: /dev/shm")
@pytest.mark.parametrize("who,sig", [("worker", signal.SIGKILL), ("trainer", signal.SIGKILL), ("trainer", signal.SIGINT)])
def test_killing_either_side_leaves_no_process_and_no_shared_memory(tmp_path, who, sig):
    """A queue-mode run (2 workers) in its own session, killed once its first step is logged. SIGKILL of a worker: the
    trainer stops with the one line naming it and closes the other. SIGINT to the whole group (Ctrl-C in a terminal):
    the workers ignore it, the trainer's KeyboardInterrupt closes them. SIGKILL of the trainer: the workers see it gone
    (before each job, every 2 s idle) and exit, the resource tracker unlinks the queues' semaphores. Either way, within
    60 s: no process of the run left, and no /dev/shm entry of its own."""
    _kill_a_queue_run(tmp_path, who, sig)


def _kill_a_queue_run(tmp_path, who, sig):
    script = tmp_path / "run.py"
    script.write_text(RUN.format(tests=str(ROOT / "tests")))
    before = set(os.listdir("/dev/shm"))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    log = open(tmp_path / "log.txt", "w")
    p = subprocess.Popen(
        [sys.executable, str(script), str(tmp_path / "out")], env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    trainer = psutil.Process(p.pid)
    try:
        metrics, deadline = tmp_path / "out" / "metrics.jsonl", time.monotonic() + 240
        while not (metrics.exists() and metrics.read_text().strip()):
            assert p.poll() is None and time.monotonic() < deadline, (tmp_path / "log.txt").read_text()[-3000:]
            time.sleep(0.5)
        procs = trainer.children(recursive=True)
        workers = [c for c in procs if "spawn_main" in " ".join(c.cmdline()) and "resource_tracker" not in " ".join(c.cmdline())]
        assert len(workers) == 2, [c.cmdline() for c in procs]
        if who == "worker":
            os.kill(workers[1].pid, sig)
        elif sig == signal.SIGINT:
            os.killpg(p.pid, sig)
        else:
            p.kill()
        code = p.wait(timeout=60)
        deadline = time.monotonic() + 60
        while alive(procs) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert alive(procs) == [], [c.cmdline() for c in procs if c.pid in alive(procs)]
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
        log.close()
    out = (tmp_path / "log.txt").read_text()
    assert code != 0
    if who == "worker":
        assert f"generation worker 1 (pid {workers[1].pid}, --trainer.async-steps 1) was killed by SIGKILL" in out, out[-3000:]
    deadline = time.monotonic() + 20  # (the resource tracker unlinks after the last process holding its pipe is gone)
    while shm_leaks(before) and time.monotonic() < deadline:
        time.sleep(1.0)
    assert shm_leaks(before) == []


# -- 4. resume ---------------------------------------------------------------------------------------------------------
def test_a_resumed_queue_run_redraws_from_the_oldest_draw_not_yet_taken(tmp_path, capsys):
    """Restored: the weights and optimizer, the version count, the loader's position before the oldest draw that still
    had a group queued, generating or ready (Rollouts.loader_state); resampled: those draws' groups, afresh by the
    restored weights (groups of those draws already trained on would be trained on again: with one worker and G = B,
    as here, a draw is taken whole, so none). 1 worker, G = B = 8, k = 1: after step s draws 1..s are taken and draw
    s + 1 queued, so step 2's checkpoint holds position 2 (as the k-step loop's); resumed, step 3 trains on fresh
    groups (staleness 0: the new worker starts on the restored version 2) and the run ends at step 3."""
    grpo = load_recipe("grpo")
    part = tmp_path / "part"
    flags = dict(save_freq=1, max_ckpt_to_keep=0, async_steps=1, queue_groups=8)
    grpo.main(quick_config(grpo, part, steps=2, **flags))
    assert [checkpoint.load(part / f"checkpoints/global_step_{s}")[0]["loader"] for s in (1, 2)] == [
        {"epoch": 0, "position": s} for s in (1, 2)
    ]
    capsys.readouterr()
    grpo.main(quick_config(grpo, part, steps=3, resume="auto", **flags))
    assert "resumed at step 2 (async: the prompts an uninterrupted run draws, sampled afresh" in capsys.readouterr().out
    rows = read_jsonl(part / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[-1]["async/groups_stale_0"] == 8 and rows[-1]["async/staleness"] == 0
    assert checkpoint.load(part / "checkpoints/global_step_3")[0]["loader"] == {"epoch": 0, "position": 3}
    assert mp.active_children() == []
