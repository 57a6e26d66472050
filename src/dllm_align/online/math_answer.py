"""The ``math_answer`` verifier: the answer a worked solution commits to, in the answer format its recipe asked
for, compared with the reference by ``math-verify``; three verdicts, each with its reason.

KTO pushes the policy toward every completion labelled desirable and away from every one labelled
undesirable, so a wrong label costs twice: a false positive teaches a wrong answer, a false negative pushes
away from a right one. The rule therefore reads only what the recipe's format marks as the answer, and
abstains (``unsure``) where a reader would have to guess:

1. **The format** (:data:`FORMATS`, the recipe's choice, stated in its prompt): ``hashes`` (``#### N``, the
   rest of the line), ``boxed`` (``\\boxed{N}`` / ``\\fbox{N}``, braces balanced), ``json`` (the value of a
   JSON field, ``"answer"`` by default) or ``answer_tag`` (``<answer>N</answer>``). Nothing else is read: no
   "the answer is", no last number. A completion without the format is ``none``, one whose format was
   opened and never closed ``truncated``; both are "no answer", undesirable or unsure as the recipe says
   (``no_answer``).
2. **One answer.** Every marked answer is read; several that disagree are ``two_answers`` (unsure): the
   output committed to two, or revised its answer. A number written after the last answer that is neither
   that answer nor one of the question's numbers means the output went on reasoning past its answer:
   ``revised`` (unsure). No word list decides either: only where the numbers are.
3. **One number.** Inside the answer, after its last ``=``: exactly one number, read by rule, is the answer;
   the text around it is its unit and is dropped (letters, currency and per-cent signs, a unit's exponent
   ``cm^2``). Two numbers are ``two_answers`` (``12 (13 with the teacher)``, ``12-13``, ``12 ± 1``, ``70,
   not 72``), unless only operators join them: then it is an ``expression`` with no stated value (unsure).
   No number at all is ``none``.
4. **Numbers in any locale** (:func:`read_number`): ``1,234.5`` and ``1.234,5``; groups of three by spaces,
   thin spaces or apostrophes; a single comma before one, two or four and more digits is a decimal comma
   (``12,5``); a single dot before exactly three digits reads either way (``1.234``): when only one reading
   equals the reference the verdict is ``ambiguous`` (unsure). Also scientific notation (``1.2e3``, ``1.2 ×
   10^3``, ``10³``), fractions and mixed numbers (``5/2``, ``2 1/2``, ``\\frac{5}{2}``, ``2\\frac{1}{2}``),
   the U+2212 minus and number words ("seventy-two", "two and a half").
5. **Equivalence** by ``math-verify`` (the reference and the answer as exact numbers); a reference that is
   not a number (MATH's ``\\frac{\\sqrt{3}}{2}``, ``(1, 2)``) is compared by ``math-verify`` on the two texts.

Bounded work: every step is one pass over the completion (markers by one scan with a stack, numbers by
regular expressions without backtracking), so the rule is linear in the completion's length (a test reads
1 MB); only an answer's own text, at most :data:`MAX_ANSWER_CHARS` characters, is parsed further
(``unreadable`` beyond that, unsure).

Reasons (:data:`REASONS`): ``correct`` (desirable), ``wrong`` (undesirable), ``none`` and ``truncated`` (no
answer: :data:`NO_ANSWER`), and the abstentions ``two_answers``, ``revised``, ``expression``, ``ambiguous``,
``unreadable`` (:data:`ABSTAIN`). The measured accuracy on held-out cases, beside ``math-verify`` alone and
lm-evaluation-harness's GSM8K extractors, is in docs/online.md (``python benchmarks/math_verifiers.py``).
"""

from __future__ import annotations

import json
import logging
import re
from collections import deque
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from fractions import Fraction
from typing import Optional

from dllm_align.online.components import ANSWER_FORMATS as FORMATS

