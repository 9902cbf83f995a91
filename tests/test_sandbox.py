"""The sandbox contains what model-written text and code try: each attack of issue #10, with the real verifiers.

A test that needs an isolation layer this machine lacks is skipped, and the reason names the layer.
"""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from rlkit import rewards, sandbox
from rlkit.errors import ConfigError, RunFailed
from rlkit.rewards import RewardFn
from rlkit.sandbox import Limits, Sandbox, SandboxFailure, SandboxPool, level_of

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the sandbox runs on Linux only")
FIXTURE = Path(__file__).parent / "fixtures" / "my_reward.py"


@pytest.fixture(scope="module")
def box():
    with Sandbox(Limits(timeout_s=1.5, memory_mb=512, nproc=32)) as sb:
        sb.run_code("pass")  # start it: level and layers are known from here on
        yield sb


@pytest.fixture
def outside():
    """A folder outside the temp roots (/tmp is emptied in the sandbox's view where it can be): writes there
    test the write and metadata layers, not the hiding of /tmp."""
    path = Path(__file__).parent / f".sandbox-outside-{os.getpid()}"
    path.mkdir()
    yield path
    shutil.rmtree(path, ignore_errors=True)


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


def running(marker: str) -> list[int]:
    """Pids (as this process sees them) of live processes whose command line holds `marker`."""
    pids = []
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit() and marker in (d / "cmdline").read_bytes().decode(errors="replace"):
                if "State:\tZ" not in (d / "status").read_text():  # a zombie is dead (not yet reaped by init)
                    pids.append(int(d.name))
        except OSError:
            pass
    return pids


@pytest.mark.parametrize("setsid", [False, True])
def test_a_timeout_kills_the_jobs_children_too(box, setsid):
    if setsid:  # a child in its own session leaves the job's process group: only a PID namespace takes it
        need(box, "pidns")
    marker = f"60.{os.getpid()}{int(setsid)}"
    r = box.run_code(f"import subprocess, time\np = subprocess.Popen(['sleep', '{marker}'], start_new_session={setsid})\ntime.sleep(60)")
    assert r.timed_out
    for _ in range(50):
        if not running(marker):
            break
        time.sleep(0.1)
    assert running(marker) == []


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


def test_the_temp_dir_is_fresh_and_removed_and_writes_elsewhere_fail(box, outside):
    r = box.run_code("import os\nopen('mine.txt', 'w').write('x')\nprint(os.getcwd())")
    cwd = Path(r.stdout.strip())
    assert r.exit_code == 0 and cwd != Path.cwd() and not cwd.exists()
    need(box, "landlock-fs")
    r = box.run_code(f"open({str(outside / 'escaped.txt')!r}, 'w').write('x')")
    assert r.exit_code == 1 and ("PermissionError" in r.stderr or "Read-only file system" in r.stderr)  # Landlock / ro-root
    assert not (outside / "escaped.txt").exists()


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


# ----------------------------------------------------------------------------- issue #21: the promises kept

OWNER = """
import json, os, sys
from rlkit.sandbox import Limits, SandboxPool
if os.environ.get("RLKIT_TEST_NO_CGROUP"):  # (another rlkit process's stale-owner cleanup kills what is in a dead owner's cgroup)
    SandboxPool._make_cgroup = lambda self, index: None
pool = SandboxPool(Limits(timeout_s=float(sys.argv[2])), workers=1).start()
print(json.dumps({"level": pool.level, "layers": pool.layers}), flush=True)
r = pool.run_code(sys.argv[1])
print(json.dumps({"status": r.status, "stdout": r.stdout, "stderr": r.stderr}), flush=True)
"""

SNOOP = """
import os
seen, pid = set(), os.getpid()
while pid > 1:  # up the PPid chain to the trainer, as the audit did, and every pid in sight
    pid = int([line for line in open(f"/proc/{pid}/status") if line.startswith("PPid")][0].split()[1])
    seen.add(pid)
for p in seen | {int(d) for d in os.listdir("/proc") if d.isdigit()} | {OWNER_PID}:
    try:
        print(p, open(f"/proc/{p}/environ").read())
    except OSError as e:
        print(p, type(e).__name__)
"""


