"""The fourth adversarial round (tests/round4.py runs it, tests/round4_cases.py holds the cases) in the suite.

The fast subset (refusals that come before any model is loaded, about a second each) runs with the
suite; the cases that fail on the code this round was written against are marked ``xfail(strict=True)``
with the class of the failure, so a fix turns them into an unexpected pass and the marker is removed
then. Everything else (sampling, training, kill-and-rerun, hostile judge servers, gpu_check) is
``slow``: ``pytest --run-slow tests/test_reliability_round4.py``, or the table with
``python tests/reliability.py --round 4``.
"""

from __future__ import annotations

import pytest

from round4 import make_ctx, run_case, run_kill
from round4_cases import CASES, KILLS

_PROMPT = "label: a bad prompt is an internal `_Bad` error, exit 1, naming no file or line"
_IMPORT = "label: a rule module's import failure is not one Error line naming --rule, exit 2"
_FOLDER = "a refusal before any work still creates the output folder"
_ONLINE_RULE = "recipes check accepts an unknown or malformed online.rule"
_DOCTOR = "doctor accepts a block size, expert count or expert groups it cannot run, and answers LLaDA2.1"

# Fast cases that fail today, by class (docs/reliability.md, "fourth round, before fixes").
FAILS_TODAY = {
    "label-prompt-null": _PROMPT, "label-prompt-number": _PROMPT, "label-prompt-empty": _PROMPT,
    "label-prompt-blank": _PROMPT, "label-prompt-bool": _PROMPT, "label-prompt-empty-list": _PROMPT,
    "label-prompt-object": _PROMPT, "label-prompt-bad-role": _PROMPT, "label-question-null": _PROMPT,
    "label-csv-empty-prompt": _PROMPT,
    "label-rule-path-escape": "a module spec like ../../etc/passwd:f is a raw TypeError, exit 1",
    "label-rule-no-module": "a module spec ':f' is a raw ValueError, exit 1",
    "label-rule-import-raises": _IMPORT, "label-rule-syntax-error": _IMPORT,
    "label-rule-import-exit-0": "sys.exit(0) at the rule module's import ends label with exit 0 and no error",
    "label-rule-import-exit-3": "sys.exit(3) at the rule module's import ends label with exit 3 and no Error line",
    "label-judge-key-unset": _FOLDER,
    "label-judge-url-not-a-url": _FOLDER + "; the error names --base-url, a flag label does not have",
    "label-judge-url-ftp": _FOLDER + "; the error names --base-url, a flag label does not have",
    "online-bad-rule-leaves-nothing": _FOLDER + " (online.json blocks the corrected rerun)",
    "online-rule-path-escape": _FOLDER + "; a raw TypeError, exit 1",
    "online-prompts-missing": _FOLDER,
    "online-prompts-null": _FOLDER + "; " + _PROMPT,
    "online-record-damaged": "a damaged online.json is a raw JSONDecodeError, exit 1",
    "recipe-alias-bomb-check": "a YAML alias bomb is expanded without bound (recipes check hangs)",
    "recipe-online-rule-unknown": _ONLINE_RULE, "recipe-online-rule-bad-regex": _ONLINE_RULE,
    "recipe-online-rule-empty-regex": _ONLINE_RULE, "recipe-online-rule-empty": _ONLINE_RULE,
    "recipe-online-rule-path-escape": _ONLINE_RULE,
    "doctor-block-size-0": _DOCTOR, "doctor-block-size-negative": _DOCTOR, "doctor-block-size-huge": _DOCTOR,
    "doctor-block-size-word": "doctor: block_size 'four' is a raw ValueError not naming block_size",
    "doctor-zero-experts": _DOCTOR, "doctor-zero-expert-groups": _DOCTOR, "doctor-llada21": _DOCTOR,
}


def _param(case):
    marks = [pytest.mark.xfail(strict=True, reason=FAILS_TODAY[case.id])] if case.id in FAILS_TODAY else []
    if not case.fast:
        marks.append(pytest.mark.slow)
    return pytest.param(case, id=case.id, marks=marks)


def test_the_round_is_large_and_covers_every_surface():
    classes = {c.cls for c in CASES} | {k.cls for k in KILLS}
    assert len(CASES) + len(KILLS) >= 100
    assert {"label-prompts", "label-rule", "label-folder", "online", "online-kill", "recipes", "block", "doctor", "cache",
            "gpu_check", "judge"} <= classes
    assert set(FAILS_TODAY) <= {c.id for c in CASES if c.fast}


@pytest.fixture(scope="module")
def ctx(tmp_path_factory):
    return make_ctx(tmp_path_factory.mktemp("round4"))


@pytest.fixture(scope="module")
def full_ctx(tmp_path_factory):
    return make_ctx(tmp_path_factory.mktemp("round4-full"), need_cache=True, need_sdar=True)


@pytest.fixture(scope="module")
def kill_ctx(tmp_path_factory):
    return make_ctx(tmp_path_factory.mktemp("round4-kill"), need_straight=True)


@pytest.mark.parametrize("case", [_param(c) for c in CASES if c.fast])
def test_fast_refusal(case, ctx, tmp_path):
    r = run_case(case, ctx, tmp_path / "case")
    assert r.ok, f"{r.got}: " + "; ".join(r.problems)


@pytest.mark.parametrize("case", [_param(c) for c in CASES if not c.fast])
def test_slow_case(case, full_ctx, tmp_path):
    r = run_case(case, full_ctx, tmp_path / "case")
    assert r.ok, f"{r.got}: " + "; ".join(r.problems)


@pytest.mark.slow
@pytest.mark.parametrize("kill", KILLS, ids=[k.id for k in KILLS])
def test_online_interrupted_and_rerun(kill, kill_ctx, tmp_path):
    r = run_kill(kill, kill_ctx, tmp_path / "case")
    assert r.ok, "; ".join(r.problems)
