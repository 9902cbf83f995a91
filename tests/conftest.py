"""Test-session settings shared by every test file.

The README's test command runs the suite on two processes (pytest-xdist `-n 2 --dist loadfile`: each test file
runs whole on one process, so a file's module fixtures are built once). Files are handed out in collection order
(pytest-xdist's own reordering, by test count, is turned off below), so the long ones go first: a long file started
last leaves the other process idle at the end (measured: the default-run learning test alone for the last ~80 s).
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # the tests import the demo builders as scripts.assets (scripts/assets/)
    sys.path.insert(0, str(ROOT))

LONG_FIRST = (  # the files with the longest tests (`pytest --durations=40`), longest first
    "test_off_policy.py",
    "test_vllm_rollout.py",
    "test_agent.py",
    "test_gpu_check_rows.py",
    "test_learning.py",
    "test_fsdp.py",
    "test_megatron.py",
    "test_ray_cluster.py",
    "test_reward_model.py",
    "test_opd.py",
    "test_vlm.py",
    "test_sampler.py",
    "test_vllm_vlm.py",
)


def pytest_configure(config):
    # pytest-xdist (>= 3.6) hands out files by their number of tests, most first, unless told to keep this order:
    # measured, the long Ray files then ran last, one process idle for minutes at the end.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(LONG_FIRST)}
    items.sort(key=lambda item: rank.get(Path(str(item.fspath)).name, len(LONG_FIRST)))  # stable: order kept within a file
