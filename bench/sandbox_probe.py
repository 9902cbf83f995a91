"""What the sandbox contains on THIS machine: each attack run as a sandboxed job, a table of what it got, and the cost.

    python bench/sandbox_probe.py          # prints the level, its layers, one row per attack, and the job costs

An attack is contained when the job's output lacks what it prints (or reads) only when the attack worked. Not a test: the same attacks with assertions are in tests/test_sandbox.py.
"""

from __future__ import annotations

import os
import shutil
import socket
import statistics
import tempfile
import time

from rlkit.sandbox import Limits, Sandbox

ATTACKS = [  # (attack, code run in the sandbox, what its output holds only if the attack worked)
    ("read the trainer's environment (/proc/<pid>/environ)", "print(open('/proc/TRAINER_PID/environ').read())", "TRAINER_VAR"),
    (
        "see other processes (/proc)",
        "import os\nprint('seen' if 'TRAINER_PID' in os.listdir('/proc') else sorted(os.listdir('/proc'))[:3])",
        "seen",
    ),
    (
        "list the trainer's ~/.ssh (when there is one)",
        "import os\nos.listdir(os.path.expanduser('TRAINER_HOME/.ssh'))\nprint('listed')",
        "listed",
    ),
    ("write outside the temp dir", "open('OUTSIDE/x', 'w').write('x')\nprint('written')", "written"),
    (
        "chmod / utime outside the temp dir",
        "import os\nos.chmod('OUTSIDE', 0o777)\nos.utime('OUTSIDE', (0, 0))\nprint('changed')",
        "changed",
    ),
    ("TCP to 127.0.0.1", "import socket\nsocket.create_connection(('127.0.0.1', PORT), timeout=1)\nprint('connected')", "connected"),
    ("UDP out", "import socket\nsocket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b'x', ('1.1.1.1', 53))\nprint('sent')", "sent"),
    (
        "connect to a unix socket file elsewhere (home, project)",
        "import socket\nsocket.socket(socket.AF_UNIX).connect('OUTSIDE/s.sock')\nprint('connected')",
        "connected",
    ),
    (
        "connect to a unix socket file in /tmp (as Ray's)",
        "import socket\nsocket.socket(socket.AF_UNIX).connect('UNIX_PATH')\nprint('connected')",
        "connected",
    ),
    ("signal the trainer", "import os\nos.kill(TRAINER_PID, 0)\nprint('reached')", "reached"),
    (
        "umount /proc, unshare (undo the namespaces)",
        "import ctypes\nlibc = ctypes.CDLL(None)\nprint('undone' if 0 in (libc.umount2(b'/proc', 2), libc.unshare(0x20000)) else 'no')",
        "undone",
    ),
    (
        "fork 1000 processes",
        "import os, time\nfor i in range(1000):\n    if os.fork() == 0:\n        time.sleep(5)\n        os._exit(0)\nprint('forked 1000')",
        "forked",
    ),
    ("allocate 4 GiB", "x = bytearray(4 << 30)\nprint('allocated')", "allocated"),
    ("read world-readable files (/etc/passwd, code, checkpoints)", "print(open('/etc/passwd').read()[:20])", "root:"),
    (
        "fill the disk from its own temp dir (400 files of 1 MiB; the quota is 256 MiB)",
        "for i in range(400):\n    open(f'f{i}', 'wb').write(b'x' * (1 << 20))\n    if i % 100 == 99:\n        print(f'wrote {i + 1} MiB', flush=True)",
        "wrote 300",
    ),
]


def main() -> None:
    outside = tempfile.mkdtemp(prefix=".rlkit-probe-", dir=os.path.expanduser("~"))  # not under /tmp (hidden there)
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    unix_path = os.path.join(tempfile.mkdtemp(prefix="rlkit-probe-"), "raylet.sock")  # where Ray keeps its sockets
    unix = socket.socket(socket.AF_UNIX)
    unix.bind(unix_path)
    unix.listen(1)
    unix2 = socket.socket(socket.AF_UNIX)
    unix2.bind(os.path.join(outside, "s.sock"))
    unix2.listen(1)
    subs = {"OUTSIDE": outside, "PORT": str(server.getsockname()[1]), "UNIX_PATH": unix_path, "TRAINER_PID": str(os.getpid())}
    subs["TRAINER_HOME"] = os.path.expanduser("~")
    clean = ("PATH", "HOME", "TMPDIR", "LANG", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
    own = [v for v in open("/proc/self/environ", "rb").read().decode(errors="replace").split("\0") if v and v.split("=")[0] not in clean]
    subs["TRAINER_VAR"] = own[0].split("=")[0] + "=" if own else "no-such-var"  # a variable only the trainer has
    with Sandbox(Limits(timeout_s=3, memory_mb=512, nproc=32)) as box:
        box.run_code("pass")  # started
        print(f"level {box.level}: {', '.join(box.layers)}\n")
        print("| attack | contained | what the job got |\n|---|---|---|")
        for name, code, mark in ATTACKS:
            for k, v in subs.items():
                code = code.replace(k, v)
            r = box.run_code(code)
            out = (r.stdout + r.stderr).strip()
            got = out.splitlines()[-1][:90] if out else r.status
            for k, v in subs.items():
                mark = mark.replace(k, v)
            print(f"| {name} | {'NO' if mark in out else 'yes'} | `{got.replace('|', '/')}` |")
        times = []
        for _ in range(100):
            t = time.perf_counter()
            box.call("math:factorial", 3)
            times.append(time.perf_counter() - t)
    t = time.perf_counter()
    with Sandbox(Limits(timeout_s=3)) as box:
        box.run_code("pass")  # started
    for d in (outside, os.path.dirname(unix_path)):
        shutil.rmtree(d, ignore_errors=True)
    print(
        f"\nworker start {1e3 * (time.perf_counter() - t):.0f} ms; one trivial job: median {1e3 * statistics.median(times):.1f} ms, ",
        end="",
    )
    print(f"p90 {1e3 * sorted(times)[89]:.1f} ms; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")


if __name__ == "__main__":
    main()
