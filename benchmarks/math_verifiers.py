"""How well answers to GSM8K-style prompts are labelled, on the case set benchmarks/data/math_verifier_cases.jsonl
(``benchmarks/math_verifier_cases.py`` writes it and says how its ``dev`` / ``heldout`` split was made):
right / false positives / false negatives / unsure, per part and per class, for

* ``math_answer``: :mod:`dllm_align.online.math_answer`, reading the answer format each row's recipe asked for
  (three verdicts; a completion without the format is undesirable, the default);
* ``math-verify``: ``math_verify.parse`` of the whole output against the reference number, nothing else;
* ``lm-eval strict`` / ``lm-eval flexible``: lm-evaluation-harness's GSM8K filters (``strict-match``: the first
  ``#### (-?[0-9.,]+)``; ``flexible-extract``: the last match of ``(-?[$0-9.,]{2,})|(-?[0-9]+)``), scored as its
  ``exact_match`` with the task's settings (ignore case, remove ``,``, ``$``, everything up to ``#### `` and a
  final ``.``): lm_eval's own filter classes when it is installed, else the same regexes.

A row's ``expected`` verdict is desirable, undesirable or unsure (it commits to two answers or revises
itself: abstaining is right, undesirable is accepted, desirable is a false positive). A verifier's unsure on
a desirable or undesirable row is an abstention, counted as ``unsure`` and neither right nor an error.

Targets (docs/online.md), on the held-out part: false positives at most 1% of the rows that are not
desirable; false negatives fewer than math-verify alone's; unsure at most 10% of the rows that commit to one
answer in their format (``in_format``, expected desirable or undesirable).

    python benchmarks/math_verifiers.py                 # held-out and dev tables, and the targets
    python benchmarks/math_verifiers.py --split dev     # the dev part only (what a rule may be tuned on)
    python benchmarks/math_verifiers.py --json          # the numbers, machine-readable
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import defaultdict
from pathlib import Path

CASES = Path(__file__).resolve().parent / "data" / "math_verifier_cases.jsonl"


# ------------------------------------------------------------------ math-verify alone
def math_verify_alone(row: dict) -> str:
    from math_verify import parse, verify

    ok = bool(verify(parse(row["answer"]), parse(row["output"])))
    return "desirable" if ok else "undesirable"


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


def lm_eval_strict(row: dict) -> str:
    ok = _lm_eval_score(_lm_eval_extract(row["output"], STRICT, 0), "#### " + row["answer"])
    return "desirable" if ok else "undesirable"


def lm_eval_flexible(row: dict) -> str:
    ok = _lm_eval_score(_lm_eval_extract(row["output"], FLEXIBLE, -1), "#### " + row["answer"])
    return "desirable" if ok else "undesirable"


# ------------------------------------------------------------------ the rule
def math_answer(row: dict) -> str:
    from dllm_align.online.math_answer import judge

    return judge(row["output"], row["answer"], fmt=row["format"], prompt=row["question"]).verdict


VERIFIERS = {"math_answer": math_answer, "math-verify": math_verify_alone, "lm-eval flexible": lm_eval_flexible,
             "lm-eval strict": lm_eval_strict}


def outcome(expected: str, got: str) -> str:
    """right, fp, fn or unsure (module docstring)."""
    if got == "unsure":
        return "right" if expected == "unsure" else "unsure"
    if got == "desirable":
        return "right" if expected == "desirable" else "fp"
    return "fn" if expected == "desirable" else "right"


def measure(rows: list[dict]) -> dict:
    """Per verifier and class (and ``all``): n, right, fp, fn, unsure; plus the targets' denominators."""
    out: dict = {}
    for name, fn in VERIFIERS.items():
        per: dict = defaultdict(lambda: {"n": 0, "right": 0, "fp": 0, "fn": 0, "unsure": 0, "committed": 0,
                                         "unsure_committed": 0, "not_desirable": 0,
                                         "said_unsure": 0})
        for r in rows:
            got = fn(r)
            res = outcome(r["expected"], got)
            committed = r["in_format"] and r["expected"] != "unsure"
            for key in (r["class"], "all"):
                c = per[key]
                c["n"] += 1
                c[res] += 1
                c["committed"] += committed
                c["unsure_committed"] += committed and got == "unsure"
                c["not_desirable"] += r["expected"] != "desirable"
                c["said_unsure"] += got == "unsure"
        out[name] = dict(per)
    return out


