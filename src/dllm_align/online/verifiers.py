"""Verifiers: functions that label one completion desirable (True) or not, given its prompt and row.

Built in:

* ``sort``: the toy task (``dllm_align.data.toy``): the completion is the prompt's digits in ascending order.
* ``math_answer``: the completion's final answer equals the row's reference answer (column ``answer`` by
  default, e.g. GSM8K's ``... #### 42``). The final answer is, in this order: the last ``#### X``; else the
  last ``\\boxed{X}``; else the number after the last "answer is" / "answer:"; else the last number in the
  text. Numbers are compared as exact fractions after removing ``$``, thousands commas, spaces and a
  trailing period (``1,234.50`` = ``1234.5``; ``3/4`` = ``0.75``; ``-7`` = ``-7.0``); a non-numeric answer
  is compared as trimmed, case-folded text.
* ``regex:PATTERN``: the completion contains a match of PATTERN (Python ``re.search``; an empty pattern is
  refused, and each search is bounded in time like a user's function, so catastrophic backtracking stops).
* ``package.module:function``: your function ``(prompt, completion, row) -> bool`` (``prompt`` is the last
  user message's text, ``row`` the prompt's source row as a dict); like the judge's rule judges, running
  your code is announced on stderr. Its printing, exits and hangs are contained
  (:mod:`dllm_align.core.usercode`); its arity is checked before anything is sampled.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from fractions import Fraction
from typing import Any, Callable, Optional

from dllm_align.core.errors import DllmAlignError, UserError

Verifier = Callable[[str, str, dict], bool]

_NUMBER = r"-?\$?\s*\d[\d,]*(?:\.\d+)?(?:\s*/\s*\d+)?|-?\$?\s*\.\d+"
_HASHES = re.compile(r"####\s*(.+?)\s*$", re.M)
_ANSWER_IS = re.compile(r"answer\s*(?:is|:)\s*:?\s*(" + _NUMBER + r")", re.I)
_ANY_NUMBER = re.compile(_NUMBER)


def _boxed(text: str) -> Optional[str]:
    """The contents of the last ``\\boxed{...}`` (nested braces counted)."""
    i = text.rfind("\\boxed{")
    if i < 0:
        return None
    depth, j = 1, i + len("\\boxed{")
    start = j
    while j < len(text) and depth:
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        j += 1
    return text[start:j - 1] if depth == 0 else None


def extract_answer(text: str) -> Optional[str]:
    """The final answer of a worked solution (module docstring), or None."""
    if not isinstance(text, str) or not text.strip():
        return None
    hashes = _HASHES.findall(text)
    if hashes:
        return hashes[-1].strip()
    boxed = _boxed(text)
    if boxed is not None:
        return boxed.strip()
    said = _ANSWER_IS.findall(text)
    if said:
        return said[-1].strip()
    numbers = _ANY_NUMBER.findall(text)
    return numbers[-1].strip() if numbers else None


def as_number(answer: str) -> Optional[Fraction]:
    """An answer as an exact number, or None when it is not one. A unit after the number is dropped
    (``160 minutes``, ``25 students``, ``100%``)."""
    s = answer.strip().replace("\\$", "").replace("$", "")
    m = re.match(r"^\s*(-?[\d,]*\.?\d+(?:\s*/\s*\d+)?)\s*(?:%|[A-Za-z][A-Za-z .]*)?$", s)
    if m:
        s = m.group(1)
    s = s.replace(",", "").replace(" ", "").rstrip(".")
    s = re.sub(r"^\\?(?:text|mathrm)\{([^}]*)\}$", r"\1", s)
    s = re.sub(r"^\\[dt]?frac\{(-?\d+)\}\{(\d+)\}$", r"\1/\2", s)
    try:
        if "/" in s:
            a, b = s.split("/", 1)
            return Fraction(Decimal(a)) / Fraction(Decimal(b)) if Decimal(b) != 0 else None
        return Fraction(Decimal(s))
    except (InvalidOperation, ValueError, ZeroDivisionError):
        return None


def same_answer(got: Optional[str], want: Optional[str]) -> bool:
    if got is None or want is None:
        return False
    a, b = as_number(got), as_number(want)
    if a is not None and b is not None:
        return a == b
    return got.strip().casefold() == want.strip().casefold()


@dataclass(frozen=True)
class Rule:
    """A verifier with its name and the source columns it needs."""

    name: str
    fn: Verifier
    needs: tuple[str, ...] = ()
    # What is wrong with a source row for this rule (None: nothing), checked before anything is sampled.
    check_row: Optional[Callable[[dict], Optional[str]]] = None


def _sort(prompt: str, completion: str, row: dict) -> bool:
    from dllm_align.data.toy import desirable, digits_of

    return completion.strip() == desirable(digits_of(prompt))


def _math(column: str) -> Verifier:
    def check(prompt: str, completion: str, row: dict) -> bool:
        return same_answer(extract_answer(completion), extract_answer(str(row[column])))

    return check


def _math_row(column: str) -> Callable[[dict], Optional[str]]:
    def problem(row: dict) -> Optional[str]:
        v = row.get(column)
        if isinstance(v, bool) or not isinstance(v, (str, int, float)) or not str(v).strip():
            return f"{column} is {json.dumps(v)[:40]}: math_answer needs a reference answer (text or a number)"
        if not extract_answer(str(v)):
            return f"{column} {str(v)[:40]!r} holds no final answer for math_answer to compare against"
        return None

    return problem


BUILTIN = ("sort", "math_answer", "regex:PATTERN", "package.module:function")


def check_spec(spec: Any, label: str) -> None:
    """Refuse a rule spec that cannot name a verifier, without importing anything (the recipe schema checks
    ``online.rule`` with the same words); :func:`get_rule` then imports a user's module."""
    from dllm_align.config.schema import verifier_problem

    problem = verifier_problem(spec)
    if problem:
        raise UserError(f"{label}: {problem}")


