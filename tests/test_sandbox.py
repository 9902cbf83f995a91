"""The sandbox contains what model-written text and code try: each attack of issue #10, with the real verifiers.

A test that needs an isolation layer this machine lacks is skipped, and the reason names the layer.
"""

import os
import signal
import socket
import sys
import time
from pathlib import Path

import pytest

from rlkit.errors import ConfigError, RunFailed
from rlkit.rewards import RewardFn
from rlkit.sandbox import Limits, Sandbox, SandboxFailure, SandboxPool

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the sandbox runs on Linux only")
FIXTURE = Path(__file__).parent / "fixtures" / "my_reward.py"


@pytest.fixture(scope="module")
def box():
    with Sandbox(Limits(timeout_s=1.5, memory_mb=512, nproc=32)) as sb:
        sb.run_code("pass")  # start it: level and layers are known from here on
        yield sb


def need(box, *layers):
    """Skip unless one of `layers` applied on this machine."""
    if not set(layers) & set(box.layers):
        pytest.skip(f"this machine lacks the {' or '.join(layers)} layer (it has: {', '.join(box.layers)})")


def test_run_code_gives_stdout_stderr_exit_code_and_reads_stdin(box):
    r = box.run_code("import sys\nprint(input()[::-1])\nprint('warn', file=sys.stderr)\nsys.exit(3)", stdin="abc\n")
    assert (r.status, r.exit_code, r.stdout, r.stderr) == ("ok", 3, "cba\n", "warn\n")
    r = box.run_code("raise ValueError('bad')")
    assert r.exit_code == 1 and r.stderr.strip().endswith("ValueError: bad")
    assert box.run_code("import os; os._exit(7)").exit_code == 7


def test_call_sends_and_returns_json_only(box):
    assert box.call("math:comb", 5, 2) == 10
    assert box.call("json:loads", '{"a": [1, 2.5, null]}') == {"a": [1, 2.5, None]}
    with pytest.raises(SandboxFailure, match="is not JSON") as info:  # an object never crosses back
        box.call("builtins:object")
    assert info.value.result.status == "error"


def test_a_hang_is_killed_at_the_wall_clock_limit_and_the_worker_goes_on(box):
    start = time.monotonic()
    r = box.run_code("import time\nwhile True: time.sleep(0.01)")
    assert r.timed_out and 1.4 < time.monotonic() - start < 5
    assert box.call("math:factorial", 4) == 24


def test_a_timeout_kills_the_jobs_children_too(box):
    r = box.run_code("import subprocess, time\np = subprocess.Popen(['sleep', '60'])\nprint(p.pid, flush=True)\ntime.sleep(60)")
    assert r.timed_out
    status = Path(f"/proc/{int(r.stdout)}/status")
    time.sleep(0.2)
    assert not status.exists() or "State:\tZ" in status.read_text()  # gone, or dead and not yet reaped by init


@pytest.mark.parametrize("code, status", [("import sys; sys.exit(0)", "error"), ("import os; os._exit(3)", "exit")])
def test_exits_are_reported_not_silent(box, code, status):
    r = box.map([{"fn": "builtins:exec", "args": [code]}])[0]
    assert r.status == status and not r.ok
    assert box.call("math:factorial", 3) == 6


def test_a_memory_bomb_fails_inside(box):
    r = box.run_code("x = bytearray(4 << 30)")
    assert r.exit_code == 1 and "MemoryError" in r.stderr


def test_a_fork_loop_is_bounded(box):
    need(box, "pids-cgroup", "nproc-rlimit")
    r = box.run_code("import os\nwhile True:\n    os.fork()")
    assert r.stderr.count("BlockingIOError") >= 1 or r.timed_out
    assert box.call("math:factorial", 3) == 6


def test_the_temp_dir_is_fresh_and_removed_and_writes_elsewhere_fail(box, tmp_path):
    r = box.run_code("import os\nopen('mine.txt', 'w').write('x')\nprint(os.getcwd())")
    cwd = Path(r.stdout.strip())
    assert r.exit_code == 0 and cwd != Path.cwd() and not cwd.exists()
    need(box, "landlock-fs")
    r = box.run_code(f"open({str(tmp_path / 'escaped.txt')!r}, 'w').write('x')")
    assert r.exit_code == 1 and "PermissionError" in r.stderr
    assert not (tmp_path / "escaped.txt").exists()


def test_no_connection_to_a_local_port(box):
    need(box, "netns", "landlock-tcp")
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        port = server.getsockname()[1]
        r = box.run_code(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)")
        assert r.exit_code == 1 and ("PermissionError" in r.stderr or "unreachable" in r.stderr), r.stderr
        server.settimeout(0.1)
        with pytest.raises(socket.timeout):
            server.accept()


