"""Run model-written text and code away from the trainer: a separate, limited, disposable process.

RL trains a policy to find whatever earns reward, so every response is adversarial input. A scorer that
`eval`s it (several reasoning-gym verifiers), feeds it to sympy, or a tool that runs it as code, runs here::

    pool = SandboxPool(Limits(timeout_s=5), workers=4, preload=["rlkit.tasks:reasoning_gym_score"])
    results = pool.map([{"fn": "rlkit.tasks:reasoning_gym_score", "kwargs": {...}}, ...])   # -> list[Result]
    Sandbox().run_code("print(1 + 1)").stdout == "2\\n"
    Sandbox().call("math:factorial", 5) == 120

How (each layer is probed when a worker starts; `level` says what applied, see docs/sandbox.md):

    trainer --JSON lines--> worker (a fresh `python -E -s`: own session, clean env, temp cwd, rlimits,
                                    no network, no writes outside its temp dir)
                              fork per job --> job child (own process group, CPU limit, nested Landlock)
                            <--JSON lines--  {"status": "ok" | "error" | "timeout" | "crash" | "exit", ...}

The worker is started from a small entry string (no `preexec_fn`: the trainer has threads) and sets
itself up. Each job runs in a fork of the worker, so a job that exits, crashes, hangs or patches the
verifier never affects the next one; the worker kills the job's process group at the wall-clock limit,
and the trainer kills the worker's whole session if the worker itself stops answering. Only JSON
crosses back (never pickle). Levels, weakest first:

    process   separate process + session, wall-clock kill, rlimits (CPU, address space, file size,
              open files, core dumps, processes), fresh temp cwd removed after, clean environment
    network   + no network: a network namespace (unshare), or Landlock TCP rules (Linux >= 6.7)
    strict    + no writes outside the temp dir (Landlock, Linux >= 5.13)

Fork loops are bounded by a pids cgroup where /sys/fs/cgroup/pids is writable, else by RLIMIT_NPROC
(which the kernel ignores for root). Code that escapes a verifier can still lie about its own score:
the sandbox protects the trainer and the machine, not the reward.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import select
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
import weakref
from dataclasses import asdict, dataclass

from rlkit.errors import ConfigError, RunFailed

logger = logging.getLogger(__name__)

LEVELS = ("process", "network", "strict")
STATUSES = ("ok", "error", "timeout", "crash", "exit")
_BOOT = "import sys, json; cfg = json.loads(sys.stdin.readline()); sys.path[:] = cfg['sys_path']; import rlkit.sandbox as s; s._worker_main(cfg)"
_logged_level: set[str] = set()


@dataclass
class Limits:
    """What one job may use. cpu_s defaults to int(timeout_s) + 1."""

    timeout_s: float = 10.0
    """wall-clock seconds per job; the job's whole process group is killed after it"""
    cpu_s: int | None = None
    """CPU seconds per job (RLIMIT_CPU)"""
    memory_mb: int = 2048
    """address space of the worker and each job (RLIMIT_AS)"""
    nproc: int = 64
    """processes at once (pids cgroup, or RLIMIT_NPROC when not root)"""
    nofile: int = 64
    """open files (RLIMIT_NOFILE)"""
    output_bytes: int = 1 << 20
    """most bytes kept of a job's result, stdout and stderr each (and RLIMIT_FSIZE)"""


@dataclass
class Result:
    """What came back from one job. status: ok | error (it raised) | timeout | crash (killed by a signal) | exit (ended early)."""

    status: str
    value: object = None
    error: str = ""
    exit_code: int | None = None
    stdout: str = ""
    stderr: str = ""
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def timed_out(self) -> bool:
        return self.status == "timeout"


class SandboxFailure(RuntimeError):
    """A sandboxed call did not return a value; `.result` says why."""

    def __init__(self, result: Result):
        super().__init__(f"{result.status}: {result.error}")
        self.result = result


def function_spec(fn) -> str:
    """'module:qualname' a worker can import, or 'path/file.py:name' for functions of files loaded by path."""
    if isinstance(fn, str):
        return fn
    module = sys.modules.get(getattr(fn, "__module__", None) or "")
    name = getattr(fn, "__qualname__", "")
    if module is None or not name or "<" in name:
        raise ConfigError(f"{fn!r} cannot run in the sandbox: pass a module-level function (or a 'path.py:name' string)")
    file = getattr(module, "__file__", None)
    if module.__name__ == "__main__" or module.__name__.startswith("rlkit_custom_"):
        if not file:
            raise ConfigError(f"{fn!r} is defined interactively; put it in a file and pass 'path.py:{name}'")
        return f"{os.path.abspath(file)}:{name}"
    return f"{module.__name__}:{name}"