def targets(res: dict) -> dict:
    a, alone = res["math_answer"]["all"], res["math-verify"]["all"]
    fp_share = a["fp"] / max(a["not_desirable"], 1)
    unsure_share = a["unsure_committed"] / max(a["committed"], 1)
    return {"fp_share": fp_share, "fp_ok": fp_share <= 0.01, "fn": a["fn"], "fn_math_verify": alone["fn"],
            "fn_ok": a["fn"] < alone["fn"], "unsure_share": unsure_share, "unsure_ok": unsure_share <= 0.10}


def table(rows: list[dict], res: dict, title: str, per_class: bool) -> str:
    names = list(VERIFIERS)
    expected = defaultdict(int)
    for r in rows:
        expected[r["expected"]] += 1
    lines = [f"### {title}: {len(rows)} outputs ({expected['desirable']} desirable, {expected['undesirable']} "
             f"undesirable, {expected['unsure']} unsure)", "",
             "| class | n | " + " | ".join(f"{n} right / FP / FN / unsure" for n in names) + " |",
             "|---|---:|" + "---:|" * len(names)]
    classes = (sorted({r["class"] for r in rows}) if per_class else []) + ["all"]
    for c in classes:
        cells = [f"{res[n][c]['right']} / {res[n][c]['fp']} / {res[n][c]['fn']} / {res[n][c]['unsure']}" for n in names]
        lines.append(f"| {'**all**' if c == 'all' else c} | {res[names[0]][c]['n']} | " + " | ".join(cells) + " |")
    hand = [r for r in rows if r["source"] == "hand"]
    if hand:  # the rows written one by one, apart from the generated ones
        h = measure(hand)
        lines += ["", f"written by hand ({len(hand)} of the {len(rows)}): " + "; ".join(
            f"{n} {h[n]['all']['right']} / {h[n]['all']['fp']} / {h[n]['all']['fn']} / {h[n]['all']['unsure']}" for n in names)]
    t = targets(res)
    a = res["math_answer"]["all"]
    lines += ["", f"math_answer: false positives {a['fp']} of {a['not_desirable']} rows not desirable "
              f"({100 * t['fp_share']:.1f}%, target <= 1%: {'met' if t['fp_ok'] else 'MISSED'}); false negatives "
              f"{t['fn']} against math-verify alone's {t['fn_math_verify']} ({'met' if t['fn_ok'] else 'MISSED'}); "
              f"unsure on {a['unsure_committed']} of {a['committed']} outputs that commit to one answer in their format "
              f"({100 * t['unsure_share']:.1f}%, target <= 10%: {'met' if t['unsure_ok'] else 'MISSED'}); unsure in all "
              f"{a['said_unsure']} of {len(rows)} ({a['said_unsure'] - a['unsure']} of them where abstaining is right)."]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--split", choices=("heldout", "dev", "both"), default="both",
                    help="which part to measure (default: both, the held-out part first)")
    ap.add_argument("--per-class", action="store_true", help="a row per class, not only the totals")
    ap.add_argument("--json", action="store_true", help="print the numbers as JSON")
    args = ap.parse_args()
    rows = [json.loads(x) for x in CASES.read_text(encoding="utf-8").splitlines()]
    parts = ("heldout", "dev") if args.split == "both" else (args.split,)
    results = {}
    for part in parts:
        mine = [r for r in rows if r["split"] == part]
        res = measure(mine)
        results[part] = {"counts": res, "targets": targets(res)}
        if not args.json:
            print(table(mine, res, f"{part} part", args.per_class) + "\n")
    if args.json:
        print(json.dumps(results, indent=1, sort_keys=True))
    else:
        print("(lm-eval extractors: " + ("lm_eval's own classes" if _has_lm_eval() else
                                         "lm_eval not installed, the same regexes") + ")", file=sys.stderr)


def _has_lm_eval() -> bool:
    try:
        import lm_eval.filters.extraction  # noqa: F401
    except ImportError:
        return False
    return True


if __name__ == "__main__":
    main()
