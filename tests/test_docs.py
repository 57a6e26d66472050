"""The docs resolve: every relative link points at a file that exists, and every `dllm-align COMMAND`
they show names a real command (and a real subcommand of a command group)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import typer

from dllm_align.cli.app import app

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted(
    [ROOT / "README.md", ROOT / "CONTRIBUTING.md", ROOT / "SECURITY.md", ROOT / "CHANGELOG.md", ROOT / "benchmarks" / "README.md"]
    + list((ROOT / "docs").glob("*.md"))
)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
COMMAND = re.compile(r"\bdllm-align((?:[ \t]+[a-z][a-z0-9-]*){1,2})")


def _code(text: str) -> str:
    """The fenced blocks and inline code spans of a page: where a command is shown, not talked about."""
    fenced = re.findall(r"```[^\n]*\n(.*?)```", text, flags=re.S)
    rest = re.sub(r"```.*?```", "", text, flags=re.S)
    return "\n".join(fenced + re.findall(r"`([^`\n]+)`", rest))


def _tree() -> dict[str, set[str] | None]:
    root = typer.main.get_command(app)
    out: dict[str, set[str] | None] = {}
    for name, cmd in root.commands.items():
        out[name] = set(cmd.commands) if hasattr(cmd, "commands") else None
    return out


def test_the_readme_links_every_docs_page():
    readme = (ROOT / "README.md").read_text()
    for page in (ROOT / "docs").glob("*.md"):
        assert f"docs/{page.name}" in readme, f"README.md does not link docs/{page.name}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    bad = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"^(https?:|mailto:|#)", target):
            continue
        path = (page.parent / target.split("#", 1)[0]).resolve()
        if not path.exists():
            bad.append(target)
    assert not bad, f"{page.relative_to(ROOT)}: links to missing files: {bad}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_command_names_resolve(page):
    tree = _tree()
    bad = []
    for words in COMMAND.findall(_code(page.read_text())):
        first, *rest = words.split()
        if first not in tree:
            bad.append(f"dllm-align {first}")
        elif tree[first] is not None and rest and rest[0] not in tree[first] and not rest[0].startswith("-"):
            # a group's next word is its subcommand (a recipe name after a group is an error in the docs)
            bad.append(f"dllm-align {first} {rest[0]}")
    assert not bad, f"{page.relative_to(ROOT)}: unknown commands: {sorted(set(bad))}"


def _slug(heading: str) -> str:
    """A heading's anchor as GitHub renders it: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {_slug(h) for h in re.findall(r"^#{1,6}\s+(.+?)\s*#*\s*$", text, flags=re.M)}


def test_anchors_named_in_the_code_and_docs_exist():
    """Code comments point to `docs/<page>.md#<anchor>`; a renamed heading must not leave them dangling."""
    named = []
    for path in sorted((ROOT / "src").rglob("*.py")):
        for page, anchor in re.findall(r"docs/([\w.-]+\.md)#([\w-]+)", path.read_text()):
            named.append((path.relative_to(ROOT), ROOT / "docs" / page, anchor))
    for page in PAGES:
        for target in LINK.findall(page.read_text()):
            if "#" not in target or re.match(r"^(https?:|mailto:)", target):
                continue
            file, anchor = target.split("#", 1)
            named.append((page.relative_to(ROOT), (page.parent / file).resolve() if file else page, anchor))
    bad = [f"{where}: {target.name}#{anchor}" for where, target, anchor in named
           if not target.exists() or anchor not in _anchors(target)]
    assert not bad, f"links to missing headings: {bad}"


def test_the_design_page_has_its_anchors():
    """The anchors the code points to, by name: the test fails if a heading is renamed."""
    have = _anchors(ROOT / "docs" / "design.md")
    for anchor in ("the-masked-diffusion-elbo", "masks-and-seeds", "the-step-batch", "the-elbo-kto-loss", "baselines",
                   "class-weights", "vrpo", "sft", "the-block-diffusion-elbo", "model-families", "precision", "the-step-0-invariant",
                   "the-reference-cache", "generation", "the-llada-rule", "the-dream-rule", "the-block-rule", "judging",
                   "lc-awr", "errors-and-exit-codes", "atomic-writes-and-resume", "inputs-and-run-folders", "secrets",
                   "untrusted-code-and-files", "standard-output-and-standard-error"):
        assert anchor in have, anchor


