"""Run model-written text and code away from the trainer: a separate, limited, disposable process.

RL trains a policy to find whatever earns reward, so every response is adversarial input. A scorer that
`eval`s it (several reasoning-gym verifiers), feeds it to sympy, or a tool that runs it as code, runs here::

    pool = SandboxPool(Limits(timeout_s=5), workers=4, preload=["rlkit.tasks:reasoning_gym_score"])
    results = pool.map([{"fn": "rlkit.tasks:reasoning_gym_score", "kwargs": {...}}, ...])   # -> list[Result]
    Sandbox().run_code("print(1 + 1)").stdout == "2\\n"
    Sandbox().call("math:factorial", 5) == 120

How (each layer is probed when a worker starts; `level` says what applied, see docs/sandbox.md):

    trainer --JSON lines--> worker (a fresh `python -E -s`: own session, clean env, temp cwd, rlimits,
                                    no network, dies with the trainer; in PID + mount namespaces it
                                    forks pid 1, which goes on as the worker: own /proc, / read-only
                                    but the temp dir, credentials hidden; no capabilities, Landlock)
                              fork per job --> job child (own process group, CPU limit, nested Landlock)
                            <--JSON lines--  {"status": "ok" | "error" | "timeout" | "crash" | "exit", ...}

The worker is started from a small entry string (no `preexec_fn`: the trainer has threads) and sets
itself up. Each job runs in a fork of the worker, so a job that exits, crashes, hangs or patches the
verifier never affects the next one; the worker kills the job's process group at the wall-clock limit,
and the trainer kills the worker's whole session if the worker itself stops answering; as pid 1 of its
namespace the worker then kills whatever the job left (even in a session of its own). Only JSON
crosses back (never pickle), on an fd no job holds (what preloaded code prints goes to the worker's log): a
script job sends nothing (its exit status and output files are its result); a function's value is parsed in the
worker and again in the trainer, bounded (MAX_DEPTH) and caught, a bad one that call's error. Levels, weakest first:

    process   separate process + session, wall-clock kill, rlimits (CPU, address space, file size,
              open files, core dumps, processes), fresh temp cwd removed after, clean environment,
              dies with its owner (PR_SET_PDEATHSIG)
    network   + no network: a network namespace (unshare), or Landlock TCP rules (Linux >= 6.7)
    strict    + no writes outside the temp dir (Landlock, Linux >= 5.13), no metadata changes outside it
              (chmod, chown, utime, xattrs: / mounted read-only in a mount namespace), the trainer's credential
              files emptied there (SECRETS), other programs' sockets hidden (/run, /dev/shm, the temp root), the
              temp dir a size-capped tmpfs, and no other process in sight (a PID namespace with its own
              /proc: the trainer's environment is unreadable); each of STRICT applied, else it says network

Fork loops are bounded by a pids cgroup where /sys/fs/cgroup/pids is writable, else by RLIMIT_NPROC
(which the kernel ignores for root). Code that escapes a verifier can still lie about its own score:
the sandbox protects the trainer and the machine, not the reward.
"""

from __future__ import annotations

import ctypes
import errno
import json
import logging
import math
import os
import re
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
    """What one job may use. cpu_s defaults to ceil(timeout_s) + 1: a job never burns a core much past its wall-clock limit."""

    timeout_s: float = 10.0
    """wall-clock seconds per job; the job's whole process group is killed after it"""
    cpu_s: int | None = None
    """CPU seconds per job (RLIMIT_CPU); None: ceil(timeout_s) + 1"""
    memory_mb: int = 2048
    """address space of the worker and each job (RLIMIT_AS)"""
    nproc: int = 64
    """processes at once (pids cgroup, or RLIMIT_NPROC when not root)"""
    nofile: int = 64
    """open files (RLIMIT_NOFILE)"""
    output_bytes: int = 1 << 20
    """most bytes kept of a job's result, stdout and stderr each (and RLIMIT_FSIZE)"""
    disk_mb: int = 256
    """the temp dir is a tmpfs of this size and 4,096 files where a mount namespace is allowed (layer disk-quota)"""

    def cpu_seconds(self) -> int:
        """RLIMIT_CPU of a job: cpu_s, else ceil(timeout_s) + 1."""
        return cpu_limit(asdict(self))