def _resolve(spec: str):
    """Import the function named by a spec, in the worker."""
    location, _, name = spec.rpartition(":")
    if location.endswith(".py") or "/" in location:
        from rlkit.userfn import load_function

        return load_function(spec)
    import importlib

    obj = importlib.import_module(location)
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


# ----------------------------------------------------------------------------- the pool (trainer side)


class _Worker:
    def __init__(self, pool: SandboxPool, index: int):
        self.tmp = tempfile.mkdtemp(prefix="rlkit-sandbox-")
        self.cgroup = pool._make_cgroup(index)
        cfg = {
            "sys_path": [p or os.getcwd() for p in sys.path],
            "tmp": self.tmp,
            "limits": asdict(pool.limits),
            "preload": pool.preload,
            "warm": pool.warm,
            "cgroup": self.cgroup,
            "network": pool.network,
        }
        env = {
            "PATH": "/usr/local/bin:/usr/bin:/bin",
            "HOME": self.tmp,
            "TMPDIR": self.tmp,
            "LANG": "C.UTF-8",
            **{k: "1" for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")},
        }
        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(
            [sys.executable, "-E", "-s", "-c", _BOOT],
            stdin=-1,
            stdout=-1,
            stderr=self.log,
            cwd=self.tmp,
            env=env,
            start_new_session=True,  # setsid in the child before exec (no preexec_fn)
            close_fds=True,
        )
        self.proc.stdin.write((json.dumps(cfg) + "\n").encode())
        self.proc.stdin.flush()
        self.fd = self.proc.stdout.fileno()
        self.buf = b""
        self.state, self.deadline = "starting", time.monotonic() + pool.start_timeout_s
        self.job_index, self.jobs_done, self.hello = None, 0, None

    def send(self, job: dict, index: int, timeout_s: float) -> None:
        self.proc.stdin.write((json.dumps(job, default=_jsonable) + "\n").encode())
        self.proc.stdin.flush()
        self.state, self.job_index, self.deadline = "busy", index, time.monotonic() + timeout_s + 5.0

    def read_line(self, limit: int) -> bytes | None:
        """A complete line if one arrived, b'' on EOF or overflow, None if more is coming."""
        if b"\n" not in self.buf:
            chunk = os.read(self.fd, 1 << 16)
            if not chunk:
                return b""
            self.buf += chunk
            if len(self.buf) > limit:
                return b""
        if b"\n" not in self.buf:
            return None
        line, self.buf = self.buf.split(b"\n", 1)
        return line

    def stderr_tail(self) -> str:
        self.log.seek(0)
        return self.log.read()[-2000:].decode(errors="replace").strip()

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout, self.log):
            try:
                f.close()
            except OSError:
                pass
        shutil.rmtree(self.tmp, ignore_errors=True)
        if self.cgroup:
            for _ in range(50):  # the kernel frees the group a moment after its last process
                try:
                    os.rmdir(self.cgroup)
                    break
                except OSError:
                    time.sleep(0.01)


def _close_all(workers: list) -> None:
    for w in workers:
        w.kill()
    workers.clear()


