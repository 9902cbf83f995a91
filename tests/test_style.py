"""The code base is formatted and linted with ruff (configured in pyproject.toml), and rlkit/ has no import cycle."""

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def ruff() -> list[str]:
    exe = shutil.which("ruff") or str(Path(sys.executable).with_name("ruff"))
    if not Path(exe).exists():
        pytest.skip("ruff is not installed: pip install -e '.[dev]'")
    return [exe]


@pytest.mark.parametrize("args", [["check", "."], ["format", "--check", "."]])
def test_ruff(args):
    out = subprocess.run(ruff() + args, cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, (
        f"ruff {' '.join(args)} found problems (run `ruff {args[0]} --fix .` / `ruff format .`):\n{out.stdout}{out.stderr}"
    )


def rlkit_imports(path: Path) -> set[str]:
    """The rlkit modules a file imports anywhere in it (module level or inside functions)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[1] for a in node.names if a.name.startswith("rlkit.")}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "rlkit":  # from rlkit import algos, recipe
                out |= {a.name for a in node.names}
            elif node.module.startswith("rlkit."):
                out.add(node.module.split(".")[1])
    return out


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle of the directed graph as a list of nodes (first == last), or None."""
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    path: list[str] = []

    def visit(node):
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_find_cycle_sees_a_function_level_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_rlkit_import_graph_has_no_cycle():
    files = {p.stem: p for p in (ROOT / "rlkit").glob("*.py")}
    graph = {name: rlkit_imports(path) & set(files) - {name} for name, path in files.items()}
    assert graph["placement"] >= {"workers"} and "fsdp_workers" in rlkit_imports(files["placement"])  # the parser sees lazy imports
    assert find_cycle(graph) is None, f"import cycle in rlkit/: {' -> '.join(find_cycle(graph))}"
