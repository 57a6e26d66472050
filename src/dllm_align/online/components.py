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
from typing import Optional

from dllm_align.config.components import Component, register


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
    "verifier", "math_answer", "dllm_align.online.verifiers:math_answer_rule",
    summary="the final committed answer equals the row's reference answer (math-verify)"))
register(Component(
    "verifier", "regex", "dllm_align.online.verifiers:regex_rule",
    summary="the completion contains a match of PATTERN (re.search, bounded in time)",
    traits={"argument": "PATTERN", "check_argument": _pattern_problem}))
register(Component(
    "verifier", "judge", "dllm_align.online.absolute:judge_rule",
    summary="an LLM judge in absolute mode answers [[YES]] (the recipe's judge section)",
    traits={"argument": "MODEL", "check_argument": _model_problem}))
