"""The size of rlkit/, layer by layer: the markdown table README.md shows (issue #35: "lines per layer").

    python scripts/core_size.py              # print the table
    python scripts/core_size.py --write      # put it in README.md, between the core-size marker comments
    python scripts/core_size.py --rev 6e1e236   # the totals of rlkit/ at a git revision (the README's "before")

What is counted: the code lines of each rlkit/*.py module -- every physical line that holds a Python token other
than a comment, so blank lines, comment-only lines and docstrings (the string that opens a module, class or
function) are left out; a line of code with a comment after it counts, and so does every line of a multi-line
expression or of a string that is not a docstring.

Every rlkit module sits in exactly one layer of LAYERS: a module in none, or in two, is an error (place a new
module before it can be measured). A name in LAYERS with no module beside it (one that left the package, or is
still to come) is skipped.
"""

from __future__ import annotations

import argparse
import ast
import io
import subprocess
import sys
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
BEGIN, END = "<!-- core-size:begin (python scripts/core_size.py --write) -->", "<!-- core-size:end -->"

LAYERS = {
    "core": (  # the algorithm and the loop: what one recipe on one device needs
        "__init__ protocol algos loop recipe config data rewards engine workers rollout checkpoint tracking errors models"
    ).split(),
    "scale-out": "ray_group placement fsdp_workers megatron_workers megatron_shims vllm_rollout async_rollout ulysses".split(),
    "features": (
        "agent tools envs sandbox judge vlm moe packing reward_model evaluation tasks preflight userfn demos "
        "embedded embedded_guess embedded_judge embedded_tools embedded_vlm"
    ).split(),
}

SKIP = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER}


def code_lines(source: str) -> int:
    """The lines of `source` holding a token other than a comment, less the docstrings' lines."""
    docs = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                docs.update(range(first.lineno, first.end_lineno + 1))
    lines = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type not in SKIP:
            lines.update(range(tok.start[0], tok.end[0] + 1))
    return len(lines - docs)


def layer_of() -> dict[str, str]:
    """module -> its layer; a module named in two layers is an error."""
    out = {}
    for layer, modules in LAYERS.items():
        for m in modules:
            if m in out:
                raise SystemExit(f"scripts/core_size.py: {m} is in two layers ({out[m]}, {layer}); keep it in one")
            out[m] = layer
    return out


def sizes(sources: dict[str, str]) -> dict[str, dict[str, int]]:
    """layer -> {module: code lines}, every module placed (a module in no layer is an error)."""
    where = layer_of()
    unplaced = sorted(set(sources) - set(where))
    if unplaced:
        raise SystemExit(f"scripts/core_size.py: rlkit/{unplaced[0]}.py is in no layer; add it to one in LAYERS ({', '.join(LAYERS)})")
    out = {layer: {} for layer in LAYERS}
    for name, text in sources.items():
        out[where[name]][name] = code_lines(text)
    return out


def table(sources: dict[str, str]) -> str:
    """The markdown table: layer | modules (each with its code lines, largest first) | lines, and the total."""
    rows = ["| layer | modules | code lines |", "|---|---|---:|"]
    total = 0
    for layer, modules in sizes(sources).items():
        listed = ", ".join(f"`{m}` {n:,}" for m, n in sorted(modules.items(), key=lambda kv: (-kv[1], kv[0])))
        rows.append(f"| {layer} | {listed} | {sum(modules.values()):,} |")
        total += sum(modules.values())
    rows.append(f"| total | {len(sources)} modules | {total:,} |")
    return "\n".join(rows)


def current_sources() -> dict[str, str]:
    return {p.stem: p.read_text() for p in sorted((ROOT / "rlkit").glob("*.py"))}


def rev_sources(rev: str) -> dict[str, str]:
    """rlkit/*.py at a git revision, read with git show."""
    names = subprocess.run(["git", "ls-tree", "--name-only", rev, "rlkit/"], cwd=ROOT, capture_output=True, text=True, check=True)
    paths = [p for p in names.stdout.split() if p.endswith(".py")]
    return {
        Path(p).stem: subprocess.run(["git", "show", f"{rev}:{p}"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
        for p in paths
    }


def with_table(readme: str, block: str) -> str:
    """README's text with `block` between the markers (which must be there, once each)."""
    if readme.count(BEGIN) != 1 or readme.count(END) != 1:
        raise SystemExit(f"README.md: no single {BEGIN} ... {END} pair to write the table between")
    head, rest = readme.split(BEGIN)
    return f"{head}{BEGIN}\n{block}\n{END}{rest.split(END, 1)[1]}"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--write", action="store_true", help="write the table into README.md between its marker comments")
    p.add_argument("--rev", help="print the totals of rlkit/*.py at this git revision (code lines, and wc -l) instead")
    args = p.parse_args(argv)
    if args.rev:
        src = rev_sources(args.rev)
        wc = sum(text.count("\n") for text in src.values())
        print(f"{args.rev}: {len(src)} modules, {sum(map(code_lines, src.values())):,} code lines ({wc:,} by wc -l)")
        return
    block = table(current_sources())
    if args.write:
        README.write_text(with_table(README.read_text(), block))
        print(f"README.md: table written ({block.splitlines()[-1]})")
    else:
        print(block)


if __name__ == "__main__":
    sys.exit(main())
