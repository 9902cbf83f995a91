"""README.md's size table is scripts/core_size.py's output for the code as it is; the counting rule on a hand-counted
source; every module in exactly one layer; the "before" line's numbers are the script's for that revision."""

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def load():
    if "core_size" not in sys.modules:
        spec = importlib.util.spec_from_file_location("core_size", ROOT / "scripts" / "core_size.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod
        spec.loader.exec_module(mod)
    return sys.modules["core_size"]


def test_readme_table_is_the_scripts_output():
    cs = load()
    readme = (ROOT / "README.md").read_text()
    assert readme.count(cs.BEGIN) == 1 and readme.count(cs.END) == 1, f"README.md: the markers {cs.BEGIN} / {cs.END} are gone"
    shown = readme.split(cs.BEGIN)[1].split(cs.END)[0].strip()
    assert shown == cs.table(cs.current_sources()), (
        "README.md's size table (between the core-size markers) is not what the code measures now: run python scripts/core_size.py --write"
    )


SOURCE = '''"""A module docstring
over two lines."""

import os  # a comment after code: counted

# a comment line


def f(x):
    """One-line docstring."""
    s = """a string that is
    not a docstring"""
    return (x,
            s)


class C:
    """Doc."""

    y = 1
'''


def test_code_lines_leave_out_docstrings_comments_and_blank_lines():
    # counted: import os; def f; s = """...; not a docstring"""; return (x,; s); class C; y = 1 -> 8
    assert load().code_lines(SOURCE) == 8
    assert load().code_lines("") == 0


def test_every_module_in_exactly_one_layer(monkeypatch):
    cs = load()
    with pytest.raises(SystemExit, match=r"rlkit/brand_new\.py is in no layer; add it to one in LAYERS"):
        cs.sizes({"algos": "x = 1\n", "brand_new": "y = 2\n"})
    monkeypatch.setitem(cs.LAYERS, "scale-out", [*cs.LAYERS["scale-out"], "algos"])
    with pytest.raises(SystemExit, match=r"algos is in two layers \(core, scale-out\)"):
        cs.sizes({"algos": "x = 1\n"})
    monkeypatch.undo()
    sizes = cs.sizes({"algos": "x = 1\n", "vllm_rollout": "a = 1\nb = 2\n"})  # a LAYERS name with no module: skipped
    assert sizes == {"core": {"algos": 1}, "scale-out": {"vllm_rollout": 2}, "features": {}}


def test_the_before_line_is_the_scripts_count_at_that_revision():
    cs = load()
    m = re.search(r"at (\w+)\) rlkit/ held (\d+) modules: ([\d,]+) by this count, ([\d,]+)\s+by `wc -l`", (ROOT / "README.md").read_text())
    assert m, "README.md: the line 'Before issue #35 (..., at REV) rlkit/ held N modules: A by this count, B by `wc -l`' is gone"
    rev, modules, code, wc = m[1], int(m[2]), int(m[3].replace(",", "")), int(m[4].replace(",", ""))
    if subprocess.run(["git", "cat-file", "-e", f"{rev}^{{commit}}"], cwd=ROOT, capture_output=True).returncode != 0:
        pytest.skip(f"{rev} is not in this clone (a shallow one)")
    src = cs.rev_sources(rev)
    assert (len(src), sum(map(cs.code_lines, src.values())), sum(t.count("\n") for t in src.values())) == (modules, code, wc)
