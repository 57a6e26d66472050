"""The package layout: imports point down the pipeline, and no module grows past ~600 lines unexplained.

Each stage package's docstring says what it may import (``May import: `core`, `config`.``); this test
holds the code to those lines, so the docs and the code cannot drift apart. Nothing in the library
imports ``cli`` (the command line is a thin layer over it), and no two library modules import each
other, even from inside a function.
"""

from __future__ import annotations

import ast
import re
import sys
import textwrap
from pathlib import Path

import pytest

from dllm_align.config import components as registry
from dllm_align.generate import sampler  # noqa: F401  (registers the decoding rules, whose names AMBIGUOUS reads)

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
# The declared names (the registry, not a copy): a comparison with one is a choice only the component's own
# package (and config/, which declares the recipe keys) may make.
OBJECTIVE_NAMES = set(registry.names("objective"))
LIKELIHOOD_NAMES = set(registry.names("likelihood"))
FAMILY_NAMES = set(registry.names("family"))
# Decoding rules share some of these names ("llada", "dream", "block"): a bare comparison with one of those is
# flagged only where it speaks of the family or likelihood itself (``fam.name == "dream"``).
AMBIGUOUS = set(registry.names("rule"))
ISSUE_OR_SPEC = re.compile(r"SPEC\.md|\b[Ii]ssue #?[0-9]+|\b[Dd]efect #?[0-9]+")


def _named(node: ast.AST) -> set[str]:
    """The names and attribute names an expression mentions (``train.objective`` -> {"train", "objective"})."""
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)} | {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)}


def name_comparisons(source: str, subject: str, declared: set[str]) -> list[int]:
    """Lines that compare something called ``subject`` or one of the ``declared`` names."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Compare):
            continue
        sides = [node.left, *node.comparators]
        names = set().union(*(_named(s) for s in sides))
        consts = {c.value for s in sides for c in ast.walk(s) if isinstance(c, ast.Constant) and isinstance(c.value, str)}
        about = any(subject[:3] in n.lower() for n in names)
        if subject in names or consts & (declared - AMBIGUOUS) or (about and consts & declared):
            out.append(node.lineno)
    return out


def objective_name_comparisons(source: str) -> list[int]:
    """Lines that compare something called ``objective`` or an objective's name: a choice only objective/ may make."""
    return name_comparisons(source, "objective", OBJECTIVE_NAMES)


def likelihood_name_comparisons(source: str) -> list[int]:
    """Lines that compare something called ``likelihood`` or a likelihood's name (ask the Likelihood instead)."""
    return name_comparisons(source, "likelihood", LIKELIHOOD_NAMES)


