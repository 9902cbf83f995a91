"""Docs that check themselves: what README.md and docs/*.md say about the code is tested against the code.

The conventions a doc follows (each failure message repeats the one it broke):

- A fenced snippet that quotes a project file names it in its info string: ```python file=recipes/grpo.py
  (any language; GitHub shows only the language). Its lines must appear in that file consecutively, as they are,
  except for one common leading indentation (a snippet may be dedented). An elision line -- one whose text starts
  with `...` or `# ...` -- marks the snippet abridged, visibly: the pieces between elisions must each appear, in
  order. A ```python fence that quotes no file says so: ```python example (user code, not checked against a file).
  `ruff format` formats python fences in markdown at rlkit's 140 columns, which would rejoin a recipe's 100-column
  lines: a quote sits between `<!-- fmt:off -->` and `<!-- fmt:on -->` lines.
- A ```bash snippet's `python recipes/X.py` / `python -m rlkit.X` / `bench/X.py` / `scripts/X.sh` paths exist
  (a `cp recipes/A.py recipes/B.py` in the same doc makes B stand for A), and each `--flag` of a recipe command
  is in that recipe's `--help` (a bench or scripts/ Python command's in the script's argparse; a tyro script's in its
  `--help`). A `--section.flag` named anywhere in the docs is in some recipe's `--help`.
- The text beside the code is held to the same: a recipe's module docstring (its `python ...` commands as a bash
  snippet's, the `--flags` its prose names in its own --help, and an `outputs/<recipe>/checkpoints/global_step_N` path
  one that the default run writes, derived from the code in default_checkpoints; the docs' such paths too), the asset
  READMEs (rlkit/assets/*/README.md: the `python X.py` / `python -m Y` they name exist), and the test files' module
  docstrings (the recipes/bench/scripts paths and `--section.flag`s they name exist).
- A recipe's page (docs/<recipe>.md; docs/agents.md for grpo_tools.py) opens with the sections What, Run, The formula
  beside the code, Flags, Metrics, Results, in this order. Its Flags table rows (`| `--flag` | default | meaning |`)
  name options of the recipe with their Config defaults, and every top-level option of the recipe's own; its Metrics
  section names every key the recipe logs beyond grpo.py's; its Results hold the `python recipes/<recipe>.py` command.
  Every mention of the default run's end point is results.md's number; a `file.md#anchor` link finds its heading.
- No "N lines" claim (N >= 2) unless DERIVED_LINE_COUNTS computes it; count words that drift are in COUNT_CLAIMS.
- Every metric key a recipe logs is named in docs/metrics.md or a doc it links, by its full name (`a/b/c`; in a
  list `a/b/c`, `/d` is short for `a/b/d`); `<name>` stands for an open set (a scorer's own keys), never for a key
  the code spells out. Every `timing/...` named in a doc is a timer the code creates.
- README.md's "What is in the box" table names every rlkit/*.py module and every recipe; `algos.x`, `recipe.X`,
  `TorchEngine.x` in a doc's code spans name things the code has.

Speed: the recipes' --help are rendered in-process once each (cached); the metric keys come from one tiny step of
each recipe (8 training prompts, no validation) in one module-scoped fixture, and a scan of the code's literal keys.
"""

import ast
import contextlib
import functools
import io
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
RECIPES = sorted(p.stem for p in (ROOT / "recipes").glob("*.py"))
RL_RECIPES = [r for r in RECIPES if r not in ("sft", "rm")]  # the claims about "every recipe" below count the RL ones (sft, rm: no rollout)
NUMBER_WORDS = "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen".split()

FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<ticks>```+)(?P<info>[^`]*)$")


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


@functools.cache
def fences(doc: Path) -> list[tuple[int, str, list[str]]]:
    """(line number of the opening fence, info string, body lines) of every fenced block of a markdown file."""
    out, lines, i = [], doc.read_text().splitlines(), 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if m:
            start, indent, ticks = i + 1, len(m["indent"]), m["ticks"]
            body, i = [], i + 1
            while i < len(lines) and lines[i].strip() != ticks:
                body.append(lines[i][indent:] if lines[i][:indent].isspace() else lines[i])
                i += 1
            out.append((start, m["info"].strip(), body))
        i += 1
    return out


def info_fields(info: str) -> tuple[str, dict[str, str], set[str]]:
    """'python file=recipes/grpo.py example' -> ('python', {'file': 'recipes/grpo.py'}, {'example'})."""
    words = info.split()
    lang = words[0] if words and "=" not in words[0] else ""
    rest = words[1:] if lang else words
    return lang, dict(w.split("=", 1) for w in rest if "=" in w), {w for w in rest if "=" not in w}


def snippets():
    for doc in DOCS:
        for start, info, body in fences(doc):
            yield pytest.param(doc, start, info, body, id=f"{rel(doc)}:{start}")


# --------------------------------------------------------------------------------------------------------------
# 1. Quoted snippets are in the files they quote
# --------------------------------------------------------------------------------------------------------------

ELISION = re.compile(r"^\s*(#\s*)?\.\.\.")


def pieces(body: list[str]) -> list[list[str]]:
    """The snippet split at its elision lines, each piece stripped of blank lines at its ends."""
    out, cur = [], []
    for line in body + ["..."]:
        if ELISION.match(line):
            while cur and not cur[0].strip():
                cur.pop(0)
            while cur and not cur[-1].strip():
                cur.pop()
            if cur:
                out.append(cur)
            cur = []
        else:
            cur.append(line)
    return out


def find_piece(piece: list[str], lines: list[str], start: int) -> int:
    """Index of the first file line (>= start) where `piece` appears, each of its lines shifted by one common
    indentation (the snippet's own indentation relative to its first line is kept exactly); -1 if nowhere."""
    base = min(len(p) - len(p.lstrip()) for p in piece if p.strip())
    piece = [p[base:] if p.strip() else "" for p in piece]
    for i in range(start, len(lines) - len(piece) + 1):
        first = lines[i]
        if not first.strip() or not first.endswith(piece[0]) or first[: len(first) - len(piece[0])].strip():
            continue
        indent = first[: len(first) - len(piece[0])]
        if all((not p and not f.strip()) or (p and f == indent + p) for p, f in zip(piece, lines[i : i + len(piece)])):
            return i
    return -1


def closest_line(line: str, lines: list[str]) -> str:
    import difflib

    best = difflib.get_close_matches(line.strip(), [x.strip() for x in lines], n=1, cutoff=0.6)
    return best[0] if best else "(nothing close)"


@pytest.mark.parametrize("doc, start, info, body", list(snippets()))
def test_a_quoted_snippet_is_in_the_file_it_names(doc, start, info, body):
    lang, fields, flags = info_fields(info)
    where = f"{rel(doc)}:{start} (```{info})"
    if "file" not in fields:
        if lang == "python":
            assert "example" in flags, (
                f"{where}: a python snippet must name the file it quotes (```python file=PATH) or say it quotes none (```python example)"
            )
            if "..." not in "\n".join(body):
                ast.parse("\n".join(body))  # an example is at least Python
        return
    path = ROOT / fields["file"]
    assert path.is_file(), f"{where}: names {fields['file']}, which does not exist"
    lines = path.read_text().splitlines()
    at = 0
    for n, piece in enumerate(pieces(body)):
        found = find_piece(piece, lines, at)
        if found < 0:
            k = max(k for k in range(len(piece)) if k == 0 or find_piece(piece[:k], lines, at) >= 0)  # longest prefix found
            there = find_piece(piece[:k], lines, at) + k if k else -1
            file_has = (
                f"{fields['file']}:{there + 1} has {lines[there].strip()!r}"
                if 0 <= there < len(lines)
                else (f"closest line in the file: {closest_line(piece[0], lines)!r}")
            )
            raise AssertionError(
                f"{where}: piece {n + 1} of the snippet (line {k + 1} of the piece, {piece[k].strip()!r}) is not in "
                f"{fields['file']} as quoted (searched from line {at + 1}); {file_has}. "
                "Copy the current lines from the file, or abridge the snippet with a `# ...` line (and keep the fence "
                "between <!-- fmt:off --> and <!-- fmt:on --> lines, or ruff format rewraps it)"
            )
        at = found + len(piece)