def cpu_limit(lim: dict) -> int:
    return int(lim["cpu_s"] or math.ceil(lim["timeout_s"]) + 1)


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
    worker: int | None = None  # the pid (as the trainer sees it) of the worker that ran the job

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
        self.tmp = tempfile.mkdtemp(prefix=f"rlkit-sandbox-{os.getpid()}-")  # the owner's pid: cleaned at start if it died
        self.cgroup = pool._make_cgroup(index)
        cfg = {
            "sys_path": [p or os.getcwd() for p in sys.path],
            "tmp": self.tmp,
            "limits": asdict(pool.limits),
            "preload": pool.preload,
            "warm": pool.warm,
            "cgroup": self.cgroup,
            "network": pool.network,
            "parent": os.getpid(),
            "secrets": secret_paths(),
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
    def map(self, jobs: list[dict], fail_fast: bool = False) -> list[Result | None]:
        """Run jobs in parallel, one Result each in order. A job: {"fn": spec, "args": [...], "kwargs": {...}}
        or {"code": str, "stdin": str | None}. Arguments and return values must be JSON. fail_fast: once a job fails,
        start no more (those not started get None; the running ones finish)."""
        results: list[Result | None] = [None] * len(jobs)
        pending = list(range(len(jobs)))[::-1]
        while len(self._workers) < min(self.n, max(len(jobs), 1)):
            self._spawn()
        t_timeout = self.limits.timeout_s
        while pending or any(w.state == "busy" for w in self._workers):
            if fail_fast and any(r is not None and not r.ok for r in results):
                pending.clear()
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

    def start(self) -> SandboxPool:
        """Start all workers now and wait until each has said which layers applied (level, layers are then set)."""
        while len(self._workers) < self.n:
            self._spawn()
        while starting := [w for w in self._workers if w.state == "starting"]:
            wait = max(min(w.deadline for w in starting) - time.monotonic(), 0.0)
            ready, _, _ = select.select([w.fd for w in starting], [], [], wait)
            for w in [w for w in starting if w.fd in ready]:
                self._on_readable(w, [], [])
            for w in [w for w in starting if w.state == "starting" and time.monotonic() > w.deadline]:
                self._fail_start(w, f"did not start within {self.start_timeout_s:g} s")
        return self

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
        if not self._spawned:
            clean_stale()
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
        msg = parse_message(line)
        if w.state == "starting":
            if msg is None or ("fatal" not in msg and (msg.get("level") not in LEVELS or not isinstance(msg.get("layers"), list))):
                self._fail_start(w, f"sent an unreadable first line ({line[:80]!r})")
            if "fatal" in msg:
                self.close()
                raise RunFailed(msg["fatal"])
            self._on_hello(msg)
            w.state = "idle"
            return
        if msg is None or msg.get("id") != w.job_index or msg.get("status") not in STATUSES:  # not the worker's answer to this job
            results[w.job_index] = Result("crash", error=f"the sandbox worker sent an unreadable line ({line[:80]!r})")
            self._replace(w)
            return
        results[w.job_index] = Result(
            **{k: v for k, v in msg.items() if k in Result.__dataclass_fields__ and k != "worker"}, worker=w.proc.pid
        )
        w.jobs_done += 1
        w.state = "idle"
        if w.jobs_done >= self.max_jobs:
            self._replace(w)

    def _on_hello(self, msg: dict) -> None:
        self.layers, self.level = msg["layers"], msg["level"]
        if LEVELS.index(self.level) < LEVELS.index(self.min_level):
            self.close()
            raise ConfigError(level_error(self.flag, self.min_level, self.level, self.layers))
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


def level_of(layers: list[str], network_allowed: bool = False) -> str:
    """The level (LEVELS) the applied layers add up to; see the module docstring."""
    have = set(layers)
    if not (network_allowed or have & {"netns", "landlock-tcp"}):
        return "process"
    return "strict" if set(STRICT) <= have else "network"


STRICT = ("landlock-fs", "ro-root", "pidns", "hidden-secrets", "hidden-sockets", "disk-quota")  # the layers strict needs
_NEEDS = {  # layer -> what provides it, for the one-line error
    "landlock-fs": "Landlock (Linux >= 5.13)",
    "ro-root": "a mount namespace (root, or unprivileged user namespaces)",
    "pidns": "a PID namespace with its own /proc (root, or unprivileged user namespaces)",
    "hidden-secrets": "mounts over the credential files",
    "hidden-sockets": "a temp root and /run that are not the Python installation or a folder on sys.path",
    "disk-quota": "a tmpfs as the temp dir",
}  # (the last four come with the mount namespace of "ro-root")


def level_error(flag: str, wanted: str, level: str, layers: list[str]) -> str:
    """The one line for a machine that cannot give `wanted`."""
    if wanted == "network" or level == "process":
        missing = "a network namespace or Landlock >= 4" + (" (and for strict: Landlock and namespaces)" if wanted == "strict" else "")
    else:
        missing = " and ".join(v for k, v in _NEEDS.items() if k not in layers)
    return (
        f"{flag} {wanted}: this machine gives only level {level!r} ({', '.join(layers)}); "
        f"it needs {missing}. Lower {flag}, or run where that is allowed (Docker: --security-opt seccomp=unconfined; "
        "Ubuntu >= 23.10: sysctl kernel.apparmor_restrict_unprivileged_userns=0)"
    )


_probed: dict = {}


def probe() -> tuple[str, list[str]]:
    """(level, layers) this machine gives a sandbox worker: one worker started and stopped, once per process."""
    if "level" not in _probed:
        with Sandbox(Limits(timeout_s=5)) as box:
            box.start()
            _probed.update(level=box.level, layers=box.layers)
    return _probed["level"], _probed["layers"]


def check_level(wanted: str, flag: str) -> str:
    """Fail closed before anything is loaded: ConfigError (one line) unless this machine gives `wanted`; the level."""
    if wanted not in LEVELS:
        raise ConfigError(f"{flag} {wanted!r}: choose one of {', '.join(LEVELS)}")
    if wanted == LEVELS[0]:  # any Linux: no worker started to check
        return wanted
    level, layers = probe()
    if LEVELS.index(level) < LEVELS.index(wanted):
        raise ConfigError(level_error(flag, wanted, level, layers))
    return level


def start_clause(cfg) -> str:
    """The run's start line says how model-written text is contained: "sandbox level strict", or why nothing runs there."""
    reward = getattr(cfg.system, "reward", None)  # (recipes/rm.py, sft.py-free of scorers: none)
    reward = reward.sandbox if reward is not None else "off"
    tools = str(getattr(getattr(cfg, "agent", None), "tools", ""))
    if reward == "off" and "python" not in tools:
        return "sandbox off (scorers run in this process)"
    try:
        level, layers = probe()
    except (RunFailed, OSError, ConfigError) as e:  # said again, as an error, where a pool starts
        return f"sandbox unavailable ({str(e)[:80]})"
    missing = [x for x in STRICT if x not in layers] if level == "network" else []  # what strict would add (docs/sandbox.md)
    return (
        f"sandbox level {level}"
        + (f" (without {', '.join(missing)})" if missing else "")
        + (" (scorers in this process: --reward.sandbox off)" if reward == "off" else "")
    )


_STALE = re.compile(r"rlkit-sandbox-(\d+)-")


def _dead(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        pass
    return False


def clean_stale(tmp_root: str | None = None, cgroup_root: str = "/sys/fs/cgroup/pids") -> list[str]:
    """Remove the temp dirs and pids cgroups of pools whose owner died without closing them (a SIGKILLed trainer);
    the owner's pid is in their names, and those of a live owner are left alone. Returns what was removed."""
    removed = []
    tmp_root = tmp_root or tempfile.gettempdir()
    for root, is_cgroup in ((tmp_root, False), (cgroup_root, True)):
        try:
            names = os.listdir(root)
        except OSError:
            continue
        for name in names:
            m = _STALE.match(name)
            if not m or not _dead(int(m.group(1))):
                continue
            path = os.path.join(root, name)
            if is_cgroup:
                try:
                    with open(os.path.join(path, "cgroup.procs")) as f:
                        for pid in f.read().split():  # leftovers of the dead owner's jobs
                            try:
                                os.kill(int(pid), signal.SIGKILL)
                            except OSError:
                                pass
                    for _ in range(50):
                        try:
                            os.rmdir(path)
                            break
                        except OSError:
                            time.sleep(0.01)
                except OSError:
                    continue
            else:
                shutil.rmtree(path, ignore_errors=True)
            if not os.path.exists(path):
                removed.append(path)
    return removed


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


MAX_DEPTH = 64  # a job's value nested deeper (lists and dicts) is an error: json's C parser recurses (~1000 levels raise)


def depth(obj) -> int:
    """How deep lists and dicts nest in obj (0 for a scalar), without recursion; stops counting past MAX_DEPTH."""
    deepest, todo = 0, [(obj, 1)]
    while todo and deepest <= MAX_DEPTH:
        o, d = todo.pop()
        if isinstance(o, (list, dict)):
            deepest = max(deepest, d)
            todo += [(v, d + 1) for v in (o.values() if isinstance(o, dict) else o)]
    return deepest


def parse_message(data: bytes) -> dict | None:
    """A JSON object from a pipe, or None when it is not one or nests over MAX_DEPTH (never raises)."""
    try:
        msg = json.loads(data)
    except (ValueError, RecursionError):
        return None
    return msg if isinstance(msg, dict) and depth(msg) <= MAX_DEPTH else None


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


_CLONE_NEWNS, _CLONE_NEWPID = 0x00020000, 0x20000000
_MS_NOSUID, _MS_NODEV, _MS_NOEXEC, _MS_BIND, _MS_REC, _MS_PRIVATE = 2, 4, 8, 0x1000, 0x4000, 0x40000
_MOUNT_ATTR_RDONLY, _AT_RECURSIVE, _AT_FDCWD = 1, 0x8000, -100


def die_with_parent(parent_alive) -> None:
    """PR_SET_PDEATHSIG(SIGKILL): the kernel kills this process when its parent ends; and end now if it already has
    (it may have died before the call). parent_alive() is checked after the call, so there is no gap."""
    _libc().prctl(1, signal.SIGKILL, 0, 0, 0)
    if not parent_alive():
        os._exit(0)


def _mount_setattr(path: str, set_: int, clear: int) -> bool:
    """mount_setattr(2) (Linux >= 5.12) on the mount at `path` and every mount under it."""
    attr = ctypes.create_string_buffer(struct.pack("QQQQ", set_, clear, 0, 0), 32)
    rc = _libc().syscall(
        ctypes.c_long(442), ctypes.c_int(_AT_FDCWD), path.encode(), ctypes.c_uint(_AT_RECURSIVE), attr, ctypes.c_size_t(32)
    )
    return rc == 0


# Credential files and folders under the trainer's home, emptied in the sandbox's mount namespace (readable otherwise).
SECRETS = (
    ".ssh", ".netrc", ".git-credentials", ".aws", ".azure", ".config/gcloud", ".config/wandb", ".config/gh", ".docker", ".kube",
    ".kaggle", ".pypirc", ".npmrc", ".huggingface", ".cache/huggingface/token", ".cache/huggingface/stored_tokens", ".env",
    ".ray/auth_token",
)  # fmt: skip


def secret_paths() -> list[str]:
    """The trainer's credential files: SECRETS under its home, $HF_HOME's tokens, $HF_TOKEN_PATH, and the .env file of
    the working directory and each folder above it."""
    home, hf = os.path.expanduser("~"), os.environ.get("HF_HOME", "")
    paths = [os.path.join(home, rel) for rel in SECRETS] + [os.environ.get("HF_TOKEN_PATH", "")]
    paths += [os.path.join(hf, name) for name in ("token", "stored_tokens") if hf]
    d = os.getcwd()
    while True:
        paths.append(os.path.join(d, ".env"))
        if d == os.path.dirname(d):
            return [p for p in paths if p]
        d = os.path.dirname(d)


def _hide_secrets(paths: list[str]) -> bool:
    """Mount an empty read-only tmpfs over each such folder and /dev/null over each such file; True if all went."""
    libc = _libc()
    for path in paths:
        if os.path.isdir(path):
            rc = libc.mount(b"tmpfs", path.encode(), b"tmpfs", 1 | _MS_NOSUID | _MS_NODEV | _MS_NOEXEC, b"size=4k,mode=000")
        elif os.path.exists(path):
            rc = libc.mount(b"/dev/null", path.encode(), None, _MS_BIND, None)
        else:
            continue
        if rc != 0:
            return False
    return True


def _hide_sockets(tmp: str, keep: list[str]) -> bool:
    """Empty tmpfs over /run, /dev/shm and the temp root holding `tmp`, with `tmp` and every path of `keep` under them
    (the Python installation, sys.path, scorer files) bound back in: the unix sockets and shared memory of other
    programs there (Ray's raylet, object store and logs, docker.sock, dbus) are out of reach. True if it applied to
    all three (a folder that is itself a path of `keep` cannot be hidden)."""
    libc, done, folders = _libc(), 0, [d for d in ("/run", "/dev/shm", os.path.dirname(tmp)) if os.path.isdir(d)]
    for d in folders:
        inside = sorted({p for p in (tmp, *keep) if (p == d or p.startswith(d + "/")) and os.path.exists(p)})
        inside = [p for p in inside if not any(p.startswith(q + "/") for q in inside)]  # a folder brings what is under it
        if d == "/" or d in inside:
            continue
        fds = [(p, os.open(p, os.O_PATH)) for p in inside]
        try:
            if libc.mount(b"tmpfs", d.encode(), b"tmpfs", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC, b"size=64k,mode=755") != 0:
                continue
            for p, fd in fds:  # a mount point in the empty tmpfs, then the original bound onto it
                os.makedirs(os.path.dirname(p), exist_ok=True)
                os.mkdir(p) if os.path.isdir(f"/proc/self/fd/{fd}") else open(p, "w").close()
                if libc.mount(f"/proc/self/fd/{fd}".encode(), p.encode(), None, _MS_BIND | _MS_REC, None) != 0:
                    raise OSError(f"cannot bind {p} back")
            done += 1
        finally:
            for _, fd in fds:
                os.close(fd)
    return done == len(folders)


def _private_pids_and_mounts(tmp: str, secrets: list[str], keep: list[str], disk_mb: int) -> list[str]:
    """A PID namespace and a mount namespace: this process forks the namespace's first process (pid 1, which goes on
    as the worker) and only waits for it. There /proc is mounted afresh (only the namespace's processes: the
    trainer's /proc/<pid>/environ is out of reach), and every mount is read-only but the temp dir (no chmod, chown,
    utime, xattrs or writes anywhere else), the temp dir a tmpfs of disk_mb MiB and 4,096 files. When pid 1 ends, the
    kernel kills every process left in the namespace. The trainer's credential files (`secrets`) are emptied. Returns
    the layers that applied (pidns, hidden-secrets, hidden-sockets, disk-quota, ro-root; [] without namespaces)."""
    libc = _libc()
    if libc.unshare(_CLONE_NEWNS | _CLONE_NEWPID) != 0:
        return []
    r, w = os.pipe()
    pid = os.fork()
    if pid:  # the outer process: keep nothing the trainer reads (it sees EOF when pid 1 ends), wait, end with it
        os.close(r)
        os.closerange(0, 2)
        os.closerange(3, w)  # (the channel back too)
        os.closerange(w + 1, 1 << 16)
        _, status = os.waitpid(pid, 0)
        os._exit(os.waitstatus_to_exitcode(status) & 0x7F)
    os.close(w)
    die_with_parent(lambda: not select.select([r], [], [], 0)[0])  # the pipe reads EOF once the outer process is gone
    os.close(r)
    layers = []
    if libc.mount(b"none", b"/", None, _MS_REC | _MS_PRIVATE, None) != 0:
        return layers
    if libc.mount(b"proc", b"/proc", b"proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC, None) == 0:
        layers.append("pidns")
    if _hide_secrets(secrets):
        layers.append("hidden-secrets")
    if "pidns" in layers and _hide_sockets(tmp, keep):  # (needs the fresh /proc to bind the kept paths back)
        layers.append("hidden-sockets")
    t = tmp.encode()
    if libc.mount(b"tmpfs", t, b"tmpfs", _MS_NOSUID | _MS_NODEV, f"size={disk_mb}m,nr_inodes=4096,mode=700".encode()) == 0:
        os.chdir(tmp)
        layers.append("disk-quota")
    if (
        ("disk-quota" in layers or libc.mount(t, t, None, _MS_BIND | _MS_REC, None) == 0)
        and _mount_setattr("/", _MOUNT_ATTR_RDONLY, 0)
        and _mount_setattr(tmp, 0, _MOUNT_ATTR_RDONLY)
    ):
        layers.append("ro-root")
    return layers


def _drop_capabilities() -> bool:
    """No capabilities, now or after an exec (root keeps its uid, not its powers: no mount, no ptrace, no
    CAP_DAC_OVERRIDE); True if it applied."""
    libc = _libc()
    for cap in range(64):  # the bounding set (needs CAP_SETPCAP, so before the capset below)
        if libc.prctl(24, cap, 0, 0, 0) != 0 and ctypes.get_errno() == errno.EINVAL:  # PR_CAPBSET_DROP
            break
    libc.prctl(47, 4, 0, 0, 0)  # PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL
    header = ctypes.create_string_buffer(struct.pack("Ii", 0x20080522, 0), 8)  # _LINUX_CAPABILITY_VERSION_3, this process
    return libc.capset(header, ctypes.create_string_buffer(24)) == 0


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
    die_with_parent(lambda: os.getppid() == cfg["parent"])  # a SIGKILLed trainer takes its workers (and their jobs) along
    _libc().prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE 0: a job without CAP_SYS_PTRACE cannot open /proc/<worker>/fd/*
    out = os.fdopen(os.dup(1), "w")  # the channel back, on an fd no job keeps; what anything prints goes to the log
    os.dup2(2, 1)
    layers = ["process", "session", "clean-env", "temp-dir", "dies-with-parent"]
    fatal = lambda e: json.dumps({"fatal": f"sandbox worker setup failed: {type(e).__name__}: {e}"})  # noqa: E731
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
        files = [spec.rpartition(":")[0] for spec in cfg["preload"] if spec.rpartition(":")[0].endswith(".py")]
        keep = [os.path.realpath(p) for p in (sys.executable, sys.prefix, sys.base_prefix, *cfg["sys_path"], *files) if p]
        disk_mb = cfg["limits"]["disk_mb"]
        layers += _private_pids_and_mounts(cfg["tmp"], cfg["secrets"], keep, disk_mb)  # from here on this may be pid 1 of a PID namespace
    except Exception as e:
        out.write(fatal(e) + "\n")
        out.flush()
        return
    try:
        layers += _set_limits(cfg["limits"])
        if _drop_capabilities():
            layers.append("no-caps")
        layers += landlock_restrict([cfg["tmp"]])
    except Exception as e:
        out.write(fatal(e) + "\n")
        out.flush()
        return
    level = level_of(layers, cfg["network"])
    out.write(json.dumps({"layers": layers, "level": level}) + "\n")
    out.flush()
    nested_landlock = "landlock-fs" in layers
    for line in sys.stdin:
        job = json.loads(line)
        result = _run_job(job, cfg, nested_landlock)
        out.write(json.dumps({"id": job["id"], **result}, default=str) + "\n")
        out.flush()


def _run_job(job: dict, cfg: dict, nested_landlock: bool) -> dict:
    """Fork, run the job in the child, collect its result within the wall-clock limit."""
    lim = cfg["limits"]
    jobdir = tempfile.mkdtemp(dir=cfg["tmp"])
    r, w = os.pipe()
    start, me = time.monotonic(), os.getpid()
    pid = os.fork()
    if pid == 0:  # the job child: never returns
        os.close(r)
        _job_child(job, jobdir, w, lim, nested_landlock, me)
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
        data += chunk if "fn" in job else b""  # what a script writes there is not read
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
    if os.getpid() == 1:  # pid 1 of the sandbox's PID namespace: whatever the job left (even in its own session) goes
        _kill_the_rest()
    seconds = time.monotonic() - start
    stdout, stderr = (_read_capped(os.path.join(jobdir, name), lim["output_bytes"]) for name in ("stdout", "stderr"))
    shutil.rmtree(jobdir, ignore_errors=True)
    out = {"stdout": stdout, "stderr": stderr, "seconds": seconds}
    if timed_out:
        return {**out, "status": "timeout", "error": f"no result after {lim['timeout_s']:g} s (wall clock)"}
    if overflow:
        return {**out, "status": "error", "error": f"the result is over {lim['output_bytes']} bytes"}
    msg = parse_message(data) if data else None
    if data and msg is None:  # (only a function's job sends data)
        return {**out, "status": "error", "error": f"the result is not a JSON object nested at most {MAX_DEPTH} deep"}
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


def _kill_the_rest() -> None:
    """As pid 1 of a PID namespace: SIGKILL every other process in it and reap them (orphans are ours to reap)."""
    if all(not d.isdigit() or d == "1" for d in os.listdir("/proc")):  # (this /proc shows only the namespace) nothing left
        return
    try:
        os.kill(-1, signal.SIGKILL)
    except OSError:
        pass
    while True:
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            return


def _read_capped(path: str, limit: int) -> str:
    try:
        with open(path, "rb") as f:
            return f.read(limit).decode(errors="replace")
    except OSError:
        return ""


def _job_child(job: dict, jobdir: str, w: int, lim: dict, nested_landlock: bool, worker: int) -> None:
    import resource

    code = 0
    try:
        die_with_parent(lambda: os.getppid() == worker)  # the job dies with its worker (a dead one changes getppid)
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
            if fd:  # 64 KiB kept for the output (FALLOC_FL_KEEP_SIZE): a job that fills the disk quota still says so
                _libc().fallocate(new, 1, ctypes.c_long(0), ctypes.c_long(min(lim["output_bytes"], 1 << 16)))
            os.dup2(new, fd)
            os.close(new)
        os.closerange(3, w)  # the worker's channel and anything else inherited
        os.closerange(w + 1, 1 << 16)
        sys.stdin, sys.stdout, sys.stderr = (open(i, m, closefd=False) for i, m in ((0, "r"), (1, "w"), (2, "w")))
        cpu = cpu_limit(lim)
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
        if nested_landlock:  # a domain of its own: it cannot signal or ptrace the worker
            landlock_restrict([jobdir])
        me = os.getpid()
        if "code" in job:  # nothing sent back: the worker reads the exit status and the output files (and waits for EOF on w)
            try:
                exec(compile(job["code"], "<sandbox>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            except BaseException:
                import traceback

                traceback.print_exc()
                code = 1
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
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