class SandboxPool:
    """`workers` sandboxed processes running jobs in parallel; see the module docstring.

    preload: functions each worker imports at start; warm: jobs ({"fn", "args", "kwargs"}, trusted input only) each
    worker runs once at start, so that what they cache (a parsed task, a lazy import) is there in every job's fork.
    min_level: refuse (ConfigError) to run below this isolation level. max_jobs: recycle a worker after
    this many jobs (fresh=True: after every job, one new process per call). network=False denies it.
    """

    def __init__(
        self,
        limits: Limits | None = None,
        workers: int = 1,
        preload: list[str] | tuple = (),
        warm: list[dict] | tuple = (),
        min_level: str = "process",
        max_jobs: int = 1000,
        fresh: bool = False,
        network: bool = False,
        flag: str = "--reward.sandbox-level",
        start_timeout_s: float = 120.0,
    ):
        if min_level not in LEVELS:
            raise ConfigError(f"{flag} {min_level!r}: choose one of {', '.join(LEVELS)}")
        if sys.platform != "linux":
            raise ConfigError(f"the sandbox needs Linux (this is {sys.platform}); run scorers in-process with --reward.sandbox off")
        self.limits, self.n, self.preload = limits or Limits(), max(int(workers), 1), [function_spec(p) for p in preload]
        self.warm = json.loads(json.dumps(list(warm), default=_jsonable))
        self.min_level, self.max_jobs, self.network, self.flag = min_level, 1 if fresh else max(max_jobs, 1), network, flag
        self.start_timeout_s = start_timeout_s
        self.level, self.layers = None, []
        self._workers: list[_Worker] = []
        self._finalizer = weakref.finalize(self, _close_all, self._workers)
        self._spawned = 0

    # -- public API ------------------------------------------------------------------------------
    def map(self, jobs: list[dict]) -> list[Result]:
        """Run jobs in parallel, one Result each in order. A job: {"fn": spec, "args": [...], "kwargs": {...}}
        or {"code": str, "stdin": str | None}. Arguments and return values must be JSON."""
        results: list[Result | None] = [None] * len(jobs)
        pending = list(range(len(jobs)))[::-1]
        while len(self._workers) < min(self.n, max(len(jobs), 1)):
            self._spawn()
        t_timeout = self.limits.timeout_s
        while pending or any(w.state == "busy" for w in self._workers):
            for w in [w for w in self._workers if w.state == "idle" and w.proc.poll() is not None]:
                self._replace(w)  # died between jobs (killed from outside): its successor takes the next job
            for w in list(self._workers):
                if w.state == "idle" and pending:
                    i = pending.pop()
                    w.send({"id": i, **jobs[i]}, i, t_timeout)
            waiting = [w for w in self._workers if w.state in ("busy", "starting")]
            if not waiting:
                break
            wait = max(min(w.deadline for w in waiting) - time.monotonic(), 0.0)
            ready, _, _ = select.select([w.fd for w in waiting], [], [], wait)
            for w in [w for w in waiting if w.fd in ready]:
                self._on_readable(w, results, pending)
            now = time.monotonic()
            for w in [w for w in list(self._workers) if w.state in ("busy", "starting") and now > w.deadline]:
                if w.state == "starting":
                    self._fail_start(w, f"did not start within {self.start_timeout_s:g} s")
                results[w.job_index] = Result("timeout", error=f"no answer from the sandbox worker after {t_timeout:g} s")
                self._replace(w)
        return results

    def call(self, fn, *args, **kwargs):
        """fn(*args, **kwargs) in a sandboxed process; its value, or SandboxFailure."""
        result = self.map([{"fn": function_spec(fn), "args": list(args), "kwargs": kwargs}])[0]
        if not result.ok:
            raise SandboxFailure(result)
        return result.value

    def run_code(self, code: str, stdin: str | None = None) -> Result:
        """Run Python source as a script (`__name__ == "__main__"`): exit_code, stdout, stderr, status."""
        return self.map([{"code": code, "stdin": stdin}])[0]

    def close(self) -> None:
        self._finalizer()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- internals -------------------------------------------------------------------------------
    def _spawn(self) -> _Worker:
        w = _Worker(self, self._spawned)
        self._spawned += 1
        self._workers.append(w)
        return w

    def _replace(self, w: _Worker) -> None:
        self._workers.remove(w)
        w.kill()
        self._spawn()

    def _fail_start(self, w: _Worker, why: str) -> None:
        tail = w.stderr_tail()
        self.close()
        raise RunFailed(f"a sandbox worker {why}" + (f": {tail.splitlines()[-1]}" if tail else ""))

    def _on_readable(self, w: _Worker, results: list, pending: list) -> None:
        line = w.read_line(self.limits.output_bytes * 3 + 65536)
        if line is None:
            return
        if line == b"":  # the worker died (or flooded its channel): its job failed, a new worker takes its place
            if w.state == "starting":
                self._fail_start(w, "exited while starting")
            code = w.proc.poll()
            results[w.job_index] = Result("crash", error=f"the sandbox worker died (status {code})")
            self._replace(w)
            return
        msg = json.loads(line)
        if w.state == "starting":
            if "fatal" in msg:
                self.close()
                raise RunFailed(msg["fatal"])
            self._on_hello(msg)
            w.state = "idle"
            return
        results[w.job_index] = Result(**{k: v for k, v in msg.items() if k in Result.__dataclass_fields__})
        w.jobs_done += 1
        w.state = "idle"
        if w.jobs_done >= self.max_jobs:
            self._replace(w)

    def _on_hello(self, msg: dict) -> None:
        self.layers, self.level = msg["layers"], msg["level"]
        if LEVELS.index(self.level) < LEVELS.index(self.min_level):
            self.close()
            missing = {"network": "a network namespace or Landlock >= 4", "strict": "Landlock (Linux >= 5.13)"}[self.min_level]
            raise ConfigError(
                f"{self.flag} {self.min_level}: this machine gives only level {self.level!r} ({', '.join(self.layers)}); "
                f"it needs {missing}. Lower {self.flag}, or run where that is allowed"
            )
        if self.level not in _logged_level:
            _logged_level.add(self.level)
            logger.info("sandbox level %s: %s", self.level, ", ".join(self.layers))

    def _make_cgroup(self, index: int) -> str | None:
        root = "/sys/fs/cgroup/pids"
        if not os.access(root, os.W_OK):
            return None
        path = f"{root}/rlkit-sandbox-{os.getpid()}-{index}"
        try:
            os.mkdir(path)
            with open(f"{path}/pids.max", "w") as f:
                f.write(str(self.limits.nproc))
        except OSError:
            return None
        return path


