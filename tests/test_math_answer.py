"""The ``math_answer`` verifier (:mod:`dllm_align.online.math_answer`): the targets on the held-out part of
benchmarks/data/math_verifier_cases.jsonl, one test per class of output that a rule reading the last number
gets wrong (each expects the right verdict or unsure, never the wrong one), the answer formats, and bounded
work on degenerate outputs."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from dllm_align.online.math_answer import FORMATS, REASONS, judge, reason_counts

CASES = Path(__file__).resolve().parents[1] / "benchmarks" / "data" / "math_verifier_cases.jsonl"


def _cases(split: str) -> list[dict]:
    return [r for r in map(json.loads, CASES.read_text(encoding="utf-8").splitlines()) if r["split"] == split]


def test_the_held_out_cases_meet_the_targets():
    """False positives at most 1% of the rows that are not desirable, false negatives fewer than math-verify
    alone's, unsure on at most 10% of the outputs that commit to one answer in their format."""
    from math_verify import parse, verify

    rows = _cases("heldout")
    assert len(rows) >= 300 and {r["format"] for r in rows} == set(FORMATS)
    got = [judge(r["output"], r["answer"], fmt=r["format"], prompt=r["question"]).verdict for r in rows]
    fp = [r["id"] for g, r in zip(got, rows) if g == "desirable" and r["expected"] != "desirable"]
    fn = sum(g == "undesirable" and r["expected"] == "desirable" for g, r in zip(got, rows))
    alone = sum(r["expected"] == "desirable" and not verify(parse(r["answer"]), parse(r["output"])) for r in rows)
    committed = [(g, r) for g, r in zip(got, rows) if r["in_format"] and r["expected"] != "unsure"]
    assert len(fp) <= 0.01 * sum(r["expected"] != "desirable" for r in rows), fp
    assert fn < alone
    assert sum(g == "unsure" for g, _ in committed) <= 0.10 * len(committed)


