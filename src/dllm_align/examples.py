"""Training examples and their batches, shared by ``precompute-ref`` and ``train``.

The recipe's rows tokenised, the collate function that turns a list of examples into
a padded batch, and the units of a global batch (single rows, or VRPO's pairs).
"""

from __future__ import annotations

import functools
import hashlib
from typing import Callable, Sequence

from dllm_align.errors import UserError

def load_training_examples(recipe, tokenizer, *, quiet: bool = False) -> list:
    """The recipe's training rows, tokenised (``data.train``, ratios, limit, truncation)."""
    from dllm_align.data import rows_from_section
    from dllm_align.tokenize import tokenize_rows

    rows = rows_from_section(recipe.data, "train", quiet=quiet)
    return tokenize_rows(rows, tokenizer, recipe.data, quiet=quiet)


def make_collate(recipe, tokenizer) -> Callable[[list], dict]:
    from dllm_align.batching import collate
    from dllm_align.tokenize import pad_token_id

    return functools.partial(
        collate, padding=recipe.data.padding, max_length=recipe.data.max_length, pad_id=pad_token_id(tokenizer)
    )


def make_units(examples: Sequence, objective: str, sft_rows: str = "all") -> list[tuple]:
    """The units of the global batch: single examples, or (chosen, rejected) pairs for VRPO."""
    if objective == "elbo_kto":
        missing = [ex.id for ex in examples if ex.label is None]
        if missing:
            raise UserError(f"objective elbo_kto needs a label on every row; row '{missing[0]}' has none")
        return [(ex,) for ex in examples]
    if objective == "sft":
        keep = [ex for ex in examples if sft_rows == "all" or ex.label]
        if not keep:
            raise UserError("objective sft with train.sft_rows 'desirable': there are no desirable rows")
        return [(ex,) for ex in keep]
    if objective != "vrpo":
        raise ValueError(objective)
    by_pair: dict[str, list] = {}
    for ex in examples:
        if ex.pair_id is None:
            raise UserError(
                f"objective vrpo needs paired data; row '{ex.id}' has no pair id",
                hint="use a paired source (prompt, chosen, rejected) with data.format: paired",
            )
        by_pair.setdefault(ex.pair_id, []).append(ex)
    units, broken = [], []
    for pid, rows in by_pair.items():
        chosen = [r for r in rows if r.label]
        rejected = [r for r in rows if r.label is False]
        if len(chosen) == 1 and len(rejected) == 1 and len(rows) == 2:
            units.append((chosen[0], rejected[0]))
        else:
            broken.append(pid)
    if broken:
        from dllm_align.console import warn

        warn(f"vrpo: {len(broken)} pair id(s) without exactly one chosen and one rejected row are skipped (e.g. '{broken[0]}')")
    if not units:
        raise UserError("objective vrpo: no complete (chosen, rejected) pairs in the training data")
    return units


def units_digest(units: Sequence[tuple]) -> str:
    h = hashlib.sha256()
    for u in units:
        h.update("\x1f".join(ex.id for ex in u).encode("utf-8"))
        h.update(b"\n")
    return h.hexdigest()