class Sandbox(SandboxPool):
    """One sandboxed worker: `Sandbox(limits).run_code(code)`, `.call(fn, *args)`."""

    def __init__(self, limits: Limits | None = None, **kwargs):
        super().__init__(limits, workers=1, **kwargs)


def _jsonable(obj):
    """numpy / torch scalars and arrays -> Python numbers and lists (anything else is an error)."""
    if hasattr(obj, "tolist"):
        return obj.tolist()
    if hasattr(obj, "item"):
        return obj.item()
    raise TypeError(f"a {type(obj).__name__} is not JSON")


# ----------------------------------------------------------------------------- the worker (sandbox side)

# Landlock (linux/landlock.h): filesystem rights that change something, network and scope bits.
_LL_WRITE = sum(1 << b for b in (1, 4, 5, 6, 7, 8, 9, 10, 11, 12))  # write file, remove dir/file, make char/dir/reg/sock/fifo/block/sym
_LL_REFER, _LL_TRUNCATE, _LL_WRITE_FILE = 1 << 13, 1 << 14, 1 << 1


def _libc():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    return libc


def landlock_abi() -> int:
    """The kernel's Landlock ABI version (0 = none)."""
    try:
        return max(int(_libc().syscall(ctypes.c_long(444), None, ctypes.c_long(0), ctypes.c_long(1))), 0)
    except (OSError, AttributeError):
        return 0