# lazy imports: math_verify: it loads sympy (about a second), which only the comparison of an answer read needs,
# not the commands that import the verifiers without labelling
VERDICTS = ("desirable", "undesirable", "unsure")
NO_ANSWER = ("none", "truncated")
ABSTAIN = ("two_answers", "revised", "expression", "ambiguous", "unreadable")
REASONS = ("correct", "wrong", *NO_ANSWER, *ABSTAIN)
MAX_ANSWER_CHARS = 400

# math-verify's one warning says that its timeouts are off, which is what we ask for (see _verify)
logging.getLogger("math_verify").setLevel(logging.ERROR)


@dataclass(frozen=True)
class Verdict:
    """One output's label: ``verdict`` one of :data:`VERDICTS`, ``reason`` one of :data:`REASONS`, ``answer``
    the answer read (None when none was)."""

    verdict: str
    reason: str
    answer: Optional[str] = None

    @property
    def desirable(self) -> bool:
        return self.verdict == "desirable"


# How a prompt asks for each format: appended to the question, so that the format read is the one asked for.
INSTRUCTIONS = {
    "hashes": "Solve the problem step by step. Then give the final answer as a number on its own last line, "
              "written as #### followed by the number.",
    "boxed": "Solve the problem step by step. Then give the final answer in \\boxed{}.",
    "json": "Solve the problem step by step. Then end with a JSON object that holds the final answer as a number: "
            '{{"{field}": <number>}}.',
    "answer_tag": "Solve the problem step by step. Then give the final answer between <answer> and </answer>.",
}


def instruction(fmt: str, field: str = "answer") -> str:
    """The sentence a prompt gets so that its answer comes in format ``fmt``."""
    return INSTRUCTIONS[fmt].format(field=field) if fmt == "json" else INSTRUCTIONS[fmt]


# ------------------------------------------------------------------ markers of each format, one pass each
# A repetition loop can mark thousands of answers: only the distinct ones (up to this many) and the last are
# kept, so the work and the memory stay linear and flat (more distinct answers than this are two answers anyway).
_DISTINCT_KEPT = 16


@dataclass(frozen=True)
class Marked:
    """The answers a format marks in a completion: ``spans``, (start, end, text) of the first occurrence of each
    distinct text in order (at most :data:`_DISTINCT_KEPT`), ``last`` the last one, ``more`` whether there were
    more distinct texts than were kept, ``unclosed`` whether an answer was opened and never closed (and none
    closed)."""

    spans: list
    last: Optional[tuple]
    more: bool
    unclosed: bool


def _collect(found, unclosed) -> Marked:
    distinct: dict = {}
    last, more = None, False
    for span in found:
        if not span[2].strip():
            continue
        last = span
        if span[2] not in distinct:
            if len(distinct) < _DISTINCT_KEPT:
                distinct[span[2]] = span
            else:
                more = True
    return Marked(list(distinct.values()), last, more, last is None and unclosed())


def _hashes(s: str) -> Marked:
    found = ((m.start(), m.end(), m.group(1)) for m in re.finditer(r"####[ \t]*([^\n]*)", s))
    return _collect(found, lambda: "####" in s)


def _boxed(s: str) -> Marked:
    """``\\boxed{...}`` / ``\\fbox{...}`` with balanced braces: one scan over the braces with a stack of plain
    positions (an escaped brace ``\\{`` is text; a box inside a box is the outer one's), so a thousand unclosed
    boxes cost one pass, not a thousand."""
    starts: list = []  # where each open brace's group starts, -1 for a plain brace
    inner: list = []
    open_boxes = [0]

    def scan():
        for m in re.finditer(r"\\(?:boxed|fbox)\s*\{|\\[{}]|[{}]", s):
            tok = m.group(0)
            if tok in ("\\{", "\\}"):
                continue
            if tok != "}":
                box = tok != "{"
                starts.append(m.start() if box else -1)
                inner.append(m.end())
                open_boxes[0] += box
                continue
            if not starts:
                continue
            start, first = starts.pop(), inner.pop()
            if start >= 0:
                open_boxes[0] -= 1
                if open_boxes[0] == 0:
                    yield start, m.end(), s[first:m.start()]

    return _collect(scan(), lambda: open_boxes[0] > 0)


