"""Ray runs in their own processes: a run joins a Ray cluster started separately with `ray start --head`, and a
killed worker ends a run cleanly.

The cluster started here must not touch the Ray of a test running beside it (pytest-xdist): its head keeps its files
in a temp folder of its own (the default one's `ray_current_cluster` file would be found by other drivers), and it is
stopped by killing the processes that carry this test's token, not with `ray stop`, which stops every Ray on the
machine."""

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest

pytest.importorskip("ray")

from test_grpo_recipe import ROOT, read_jsonl  # noqa: E402

from rlkit.ray_group import free_port  # noqa: E402


@pytest.mark.skipif(
    shutil.which("ray") is None and not os.path.exists(os.path.join(os.path.dirname(sys.executable), "ray")),
    reason="the ray command-line tool is not installed",
)
def test_a_run_joins_a_two_node_ray_cluster_started_separately(tmp_path):
    """`ray start --head` plus a second node with `ray start --address`, one CPU each, on this machine: the run's
    two 1-CPU workers cannot share a node, so its FSDP group spans both (rank 0's node hosts the rendezvous)."""
    ray_cli = os.path.join(os.path.dirname(sys.executable), "ray")
    port = free_port()
    token = f"rlkit-test-{os.getpid()}-{port}"
    temp_dir = tempfile.mkdtemp(prefix="rt", dir="/tmp")  # short: Ray's socket paths must stay under 108 bytes
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled", "OMP_NUM_THREADS": "1", "RLKIT_TEST_TOKEN": token}
    env.pop("RAY_ADDRESS", None)
    head = subprocess.run(
        [
            ray_cli,
            "start",
            "--head",
            "--node-ip-address",
            "127.0.0.1",
            "--port",
            str(port),
            "--num-cpus",
            "1",
            "--include-dashboard",
            "false",
            "--disable-usage-stats",
            "--temp-dir",
            temp_dir,
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    try:
        assert head.returncode == 0, head.stderr[-2000:]
        node = subprocess.run(
            [
                ray_cli,
                "start",
                "--address",
                f"127.0.0.1:{port}",
                "--node-ip-address",
                "127.0.0.1",
                "--num-cpus",
                "1",
                "--disable-usage-stats",
            ],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )
        assert node.returncode == 0, node.stderr[-2000:]
        status = subprocess.run(
            [
                sys.executable,
                "-c",
                f"import ray; ray.init(address='127.0.0.1:{port}'); "
                "print(sorted(n['Resources'].get('CPU', 0) for n in ray.nodes() if n['Alive']))",
            ],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )
        assert status.stdout.strip().splitlines()[-1] == "[1.0, 1.0]", status.stdout + status.stderr[-2000:]  # two nodes, 1 CPU each
        out = subprocess.run(
            [
                sys.executable,
                str(ROOT / "recipes/grpo.py"),
                "--trainer.backend",
                "ray",
                "--trainer.n-workers",
                "2",
                "--trainer.ray-address",
                f"127.0.0.1:{port}",
                "--trainer.total-training-steps",
                "2",
                "--data.train-batch-size",
                "8",
                "--actor.ppo-mini-batch-size",
                "8",
                "--rollout.n",
                "4",
                "--data.val-max-samples",
                "16",
                "--trainer.default-local-dir",
                str(tmp_path),
            ],
            capture_output=True,
            text=True,
            env=env,
            timeout=300,
        )
        assert out.returncode == 0, out.stderr[-3000:]
        assert "Connecting to existing Ray cluster" in out.stderr + out.stdout
        assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [0, 1, 2]
        assert (tmp_path / "checkpoints/global_step_2/hf/model.safetensors").is_file()
    finally:
        for pid in _processes_with(token):  # this cluster's processes only (they inherit the token)
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        shutil.rmtree(temp_dir, ignore_errors=True)


KILLER = '''
import os, signal
from pathlib import Path

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """Scores 0; once checkpoint 1 exists, SIGKILLs one policy worker of this run (found by its environment)."""
    if Path(os.environ["RLKIT_TEST_CKPT"]).is_file() and not os.environ.get("RLKIT_TEST_KILLED"):
        os.environ["RLKIT_TEST_KILLED"] = "1"
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                cmd, env = (open(f"/proc/{pid}/{f}", "rb").read() for f in ("cmdline", "environ"))
            except OSError:
                continue
            if cmd.startswith(b"ray::FSDPActorRolloutRefWorker") and os.environ["RLKIT_TEST_TOKEN"].encode() in env:
                os.kill(int(pid), signal.SIGKILL)
                break
    return 0.0
'''


def _processes_with(token: str) -> list[int]:
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if token.encode() in open(f"/proc/{pid}/environ", "rb").read():
                out.append(int(pid))
        except OSError:
            pass
    return out


def test_a_killed_worker_ends_the_run_with_a_clear_error_keeps_the_last_checkpoint_and_stops_ray(tmp_path):
    (tmp_path / "killer.py").write_text(KILLER)
    token = f"rlkit-test-{os.getpid()}-{free_port()}"
    ckpt = tmp_path / "out/checkpoints"
    env = {
        **os.environ,
        "RAY_USAGE_STATS_ENABLED": "0",
        "OMP_NUM_THREADS": "1",
        "RLKIT_TEST_TOKEN": token,
        "RLKIT_TEST_CKPT": str(ckpt / "global_step_1/state.pt"),
    }
    env.pop("RAY_ADDRESS", None)
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "recipes/grpo.py"),
            "--trainer.backend",
            "ray",
            "--trainer.n-workers",
            "2",
            "--trainer.total-training-steps",
            "3",
            "--trainer.save-freq",
            "1",
            "--trainer.no-val-before-train",
            "--trainer.test-freq",
            "0",
            "--data.train-batch-size",
            "8",
            "--actor.ppo-mini-batch-size",
            "8",
            "--rollout.n",
            "4",
            "--reward.custom-fn",
            f"{tmp_path / 'killer.py'}:compute_score",
            "--reward.sandbox",
            "off",  # the function kills a Ray worker from the trainer's process (a sandbox would rightly stop it)
            "--trainer.default-local-dir",
            str(tmp_path / "out"),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert out.returncode == 1, out.stderr[-3000:]
    assert "rlkit: error: a FSDPActorRolloutRefWorker worker died" in out.stderr, out.stderr[-3000:]
    assert "Traceback" not in out.stderr.split("rlkit: error:")[-1]  # one clear line, not a stack dump
    from rlkit import checkpoint

    assert checkpoint.list_checkpoints(ckpt) == [1] and (ckpt / "latest").read_text() == "1"
    assert checkpoint.find_resume_path("auto", ckpt) == ckpt / "global_step_1"
    assert {".metadata", "__0_0.distcp", "__1_0.distcp"} <= {p.name for p in (ckpt / "global_step_1/policy").iterdir()}
    for _ in range(40):  # Ray (and the surviving worker) went down with the run
        if not _processes_with(token):
            break
        time.sleep(0.5)
    assert not _processes_with(token)


def test_a_peer_failing_on_a_dead_worker_is_reported_as_the_death(monkeypatch):
    """Killed mid-step, a worker's death can reach the driver after its peers' collective failed on the lost connection
    (gloo: 'Connection reset by peer'); ray.get raises that peer's error first. The group names the death (RunFailed,
    'worker died'), as it does when the death comes first; a peer's failure with every worker alive stays a failure."""
    import ray

    from rlkit.errors import RunFailed
    from rlkit.ray_group import RayWorkerGroup

    peer = ray.exceptions.RayTaskError("update", "Traceback: Connection reset by peer", RuntimeError("Connection reset by peer"))
    death = ray.exceptions.RayActorError()
    outcome = {"peer": peer, "dead": death}

    def get(refs, timeout=None):
        for ref in refs if isinstance(refs, list) else [refs]:
            if ref in outcome:
                raise outcome[ref]
        return refs

    monkeypatch.setattr(ray, "get", get)
    monkeypatch.setattr(ray, "wait", lambda refs, num_returns, timeout: (list(refs), []))
    group = object.__new__(RayWorkerGroup)
    group.worker_cls, group.timeout_s = type("FSDPActorRolloutRefWorker", (), {}), 60
    with pytest.raises(RunFailed, match="a FSDPActorRolloutRefWorker worker died"):
        group._get(["peer", "dead"])
    with pytest.raises(RuntimeError, match="a FSDPActorRolloutRefWorker worker failed"):
        group._get(["peer", "alive"])
