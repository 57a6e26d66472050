"""The ``math_answer`` verifier (:mod:`dllm_align.online.math_answer`): the hand-labelled held-out set
(tests/fixtures/gsm8k_heldout.md says how it was built), one test per false-positive class that the rule
before it had, the no-answer reasons and the forms math-verify alone does not read."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dllm_align.online.math_answer import REASONS, judge, reason_counts
from dllm_align.online.verifiers import get_rule

HELDOUT = Path(__file__).parent / "fixtures" / "gsm8k_heldout.jsonl"


def _rows() -> list[dict]:
    return [json.loads(x) for x in HELDOUT.read_text().splitlines()]


def test_the_held_out_set_meets_the_targets():
    """False positives at most 1% of the undesirable outputs; false negatives fewer than math-verify's
    alone (its whole-output parse against the reference number) on the same rows."""
    from math_verify import parse, verify

    rows = _rows()
    assert len(rows) >= 200 and len({r["format"] for r in rows}) >= 19
    got = [judge(r["output"], r["answer"]).desirable for r in rows]
    wrong = sum(not r["desirable"] for r in rows)
    fp = sum(g and not r["desirable"] for g, r in zip(got, rows))
    fn = sum(r["desirable"] and not g for g, r in zip(got, rows))
    alone = [bool(verify(parse(r["answer"].rsplit("####", 1)[1]), parse(r["output"]))) for r in rows]
    fn_alone = sum(r["desirable"] and not g for g, r in zip(alone, rows))
    assert fp <= 0.01 * wrong, [r["id"] for g, r in zip(got, rows) if g and not r["desirable"]]
    assert fn < fn_alone


def test_the_no_answer_kinds_on_the_held_out_set_get_their_reason():
    rows = [r for r in _rows() if r["kind"] in ("hedge", "truncated", "expression", "none")]
    counts = reason_counts(judge(r["output"], r["answer"]).reason for r in rows)
    assert set(counts) == set(REASONS)
    assert counts == reason_counts(r["kind"] for r in rows) and counts["correct"] == counts["wrong"] == 0


# one test per false-positive class of the rule before this one: each output is wrong, never desirable
@pytest.mark.parametrize("output, reason", [
    ("The answer is 24 + 48.", "expression"),          # the first number of an expression was taken
    ("So the answer is \\boxed{24 + 48}", "expression"),
    ("The answer is 24 + 48 = 72.", "wrong"),          # a stated result is the result, not the first term
])
def test_an_expression_is_not_read_as_its_first_number(output, reason):
    v = judge(output, "#### 24")
    assert not v.desirable and v.reason == reason


@pytest.mark.parametrize("output", [
    "She sold 72 clips.\n#### 72. Wait, I misread: she sold 72 each month for two months. The total is 144.",
    "\\boxed{72} Actually, let me recheck: 48 + 48 = 96, so she sold 96.",
    "Answer: 72. Hmm, wait. Each box holds 12, so 12 * 8 = 96.",
])
def test_a_later_correction_wins_over_an_earlier_marker(output):
    assert not judge(output, "#### 72").desirable
    assert judge(output, "#### 72").reason == "wrong"


@pytest.mark.parametrize("output", [
    "In May she sold 48 / 2", "Half of 48 is", "She earns 0.2 * 50 =", "Remaining: 120 - 36 = 84, and half of that is 84 /",
])
def test_a_truncated_output_is_not_evaluated_or_taken(output):
    v = judge(output, "#### 24" if "48 / 2" in output or "Half" in output else "#### 84")
    assert not v.desirable and v.reason == "truncated"


@pytest.mark.parametrize("output", [
    "It is either 70 or 72.", "The answer is 70 or 72.", "\\boxed{70} or \\boxed{72}", "I'm not sure, maybe 72.",
    "It could be 72, depending on the day.",
])
def test_a_hedge_never_commits_so_the_last_number_is_not_taken(output):
    v = judge(output, "#### 72")
    assert not v.desirable and v.reason == "hedge"


@pytest.mark.parametrize("output, reference", [
    ("\\boxed{\\text{72 clips}}", "72"), ("\\boxed{25\\%}", "25"), ("\\boxed{1{,}200}", "1200"),
    ("The answer is \\textbf{48}.", "48"), ("$x = 72$", "72"), ("\\boxed{\\frac{6}{8}}", "3/4"),
    ("The answer is 2 1/2.", "5/2"), ("\\boxed{2\\frac{1}{2}}", "5/2"), ("The answer is 60 km/h.", "60"),
    ("\\boxed{48 \\text{ cm}^2}", "48"), ("The answer is 2.5 million.", "2500000"),
    ("The answer is seventy-two.", "72"), ("The answer is \u22125.", "-5"), ("9", "9"),
])
def test_forms_math_verify_alone_misses_are_read(output, reference):
    assert judge(output, f"#### {reference}").desirable


def test_close_numbers_are_not_equal():
    assert not judge("\\boxed{0.33}", "#### 1/3").desirable and judge("\\boxed{0.75}", "#### 3/4").desirable
    assert not judge("The answer is 2 1/3.", "#### 5/2").desirable


def test_the_rule_gives_its_reason_and_a_text_reference_is_compared_as_text():
    rule = get_rule("math_answer")
    assert rule.explain("q", "It is either 70 or 72.", {"answer": "#### 72"}) == "hedge"
    assert rule.fn("q", "The answer is 72.", {"answer": "#### 72"}) is True
    assert get_rule("regex:x").explain("q", "x", {}) is None  # a rule with no reasons
    from dllm_align.data.toy import prompt_text

    sort, q = get_rule("sort"), prompt_text("3142")
    assert [sort.explain(q, c, {}) for c in ("1234", "4321", "1324", "1 234", "123")] == [
        "correct", "descending", "unsorted", "malformed", "malformed"]
    assert judge("The answer is Paris.", "#### paris").desirable and not judge("The answer is Rome.", "#### Paris").desirable
