"""stats.py: the judging protocol's numbers, checked by hand (docs/design.md#judging, paper Appendix C)."""

from __future__ import annotations

from fractions import Fraction
from itertools import product

import numpy as np
import pytest

from dllm_align.judge import stats
from dllm_align.judge.stats import LOSS, TIE, WIN


def test_pair_outcome_all_nine_verdict_combinations():
    # verdicts are positional: in the AB order "A" prefers model A; in the BA order "B" does.
    expected = {
        ("A", "B"): WIN,   # both orders prefer model A
        ("B", "A"): LOSS,  # both prefer model B
        ("A", "A"): TIE,   # always the first shown: position bias
        ("B", "B"): TIE,   # always the second shown
        ("C", "C"): TIE,
        ("A", "C"): TIE, ("C", "B"): TIE,  # only one order prefers A
        ("B", "C"): TIE, ("C", "A"): TIE,  # only one order prefers B
    }
    for ab, ba in product("ABC", repeat=2):
        assert stats.pair_outcome(ab, ba) == expected[(ab, ba)], (ab, ba)
    with pytest.raises(ValueError):
        stats.pair_outcome("a", "B")


def test_counts_and_awr_by_hand():
    o = [WIN, WIN, WIN, LOSS, LOSS, TIE, TIE, TIE]
    assert stats.counts(o) == {"wins": 3, "losses": 2, "ties": 3, "n": 8}
    assert stats.awr(o) == (3 + 0.5 * 3) / 8 == 0.5625
    assert stats.awr([TIE] * 5) == 0.5
    assert stats.awr([WIN]) == 1.0 and stats.awr([LOSS]) == 0.0
    with pytest.raises(ValueError):
        stats.awr([])
    with pytest.raises(ValueError):
        stats.awr([2, 1])


def test_majority_vote_needs_both_judges_to_agree():
    o1 = [WIN, WIN, LOSS, TIE, TIE, WIN, LOSS, LOSS]
    o2 = [WIN, TIE, LOSS, TIE, WIN, LOSS, WIN, TIE]
    assert stats.majority_vote(o1, o2).tolist() == [WIN, TIE, LOSS, TIE, TIE, TIE, TIE, TIE]
    with pytest.raises(ValueError):
        stats.majority_vote([WIN], [WIN, WIN])


def test_kappa_hand_computed_3x3_table():
    # The docstring's table: rows judge 1, columns judge 2, classes (win, loss, tie):
    #   W: 4 0 1 | L: 0 2 1 | T: 1 0 1   ->  p_o = 0.7, p_e = 0.37, kappa = 0.33 / 0.63 = 11/21
    table = np.array([[4, 0, 1], [0, 2, 1], [1, 0, 1]])
    assert stats.kappa_from_table(table) == pytest.approx(11 / 21, abs=1e-15)
    # the same table as outcomes
    cells = {(0, 0): (WIN, WIN), (0, 2): (WIN, TIE), (1, 1): (LOSS, LOSS), (1, 2): (LOSS, TIE), (2, 0): (TIE, WIN), (2, 2): (TIE, TIE)}
    o1, o2 = [], []
    for (i, j), (a, b) in cells.items():
        o1 += [a] * int(table[i, j])
        o2 += [b] * int(table[i, j])
    assert stats.confusion(o1, o2).tolist() == table.tolist()
    assert stats.cohen_kappa(o1, o2) == pytest.approx(11 / 21, abs=1e-15)


def test_kappa_special_values():
    assert stats.cohen_kappa([WIN, LOSS, TIE], [WIN, LOSS, TIE]) == 1.0
    # complete disagreement on two balanced classes: p_o = 0, p_e = 1/2 -> -1
    assert stats.cohen_kappa([WIN, LOSS], [LOSS, WIN]) == -1.0
    # independent-looking judges: p_o = p_e -> 0
    assert stats.cohen_kappa([WIN, WIN, LOSS, LOSS], [WIN, LOSS, WIN, LOSS]) == 0.0
    # p_e = 1 (everything in one class for both judges) is defined as 1.0
    assert stats.cohen_kappa([TIE] * 4, [TIE] * 4) == 1.0
    assert stats.kappa_from_table(np.diag([7, 0, 0])) == 1.0
    with pytest.raises(ValueError):
        stats.cohen_kappa([], [])


