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
STAGES = ("core", "config", "data", "models", "objective", "training", "generate", "judge", "evaluate", "online", "workflows")
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