def start_owner(code: str, timeout_s: float, cwd=None, **env) -> tuple[subprocess.Popen, dict]:
    """A small trainer stand-in in its own process: it starts a pool, says its level, and runs `code` there."""
    proc = subprocess.Popen(
        [sys.executable, "-c", OWNER, code, str(timeout_s)], stdout=subprocess.PIPE, text=True, env={**os.environ, **env}, cwd=cwd
    )
    return proc, json.loads(proc.stdout.readline())


def test_the_trainers_secrets_and_other_processes_are_out_of_reach():
    proc, hello = start_owner(SNOOP.replace("OWNER_PID", "os.getpid()"), 10, HF_TOKEN="secret-h3-token", WANDB_API_KEY="secret-h3-key")
    out = json.loads(proc.stdout.readline())
    proc.wait()
    if "pidns" not in hello["layers"]:
        assert hello["level"] != "strict"  # the level does not promise what the machine does not give
        pytest.skip(f"this machine lacks the pidns layer (it has: {', '.join(hello['layers'])})")
    assert out["status"] == "ok" and "PATH=" in out["stdout"]  # it did read environments: its own, clean ones
    assert "secret-h3" not in out["stdout"] + out["stderr"]


def test_the_trainers_credential_files_are_emptied(outside):
    home, project = outside / "home", outside / "project" / "src"
    files = [home / f for f in (".ssh/id_ed25519", ".netrc", ".config/gh/hosts.yml", ".kaggle/kaggle.json", ".ray/auth_token")]
    files += [outside / "hf" / "token", outside / "project" / ".env"]  # $HF_HOME's token; the .env above the working dir
    for f in files:
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(f"secret-h3-{f.name}")
    project.mkdir()
    code = f"for p in {[str(f) for f in files]!r}:\n    try:\n        print(open(p).read())\n    except OSError as e:\n        print(type(e).__name__)"
    proc, hello = start_owner(code, 10, cwd=project, HOME=str(home), HF_HOME=str(outside / "hf"))
    out = json.loads(proc.stdout.readline())
    proc.wait()
    if "hidden-secrets" not in hello["layers"]:
        assert hello["level"] != "strict"
        pytest.skip(f"this machine lacks the hidden-secrets layer (it has: {', '.join(hello['layers'])})")
    lines = out["stdout"].split("\n")
    assert out["status"] == "ok" and lines[-1] == "" and len(lines) == len(files) + 1, out
    assert not any("secret-h3" in line for line in lines), out  # not one credential read
    if not str(outside).startswith(tempfile.gettempdir()):  # (a checkout under the temp root: all of it hidden, not found)
        assert lines[:-1] == ["PermissionError", "", "PermissionError", "PermissionError", "", "", ""], out
    assert all(line in ("", "PermissionError", "FileNotFoundError") for line in lines), out
    # (a folder without access, an empty file; under the hidden temp root: not found)


def test_unix_sockets_in_the_temp_root_and_run_are_out_of_reach(box, tmp_path):
    need(box, "hidden-sockets")  # (not where the Python installation or a scorer file lives in /tmp: then /tmp stays)
    path = str(tmp_path / "raylet.sock")  # where Ray keeps its sockets: /tmp/ray/session_*/sockets
    with socket.socket(socket.AF_UNIX) as server:
        server.bind(path)
        server.listen(1)
        r = box.run_code(f"import socket\nsocket.socket(socket.AF_UNIX).connect({path!r})\nprint('connected')")
    assert r.exit_code == 1 and "FileNotFoundError" in r.stderr and "connected" not in r.stdout