def _tags(s: str) -> Marked:
    """``<answer>...</answer>``: each closing tag pairs with the latest opening one (one scan)."""
    opened: list = [None]

    def scan():
        for m in re.finditer(r"<(/?)answer\s*>", s, re.I):
            if not m.group(1):
                opened[0] = m.end()
            elif opened[0] is not None:
                yield opened[0], m.end(), s[opened[0]:m.start()]
                opened[0] = None

    return _collect(scan(), lambda: opened[0] is not None)


_DECODER = json.JSONDecoder()
_JSON_KEYS_READ = 8  # the last keys only, each value decoded from at most _JSON_VALUE_CHARS: bounded work
_JSON_VALUE_CHARS = 4 * MAX_ANSWER_CHARS


def _json_field(s: str, field: str) -> Marked:
    """The values of ``"field":`` anywhere in the text (a JSON object, fenced or bare, or nested): each decoded
    from the key on, so a field of any JSON value type is read without parsing the objects around it."""
    keys = deque(re.finditer(r'"' + re.escape(field) + r'"\s*:\s*', s), maxlen=_JSON_KEYS_READ)
    failed = [False]

    def values():
        for m in keys:
            window = s[m.end():m.end() + _JSON_VALUE_CHARS]
            try:
                value, used = _DECODER.raw_decode(window)
            except (ValueError, RecursionError):  # cut off, or no JSON value (or one longer than any answer)
                failed[0] = True
                continue
            if value is None or isinstance(value, (bool, dict)):
                continue
            if isinstance(value, list):
                if len(value) != 1:  # several answers (or none) in a list
                    yield m.start(), m.end() + used, "; ".join(map(str, value))
                    continue
                value = value[0]
            yield m.start(), m.end() + used, repr(value) if isinstance(value, float) else str(value)

    return _collect(values(), lambda: failed[0])


def marked(text: str, fmt: str, field: str = "answer") -> Marked:
    """The answers ``text`` marks in format ``fmt`` (one of :data:`FORMATS`)."""
    if fmt == "hashes":
        return _hashes(text)
    if fmt == "boxed":
        return _boxed(text)
    if fmt == "json":
        return _json_field(text, field)
    if fmt == "answer_tag":
        return _tags(text)
    raise ValueError(f"unknown answer format {fmt!r}; known: {', '.join(FORMATS)}")


# ------------------------------------------------------------------ an answer's text as a number
_WRAPPER = re.compile(r"\\(?:text|textbf|textit|textrm|mathbf|mathrm|mathit|mbox|operatorname|displaystyle)\s*\{([^{}]*)\}")
_SUPERSCRIPT = str.maketrans("\u2070\u00b9\u00b2\u00b3\u2074\u2075\u2076\u2077\u2078\u2079\u207b", "0123456789-")


def _plain_text(s: str) -> str:
    """LaTeX and markdown around an answer removed, the minus and thin spaces made plain; linear."""
    s = s.replace("\u2212", "-").replace("{,}", ",").replace("\\%", "%").replace("\\$", "$")
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac").replace("\\times", "\u00d7").replace("\\cdot", "\u00d7")
    for _ in range(3):  # nested wrappers: \boxed{\text{\textbf{72}}}
        s = _WRAPPER.sub(r"\1", s)
    s = re.sub(r"\\[,;:! ]|~|\u2009|\u202f|\u00a0", " ", s)  # LaTeX and Unicode thin spaces are spaces
    s = re.sub(r"\\(?:left|right)|\$|\*\*|\\\(|\\\)|\\\[|\\\]", "", s)
    return s


