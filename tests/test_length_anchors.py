"""Length anchors for the LC-AWR: the rewrite step against the 127.0.0.1 test judge server, and the fit
with anchors and with the instruction-difficulty term (:func:`dllm_align.judge.stats.lc_estimate`)."""

from __future__ import annotations

import numpy as np
import pytest

from dllm_align.judge import stats
from dllm_align.judge.client import ChatClient
from dllm_align.judge.anchors import rewrite_for_length
from judge_server import JudgeServer

KEY = "sk-test"


def test_the_judge_model_rewrites_the_baselines_answers_verbose_and_concise():
    def reply(content: str, n_messages: int) -> str:
        answer = content.split("[Answer]\n", 1)[1]
        if "p2" in answer:
            return "   "  # an empty rewrite: no anchor row for that prompt
        return answer * 3 if "much longer" in content else answer[: max(1, len(answer) // 3)]

    prompts = [f"question {i}" for i in range(4)]
    answers = [f"the answer p{i} is long enough to shorten" for i in range(4)]
    with JudgeServer(KEY) as srv:
        srv.absolute = reply
        client = ChatClient(srv.url, KEY, max_retries=0)
        try:
            verbose = rewrite_for_length(client, "judge-1", prompts, answers, "verbose", {"temperature": 0.0})
            concise = rewrite_for_length(client, "judge-1", prompts, answers, "concise", {"temperature": 0.0})
        finally:
            client.close()
        asked = [x for x in srv.log if x.get("model") == "judge-1"]
    assert verbose[2] is None and concise[2] is None
    for i in (0, 1, 3):
        assert len(verbose[i]) == 3 * len(answers[i]) and 0 < len(concise[i]) < len(answers[i])
        assert verbose[i].startswith(answers[i])
    assert len(asked) == 8  # one request per prompt and style


def test_an_unknown_style_is_refused():
    from dllm_align.core.errors import UserError

    with pytest.raises(UserError, match="unknown style"):
        rewrite_for_length(None, "m", ["q"], ["a"], "shouty", {})


def _length_loving(seed: int, n: int = 300, bias: float = 2.0):
    """A judge that prefers the longer answer (and nothing else) on data where A is longer on every
    prompt, with anchors: B rewritten longer and shorter, judged by the same judge."""
    rng = np.random.default_rng(seed)
    lb = rng.integers(300, 900, n).astype(float)
    la = lb + rng.integers(50, 400, n)

    def outcome(d):
        p = 1 / (1 + np.exp(-bias * np.tanh(d / 200)))
        a1, a2 = rng.random(n) < p, rng.random(n) < p
        return np.where(a1 & a2, 1, np.where(~a1 & ~a2, -1, 0))

    anchors = []
    for sign in (1, -1):
        lr = np.maximum(lb + sign * rng.integers(50, 400, n), 1)
        anchors.append((outcome(lr - lb).tolist(), lr.tolist()))
    return outcome(la - lb), la, lb, anchors


def test_anchors_identify_the_slope_when_every_prompt_lies_on_one_side():
    o, la, lb, anchors = _length_loving(0)
    assert stats.awr(o) > 0.7
    bare = stats.lc_estimate(o, la, lb, n_resamples=50)
    assert bare["lc_awr"] is None and "add length anchors" in bare["withheld"]
    e = stats.lc_estimate(o, la, lb, anchors=anchors, n_resamples=300, seed=0)
    assert e["withheld"] is None and e["anchors"] == 2
    assert abs(e["lc_awr"] - 0.5) < 0.06 and e["ci90"][0] < 0.5 < e["ci90"][1]  # the truth: no quality gap


def test_missing_anchor_rows_are_left_out_and_bad_anchors_refused():
    o, la, lb, anchors = _length_loving(1, n=60)
    (oa, lr), second = anchors
    oa = [None if i % 5 == 0 else v for i, v in enumerate(oa)]
    e = stats.lc_estimate(o, la, lb, anchors=[(oa, lr), second], n_resamples=20)
    assert e["lc_awr"] is not None
    with pytest.raises(ValueError, match="one outcome and one length per prompt"):
        stats.lc_estimate(o, la, lb, anchors=[(oa[:-1], lr)], n_resamples=1)


def test_the_difficulty_term_averages_over_prompts():
    # outcome = a second model's outcome on the same prompt (hard prompts lost by both), equal lengths
    # on half the prompts: the fit with the difficulty term predicts the mean of sigmoid(theta + psi g)
    rng = np.random.default_rng(2)
    n = 400
    g = rng.choice([1, 0, -1], n)
    o = np.where(rng.random(n) < 0.8, g, rng.choice([1, 0, -1], n))
    lb = rng.integers(300, 900, n).astype(float)
    la = lb + rng.integers(-200, 200, n)
    e = stats.lc_estimate(o, la, lb, difficulty=g, n_resamples=100)
    plain = stats.lc_estimate(o, la, lb, n_resamples=100)
    assert e["difficulty"] and abs(e["lc_awr"] - plain["lc_awr"]) < 0.03  # length-blind: both near the AWR
    assert abs(e["lc_awr"] - stats.awr(o)) < 0.03
    with pytest.raises(ValueError, match="one difficulty outcome per prompt"):
        stats.lc_estimate(o, la, lb, difficulty=g[:-1], n_resamples=1)


def test_a_published_difficulty_table_is_matched_by_the_instruction_text():
    prompts = ["Name three rivers.", "  Why is the sky blue?\n", "Write a haiku."]
    table = {stats.instruction_key(p.strip()): v for p, v in zip(prompts, (0.5, -1.25, 2.0))}
    table[stats.instruction_key("another prompt")] = 9.0
    g, matched = stats.difficulty_lookup(prompts[::-1], table)  # the data set's order, not the table's
    assert matched == 3 and g.tolist() == [2.0, -1.25, 0.5]
    assert stats.instruction_key("a b") != stats.instruction_key("a  b")  # only the ends are stripped
    # one prompt outside the table: no term at all (a mix would read as easy and hard prompts)
    g, matched = stats.difficulty_lookup([*prompts, "a prompt of our own"], table)
    assert g is None and matched == 3
    assert stats.difficulty_lookup([], table) == (None, 0)


def _with_difficulty(seed: int, n: int, a_longer_share: float):
    """A judge that sees quality and instruction difficulty, and likes length a little; A longer on the given share."""
    rng = np.random.default_rng(seed)
    g = rng.normal(0.0, 1.0, n)
    lb = rng.integers(400, 900, n).astype(float)
    mag = rng.integers(50, 400, n)
    la = lb + np.where(rng.random(n) < a_longer_share, mag, -mag)
    z = -0.3 + 1.5 * g + 0.5 * np.tanh((la - lb) / 300)
    p = 1 / (1 + np.exp(-z))
    a1, a2 = rng.random(n) < p, rng.random(n) < p
    return np.where(a1 & a2, 1, np.where(~a1 & ~a2, -1, 0)), la, lb, g


def test_the_giving_rule_with_a_published_difficulty_table():
    # lengths lopsided (A longer on 4%): VIF between LC_MAX_VIF and LC_DIFFICULTY_MAX_VIF; withheld by the
    # rule without a published table, given with one
    o, la, lb, g = _with_difficulty(0, 800, 0.04)
    with_table = stats.lc_estimate(o, la, lb, difficulty=g, published_difficulty=True, n_resamples=200)
    second_model = stats.lc_estimate(o, la, lb, difficulty=g, n_resamples=200)
    assert stats.LC_MAX_VIF < with_table["vif"] <= stats.LC_DIFFICULTY_MAX_VIF
    assert with_table["lc_awr"] is not None and with_table["withheld"] is None
    assert with_table["ci90"][1] - with_table["ci90"][0] <= stats.LC_MAX_CI_WIDTH
    assert second_model["lc_awr"] is None and "variance inflation" in second_model["withheld"]
    # every prompt on one side: not identified, whatever the table
    o, la, lb, g = _with_difficulty(1, 800, 1.0)
    e = stats.lc_estimate(o, la, lb, difficulty=g, published_difficulty=True, n_resamples=50)
    assert e["lc_awr"] is None and e["vif"] > stats.LC_DIFFICULTY_MAX_VIF
    # balanced but few prompts: the interval is wider than LC_MAX_CI_WIDTH, so the figure is withheld
    o, la, lb, g = _with_difficulty(2, 24, 0.5)
    e = stats.lc_estimate(o, la, lb, difficulty=g, published_difficulty=True, n_resamples=200)
    assert e["vif"] <= stats.LC_DIFFICULTY_MAX_VIF and e["lc_awr"] is None and "points wide" in e["withheld"]
    wide = stats.lc_estimate(o, la, lb, difficulty=g, n_resamples=200)  # a second model's outcomes: no width bound
    assert wide["lc_awr"] is not None and wide["ci90"][1] - wide["ci90"][0] > stats.LC_MAX_CI_WIDTH
    with pytest.raises(ValueError, match="finite"):
        stats.lc_estimate(o, la, lb, difficulty=np.full(len(o), np.nan), n_resamples=1)
    with pytest.raises(ValueError, match="needs the difficulty"):
        stats.lc_estimate(o, la, lb, published_difficulty=True, n_resamples=1)


def _gen(path, answers):
    import json

    path.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"question {i}", "completion": a}) + "\n"
                            for i, a in enumerate(answers)))
    return path