def test_metadata_changes_outside_the_temp_dir_are_refused(box, outside):
    target = outside / "checkpoint.bin"
    target.write_bytes(b"weights")
    os.chmod(target, 0o600)
    os.utime(target, (1e9, 1e9))
    code = f"""
import os
open('mine', 'w').close()
for f in ({str(target)!r}, 'mine'):
    for name, op in [
        ('chmod', lambda: os.chmod(f, 0o777)),
        ('chown', lambda: os.chown(f, os.getuid(), os.getgid())),
        ('utime', lambda: os.utime(f, (0, 0))),
        ('setxattr', lambda: os.setxattr(f, 'user.rlkit', b'1')),
    ]:
        try:
            op()
            print(f == 'mine', name, 'done')
        except OSError as e:
            print(f == 'mine', name, 'refused', e.errno)
"""
    r = box.run_code(code)
    if "ro-root" not in box.layers:
        assert box.level != "strict"
        pytest.skip(f"this machine lacks the ro-root layer (it has: {', '.join(box.layers)})")
    lines = r.stdout.splitlines()
    assert [line.split()[2:] for line in lines] == [["refused", "30"]] * 4 + [["done"]] * 4, r.stdout + r.stderr  # EROFS; its own: as usual
    st = target.stat()
    assert (st.st_mode & 0o777, st.st_mtime) == (0o600, 1e9) and "user.rlkit" not in os.listxattr(target)