_ONES = {w: i for i, w in enumerate(
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen "
    "seventeen eighteen nineteen".split())}
_TENS = {w: 10 * (i + 2) for i, w in enumerate("twenty thirty forty fifty sixty seventy eighty ninety".split())}
_SCALES = {"hundred": 100, "thousand": 10**3, "million": 10**6, "billion": 10**9}
_PARTS = {"half": Fraction(1, 2), "halves": Fraction(1, 2), "quarter": Fraction(1, 4), "quarters": Fraction(1, 4),
          "third": Fraction(1, 3), "thirds": Fraction(1, 3)}
_NUMBER_WORD = "|".join(sorted([*_ONES, *_TENS, *_SCALES, *_PARTS, "a", "an"], key=len, reverse=True))
_WORDS = re.compile(rf"\b(?:{_NUMBER_WORD})\b(?:(?:[\s-]+|\s+and\s+)\b(?:{_NUMBER_WORD})\b)*", re.I)


def _words_value(phrase: str) -> Optional[Fraction]:
    """"seventy-two" -> 72, "two and a half" -> 5/2, "three quarters" -> 3/4; None for a phrase that is
    not a number ("a", "and a")."""
    total, cur, frac, seen, pending = Fraction(0), Fraction(0), Fraction(0), False, None
    for w in re.split(r"[\s-]+", phrase.lower()):
        if w == "and":
            continue
        if w in ("a", "an"):
            pending = Fraction(1)
            continue
        if w in _ONES:
            cur += _ONES[w]
        elif w in _TENS:
            cur += _TENS[w]
        elif w == "hundred":
            cur = max(cur, 1) * 100
        elif w in _SCALES:
            total, cur = total + max(cur, 1) * _SCALES[w], Fraction(0)
        elif w in _PARTS:
            if pending is not None:  # "and a half": a part added to the whole before it
                frac += pending * _PARTS[w]
            elif cur:  # "three quarters": the count before it is the numerator
                frac, cur = frac + cur * _PARTS[w], Fraction(0)
            else:
                frac += _PARTS[w]
            pending = None
            seen = True
            continue
        else:
            return None
        pending = None
        seen = True
    return total + cur + frac if seen else None


def _words_to_digits(s: str) -> str:
    def sub(m: re.Match) -> str:
        v = _words_value(m.group(0))
        if v is None:
            return m.group(0)
        return str(v.numerator) if v.denominator == 1 else f"{v.numerator}/{v.denominator}"

    return _WORDS.sub(sub, s)


# A numeral: groups and a decimal part with any of the separators, then an optional exponent (e-notation,
# "× 10^k", "10^{k}"); fractions and mixed numbers as one numeral. Every repetition is anchored on a separator
# followed by digits, so no match backtracks over a long run.
_DIGITS = r"[0-9]+(?:[.,' ][0-9]+)*"
_EXP = r"(?:[eE][-+]?[0-9]+|\s*[\u00d7x*]\s*10\s*\^\s*\{?\s*-?[0-9]+\s*\}?)?"
_NUMERAL = re.compile(
    r"(?P<sign>-\s*)?(?:"
    r"\\frac\s*\{\s*(?P<fn>-?[0-9]+)\s*\}\s*\{\s*(?P<fd>[0-9]+)\s*\}"
    r"|(?P<mw>[0-9]+)\s*(?:\\frac\s*\{\s*(?P<mn>[0-9]+)\s*\}\s*\{\s*(?P<md>[0-9]+)\s*\}|\s(?P<mn2>[0-9]+)/(?P<md2>[0-9]+)(?![0-9]))"
    r"|(?P<n>[0-9]+)/(?P<d>[0-9]+)(?![0-9])"
    rf"|(?P<num>{_DIGITS}|\.[0-9]+){_EXP}"
    r")"
)
_OPERATOR = re.compile(r"[-+*/\u00d7\u00f7^]|\\div")


