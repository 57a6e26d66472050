"""Verifiers: functions that label one completion, given its prompt and row: desirable, undesirable or unsure
(:data:`VERDICTS`), each with its reason where the verifier gives one.

What a verifier returns: ``True`` (desirable), ``False`` (undesirable), ``None`` (unsure: it abstains), or a
verdict with its reason (an object with ``verdict`` and ``reason``, or a pair ``(verdict, reason)``);
:func:`apply` turns each into an :class:`Outcome`. A call past its time bound is unsure too (reason
``timeout``), so one pathological completion never stops a labelling run. ``label`` and ``online`` leave the
unsure rows out of training and count them.

A verifier is a component of kind ``verifier`` (``dllm_align.config.components``): declared torch-free with
its name, the argument it takes after ':' and its own settings (``online.<name>``), the built-in ones in
:mod:`dllm_align.online.components`; its target is a factory ``(Selection) -> Rule``. A spec ``name:ARGUMENT``
selects ``name`` with that argument; a spec no component takes is a user's ``package.module:function``.

Built in:

* ``sort``: the toy task (``dllm_align.data.toy``): the completion is the prompt's digits in ascending order
  (reasons: ``correct``, ``descending``, ``unsorted``, ``malformed``: not the prompt's digits).
* ``math_answer``: the answer the completion gives in the recipe's answer format (``#### N`` by default,
  ``\\boxed{}``, a JSON field or an ``<answer>`` tag) equals the row's reference answer (column ``answer``
  by default, e.g. GSM8K's ``... #### 42``), compared by ``math-verify``; unsure when it commits to two
  answers or revises itself, "no answer" (undesirable, or unsure as the recipe says) without the format.
  The full rule is in :mod:`dllm_align.online.math_answer`.
* ``regex:PATTERN``: the completion contains a match of PATTERN (Python ``re.search``; an empty pattern is
  refused, and each search is bounded in time like a user's function, so catastrophic backtracking stops).
* ``judge:MODEL``: an LLM judge in absolute mode (:mod:`dllm_align.online.absolute`), bound to the run
  folder once it is taken (its verdict cache lives there).
* ``package.module:function``: your function ``(prompt, completion, row)`` returning a verdict as above
  (``prompt`` is the last
  user message's text, ``row`` the prompt's source row as a dict); like the judge's rule judges, running
  your code is announced on stderr. Its printing, exits and hangs are contained
  (:mod:`dllm_align.core.usercode`); its arity is checked before anything is sampled.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from pydantic import BaseModel

from dllm_align.config.schema import split_verifier, unused_settings_problems, verifier_problem
from dllm_align.core.errors import DllmAlignError, UserError
from dllm_align.core.usercode import OverTime, call, load_function
from dllm_align.data.toy import desirable, digits_of, undesirable
from dllm_align.online.math_answer import REASONS, instruction, judge, reference_answer

Verifier = Callable[[str, str, dict], Any]
VERDICTS = ("desirable", "undesirable", "unsure")


@dataclass(frozen=True)
class Outcome:
    """One completion's verdict (one of :data:`VERDICTS`) and its reason (None when the verifier gives none)."""

    verdict: str
    reason: Optional[str] = None

    @property
    def label(self) -> Optional[bool]:
        """The training label: True, False, or None for an unsure row (left out of training)."""
        return None if self.verdict == "unsure" else self.verdict == "desirable"


