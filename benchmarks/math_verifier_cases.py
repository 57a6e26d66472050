"""The case set of ``benchmarks/math_verifiers.py``: model outputs for GSM8K-style prompts, each with the
answer format its recipe asked for, the reference answer and the verdict a verifier should give, split into a
``dev`` part (rules may be written and tuned against it) and a ``heldout`` part (only measured).

    python benchmarks/math_verifier_cases.py          # rewrites benchmarks/data/math_verifier_cases.jsonl
    python benchmarks/math_verifier_cases.py --check  # exits 1 when the file is not what this script writes

Each row: ``id``, ``split``, ``source`` (``template``: generated below with drawn numbers; ``hand``: written
out one by one in :data:`HAND`), ``format`` (the recipe's answer format: ``hashes`` ``#### N``, ``boxed``
``\\boxed{N}``, ``json`` a JSON ``"answer"`` field, ``answer_tag`` ``<answer>N</answer>``), ``class``,
``question``, ``answer`` (the reference, a plain number), ``output``, ``expected`` and ``in_format``.

``expected``: ``desirable`` (the output commits to one answer, in the format, equal to the reference),
``undesirable`` (it commits to another answer, or to none in the format), ``unsure`` (it commits to two
answers or revises itself: a verifier should abstain; undesirable is accepted too, desirable never). A
verifier's unsure on a desirable or undesirable row is counted as an abstention, not as an error.
``in_format``: the output holds the format's answer (the denominator of the unsure target).

The split is fixed by the row's content, not by order or by any verifier: a row is ``heldout`` when the first
byte of sha256(format, answer, output) is below 128 (about half). It was made, and the file committed, before
the rule it measures was written; the rule is tuned on ``dev`` only.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import re
import sys
from fractions import Fraction
from pathlib import Path

OUT = Path(__file__).resolve().parent / "data" / "math_verifier_cases.jsonl"
FORMATS = ("hashes", "boxed", "json", "answer_tag")
SEED = 48


def split_of(fmt: str, answer: str, output: str) -> str:
    h = hashlib.sha256(f"{fmt}\x00{answer}\x00{output}".encode()).digest()
    return "heldout" if h[0] < 128 else "dev"


# ------------------------------------------------------------------ numbers as people and models write them
def plain(v: Fraction) -> str:
    if v.denominator == 1:
        return str(v.numerator)
    d = v.numerator / v.denominator
    s = f"{d:.6f}".rstrip("0").rstrip(".")
    if Fraction(s) == v:
        return s
    return f"{v.numerator}/{v.denominator}"


_UNITS = ("zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen "
          "seventeen eighteen nineteen").split()
_TENS = "twenty thirty forty fifty sixty seventy eighty ninety".split()


def words(n: int) -> str:
    if n < 20:
        return _UNITS[n]
    if n < 100:
        return _TENS[n // 10 - 2] + ("" if n % 10 == 0 else "-" + _UNITS[n % 10])
    if n < 1000:
        return _UNITS[n // 100] + " hundred" + ("" if n % 100 == 0 else " and " + words(n % 100))
    return words(n // 1000) + " thousand" + ("" if n % 1000 == 0 else " " + words(n % 1000))


def words_of(v: Fraction) -> str:
    whole, frac = divmod(v, 1)
    tail = {Fraction(1, 2): " and a half", Fraction(1, 4): " and a quarter", Fraction(3, 4): " and three quarters"}
    if frac == 0:
        return words(int(whole))
    return words(int(whole)) + tail[frac]


def grouped(n: int, sep: str) -> str:
    return f"{n:,}".replace(",", sep)


# ------------------------------------------------------------------ problems: (question, worked steps, answer)
NAMES = ("Natalia", "Weng", "Betty", "Julie", "James", "Mark", "Albert", "Ken", "Alexis", "Tina", "Randy", "Joy")


def p_clips(r: random.Random):
    a = 2 * r.randint(12, 60)
    n = r.choice(NAMES)
    q = f"{n} sold clips to {a} of her friends in April, and then she sold half as many clips in May. How many clips did {n} sell altogether in April and May?"
    steps = f"In May {n} sold {a} / 2 = {a // 2} clips. Altogether she sold {a} + {a // 2} = {a + a // 2} clips."
    return q, steps, Fraction(a + a // 2), a


def p_wage(r: random.Random):
    w, h = r.choice((12, 15, 18, 20, 25)), r.randint(3, 9)
    n = r.choice(NAMES)
    q = f"{n} earns ${w} an hour for babysitting. Yesterday, she did {h} hours of babysitting. How much did she earn?"
    steps = f"She earned {w} * {h} = ${w * h}."
    return q, steps, Fraction(w * h), w


def p_half(r: random.Random):
    c, k = r.randint(2, 9), r.choice((2, 4))
    n = r.choice(NAMES)
    total = Fraction(c * k + k // 2, k)  # c and a half / c and a quarter... kept to halves and quarters
    q = f"{n} has {c * k + k // 2} cups of flour and splits them equally into {k} bowls. How many cups go in each bowl?"
    steps = f"Each bowl gets {c * k + k // 2} / {k} = {plain(total)} cups."
    return q, steps, total, c * k + k // 2


def p_speed(r: random.Random):
    s, h = r.choice((40, 45, 50, 60, 72)), r.randint(2, 6)
    q = f"A train travels at {s} km/h for {h} hours. How far does it travel?"
    steps = f"Distance = speed * time = {s} * {h} = {s * h} km."
    return q, steps, Fraction(s * h), s


def p_percent(r: random.Random):
    n, p = r.choice((40, 60, 80, 120, 200)), r.choice((10, 15, 25, 30))
    q = f"A class has {n} students and {p}% of them walk to school. How many students walk to school?"
    steps = f"{p}% of {n} is {p} / 100 * {n} = {n * p // 100}."
    return q, steps, Fraction(n * p, 100), n


def p_population(r: random.Random):
    a, b = r.randint(1200, 9800), r.randint(150, 900)
    q = f"A town had {a} residents. This year {b} more moved in. How many residents does the town have now?"
    steps = f"The town now has {a} + {b} = {a + b} residents."
    return q, steps, Fraction(a + b), a


def p_price(r: random.Random):
    p, n = r.choice((Fraction(5, 2), Fraction(15, 4), Fraction(25, 2), Fraction(7, 2))), r.randint(2, 5)
    q = f"A notebook costs ${plain(p)}. How much do {n} notebooks cost?"
    steps = f"{n} notebooks cost {n} * {plain(p)} = ${plain(p * n)}."
    return q, steps, p * n, n


def p_pages(r: random.Random):
    t, y = r.choice((120, 180, 240, 300)), r.randint(10, 30)
    q = f"A book has {t} pages. Julie read {y} pages yesterday and twice as many today. If she wants to read half of the remaining pages tomorrow, how many pages should she read?"
    rem = t - 3 * y
    steps = f"Today she read {y} * 2 = {2 * y} pages, {3 * y} in all. {t} - {3 * y} = {rem} pages remain, and half of that is {rem} / 2 = {rem / 2:g}."
    return q, steps, Fraction(rem, 2), t


def p_big(r: random.Random):
    a, m = r.randint(11, 99) * 1000 + r.randint(100, 999), r.randint(2, 4)
    q = f"A warehouse holds {a} boxes. A second warehouse holds {m} times as many. How many boxes does the second warehouse hold?"
    steps = f"It holds {a} * {m} = {a * m} boxes."
    return q, steps, Fraction(a * m), a


def p_sci(r: random.Random):
    a, e = r.choice((12, 15, 25, 35, 48)), r.choice((3, 4, 5))
    v = Fraction(a * 10 ** e, 10)
    q = f"A cell divides so that there are {a} cells after one hour; each hour afterwards the count is multiplied by 10. Written in full, how many cells are there after {e} more hours, divided by 10?"
    steps = f"After {e} more hours there are {a} * 10^{e} cells; divided by 10 that is {plain(v)}."
    return q, steps, v, a


PROBLEMS = (p_clips, p_wage, p_half, p_speed, p_percent, p_population, p_price, p_pages, p_big, p_sci)


# ------------------------------------------------------------------ how each format wraps a final answer
def marker(fmt: str, content: str, style: int = 0) -> str:
    if fmt == "hashes":
        return f"#### {content}"
    if fmt == "boxed":
        return ("The answer is $\\boxed{%s}$." if style % 2 == 0 else "\\boxed{%s}") % content
    if fmt == "json":
        # a plain number is a JSON number; anything else a JSON string
        value = content if re.fullmatch(r"-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?", content) else json.dumps(content, ensure_ascii=False)
        return ("```json\n{\"answer\": %s}\n```" if style % 2 == 0 else "{\"answer\": %s}") % value
    return f"<answer>{content}</answer>"


def other_format(fmt: str) -> str:
    return {"hashes": "boxed", "boxed": "answer_tag", "json": "hashes", "answer_tag": "json"}[fmt]


HEDGES = ("{g} ({h} if you count the teacher)", "{g}\u2013{h}", "{g} \u00b1 1", "{g} or {h}", "between {g} and {h}",
          "{g}-{h}", "{g} (or {h})", "{g}, maybe {h}")
REVISIONS = ("On second thought, I left out one step, so the total is {x}.",
             "Scratch that: recounting gives {x}.",
             "Looking at it again, the question asks for the amount after the change, which is {x}.",
             "Hold on, I dropped a term. Redoing it: {x}.",
             "Rereading the problem, it should be {x}.")
TRAILERS = (" \U0001f389", "\n<|endoftext|>", "\n```", "\n\n| step | value |\n|---|---|\n| total | {g} |", " \U0001f60a",
            "\n\n---")


def cases_for(fmt: str, r: random.Random) -> list[dict]:
    out: list[dict] = []

    def add(cls: str, q: str, gold: Fraction, output: str, expected: str, in_format: bool) -> None:
        out.append({"format": fmt, "class": cls, "question": q, "answer": plain(gold), "output": output,
                    "expected": expected, "in_format": in_format})

    for _ in range(12):  # ordinary right and wrong answers over every problem and marker style
        q, steps, g, qty = r.choice(PROBLEMS)(r)
        st = r.randint(0, 3)
        d = r.choice((1, 2, 3, 5, 10, Fraction(1, 2)))
        add("right", q, g, f"{steps}\n{marker(fmt, plain(g), st)}", "desirable", True)
        add("wrong", q, g, f"{steps}\n{marker(fmt, plain(g + d), st)}", "undesirable", True)
    for k in range(3):
        q, steps, g, qty = r.choice(PROBLEMS)(r)
        d = r.choice((1, 2, 3, 5, 10)) * r.choice((1, -1))
        wrong = g + d if g + d > 0 else g + abs(d)
        gs, ws = plain(g), plain(wrong)
        st = r.randint(0, 3)
        add("right", q, g, f"{steps}\n{marker(fmt, gs, st)}", "desirable", True)
        add("wrong", q, g, f"{steps}\n{marker(fmt, ws, st)}", "undesirable", True)
        # a hedge inside the answer: two answers, one of them the reference
        hedge = r.choice(HEDGES).format(g=gs, h=ws)
        add("hedge", q, g, f"{steps}\n{marker(fmt, hedge, st)}", "unsure", True)
        # a revision after the answer with no second marker (no cue word of any list)
        rev = r.choice(REVISIONS).format(x=ws)
        add("correction_after", q, g, f"{steps}\n{marker(fmt, gs, st)}\n{rev}", "unsure", True)
        # two final answers that disagree: the last one is the reference
        add("two_markers", q, g, f"{marker(fmt, ws, st)}\n{r.choice(REVISIONS).format(x=gs)}\n{steps}\n{marker(fmt, gs, st)}",
            "unsure", True)
        # a correction inside the working, then one committed answer
        add("correction_before", q, g,
            f"At first I got {ws}. {r.choice(('Scratch that', 'That is not right', 'Recounting'))}: {steps}\n{marker(fmt, gs, st)}",
            "desirable", True)
        # a quantity of the question restated after the answer
        add("restated_after", q, g, f"{steps}\n{marker(fmt, gs, st)}\n(Recall that the question starts from {qty}.)",
            "desirable", True)
        # a restated quantity last, no answer in the format
        add("restated_no_format", q, g, f"{steps} So the answer is {gs}. The question started from {qty}.", "undesirable", False)
        # "not X"
        add("not_x", q, g, f"{steps}\n{marker(fmt, f'{gs}, not {ws}', st)}", "desirable", True)
        add("not_x", q, wrong, f"{steps}\n{marker(fmt, f'{gs}, not {ws}', st)}", "undesirable", True)
        add("not_x_no_format", q, wrong, f"{steps} So it is {gs}, not {ws}.", "undesirable", False)
        # "= X, but ... Y"
        y = r.randint(1, 9)
        but = f"{steps} Before giving any away there were {gs} + {y} = {plain(g + y)}, but {y} were given away, leaving {gs}."
        add("eq_but", q, g, f"{but}\n{marker(fmt, gs, st)}", "desirable", True)
        add("eq_but", q, g + y, f"{but}\n{marker(fmt, gs, st)}", "undesirable", True)
        add("eq_but_in_answer", q, g + y, f"{steps}\n{marker(fmt, f'{plain(g + y)} in all, but {y} were given away, leaving {gs}', st)}",
            "unsure", True)
        add("eq_but_no_format", q, g + y, f"{but}", "undesirable", False)
        # an answer in another format than the recipe's
        add("no_format", q, g, f"{steps}\n{marker(other_format(fmt), gs, st)}", "undesirable", False)
        add("no_format", q, g, f"{steps} The answer is {gs}.", "undesirable", False)
        # an unclosed answer (cut off)
        cut = {"hashes": f"{steps}\n####", "boxed": f"{steps}\n\\boxed{{{gs}", "json": f"{steps}\n{{\"answer\": ",
               "answer_tag": f"{steps}\n<answer>{gs}"}[fmt]
        add("truncated", q, g, cut, "undesirable", False)
        # complete outputs that end without final punctuation
        trail = r.choice(TRAILERS).format(g=gs)
        add("no_final_punct", q, g, f"{steps}\n{marker(fmt, gs, st)}{trail}", "desirable", True)
        add("no_final_punct", q, g, f"{steps}\n{marker(fmt, ws, st)}{trail}", "undesirable", True)
        # agreeing answers twice
        add("agree_twice", q, g, f"{marker(fmt, gs, st)}\n{steps}\n{marker(fmt, gs, st)}", "desirable", True)
        # an expression with no stated value
        if g.denominator == 1 and g > 3:
            a = r.randint(1, int(g) - 1)
            add("expression", q, g, f"{steps}\n{marker(fmt, f'{a} + {int(g) - a}', st)}", "unsure", True)

    # forms: number words, decimal comma, locale separators, scientific notation, fractions, units
    n = r.randint(21, 99)
    half = Fraction(2 * r.randint(1, 9) + 1, 2)
    q = "How many are there?"
    for v in (Fraction(n), half, Fraction(r.randint(2, 9) * 100 + r.randint(1, 99))):
        add("number_words", q, v, f"Counting them all gives the total.\n{marker(fmt, words_of(v))}", "desirable", True)
        add("number_words", q, v + 1, f"Counting them all gives the total.\n{marker(fmt, words_of(v))}", "undesirable", True)
    for a, b in ((r.randint(1, 99), r.choice((5, 25, 75))), (r.randint(100, 999), r.choice((5, 2, 8)))):
        v = Fraction(f"{a}.{b}")
        add("decimal_comma", q, v, f"The average is computed per day.\n{marker(fmt, f'{a},{b}')}", "desirable", True)
        add("decimal_comma", q, Fraction(f"{a}{b}"), f"The average is computed per day.\n{marker(fmt, f'{a},{b}')}",
            "undesirable", True)
    big = r.randint(1001, 99999)
    cents = r.choice((25, 5, 75))
    for text, v in ((grouped(big, ","), big), (grouped(big, "."), big), (grouped(big, " "), big),
                    (grouped(big, "\u202f"), big), (grouped(big, "'"), big), (grouped(big * 1000 + 7, ","), big * 1000 + 7),
                    (f"{grouped(big, '.')},{cents}", Fraction(f"{big}.{cents}")),
                    (f"{grouped(big, ',')}.{cents}", Fraction(f"{big}.{cents}"))):
        add("locale", q, Fraction(v), f"Adding the parts gives the total.\n{marker(fmt, text)}", "desirable", True)
        add("locale", q, Fraction(v) + 10, f"Adding the parts gives the total.\n{marker(fmt, text)}", "undesirable", True)
    m, e = r.choice(("1.2", "3.5", "4.25", "6")), r.randint(3, 6)
    v = Fraction(m) * 10 ** e
    for text in (f"{m}e{e}", f"{m}E+0{e}", f"{m} \u00d7 10^{e}", f"{m} x 10^{e}", f"{m}\\times 10^{{{e}}}", f"{m} \\cdot 10^{e}"):
        add("scientific", q, v, f"The count grows by a factor of ten each step.\n{marker(fmt, text)}", "desirable", True)
        add("scientific", q, v * 10, f"The count grows by a factor of ten each step.\n{marker(fmt, text)}", "undesirable", True)
    small = Fraction(m) / 10 ** e
    add("scientific", q, small, f"Each part is tiny.\n{marker(fmt, f'{m}e-{e}')}", "desirable", True)
    w = r.randint(1, 9)
    frac = Fraction(2 * w + 1, 2)
    for text in (f"{2 * w + 1}/2", f"{w} 1/2", f"\\frac{{{2 * w + 1}}}{{2}}", f"{w}\\frac{{1}}{{2}}", f"\\dfrac{{{2 * w + 1}}}{{2}}"):
        add("fraction", q, frac, f"Half of {2 * w + 1} is the answer.\n{marker(fmt, text)}", "desirable", True)
        add("fraction", q, frac + 1, f"Half of {2 * w + 1} is the answer.\n{marker(fmt, text)}", "undesirable", True)
    u = r.randint(11, 95)
    for text in (f"${u}", f"\\${u}", f"{u}%", f"{u}\\%", f"{u} km/h", f"{u} \\text{{ cm}}^2", f"{u} apples", f"\u20ac{u}",
                 f"{u}\u00b0C", f"\\text{{{u} dollars}}", f"{u}.00"):
        add("units", q, Fraction(u), f"Working it through step by step.\n{marker(fmt, text)}", "desirable", True)
        add("units", q, Fraction(u + 1), f"Working it through step by step.\n{marker(fmt, text)}", "undesirable", True)
    neg = -r.randint(2, 40)
    for text in (f"{neg}", f"\u2212{-neg}"):
        add("negative", q, Fraction(neg), f"The temperature fell below zero.\n{marker(fmt, text)}", "desirable", True)
        add("negative", q, Fraction(-neg), f"The temperature fell below zero.\n{marker(fmt, text)}", "undesirable", True)
    return out


# ------------------------------------------------------------------ written one by one
# (format, class, question, answer, output, expected)
HAND = [
    ("hashes", "correction_after", "How many people are in the room?", "12",
     "There are 11 students and a teacher... well, 12 students.\n#### 12\nActually no wait, I meant 11 students plus the teacher: 12. Hmm, or 13 with the assistant.", "unsure"),
    ("hashes", "hedge", "How many people went on the trip?", "12", "12 children went.\n#### 12 (13 if you count the teacher)", "unsure"),
    ("hashes", "hedge", "How many eggs are left?", "12", "Somewhere around a dozen remain.\n#### 12\u201313", "unsure"),
    ("boxed", "hedge", "How tall is the tree in metres?", "12", "Estimating from the shadow: $\\boxed{12 \\pm 1}$", "unsure"),
    ("boxed", "hedge", "What is x?", "4", "Both roots work, so $x = \\boxed{4}$ or $x = \\boxed{-4}$.", "unsure"),
    ("answer_tag", "hedge", "How many marbles?", "30", "<answer>30 or 31</answer>", "unsure"),
    ("json", "hedge", "How many marbles?", "30", "{\"answer\": [30, 31]}", "unsure"),
    ("json", "hedge", "How many marbles?", "30", "{\"answer\": \"30 to 31\"}", "unsure"),
    ("hashes", "correction_after", "How many clips did she sell?", "72",
     "She sold 48 + 24 = 72 clips.\n#### 72\n\nOn second thought, May was a third, not a half: 48 + 16 = 64.", "unsure"),
    ("boxed", "correction_after", "How much did she earn?", "10",
     "She earned $\\boxed{10}$.\n\nScratch that. The rate is per minute, so 0.2 * 60 = 12 dollars.", "unsure"),
    ("answer_tag", "two_markers", "How much did she earn?", "12",
     "<answer>10</answer>\nI misread the rate; per hour it is 12 dollars.\n<answer>12</answer>", "unsure"),
    ("json", "two_markers", "What is the total?", "64", "{\"answer\": 72}\nLet me redo the May count: 48/3 = 16.\n{\"answer\": 64}", "unsure"),
    ("hashes", "restated_no_format", "How many clips?", "72",
     "In May she sold 24 clips, for a total of 72 clips. She started with 48 clips in April.", "undesirable"),
    ("boxed", "restated_after", "How many clips?", "72",
     "Total: $\\boxed{72}$ clips (48 in April and 24 in May).", "desirable"),
    ("hashes", "not_x", "How many apples are left?", "70", "She gave 2 away from 72.\n#### 70 (not 72)", "desirable"),
    ("hashes", "not_x_no_format", "How many apples are left?", "72", "The answer is 70, not 72.", "undesirable"),
    ("boxed", "not_x", "How many apples are left?", "72", "The count is $\\boxed{70}$, not 72.", "undesirable"),
    ("hashes", "eq_but_in_answer", "How many clips?", "72", "#### = 72 clips, but she gave 2 away, leaving 70", "unsure"),
    ("hashes", "eq_but", "How many clips are left?", "70", "48 + 24 = 72 clips, but she gave 2 away, leaving 70.\n#### 70", "desirable"),
    ("boxed", "number_words", "How many cakes?", "2.5", "Each of them gets $\\boxed{\\text{two and a half}}$ cakes.", "desirable"),
    ("answer_tag", "number_words", "How many cakes?", "2", "<answer>two and a half</answer>", "undesirable"),
    ("json", "number_words", "How many dogs?", "72", "{\"answer\": \"seventy-two\"}", "desirable"),
    ("hashes", "decimal_comma", "What is the average?", "12.5", "Der Durchschnitt ist 25 / 2.\n#### 12,5", "desirable"),
    ("hashes", "decimal_comma", "What is the average?", "125", "Der Durchschnitt ist 25 / 2.\n#### 12,5", "undesirable"),
    ("boxed", "decimal_comma", "Quel est le prix ?", "3.75", "Le prix est $\\boxed{3{,}75}$ euros.", "desirable"),
    ("json", "json_field", "How many?", "72", "{\"reasoning\": \"48 + 24 = 72\", \"answer\": 72}", "desirable"),
    ("json", "json_field", "How many?", "72", "{\"reasoning\": \"48 + 24 = 72\", \"answer\": \"72 clips\"}", "desirable"),
    ("json", "json_field", "How many?", "72", "{\"reasoning\": \"48 + 24 = 72, but she kept 2\", \"answer\": 70}", "undesirable"),
    ("json", "json_field", "How many?", "72", "{\"answer\": null, \"reasoning\": \"I could not tell.\"}", "undesirable"),
    ("json", "json_field", "How many?", "72", "Here is the result:\n```json\n{\n  \"steps\": [\"48 / 2 = 24\", \"48 + 24 = 72\"],\n  \"answer\": 72\n}\n```", "desirable"),
    ("json", "json_field", "How many?", "72", "{\"answer\": 72, \"check\": {\"answer\": 70}}", "unsure"),
    ("hashes", "no_final_punct", "How many?", "72", "48 + 24 = 72\n#### 72 \U0001f680", "desirable"),
    ("boxed", "no_final_punct", "How many?", "72", "48 + 24 = 72, so\n$$\\boxed{72}$$\n<|endoftext|>", "desirable"),
    ("answer_tag", "no_final_punct", "How many?", "72", "| month | clips |\n|---|---|\n| April | 48 |\n| May | 24 |\n<answer>72</answer>\n| total | 72 |", "desirable"),
    ("json", "no_final_punct", "How many?", "72", "```json\n{\"answer\": 72}\n```", "desirable"),
    ("hashes", "locale", "How many residents?", "1234.5", "Average per district.\n#### 1.234,5", "desirable"),
    ("boxed", "locale", "How many residents?", "1234", "Adding up: $\\boxed{1\\,234}$", "desirable"),
    ("answer_tag", "locale", "How many residents?", "1234", "<answer>1 234</answer>", "desirable"),
    ("answer_tag", "locale", "How many residents?", "1.234", "<answer>1 234</answer>", "undesirable"),
    ("hashes", "scientific", "How many cells?", "1200", "#### 1.2 \u00d7 10\u00b3", "desirable"),
    ("boxed", "scientific", "How many cells?", "120", "$\\boxed{1.2 \\times 10^{3}}$", "undesirable"),
    ("json", "scientific", "How far, in km?", "0.00035", "{\"answer\": 3.5e-4}", "desirable"),
    ("hashes", "truncated", "How many?", "72", "48 + 24 = 72 clips, so the total is", "undesirable"),
    ("boxed", "truncated", "How many?", "72", "So the total is \\boxed{72" + "\\boxed{" * 40, "undesirable"),
    ("answer_tag", "no_format", "How many?", "72", "The answer is 72.", "undesirable"),
    ("hashes", "no_format", "How many?", "72", "The answer is $\\boxed{72}$.", "undesirable"),
    ("boxed", "units", "What is the area?", "48", "The area is $\\boxed{48\\text{ cm}^2}$.", "desirable"),
    ("hashes", "units", "How much money?", "1200", "#### $1,200.00", "desirable"),
    ("answer_tag", "units", "What share?", "25", "<answer>25 %</answer>", "desirable"),
    ("boxed", "units", "What is the speed?", "60", "$\\boxed{60 \\mathrm{km/h}}$", "desirable"),
    ("hashes", "wrong", "What is 1/3 as a decimal to 2 places?", "0.333333", "#### 0.33", "undesirable"),
    ("boxed", "fraction", "What fraction?", "0.75", "$\\boxed{\\frac{6}{8}}$", "desirable"),
    ("hashes", "expression", "How many?", "72", "#### 24 + 48", "unsure"),
    ("hashes", "right", "How many?", "72", "#### 72", "desirable"),
    ("boxed", "right", "How many?", "72", "So we get $x = \\boxed{72}$.", "desirable"),
    ("answer_tag", "right", "How many?", "72", "Let me think.\n<answer>\n72\n</answer>", "desirable"),
    ("answer_tag", "wrong", "How many?", "72", "<answer>\n27\n</answer>", "undesirable"),
    ("json", "wrong", "How many?", "72", "{\"answer\": \"27\"}", "undesirable"),
    ("boxed", "negative", "What is the change?", "-5", "The change is $\\boxed{-5}$.", "desirable"),
    ("boxed", "negative", "What is the change?", "5", "The change is $\\boxed{-5}$.", "undesirable"),
    ("hashes", "agree_twice", "How many?", "72", "#### 72\nChecking: 48 + 24 = 72.\n#### 72", "desirable"),
    ("hashes", "restated_after", "How many clips did she sell in all?", "72", "In April 48, in May 24.\n#### 72\nThat is 48 in April and 24 in May.", "desirable"),
]


def build() -> list[dict]:
    r = random.Random(SEED)
    rows: list[dict] = []
    for fmt in FORMATS:
        for c in cases_for(fmt, r):
            rows.append({"source": "template", **c})
    for fmt, cls, q, ans, output, expected in HAND:
        in_format = cls not in ("truncated", "no_format", "restated_no_format", "not_x_no_format", "eq_but_no_format")
        rows.append({"source": "hand", "format": fmt, "class": cls, "question": q, "answer": ans, "output": output,
                     "expected": expected, "in_format": in_format})
    seen: set = set()
    out = []
    for row in rows:
        key = (row["format"], row["answer"], row["output"])
        if key in seen:
            continue
        seen.add(key)
        out.append({"id": f"c{len(out):04d}", "split": split_of(*key), **row})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 when the file differs from what this script writes")
    args = ap.parse_args()
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in build())
    if args.check:
        sys.exit(0 if OUT.is_file() and OUT.read_text(encoding="utf-8") == text else 1)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(text, encoding="utf-8")
    rows = [json.loads(x) for x in text.splitlines()]
    held = sum(r["split"] == "heldout" for r in rows)
    print(f"{len(rows)} cases, {held} held out, {len(rows) - held} dev -> {OUT}", file=sys.stderr)


if __name__ == "__main__":
    main()