# --------------------------------------------------------------------------- code the docs name
PKG = ROOT / "src" / "dllm_align"
CODE_PAGES = [p for p in PAGES if p.name != "CHANGELOG.md"]  # the changelog is a history: it names code as it was
# `src/dllm_align/objective/uniform.py`, or a package-relative `objective/uniform.py`, optionally `: name`
CODE_PATH = re.compile(r"(?<![\w./-])(?:src/dllm_align/)?((?:%s)/[\w/]*?\w+\.py)(?::\s*`?(\w+))?" % "|".join(
    sorted(p.name for p in PKG.iterdir() if p.is_dir() and (p / "__init__.py").exists())))
MODULE = re.compile(r"\bdllm_align((?:\.\w+)+)(\*?)")
# the recipes ship as the package dllm_align.recipes from the repository's recipes/ (pyproject.toml's package-dir)
PACKAGE_DIRS = {"recipes": ROOT / "recipes"}


def _defines(path: Path, name: str, prefix: bool = False) -> bool:
    """``name`` (with ``prefix``: a name starting so, as in `atomic_write_*`) is defined in the module at ``path`` (a
    def, a class or an assignment at any depth), not only imported."""
    end = r"\w*" if prefix else r"\b"
    return re.search(rf"^\s*(?:async\s+def|def|class)\s+{name}{end}|^\s*{name}{end}\s*[:=]", path.read_text(),
                     flags=re.M) is not None


def code_pointer_problems(text: str) -> list[str]:
    """The module paths, `path: name` pairs and `dllm_align.x.y` names in ``text`` that do not exist in src/."""
    bad = []
    for rel, name in CODE_PATH.findall(text):
        path = PKG / rel
        if not path.is_file():
            bad.append(rel)
        elif name and not _defines(path, name):
            bad.append(f"{rel}: {name} (not defined there)")
    for dotted, star in MODULE.findall(text):
        parts = dotted.strip(".").split(".")
        at, i = PKG, 0
        if parts[0] in PACKAGE_DIRS:
            at, i = PACKAGE_DIRS[parts[0]], 1
        while i < len(parts) and ((at / parts[i]).is_dir() or (at / f"{parts[i]}.py").is_file()):
            at = at / parts[i] if (at / parts[i]).is_dir() else at / f"{parts[i]}.py"
            i += 1
        if i == 0:
            bad.append(f"dllm_align{dotted}")
        elif i < len(parts):
            module = at / "__init__.py" if at.is_dir() else at
            if not _defines(module, parts[i], prefix=bool(star) and i == len(parts) - 1):
                bad.append(f"dllm_align{dotted}")
    return bad


@pytest.mark.parametrize("page", CODE_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_code_the_docs_name_exists(page):
    """A module path, a `path: name` pair or a `dllm_align.x.y` name in the docs is a pointer too: it must exist, and
    the name must be defined in that module (re-exported is not where a reader finds it)."""
    bad = code_pointer_problems(page.read_text())
    assert not bad, f"{page.relative_to(ROOT)}: names code that is not there: {sorted(set(bad))}"


def test_anchors_named_outside_src_exist():
    """Tests, recipes and benchmarks point to `docs/<page>.md#<anchor>` as src/ does; those anchors must exist too."""
    bad = []
    for folder in ("tests", "recipes", "benchmarks"):
        for path in sorted((ROOT / folder).rglob("*")):
            if path.suffix not in (".py", ".yaml", ".yml", ".md") or not path.is_file():
                continue
            for page, anchor in re.findall(r"docs/([\w.-]+\.md)#([\w-]+)", path.read_text(encoding="utf-8")):
                target = ROOT / "docs" / page
                if not target.exists() or anchor not in _anchors(target):
                    bad.append(f"{path.relative_to(ROOT)}: {page}#{anchor}")
    assert not bad, f"links to missing headings: {bad}"


def test_the_code_pointer_check_catches_what_it_is_for():
    assert code_pointer_problems("`objective/elbo.py: exact_elbo`") == ["objective/elbo.py: exact_elbo (not defined there)"]
    assert code_pointer_problems("`objective/masked.py: exact_elbo`, `src/dllm_align/objective/uniform.py`") == []
    assert code_pointer_problems("see `objective/nowhere.py`") == ["objective/nowhere.py"]
    assert code_pointer_problems("`dllm_align.objective.uniform.per_token_nelbo`, `dllm_align.config`") == []
    assert code_pointer_problems("`dllm_align.families.llada_moe`") == ["dllm_align.families.llada_moe"]
