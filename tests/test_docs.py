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