def test_judge_with_length_anchors_and_difficulty_end_to_end(tmp_path, monkeypatch):
    """`judge --length-anchors`: the judge model rewrites B verbose and concise, each rewrite is judged against
    B, and the anchors enter the LC fit; rewrites and verdicts are cached (a rerun asks nothing). A is longer
    on every prompt and the judge likes only length: without anchors the LC figure is withheld, with them
    it is given. `--difficulty-from` reads a second model's outcomes."""
    import json
    import re

    from reliability import run_cli

    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    rng = np.random.default_rng(0)
    n = 60
    b = ["b" * int(k) for k in rng.integers(20, 60, n)]
    a = [x + "a" * int(k) for x, k in zip(b, rng.integers(5, 40, n))]

    def reply(content: str, n_messages: int) -> str:
        if "Rewrite the answer below" in content:
            answer = content.split("[Answer]\n", 1)[1]
            return answer * 2 if "much longer" in content else answer[: max(1, len(answer) // 2)]
        first = re.search(r"<answer_a>\n(.*?)\n</answer_a>", content, re.S).group(1)
        second = re.search(r"<answer_b>\n(.*?)\n</answer_b>", content, re.S).group(1)
        return "[[A]]" if len(first) > len(second) else "[[B]]" if len(second) > len(first) else "[[C]]"

    fa, fb = _gen(tmp_path / "a.jsonl", a), _gen(tmp_path / "b.jsonl", b)
    with JudgeServer(KEY) as srv:
        srv.absolute = reply
        base = ["judge", fa, fb, "--judge", "j1", "--base-url", srv.url, "--bootstrap", "200", "--json"]
        plain = run_cli([*base, "-o", tmp_path / "plain"])
        assert plain.code == 0, plain.err
        r = run_cli([*base, "-o", tmp_path / "anch", "--length-anchors"])
        assert r.code == 0, r.err
        asked = len(srv.log)
        again = run_cli([*base, "-o", tmp_path / "anch", "--length-anchors"])
        assert again.code == 0 and len(srv.log) == asked
        diff = run_cli([*base, "-o", tmp_path / "diff", "--length-anchors", "--difficulty-from", tmp_path / "plain"])
        assert diff.code == 0, diff.err
    p = json.loads(plain.out)["judges"]["j1"]
    q = json.loads(r.out)["judges"]["j1"]
    assert p["awr"] == 1.0 and p["lc_awr"] is None and p["lc_withheld"]
    assert q["lc_awr"] is not None and q["lc_anchor_rows"] == 2 * n
    assert json.loads(r.out)["settings"]["length_anchors"] == "j1"
    rewrites = [json.loads(x) for x in (tmp_path / "anch" / "anchors" / "rewrites.jsonl").read_text().splitlines()]
    assert len(rewrites) == 2 * n and {x["style"] for x in rewrites} == {"verbose", "concise"}
    d = json.loads(diff.out)["judges"]["j1"]
    assert d["lc_difficulty_missing"] == 0 and d["lc_awr"] is not None
    bad = run_cli(["judge", fa, fb, "--judge", "rule:sort", "-o", tmp_path / "r", "--length-anchors"])
    assert bad.code == 2 and "--anchors-model" in bad.err


def test_judge_with_a_difficulty_table_end_to_end(tmp_path, monkeypatch):
    """`judge --difficulty-table`: the table enters the LC fit when every prompt is in it (matched by text),
    and results.json records where the term came from; a table missing a prompt leaves the term out, said so."""
    import json
    import re

    from reliability import run_cli

    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    rng = np.random.default_rng(3)
    n = 80
    b = ["b" * int(k) for k in rng.integers(20, 60, n)]
    a = ["a" * int(k) for k in rng.integers(10, 90, n)]
    hard = {i for i in range(n) if i % 3 == 0}

    def reply(content: str, n_messages: int) -> str:  # B wins the hard prompts, length decides the rest
        i = int(re.search(r"question (\d+)", content).group(1))
        first = re.search(r"<answer_a>\n(.*?)\n</answer_a>", content, re.S).group(1)
        second = re.search(r"<answer_b>\n(.*?)\n</answer_b>", content, re.S).group(1)
        if i in hard:
            return "[[A]]" if first.startswith("b") else "[[B]]"
        return "[[A]]" if len(first) > len(second) else "[[B]]" if len(second) > len(first) else "[[C]]"

    full, partial = tmp_path / "difficulty.csv", tmp_path / "partial.csv"
    full.write_text("instruction,difficulty\n" + "".join(f"question {i},{-2.0 if i in hard else 0.5}\n" for i in range(n)))
    partial.write_text("instruction_sha256,difficulty\n"
                       + "".join(f"{stats.instruction_key(f'question {i}')},0.0\n" for i in range(n - 1)))
    fa, fb = _gen(tmp_path / "a.jsonl", a), _gen(tmp_path / "b.jsonl", b)
    with JudgeServer(KEY) as srv:
        srv.absolute = reply
        base = ["judge", fa, fb, "--judge", "j1", "--base-url", srv.url, "--bootstrap", "200", "--json"]
        r = run_cli([*base, "-o", tmp_path / "full", "--difficulty-table", full])
        assert r.code == 0, r.err
        p = run_cli([*base, "-o", tmp_path / "partial", "--difficulty-table", partial])
        assert p.code == 0, p.err
        both = run_cli([*base, "-o", tmp_path / "both", "--difficulty-table", full, "--difficulty-from", tmp_path / "full"])
    res = json.loads(r.out)
    note = res["lc_difficulty"]
    assert note["used"] and note["matched"] == n and note["instructions"] == n and len(note["sha256"]) == 64
    assert res["settings"]["difficulty_table"] == str(full)
    assert res["judges"]["j1"]["lc_vif"] is not None
    res_p = json.loads(p.out)
    assert not res_p["lc_difficulty"]["used"] and res_p["lc_difficulty"]["matched"] == n - 1
    assert "79 of 80 prompts" in p.err
    assert both.code == 2 and "difficulty_table" in both.err
