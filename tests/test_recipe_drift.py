"""Drift guard for forks: the code recipes share by design stays identical, so a fix in one is a fix in all.

A recipe is grpo.py with its own header, config fields and `# ALGO LOGIC` lines. Three checks:

1. forks of grpo.py (FORKS): main() is grpo.py's, line for line and comment for comment, once the
   ALGO LOGIC blocks and the recipe's own config checks (`if ...: raise ConfigError(...)`) are cut;
2. every RL recipe: each plumbing statement of grpo.py's main() (setup, step preamble, metrics and
   end of step, compared as code, comments aside) appears in the recipe's main(), except the
   deliberate differences listed in DIFFERS, each with its reason (sft.py and rm.py are skipped whole: DIFFERS
   says why);
3. the recipes that use the PPO clip loss unchanged (PPO_CLIP): make_actor_loss is grpo.py's;
4. the recipes with a policy loss of their own (OWN_LOSS): make_actor_loss is grpo.py's outside the statement that
   computes pg_loss (the rollout correction, the entropy and KL terms, the total are shared).

Every line of every recipe, comments and strings included, fits in 100 columns (recipes/ruff.toml formats
the code to that width; rlkit/ keeps 140).

`python tests/test_recipe_drift.py` prints the table "recipe -> lines that differ from grpo.py" of
docs/algorithms.md.
"""

import ast
import difflib
import sys
from pathlib import Path

import pytest

RECIPES_DIR = Path(__file__).resolve().parents[1] / "recipes"
NOT_FORKS = {
    "sft": "supervised fine-tuning: no rollout, reward or advantage, so none of grpo.py's loop",
    "rm": "reward-model training on preference pairs: no rollout, reward or advantage either",
}
RECIPES = sorted(p.stem for p in RECIPES_DIR.glob("*.py") if p.stem != "grpo" and p.stem not in NOT_FORKS)
FORKS = ("cispo", "gmpo", "gspo", "rloo")
PPO_CLIP = ("dapo", "grpo_tools", "opd", "ppo", "reinforce_pp", "remax", "rloo")
OWN_LOSS = ("cispo", "gmpo", "gspo")
DIFFERS = {  # recipe -> {grpo.py statement (by what it assigns or calls): why the recipe changes it}
    "dapo": {
        "train": "prompts come in generation batches of --gen-batch-size, filtered down to train_batch_size",
    },
    "grpo_tools": {
        "policy": "the worker group is wrapped so that generate() runs the multi-turn turn loop with the tools",
        "train": "the prompts offer the tools (their JSON schemas go to the chat template)",
        "val": "the validation prompts offer the tools too",
    },
    "opd": {
        "batch": "the student's log-probs are computed every step: the advantage -kl_coef * d_t needs them before the update",
        "metrics": "the distillation metrics (distill/*) as well",
    },
    "remax": {
        "rollouts": "each batch's prompts get their greedy response's score, the baseline, before they are repeated",
    },
    "reinforce_pp": {
        "policy": "the reference policy is also needed for the KL in the reward",
        "rollouts": "with --trainer.async-steps the worker computes the reference for the KL in the reward too",
    },
    "ppo": {
        "policy": "the reference is needed for the KL in the reward; room for the critic on Ray",
        "run": "the critic and the KL controller are saved in checkpoints",
        "actor_loss": "a critic loss as well",
        "metrics": "the critic's and the KL controller's metrics as well",
        "rollouts": "with --trainer.async-steps the worker computes the reference for the KL in the reward too",
    },
}


def source(name: str) -> str:
    return (RECIPES_DIR / f"{name}.py").read_text()


def function(src: str, name: str) -> ast.FunctionDef:
    return next(n for n in ast.parse(src).body if isinstance(n, ast.FunctionDef) and n.name == name)