@dataclass(frozen=True)
class Rule:
    """A verifier with its name and the source columns it needs. ``why``, where the rule has one, gives the
    reason behind a verdict (``math_answer``: one of :data:`dllm_align.online.math_answer.REASONS`), so a
    labeller can count the no-answer kinds instead of folding them into "undesirable"."""

    name: str
    fn: Verifier
    needs: tuple[str, ...] = ()
    why: Optional[Callable[[str, str, dict], str]] = None
    # What is wrong with a source row for this rule (None: nothing), checked before anything is sampled.
    check_row: Optional[Callable[[dict], Optional[str]]] = None
    # Every reason ``why`` can give, so that summaries of different rounds have the same keys (zeros included).
    reasons: tuple[str, ...] = ()
    # A verifier that works in the run folder (the absolute judge caches its verdicts there): called with the
    # folder once it is taken, it returns what labels instead of ``fn`` (with ``batch`` when it can ask in bulk).
    bind: Optional[Callable[[Path], Any]] = None
    # What every prompt is told so that its answer comes in the form the verifier reads (math_answer's answer
    # format), appended to the last user message; None: the prompts are sampled as they are.
    instruction: Optional[str] = None

    def explain(self, prompt: str, completion: str, row: dict) -> Optional[str]:
        """The reason behind the verdict, or None for a rule that gives none."""
        return self.why(prompt, completion, row) if self.why is not None else None


def _sort(prompt: str, completion: str, row: dict) -> bool:
    return completion.strip() == desirable(digits_of(prompt))


SORT_REASONS = ("correct", "descending", "unsorted", "malformed")


def _sort_why(prompt: str, completion: str, row: dict) -> str:
    """``correct``; ``descending`` (the reverse sort); ``unsorted`` (the prompt's digits in another order);
    ``malformed`` (not the prompt's digits: missing, extra or other characters)."""
    digits, got = digits_of(prompt), completion.strip()
    if got == desirable(digits):
        return "correct"
    if got == undesirable(digits):
        return "descending"
    return "unsorted" if sorted(got) == sorted(digits) else "malformed"


def _math(column: str, fmt: str = "hashes", field: str = "answer", no_answer: str = "undesirable") -> Verifier:
    """math_answer's verdict, with its reason, in one reading (:func:`dllm_align.online.math_answer.judge`)."""

    def check(prompt: str, completion: str, row: dict):
        return judge(completion, str(row[column]), fmt=fmt, field=field, prompt=prompt, no_answer=no_answer)

    return check


def _math_row(column: str) -> Callable[[dict], Optional[str]]:
    def problem(row: dict) -> Optional[str]:
        v = row.get(column)
        if isinstance(v, bool) or not isinstance(v, (str, int, float)) or not str(v).strip():
            return f"{column} is {json.dumps(v)[:40]}: math_answer needs a reference answer (text or a number)"
        want, text = reference_answer(str(v))
        if want is None and not text:
            return f"{column} {str(v)[:40]!r} holds no final answer for math_answer to compare against"
        return None

    return problem


@dataclass(frozen=True)
class Selection:
    """A verifier as a spec selects it: the spec as written, the text after ':' (None: none), the verifier's own
    settings (``online.<name>``, its defaults when the recipe has none), the reference-answer column
    (``--answer-column``) and the recipe (None when there is none)."""

    spec: str
    argument: Optional[str]
    settings: BaseModel
    answer_column: str = "answer"
    recipe: Any = None


def sort_rule(sel: Selection) -> Rule:
    return Rule("sort", _sort, why=_sort_why, reasons=SORT_REASONS)


def math_answer_rule(sel: Selection) -> Rule:
    """math_answer with its own settings (``online.math_answer``: the answer format, its JSON field, what no
    answer is, the sentence that asks for the format)."""
    own = sel.settings
    check = _math(sel.answer_column, own.format, own.field, own.no_answer)
    said = instruction(own.format, own.field) if own.instruction is None else own.instruction
    return Rule("math_answer", check, (sel.answer_column,), None, _math_row(sel.answer_column), REASONS,
                instruction=said or None)


def regex_rule(sel: Selection) -> Rule:
    rx = re.compile(sel.argument or "")  # checked with the spec (verifier_problem)
    return Rule(sel.spec, lambda p, c, r: rx.search(c) is not None)