def _decimal(body: str) -> list[Fraction]:
    """Every reading of one numeral's digits and separators (module docstring, point 4); empty when it is no
    well-formed number."""
    seps = [c for c in body if not c.isdigit()]
    if not seps:
        return [Fraction(int(body))]
    groups = re.split(r"[.,' ]", body)

    def grouped(dec: Optional[str]) -> Optional[Fraction]:
        # the groups before the decimal mark: the first one to three digits, the rest exactly three
        parts = re.split(r"[.,' ]", body if dec is None else body[:body.rindex(dec)])
        if not (1 <= len(parts[0]) <= 3 and all(len(p) == 3 for p in parts[1:])):
            return None
        whole = "".join(parts)
        frac = "" if dec is None else body[body.rindex(dec) + 1:]
        return Fraction(Decimal(whole + ("." + frac if frac else "")))

    kinds = set(seps)
    if "," in kinds and "." in kinds:  # the last of the two is the decimal mark
        dec = "," if body.rindex(",") > body.rindex(".") else "."
        if seps.count(dec) != 1:
            return []
        v = grouped(dec)
        return [v] if v is not None else []
    if len(seps) == 1 and seps[0] in ",.":
        after = groups[1]
        as_decimal = Fraction(Decimal(groups[0] + "." + after))
        if len(after) != 3:
            return [as_decimal]  # 12,5 and 12.25: a decimal mark (a group has three digits)
        as_group = grouped(None)
        if seps[0] == "," or as_group is None:
            return [as_group if as_group is not None else as_decimal]  # 1,234: English thousands
        return [as_decimal, as_group]  # 1.234: a decimal or German thousands
    if len(kinds) == 1:
        v = grouped(None)  # 1,234,567 / 1.234.567 / 1 234 / 1'234
        return [v] if v is not None else []
    return []


def _exponent(m: re.Match) -> int:
    tail = m.group(0)[m.end("num") - m.start(0):]
    got = re.search(r"-?[0-9]+\s*\}?\s*$", tail)
    if not tail.strip() or got is None:
        return 0
    return int(got.group(0).strip(" }"))


def _readings(m: re.Match) -> list[Fraction]:
    """Every value one numeral match can mean (two only for a ``1.234``)."""
    neg = bool(m.group("sign"))
    if m.group("fn") is not None:
        d = int(m.group("fd"))
        vals = [Fraction(int(m.group("fn")), d)] if d else []
    elif m.group("mw") is not None:
        n, d = (m.group("mn"), m.group("md")) if m.group("mn") is not None else (m.group("mn2"), m.group("md2"))
        vals = [int(m.group("mw")) + Fraction(int(n), int(d))] if int(d) else []
    elif m.group("n") is not None:
        d = int(m.group("d"))
        vals = [Fraction(int(m.group("n")), d)] if d else []
    else:
        body = m.group("num")
        try:
            vals = _decimal(body) if not body.startswith(".") else [Fraction(Decimal("0" + body))]
        except (InvalidOperation, ValueError):
            vals = []
        e = _exponent(m)
        vals = [v * Fraction(10) ** e for v in vals]
    return [-v for v in vals] if neg else vals


@dataclass(frozen=True)
class Reading:
    """What an answer's text says: ``kind`` ``number`` (``values``: its readings, two for an ambiguous
    separator), ``latex`` (LaTeX beyond numbers, for math-verify), ``two_answers``, ``expression``, ``none``
    or ``unreadable``."""

    kind: str
    values: tuple = ()
    text: str = ""