def own_lines(src: str, fn: ast.FunctionDef) -> set[int]:
    """Line numbers of fn's ALGO LOGIC blocks and own config checks (1-based).

    An ALGO LOGIC block is a `# ALGO LOGIC` comment and the lines after it up to a blank or a dedented line, or a
    statement whose first line carries the marker (with its body). A config check is an `if` whose
    body only raises ConfigError.
    """
    lines, cut = src.splitlines(), set()
    for node in ast.walk(fn):
        if isinstance(node, ast.stmt) and "# ALGO LOGIC" in lines[node.lineno - 1]:
            cut.update(range(node.lineno, node.end_lineno + 1))
        if isinstance(node, ast.If) and all(isinstance(s, ast.Raise) and "ConfigError" in ast.unparse(s) for s in node.body):
            cut.update(range(node.lineno, node.end_lineno + 1))
    i = fn.lineno
    while i <= fn.end_lineno:
        if lines[i - 1].strip().startswith("# ALGO LOGIC"):
            indent = indentation(lines[i - 1])
            while i <= fn.end_lineno and lines[i - 1].strip() and indentation(lines[i - 1]) >= indent:
                cut.add(i)
                i += 1
        else:
            i += 1
    return cut


def indentation(line: str) -> int:
    return len(line) - len(line.lstrip())


def shared_text(name: str) -> list[str]:
    """main()'s non-blank lines without the ALGO LOGIC blocks and the recipe's own config checks."""
    src = source(name)
    fn = function(src, "main")
    cut = own_lines(src, fn)
    lines = src.splitlines()
    return [lines[i - 1] for i in range(fn.lineno, fn.end_lineno + 1) if i not in cut and lines[i - 1].strip()]


def key(stmt: ast.stmt) -> str:
    """What a statement assigns (`batch["uid"]`), or the call it makes (`run.end_of_step`)."""
    if isinstance(stmt, ast.Assign):
        return ast.unparse(stmt.targets[0])
    call = stmt.value if isinstance(stmt, (ast.Expr, ast.Return)) else None
    return ast.unparse(call.func) if isinstance(call, ast.Call) else ast.unparse(stmt)


def plumbing(name: str) -> list[ast.stmt]:
    """The simple statements (no if/with/for) of main() outside ALGO LOGIC blocks and config checks."""
    src = source(name)
    fn = function(src, "main")
    cut = own_lines(src, fn)
    compound = (ast.FunctionDef, ast.If, ast.With, ast.For, ast.While, ast.Try)
    return [n for n in ast.walk(fn) if isinstance(n, ast.stmt) and not isinstance(n, compound) and n.lineno not in cut]


def diff(a: list[str], b: list[str], name: str) -> str:
    return "\n".join(difflib.unified_diff(a, b, "grpo.py", f"{name}.py", lineterm=""))


def test_the_lists_name_real_recipes():
    assert set(FORKS) | set(PPO_CLIP) | set(DIFFERS) | set(OWN_LOSS) <= set(RECIPES)
    assert not set(PPO_CLIP) & set(OWN_LOSS)
    assert not set(FORKS) & set(DIFFERS)


@pytest.mark.parametrize("name", FORKS)
def test_a_fork_of_grpo_changes_main_only_in_its_algo_logic_lines(name):
    grpo, fork = shared_text("grpo"), shared_text(name)
    assert fork == grpo, f"recipes/{name}.py: main() drifted from grpo.py outside its ALGO LOGIC lines:\n{diff(grpo, fork, name)}"


@pytest.mark.parametrize("name", RECIPES)
def test_every_recipe_keeps_grpos_plumbing_statements(name):
    mine = {ast.unparse(s) for s in plumbing(name)}
    allowed = DIFFERS.get(name, {})
    missing = [s for s in plumbing("grpo") if ast.unparse(s) not in mine and key(s) not in allowed]
    assert not missing, f"recipes/{name}.py: grpo.py's plumbing changed (fix it in every recipe, or list it in DIFFERS):\n" + "\n".join(
        f"  grpo.py line {s.lineno}: {ast.unparse(s)}" for s in missing
    )
    differing = {key(s) for s in plumbing("grpo") if ast.unparse(s) not in mine}
    stale = [k for k in allowed if k not in differing]
    assert not stale, f"DIFFERS[{name!r}] lists {stale}, which recipes/{name}.py now shares with grpo.py: remove them from DIFFERS"


