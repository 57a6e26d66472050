"""The demo's toy task: deterministic data and an exact rule judge."""

from __future__ import annotations

from dllm_align.data import toy
from dllm_align.judge.run import get_rule


def test_splits_deterministic_and_disjoint():
    a = toy.splits(toy.ToySpec(n_train=300, n_test=50, seed=4))
    b = toy.splits(toy.ToySpec(n_train=300, n_test=50, seed=4))
    assert a == b
    assert not set(a["train"]) & set(a["test"])
    assert len(set(a["train"])) == 300 and all(len(d) == 5 for d in a["train"])
    assert toy.splits(toy.ToySpec(n_train=300, n_test=50, seed=5)) != a


def test_rows_and_labels():
    rows = toy.unpaired_rows(["31415"], "train")
    assert [(r["completion"], r["label"]) for r in rows] == [("11345", True), ("54311", False)]
    pairs = toy.paired_rows(["31415"], "test")
    assert pairs[0]["chosen"] == "11345" and pairs[0]["rejected"] == "54311"
    assert pairs[0]["prompt"] == [{"role": "user", "content": "sort: 31415"}]


def test_score_and_rule_registered():
    p = [{"role": "user", "content": "sort: 31415"}]
    assert toy.score(p, "11345") == 5
    assert toy.score(p, "54311") == 1  # only the middle 3 agrees
    assert toy.score("sort: 31415", "1134") == 4  # too short: compared over what is there
    rule = get_rule("sort")
    assert rule("sort: 31415", "11345", "54311", None) == "A"
    assert rule("sort: 31415", "54311", "11345", None) == "B"
    assert rule("sort: 31415", "11345", "11345", None) == "C"