def test_kappa_matches_the_textbook_formula_on_random_tables():
    rng = np.random.default_rng(1)
    for _ in range(200):
        n = int(rng.integers(1, 30))
        o1, o2 = rng.integers(-1, 2, n), rng.integers(-1, 2, n)
        po = Fraction(int((o1 == o2).sum()), n)
        pe = sum(Fraction(int((o1 == c).sum()), n) * Fraction(int((o2 == c).sum()), n) for c in (-1, 0, 1))
        want = 1.0 if pe == 1 else float((po - pe) / (1 - pe))
        assert stats.cohen_kappa(o1, o2) == pytest.approx(want, abs=1e-12)


def test_bootstrap_is_degenerate_for_one_prompt_or_identical_outcomes():
    assert stats.awr_ci([WIN], n_resamples=500) == (1.0, 1.0)
    assert stats.awr_ci([TIE] * 40, n_resamples=500) == (0.5, 0.5)
    assert stats.kappa_ci([WIN], [LOSS], n_resamples=200) == (0.0, 0.0)  # p_o = p_e = 0 on every resample
    assert stats.kappa_ci([WIN] * 6, [WIN] * 6, n_resamples=200) == (1.0, 1.0)


def test_bootstrap_matches_a_direct_numpy_reimplementation():
    rng = np.random.default_rng(7)
    o1 = rng.integers(-1, 2, 57)
    o2 = np.where(rng.random(57) < 0.7, o1, rng.integers(-1, 2, 57))
    B, seed = 5000, 123

    # direct re-implementation of the documented protocol
    r = np.random.default_rng(seed)
    idx = [r.integers(0, 57, size=57) for _ in range(B)]
    awrs = np.array([((o1[i] == 1).sum() + 0.5 * (o1[i] == 0).sum()) / 57 for i in idx])
    want_awr = np.percentile(awrs, [5, 95])
    kappas = []
    for i in idx:
        a, b = o1[i], o2[i]
        po = (a == b).mean()
        pe = sum((a == c).mean() * (b == c).mean() for c in (-1, 0, 1))
        kappas.append(1.0 if pe == 1 else (po - pe) / (1 - pe))
    want_kappa = np.percentile(kappas, [5, 95])

    got_awr = stats.awr_ci(o1, n_resamples=B, seed=seed)
    got_kappa = stats.kappa_ci(o1, o2, n_resamples=B, seed=seed)
    assert got_awr == pytest.approx(tuple(want_awr), abs=1e-12)
    assert got_kappa == pytest.approx(tuple(want_kappa), abs=1e-12)
    # an 80% interval sits inside the 90% one; the seed fixes the resamples
    lo80, hi80 = stats.awr_ci(o1, n_resamples=B, seed=seed, level=0.8)
    assert got_awr[0] <= lo80 <= hi80 <= got_awr[1]
    first = lambda s: next(stats.bootstrap_indices(57, 1, s)).tolist()  # noqa: E731
    assert first(seed) == first(seed) != first(seed + 1)
    assert got_awr[0] < stats.awr(o1) < got_awr[1]


def test_bootstrap_interval_width_is_near_the_normal_approximation():
    # 400 prompts, AWR 0.6: the 90% half-width is about 1.645 * sd(score) / sqrt(n).
    o = np.array([WIN] * 160 + [TIE] * 160 + [LOSS] * 80)
    scores = (o + 1) / 2
    half = 1.645 * scores.std() / np.sqrt(len(o))
    lo, hi = stats.awr_ci(o, n_resamples=5000, seed=0)
    assert (hi - lo) / 2 == pytest.approx(half, rel=0.08)
    assert (lo + hi) / 2 == pytest.approx(0.6, abs=0.005)


def test_summarize_fields():
    s = stats.summarize([WIN, TIE, LOSS, WIN], n_resamples=200)
    assert s["wins"] == 2 and s["losses"] == 1 and s["ties"] == 1 and s["n"] == 4
    assert s["awr"] == 0.625 and len(s["ci90"]) == 2
    assert stats.summarize([]) == {"wins": 0, "losses": 0, "ties": 0, "n": 0, "awr": None, "ci90": None}