@pytest.mark.parametrize("name", PPO_CLIP)
def test_recipes_on_the_ppo_clip_loss_share_make_actor_loss(name):
    grpo = ast.get_source_segment(source("grpo"), function(source("grpo"), "make_actor_loss")).splitlines()
    mine = ast.get_source_segment(source(name), function(source(name), "make_actor_loss")).splitlines()
    assert mine == grpo, f"recipes/{name}.py: make_actor_loss differs from grpo.py's:\n{diff(grpo, mine, name)}"


def loss_without_pg_loss(name: str) -> list[str]:
    """make_actor_loss's lines without the statement that assigns pg_loss (the recipe's own policy loss)."""
    src = source(name)
    fn = function(src, "make_actor_loss")
    pg = [n for n in ast.walk(fn) if isinstance(n, ast.Assign) and "pg_loss" in ast.unparse(n.targets[0])]
    assert len(pg) == 1, f"recipes/{name}.py: make_actor_loss should assign pg_loss once"
    cut = set(range(pg[0].lineno, pg[0].end_lineno + 1))
    lines = src.splitlines()
    above = pg[0].lineno - 1
    while lines[above - 1].strip().startswith("#"):  # the comment lines that introduce the recipe's own pg_loss
        cut.add(above)
        above -= 1
    return [lines[i - 1] for i in range(fn.lineno, fn.end_lineno + 1) if i not in cut]


@pytest.mark.parametrize("name", OWN_LOSS)
def test_recipes_with_their_own_loss_share_the_rest_of_make_actor_loss(name):
    """The rollout correction, the entropy bonus, the KL term and their sum stay grpo.py's in GSPO, CISPO and GMPO."""
    grpo, mine = loss_without_pg_loss("grpo"), loss_without_pg_loss(name)
    assert mine == grpo, f"recipes/{name}.py: make_actor_loss differs from grpo.py's outside pg_loss:\n{diff(grpo, mine, name)}"


def test_the_guard_sees_a_drifted_line(tmp_path, monkeypatch):
    drifted = source("rloo").replace("        cfg.data.shuffle,\n", "        True,\n")
    assert drifted != source("rloo")
    (tmp_path / "rloo.py").write_text(drifted)
    (tmp_path / "grpo.py").write_text(source("grpo"))
    monkeypatch.setattr(sys.modules[__name__], "RECIPES_DIR", tmp_path)
    with pytest.raises(AssertionError, match=r"(?s)rloo.py: main\(\) drifted.*\+ +True,"):
        test_a_fork_of_grpo_changes_main_only_in_its_algo_logic_lines("rloo")
    with pytest.raises(AssertionError, match=r"rloo.py: grpo.py's plumbing changed.*\n.*train = PromptLoader"):
        test_every_recipe_keeps_grpos_plumbing_statements("rloo")
    (tmp_path / "rloo.py").write_text(source("grpo").replace("a.kl_loss_coef * parts", "0.1 * parts"))
    with pytest.raises(AssertionError, match=r"(?s)rloo.py: make_actor_loss differs.*\+.*0.1 \* parts"):
        test_recipes_on_the_ppo_clip_loss_share_make_actor_loss("rloo")
    gspo = (Path(__file__).resolve().parents[1] / "recipes" / "gspo.py").read_text()
    no_correction = gspo.replace("algos.rollout_weights(mb, off)", "None, mb['response_mask'], {}")  # a fork that skips it
    (tmp_path / "gspo.py").write_text(no_correction)
    assert source("gspo") != gspo
    with pytest.raises(AssertionError, match=r"(?s)gspo.py: make_actor_loss differs from grpo.py's outside pg_loss.*\+.*None, mb"):
        test_recipes_with_their_own_loss_share_the_rest_of_make_actor_loss("gspo")