def recorded_settings(spec: str, recipe) -> Optional[dict]:
    """The own settings (``online.<name>``) of the registered verifier ``spec`` selects, as a run records them;
    None for a verifier without settings (or a user's function)."""
    comp, _ = split_verifier(spec) if isinstance(spec, str) else (None, None)
    if comp is None or not comp.has_settings():
        return None
    online = getattr(recipe, "online", None)
    own = online.own_settings(comp.name) if online is not None else comp.settings()
    return own.model_dump(mode="json")


def check_spec(spec: Any, label: str) -> None:
    """Refuse a rule spec that cannot name a verifier, without importing it (the recipe schema checks
    ``online.rule`` with the same words); :func:`get_rule` then loads it."""
    problem = verifier_problem(spec)
    if problem:
        raise UserError(f"{label}: {problem}")


def get_rule(spec: str, *, answer_column: str = "answer", recipe=None) -> Rule:
    """The verifier a ``--rule`` names (module docstring), every check that needs no model done; one error naming
    it when it is unknown, and a user's function that cannot take (prompt, completion, row) refused before
    anything is sampled. Its own settings are the recipe's ``online.<name>`` (defaults without an online section)."""
    label = f"--rule {spec}"
    check_spec(spec, label)
    comp, argument = split_verifier(spec)
    online = getattr(recipe, "online", None)
    if online is not None:  # another verifier's settings in the recipe: nothing would read them
        problems = unused_settings_problems(online, "verifier", comp.name if comp is not None else spec, "--rule")
        if problems:
            raise UserError(f"online.{problems[0][0]}: {problems[0][1]}")
    if comp is None:
        fn, _ = load_function(spec, label, args=("", "", {}), what="(prompt, completion, row) and return True or False")
        return Rule(spec, fn)
    own = online.own_settings(comp.name) if online is not None else comp.settings()
    rule = comp.load()(Selection(spec, argument, own, answer_column, recipe))
    if not isinstance(rule, Rule):
        raise UserError(f"{label}: the verifier {comp.name!r} ({comp.target}) returned {type(rule).__name__}, not a Rule")
    return rule


def apply(rule: Rule, prompt: str, completion: str, row: dict, where: str) -> Outcome:
    """Run a verifier on one completion (printing, exiting and hanging contained: :mod:`dllm_align.core.usercode`)
    and read its verdict (module docstring); a call past its bound is unsure (reason ``timeout``). An exception
    or an answer that is no verdict is one error naming the rule and the row."""
    try:
        v: Any = call(rule.fn, (prompt, completion, row), f"--rule {rule.name}", where)
    except OverTime:
        return Outcome("unsure", "timeout")
    except DllmAlignError:
        raise
    except Exception as e:  # noqa: BLE001 - the user's function failed: say where, not a traceback
        raise UserError(f"--rule {rule.name} failed on {where}: {type(e).__name__}: {e}"[:400]) from None
    got = outcome_of(v)
    if got is None:
        raise UserError(f"--rule {rule.name} returned {v!r}"[:200] + f" on {where}; a verifier returns True, False, "
                        "None (unsure) or (verdict, reason) with a verdict of " + ", ".join(VERDICTS))
    if got.reason is None and rule.why is not None and got.verdict != "unsure":
        got = Outcome(got.verdict, rule.explain(prompt, completion, row))
    return got


def outcome_of(v: Any) -> Optional[Outcome]:
    """A verifier's answer as an :class:`Outcome`, or None when it is no verdict."""
    if isinstance(v, bool):
        return Outcome("desirable" if v else "undesirable")
    if v is None:
        return Outcome("unsure")
    if isinstance(v, tuple) and len(v) == 2:
        verdict, reason = v
    elif hasattr(v, "verdict") and hasattr(v, "reason"):
        verdict, reason = v.verdict, v.reason
    else:
        return None
    if verdict not in VERDICTS or not (reason is None or isinstance(reason, str)):
        return None
    return Outcome(verdict, reason)