def test_the_quote_checker_sees_a_changed_line_and_accepts_elisions():
    lines = ["def f(x):", "    a = 1", "    b = 2", "", "    return a + b"]
    assert find_piece(["a = 1", "b = 2"], lines, 0) == 1  # dedented
    assert find_piece(["a = 1", "b = 3"], lines, 0) == -1  # a changed line
    assert find_piece(["a = 1", "  b = 2"], lines, 0) == -1  # relative indentation kept
    assert find_piece(["b = 2", "", "return a + b"], lines, 0) == 2
    assert [len(p) for p in pieces(["a = 1", "# ... the rest", "return a + b"])] == [1, 1]
    assert find_piece(["return a + b"], lines, 2) == 4 and find_piece(["a = 1"], lines, 2) == -1  # in order


# --------------------------------------------------------------------------------------------------------------
# 2. Shell commands: paths exist, flags are the recipe's
# --------------------------------------------------------------------------------------------------------------


@functools.cache
def load_recipe(name: str):
    sys.path.insert(0, str(ROOT / "tests"))
    from test_grpo_recipe import load_recipe as load

    return load(name)


@functools.cache
def recipe_flags(name: str) -> frozenset[str]:
    """Every `--flag` of `python recipes/<name>.py --help`: the script run as __main__ in this process (imports cached)."""
    import runpy
    from unittest import mock

    path, out = ROOT / (name if name.endswith(".py") else f"recipes/{name}.py"), io.StringIO()  # or a tyro script's path
    with mock.patch.object(sys, "argv", [str(path), "--help"]), mock.patch.dict("os.environ", {"COLUMNS": "200"}):
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out), pytest.raises(SystemExit):
            runpy.run_path(str(path), run_name="__main__")
    from collections import Counter

    found = Counter(re.findall(r"(--[a-z0-9][\w.-]*)", out.getvalue()))
    found -= Counter(re.findall(r"(--[a-z0-9][\w.-]*)", module_docstring(path)[1] and "\n".join(module_docstring(path)[1])))
    flags = set(found)  # the options, not the description above them (the docstring, checked on its own)
    assert len(flags) > 20, out.getvalue()[:2000]
    flags.add("--help")
    if "--model.path" in flags:
        flags.add("--model")  # recipe.expand_aliases: --model X is --model.path X
    return frozenset(flags)


def commands(body: list[str]) -> list[tuple[int, list[str]]]:
    """(offset of its first line, tokens) of each shell command of a ```bash block: `\\` continues a line, `#` starts
    a comment, `&&` / `||` / `;` separate commands."""
    out, joined, first = [], "", None
    for k, line in enumerate(body + [""]):
        line = re.sub(r"(^|\s)#.*$", "", line)
        if first is None and line.strip():
            first = k
        if line.rstrip().endswith("\\"):
            joined += line.rstrip()[:-1] + " "
            continue
        joined += line
        for part in re.split(r"&&|\|\||;", joined):
            if part.strip():
                out.append((first, part.split()))
        joined, first = "", None
    return out


def copies(doc: Path) -> dict[str, str]:
    """`cp recipes/A.py recipes/B.py` in a doc's bash blocks: B stands for A in its commands."""
    out = {}
    for _, info, body in fences(doc):
        for _, toks in commands(body) if info_fields(info)[0] in ("bash", "sh", "shell") else []:
            if toks[:1] == ["cp"] and len(toks) == 3:
                out[toks[2]] = toks[1]
    return out


PATH = re.compile(r"^(?:\.\./)?((?:recipes|bench|scripts|rlkit|tests)/[\w/.-]+\.(?:py|sh))$")


def bash_snippets():
    for doc in DOCS:
        for start, info, body in fences(doc):
            if info_fields(info)[0] in ("bash", "sh", "shell"):
                yield pytest.param(doc, start, body, id=f"{rel(doc)}:{start}")


@pytest.mark.parametrize("doc, start, body", list(bash_snippets()))
def test_a_shell_snippet_runs_real_files_with_real_flags(doc, start, body):
    check_commands(rel(doc), start + 1, body, copies(doc))


def check_commands(name: str, first_line: int, body: list[str], aliases: dict[str, str]) -> None:
    """The shell commands of `body` (lines from `first_line` of file `name`) run files that exist with their flags."""
    for offset, toks in commands(body):
        where = f"{name}:{first_line + offset} `{' '.join(toks)[:80]}`"
        if toks[:1] == ["cp"]:
            assert (ROOT / toks[1]).is_file(), f"{where}: {toks[1]} does not exist"
            continue
        target = None
        for i, tok in enumerate(toks):
            if tok == "-m" and i + 1 < len(toks):
                assert module_exists(toks[i + 1]), f"{where}: no module {toks[i + 1]}"
            m = PATH.match(tok)
            if m:
                path = aliases.get(m[1], m[1])
                assert (ROOT / path).is_file(), f"{where}: {m[1]} does not exist"
                if target is None and path.endswith(".py") and path.split("/")[0] in ("recipes", "bench", "scripts"):
                    target = (path, i)
        if target is None:
            continue
        path, i = target
        for tok in toks[i + 1 :]:
            tok = tok.strip("[]")
            if not tok.startswith("--") or tok == "--":
                continue
            flag = tok.split("=", 1)[0]
            if path.startswith("recipes/"):
                name = Path(path).stem
                assert flag in recipe_flags(name), (
                    f"{where}: {flag} is not an option of {path} (not in `python {path} --help`); "
                    f"close ones: {sorted(f for f in recipe_flags(name) if f.split('.')[-1] == flag.split('.')[-1])}"
                )
            elif "import tyro" in (ROOT / path).read_text():  # a tyro script (scripts/eval.py): its --help
                assert flag in recipe_flags(path), f"{where}: {flag} is not an option of {path} (not in `python {path} --help`)"
            else:
                src = (ROOT / path).read_text() + (ROOT / "bench" / "common.py").read_text()
                assert f'"{flag}"' in src, f"{where}: {flag} is not an argument of {path} (no add_argument({flag!r}))"


def module_exists(name: str) -> bool:
    """`python -m name` runs something: a module or package of this checkout (rlkit.x, scripts.x), else an installed one."""
    import importlib.util

    path = ROOT / name.replace(".", "/")
    if (ROOT / name.split(".")[0]).is_dir():
        return path.with_suffix(".py").is_file() or (path / "__main__.py").is_file()
    return importlib.util.find_spec(name.split(".")[0]) is not None