def family(pid: int) -> set[int]:
    """`pid`'s descendants (from /proc's PPid lines)."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        try:
            ppid = int([x for x in (d / "status").read_text().splitlines() if x.startswith("PPid")][0].split()[1])
            children.setdefault(ppid, []).append(int(d.name))
        except (OSError, ValueError, IndexError):
            pass
    out, todo = set(), [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        out.update(kids)
        todo += kids
    return out


def alive(pid: int) -> bool:
    try:
        return "State:\tZ" not in Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False


def test_workers_and_their_jobs_die_with_their_owner():
    # a busy job with a long limit, as in the audit; no pids cgroup, so that a sandbox started meanwhile by another test
    # (pytest -n 2) or program cannot be what kills the orphans: they must die with their owner on their own
    proc, hello = start_owner("while True: pass", 600, RLKIT_TEST_NO_CGROUP="1")
    try:
        time.sleep(2)  # the job is sent right after the hello
        kin = family(proc.pid)
        assert len(kin) >= 2, kin  # the worker and its busy job (and with a PID namespace, the worker's outer process)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        for _ in range(100):
            if not any(alive(p) for p in kin):
                break
            time.sleep(0.1)
        assert [p for p in kin if alive(p)] == []
    finally:
        for p in family(proc.pid) | ({p for p in kin if alive(p)} if "kin" in locals() else set()):
            try:
                os.kill(p, signal.SIGKILL)
            except OSError:
                pass


def test_the_cpu_limit_follows_the_wall_clock_limit(box):
    assert box.call("resource:getrlimit", 0) == [3, 4]  # RLIMIT_CPU: ceil(1.5) + 1 seconds, hard limit one more
    assert Limits(timeout_s=600).cpu_seconds() == 601 and Limits(timeout_s=2, cpu_s=5).cpu_seconds() == 5


def test_reward_fn_has_a_finite_time_limit_by_default(monkeypatch, tmp_path):
    assert RewardFn().timeout_s == rewards.DEFAULT_TIMEOUT_S == 30.0  # as --reward.timeout-s; 0 = none only when asked
    scorer = tmp_path / "evaluating.py"
    scorer.write_text("def score(data_source, solution_str, ground_truth, extra_info=None):\n    return float(eval(solution_str) == 1)\n")
    monkeypatch.setattr(rewards, "DEFAULT_TIMEOUT_S", 1.0)
    reward = RewardFn(f"{scorer}:score", on_error="zero")
    try:
        scores, metrics = reward(["ds"], ["9**9**9**9"], ["1"])
        assert reward.pool.limits.timeout_s == 1.0 and reward.pool.limits.cpu_seconds() == 2
    finally:
        reward.close()
    # (a timeout; or, on a fast moment, 9**(9**9) is reached and 9 to that power runs out of memory)
    assert scores.tolist() == [0.0] and metrics["reward/errors"] == 1.0


def test_leftovers_of_a_dead_owner_are_removed_at_start():
    dead = subprocess.Popen(["true"])
    dead.wait()  # a pid that no longer runs
    root = Path(tempfile.gettempdir())
    stale, live = root / f"rlkit-sandbox-{dead.pid}-x1", root / f"rlkit-sandbox-{os.getppid()}-x1"  # (our parent lives)
    cgroups = Path("/sys/fs/cgroup/pids")
    stale_cg = cgroups / f"rlkit-sandbox-{dead.pid}-0"
    try:
        for d in (stale, live):
            (d / "job").mkdir(parents=True)
        if os.access(cgroups, os.W_OK):
            stale_cg.mkdir()
        with Sandbox(Limits(timeout_s=5)) as sb:
            sb.run_code("pass")
        assert not stale.exists() and live.exists() and not stale_cg.exists()
    finally:
        shutil.rmtree(stale, ignore_errors=True)
        shutil.rmtree(live, ignore_errors=True)
        if stale_cg.exists():
            stale_cg.rmdir()


def test_the_level_is_checked_before_anything_loads_and_shown_in_the_start_line(monkeypatch):
    monkeypatch.setattr(sandbox, "_probed", {"level": "network", "layers": ["process", "netns", "landlock-fs"]})
    with pytest.raises(ConfigError, match=r"^--agent.sandbox-level strict: this machine gives only level 'network'.*PID namespace"):
        sandbox.check_level("strict", "--agent.sandbox-level")
    assert sandbox.check_level("network", "--agent.sandbox-level") == "network"
    with pytest.raises(ConfigError, match="choose one of process, network, strict"):
        sandbox.check_level("max", "--agent.sandbox-level")
    cfg = SimpleNamespace(system=SimpleNamespace(reward=SimpleNamespace(sandbox="auto")), agent=SimpleNamespace(tools="calculator"))
    without = "(without ro-root, pidns, hidden-secrets, hidden-sockets, disk-quota)"  # each layer it could not apply
    assert sandbox.start_clause(cfg) == f"sandbox level network {without}"
    cfg.system.reward.sandbox = "off"
    assert sandbox.start_clause(cfg) == "sandbox off (scorers run in this process)"
    cfg.agent.tools = "calculator,python"
    assert sandbox.start_clause(cfg) == f"sandbox level network {without} (scorers in this process: --reward.sandbox off)"
    monkeypatch.setattr(sandbox, "_probed", {"level": "strict", "layers": [*sandbox.STRICT, "netns"]})
    assert sandbox.start_clause(cfg) == "sandbox level strict (scorers in this process: --reward.sandbox off)"


def test_pool_runs_in_order_across_workers_and_recycles():
    with SandboxPool(Limits(timeout_s=5), workers=2, max_jobs=2) as pool:
        results = pool.map([{"fn": "os:getpid"} for _ in range(6)] + [{"fn": "math:sqrt", "args": [16]}])
        assert [r.status for r in results] == ["ok"] * 7 and results[-1].value == 4.0
        assert len({r.worker for r in results[:6]}) >= 3  # 2 workers, each replaced after 2 jobs
    with SandboxPool(Limits(timeout_s=5), workers=1, fresh=True) as pool:
        pids = [r.worker for r in pool.map([{"fn": "os:getpid"}] * 3)]
        assert len(set(pids)) == 3  # a new process for every call


def test_a_minimum_level_the_machine_lacks_fails_fast():
    pool = SandboxPool(min_level="strict")
    with pytest.raises(ConfigError, match=r"--reward.sandbox-level strict: this machine gives only level 'process'.*Landlock"):
        pool._on_hello({"layers": ["process", "rlimits"], "level": "process"})
    layers = ["process", "netns", "landlock-fs", "landlock-tcp"]  # Landlock but no namespaces (Docker, Ubuntu >= 23.10)
    mounts = ["pidns", "ro-root", "hidden-secrets", "hidden-sockets", "disk-quota"]
    assert level_of(layers) == "network" and level_of(layers + mounts) == "strict"
    for layer in ["landlock-fs"] + mounts:  # strict only with every layer it promises (hidden credential files, sockets, the quota...)
        assert level_of([x for x in layers + mounts if x != layer]) == "network", layer
    with pytest.raises(ConfigError, match=r"only level 'network'.*needs a mount namespace .* and a PID namespace") as info:
        SandboxPool(min_level="strict")._on_hello({"layers": layers, "level": "network"})
    assert "\n" not in str(info.value)
    with pytest.raises(ConfigError, match="choose one of process, network, strict"):
        SandboxPool(min_level="max")


def test_a_worker_killed_from_outside_is_replaced(box):
    pid = box.map([{"fn": "os:getpid"}])[0].worker
    os.killpg(pid, signal.SIGKILL)
    time.sleep(0.3)  # (a job sent at the very moment it dies comes back as status "crash")
    assert box.call("math:factorial", 5) == 120
    assert box.map([{"fn": "os:getpid"}])[0].worker != pid


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


# ----------------------------------------------------------------------------- issue #34: model-written text never crashes a run

FORGE = """
import os
line = b'{"id": 0, "status": "ok", "value": ' + b'[' * 990 + b']' * 990 + b'}\\n'
for pid in (os.getppid(), 1):  # the worker's fds, then its own: the job -> worker pipe, whatever else is open
    for fd in range(64):
        try:
            os.write(os.open(f"/proc/{pid}/fd/{fd}", os.O_WRONLY), line)
        except OSError:
            pass
