"""The demo's toy preference task: sort a short string of digits.

A prompt asks to sort digits; the *desirable* completion is the ascending
sort, the *undesirable* one the descending sort (a plausible, fluent, wrong
answer that shares every token with the right one - the hard case for
likelihood-based alignment, docs/design.md#class-weights). Quality is computable, so a
rule judge compares two completions exactly.

Everything is a pure function of a seed, so the demo is reproducible on any
machine with no network.
"""

from __future__ import annotations

import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

PROMPT_PREFIX = "sort: "


@dataclass(frozen=True)
class ToySpec:
    n_digits: int = 5
    n_train: int = 2000
    n_test: int = 200
    seed: int = 0


def _digits(rng: random.Random, n: int) -> str:
    return "".join(rng.choice("0123456789") for _ in range(n))


def make_prompts(n: int, n_digits: int, seed: int, exclude: Iterable[str] = ()) -> list[str]:
    """n distinct digit strings (deterministic by seed), none in ``exclude``."""
    rng = random.Random(seed)
    seen = set(exclude)
    out = []
    while len(out) < n:
        d = _digits(rng, n_digits)
        if d not in seen:
            seen.add(d)
            out.append(d)
    return out


def desirable(digits: str) -> str:
    return "".join(sorted(digits))


def undesirable(digits: str) -> str:
    return "".join(sorted(digits, reverse=True))


def prompt_text(digits: str) -> str:
    return PROMPT_PREFIX + digits


def digits_of(prompt: str | list) -> str:
    """The digit string a toy prompt asks about (prompt as text or chat messages)."""
    if isinstance(prompt, list):
        prompt = next(m["content"] for m in prompt if m.get("role") == "user")
    text = prompt.strip()
    if text.startswith(PROMPT_PREFIX.strip()):
        text = text[len(PROMPT_PREFIX.strip()):]
    return text.strip()


def score(prompt: str | list, completion: str) -> int:
    """Positions where the completion agrees with the ascending sort (0..n_digits).

    Graded rather than all-or-nothing, so that a nearly-right answer beats a
    wrong one; a completion of the wrong length is compared position by
    position over the right answer's length.
    """
    want = desirable(digits_of(prompt))
    got = completion.strip()
    return sum(1 for i, ch in enumerate(want) if i < len(got) and got[i] == ch)


def rule_verdict(prompt, completion_a: str, completion_b: str) -> str:
    """'A', 'B' or 'C' (tie) by :func:`score`."""
    sa, sb = score(prompt, completion_a), score(prompt, completion_b)
    return "A" if sa > sb else "B" if sb > sa else "C"


def splits(spec: ToySpec = ToySpec()) -> dict[str, list[str]]:
    test = make_prompts(spec.n_test, spec.n_digits, spec.seed + 1)
    train = make_prompts(spec.n_train, spec.n_digits, spec.seed, exclude=test)
    return {"train": train, "test": test}


def paired_rows(prompts: list[str], split: str) -> list[dict]:
    return [
        {
            "id": f"sort-{split}-{i:05d}",
            "prompt": [{"role": "user", "content": prompt_text(d)}],
            "chosen": desirable(d),
            "rejected": undesirable(d),
        }
        for i, d in enumerate(prompts)
    ]


def unpaired_rows(prompts: list[str], split: str, seed: int = 0, both: bool = True) -> list[dict]:
    """KTO rows. ``both``: each prompt gives a desirable and an undesirable row (like kto-mix);
    otherwise each prompt gets one of the two at random (truly unpaired)."""
    rng = random.Random(seed)
    rows = []
    for i, d in enumerate(prompts):
        msgs = [{"role": "user", "content": prompt_text(d)}]
        labels = [True, False] if both else [rng.random() < 0.5]
        for lab in labels:
            rows.append(
                {
                    "id": f"sort-{split}-{i:05d}-{'d' if lab else 'u'}",
                    "prompt": msgs,
                    "completion": desirable(d) if lab else undesirable(d),
                    "label": lab,
                }
            )
    return rows


BASES = ("toy_sort_base", "toy_sort_base_dream", "toy_sort_base_sdar", "toy_sort_base_gemma", "toy_sort_base_llada21")
ASSET_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def install_base(folder: str, name: str = "toy_sort_base") -> str:
    """Copy a trained base model (the ``toy_sort_base``, ``toy_sort_base_dream``, ``toy_sort_base_sdar``,
    ``toy_sort_base_gemma`` or ``toy_sort_base_llada21`` recipe's final/ folder) into the package as
    ``builtin:toy-sort-base`` (or ``-dream``, ``-sdar``, ``-gemma``, ``-llada21``)."""
    if name not in BASES:
        raise SystemExit(f"unknown packaged base {name!r} ({', '.join(BASES)})")
    src = Path(folder)
    dst = Path(__file__).resolve().parents[1] / "assets" / name
    dst.mkdir(parents=True, exist_ok=True)
    for f in ASSET_FILES:
        if (src / f).exists():
            shutil.copy2(src / f, dst / f)
    return str(dst)


if __name__ == "__main__":
    import sys

    args = sys.argv[1:]
    if len(args) in (2, 4) and args[0] == "install-base" and (len(args) == 2 or args[2] == "--name"):
        print(install_base(args[1], *(args[3:4])))
    else:
        sys.stderr.write("usage: python -m dllm_align.data.toy install-base RUN/final [--name toy_sort_base_dream]\n")
        sys.exit(2)
