"""Training examples and their batches, shared by ``precompute-ref`` and ``train``.

The recipe's rows tokenised, the collate function that turns a list of examples into
a padded batch, the step count, and the mismatched pairs of ``train.baseline: kl``.

KTO's reference point z0 (``train.baseline: kl``)
    KTO estimates z0 = KL(policy || reference) from mismatched pairs: each
    prompt of the step batch with another row's completion, as TRL's
    KTOTrainer does (row i's prompt with row i-1's completion, cyclically).
    Here the pairs are cut from the *global* batch of the optimiser step, not
    from one device's rows, so they exist with 8 processes x 1 row. The pairs
    are a pure function of the batch plan (seed, epoch, global batch size,
    grouping), so ``precompute-ref`` knows them in advance and caches their
    reference ELBOs with the rest.
"""

from __future__ import annotations

import functools
import hashlib
import math
from typing import Callable, Optional, Sequence

from dllm_align.core.console import info
from dllm_align.core.errors import UserError
from dllm_align.data.batching import collate, plan_batches
from dllm_align.data.load import rows_from_section
from dllm_align.data.tokenize import Example, block_layout, canvas_layout, pad_token_id, tokenize_rows


def block_scoring(data, block_size: Optional[int], canvas_length: Optional[int] = None) -> Optional[str]:
    """What ``data.block_scoring`` does for a model of ``block_size`` (block diffusion) or ``canvas_length``
    (DiffusionGemma's canvases); None for a whole-sequence model, where it does nothing: ``"published"`` or
    ``"completion_only"``. Recorded in the reference-cache fingerprint."""
    if not block_size and not canvas_length:
        return None
    return getattr(data, "block_scoring", "published")


def block_layout_for(data, tokenizer, block_size: Optional[int], canvas_length: Optional[int] = None):
    """The :class:`dllm_align.data.tokenize.BlockLayout` the tokenisers take for ``data.block_scoring`` and a model of
    ``block_size`` or ``canvas_length``, or None (whole-sequence models, ``completion_only``)."""
    if block_scoring(data, block_size, canvas_length) != "published":
        return None
    if canvas_length:
        return canvas_layout(tokenizer, int(canvas_length))
    return block_layout(tokenizer, int(block_size))


def load_training_examples(recipe, tokenizer, *, quiet: bool = False, block_size: Optional[int] = None,
                           canvas_length: Optional[int] = None) -> list:
    """The recipe's training rows, tokenised (``data.train``, ratios, limit, truncation). ``block_size``: the
    model's block size (block-diffusion families), ``canvas_length`` its canvas (DiffusionGemma), for the layout
    ``data.block_scoring`` names."""
    rows = rows_from_section(recipe.data, "train", quiet=quiet)
    return tokenize_rows(rows, tokenizer, recipe.data, quiet=quiet,
                         block=block_layout_for(recipe.data, tokenizer, block_size, canvas_length))


def make_collate(recipe, tokenizer) -> Callable[[list], dict]:
    return functools.partial(
        collate, padding=recipe.data.padding, max_length=recipe.data.max_length, pad_id=pad_token_id(tokenizer)
    )


def units_digest(units: Sequence[tuple]) -> str:
    h = hashlib.sha256()
    for u in units:
        h.update("\x1f".join(ex.id for ex in u).encode("utf-8"))
        h.update(b"\n")
    return h.hexdigest()


def step_count(t, n_units: int, G: int) -> tuple[int, int]:
    """(steps per epoch, total optimiser steps) for ``n_units`` units in global batches of ``G`` (``train`` section t)."""
    per_epoch = n_units // G
    if t.max_steps:
        return per_epoch, t.max_steps
    exact = t.epochs * per_epoch
    if 0 < exact < 0.5:
        # Less than half a step's worth of epochs would otherwise round up to a whole step without a word.
        raise UserError(
            f"train.epochs {t.epochs:g} is {exact:.3g} optimiser steps of {per_epoch} per epoch "
            f"({n_units} units in global batches of {G}): less than half a step",
            hint="use train.epochs of at least one step's worth, or train.max_steps",
        )
    steps = max(1, math.ceil(exact))
    if steps != exact:
        info(f"train.epochs {t.epochs:g} = {exact:.3g} optimiser steps; rounded up to {steps}")
    return per_epoch, steps


def kl_pair_id(prompt_from: str, completion_from: str) -> str:
    return f"kl({prompt_from},{completion_from})"


def kl_examples(batch: Sequence, max_length: int) -> list:
    """The mismatched pairs of one global batch (module docstring): row i's prompt, row i-1's completion.

    A borrowed completion that does not fit after the prompt loses its tail
    (``truncation: completion``). Pairs are in the batch's row order, so pair
    i belongs with row i on whichever process holds it.
    """
    n = len(batch)
    if n < 2:
        raise UserError("train.baseline kl needs at least 2 rows per global batch (it pairs each prompt with another row's completion)")
    out = []
    for i, a in enumerate(batch):
        b = batch[i - 1]
        room = max_length - len(a.prompt_ids)
        out.append(Example(kl_pair_id(a.id, b.id), a.prompt_ids, b.completion_ids[:room], None))
    return out


def planned_batches(recipe, lengths: Sequence[int], G: int, total: int) -> list[list[int]]:
    """The global batches of every step of the run, in order (the plan of each epoch it reaches)."""
    out: list[list[int]] = []
    epoch = 0
    while len(out) < total:
        plan = plan_batches(lengths, G, recipe.train.seed, epoch, recipe.data.group_by_length, drop_last=True)
        out.extend(plan[: total - len(out)])
        epoch += 1
    return out
