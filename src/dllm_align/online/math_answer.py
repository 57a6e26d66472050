"""The ``math_answer`` verifier: a worked solution's final committed answer, compared with the reference
by ``math-verify``.

KTO pushes the policy toward every completion labelled desirable, so a wrong answer labelled desirable
(a false positive) costs far more than a right one labelled undesirable. The rule therefore reads only
an answer the output commits to, and labels everything else undesirable with a reason:

1. Markers: ``#### X``, ``\\boxed{X}`` (``\\fbox``), "answer is X" / "answer: X" (any case, after
   removing ``**``, ``$``, ``\\text{}``, ``\\textbf{}``, ``\\mathbf{}``, ``\\mathrm{}``). The last
   marker in the text is the committed answer, unless a correction follows it.
2. A correction: after the last marker, a cue ("wait", "actually", "correction", "oops", "mistake",
   "hmm", "no,", "reconsider", "recheck", "double check", "let me check/verify/re...") replaces the
   marker's answer with the stated result of the last sentence after the cue that holds a number (the
   same answer again is a confirmation). A cue followed by no number is no answer (``hedge``).
3. No marker: the stated result of the last sentence that holds a number, if the output ends like a
   finished text (``.``, ``!``, ``?``, ``}``, ``)``, ``]``, ``$``, ``**``) or is a bare number; an output
   that stops mid-sentence is ``truncated``.
4. The stated result of a span is what follows its last ``=``; in it, two numbers joined by an operator
   (``24 + 48``, ``(120 - 36) / 2``) is an ``expression`` with no stated result; "or", "either",
   "maybe", "probably", "not sure", "could be", "might be", "between", "depending" make it a ``hedge``.
5. The answer is the span's first number (after an ``=``: ``x = 72`` is 72), read with the forms
   ``math-verify`` does not: the U+2212 minus sign, ``{,}`` thousands, mixed numbers ``2 1/2`` and
   ``2\\frac{1}{2}``, "2.5 million", number words ("seventy-two"); units and ``%`` after it are dropped
   (GSM8K's references state percentages and measures as plain numbers).
6. The reference (GSM8K's ``... #### 72``) is read by the same rule; ``math-verify`` parses both and
   decides equality (fractions, decimals, ``\\frac{6}{8}`` = 0.75, rounding to 6 places). A reference
   that is not a number is compared as trimmed, case-folded text.

Reasons (:data:`REASONS`): ``correct`` (desirable), ``wrong``, and the no-answer kinds ``hedge``,
``truncated``, ``expression`` and ``none``, all undesirable: an output that never commits to one
answer is a failure of the policy, not of the judge, so it is a thumbs-down (never unjudgeable). The
measured accuracy per format, against ``math-verify`` alone and lm-evaluation-harness's GSM8K
extractors, is in docs/online.md (``python benchmarks/math_verifiers.py``).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from fractions import Fraction
from typing import Optional

# lazy imports: math_verify: it loads sympy (about a second), which only the math_answer verifier's symbolic
# fallback needs

REASONS = ("correct", "wrong", "hedge", "truncated", "expression", "none")
NO_ANSWER = ("hedge", "truncated", "expression", "none")


@dataclass(frozen=True)
class Verdict:
    """One output's label: ``desirable`` only when ``reason == "correct"``; ``answer`` is the answer read
    (``None`` for the no-answer reasons)."""

    desirable: bool
    reason: str
    answer: Optional[str] = None


# ------------------------------------------------------------------ normalising the text
_WRAPPERS = re.compile(r"\\(?:text|textbf|mathbf|mathrm|textit|mbox|operatorname)\s*\{([^{}]*)\}")
_DROP = re.compile(r"\\[$(),\[\]!;: ]|\$|\*\*|~|\\left|\\right")


def _normalise(text: str) -> str:
    s = text.replace("\u2212", "-").replace("{,}", ",").replace("\\%", "%").replace("\\dfrac", "\\frac")
    s = s.replace("\\tfrac", "\\frac").replace("\\times", "*").replace("\\cdot", "*").replace("\\div", "/")
    for _ in range(3):  # nested wrappers: \boxed{\text{\textbf{72}}}
        s = _WRAPPERS.sub(r"\1", s)
    s = re.sub(r"\\\$", " ", s)  # an escaped dollar sign is a currency mark, not maths
    return _DROP.sub(" ", s)


# ------------------------------------------------------------------ number words
_UNITS = {w: i for i, w in enumerate(
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen "
    "seventeen eighteen nineteen".split())}
_TENS = {w: 10 * (i + 2) for i, w in enumerate("twenty thirty forty fifty sixty seventy eighty ninety".split())}
_SCALES = {"thousand": 10**3, "million": 10**6, "billion": 10**9}
_WORD = "|".join(sorted([*_UNITS, *_TENS, "hundred", *_SCALES], key=len, reverse=True))
_WORDS = re.compile(rf"\b(?:{_WORD})(?:(?:[\s-]+|\s+and\s+)(?:{_WORD}))*\b", re.I)


def _words_value(phrase: str) -> Optional[int]:
    total, cur, seen = 0, 0, False
    for w in re.split(r"[\s-]+", phrase.lower()):
        if w == "and":
            continue
        if w in _UNITS:
            cur += _UNITS[w]
        elif w in _TENS:
            cur += _TENS[w]
        elif w == "hundred":
            cur = max(cur, 1) * 100
        elif w in _SCALES:
            total, cur = total + max(cur, 1) * _SCALES[w], 0
        seen = True
    return total + cur if seen else None


def _words_to_digits(s: str) -> str:
    def sub(m: re.Match) -> str:
        if re.fullmatch(r"(?i)thousand|million|billion|hundred", m.group(0)):
            return m.group(0)  # a bare scale word belongs to the number before it ("2.5 million")
        v = _words_value(m.group(0))
        return str(v) if v is not None else m.group(0)

    return _WORDS.sub(sub, s)


# ------------------------------------------------------------------ spans and their stated result
_NUM = r"-?(?:\d[\d,]*(?:\.\d+)?|\.\d+)"
_HEDGE = re.compile(r"\b(?:or|either|maybe|perhaps|possibly|probably|not sure|could be|might be|between|depending)\b", re.I)
_OPERATOR = re.compile(r"(?:\d|\))\s*(?:[-+*/×÷^]|\bx\b)\s*(?:-?\d|\(|\\frac)")
# a fraction or mixed number is one number, not an operation ("2 1/2", "3/4", "2\\frac{1}{2}")
_FRACTION_TOKEN = re.compile(r"(?<![\d.])(?:\d+\s+)?\d+/\d+(?![\d/])|(?:\d+\s*)?\\frac\{-?\d+\}\{\d+\}")
_LEADING = [
    (re.compile(r"^(-?)(\d+)\s+(\d+)/(\d+)(?![\d/])"), "mixed"),
    (re.compile(r"^(-?)(\d+)\s*\\frac\{(\d+)\}\{(\d+)\}"), "mixed"),
    (re.compile(r"^(-?)\\frac\{(-?\d+)\}\{(\d+)\}"), "frac"),
    (re.compile(r"^(-?)(\d+)/(\d+)(?![\d/])"), "frac"),
    (re.compile(rf"^({_NUM})\s*(thousand|million|billion)?\b"), "dec"),
]
_SENTENCE_END = re.compile(r"(?<=[.!?])(?=\s|$)|\n")
_FINISHED = re.compile(r"(?:[.!?})\]$]|\*\*)\s*$")  # "**" closes markdown bold; a lone "*" is an operator


def _number(s: str) -> Optional[tuple[Fraction, str]]:
    """The span's first number (an exact fraction) and the LaTeX math-verify reads for it."""
    s = s.strip().lstrip("=:").strip()
    for rx, kind in _LEADING:
        m = rx.match(s)
        if not m:
            continue
        try:
            if kind == "mixed":
                v = int(m.group(2)) + Fraction(int(m.group(3)), int(m.group(4)))
                v = -v if m.group(1) else v
            elif kind == "frac":
                if int(m.group(3)) == 0:
                    return None
                v = Fraction(int(m.group(2)), int(m.group(3)))
                v = -v if m.group(1) else v
            else:
                v = Fraction(Decimal(m.group(1).replace(",", "")))
                if m.group(2):
                    v *= _SCALES[m.group(2).lower()]
        except (InvalidOperation, ValueError):
            return None
        if kind == "dec" and not m.group(2):
            return v, m.group(1).replace(",", "")  # the written decimal: math-verify rounds it itself
        return v, (f"\\frac{{{v.numerator}}}{{{v.denominator}}}" if v.denominator != 1 else str(v.numerator))
    return None


