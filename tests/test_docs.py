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