def test_the_shell_checker_sees_a_wrong_flag_and_a_missing_file(tmp_path):
    doc = tmp_path / "x.md"
    doc.write_text("")
    check = test_a_shell_snippet_runs_real_files_with_real_flags
    check(doc, 1, ["python recipes/ppo.py --kl-ctrl adaptive --model x \\", "    --actor.no-use-kl-loss  # a comment --not-a-flag"])
    with pytest.raises(AssertionError, match=r"--actor\.bogus is not an option of recipes/grpo\.py"):
        check(doc, 1, ["python recipes/grpo.py --actor.lr 1e-5 \\", "    --actor.bogus 2"])
    with pytest.raises(AssertionError, match="--gspo-token is not an option of recipes/grpo.py"):
        check(doc, 1, ["bash scripts/install.sh && python recipes/grpo.py --gspo-token"])
    with pytest.raises(AssertionError, match="recipes/nope.py does not exist"):
        check(doc, 1, ["python recipes/nope.py"])
    with pytest.raises(AssertionError, match="--nope is not an argument of bench/async.py"):
        check(doc, 1, ["python bench/async.py --steps 2 --nope 1"])
    with pytest.raises(AssertionError, match="--rm-step is not an argument of scripts/rm_demo.py"):
        check(doc, 1, ["python scripts/rm_demo.py run --rm-init x --rm-step 3"])
    check(doc, 1, ["python scripts/eval.py --model m --data.val-files a.parquet -n 4 --output s.jsonl"])
    with pytest.raises(AssertionError, match="--rollout.nope is not an option of scripts/eval.py"):
        check(doc, 1, ["python scripts/eval.py --rollout.nope 1"])
    with pytest.raises(AssertionError, match="no module rlkit.nope"):
        check(doc, 1, ["python -m rlkit.nope"])
    with pytest.raises(AssertionError, match="no module nopetest"):
        check(doc, 1, ["python -m nopetest -q"])
    check(doc, 1, ["python -m pytest -q tests/test_docs.py && python -m rlkit.checkpoint convert x"])


@functools.cache
def all_recipe_flags() -> frozenset[str]:
    return frozenset().union(*(recipe_flags(name) for name in RECIPES))


def test_every_dotted_flag_named_in_the_docs_is_a_recipe_option():
    """`--actor.clip-ratio` in prose (or a table) is an option of some recipe: a renamed flag leaves no stale name."""
    bad = []
    for doc in DOCS:
        for n, line in enumerate(doc.read_text().splitlines(), start=1):
            for flag in re.findall(r"(?<![\w-])(--[a-z][\w-]*\.[a-z][\w.-]*[a-z0-9])", line):
                if flag not in all_recipe_flags():
                    bad.append(f"{rel(doc)}:{n}: {flag}")
    assert not bad, "flags named in the docs that no recipe's --help has (rename or remove them):\n" + "\n".join(bad)


BOOL_VALUE = re.compile(r"(?<![\w-])(--[a-z][\w.-]*[a-z0-9])[ =](true|false|True|False)\b")


def test_no_doc_gives_a_boolean_flag_a_value():
    """tyro's booleans are `--model.remove-padding` / `--model.no-remove-padding`: `--model.remove-padding false` is an
    unrecognized argument (two docs said so, found by a claim audit)."""
    bad = [
        f"{rel(doc)}:{n}: {m.group(0)}"
        for doc in [
            *DOCS,
            *sorted((ROOT / "recipes").glob("*.py")),
            *sorted((ROOT / "rlkit").glob("*.py")),
            *sorted((ROOT / "bench").glob("*.py")),
        ]
        for n, line in enumerate(doc.read_text().splitlines(), start=1)
        for m in BOOL_VALUE.finditer(line)
    ]
    assert not bad, "write a boolean flag as --x or --no-x:\n" + "\n".join(bad)
    assert BOOL_VALUE.search("(`--actor.use-kl-loss false`, ...)") and not BOOL_VALUE.search("`--actor.no-use-kl-loss`")


# --------------------------------------------------------------------------------------------------------------
# 2b. The same for the text beside the code: recipe docstrings, asset READMEs, test docstrings
# --------------------------------------------------------------------------------------------------------------


def module_docstring(path: Path) -> tuple[int, list[str]]:
    """(file line of the docstring's first line, its lines) of a .py file's module docstring; (0, []) if it has none."""
    tree = ast.parse(path.read_text())
    node = tree.body[0] if tree.body else None
    if not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)):
        return 0, []
    return node.lineno, node.value.value.splitlines()


def docstring_commands(lines: list[str]) -> list[tuple[int, list[str]]]:
    """(index of its first line, its lines) of each `python ...` command in a docstring, with its `\\` continuations."""
    out, k = [], 0
    while k < len(lines):
        if re.match(r"\s*python3? ", lines[k]):
            first, body = k, [lines[k]]
            while body[-1].split("#")[0].rstrip().endswith("\\") and k + 1 < len(lines):
                k += 1
                body.append(lines[k])
            out.append((first, body))
        k += 1
    return out