def _stated(span: str) -> tuple[str, Optional[tuple[Fraction, str]]]:
    """(reason, number) for a span that should state one result."""
    span = _words_to_digits(span).strip().rstrip(".").strip()
    if _HEDGE.search(span):
        return "hedge", None
    result = span.rsplit("=", 1)[1] if "=" in span else span
    if _OPERATOR.search(_FRACTION_TOKEN.sub("1", result)):
        return "expression", None
    got = _number(result)
    if got is None and "=" not in span:
        # a sentence, not a bare answer: its last number ("So she needs $5 more." -> 5)
        found = [m for m in re.finditer(rf"(?<![\w.]){_NUM}(?:\s*(?:thousand|million|billion)\b)?", result)]
        got = _number(result[found[-1].start():]) if found else None
    if got is None:
        return "none", None
    return "stated", got


# ------------------------------------------------------------------ markers
_ANSWER_IS = re.compile(r"answer\s*(?:is|:|=)\s*:?", re.I)
_CUE = re.compile(r"\b(?:wait|actually|correction|oops|mistake|hmm|no,|reconsider|re-?check|double[- ]check|"
                  r"let me (?:check|verify|re))", re.I)


def _boxed(s: str) -> list[tuple[int, int, str]]:
    out = []
    for m in re.finditer(r"\\(?:boxed|fbox)\s*\{", s):
        depth, j = 1, m.end()
        while j < len(s) and depth:
            depth += {"{": 1, "}": -1}.get(s[j], 0)
            j += 1
        if depth == 0:
            out.append((m.start(), j, s[m.end():j - 1]))
    return out


