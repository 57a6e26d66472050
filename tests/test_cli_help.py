"""Every command's --help reads like a well-kept CLI's at 80 columns: prose reflowed, flags shown as
flags (no ``<bool>`` value), option names never cut, and an example to copy."""

from __future__ import annotations

import pytest
import typer
from typer.testing import CliRunner

from dllm_align.cli.app import app


def _commands() -> list[tuple[str, ...]]:
    out = []
    for name, cmd in typer.main.get_command(app).commands.items():
        if hasattr(cmd, "commands"):
            out += [(name, sub) for sub in cmd.commands]
        else:
            out.append((name,))
    return sorted(out)


def _help(monkeypatch, *words: str) -> str:
    monkeypatch.setenv("COLUMNS", "80")
    monkeypatch.delenv("TERMINAL_WIDTH", raising=False)
    r = CliRunner().invoke(app, [*words, "--help"])
    assert r.exit_code == 0, r.output
    return r.output


@pytest.mark.parametrize("words", _commands(), ids=" ".join)
def test_help_at_80_columns(monkeypatch, words):
    text = _help(monkeypatch, *words)
    assert "…" not in text, f"dllm-align {' '.join(words)} --help cuts a name or text at 80 columns:\n{text}"
    flag_lines = [line for line in text.splitlines() if "<bool>" in line and "--help" not in line]
    assert not flag_lines, f"boolean flags shown with a value: {flag_lines}"
    assert "Example" in text, f"dllm-align {' '.join(words)} --help has no example"


def test_prose_is_reflowed_not_ragged(monkeypatch):
    # judge's docstring wraps "A wins only if" / "both orders prefer it" at 80 columns in the source;
    # the help joins the lines of a paragraph, so no line of it ends after one or two words.
    text = _help(monkeypatch, "judge")
    body = text.split("╭")[0]
    short = [line for line in body.splitlines() if 0 < len(line.strip()) <= 12 and not line.strip().startswith(("Usage", "Example"))]
    assert not short, f"ragged lines in judge --help: {short}"


def test_defaults_are_shown(monkeypatch):
    text = _help(monkeypatch, "judge")
    assert "[default:" in text


def test_flag_defaults_come_from_the_schema(monkeypatch):
    # --help shows the recipe key a flag sets and the schema's default (the recipe's value wins), read from the
    # schema itself: a changed default shows at once.
    from dllm_align.config.schema import FAST_THRESHOLD, JudgeSection, OnlineSection

    judge = " ".join(_help(monkeypatch, "judge").split())
    assert f"judge.concurrency, {JudgeSection().concurrency}" in judge
    assert f"judge.bootstrap, {JudgeSection().bootstrap}" in judge
    online = " ".join(_help(monkeypatch, "online").split())
    assert f"online.rounds, {OnlineSection().rounds}" in online
    generate = " ".join(_help(monkeypatch, "generate").split())
    assert f"threshold {FAST_THRESHOLD}" in generate and "generate.gen_length, 512" in generate


def test_set_is_declared_once():
    import ast
    from pathlib import Path

    import dllm_align.cli as cli

    declared = []
    for path in Path(cli.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and node.value == "--set":
                declared.append(path.name)
    assert declared == ["app.py"]