def test_the_environment_is_clean(monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", "secret-key")
    monkeypatch.setenv("HF_TOKEN", "secret-token")
    with Sandbox(Limits(timeout_s=5)) as sb:
        out = sb.run_code("import os; print(sorted(os.environ))").stdout
    assert "WANDB_API_KEY" not in out and "HF_TOKEN" not in out and "PATH" in out


def test_pool_runs_in_order_across_workers_and_recycles():
    with SandboxPool(Limits(timeout_s=5), workers=2, max_jobs=2) as pool:
        results = pool.map([{"fn": "os:getppid"} for _ in range(6)] + [{"fn": "math:sqrt", "args": [16]}])
        assert [r.status for r in results] == ["ok"] * 7 and results[-1].value == 4.0
        assert len({r.value for r in results[:6]}) >= 3  # 2 workers, each replaced after 2 jobs
    with SandboxPool(Limits(timeout_s=5), workers=1, fresh=True) as pool:
        pids = [r.value for r in pool.map([{"fn": "os:getppid"}] * 3)]
        assert len(set(pids)) == 3  # a new process for every call


def test_a_minimum_level_the_machine_lacks_fails_fast():
    pool = SandboxPool(min_level="strict")
    with pytest.raises(ConfigError, match=r"--reward.sandbox-level strict: this machine gives only level 'process'.*Landlock"):
        pool._on_hello({"layers": ["process", "rlimits"], "level": "process"})
    with pytest.raises(ConfigError, match="choose one of process, network, strict"):
        SandboxPool(min_level="max")


def test_a_worker_killed_from_outside_is_replaced(box):
    pid = box.call("os:getppid")
    os.killpg(pid, signal.SIGKILL)
    time.sleep(0.3)  # (a job sent at the very moment it dies comes back as status "crash")
    assert box.call("math:factorial", 5) == 120
    assert box.call("os:getppid") != pid


# ----------------------------------------------------------------------------- through the reward function


@pytest.mark.parametrize("task", ["spiral_matrix", "countdown"])  # the verifier evals / sympy-parses the answer
def test_real_reasoning_gym_verifiers_cannot_run_the_models_code_in_the_trainer(tmp_path, task):
    pytest.importorskip("reasoning_gym")
    from rlkit import tasks

    row = tasks.task_rows(f"reasoning_gym:{task}", 1, 0)[0]
    tasks.register(task)
    marker = tmp_path / "pwned"
    payload = f"<answer>__import__('pathlib').Path({str(marker)!r}).write_text('x')</answer>"
    args = (row["data_source"], [payload], [row["reward_model"]["ground_truth"]], [row["extra_info"]])
    RewardFn(sandbox="off")(*args)
    assert marker.exists()  # the attack is real: in-process, the model's text ran
    marker.unlink()
    reward = RewardFn(timeout_s=10)
    try:
        scores, _ = reward(*args)
        if "landlock-fs" not in reward.pool.layers:
            pytest.skip("this machine lacks Landlock: the write is then only kept off the trainer's process, not its disk")
    finally:
        reward.close()
    assert not marker.exists() and scores.tolist() == [pytest.approx(0.0, abs=0.06)]


def test_countdown_power_tower_fails_within_the_limit_instead_of_hanging_the_run():
    pytest.importorskip("reasoning_gym")
    from rlkit import tasks

    row = tasks.task_rows("reasoning_gym:countdown", 1, 0)[0]
    tasks.register("countdown")
    reward = RewardFn(on_error="zero", timeout_s=1)
    try:
        reward(row["data_source"], ["<answer>1</answer>"], ["1"], [row["extra_info"]])  # starts the workers
        start = time.monotonic()
        scores, metrics = reward(row["data_source"], ["<answer>9**9**9**9</answer>"], ["1"], [row["extra_info"]])
        seconds = time.monotonic() - start
    finally:
        reward.close()
    # (sympy either runs past the 1 s limit or, on a fast moment, reaches 9**(9**9) and runs out of memory)
    assert scores.tolist() == [0.0] and metrics["reward/errors"] == 1.0 and seconds < 6, (metrics, seconds)


@pytest.mark.parametrize(
    "name, needle",
    [("exit_score", "called sys.exit(0)"), ("os_exit_score", "exited with status 3"), ("object_score", "is not JSON")],
)
def test_a_scorer_that_exits_or_returns_garbage_stops_the_run_with_one_line(name, needle):
    reward = RewardFn(f"{FIXTURE}:{name}")
    try:
        with pytest.raises(RunFailed) as info:
            reward(["ds"] * 2, ["first", "the answer"], ["1", "2"])
    finally:
        reward.close()
    message = str(info.value)
    assert f"{name} failed on sample 0" in message and "response='first'" in message and needle in message
    assert "\n" not in message
