"""Reading, layouts, validation, unpairing and the class-imbalance tools (dllm_align.data)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dllm_align.data import load_prompts, load_unpaired
from dllm_align.errors import UserError


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def test_load_prompts_text_file(tmp_path):
    p = tmp_path / "prompts.txt"
    p.write_text("What is 2+2?\n\nName a colour.\nWhat is 2+2?\n", encoding="utf-8")
    prompts = load_prompts(p)
    assert [x.messages for x in prompts] == [
        [{"role": "user", "content": "What is 2+2?"}],
        [{"role": "user", "content": "Name a colour."}],
    ]
    # ids are content hashes: the same prompt has the same id in any file
    again = load_prompts(write_lines(tmp_path / "b.txt", ["Name a colour."]))
    assert again[0].id == prompts[1].id


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_load_prompts_shared_rows(shared_data):
    prompts = load_prompts(shared_data, limit=10)
    assert [p.id for p in prompts] == [str(i) for i in range(1, 11)]
    assert prompts[0].messages[-1]["role"] == "user"
    assert len(load_prompts(shared_data)) == 750


def test_load_prompts_unpaired_dedupes(tmp_path):
    f = write_jsonl(
        tmp_path / "u.jsonl",
        [
            {"prompt": "hi", "completion": "hello", "label": True},
            {"prompt": "hi", "completion": "go away", "label": False},
            {"prompt": "bye", "completion": "ciao", "label": True},
        ],
    )
    prompts = load_prompts(f)
    assert [p.messages[0]["content"] for p in prompts] == ["hi", "bye"]
    assert len({p.id for p in prompts}) == 2


def test_shared_rows_read_as_unpaired(shared_data):
    rows = load_unpaired(shared_data)
    assert len(rows) == 1500
    assert sum(r.label for r in rows) == 750
    assert rows[0].id == "1:chosen" and rows[1].id == "1:rejected"
    assert rows[0].pair_id == rows[1].pair_id == "1"
    assert rows[0].prompt == rows[1].prompt


def test_missing_source_is_user_error(tmp_path):
    with pytest.raises(UserError, match="data not found"):
        load_unpaired(tmp_path / "nope.jsonl")