def family_name_comparisons(source: str) -> list[int]:
    """Lines that compare a family's name with a family, a name or a model type (ask the Family record instead);
    the decoding rules' names that are also families' ("sdar", "llada2") are compared as rules freely."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Compare):
            continue
        sides = [node.left, *node.comparators]
        names = {n.lower() for n in set().union(*(_named(s) for s in sides))}
        consts = {c.value for s in sides for c in ast.walk(s) if isinstance(c, ast.Constant) and isinstance(c.value, str)}
        about = any("fam" in n for n in names) or names & {"name", "model_type", "get"}
        if consts & FAMILY_NAMES and about and not names & {"rule", "sampler", "block_rule"}:
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


def test_only_objective_and_config_compare_on_a_likelihood_name():
    bad = [f"{mod}:{line}" for mod, path in _modules().items() if _package(mod) not in ("objective", "config")
           for line in likelihood_name_comparisons(path.read_text())]
    assert not bad, "a comparison on a likelihood's name outside objective/ and config/ (ask the Likelihood):\n" + "\n".join(bad)


def test_only_the_families_compare_on_a_family_name():
    bad = [f"{mod}:{line}" for mod, path in _modules().items() if not mod.startswith("models.families")
           for line in family_name_comparisons(path.read_text())]
    assert not bad, "a comparison on a family's name outside models/families/ (ask the Family):\n" + "\n".join(bad)


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
    assert likelihood_name_comparisons('if fam.likelihood == "uniform":\n    pass\n') == [1]
    assert likelihood_name_comparisons('ok = name in ("masked", "block")\n') == [1]
    assert family_name_comparisons('if family_of(model).name == "dream":\n    pass\n') == [1]
    assert family_name_comparisons('x = 1 if fam is not None and fam.name != "sdar" else 2\n') == [1]
    assert family_name_comparisons('if fam.logit_shift:\n    pass\n') == []
    assert family_name_comparisons('if rule == "sdar":\n    pass\n') == []
    assert block_size_branches("if cfg.block_size:\n    pass\n") == [1]
    assert block_size_branches("n = a if block_size else b\n") == [1]
    assert block_size_branches("n = likelihood.count(block_size=8)\n") == []
    assert ISSUE_OR_SPEC.search("see SPEC.md section 5") and ISSUE_OR_SPEC.search("(issue 13, defect 8)")
    assert not ISSUE_OR_SPEC.search("BUILTIN_SPECS and SPECIAL_TOKENS")


# --------------------------------------------------------------------------- the import rule
# Library modules import at the top. A function-level import stays only for a reason the module states once, on
# a module-level comment line of this form (several lines for several reasons):
#
#     # lazy imports: peft, lm_eval: optional extras (pip install dllm-align[lora] / [eval])
#
# and then every function-level import must be of a listed module or a submodule of one (``torch.distributed``
# covers ``torch.distributed.fsdp``). cli/ has its own rule: command modules import typer, the standard library,
# cli.app and the recipe schema at module level and everything else inside the command (tested below).
LAZY_LINE = re.compile(r"^# lazy imports: (?P<modules>[\w.]+(?:, [\w.]+)*): (?P<reason>\S.*)$", re.M)
FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)


def lazy_declarations(source: str) -> dict[str, str]:
    """The modules a module may import inside functions, each with the reason its comment line gives."""
    return {m: hit["reason"] for hit in LAZY_LINE.finditer(source) for m in hit["modules"].split(", ")}


def _function_level(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    found: dict[int, ast.Import | ast.ImportFrom] = {}
    for fn in ast.walk(tree):
        if isinstance(fn, FUNCTIONS):
            found.update({id(n): n for n in ast.walk(fn) if isinstance(n, (ast.Import, ast.ImportFrom))})
    return sorted(found.values(), key=lambda n: (n.lineno, n.col_offset))


def _targets(node: ast.Import | ast.ImportFrom) -> list[tuple[str, str]]:
    """(module, the name it binds) per alias; ``from a import b`` counts as module ``a.b`` (b may be a module)."""
    if isinstance(node, ast.Import):
        return [(a.name, a.asname or a.name.split(".")[0]) for a in node.names]
    base = node.module or ""
    return [(f"{base}.{a.name}", a.asname or a.name) for a in node.names]


def _covered(module: str, declared: set[str]) -> bool:
    return any(module == d or module.startswith(d + ".") for d in declared)


def function_level_imports(source: str) -> list[tuple[int, str]]:
    """(line, module) of every import inside a function."""
    return [(node.lineno, mod) for node in _function_level(ast.parse(source)) for mod, _ in _targets(node)]


def unjustified_imports(source: str) -> list[str]:
    """Function-level imports of a module the module's ``# lazy imports:`` lines do not list."""
    declared = set(lazy_declarations(source))
    return [f"{line}: {mod}" for line, mod in function_level_imports(source)
            if not (_covered(mod, declared) or _covered(mod.rpartition(".")[0], declared))]


def unused_declarations(source: str) -> list[str]:
    """Declared lazy modules no function imports: a stale reason."""
    mods = [m for _, m in function_level_imports(source)]
    return [d for d in lazy_declarations(source) if not any(_covered(m, {d}) or _covered(m.rpartition(".")[0], {d}) for m in mods)]


def reimports(source: str) -> list[str]:
    """Function-level imports that bind a name the module already imports at the top."""
    tree = ast.parse(source)
    inner = _function_level(tree)
    top = {bound for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom)) and node not in inner
           for _, bound in _targets(node)}
    return [f"{node.lineno}: {bound}" for node in inner for _, bound in _targets(node) if bound in top]