MAX_COLUMNS = 100


@pytest.mark.parametrize("name", ["grpo", *RECIPES, *NOT_FORKS])  # sft and rm too: only the fork checks skip them
def test_every_recipe_line_fits_in_100_columns(name):
    long = [(i, len(line)) for i, line in enumerate(source(name).splitlines(), 1) if len(line) > MAX_COLUMNS]
    assert not long, f"recipes/{name}.py: lines over {MAX_COLUMNS} characters (line, length): {long}"


def test_the_column_check_sees_a_long_line(tmp_path, monkeypatch):
    (tmp_path / "rloo.py").write_text(source("rloo") + "# " + "x" * 99 + "\n")
    monkeypatch.setattr(sys.modules[__name__], "RECIPES_DIR", tmp_path)
    with pytest.raises(AssertionError, match=r"rloo.py: lines over 100 characters .*101\)\]"):
        test_every_recipe_line_fits_in_100_columns("rloo")


def test_docs_algorithms_md_shows_the_current_drift_table():
    doc = (RECIPES_DIR.parent / "docs" / "algorithms.md").read_text()
    assert drift_table() in doc, "docs/algorithms.md: paste the output of `python tests/test_recipe_drift.py` into its drift table"


def region(src: str) -> list[str]:
    """Each line's part of the file: header, imports + Config, make_actor_loss, main (ALGO LOGIC), main, other."""
    tree, lines = ast.parse(src), src.splitlines()
    out = ["other"] * len(lines)
    doc = tree.body[0]
    for i in range(doc.lineno, doc.end_lineno + 1):
        out[i - 1] = "header"
    for node in tree.body[1:]:
        if isinstance(node, (ast.Import, ast.ImportFrom, ast.ClassDef)):
            part = "Config"
        elif isinstance(node, ast.FunctionDef) and node.name == "main":
            part = "main"
        elif isinstance(node, ast.FunctionDef):
            part = "losses"
        else:
            continue
        start = node.lineno
        while start > 1 and lines[start - 2].lstrip().startswith("#"):  # the comment above a definition belongs to it
            start -= 1
        for i in range(start, node.end_lineno + 1):
            out[i - 1] = part
    if any(isinstance(n, ast.FunctionDef) and n.name == "main" for n in tree.body):
        for i in own_lines(src, function(src, "main")):
            out[i - 1] = "main: ALGO LOGIC + checks"
    return out


def drift_table() -> str:
    """Markdown: per recipe, the non-blank lines added (+) and removed (-) against grpo.py, by part of the file."""
    parts = ["header", "Config", "losses", "main: ALGO LOGIC + checks", "main"]
    grpo = source("grpo")
    rows = [
        "| recipe | header docstring | imports + Config | loss functions | main: ALGO LOGIC + config checks | main: the rest |",
        "|---|---|---|---|---|---|",
    ]
    for name in RECIPES:
        mine = source(name)
        a, b = grpo.splitlines(), mine.splitlines()
        ra, rb = region(grpo), region(mine)
        plus, minus = dict.fromkeys(parts, 0), dict.fromkeys(parts, 0)
        for op, i1, i2, j1, j2 in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes():
            if op != "equal":
                for i in (i for i in range(i1, i2) if a[i].strip()):  # blank lines aside
                    minus[ra[i]] = minus.get(ra[i], 0) + 1
                for j in (j for j in range(j1, j2) if b[j].strip()):
                    plus[rb[j]] = plus.get(rb[j], 0) + 1
        cells = [f"+{plus[p]} −{minus[p]}" if plus[p] or minus[p] else "=" for p in parts]
        rows.append(f"| `{name}.py` | " + " | ".join(cells) + " |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(drift_table())
