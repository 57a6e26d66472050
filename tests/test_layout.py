"""The package layout: imports point down the pipeline, and no module grows past ~600 lines unexplained.

Each stage package's docstring says what it may import (``May import: `core`, `config`.``); this test
holds the code to those lines, so the docs and the code cannot drift apart. Nothing in the library
imports ``cli`` (the command line is a thin layer over it), and no two library modules import each
other, even from inside a function.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "src" / "dllm_align"
STAGES = ("core", "config", "data", "models", "objective", "training", "generate", "judge", "evaluate", "online", "serve",
          "workflows")
MAX_LINES = 600


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PKG.rglob("*.py")) if "recipes" not in p.parts and "assets" not in p.parts}


def _imports(path: Path) -> set[str]:
    """Every dllm_align module a file imports, at the top or inside a function."""
    out: set[str] = set()
    mods = _modules()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "dllm_align":
            for alias in node.names:  # `from dllm_align.data import rows` names a module
                sub = f"{node.module}.{alias.name}"
                out.add(sub if sub in mods else node.module)
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.split(".")[0] == "dllm_align"}
    return out


def _package(module: str) -> str:
    """The stage package a module belongs to ("" for the top-level dllm_align, __main__ and the like)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and (PKG / parts[1]).is_dir()) else ""


def _allowed(stage: str) -> set[str]:
    doc = ast.get_docstring(ast.parse((PKG / stage / "__init__.py").read_text())) or ""
    m = re.search(r"May import:(.*)", doc)
    assert m, f"dllm_align.{stage}'s docstring does not say what it may import"
    if "every stage package" in m.group(1):
        return set(STAGES)
    return set(re.findall(r"`(\w+)`", m.group(1)))


def test_every_stage_package_says_what_it_holds_and_may_import():
    found = sorted(p.name for p in PKG.iterdir() if p.is_dir() and (p / "__init__.py").exists())
    assert set(found) - {"cli", "recipes", "assets"} == set(STAGES)
    for stage in STAGES:
        assert _allowed(stage) <= set(STAGES), stage


def test_imports_point_down_the_pipeline():
    bad = []
    for mod, path in _modules().items():
        pkg = _package(mod)
        if pkg in ("cli", ""):
            continue
        allowed = _allowed(pkg) | {pkg}
        for target in _imports(path):
            tpkg = _package(target)
            if tpkg == "cli" or (tpkg and tpkg not in allowed):
                bad.append(f"{mod} imports {target}")
    assert not bad, "imports against the pipeline:\n" + "\n".join(bad)


def test_no_two_library_modules_import_each_other():
    mods = _modules()
    # A package's __init__ holds only its docstring: importing it is no edge.
    inits = {"dllm_align"} | {f"dllm_align.{s}" for s in STAGES}
    graph = {m: {t for t in _imports(p) if t in mods and t != m and t not in inits} for m, p in mods.items() if _package(m) != "cli"}
    state: dict[str, int] = {}
    cycles = []

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        for t in sorted(graph.get(m, ())):
            if _package(t) == "cli" or t not in graph:
                continue
            if state.get(t) == 1:
                cycles.append(" -> ".join(stack[stack.index(t):] + [t]) if t in stack else f"{m} -> {t}")
            elif t not in state:
                visit(t, stack + [t])
        state[m] = 2

    for m in graph:
        if m not in state:
            visit(m, [m])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


@pytest.mark.parametrize("path", sorted(p for p in PKG.rglob("*.py")), ids=lambda p: str(p.relative_to(PKG)))
def test_no_module_past_600_lines_without_a_reason(path):
    lines = len(path.read_text().splitlines())
    if lines <= MAX_LINES:
        return
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    assert "Size:" in doc, f"{path.relative_to(PKG)} has {lines} lines (> {MAX_LINES}) and no 'Size:' reason in its docstring"


# --------------------------------------------------------------------------- seams and comments
OBJECTIVE_NAMES = {"elbo_kto", "sft", "vrpo"}
ISSUE_OR_SPEC = re.compile(r"SPEC\.md|\b[Ii]ssue #?[0-9]+|\b[Dd]efect #?[0-9]+")


def _named(node: ast.AST) -> set[str]:
    """The names and attribute names an expression mentions (``train.objective`` -> {"train", "objective"})."""
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)} | {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)}


def objective_name_comparisons(source: str) -> list[int]:
    """Lines that compare something called ``objective`` or an objective's name: a choice only objective/ may make."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Compare):
            continue
        sides = [node.left, *node.comparators]
        names = set().union(*(_named(s) for s in sides))
        consts = {c.value for s in sides for c in ast.walk(s) if isinstance(c, ast.Constant) and isinstance(c.value, str)}
        if "objective" in names or consts & OBJECTIVE_NAMES:
            out.append(node.lineno)
    return out


def block_size_branches(source: str) -> list[int]:
    """Lines whose ``if`` / ``while`` / conditional expression tests ``block_size``: the likelihood's choice."""
    return [n.lineno for n in ast.walk(ast.parse(source))
            if isinstance(n, (ast.If, ast.IfExp, ast.While)) and "block_size" in _named(n.test)]


