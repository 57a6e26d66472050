"""judge_report.py and the length-controlled AWR end to end: a judge that only
likes length, a judge that likes A whatever its length, the length columns and
marker, tokens and cost."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from dllm_align.judge import run as judging

from dllm_align.judge import stats
from dllm_align.judge.report import usage_report
from dllm_align.config.schema import JudgeSection
from judge_server import JudgeServer
from test_judging import J1, KEY, cli, fast, script, write_gen


def length_biased_files(tmp: Path, n: int = 200, a_longer: float = 0.8, seed: int = 0) -> tuple[Path, Path]:
    """A is longer than B on about ``a_longer`` of the prompts; the length gaps have
    the same distribution on both sides (10-200 characters)."""
    rng = np.random.default_rng(seed)
    paths = []
    len_b = rng.integers(100, 400, n)
    gap = rng.integers(10, 200, n) * np.where(rng.random(n) < a_longer, 1, -1)
    for side, lengths in (("a", len_b + gap), ("b", len_b)):
        p = tmp / f"{side}.jsonl"
        p.write_text("".join(json.dumps({"id": f"q{i}", "prompt": f"Question {i}?", "completion": f"{side.upper()}:" + "x" * int(k)}) + "\n"
                             for i, k in enumerate(lengths)))
        paths.append(p)
    return paths[0], paths[1]


@judging.register_rule("prefers-a-marker", replace=True)
def _prefers_a(prompt, first, second):
    """A wins whatever the lengths (the answers start with 'A:' or 'B:')."""
    return "A" if first.startswith("A:") else "B"


@judging.register_rule("mostly-a", replace=True)
def _mostly_a(prompt, first, second):
    """A better on ~85% of prompts, decided by a hash of the prompt (not by length); consistent in both orders."""
    a_better = int(hashlib.sha256(prompt.encode()).hexdigest(), 16) % 100 < 85
    want = "A:" if a_better else "B:"
    return "A" if first.startswith(want) else "B"


@pytest.fixture
def bare_fit(monkeypatch):
    """The fit itself, without the bound on the length correction (and its margin) that gives it: for tests of
    what the estimator computes; the giving rule has its own tests below."""
    monkeypatch.setattr(stats, "LC_MAX_CORRECTION", float("inf"))
    monkeypatch.setattr(stats, "LC_CORRECTION_MARGIN", 0.0)


def test_a_judge_that_only_likes_length_gets_a_high_awr_but_an_lc_awr_around_half(tmp_path, monkeypatch):
    a, b = length_biased_files(tmp_path, seed=1)
    res = judging.judge_files(a, b, tmp_path / "out", JudgeSection(judges=["rule:longer"])).results
    j = res["judges"]["rule:longer"]
    assert j["awr"] > 0.75 and j["ci90"][0] > 0.7  # well above 0.5
    # a 30-point correction with nothing to check it by: no figure, with the reason, strict JSON null
    assert j["lc_awr"] is None and j["lc_ci90"] is None and j["lc_vif"] <= stats.LC_MAX_VIF
    assert "length correction is" in j["lc_withheld"] and "add --length-anchors" in j["lc_withheld"]
    saved = json.loads((tmp_path / "out" / "results.json").read_text(), parse_constant=lambda c: pytest.fail(c))
    assert saved["judges"]["rule:longer"]["lc_awr"] is None
    assert "LC-AWR withheld (rule:longer): the length correction is" in (tmp_path / "out" / "results.md").read_text()
    monkeypatch.setattr(stats, "LC_MAX_CORRECTION", float("inf"))  # the fit behind it
    monkeypatch.setattr(stats, "LC_CORRECTION_MARGIN", 0.0)
    res = judging.judge_files(a, b, tmp_path / "out2", JudgeSection(judges=["rule:longer"])).results
    j = res["judges"]["rule:longer"]
    lo, hi = j["lc_ci90"]
    assert lo < 0.5 < hi  # the whole gain is length
    assert abs(j["lc_awr"] - 0.5) < 0.07
    assert res["lengths"]["beyond_threshold"] and res["lengths"]["relative_difference"] > 0.2


def test_the_length_only_judge_over_ten_data_sets(bare_fit):
    """The same judge on ten independently drawn data sets (seeds 0-9, 200 prompts,
    A longer on ~80%). A judge whose verdict is a step function of the length
    difference is the hardest case for any smooth model: the value at zero is an
    extrapolation across the gap between the smallest differences on each side,
    and the bootstrap sees only that sample's gap. Measured: AWR 0.755-0.83,
    LC-AWR 0.43-0.57, the 90% interval holding 0.5 in 8 of the 10."""
    holds, lcs = 0, []
    for seed in range(10):
        rng = np.random.default_rng(seed)
        len_b = rng.integers(100, 400, 200)
        len_a = len_b + rng.integers(10, 200, 200) * np.where(rng.random(200) < 0.8, 1, -1)
        o = np.sign(len_a - len_b)  # the longer answer wins in both orders
        assert stats.awr(o) > 0.75
        e = stats.lc_estimate(o, len_a, len_b, n_resamples=1000, seed=0)
        lc, (lo, hi) = e["lc_awr"], e["ci90"]
        lcs.append(lc)
        holds += lo < 0.5 < hi
    assert max(abs(x - 0.5) for x in lcs) < 0.075 and abs(np.mean(lcs) - 0.5) < 0.02
    assert holds >= 7


def test_a_judge_that_prefers_a_whatever_the_length_keeps_both_high(tmp_path):
    a, b = length_biased_files(tmp_path)
    res = judging.judge_files(a, b, tmp_path / "out", JudgeSection(judges=["rule:prefers-a-marker", "rule:mostly-a"])).results
    sure, mostly = res["judges"]["rule:prefers-a-marker"], res["judges"]["rule:mostly-a"]
    assert sure["awr"] == 1.0 and sure["lc_awr"] > 0.99 and sure["lc_ci90"][0] > 0.99
    assert 0.78 < mostly["awr"] < 0.92
    assert abs(mostly["lc_awr"] - mostly["awr"]) < 0.05 and mostly["lc_ci90"][0] > 0.7
    mv = res["majority_vote"]
    assert mv["lc_awr"] > 0.75 and "lc_ci90" in mv


def test_the_length_columns_and_marker_in_the_table_and_results(tmp_path):
    a, b = length_biased_files(tmp_path, n=60)
    r = cli([a, b, "-o", tmp_path / "out", "--judge", "rule:longer", "--bootstrap", "500"], key=None)
    assert r.exit_code == 0, r.stderr
    res = json.loads((tmp_path / "out" / "results.json").read_text())
    ln = res["lengths"]
    assert set(ln) == {"unit", "a", "b", "relative_difference", "threshold", "beyond_threshold", "balance"}
    assert ln["a"]["mean"] > ln["b"]["mean"] and ln["threshold"] == 0.1 and ln["beyond_threshold"]
    bal = ln["balance"]
    assert bal["a_longer"] + bal["b_longer"] + bal["equal"] == 60 and bal["a_longer_share"] == bal["a_longer"] / 60
    assert "longer one on" in r.stdout
    row = next(x for x in r.stdout.splitlines() if x.startswith("│ rule:longer"))
    assert "†" in row and "LC-AWR (%)" in r.stdout and "longer on average" in r.stdout
    md = (tmp_path / "out" / "results.md").read_text()
    assert "| Judge | AWR (%) | 90% CI | LC-AWR (%) | LC 90% CI |" in md and "†" in md
    first = json.loads((tmp_path / "out" / "outcomes.jsonl").read_text().splitlines()[0])
    assert {"length_a", "length_b"} <= set(first)
    # a looser threshold: no marker
    r = cli([a, b, "-o", tmp_path / "o2", "--judge", "rule:longer", "--bootstrap", "500", "--length-threshold", "5"], key=None)
    assert r.exit_code == 0 and "†" not in r.stdout


def test_equal_lengths_give_lc_awr_equal_to_awr():
    out = [1, 1, -1, 0, 0, 1, -1, 0]
    same = [10] * 8
    assert stats.lc_awr(out, same, same) == pytest.approx(stats.awr(out), abs=1e-12)
    e = stats.lc_estimate(out, same, same, n_resamples=300, seed=3)
    assert e["ci90"] == pytest.approx(stats.awr_ci(out, n_resamples=300, seed=3), abs=1e-9) and e["withheld"] is None


def test_a_mirror_image_length_judge_gives_exactly_one_half(bare_fit):
    # A longer by 5 on three prompts and wins them, shorter by 5 on one and loses it: with
    # the A-longer and B-longer groups weighted equally the fit is symmetric, theta = 0.
    out, la, lb = [1, 1, 1, -1], [15, 15, 15, 10], [10, 10, 10, 15]
    assert stats.awr(out) == 0.75
    assert stats.lc_awr(out, la, lb) == pytest.approx(0.5, abs=1e-12)


def _lopsided(seed: int, n: int = 400, b_longer: int = 1, p_win: float = 0.6, p_tie: float = 0.26):
    """A judge that ignores length (outcomes drawn independently of it) on data where A is longer on
    all but ``b_longer`` prompts."""
    rng = np.random.default_rng(seed)
    out = rng.choice([1, 0, -1], size=n, p=[p_win, p_tie, 1 - p_win - p_tie])
    la = rng.integers(300, 900, size=n).astype(float)
    lb = la - rng.integers(1, 200, size=n)
    lb[:b_longer] = la[:b_longer] + rng.integers(1, 200, size=b_longer)
    return out, la, lb


def test_the_lc_awr_is_withheld_not_shrunk_when_one_prompt_could_flip_it():
    # A longer on 399 of 400 prompts, a judge that ignores length: the one B-longer prompt's verdict
    # moved the bare fit from 9% to 97%. The slope is not identified, so there is no figure, with the reason.
    for seed in range(3):
        out, la, lb = _lopsided(seed)
        for flip in (1, -1):
            out[0] = flip
            e = stats.lc_estimate(out, la, lb, n_resamples=50)
            assert e["lc_awr"] is None and e["ci90"] is None and e["vif"] > stats.LC_MAX_VIF
            assert "not identified" in e["withheld"] and "A longer on 399 of 400" in e["withheld"]
            assert stats.lc_awr(out, la, lb) is None
        bal = stats.lc_balance(la, lb)
        assert (bal["a_longer"], bal["b_longer"], bal["a_longer_share"]) == (399, 1, 399 / 400)


def test_the_identification_rule_is_relative_to_n_not_a_fixed_count():
    # the same shape at 50 and at 5,000 prompts gets the same verdict: given with A longer on 90%,
    # withheld with A longer on 98% (1 of 50 or 100 of 5,000 prompts on B's side)
    for share, given in ((0.9, True), (0.98, False)):
        for n in (50, 5000):
            rng = np.random.default_rng(0)
            lb = rng.integers(300, 900, size=n).astype(float)
            la = lb + rng.integers(1, 200, size=n) * np.where(np.arange(n) < share * n, 1, -1)
            out = rng.choice([1, 0, -1], size=n)
            e = stats.lc_estimate(out, la, lb, n_resamples=1)
            assert (e["withheld"] is None) == given, (share, n, e["vif"])


def test_the_report_warns_when_lengths_are_lopsided(tmp_path):
    # A longer on every prompt: the length control has nothing to stand on; the figure is withheld with the reason.
    a, b = length_biased_files(tmp_path, n=40, a_longer=1.0)
    r = cli([a, b, "-o", tmp_path / "out", "--judge", "rule:mostly-a", "--bootstrap", "200"], key=None)
    assert r.exit_code == 0, r.stderr
    res = json.loads((tmp_path / "out" / "results.json").read_text())
    j = res["judges"]["rule:mostly-a"]
    assert res["lengths"]["balance"]["a_longer_share"] == 1.0 and j["lc_vif"] > stats.LC_MAX_VIF
    assert j["lc_awr"] is None and j["lc_ci90"] is None and "not identified" in j["lc_withheld"]
    assert "LC-AWR withheld" in r.stdout and "LC-AWR withheld" in (tmp_path / "out" / "results.md").read_text()


def _two_order(rng, theta: float, phi: float, la, lb):
    """A judge with no prompt-to-prompt quality spread: each order prefers A with probability
    sigmoid(theta + phi tanh(d / sd(d))); a win needs both. E[y | d] is then that same probability, so the
    LC model holds exactly and the length-free truth is sigmoid(theta)."""
    d = np.asarray(la, float) - np.asarray(lb, float)
    p = 1 / (1 + np.exp(-(theta + phi * np.tanh(d / d.std()))))
    a1, a2 = rng.random(d.size) < p, rng.random(d.size) < p
    return np.where(a1 & a2, 1, np.where(~a1 & ~a2, -1, 0))


def test_a_large_length_correction_without_anchors_or_difficulty_is_withheld():
    # a strong length preference, A longer on 80%: the slope is identified (VIF under 4) but the figure would
    # move the AWR by 12 points (68.1 -> 56.1), which nothing in these data can check
    rng = np.random.default_rng(0)
    lb = rng.integers(300, 900, 800).astype(float)
    la = lb + rng.integers(20, 300, 800) * np.where(rng.random(800) < 0.8, 1, -1)
    out = _two_order(rng, 0.2, 1.5, la, lb)
    e = stats.lc_estimate(out, la, lb, n_resamples=50)
    assert e["vif"] <= stats.LC_MAX_VIF and e["lc_awr"] is None and e["ci90"] is None
    assert "length correction is" in e["withheld"] and "> 5" in e["withheld"]
    # the same data with a difficulty term (here a second model's outcomes) or anchors is not held to the bound
    assert stats.lc_estimate(out, la, lb, difficulty=rng.choice([1, 0, -1], 800), n_resamples=1)["withheld"] is None


def test_a_small_length_correction_is_given_with_its_interval_widened_by_half_the_correction(monkeypatch):
    rng = np.random.default_rng(1)
    lb = rng.integers(300, 900, 600).astype(float)
    la = lb + rng.integers(20, 300, 600) * np.where(rng.random(600) < 0.7, 1, -1)
    out = _two_order(rng, 0.3, 0.3, la, lb)
    e = stats.lc_estimate(out, la, lb, n_resamples=300, seed=0)
    correction = abs(e["lc_awr"] - stats.awr(out))
    assert e["withheld"] is None and 0.005 < correction <= stats.LC_MAX_CORRECTION
    monkeypatch.setattr(stats, "LC_CORRECTION_MARGIN", 0.0)
    bare = stats.lc_estimate(out, la, lb, n_resamples=300, seed=0)
    assert bare["lc_awr"] == e["lc_awr"]
    assert e["ci90"][0] == pytest.approx(bare["ci90"][0] - 0.5 * correction, abs=1e-12)
    assert e["ci90"][1] == pytest.approx(bare["ci90"][1] + 0.5 * correction, abs=1e-12)


def test_the_given_interval_covers_a_known_truth_in_simulation():
    # 40 data sets with a known length-free truth sigmoid(0.4) = 59.9% and a mild length preference, A longer
    # on 65%: the figure is given on most of them, within 5 points of the truth each time, and its 90%
    # interval holds the truth on at least 85% of those given. Measured: 40 of 40 given, worst error 3.8
    # points, 40 covered (37 without the margin).
    theta, truth = 0.4, 1 / (1 + np.exp(-0.4))
    rng = np.random.default_rng(5)
    given = covered = 0
    for _ in range(40):
        lb = rng.integers(300, 900, 400).astype(float)
        la = lb + rng.integers(20, 300, 400) * np.where(rng.random(400) < 0.65, 1, -1)
        e = stats.lc_estimate(_two_order(rng, theta, 0.5, la, lb), la, lb, n_resamples=200, seed=0)
        if e["lc_awr"] is None:
            continue
        given += 1
        assert abs(e["lc_awr"] - truth) <= 0.05
        covered += e["ci90"][0] <= truth <= e["ci90"][1]
    assert given >= 30 and covered >= 0.85 * given, (given, covered)


def test_balanced_data_is_given_with_no_variance_inflation():
    rng = np.random.default_rng(3)
    out = rng.choice([1, 0, -1], size=300, p=[0.5, 0.2, 0.3])
    la = rng.integers(100, 900, size=300).astype(float)
    lb = rng.integers(100, 900, size=300).astype(float)
    e = stats.lc_estimate(out, la, lb, n_resamples=1)
    assert e["withheld"] is None and e["vif"] < 1.1


# --------------------------------------------------------------------------- tokens and cost
def test_tokens_and_cost_per_judge(tmp_path):
    a, b = write_gen(tmp_path, model="A"), write_gen(tmp_path, model="B")
    out = tmp_path / "out"
    with JudgeServer(KEY) as srv:
        script(srv, "judge-1", J1)
        srv.faults = {("judge-1", "p4", "BA"): ["garbage"]}  # a re-asked judgement: both replies are paid for
        r = cli([a, b, "-o", out, "--judge", "judge-1", *fast(srv), "--price", "0.15,0.60", "--price", "other=1,2"])
        assert r.exit_code == 0, r.stderr
        expect_prompt = sum(len(c) // 4 for c in srv.contents)  # the fake server's usage: len/4 prompt, 5 completion tokens
        n_requests = len(srv.contents)
    u = json.loads((out / "results.json").read_text())["usage"]["judge-1"]
    assert n_requests == 17
    assert (u["judgements"], u["live"], u["batch"]) == (16, 16, 0)
    assert (u["prompt_tokens"], u["completion_tokens"]) == (expect_prompt, 5 * 17)
    assert u["price_per_mtok"] == [0.15, 0.60]
    assert u["cost_usd"] == pytest.approx((expect_prompt * 0.15 + 85 * 0.60) / 1e6, rel=1e-12)
    assert "Tokens: judge-1: 16 judgements" in (out / "results.md").read_text()
    assert "completion tokens, $" in r.stderr


def test_batch_tokens_are_charged_at_the_batch_factor():
    rows = [{"judge": "j", "mode": "batch", "usage": {"prompt_tokens": 1000, "completion_tokens": 100}},
            {"judge": "j", "mode": "live", "usage": {"prompt_tokens": 1000, "completion_tokens": 100}}]
    u = usage_report(rows, {"j": (2.0, 8.0)}, 0.5)["j"]
    # live 1000 * 2 + 100 * 8 = 2800; batch half of that = 1400; per million
    assert u["cost_usd"] == pytest.approx(4200 / 1e6)
    assert usage_report(rows, {}, 0.5)["j"].get("cost_usd") is None


def test_bad_prices_are_refused(tmp_path):
    a, b = write_gen(tmp_path, model="A"), write_gen(tmp_path, model="B")
    r = cli([a, b, "-o", tmp_path / "o", "--judge", "m", "--price", "cheap"])
    assert r.exit_code == 2 and "--price 'cheap'" in r.stderr
    r = cli([a, b, "-o", tmp_path / "o", "--judge", "m", "--price", "-1,2"])
    assert r.exit_code == 2 and "prices" in r.stderr
