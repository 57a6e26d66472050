"""The built-in components this package implements, declared for ``dllm_align.config.components``.

Torch-free: only declarations (names, settings, ignored keys, checks, targets); the implementations load when
a command first uses them.

Verifiers (``online.rule``, ``--rule``): a spec ``name`` or ``name:ARGUMENT`` selects the verifier ``name``;
its target is a factory ``(online.verifiers.Selection) -> online.verifiers.Rule``. Traits: ``argument`` (the
metavar of the text after ':', e.g. ``PATTERN``; absent: the verifier takes none) and ``check_argument``
(``(text) -> problem or None``, run by ``recipes check`` without importing the verifier). Its own settings live
under ``online.<name>``. A ``package.module:function`` spec needs no declaration (``online.verifiers``).
"""

from __future__ import annotations

import re
from typing import Literal, Optional

from pydantic import Field

from dllm_align.config.components import Component, ComponentSettings, register

# math_answer's answer formats (dllm_align.online.math_answer reads each): GSM8K's "#### N", MATH's \boxed{},
# a JSON field, an <answer> tag.
ANSWER_FORMATS = ("hashes", "boxed", "json", "answer_tag")


class MathAnswerSettings(ComponentSettings):
    """math_answer's own settings (``online.math_answer.*``): the answer format the prompts ask for and the only
    place the verifier reads an answer, and what a completion without it is."""

    format: Literal["hashes", "boxed", "json", "answer_tag"] = Field(
        "hashes", description="Where the answer is, as the prompt asks for it: hashes (a last line '#### N', GSM8K's), "
        "boxed (\\boxed{N}, MATH's), json (a JSON field, online.math_answer.field) or answer_tag (<answer>N</answer>).")
    field: str = Field("answer", min_length=1, pattern=r"^[^\"\\]+$",
                       description="format json: the field that holds the answer.")
    no_answer: Literal["undesirable", "unsure"] = Field(
        "undesirable", description="A completion without the format (no answer): undesirable (the policy did not "
        "answer as asked) or unsure (left out of training).")
    instruction: Optional[str] = Field(
        None, description="The sentence appended to every prompt's last user message to ask for the format; unset: "
        "the format's own (dllm_align.online.math_answer.INSTRUCTIONS); '': none (the prompts ask already).")


def _pattern_problem(pattern: str) -> Optional[str]:
    if not pattern:
        return "an empty pattern matches every completion: give the text a desirable completion contains"
    try:
        re.compile(pattern)
    except re.error as e:
        return f"not a valid regular expression ({e})"
    return None


def _model_problem(model: str) -> Optional[str]:
    return None if model.strip() else "name the judge model, e.g. judge:gpt-4o-mini"


register(Component(
    "verifier", "sort", "dllm_align.online.verifiers:sort_rule",
    summary="the toy task: the completion is the prompt's digits in ascending order"))
register(Component(
    "verifier", "math_answer", "dllm_align.online.verifiers:math_answer_rule", settings=MathAnswerSettings,
    summary="the answer in the recipe's format (online.math_answer.format) equals the row's reference answer "
            "(math-verify); unsure when it gives two or revises itself"))
register(Component(
    "verifier", "regex", "dllm_align.online.verifiers:regex_rule",
    summary="the completion contains a match of PATTERN (re.search, bounded in time)",
    traits={"argument": "PATTERN", "check_argument": _pattern_problem}))
register(Component(
    "verifier", "judge", "dllm_align.online.absolute:judge_rule",
    summary="an LLM judge in absolute mode answers [[YES]] (the recipe's judge section)",
    traits={"argument": "MODEL", "check_argument": _model_problem}))
