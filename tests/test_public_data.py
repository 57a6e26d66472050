"""The kto-mix-14k test split for tests and benchmarks (dllm_align.data.public): found beside
the checkout, in the cache, or through `datasets`; otherwise a one-line reason."""

from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest

from conftest import REPO
from dllm_align.data.public import Unavailable, kto_mix_test, pair_rows


def test_pairing_the_hub_rows_rebuilds_the_two_files(shared_data):
    chosen = [json.loads(x) for x in (shared_data / "chosen.jsonl").read_text(encoding="utf-8").splitlines()]
    rejected = [json.loads(x) for x in (shared_data / "rejected.jsonl").read_text(encoding="utf-8").splitlines()]
    # the hub's layout: one unpaired row per completion, each prompt twice, labels mixed
    rows = []
    for c, r in zip(chosen, rejected):
        pair = [{"prompt": c["prompt"], "completion": c["completion"], "label": True},
                {"prompt": r["prompt"], "completion": r["completion"], "label": False}]
        random.Random(c["id"]).shuffle(pair)
        rows += pair
    got_c, got_r = pair_rows(rows)
    assert got_c == chosen and got_r == rejected


def test_pairs_share_a_prompt_and_unmatched_rows_are_left_out():
    rows = [
        {"prompt": "p", "completion": "bad", "label": False},
        {"prompt": "q", "completion": "only good", "label": True},
        {"prompt": "p", "completion": "good", "label": True},
    ]
    c, r = pair_rows(rows)
    assert c == [{"id": 1, "prompt": "p", "completion": "good"}]
    assert r == [{"id": 1, "prompt": "p", "completion": "bad"}]


def test_unavailable_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("DLLM_ALIGN_KTO_MIX_TEST", str(tmp_path))
    with pytest.raises(Unavailable) as e:
        kto_mix_test(REPO)
    assert str(tmp_path) in str(e.value) and "\n" not in str(e.value)
    monkeypatch.delenv("DLLM_ALIGN_KTO_MIX_TEST")
    monkeypatch.setenv("DLLM_ALIGN_CACHE", str(tmp_path / "cache"))
    with pytest.raises(Unavailable) as e:
        kto_mix_test(tmp_path / "clone", allow_download=False)  # nothing beside a fresh clone
    assert "\n" not in str(e.value)


def test_padding_benchmark_skips_with_a_reason_when_the_data_cannot_be_had(tmp_path):
    import os

    env = dict(os.environ, DLLM_ALIGN_KTO_MIX_TEST=str(tmp_path))
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "run.py"), "--only", "padding"],
        capture_output=True, text=True, timeout=120, env=env,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    row = next(line for line in proc.stdout.splitlines() if line.startswith("| padding_ratio |"))
    assert row.rstrip().endswith("| skipped |") and "kto-mix-14k test split unavailable" in row