def get_rule(spec: str, *, answer_column: str = "answer") -> Rule:
    """The verifier a ``--rule`` names (module docstring); one error naming it when it is unknown, and a user's
    function that cannot take (prompt, completion, row) refused before anything is sampled."""
    label = f"--rule {spec}"
    check_spec(spec, label)
    if spec == "sort":
        return Rule("sort", _sort)
    if spec == "math_answer":
        return Rule("math_answer", _math(answer_column), (answer_column,), _math_row(answer_column))
    if spec.startswith("regex:"):
        rx = re.compile(spec[len("regex:"):])  # checked by check_spec
        return Rule(spec, lambda p, c, r: rx.search(c) is not None)
    if spec.startswith("judge:"):
        raise UserError(f"{label}: the judge labels through dllm_align.online.absolute, not as a function")
    from dllm_align.core.usercode import load_function

    fn, _ = load_function(spec, label, args=("", "", {}), what="(prompt, completion, row) and return True or False")
    return Rule(spec, fn)


def apply(rule: Rule, prompt: str, completion: str, row: dict, where: str) -> bool:
    """Run a verifier on one completion (printing, exiting and hanging contained: :mod:`dllm_align.core.usercode`);
    an exception or a non-boolean answer is one error naming the rule and the row."""
    from dllm_align.core.usercode import call

    try:
        v: Any = call(rule.fn, (prompt, completion, row), f"--rule {rule.name}", where)
    except DllmAlignError:
        raise
    except Exception as e:  # noqa: BLE001 - the user's function failed: say where, not a traceback
        raise UserError(f"--rule {rule.name} failed on {where}: {type(e).__name__}: {e}"[:400]) from None
    if not isinstance(v, bool):
        raise UserError(f"--rule {rule.name} returned {v!r}"[:200] + f" on {where}; a verifier returns True or False")
    return v
