"""scripts/uv_args.py: uv gets the package sources pip is configured with (uv reads no pip configuration)."""

import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "uv_args.py"


def uv_args(**pip_env):
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env.update(PIP_CONFIG_FILE=os.devnull, **pip_env)  # no config file: only the variables below count
    return subprocess.run([sys.executable, str(SCRIPT)], env=env, capture_output=True, text=True, check=True).stdout.split()


def test_pip_variables_become_uv_flags_and_missing_local_paths_are_dropped(tmp_path):
    args = uv_args(
        PIP_FIND_LINKS=f"{tmp_path} {tmp_path / 'gone'}",
        PIP_EXTRA_INDEX_URL=f"https://mirror.example/simple file://{tmp_path / 'gone'} file://{tmp_path}",
        PIP_INDEX_URL="https://index.example/simple",
    )
    pairs = list(zip(args[::2], args[1::2]))
    assert sorted(pairs) == sorted(
        [
            ("--find-links", str(tmp_path)),
            ("--extra-index-url", "https://mirror.example/simple"),
            ("--extra-index-url", f"file://{tmp_path}"),
            ("--index-url", "https://index.example/simple"),
        ]
    )


def test_no_configuration_gives_no_flags_and_no_index_passes_through():
    assert uv_args() == []
    assert uv_args(PIP_NO_INDEX="1") == ["--no-index"]