for fd in range(3, 64):
    try:
        os.write(fd, line)
    except OSError:
        pass
os._exit(0)
"""


def deep_stack(n, fn):
    """fn() called n frames deeper (as the trainer calls a tool, ~40 frames down from the training loop)."""
    return deep_stack(n - 1, fn) if n else fn()


def test_a_python_tool_call_cannot_forge_its_result_or_crash_the_trainer():
    from rlkit.tools import ToolCall, Tools, python

    tools = Tools([python], sandbox_workers=1)
    try:
        calls = [ToolCall("python", {"code": FORGE}), ToolCall("python", {"code": "print(6 * 7)"})]
        forged, after = deep_stack(100, lambda: tools.call_many(calls))
        assert (forged.text, forged.error) == ("", False)  # what a script writes to a pipe is never read as its result
        assert (after.text, after.error) == ("42\n", False)  # and the run goes on
    finally:
        tools.close()


def test_a_function_jobs_deep_or_forged_value_is_that_calls_error(box):
    with pytest.raises(SandboxFailure, match="nested at most 64 deep"):
        box.call("json:loads", "[" * 500 + "]" * 500)
    r = box.map([{"fn": "builtins:exec", "args": [FORGE]}])[0]  # a verifier that evals the answer: the same primitive
    assert (r.status, r.value) == ("error", None) and "nested at most 64 deep" in r.error
    assert box.call("json:loads", "[[1]]") == [[1]]


def test_an_unreadable_line_from_a_worker_is_that_jobs_crash_and_the_worker_is_replaced(monkeypatch):
    with Sandbox(Limits(timeout_s=5)) as sb:
        sb.start()
        first = sb._workers[0].proc.pid
        real = sandbox._Worker.read_line
        lines = iter([b"[" * 100_000, b'{"id": 7, "status": "ok"}', b"not json"])
        fake = lambda w, limit: (real(w, limit), next(lines, None))[1] if w.state == "busy" else real(w, limit)  # noqa: E731
        monkeypatch.setattr(sandbox._Worker, "read_line", fake)
        results = deep_stack(100, lambda: [sb.run_code("print(1)") for _ in range(3)])
        assert [r.status for r in results] == ["crash"] * 3 and all("unreadable line" in r.error for r in results)
        monkeypatch.undo()
        assert sb.run_code("print(1)").stdout == "1\n" and sb._workers[0].proc.pid != first


def test_a_killed_python_tool_call_counts_as_a_tool_error():
    from rlkit.tools import ToolCall, Tools, python

    tools = Tools([python], sandbox_workers=1)
    try:
        (res,) = tools.call_many([ToolCall("python", {"code": "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"})])
    finally:
        tools.close()
    assert res.error and "killed by SIGKILL" in res.text


@pytest.mark.parametrize("body", ["print('loading', flush=True)", "print('x' * 9000)", "import os; os.write(1, b'{}\\n')"])
def test_a_reward_file_that_prints_at_import_scores_as_usual(tmp_path, body):
    path = tmp_path / "noisy_reward.py"
    path.write_text(
        f"{body}\n\ndef score(data_source, solution_str, ground_truth, extra_info=None):\n    return float(solution_str == ground_truth)\n"
    )
    reward = RewardFn(f"{path}:score")
    try:
        scores, _ = reward(["ds"] * 2, ["1", "2"], ["1", "1"])
    finally:
        reward.close()
    assert scores.tolist() == [1.0, 0.0]


def test_the_read_only_root_covers_sub_mounts(box, outside):
    need(box, "ro-root")
    sub = outside / "sub"  # (mounted before the sandbox starts: its mount namespace is a copy)
    sub.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "none", str(sub)], capture_output=True).returncode != 0:
        pytest.skip("no rights to mount a tmpfs here (a sub-mount is needed)")
    try:
        (sub / "f").write_text("x")
        os.chmod(sub / "f", 0o600)
        with Sandbox(Limits(timeout_s=5)) as sb:
            r = sb.run_code(f"import os\ntry:\n    os.chmod({str(sub / 'f')!r}, 0o777)\nexcept OSError as e:\n    print(e.errno)")
        assert r.stdout == "30\n" and (sub / "f").stat().st_mode & 0o777 == 0o600  # EROFS on a mount under /, too
    finally:
        subprocess.run(["umount", "-l", str(sub)])


def test_sockets_in_the_temp_root_are_hidden_even_when_a_scorer_file_lives_there(tmp_path):
    scorer = tmp_path / "scorer.py"  # a preloaded file in /tmp: its folder once kept the whole temp root visible
    scorer.write_text("def score(x):\n    return x + 1\n")
    path = str(tmp_path / "raylet.sock")
    with socket.socket(socket.AF_UNIX) as server, SandboxPool(Limits(timeout_s=5), preload=[f"{scorer}:score"]) as pool:
        server.bind(path)
        server.listen(1)
        assert pool.call(f"{scorer}:score", 1) == 2  # the file is still there
        r = pool.run_code(f"import socket\nsocket.socket(socket.AF_UNIX).connect({path!r})\nprint('connected')")
    if "pidns" not in pool.layers:
        pytest.skip(f"this machine lacks the pidns layer (it has: {', '.join(pool.layers)})")
    assert "hidden-sockets" in pool.layers and pool.level == "strict"
    assert "FileNotFoundError" in r.stderr and "connected" not in r.stdout


def test_a_job_cannot_fill_the_disk():
    with Sandbox(Limits(timeout_s=10, output_bytes=1 << 16, disk_mb=8)) as sb:
        r = sb.run_code("import os\nfor i in range(100_000):\n    with open(f'f{i}', 'wb') as f:\n        f.write(b'x' * 60_000)")
        if "disk-quota" not in sb.layers:
            assert sb.level != "strict"
            pytest.skip(f"this machine lacks the disk-quota layer (it has: {', '.join(sb.layers)})")
        assert r.exit_code == 1 and "No space left on device" in r.stderr
        r = sb.run_code("import os\nfor i in range(100_000):\n    open(f'f{i}', 'w').close()")
        assert r.exit_code == 1 and "No space left on device" in r.stderr  # 4,096 files at most
        assert sb.run_code("open('f', 'w').write('ok'); print(open('f').read())").stdout == "ok\n"  # each job's files go with it


def test_under_on_error_raise_a_batch_stops_at_its_first_failure():
    reward = RewardFn(f"{FIXTURE}:hanging_score", timeout_s=1.0, sandbox_workers=1)  # on_error="raise"
    start = time.monotonic()
    try:
        with pytest.raises(RunFailed, match="hanging_score failed on sample 0") as info:
            reward(["ds"] * 8, [str(i) for i in range(8)], ["1"] * 8)
    finally:
        reward.close()
    assert time.monotonic() - start < 5 and "\n" not in str(info.value)  # not the 8 s of all eight calls' limits