def test_src_points_to_the_design_page_not_outside_nor_to_issues():
    """Comments point to docs/design.md (a clone has it) and say why, not which issue asked."""
    bad = [f"{p.relative_to(PKG.parent)}:{i}: {line.strip()}"
           for p in sorted(PKG.rglob("*")) if p.is_file() and p.suffix in (".py", ".yaml", ".yml", ".md", ".txt", ".json")
           for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1) if ISSUE_OR_SPEC.search(line)]
    assert not bad, "src/ points to SPEC.md or narrates an issue:\n" + "\n".join(bad)


def test_only_objective_and_config_compare_on_the_objective_name():
    bad = [f"{mod}:{line}" for mod, path in _modules().items() if _package(mod) not in ("objective", "config")
           for line in objective_name_comparisons(path.read_text())]
    assert not bad, "a comparison on the objective's name outside objective/ and config/ (ask the Objective):\n" + "\n".join(bad)


def test_elbo_and_the_memory_model_do_not_branch_on_block_size():
    bad = [f"{rel}:{line}" for rel in ("objective/elbo.py", "training/memory.py")
           for line in block_size_branches((PKG / rel).read_text())]
    assert not bad, "a block_size branch (ask the family's Likelihood):\n" + "\n".join(bad)


def test_the_guards_catch_what_they_are_for():
    """Each guard finds a planted violation, so an empty result above means something."""
    assert objective_name_comparisons('if train.objective == "sft":\n    pass\n') == [1]
    assert objective_name_comparisons('x = 1 if name != "vrpo" else 2\n') == [1]
    assert objective_name_comparisons('ok = "elbo_kto" in names\n') == [1]
    assert objective_name_comparisons('if objective.needs_reference:\n    pass\n') == []
    assert block_size_branches("if cfg.block_size:\n    pass\n") == [1]
    assert block_size_branches("n = a if block_size else b\n") == [1]
    assert block_size_branches("n = likelihood.count(block_size=8)\n") == []
    assert ISSUE_OR_SPEC.search("see SPEC.md section 5") and ISSUE_OR_SPEC.search("(issue 13, defect 8)")
    assert not ISSUE_OR_SPEC.search("BUILTIN_SPECS and SPECIAL_TOKENS")


# --------------------------------------------------------------------------- no issue numbers outside src/ either
# The src/ pattern plus "SPEC 4" / "SPEC §7": a section number of a spec a clone does not have.
NARRATION = re.compile(ISSUE_OR_SPEC.pattern + r"|\bSPEC ?§? ?[0-9]+")
NARRATION_FOLDERS = ("recipes", "benchmarks", "docs", "tests")
TEXT_SUFFIXES = (".py", ".yaml", ".yml", ".md", ".txt", ".json", ".toml", ".sh", ".cfg", ".ini")


def narrations(root: Path) -> list[str]:
    """Lines under ``root``'s recipes/, benchmarks/, docs/ and tests/ that name an issue, a defect or a SPEC section.
    This file is left out: it holds the pattern and the planted examples that prove it works."""
    out = []
    for folder in NARRATION_FOLDERS:
        for p in sorted((root / folder).rglob("*")):
            if not p.is_file() or p.suffix not in TEXT_SUFFIXES or p.resolve() == Path(__file__).resolve():
                continue
            for i, line in enumerate(p.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
                if NARRATION.search(line):
                    out.append(f"{p.relative_to(root)}:{i}: {line.strip()[:160]}")
    return out


def test_recipes_benchmarks_docs_and_tests_say_why_not_which_issue():
    """As in src/: a comment says why, a doc says what; an issue number means nothing to a reader of a clone.
    CHANGELOG.md (the repository's root, a history) is not under these folders."""
    bad = narrations(PKG.parents[1])
    assert not bad, "an issue, defect or SPEC section named:\n" + "\n".join(bad)


def test_the_narration_guard_catches_what_it_is_for(tmp_path):
    (tmp_path / "recipes").mkdir()
    (tmp_path / "recipes" / "r.yaml").write_text("beta: 0.1  # see SPEC " + "4\n")
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "p.md").write_text("fine\n(SPEC §" + "7)\n")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_x.py").write_text('"""Issue ' + '22, item 8"""\n# tests/dist.py SPEC.json\n')
    assert [b.split(":")[0:2] for b in narrations(tmp_path)] == [
        ["recipes/r.yaml", "1"], ["docs/p.md", "2"], ["tests/test_x.py", "1"]]