def read_number(text: str) -> Reading:
    """An answer's text read as one number (module docstring, points 3 and 4)."""
    if len(text) > MAX_ANSWER_CHARS:
        return Reading("unreadable", text=text[:40])
    s = re.sub("[\u2070\u00b9\u00b2\u00b3\u2074-\u2079\u207b]+", lambda m: "^" + m.group(0).translate(_SUPERSCRIPT),
               _plain_text(text))  # 10³ is 10^3, cm² is cm^2
    s = _words_to_digits(s)
    if "=" in s:
        s = s.rsplit("=", 1)[1]  # x = 72, 24 + 48 = 72: the stated value
    s = re.sub(r"(?<=[A-Za-z\u00b0])\s*\^\s*\{?-?[0-9]+\}?", "", s)  # a unit's exponent: cm^2
    s = re.sub(r"\s+", " ", s).strip()
    if re.search(r"\\(?!frac\b)[A-Za-z]", s):  # \sqrt, \pi, \pm ...: maths this reader does not do
        return Reading("latex", text=s)
    found = list(_NUMERAL.finditer(s))
    # a number glued to a word is part of it (a name such as "B12"), not an answer
    found = [m for m in found if not (m.start() > 0 and s[m.start() - 1].isalpha() and not m.group("sign"))]
    if not found:
        return Reading("none", text=s)
    if len(found) > 1:
        between = [s[a.end():b.start()] for a, b in zip(found, found[1:])]
        # an arithmetic operator between every two numbers (brackets around it allowed), and no words
        operators_only = all(re.fullmatch(r"[\s)]*(?:[-+*/\u00d7\u00f7^]|\\div)[\s(]*", g) for g in between)
        if operators_only and not re.search(r"[A-Za-z]", s):
            return Reading("expression", text=s)
        # "-" read as a sign: 12-13 is a range written with a hyphen, a second number either way
        return Reading("two_answers", text=s)
    m = found[0]
    vals = _readings(m)
    if not vals:
        return Reading("unreadable", text=s)
    return Reading("number", tuple(vals), m.group(0).strip())


def reference_answer(reference: str) -> tuple[Optional[Fraction], str]:
    """The reference's number (GSM8K: after the last ``####``), or None with its trimmed text for a reference
    that is not one number (compared by math-verify as it is)."""
    s = str(reference)
    tail = s.rsplit("####", 1)[1] if "####" in s else s
    got = read_number(tail.strip())
    if got.kind == "number":
        return got.values[0], tail.strip()  # a reference's 1.234 is the decimal (GSM8K writes 1,234 for thousands)
    return None, tail.strip()


def _latex(v: Fraction) -> str:
    return str(v.numerator) if v.denominator == 1 else f"\\frac{{{v.numerator}}}{{{v.denominator}}}"