def private_imports(source: str, module: str, modules: set[str]) -> list[str]:
    """Private names (``_x``) this module takes from another module of the project: by import, or as an
    attribute of a project module it imported (``from dllm_align.core import io`` ... ``io._fsync_dir``)."""
    tree = ast.parse(source)
    out, aliases = [], {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "dllm_align":
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                if sub in modules:
                    aliases[a.asname or a.name] = sub
                elif a.name.startswith("_") and not a.name.startswith("__") and node.module != module:
                    out.append(f"{node.lineno}: {node.module}.{a.name}")
        elif isinstance(node, ast.Import):
            aliases.update({a.asname: a.name for a in node.names if a.asname and a.name in modules})
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                and aliases[node.value.id] != module and node.attr.startswith("_") and not node.attr.startswith("__")):
            out.append(f"{node.lineno}: {aliases[node.value.id]}.{node.attr}")
    return out


def _library() -> dict[str, Path]:
    return {m: p for m, p in _modules().items() if _package(m) not in ("cli", "")}


def test_library_modules_import_at_the_top_unless_they_say_why():
    bad = [f"{m}:{hit}" for m, p in _library().items() for hit in unjustified_imports(p.read_text())]
    assert not bad, ("a function-level import with no stated reason (move it to the top, or list the module on a "
                     "'# lazy imports: <modules>: <reason>' line at the module's top):\n" + "\n".join(bad))


def test_every_stated_lazy_import_is_used():
    bad = [f"{m}: {d}" for m, p in _modules().items() for d in unused_declarations(p.read_text())]
    assert not bad, "a '# lazy imports:' line names a module no function imports:\n" + "\n".join(bad)


def test_no_function_reimports_a_name_imported_at_the_top():
    bad = [f"{m}:{hit}" for m, p in _modules().items() for hit in reimports(p.read_text())]
    assert not bad, "a function re-imports a name the module imports at the top:\n" + "\n".join(bad)


def test_no_private_name_is_imported_across_modules():
    mods = set(_modules())
    bad = [f"{m}:{hit}" for m, p in _modules().items() for hit in private_imports(p.read_text(), m, mods)]
    assert not bad, ("a private name used from another module (make it public where it is shared, or merge modules "
                     "whose split is not a seam):\n" + "\n".join(bad))


CLI_MODULE_LEVEL = {"typer", "dllm_align", "dllm_align.cli", "dllm_align.config.schema"}


def cli_module_level_imports(source: str) -> list[str]:
    """A command module's module-level imports of anything but the standard library, typer, cli.app and the schema."""
    tree = ast.parse(source)
    inner = set(map(id, _function_level(tree)))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in inner and getattr(node, "module", "") != "__future__":
            for mod, _ in _targets(node):
                base = mod if isinstance(node, ast.Import) else node.module or ""
                if base.split(".")[0] in sys.stdlib_module_names or _covered(base, CLI_MODULE_LEVEL - {"dllm_align"}) or base == "dllm_align":
                    continue
                out.append(f"{node.lineno}: {base}")
    return out


def test_command_modules_keep_heavy_imports_inside_the_commands():
    bad = [f"{m}:{hit}" for m, p in _modules().items() if _package(m) == "cli" for hit in cli_module_level_imports(p.read_text())]
    assert not bad, "a cli/ module imports at module level what --help must not load:\n" + "\n".join(bad)