def _to_sentence_end(s: str, start: int) -> int:
    m = _SENTENCE_END.search(s, start)
    return m.start() if m else len(s)


def _markers(s: str) -> list[tuple[int, int, str]]:
    """(start, end, span) of every answer marker, in order of position."""
    found = _boxed(s)
    for m in re.finditer(r"####", s):
        end = _to_sentence_end(s, m.end())
        found.append((m.start(), end, s[m.end():end]))
    for m in _ANSWER_IS.finditer(s):
        end = _to_sentence_end(s, m.end())
        inner = [b for b in found if m.end() <= b[0] < end]  # "the answer is \boxed{5}": the box says it
        if not inner:
            found.append((m.start(), end, s[m.end():end]))
    return sorted(found)


def _last_sentence_with_number(s: str) -> Optional[str]:
    s = _words_to_digits(s)
    parts = [p for p in _SENTENCE_END.split(s) if p and re.search(r"\d", p)]
    return parts[-1] if parts else None


def read_answer(text: str) -> tuple[str, Optional[tuple[Fraction, str]]]:
    """(reason, number) of an output under the rule in the module docstring; reason is ``stated`` when a
    number was read, else one of :data:`NO_ANSWER`."""
    if not isinstance(text, str) or not text.strip():
        return "none", None
    s = _normalise(text)
    marks = _markers(s)
    if marks:
        start, end, span = marks[-1]
        reason, got = _stated(span)
        if reason == "stated":
            # a hedge across markers: "\boxed{35} or \boxed{28}"
            if len(marks) > 1 and re.fullmatch(r"\s*[.,]?\s*or\s*", s[marks[-2][1]:start], re.I):
                return "hedge", None
        cue = _CUE.search(s, end)
        if cue is None:
            return reason, got
        tail = s[cue.start():]
        if not _FINISHED.search(text):
            return "truncated", None
        sentence = _last_sentence_with_number(tail)
        return _stated(sentence) if sentence is not None else ("hedge", None)
    sentence = _last_sentence_with_number(s)
    if sentence is None:
        return "none", None
    if not _FINISHED.search(text.rstrip()) and not re.fullmatch(rf"\s*{_NUM}\s*", sentence):
        return "truncated", None  # a bare number on the last line is an answer, not a cut-off sentence
    return _stated(sentence)


def reference_answer(reference: str) -> tuple[Optional[tuple[Fraction, str]], str]:
    """The reference's number (GSM8K: after the last ``####``), or None with its trimmed text."""
    s = str(reference)
    tail = s.rsplit("####", 1)[1] if "####" in s else s
    reason, got = _stated(_normalise(tail))
    return (got if reason == "stated" else None), tail.strip()


def _equal(got: tuple[Fraction, str], want: tuple[Fraction, str]) -> bool:
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    # its one warning says that timeouts are off, which is what we ask for (see below)
    logging.getLogger("math_verify").setLevel(logging.ERROR)

    cfg = [LatexExtractionConfig(), ExprExtractionConfig()]
    # parsing_timeout/timeout_seconds use SIGALRM, which works only in the main thread; the inputs are
    # single numbers, so no time limit is needed
    gold = parse(f"${want[1]}$", cfg, parsing_timeout=None)
    pred = parse(f"${got[1]}$", cfg, parsing_timeout=None)
    if not gold or not pred:  # math-verify could not read a number we could: compare the exact values
        return got[0] == want[0]
    return bool(verify(gold, pred, timeout_seconds=None))


def reason_counts(reasons) -> dict[str, int]:
    """How many verdicts had each reason, every reason of :data:`REASONS` listed (zeros included) so that
    summaries of different runs have the same keys."""
    out = dict.fromkeys(REASONS, 0)
    for r in reasons:
        out[r] += 1
    return out


def judge(completion: str, reference: str) -> Verdict:
    """The verdict on one completion against its reference answer (module docstring)."""
    want, want_text = reference_answer(reference)
    if want is None:  # a reference that is not a number: the last marker's text against it
        marks = _markers(_normalise(completion)) if isinstance(completion, str) else []
        if not marks:
            return Verdict(False, "none")
        text = marks[-1][2].strip().rstrip(".").strip()
        ok = text.casefold() == want_text.casefold()
        return Verdict(ok, "correct" if ok else "wrong", text)
    reason, got = read_answer(completion)
    if reason != "stated":
        return Verdict(False, reason)
    ok = _equal(got, want)
    return Verdict(ok, "correct" if ok else "wrong", got[1])