def _verify(gold_text: str, pred_text: str) -> Optional[bool]:
    """math-verify's equivalence of two LaTeX texts; None when it cannot read one of them."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    cfg = [LatexExtractionConfig(), ExprExtractionConfig()]
    # parsing_timeout/timeout_seconds use SIGALRM, which works only in the main thread; the texts are short
    # (MAX_ANSWER_CHARS) and the whole call is bounded by the verifier's time limit
    gold = parse(f"${gold_text}$", cfg, parsing_timeout=None)
    pred = parse(f"${pred_text}$", cfg, parsing_timeout=None)
    if not gold or not pred:
        return None
    return bool(verify(gold, pred, timeout_seconds=None))


def _equal(got: Fraction, want: Fraction) -> bool:
    """math-verify's equivalence of two exact numbers (its rounding to 6 places included); the exact values
    when it cannot read one of them."""
    same = _verify(_latex(want), _latex(got))
    return got == want if same is None else same


# ------------------------------------------------------------------ after the answer
_ANY_NUMBER = re.compile(r"[0-9]+(?:[.,][0-9]+)*")


def _number_keys(s: str) -> set:
    """The numbers a text writes, as plain decimals (separators dropped), for telling a restated number from
    a new one."""
    out = set()
    for m in _ANY_NUMBER.finditer(s):
        out.add(m.group(0).replace(",", "").rstrip("0").rstrip(".") if "." in m.group(0) else m.group(0).replace(",", ""))
    return out


def _keys_of(v: Fraction) -> set:
    keys = {str(abs(v.numerator)) if v.denominator == 1 else ""}
    d = abs(v.numerator) / v.denominator
    keys.add(f"{d:.6f}".rstrip("0").rstrip("."))
    return keys - {""}


def _went_on(text: str, end: int, answer: Fraction, prompt: str) -> bool:
    """Whether the text after the last answer writes a number that is neither the answer nor one of the
    question's: the output reasoned on past its answer. (The working's numbers are not excused: a revision
    to a number met earlier is still a revision.)"""
    after = _number_keys(text[end:])
    if not after:
        return False
    known = _number_keys(prompt) | _keys_of(answer)
    return bool(after - known)


# ------------------------------------------------------------------ the verdict
def judge(completion: str, reference: str, *, fmt: str = "hashes", field: str = "answer", prompt: str = "",
          no_answer: str = "undesirable") -> Verdict:
    """The verdict on one completion against its reference answer, reading the answer format ``fmt``
    (module docstring). ``no_answer``: the verdict of a completion without the format (``undesirable`` or
    ``unsure``); ``prompt``: the question, whose numbers may be restated after the answer."""
    if no_answer not in ("undesirable", "unsure"):
        raise ValueError(f"no_answer must be undesirable or unsure, not {no_answer!r}")
    if not isinstance(completion, str):
        return Verdict(no_answer, "none")
    found = marked(completion, fmt, field)
    if found.last is None:
        return Verdict(no_answer, "truncated" if found.unclosed else "none")
    want, want_text = reference_answer(reference)
    if want is None:
        return _judge_text(found, want_text)
    if found.more:
        return Verdict("unsure", "two_answers", found.last[2][:40])
    readings = {text: read_number(text) for _, _, text in found.spans}
    last = readings[found.last[2]]
    if len(found.spans) == 1 and last.kind == "latex":
        ok = bool(_verify(_latex(want), last.text))
        return Verdict("desirable" if ok else "undesirable", "correct" if ok else "wrong", last.text)
    numbers = [r for r in readings.values() if r.kind == "number"]
    other = [r for r in readings.values() if r.kind not in ("number", "none")]
    if other:
        return Verdict("unsure", "unreadable" if other[-1].kind == "latex" else other[-1].kind, other[-1].text or None)
    if not numbers:
        return Verdict(no_answer, "none")
    if any(set(r.values) != set(numbers[0].values) for r in numbers[1:]):
        return Verdict("unsure", "two_answers", numbers[-1].text)
    last = numbers[-1] if last.kind != "number" else last
    end = found.last[1]
    if fmt == "json":  # the fields of the answer's object come in any order: what follows the object counts
        end = max(end, completion.rfind("}") + 1)
    if _went_on(completion, end, last.values[0], prompt):
        return Verdict("unsure", "revised", last.text)
    hits = [v for v in last.values if _equal(v, want)]
    if hits and len(hits) < len(last.values):
        return Verdict("unsure", "ambiguous", last.text)
    return Verdict("desirable" if hits else "undesirable", "correct" if hits else "wrong", last.text)


def _judge_text(found: Marked, want_text: str) -> Verdict:
    """A reference that is not one number: the last answer against it by math-verify, or as text."""
    texts = {t.strip() for _, _, t in found.spans}
    got = found.last[2].strip()
    if found.more or len(texts) > 1:
        return Verdict("unsure", "two_answers", got[:40])
    if len(got) > MAX_ANSWER_CHARS:
        return Verdict("unsure", "unreadable", got[:40])
    ok = got.casefold() == want_text.casefold() or bool(_verify(want_text, got))
    return Verdict("desirable" if ok else "undesirable", "correct" if ok else "wrong", got)


def reason_counts(reasons) -> dict[str, int]:
    """How many verdicts had each reason, every reason of :data:`REASONS` listed (zeros included) so that
    summaries of different runs have the same keys."""
    out = dict.fromkeys(REASONS, 0)
    for r in reasons:
        out[r] += 1
    return out