def test_the_import_guards_catch_what_they_are_for():
    """Each guard finds a planted violation in a string of source, so an empty result above means something."""
    planted = "import os\n\ndef f():\n    import json\n    from dllm_align.data import toy\n    return json, toy\n"
    assert unjustified_imports(planted) == ["4: json", "5: dllm_align.data.toy"]
    stated = "# lazy imports: json, dllm_align.data: start-up time\n" + planted
    assert unjustified_imports(stated) == [] and unused_declarations(stated) == []
    assert unused_declarations("# lazy imports: peft: optional extra\n") == ["peft"]
    assert unjustified_imports("# lazy imports: torch.distributed: a newer torch name\ndef f():\n"
                               "    from torch.distributed.fsdp import fully_shard\n    import torch\n") == ["4: torch"]
    assert reimports("import json\n\ndef f():\n    import json\n") == ["4: json"]
    assert reimports("def f():\n    import json\n\ndef g():\n    import json\n") == []
    mods = {"dllm_align.data.rows", "dllm_align.core.io"}
    assert private_imports("from dllm_align.data.rows import _Bad, Row\n", "dllm_align.data.load", mods) == ["1: dllm_align.data.rows._Bad"]
    assert private_imports("from dllm_align.data.rows import _Bad\n", "dllm_align.data.rows", mods) == []
    assert private_imports("from dllm_align.core import io\nio._fsync_dir(p)\n", "dllm_align.training.train", mods) == [
        "2: dllm_align.core.io._fsync_dir"]
    assert cli_module_level_imports("import json\nimport typer\nfrom dllm_align.cli.app import command\n") == []
    assert cli_module_level_imports("import torch\nfrom dllm_align.data.load import x\n") == ["1: torch", "2: dllm_align.data.load"]


def import_counts() -> dict[str, int]:
    """The figures the rule is measured by: function-level import statements in library modules (cli/ aside), those
    with no stated reason, those of the project's own modules, re-imports and cross-module private names."""
    lib = {m: p.read_text() for m, p in _library().items()}
    mods = set(_modules())
    return {
        "function-level import statements": sum(len(_function_level(ast.parse(s))) for s in lib.values()),
        "function-level imported names": sum(len(function_level_imports(s)) for s in lib.values()),
        "  of the project's own modules": sum(m.startswith("dllm_align") for s in lib.values() for _, m in function_level_imports(s)),
        "  with no stated reason": sum(len(unjustified_imports(s)) for s in lib.values()),
        "re-imports (all modules)": sum(len(reimports(p.read_text())) for p in _modules().values()),
        "cross-module private names (all modules)": sum(len(private_imports(p.read_text(), m, mods)) for m, p in _modules().items()),
    }




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



# --------------------------------------------------------------------------- function length
# A function a reader cannot take in at once is split into named steps (canvas setup, one step, the commit rule).
MAX_FUNCTION_LINES = 100


def long_functions(source: str, limit: int = MAX_FUNCTION_LINES) -> list[tuple[str, int]]:
    """(qualified name, lines from ``def`` to its last line) of every function or method longer than ``limit``;
    a nested function counts in its parent too."""
    out: list[tuple[str, int]] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = prefix + child.name
                if not isinstance(child, ast.ClassDef) and child.end_lineno - child.lineno + 1 > limit:
                    out.append((name, child.end_lineno - child.lineno + 1))
                visit(child, name + ".")
            else:
                visit(child, prefix)

    visit(ast.parse(source), "")
    return out


def test_no_function_past_100_lines():
    bad = [f"{p.relative_to(PKG)}: {name} ({n} lines)" for p in sorted(PKG.rglob("*.py"))
           for name, n in long_functions(p.read_text())]
    assert not bad, f"functions over {MAX_FUNCTION_LINES} lines (split them into named steps):\n" + "\n".join(bad)


def test_the_function_length_guard_catches_what_it_is_for():
    body = "".join(f"x{i} = {i}\n" for i in range(99))
    assert long_functions("def f():\n" + textwrap.indent(body, "    ")) == []  # 100 lines: the limit itself passes
    body += "return 1\n"
    assert long_functions("def f():\n" + textwrap.indent(body, "    ")) == [("f", 101)]
    assert long_functions("class C:\n    async def m(self):\n" + textwrap.indent(body, "        ")) == [("C.m", 101)]
    assert long_functions("def outer():\n    def inner():\n" + textwrap.indent(body, "        ")) == [
        ("outer", 102), ("outer.inner", 101)]


if __name__ == "__main__":  # python tests/test_layout.py: the figures above, per rule
    for what, n in import_counts().items():
        print(f"{n:5d}  {what}")