@functools.cache
def default_checkpoints(name: str) -> tuple[str, frozenset[int]]:
    """(output folder, the steps it holds checkpoints of) of `python recipes/<name>.py` on its defaults, derived from
    the code, not run: recipe.run_name names the folder; steps = total_training_steps, else total_epochs x batches per
    epoch (PromptLoader: rows // batch size, the last incomplete batch dropped; dapo.py's loader draws gen_batch_size
    prompts); a checkpoint every save_freq steps and at the last."""
    import pyarrow.parquet as pq

    from rlkit import recipe

    cfg = load_recipe(name).Config()
    t, s = cfg.trainer, cfg.system.trainer  # the schedule; the output and checkpoints
    rows = sum(pq.ParquetFile(ROOT / f).metadata.num_rows for f in cfg.data.train_files)
    batch = getattr(cfg, "gen_batch_size", None) or cfg.data.train_batch_size
    total = t.total_training_steps or t.total_epochs * (rows // batch)
    steps = {total, *(range(s.save_freq, total + 1, s.save_freq) if s.save_freq > 0 else ())}
    out = s.default_local_dir.format(experiment_name=s.experiment_name or recipe.run_name(cfg), project_name=s.project_name)
    return out, frozenset(steps)


CHECKPOINT_PATH = re.compile(r"(outputs/([\w.-]+))/checkpoints/global_step_(\d+)")


def false_checkpoint_paths(text: str) -> list[str]:
    """The `outputs/<recipe>/checkpoints/global_step_N` paths of a text (a recipe's default run folder) that the default
    run does not write."""
    bad = []
    for m in CHECKPOINT_PATH.finditer(text):
        if m[2] in RECIPES:
            folder, steps = default_checkpoints(m[2])
            if m[1] != folder or int(m[3]) not in steps:
                bad.append(f"{m[0]} (the default `python recipes/{m[2]}.py` writes {folder}/checkpoints/global_step_{sorted(steps)})")
    return bad


def flags_in(line: str) -> list[str]:
    return re.findall(r"(?<![\w-])(--[a-z][\w.-]*[a-z0-9])", line)


def recipe_docstring_claims(name: str) -> list[str]:
    """What a recipe's module docstring says that the code contradicts: its commands (files, flags), the flags its prose
    names (the recipe's own --help), and its example checkpoint paths (ones the default runs write)."""
    path = ROOT / "recipes" / f"{name}.py"
    first, lines = module_docstring(path)
    bad, in_command = [], set()
    for k, body in docstring_commands(lines):
        in_command |= set(range(k, k + len(body)))
        try:
            check_commands(rel(path), first + k, body, {})
        except AssertionError as e:
            bad.append(str(e).splitlines()[0])
    for k, line in enumerate(lines):
        if k not in in_command:
            bad += [f"{rel(path)}:{first + k}: {f} is not an option of {rel(path)}" for f in flags_in(line) if f not in recipe_flags(name)]
        bad += [f"{rel(path)}:{first + k}: {p}" for p in false_checkpoint_paths(line)]
    return bad


@pytest.mark.parametrize("name", RECIPES)
def test_a_recipe_docstring_runs_real_files_with_real_flags_and_names_real_outputs(name):
    bad = recipe_docstring_claims(name)
    assert not bad, f"recipes/{name}.py's docstring says what the code does not do:\n" + "\n".join(bad)


def test_the_docs_name_the_checkpoints_the_default_runs_write():
    bad = [
        f"{rel(doc)}:{n}: {p}"
        for doc in DOCS
        for n, line in enumerate(doc.read_text().splitlines(), 1)
        for p in false_checkpoint_paths(line)
    ]
    assert not bad, "checkpoint paths in the docs that the default runs do not write:\n" + "\n".join(bad)


def test_the_docstring_checker_sees_a_wrong_command_flag_and_checkpoint(monkeypatch):
    assert default_checkpoints("grpo") == ("outputs/grpo", frozenset({296}))  # 9,488 prompts // 32, saved at the end
    assert [k for k, _ in docstring_commands(["x", "    python recipes/a.py \\", "        --b 1", "python -m c"])] == [1, 3]
    assert false_checkpoint_paths("outputs/grpo/checkpoints/global_step_296/hf, outputs/grpo-x/checkpoints/global_step_7") == []
    assert len(false_checkpoint_paths("`outputs/grpo/checkpoints/global_step_295/hf`")) == 1
    doc = load_recipe("rloo").__doc__
    for planted, match in [
        ("    python recipes/rloo.py --actor.bogus 1", "--actor.bogus is not an option of recipes/rloo.py"),
        ("    python recipes/nope.py", "recipes/nope.py does not exist"),
        ("the cap bites with --rollout.nn 2", "--rollout.nn is not an option of recipes/rloo.py"),
        ("    python recipes/grpo.py --teacher outputs/rloo/checkpoints/global_step_300/hf", "--teacher is not an option"),
        ("load outputs/rloo/checkpoints/global_step_300/hf", "global_step_300"),
    ]:
        src = (ROOT / "recipes" / "rloo.py").read_text().replace(doc, doc + planted + "\n", 1)
        monkeypatch.setattr(Path, "read_text", lambda self, src=src, real=Path.read_text: src if self.name == "rloo.py" else real(self))
        assert any(match in b for b in recipe_docstring_claims("rloo")), (planted, recipe_docstring_claims("rloo"))
        monkeypatch.undo()
    assert recipe_docstring_claims("rloo") == []


ASSET_READMES = sorted((ROOT / "rlkit" / "assets").glob("*/README.md"))


def asset_readme_claims(path: Path) -> list[str]:
    """The `python X.py ...` / `python -m Y ...` commands an asset README names (in code spans or fences) run files
    and modules that exist, with the flags their scripts have."""
    bad = []
    for n, line in enumerate(path.read_text().splitlines(), start=1):
        for span in re.findall(r"`(python3? [^`]+)`", line) or ([line] if re.match(r"\s*python3? ", line) else []):
            for _, toks in commands([span]):
                for i, tok in enumerate(toks[:-1]):
                    script = toks[i + 1]
                    if (
                        re.fullmatch(r"python3?", tok)
                        and script.endswith(".py")
                        and not PATH.match(script)
                        and not (ROOT / script).is_file()
                    ):
                        bad.append(f"{rel(path)}:{n}: {toks[i + 1]} does not exist")
            try:
                check_commands(rel(path), n, [span], {})
            except AssertionError as e:
                bad.append(str(e).splitlines()[0])
    return bad


@pytest.mark.parametrize("path", ASSET_READMES, ids=[p.parent.name for p in ASSET_READMES])
def test_an_asset_readme_names_commands_that_exist(path):
    bad = asset_readme_claims(path)
    assert not bad, "the rebuild commands of an asset README must run: fix the command or the file\n" + "\n".join(bad)


def test_the_asset_readme_checker_sees_a_missing_script_and_module(tmp_path):
    assert ASSET_READMES, "rlkit/assets/*/README.md: none found"
    readme = tmp_path / "README.md"
    for text, match in [
        ("Rebuild with `python -m rlkit.embedded_nope`.", "no module rlkit.embedded_nope"),
        ("Rebuild with `python scripts/assets/nope.py --seed 0`.", "scripts/assets/nope.py does not exist"),
        ("Rebuild with `python nope.py`.", "nope.py does not exist"),
    ]:
        readme.write_text(text)
        assert any(match in b for b in asset_readme_claims(readme)), (text, asset_readme_claims(readme))
    readme.write_text("Rebuild with `python -m rlkit.checkpoint convert x` or `python scripts/rm_demo.py run`.")
    assert asset_readme_claims(readme) == []


TEST_FILES = sorted(p for p in (ROOT / "tests").glob("test_*.py") if p.name != "test_docs.py")  # this one names placeholders


def docstring_claims_of_test(path: Path) -> list[str]:
    """A test file's module docstring: the recipes/bench/scripts paths it names exist, its `--section.flag`s are options."""
    first, lines = module_docstring(path)
    bad = []
    for k, line in enumerate(lines):
        for p in re.findall(r"(?<![\w/])((?:recipes|bench|scripts)/[\w/.-]*\w\.(?:py|sh))", line):
            if not (ROOT / p).is_file():
                bad.append(f"{rel(path)}:{first + k}: {p} does not exist")
        for flag in re.findall(r"(?<![\w-])(--[a-z][\w-]*\.[a-z][\w.-]*[a-z0-9])", line):
            if flag not in all_recipe_flags():
                bad.append(f"{rel(path)}:{first + k}: {flag} is no recipe's option")
    return bad


def test_test_docstrings_name_real_files_and_flags():
    bad = [b for path in TEST_FILES for b in docstring_claims_of_test(path)]
    assert not bad, "test docstrings naming files or flags that do not exist:\n" + "\n".join(bad)


def test_the_test_docstring_checker_sees_a_missing_file_and_flag(tmp_path):
    path = tmp_path / "test_x.py"
    path.write_text('"""Runs bench/nope.py with --trainer.nope-steps 3, as recipes/grpo.py --trainer.resume does."""\n')
    assert [b.split(": ", 1)[1] for b in docstring_claims_of_test(path)] == [
        "bench/nope.py does not exist",
        "--trainer.nope-steps is no recipe's option",
    ]


@functools.cache
def rlkit_names() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """From the source (no import): module -> its top-level names, and class -> its attributes (methods, fields,
    class variables, self.x assignments, and those of its rlkit base classes)."""
    modules, classes, bases = {}, {}, {}
    for path in (ROOT / "rlkit").glob("*.py"):
        tree, names = ast.parse(path.read_text()), set()
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                names |= {t.id for t in (node.targets if isinstance(node, ast.Assign) else [node.target]) if isinstance(t, ast.Name)}
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                names |= {(a.asname or a.name).split(".")[0] for a in node.names}
            if isinstance(node, ast.ClassDef):
                attrs = {n.name for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
                attrs |= {n.target.id for n in node.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
                attrs |= {t.id for n in node.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
                attrs |= {
                    t.attr
                    for n in ast.walk(node)
                    for t in (n.targets if isinstance(n, ast.Assign) else [n.target] if isinstance(n, ast.AnnAssign) else [])
                    if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"
                }
                classes[node.name] = attrs
                bases[node.name] = [b.id for b in node.bases if isinstance(b, ast.Name)]
        modules[path.stem] = names
    for name in classes:  # inherited attributes, rlkit bases only
        todo = list(bases[name])
        while todo:
            base = todo.pop()
            if base in classes:
                classes[name] = classes[name] | classes[base]
                todo += bases[base]
    return modules, classes


# `module.name` in a doc's code span is checked for these rlkit modules (not for config sections such as
# rollout / data / agent, whose `rollout.n` is a field, nor for data columns such as reward_model)
CHECKED_MODULES = (
    "algos recipe rewards engine protocol packing tools sandbox async_rollout workers placement checkpoint tracking errors "
    "models tasks userfn vllm_rollout fsdp_workers megatron_workers megatron_shims ray_group demos"
).split()


def test_every_rlkit_name_in_the_docs_exists():
    """`algos.grpo_advantage`, `recipe.Rollouts`, `TorchEngine.update`, `ActorConfig.clip_low` in a doc's code spans name
    things the code has: a rename leaves no stale name behind."""
    modules, classes = rlkit_names()
    assert "grpo_advantage" in modules["algos"] and "update" in classes["TorchEngine"] and "lr" in classes["ActorConfig"]
    assert "bogus" not in modules["algos"] and "is_on_policy" not in classes["ActorRolloutRefWorker"]
    bad = []
    for doc in DOCS:
        for n, line in enumerate(doc.read_text().splitlines(), start=1):
            for span in re.findall(r"`([^`]+)`", line):
                for m in re.finditer(r"(?<![\w.-])(?:rlkit\.)?([A-Za-z_]\w*)\.([A-Za-z_]\w*)", span):
                    head, attr = m[1], m[2]
                    if head in CHECKED_MODULES and attr not in ("py",) and attr not in modules[head]:
                        bad.append(f"{rel(doc)}:{n}: {m[0]} (rlkit/{head}.py has no top-level {attr})")
                    elif head in classes and attr not in classes[head]:
                        bad.append(f"{rel(doc)}:{n}: {m[0]} (class {head} has no attribute {attr})")
    assert not bad, "names in the docs that the code does not have (renamed? removed?):\n" + "\n".join(bad)


# --------------------------------------------------------------------------------------------------------------
# 3. Counts: "N lines" claims are derived or absent; counted things are counted
# --------------------------------------------------------------------------------------------------------------


def update_pseudo_code_lines() -> int:
    """The update's pseudo-code in grpo.py's docstring: `for epoch ...` through `... optimizer.step()`."""
    doc = load_recipe("grpo").__doc__.splitlines()
    first = next(i for i, x in enumerate(doc) if x.strip().startswith("for epoch in range"))
    last = next(i for i, x in enumerate(doc) if "optimizer.step()" in x)
    return last - first + 1


# (doc, the words of the claim) -> the function that counts the lines it claims
DERIVED_LINE_COUNTS = {
    ("docs/grpo.md", "six lines"): update_pseudo_code_lines,
    ("docs/course.md", "six lines"): update_pseudo_code_lines,
}
LINE_CLAIM = re.compile(
    rf"(?i)(?<![\w~])((?:about |~ ?|some |over |under |nearly |almost )?(?:\d+|{'|'.join(NUMBER_WORDS[2:])})[ -](?:code |source )?lines?)\b"
)


def as_number(words: str) -> int:
    w = re.sub(r"[^\w]", " ", words.lower()).split()
    num = next(x for x in w if x.isdigit() or x in NUMBER_WORDS)
    return int(num) if num.isdigit() else NUMBER_WORDS.index(num)


def test_line_count_claims_are_derived_or_absent():
    bad = []
    for doc in DOCS:
        for n, line in enumerate(doc.read_text().splitlines(), start=1):
            for claim in LINE_CLAIM.findall(line):
                key = (rel(doc), claim.lower())
                if key not in DERIVED_LINE_COUNTS:
                    bad.append(
                        f"{rel(doc)}:{n}: {claim!r}: a line count drifts with the code; remove it, or derive it in "
                        "tests/test_docs.py DERIVED_LINE_COUNTS"
                    )
                elif DERIVED_LINE_COUNTS[key]() != as_number(claim):
                    bad.append(f"{rel(doc)}:{n}: {claim!r}, but the code has {DERIVED_LINE_COUNTS[key]()}")
    assert not bad, "\n".join(bad)


def test_the_line_claim_pattern():
    found = [LINE_CLAIM.findall(x) for x in ("about 120 lines", "a 90-line update", "~60 lines", "one line per step", "lines")]
    assert found == [["about 120 lines"], ["90-line"], ["~60 lines"], [], []]


def loss_agg_modes() -> int:
    from rlkit import algos

    return len(algos.LOSS_AGG_MODES)


def listed_in(path: str, name: str) -> list[str]:
    """The literal list `name = [...]` of a test file (read, not imported)."""
    tree = ast.parse((ROOT / path).read_text())
    node = next(n for n in tree.body if isinstance(n, ast.Assign) and any(getattr(t, "id", None) == name for t in n.targets))
    return ast.literal_eval(node.value)


def covers_every_recipe(path: str, name: str):
    def check() -> int:
        listed = listed_in(path, name)
        assert set(listed) == set(RL_RECIPES), f"the docs say every recipe, but {path} {name} lists {sorted(listed)}, not {RL_RECIPES}"
        return len(RL_RECIPES)

    check.__name__ = f"{path}:{name}"
    return check


# regex over one doc line (group 1 a number word or digits) -> what it counts
COUNT_CLAIMS = {
    r"\b(\w+) (?:ways of averaging token losses|(?:loss[- ])?aggregation modes)": loss_agg_modes,
    r"actor loss \(all (\w+);": lambda: len(RL_RECIPES),
    r"pins the first two steps of (every) (?:RL )?recipe": covers_every_recipe("tests/test_anchors.py", "RECIPES"),
}


def test_counted_things_are_counted():
    bad, seen = [], set()
    for doc in DOCS:
        for n, line in enumerate(doc.read_text().splitlines(), start=1):
            for pattern, count in COUNT_CLAIMS.items():
                for m in re.finditer(pattern, line):
                    seen.add(pattern)
                    if m[1] == "every":
                        count()  # asserts itself
                        continue
                    if as_number(m[1]) != count():
                        bad.append(f"{rel(doc)}:{n}: {m[0]!r}, but the code has {count()} ({count.__name__})")
    assert not bad, "\n".join(bad)
    assert seen == set(COUNT_CLAIMS), f"claims no doc makes any more (drop them from COUNT_CLAIMS): {set(COUNT_CLAIMS) - seen}"


# --------------------------------------------------------------------------------------------------------------
# 4. Metrics: every key a recipe logs is documented; every timing/ key named is a timer
# --------------------------------------------------------------------------------------------------------------

FAMILIES = (
    "actor|critic|reward|val|timing|perf|training|response_length|prompt_length|rollout_corr|async|agent|memory|dapo|distill|rm|sampler"
)
KEY = re.compile(rf"^(?:{FAMILIES})/[\w<>/|@-]+$")  # @: val/pass@<k>


class Pattern:
    """A documented key with a placeholder: .match(key), and the text it was written as."""

    def __init__(self, key: str):
        self.pattern_text, self.regex = key, placeholder_regex(key)

    def match(self, key: str):
        return self.regex.match(key)


def doc_keys(text: str) -> tuple[set[str], list[Pattern]]:
    """The metric keys a doc names in `code`: exact keys, and patterns for keys with a `<placeholder>` segment.
    In a run of spans `a/b/c`, `/d`, the short `/d` means `a/b/d`; `a/b/c|d` means `a/b/c` and `a/b/d`."""
    exact, patterns = set(), []
    for line in text.splitlines():
        last = None
        for span in re.findall(r"`([^`\s]+)`", line):
            if span.startswith("/") and last:
                span = last.rsplit("/", 1)[0] + span
            if not KEY.match(span):
                continue
            last = span
            head, _, tail = span.rpartition("/")
            for key in [f"{head}/{t}" for t in tail.split("|")] if head else [span]:
                if "<" in key:
                    patterns.append(Pattern(key))
                else:
                    exact.add(key)
    return exact, patterns


def metrics_docs() -> list[Path]:
    """docs/metrics.md and the docs it links."""
    text = (ROOT / "docs" / "metrics.md").read_text()
    linked = {ROOT / "docs" / m for m in re.findall(r"\]\(([\w-]+\.md)(?:#[\w-]*)?\)", text)}
    return [ROOT / "docs" / "metrics.md", *sorted(p for p in linked if p.is_file())]


def code_literal_keys() -> dict[str, str]:
    """Metric keys spelled out as string literals in rlkit/ and recipes/ (key -> file), docstrings and comments
    aside: the families a short run does not reach (async/, memory/ on CUDA, reward/timeouts, timing/weight_sync)."""
    out = {}
    for path in sorted([*(ROOT / "rlkit").glob("*.py"), *(ROOT / "recipes").glob("*.py")]):
        tree = ast.parse(path.read_text())
        docstrings = {
            id(node.body[0].value)
            for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef))
            and node.body
            and isinstance(node.body[0], ast.Expr)
            and isinstance(node.body[0].value, ast.Constant)
        }
        for node in ast.walk(tree):
            if isinstance(node, ast.JoinedStr):
                parts = [v.value if isinstance(v, ast.Constant) else "<name>" for v in node.values]
                text = "".join(str(p) for p in parts)
                if KEY.match(text) and text.startswith("memory/<name>"):  # CUDA only: no CPU run logs it
                    out.setdefault(text, rel(path))
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
                if KEY.match(node.value) and "<" not in node.value and not node.value.endswith("/"):
                    out.setdefault(node.value, rel(path))
    return out


@functools.cache
def code_strings() -> frozenset[str]:
    """Every string literal of rlkit/ and recipes/ (the names a prefix turns into a key: "pg_loss" -> actor/pg_loss)."""
    out = set()
    for path in [*(ROOT / "rlkit").glob("*.py"), *(ROOT / "recipes").glob("*.py")]:
        out |= {n.value for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
    return frozenset(out)


def tiny_train_file(recipe, tmp: Path) -> str:
    """The recipe's default training parquet cut to 8 rows (tokenising the full set is most of a 1-step run)."""
    import pyarrow.parquet as pq

    src = recipe.Config().data.train_files[0]
    dst = tmp / f"{Path(src).parent.name}-{Path(src).name}"
    if not dst.exists():
        pq.write_table(pq.read_table(ROOT / src if not Path(src).is_absolute() else src).slice(0, 8), dst)
    return str(dst)


@pytest.fixture(scope="module")
def logged_keys(tmp_path_factory) -> dict[str, set[str]]:
    """key -> the recipes that logged it, from one tiny step of every recipe (no validation, plot or checkpoint)."""
    import json

    from test_grpo_recipe import small_config

    from rlkit import recipe, tracking

    tmp, out = tmp_path_factory.mktemp("docs-metrics"), {}
    with pytest.MonkeyPatch.context() as mp:  # the plot and the checkpoint come after the metrics are logged
        mp.setattr(tracking, "plot_learning_curve", lambda metrics, png, title="": Path(png))
        mp.setattr(recipe.Run, "save", lambda self, step: None)
        for name in RECIPES:
            module = load_recipe(name)
            cfg = small_config(module, tmp / name, steps=1, num_threads=1, save_freq=0)
            cfg.data.train_files = [tiny_train_file(module, tmp)]
            cfg.system.data.val_files = []
            cfg.data.train_batch_size = 4
            if hasattr(cfg.actor, "ppo_mini_batch_size"):  # rm.py: one optimizer step per batch
                cfg.actor.ppo_mini_batch_size = 4
            if hasattr(cfg, "rollout"):  # rm.py samples nothing
                cfg.rollout.n = 2
            if name == "dapo":
                cfg.gen_batch_size = 4
            if name == "opd":  # distills from a teacher: the embedded model itself will do for the metric names
                cfg.teacher = str(ROOT / "rlkit" / "assets" / "tiny-arith")
            module.main(cfg)
            for row in map(json.loads, (tmp / name / "metrics.jsonl").read_text().splitlines()):
                for key in row:
                    out.setdefault(key, set()).add(name)
    out.pop("step", None)
    return out


def test_doc_keys_reads_short_forms_and_placeholders():
    exact, patterns = doc_keys("| `critic/values/mean`, `/max` | `reward/<key>` and `critic/score/mean|std`, `--flag` |")
    assert exact == {"critic/values/mean", "critic/values/max", "critic/score/mean", "critic/score/std"}
    assert documented("reward/acc", exact, patterns, literal=False)  # a scorer's own key
    assert not documented("reward/timeouts", exact, patterns, literal=True)  # spelled out in the code: listed by name
    assert not documented("critic/values/min", exact, patterns, literal=False)


def placeholder_regex(key: str) -> re.Pattern:
    """`memory/<name>_peak_gb` -> a regex whose `<...>` matches one path segment's text."""
    return re.compile("".join("[^/]+" if part.startswith("<") else re.escape(part) for part in re.split(r"(<[^>]*>)", key)) + "$")


def same_pattern(a: str, b: str) -> bool:
    return re.sub(r"<[^>]*>", "<>", a) == re.sub(r"<[^>]*>", "<>", b)


def documented(key: str, exact: set[str], patterns: list[Pattern], literal: bool) -> bool:
    """A literal key with a placeholder (memory/<name>_peak_gb) is documented by the same pattern."""
    if "<" in key:
        return any(same_pattern(key, p.pattern_text) for p in patterns)
    return key in exact or (not literal and any(p.match(key) for p in patterns))


def test_every_logged_metric_is_in_docs_metrics_md(logged_keys):
    exact, patterns = set(), []
    for doc in metrics_docs():
        e, p = doc_keys(doc.read_text())
        exact |= e
        patterns += p
    literal = code_literal_keys()
    missing = [
        f"{key} (logged by {', '.join(sorted(logged_keys[key]))})"
        for key in sorted(logged_keys)
        if not documented(key, exact, patterns, key in literal)
    ]
    missing += [
        f"{key} (any --actor.rollout-correction mode)" for key in sorted(rollout_corr_keys() - set(logged_keys)) if key not in exact
    ]
    missing += [
        f"{key} (spelled out in {where})"
        for key, where in sorted(literal.items())
        if key not in logged_keys and not documented(key, exact, patterns, True)
    ]
    assert not missing, (
        "metric keys that docs/metrics.md (or a doc it links) does not name: add a row (or `/suffix` to a row) for each\n"
        + "\n".join(missing)
    )
    assert {"critic/score/mean", "actor/pg_loss", "timing/update", "agent/turns/mean", "critic/vf_loss"} <= set(logged_keys)


EXERCISE_KEYS = {"actor/token_share"}  # docs/course.md's exercise has the reader add it


def test_every_metric_named_in_the_docs_is_logged(logged_keys):
    """The other way: a key a doc names that no run logs and no code spells out is stale (renamed or removed)."""
    where = {}
    for doc in DOCS:
        for n, line in enumerate(doc.read_text().splitlines(), start=1):
            for key in doc_keys(line)[0]:
                where.setdefault(key, f"{rel(doc)}:{n}")
    exact = set(where) - EXERCISE_KEYS
    literal = code_literal_keys()
    names = code_strings()  # actor/<name>: a loss part or engine metric the run did not reach (e.g. entropy_loss)
    stale = sorted(
        k
        for k in exact
        if k not in logged_keys
        and k not in literal
        and not rollout_corr_key(k)
        and k.split("/", 1)[1] not in names
        and not any("<" in lit and placeholder_regex(lit).match(k) for lit in literal)  # memory/gen_peak_gb
    )
    assert not stale, "the docs name metrics the code does not log (renamed? removed?):\n" + "\n".join(f"{where[k]}: {k}" for k in stale)


@functools.cache
def rollout_corr_keys() -> frozenset[str]:
    """Every rollout_corr/ key any correction mode logs (the recipes' run logs only the default mode's)."""
    import torch

    from rlkit import algos

    lp, mu = torch.tensor([[-1.0, -2.0, -0.5]]), torch.tensor([[-1.1, -1.9, -0.7]])
    mask = torch.ones(1, 3)
    keys = set()
    for mode in algos.CORRECTION_MODES:
        keys |= set(algos.rollout_correction(lp, mu, mask, mode)[-1])
    assert "rollout_corr/kl" in keys and "rollout_corr/is_mean" in keys and "rollout_corr/masked_fraction" in keys
    return frozenset(keys)


def rollout_corr_key(key: str) -> bool:
    return key in rollout_corr_keys()


@functools.cache
def timers() -> frozenset[str]:
    """timing/ keys the code creates: `recipe.timer("name", ...)` blocks and literal `timing/...` keys."""
    names = set()
    for path in [*(ROOT / "rlkit").glob("*.py"), *(ROOT / "recipes").glob("*.py")]:
        src = path.read_text()
        names |= {f"timing/{n}" for n in re.findall(r"\btimer\(\s*[\"'](\w+)[\"']", src)}
        names |= set(re.findall(r"[\"'](timing/\w+)[\"']", src))
    return frozenset(names)


def test_every_timing_key_named_in_the_docs_is_a_timer():
    bad = []
    for doc in DOCS:
        for n, line in enumerate(doc.read_text().splitlines(), start=1):
            last = None
            for m in re.finditer(r"`(/\w+)`|(?<![\w/])(timing/\w+)", line):
                key = m[2] or (last.rsplit("/", 1)[0] + m[1] if last and m[1] else None)
                if m[2]:
                    last = m[2]
                if key and key not in timers():
                    bad.append(f"{rel(doc)}:{n}: {key}")
    assert timers() >= {"timing/gen", "timing/update", "timing/weight_sync"}
    assert not bad, f"timing keys named in the docs that no timer creates (timers: {sorted(timers())}):\n" + "\n".join(bad)


# --------------------------------------------------------------------------------------------------------------
# 5. README's module table
# --------------------------------------------------------------------------------------------------------------


def readme_box_paths() -> set[str]:
    """The paths in the first column of README's "What is in the box" table (`rlkit/a.py`, `b.py`: b is rlkit/b.py)."""
    text = (ROOT / "README.md").read_text()
    section = text.split("## What is in the box", 1)[1].split("\n## ", 1)[0]
    paths = set()
    for row in section.splitlines():
        if not row.startswith("| `"):
            continue
        first, folder = row.split("|")[1], ""
        for span in re.findall(r"`([^`]+)`", first):
            if "/" in span:
                folder = span.rsplit("/", 1)[0] + "/"
                paths.add(span)
            else:
                paths.add(folder + span)
    return paths


def test_readme_names_every_module_and_recipe():
    listed = readme_box_paths()
    want = {rel(p) for p in (ROOT / "rlkit").glob("*.py") if p.name != "__init__.py"}
    want |= {f"recipes/{n}.py" for n in RECIPES}
    assert not want - listed, f"README.md's 'What is in the box' table lacks: {sorted(want - listed)} (add a row each)"
    gone = sorted(p for p in listed if not (ROOT / p).exists())
    assert not gone, f"README.md's 'What is in the box' table names files that do not exist: {gone}"


# --------------------------------------------------------------------------------------------------------------
# 6. The recipe pages: one template, their flags tables as --help has them, their metrics the recipe's own
# --------------------------------------------------------------------------------------------------------------

RECIPE_PAGES = {f"docs/{r}.md": r for r in RECIPES if r != "grpo_tools"} | {"docs/agents.md": "grpo_tools"}
TEMPLATE = ["What", "Run", "The formula beside the code", "Flags", "Metrics", "Results"]


def page_sections(doc: str) -> dict[str, str]:
    """`## heading` -> its text, in order (fenced blocks' `#` lines are not headings)."""
    out, head, inside = {}, None, False
    for line in (ROOT / doc).read_text().splitlines():
        if line.lstrip().startswith("```"):
            inside = not inside
        if not inside and line.startswith("## "):
            head = line[3:].strip()
            out[head] = ""
        elif head is not None:
            out[head] += line + "\n"
    return out


@pytest.mark.parametrize("doc", sorted(RECIPE_PAGES))
def test_a_recipe_page_follows_the_template(doc):
    heads = list(page_sections(doc))
    first = [next((t for t in TEMPLATE if re.match(rf"{t}\b(?![-\w])", h)), h) for h in heads[: len(TEMPLATE)]]
    assert first == TEMPLATE, (
        f"{doc}: its first sections are {heads[: len(TEMPLATE)]}; a recipe page opens with the sections {TEMPLATE}, in this "
        "order (a heading may go on: '## Results (CPU)'); anything else goes after them, histories to docs/results.md"
    )
    results = page_sections(doc)[heads[5]]
    assert re.search(rf"python recipes/{RECIPE_PAGES[doc]}\.py", results) and "|" in results, (
        f"{doc}: its Results section holds one table and the exact `python recipes/{RECIPE_PAGES[doc]}.py ...` command that made it"
    )


def config_default(cfg, flag: str):
    """The default of `--section.some-flag` / `--some-flag` in a recipe's Config, wherever its section sits
    (config.flag_values; a KeyError if it has no such option)."""
    from rlkit.config import flag_values

    values = flag_values(cfg)
    name = flag.lstrip("-").replace("-", "_")
    if name not in values:
        raise KeyError(flag)
    return values[name]


def same_default(cell: str, value) -> bool:
    """A Flags table's default cell (`0.2`, `True`, `''`, `kl`) is the Config's value, as --help prints it."""
    cell = cell.strip().strip("`").strip()
    if isinstance(value, bool) or value is None:
        return cell == str(value)
    if isinstance(value, (int, float)):
        try:
            return float(cell) == float(value)
        except ValueError:
            return False
    if isinstance(value, (list, tuple)):
        return cell.split() == [str(v) for v in value]
    return cell == (repr(value) if value == "" else str(value))


def flags_table_claims(doc: str) -> list[str]:
    """A recipe page's Flags table names the recipe's options with their defaults, and every option of its own (a
    top-level Config field: --kl-coef, not a shared section's --actor.lr)."""
    import dataclasses

    name, bad, named = RECIPE_PAGES[doc], [], set()
    cfg = load_recipe(name).Config()
    section = next((text for head, text in page_sections(doc).items() if head.startswith("Flags")), "")
    for row in section.splitlines():
        cells = [c.strip() for c in row.strip().strip("|").split("|")]
        if not row.startswith("| `--") or len(cells) < 3:
            continue
        for flag in re.findall(r"`(--[\w.-]+)`", cells[0]):
            named.add(flag)
            if flag.startswith("--no-") and f"--{flag[5:]}" in recipe_flags(name):
                continue
            if flag not in recipe_flags(name):
                bad.append(f"{doc}: {flag} is not an option of recipes/{name}.py")
                continue
            try:
                value = config_default(cfg, flag)
            except KeyError:
                continue  # an alias (--model): no field of that name
            if not same_default(cells[1], value):
                bad.append(f"{doc}: {flag}'s default is {value!r} in recipes/{name}.py, the table says {cells[1]}")
    own = {
        "--" + f.name.replace("_", "-")
        for f in dataclasses.fields(cfg)
        if not dataclasses.is_dataclass(getattr(cfg, f.name)) and "--" + f.name.replace("_", "-") in recipe_flags(name)
    }
    bad += [f"{doc}: the Flags table lacks {flag}, an option of recipes/{name}.py's own" for flag in sorted(own - named)]
    return bad


@pytest.mark.parametrize("doc", sorted(RECIPE_PAGES))
def test_a_recipe_page_flags_table_is_the_recipe_help(doc):
    bad = flags_table_claims(doc)
    assert not bad, "a Flags table row is `| `--flag` | default | meaning |`, the default as --help prints it:\n" + "\n".join(bad)


def test_the_flags_table_checker_sees_a_wrong_default_a_missing_flag_and_a_stale_one(monkeypatch):
    real = Path.read_text
    text = real(ROOT / "docs" / "gspo.md")
    for old, new, match in [
        ("| `--gspo-token` / `--no-gspo-token` | `False`", "| `--gspo-token` / `--no-gspo-token` | `True`", "the table says `True`"),
        ("| `--gspo-token` / `--no-gspo-token` |", "| `--gspo-tokens` |", "--gspo-tokens is not an option"),
        ("| `--gspo-token` / `--no-gspo-token` |", "| gspo-token |", "lacks --gspo-token"),
    ]:
        assert old in text, old
        planted = text.replace(old, new)
        monkeypatch.setattr(Path, "read_text", lambda self, t=planted: t if self.name == "gspo.md" else real(self))
        assert any(match in b for b in flags_table_claims("docs/gspo.md")), (match, flags_table_claims("docs/gspo.md"))
        monkeypatch.undo()


@pytest.mark.parametrize("doc", sorted(RECIPE_PAGES))
def test_a_recipe_page_names_the_metrics_its_recipe_adds(doc, logged_keys):
    """The keys the recipe logs that grpo.py does not, named in its Metrics section (`family/*` names a family)."""
    name = RECIPE_PAGES[doc]
    section = next(text for head, text in page_sections(doc).items() if head.startswith("Metrics"))
    exact, patterns = doc_keys(section)
    families = set(re.findall(r"`(\w+)/\*`", section))
    base = {k for k, by in logged_keys.items() if "grpo" in by}
    own = sorted(k for k, by in logged_keys.items() if name in by and k not in base)
    missing = [k for k in own if k not in exact and k.split("/")[0] not in families and not any(p.match(k) for p in patterns)]
    assert "docs/metrics.md" in section or "(metrics.md" in section, f"{doc}: its Metrics section links docs/metrics.md"
    assert not missing, f"{doc}: recipes/{name}.py logs keys its Metrics section does not name: {missing}"


# --------------------------------------------------------------------------------------------------------------
# 7. The default run's end point: stated in results.md, every other mention the same number
# --------------------------------------------------------------------------------------------------------------

END_POINT = re.compile(
    r"(?i)(?:(?:default run|`python recipes/grpo\.py`).*?0\.295 (?:→|->) \**|held-out accuracy: 0\.295 at step 0 -> )(0\.\d+)"
)


def default_end_point() -> str:
    """The held-out accuracy of `python recipes/grpo.py` as results.md's default-run table states it."""
    row = next(x for x in (ROOT / "docs" / "results.md").read_text().splitlines() if x.startswith("| held-out accuracy | **0.295 → "))
    return re.search(r"0\.295 → (0\.\d+)", row)[1]


def test_the_default_runs_end_point_is_the_one_results_md_states():
    want, bad = default_end_point(), []
    for doc in DOCS:
        if doc.name == "results.md":
            continue
        for n, line in enumerate(doc.read_text().splitlines(), start=1):
            bad += [f"{rel(doc)}:{n}: 0.295 → {m[1]}" for m in END_POINT.finditer(line) if m[1] != want]
    assert END_POINT.search("| the default run (`python recipes/grpo.py`), 296 steps | 82 s, 0.295 → 0.684 held-out |")
    assert END_POINT.search("the last lines: `held-out accuracy: 0.295 at step 0 -> 0.684 at step 296 (+38.9 points)`")
    assert not bad, f"the default run ends at {want} (docs/results.md); these say otherwise (link results.md instead):\n" + "\n".join(bad)


def slug(heading: str) -> str:
    """GitHub's anchor of a markdown heading: lower case, punctuation dropped (not `-`), spaces to `-`."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@functools.cache
def anchors(doc: Path) -> frozenset[str]:
    out, inside = set(), False
    for line in doc.read_text().splitlines():
        if line.lstrip().startswith("```"):
            inside = not inside
        elif not inside and re.match(r"#{1,6} ", line):
            out.add(slug(line.lstrip("#")))
    return frozenset(out)


def test_every_link_to_a_section_finds_its_heading():
    """`[x](results.md#a-heading)`: a renamed or moved heading leaves no dead link (the recipe pages link results.md's)."""
    assert slug("## SFT: the embedded models rebuilt by `recipes/sft.py` (2026-11-26)".lstrip("#")) == (
        "sft-the-embedded-models-rebuilt-by-recipessftpy-2026-11-26"
    )
    bad = []
    for doc in DOCS:
        for n, line in enumerate(doc.read_text().splitlines(), start=1):
            for target, anchor in re.findall(r"\]\(((?:[\w./-]+\.md)?)#([\w-]+)\)", line):
                path = (doc.parent / target) if target else doc
                if path.is_file() and anchor not in anchors(path):
                    bad.append(f"{rel(doc)}:{n}: {target}#{anchor}")
    assert not bad, "links to sections that do not exist (the heading was renamed?):\n" + "\n".join(bad)