def landlock_restrict(write_dirs: list[str]) -> list[str]:
    """Deny writes outside write_dirs (and /dev/null), TCP bind/connect (ABI >= 4), signals and abstract unix
    sockets out of this process's domain (ABI >= 6). Returns the layers that applied ([] if none)."""
    abi = landlock_abi()
    if abi < 1:
        return []
    libc = _libc()
    fs = _LL_WRITE | (_LL_REFER if abi >= 2 else 0) | (_LL_TRUNCATE if abi >= 3 else 0)
    net = 0b11 if abi >= 4 else 0
    scoped = 0b11 if abi >= 6 else 0
    size = 8 if abi < 4 else 16 if abi < 6 else 24
    attr = ctypes.create_string_buffer(struct.pack("QQQ", fs, net, scoped)[:size], size)
    ruleset = libc.syscall(ctypes.c_long(444), attr, ctypes.c_long(size), ctypes.c_long(0))
    if ruleset < 0:
        return []
    try:
        rules = [(d, fs, os.O_DIRECTORY) for d in write_dirs] + [("/dev/null", _LL_WRITE_FILE | (fs & _LL_TRUNCATE), 0)]
        for path, rights, flags in rules:
            fd = os.open(path, os.O_PATH | flags)
            rule = ctypes.create_string_buffer(struct.pack("=Qi", rights, fd), 12)
            rc = libc.syscall(ctypes.c_long(445), ctypes.c_long(ruleset), ctypes.c_long(1), rule, ctypes.c_long(0))
            os.close(fd)
            if rc < 0:
                return []
        libc.prctl(38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS: required by Landlock without CAP_SYS_ADMIN
        if libc.syscall(ctypes.c_long(446), ctypes.c_long(ruleset), ctypes.c_long(0)) < 0:
            return []
    finally:
        os.close(ruleset)
    return ["landlock-fs"] + (["landlock-tcp"] if net else []) + (["landlock-scope"] if scoped else [])


def _unshare_net() -> bool:
    """A private network namespace (only a down loopback): as root directly, else inside a user namespace."""
    libc = _libc()
    if libc.unshare(0x40000000) == 0:  # CLONE_NEWNET
        return True
    return libc.unshare(0x10000000 | 0x40000000) == 0  # CLONE_NEWUSER | CLONE_NEWNET


def _set_limits(lim: dict) -> list[str]:
    import resource

    def cap(which, value):
        soft, hard = resource.getrlimit(which)
        value = value if hard == resource.RLIM_INFINITY else min(value, hard)
        resource.setrlimit(which, (value, value))

    cap(resource.RLIMIT_AS, lim["memory_mb"] << 20)
    cap(resource.RLIMIT_FSIZE, lim["output_bytes"] + 4096)
    cap(resource.RLIMIT_NOFILE, lim["nofile"])
    cap(resource.RLIMIT_CORE, 0)
    layers = ["rlimits"]
    if os.getuid() != 0:  # the kernel does not apply RLIMIT_NPROC to root
        cap(resource.RLIMIT_NPROC, lim["nproc"] + len(os.listdir("/proc/self/task")))
        layers.append("nproc-rlimit")
    return layers


def _on_alarm(signum, frame):
    raise TimeoutError("warm-up call over the time limit")


def _worker_main(cfg: dict) -> None:
    """Entry point of a worker process (started by _BOOT): set up, say hello, then run jobs until stdin ends."""
    sys.dont_write_bytecode = True
    out = os.fdopen(os.dup(1), "w")  # the channel back; fds 0/1 are taken away from jobs
    layers = ["process", "session", "clean-env", "temp-dir"]
    try:
        if cfg["cgroup"]:
            with open(f"{cfg['cgroup']}/cgroup.procs", "w") as f:
                f.write(str(os.getpid()))
            layers.append("pids-cgroup")
        network = not cfg["network"] and _unshare_net()
        if network:
            layers.append("netns")
        for spec in cfg["preload"]:  # imports happen once, here, before the restrictions
            _resolve(spec)
        signal.signal(signal.SIGALRM, _on_alarm)
        for job in cfg["warm"]:  # trusted calls that fill the functions' caches, inherited by every job's fork
            signal.setitimer(signal.ITIMER_REAL, cfg["limits"]["timeout_s"])
            try:
                _resolve(job["fn"])(*job.get("args", ()), **job.get("kwargs", {}))
            except Exception:
                pass
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
        layers += _set_limits(cfg["limits"])
        layers += landlock_restrict([cfg["tmp"]])
    except Exception as e:
        out.write(json.dumps({"fatal": f"sandbox worker setup failed: {type(e).__name__}: {e}"}) + "\n")
        out.flush()
        return
    net_ok = "netns" in layers or "landlock-tcp" in layers or cfg["network"]
    level = "strict" if net_ok and "landlock-fs" in layers else "network" if net_ok else "process"
    out.write(json.dumps({"layers": layers, "level": level}) + "\n")
    out.flush()
    nested_landlock = "landlock-fs" in layers
    for line in sys.stdin:
        job = json.loads(line)
        result = _run_job(job, cfg, nested_landlock)
        out.write(json.dumps(result, default=str) + "\n")
        out.flush()


def _run_job(job: dict, cfg: dict, nested_landlock: bool) -> dict:
    """Fork, run the job in the child, collect its result within the wall-clock limit."""
    lim = cfg["limits"]
    jobdir = tempfile.mkdtemp(dir=cfg["tmp"])
    r, w = os.pipe()
    start = time.monotonic()
    pid = os.fork()
    if pid == 0:  # the job child: never returns
        os.close(r)
        _job_child(job, jobdir, w, lim, nested_landlock)
    os.close(w)
    data, timed_out, overflow = b"", False, False
    deadline = start + lim["timeout_s"]
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            timed_out = True
            break
        ready, _, _ = select.select([r], [], [], left)
        if not ready:
            continue
        chunk = os.read(r, 1 << 16)
        if not chunk:
            break
        data += chunk
        if len(data) > lim["output_bytes"]:
            overflow = True
            break
    os.close(r)
    for target in (lambda: os.killpg(pid, signal.SIGKILL), lambda: os.kill(pid, signal.SIGKILL)):
        try:
            target()  # the job's group: it and anything it started (unless they made their own session)
        except (ProcessLookupError, PermissionError):
            pass
    _, status = os.waitpid(pid, 0)
    seconds = time.monotonic() - start
    stdout, stderr = (_read_capped(os.path.join(jobdir, name), lim["output_bytes"]) for name in ("stdout", "stderr"))
    shutil.rmtree(jobdir, ignore_errors=True)
    out = {"stdout": stdout, "stderr": stderr, "seconds": seconds}
    if timed_out:
        return {**out, "status": "timeout", "error": f"no result after {lim['timeout_s']:g} s (wall clock)"}
    if overflow:
        return {**out, "status": "error", "error": f"the result is over {lim['output_bytes']} bytes"}
    try:
        msg = json.loads(data) if data else None
    except json.JSONDecodeError:
        msg = None
    if isinstance(msg, dict) and msg.get("status") in ("ok", "error"):
        return {**out, **{k: msg[k] for k in ("status", "value", "error", "exit_code") if k in msg}}
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        if sig == signal.SIGXCPU:
            return {**out, "status": "timeout", "error": "over the CPU-time limit"}
        return {**out, "status": "crash", "error": f"killed by {signal.Signals(sig).name}"}
    code = os.WEXITSTATUS(status)
    if "code" in job:  # a script that ends with os._exit(n) still ended: its exit code is the result
        return {**out, "status": "ok", "exit_code": code}
    return {**out, "status": "exit", "exit_code": code, "error": f"the process exited with status {code} without returning a value"}


def _read_capped(path: str, limit: int) -> str:
    try:
        with open(path, "rb") as f:
            return f.read(limit).decode(errors="replace")
    except OSError:
        return ""


def _job_child(job: dict, jobdir: str, w: int, lim: dict, nested_landlock: bool) -> None:
    import resource

    code = 0
    try:
        os.setpgid(0, 0)
        os.chdir(jobdir)
        stdin_path = os.path.join(jobdir, "stdin")
        with open(stdin_path, "w") as f:
            f.write(job.get("stdin") or "")
        for fd, path, mode in (
            (0, stdin_path, os.O_RDONLY),
            (1, "stdout", os.O_WRONLY | os.O_CREAT),
            (2, "stderr", os.O_WRONLY | os.O_CREAT),
        ):
            new = os.open(path, mode, 0o600)
            os.dup2(new, fd)
            os.close(new)
        os.closerange(3, w)  # the worker's channel and anything else inherited
        os.closerange(w + 1, 1 << 16)
        sys.stdin, sys.stdout, sys.stderr = (open(i, m, closefd=False) for i, m in ((0, "r"), (1, "w"), (2, "w")))
        cpu = lim["cpu_s"] or int(lim["timeout_s"]) + 1
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
        if nested_landlock:  # a domain of its own: it cannot signal or ptrace the worker
            landlock_restrict([jobdir])
        me = os.getpid()
        if "code" in job:
            try:
                exec(compile(job["code"], "<sandbox>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
                msg = {"status": "ok", "exit_code": 0}
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
                msg = {"status": "ok", "exit_code": code}
            except BaseException:
                import traceback

                traceback.print_exc()
                msg = {"status": "ok", "exit_code": 1}
        else:
            try:
                value = _resolve(job["fn"])(*job.get("args", ()), **job.get("kwargs", {}))
                msg = {"status": "ok", "value": json.loads(json.dumps(value, default=_jsonable))}
            except SystemExit as e:
                msg = {"status": "error", "error": f"called sys.exit({e.code!r})"}
            except BaseException as e:
                msg = {"status": "error", "error": f"{type(e).__name__}: {str(e)[:500]}"}
        sys.stdout.flush()
        sys.stderr.flush()
        if os.getpid() != me:  # a process the job forked: only the job itself answers
            os._exit(code)
        data = json.dumps(msg).encode()
        while data:
            data = data[os.write(w, data) :]
    except BaseException:
        code = 70
    os._exit(code)
