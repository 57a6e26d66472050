"""How well GSM8K-style answers are labelled: accuracy, false positives and false negatives per format on
the hand-labelled held-out set tests/fixtures/gsm8k_heldout.jsonl, for

* ``old``: the ``math_answer`` rule before the strict rule (last ``####``, else last ``\\boxed{}``, else
  the number after "answer is", else the last number), kept here only to measure it;
* ``math-verify``: ``math_verify.parse`` of the whole output against the reference number, nothing else;
* ``lm-eval strict`` / ``lm-eval flexible``: lm-evaluation-harness's GSM8K filters (``strict-match``:
  first ``#### (-?[0-9.,]+)``; ``flexible-extract``: the last match of ``(-?[$0-9.,]{2,})|(-?[0-9]+)``),
  scored as its ``exact_match`` with the task's settings (ignore case, remove ``,``, ``$``, everything
  up to ``#### `` and a final ``.``). lm_eval's own filter classes when it is installed, else the same
  regexes;
* ``new``: :mod:`dllm_align.online.math_answer`.

A false positive is a row labelled undesirable by hand that the verifier calls desirable (the costly
error for KTO); a false negative the reverse.

    python benchmarks/math_verifiers.py            # the table docs/online.md shows
    python benchmarks/math_verifiers.py --json     # the numbers, machine-readable
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import defaultdict
from decimal import Decimal, InvalidOperation
from fractions import Fraction
from pathlib import Path
from typing import Optional

FIXTURE = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "gsm8k_heldout.jsonl"


# ------------------------------------------------------------------ the rule before (measured, not used)
_NUMBER = r"-?\$?\s*\d[\d,]*(?:\.\d+)?(?:\s*/\s*\d+)?|-?\$?\s*\.\d+"
_HASHES = re.compile(r"####\s*(.+?)\s*$", re.M)
_ANSWER_IS = re.compile(r"answer\s*(?:is|:)\s*:?\s*(" + _NUMBER + r")", re.I)
_ANY_NUMBER = re.compile(_NUMBER)


def _old_boxed(text: str) -> Optional[str]:
    i = text.rfind("\\boxed{")
    if i < 0:
        return None
    depth, j = 1, i + len("\\boxed{")
    start = j
    while j < len(text) and depth:
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        j += 1
    return text[start:j - 1] if depth == 0 else None


def _old_extract(text: str) -> Optional[str]:
    if not text.strip():
        return None
    hashes = _HASHES.findall(text)
    if hashes:
        return hashes[-1].strip()
    boxed = _old_boxed(text)
    if boxed is not None:
        return boxed.strip()
    said = _ANSWER_IS.findall(text)
    if said:
        return said[-1].strip()
    numbers = _ANY_NUMBER.findall(text)
    return numbers[-1].strip() if numbers else None


def _old_number(answer: str) -> Optional[Fraction]:
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


def old(output: str, reference: str) -> bool:
    got, want = _old_extract(output), _old_extract(reference)
    if got is None or want is None:
        return False
    a, b = _old_number(got), _old_number(want)
    if a is not None and b is not None:
        return a == b
    return got.strip().casefold() == want.strip().casefold()


# ------------------------------------------------------------------ math-verify alone
def math_verify_alone(output: str, reference: str) -> bool:
    from math_verify import parse, verify

    gold = parse(reference.rsplit("####", 1)[1].strip())
    return bool(verify(gold, parse(output)))


# ------------------------------------------------------------------ lm-evaluation-harness's GSM8K filters
STRICT = r"#### (\-?[0-9\.\,]+)"
FLEXIBLE = r"(-?[$0-9.,]{2,})|(-?[0-9]+)"


def _lm_eval_extract(output: str, pattern: str, group_select: int) -> str:
    try:
        from lm_eval.filters.extraction import RegexFilter
    except ImportError:  # the same rule from its published facts
        found = re.findall(pattern, output)
        if not found:
            return "[invalid]"
        m = found[group_select]
        return [x for x in m if x][0] if isinstance(m, tuple) else m
    f = RegexFilter(regex_pattern=pattern, group_select=group_select)
    return list(f.apply([[output]], [{}]))[0][0]


def _lm_eval_score(extracted: str, reference: str) -> bool:
    def clean(s: str) -> str:
        for rx in (",", r"\$", r"(?s).*#### ", r"\.$"):
            s = re.sub(rx, "", s)
        return s.lower()

    return clean(extracted) == clean(reference)


def lm_eval_strict(output: str, reference: str) -> bool:
    return _lm_eval_score(_lm_eval_extract(output, STRICT, 0), reference)


def lm_eval_flexible(output: str, reference: str) -> bool:
    return _lm_eval_score(_lm_eval_extract(output, FLEXIBLE, -1), reference)


# ------------------------------------------------------------------ the new rule
def new(output: str, reference: str) -> bool:
    from dllm_align.online.math_answer import judge

    return judge(output, reference).desirable


VERIFIERS = {"old": old, "math-verify": math_verify_alone, "lm-eval strict": lm_eval_strict,
             "lm-eval flexible": lm_eval_flexible, "new": new}


def measure(rows: list[dict]) -> dict:
    out: dict = {}
    for name, fn in VERIFIERS.items():
        per: dict = defaultdict(lambda: {"n": 0, "right": 0, "fp": 0, "fn": 0})
        for r in rows:
            got = fn(r["output"], r["answer"])
            for key in (r["format"], "all"):
                c = per[key]
                c["n"] += 1
                c["right"] += got == r["desirable"]
                c["fp"] += got and not r["desirable"]
                c["fn"] += (not got) and r["desirable"]
        out[name] = dict(per)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print the numbers as JSON")
    args = ap.parse_args()
    rows = [json.loads(x) for x in FIXTURE.read_text().splitlines()]
    res = measure(rows)
    if args.json:
        print(json.dumps(res, indent=1, sort_keys=True))
        return
    wrong = sum(not r["desirable"] for r in rows)
    print(f"{len(rows)} outputs, {len(rows) - wrong} desirable, {wrong} not (hand labels)\n")
    names = list(VERIFIERS)
    print("| format | n | " + " | ".join(f"{n} right / FP / FN" for n in names) + " |")
    print("|---|---:|" + "---:|" * len(names))
    formats = sorted({r["format"] for r in rows}) + ["all"]
    for f in formats:
        cells = [f"{res[n][f]['right']} / {res[n][f]['fp']} / {res[n][f]['fn']}" for n in names]
        label = "**all**" if f == "all" else f
        print(f"| {label} | {res[names[0]][f]['n']} | " + " | ".join(cells) + " |")
    print("\nfalse positives as a share of the undesirable outputs: "
          + ", ".join(f"{n} {100 * res[n]['all']['fp'] / wrong:.1f}%" for n in names), file=sys.stdout)


if __name__ == "__main__":
    main()