def test_the_case_set_is_what_its_script_writes_and_its_split_is_by_content():
    """The committed cases are benchmarks/math_verifier_cases.py's output (no row edited by hand to fit a rule),
    and each row's part is the hash of its content."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("math_verifier_cases", CASES.parents[1] / "math_verifier_cases.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    rows = mod.build()
    assert CASES.read_text(encoding="utf-8") == "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    assert all(r["split"] == mod.split_of(r["format"], r["answer"], r["output"]) for r in rows)


def _v(output: str, answer: str, fmt: str = "hashes", prompt: str = ""):
    return judge(output, answer, fmt=fmt, prompt=prompt)


# one test per class: the right verdict, or unsure; never the wrong one
@pytest.mark.parametrize("output", [
    "There are 12 students.\n#### 12\nOn second thought, the bus driver came too, so 14.",
    "#### 12\nScratch that - I forgot the two helpers: 14 in all.",
    "#### 12\n\nRedoing it with the teacher: 13.\n#### 13",
])
def test_a_correction_without_a_cue_word_is_never_read_as_the_first_answer(output):
    v = _v(output, "12")
    assert v.verdict == "unsure" and v.reason in ("revised", "two_answers")


@pytest.mark.parametrize("answer_text", ["12 (13 if you count the teacher)", "12\u201313", "12 \u00b1 1", "12-13",
                                         "12 or 13", "about 12 to 13"])
def test_a_hedge_without_a_hedge_word_abstains(answer_text):
    for fmt, out in (("hashes", f"#### {answer_text}"), ("boxed", f"\\boxed{{{answer_text}}}"),
                     ("answer_tag", f"<answer>{answer_text}</answer>"), ("json", json.dumps({"answer": answer_text}))):
        v = _v(out, "12", fmt)
        assert v.verdict == "unsure" and v.reason == "two_answers", (fmt, v)


def test_a_restated_quantity_is_not_the_answer():
    q = "A farmer has 48 sheep and buys 24 more. How many sheep does he have?"
    assert _v("He has 48 + 24 = 72 sheep. He started with 48 sheep.", "48", prompt=q).verdict == "undesirable"  # no ####
    assert _v("48 + 24 = 72.\n#### 72\nHe started with 48 sheep and bought 24.", "72", prompt=q).verdict == "desirable"
    assert _v("48 + 24 = 72.\n#### 72\nHe started with 48 sheep.", "48", prompt=q).verdict == "undesirable"


def test_not_x_is_never_read_as_x():
    assert _v("#### 70, not 72", "72").verdict == "unsure"
    assert _v("The answer is 70, not 72.", "72").verdict == "undesirable"  # not in the format: no answer
    assert _v("It is 70, not 72.\n#### 70", "70").verdict == "desirable"


def test_equals_x_but_then_y_reads_the_marked_answer_only():
    out = "48 + 24 = 72 clips, but she gave 2 away, leaving 70."
    assert _v(out + "\n#### 70", "70").verdict == "desirable"
    assert _v(out + "\n#### 70", "72").verdict == "undesirable"
    assert _v(out, "72").verdict == "undesirable" and _v(out, "72").reason == "none"
    assert _v("#### = 72 clips, but she gave 2 away, leaving 70", "72").verdict == "unsure"


@pytest.mark.parametrize("text, answer", [("two and a half", "2.5"), ("seventy-two", "72"), ("three quarters", "0.75"),
                                          ("one thousand two hundred", "1200"), ("\\text{twelve}", "12")])
def test_number_words_are_read(text, answer):
    assert _v(f"\\boxed{{{text}}}", answer, "boxed").verdict == "desirable"
    assert _v(f"\\boxed{{{text}}}", str(float(answer) + 1), "boxed").verdict == "undesirable"


def test_a_decimal_comma_is_a_decimal_mark():
    assert _v("#### 12,5", "12.5").verdict == "desirable"
    assert _v("#### 12,5", "125").verdict == "undesirable"
    assert _v("\\boxed{3{,}75}", "3.75", "boxed").verdict == "desirable"


def test_a_json_answer_field_is_read_in_any_position_and_type():
    assert _v('{"reasoning": "48 + 24 = 72", "answer": 72}', "72", "json").verdict == "desirable"
    assert _v('{"answer": 72, "reasoning": "48 + 24 = 72"}', "72", "json").verdict == "desirable"
    assert _v('Result:\n```json\n{"answer": "72 clips"}\n```', "72", "json").verdict == "desirable"
    assert _v('{"answer": 70}', "72", "json").verdict == "undesirable"
    assert _v('{"answer": null}', "72", "json").reason == "none"
    assert _v('{"answer": 72, "check": {"answer": 70}}', "72", "json").verdict == "unsure"
    assert _v('{"final": 72}', "72", "json", ).reason == "none"
    assert _v('{"final": 72}', "72", "json") == judge('{"final": 72}', "72", fmt="json", field="answer")
    assert judge('{"final": 72}', "72", fmt="json", field="final").verdict == "desirable"


@pytest.mark.parametrize("end", [" \U0001f389", "\n<|endoftext|>", "\n```", "\n\n| total | 72 |", ""])
def test_a_complete_output_without_final_punctuation_is_not_truncated(end):
    assert _v(f"48 + 24 = 72\n#### 72{end}", "72").verdict == "desirable"
    assert _v(f"\\boxed{{72}}{end}", "72", "boxed").verdict == "desirable"
    assert _v(f"<answer>72</answer>{end}", "72", "answer_tag").verdict == "desirable"


@pytest.mark.parametrize("text, answer", [("1.234,5", "1234.5"), ("1,234.5", "1234.5"), ("1 234", "1234"),
                                          ("1\u202f234", "1234"), ("1'234", "1234"), ("1\\,234", "1234"),
                                          ("1,234,567", "1234567"), ("1.234.567", "1234567"), ("$1,200.00", "1200")])
def test_locale_separators_are_read(text, answer):
    assert _v(f"#### {text}", answer).verdict == "desirable"
    assert _v(f"#### {text}", str(int(float(answer)) + 10)).verdict == "undesirable"


def test_a_dot_before_three_digits_reads_either_way_and_abstains_only_when_that_decides():
    assert _v("#### 1.234", "1234").verdict == "unsure" and _v("#### 1.234", "1234").reason == "ambiguous"
    assert _v("#### 1.234", "1.234").verdict == "unsure"
    assert _v("#### 1.234", "99").verdict == "undesirable"


@pytest.mark.parametrize("text", ["1.2e3", "1.2E+03", "1.2 \u00d7 10^3", "1.2\\times 10^{3}", "1.2 \\cdot 10^3",
                                  "1.2 \u00d7 10\u00b3", "12 x 10^2"])
def test_scientific_notation_is_read(text):
    assert _v(f"#### {text}", "1200").verdict == "desirable"
    assert _v(f"#### {text}", "120").verdict == "undesirable"


@pytest.mark.parametrize("text, answer", [("\\frac{5}{2}", "2.5"), ("2 1/2", "2.5"), ("2\\frac{1}{2}", "5/2"),
                                          ("48 \\text{ cm}^2", "48"), ("25\\%", "25"), ("60 km/h", "60"),
                                          ("\u221215", "-15"), ("\u20ac12.50", "12.5"), ("x = 72", "72")])
def test_fractions_units_and_signs(text, answer):
    assert _v(f"\\boxed{{{text}}}", answer, "boxed").verdict == "desirable"


def test_only_the_recipe_format_is_read():
    out = "48 + 24 = 72. The answer is \\boxed{72}."
    assert _v(out, "72", "boxed").verdict == "desirable"
    for fmt in ("hashes", "json", "answer_tag"):
        assert _v(out, "72", fmt).verdict == "undesirable" and _v(out, "72", fmt).reason == "none"
    assert judge(out, "72", fmt="hashes", no_answer="unsure").verdict == "unsure"
    assert _v("so the answer is \\boxed{72", "72", "boxed").reason == "truncated"
    assert _v("<answer>72", "72", "answer_tag").reason == "truncated"


def test_an_expression_has_no_stated_value():
    v = _v("#### 24 + 48", "72")
    assert v.verdict == "unsure" and v.reason == "expression"
    assert _v("#### 24 + 48 = 72", "72").verdict == "desirable"


def test_a_reference_that_is_not_a_number_goes_to_math_verify():
    assert _v("\\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{\\sqrt3}{2}", "boxed").verdict == "desirable"
    assert _v("\\boxed{\\frac{\\sqrt{2}}{2}}", "\\frac{\\sqrt3}{2}", "boxed").verdict == "undesirable"


def test_reasons_are_counted_with_every_key():
    got = [_v(o, "72").reason for o in ("#### 72", "#### 7", "no answer", "#### 70 or 72")]
    counts = reason_counts(got)
    assert set(counts) == set(REASONS) and counts["correct"] == counts["wrong"] == counts["none"] == 1


# ------------------------------------------------------------------ bounded work
@pytest.mark.parametrize("fmt, unit", [("boxed", "\\boxed{"), ("answer_tag", "<answer>"), ("json", '{"answer": '),
                                       ("hashes", "#### 12\nno, 13\n"), ("boxed", "\\boxed{12} then \\boxed{13} ")])
def test_the_rule_is_linear_in_the_completion(fmt, unit):
    """100 KB, then 1 MB of a degenerate repetition: ten times the text takes about ten times as long, not a
    hundred (the bound, 40 times, leaves room for a busy machine; so does the 5 s ceiling at 1 MB)."""
    def timed(text: str) -> tuple[float, str]:
        t0 = time.perf_counter()
        v = judge(text, "12", fmt=fmt)
        return time.perf_counter() - t0, v.verdict

    judge(unit * 10, "12", fmt=fmt)  # math-verify's first import is not the rule's time
    small = min(timed(unit * (100_000 // len(unit)))[0] for _ in range(2))
    big, verdict = timed(unit * (1_000_000 // len(unit)))
    assert verdict != "desirable"
    assert big < 5 and big < 40 * max(small, 0.005), (small, big)
