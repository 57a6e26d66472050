"""The offline-install requirements file says what pyproject.toml says (torch apart, installed first)."""

from __future__ import annotations

import re
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = None

import pytest

REPO = Path(__file__).resolve().parents[1]


def _norm(req: str) -> str:
    return re.sub(r"\s+", "", req).replace('"', "'").lower()


@pytest.mark.skipif(tomllib is None, reason="tomllib needs Python 3.11+ (the same file is read on every 3.11+ CI run)")
def test_runtime_requirements_match_pyproject():
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    want = sorted(_norm(d) for d in deps if not re.match(r"^torch\b", d))
    lines = [ln.split("#", 1)[0].strip() for ln in (REPO / "requirements" / "runtime.txt").read_text().splitlines()]
    got = sorted(_norm(ln) for ln in lines if ln)
    assert got == want, "requirements/runtime.txt and pyproject.toml's dependencies differ: update both together"
    assert any(re.match(r"^torch\b", d) for d in deps)  # torch stays a range in pyproject, installed first
