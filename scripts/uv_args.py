"""Print, one per line, the uv arguments that give `uv pip install` the package sources pip is configured with.

uv does not read pip's configuration files or PIP_* variables, so without this a machine whose pip is set up to
use a mirror, a local index or a folder of wheels would send uv to PyPI. Read by scripts/install.sh. pip's
precedence: an environment variable beats the `install` section, which beats `global`; a local path that does
not exist is skipped (pip only warns about it, uv would stop).
"""

import os
import subprocess
import sys

OPTIONS = {  # pip option -> uv flag (given once per value)
    "index-url": "--index-url",
    "extra-index-url": "--extra-index-url",
    "find-links": "--find-links",
    "constraint": "--constraint",
}
RANK = {":env:": 2, "install": 1, "global": 0}


def exists(value: str) -> bool:
    path = value[len("file://") :] if value.startswith("file://") else value
    return "://" in value and not value.startswith("file://") or os.path.exists(path)


def main() -> None:
    out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
    best: dict[str, tuple[int, str]] = {}
    for line in out.splitlines():
        key, _, value = line.partition("=")
        section, _, option = key.rpartition(".")
        option = option.replace("_", "-")
        if option in OPTIONS or option == "no-index":
            rank = RANK.get(section, 0)
            if option not in best or rank >= best[option][0]:
                best[option] = (rank, value.strip().strip("'\""))
    for option, (_, value) in best.items():
        if option == "no-index":
            if value.lower() in ("1", "true", "yes", "on"):
                print("--no-index")
            continue
        for v in value.split():
            if exists(v):
                print(OPTIONS[option])
                print(v)


if __name__ == "__main__":
    main()
