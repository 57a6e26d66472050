"""Batches: padding (docs/design.md#tokens-padding-and-packing) and a process-count-free batch plan
(docs/design.md#the-step-batch).

Padding (``data.padding``)
    ``paper``: every row is right-padded with the pad id (EOS) to ``max_length``,
    as the paper's code does. The pads are visible context (attention 1) but never
    masked or scored. Because attention is bidirectional the EOS tail changes the
    ELBO, so the reference and the policy must use the same choice.
    ``none``: rows are padded only to the longest row of the batch, and the pads
    are hidden (attention 0), so a row scores exactly as it would alone.
    ``packed``: collated as ``none``; the ELBO code then packs the noisy copies
    of the rows into as few ``max_length`` rows as fit, with block-diagonal
    attention (:func:`dllm_align.objective.elbo.elbo_draws`), so uniform batches cost no
    padding either.

The batch plan
    Training draws *global* batches: the rows of one optimiser step across all
    processes and gradient-accumulation micro-batches
    (``global = per_device * world * grad_accum``). ELBO-KTO's baseline is a mean
    over that global batch (docs/design.md#baselines), so the global batches must not
    depend on how many processes share the work. :func:`plan_batches` builds the
    list of global batches from (seed, epoch) alone; :func:`shard` then hands
    each process its micro-batches of each global batch. 1 x 8, 2 x 4 and 4 x 2
    processes see the same global batches.

    By default the rows are shuffled and cut into global batches in order: the
    uniform mini-batches the paper's analysis assumes (its section 3.2; the
    baseline is a statistic of the batch). With ``group_by_length`` (an opt-in
    departure) the rows are shuffled, cut into "megabatches" of
    ``megabatch_factor`` global batches, sorted by length inside each megabatch,
    and cut into global batches whose order is then shuffled. Rows of similar
    length meet in a batch (little padding with ``padding: none``) while batches
    still mix across the whole data set from epoch to epoch. Inside a global batch
    rows are sorted longest first, so each micro-batch is of similar lengths too.
    The global batch holding the longest row goes first: an out-of-memory shows
    at step 1, not hours in.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch

PADDINGS = ("paper", "none", "packed")


def collate(examples: Sequence, padding: str, max_length: int, pad_id: int) -> dict:
    """Stack :class:`dllm_align.data.tokenize.Example` s into a batch (CONTRIBUTING.md, shared data structures).

    Each row is ``prompt_ids + completion_ids``, right-padded with ``pad_id``:
    to ``max_length`` with visible pads (``paper``) or to the batch's longest row
    with hidden pads (``none``). ``completion_mask`` is true on completion tokens
    only. ``labels`` is a bool tensor, or None when the examples carry no label (SFT).
    """
    if padding not in PADDINGS:
        raise ValueError(f"padding must be one of {PADDINGS}, got {padding!r}")
    if not examples:
        raise ValueError("collate needs at least one example")
    lengths = [len(e.prompt_ids) + len(e.completion_ids) for e in examples]
    if max(lengths) > max_length:
        worst = examples[int(np.argmax(lengths))]
        raise ValueError(f"example {worst.id} has {max(lengths)} tokens, more than max_length {max_length}")
    T = max_length if padding == "paper" else max(lengths)  # "packed" collates like "none"; elbo_draws packs
    B = len(examples)
    input_ids = torch.full((B, T), pad_id, dtype=torch.long)
    attention = torch.ones((B, T), dtype=torch.long) if padding == "paper" else torch.zeros((B, T), dtype=torch.long)
    completion_mask = torch.zeros((B, T), dtype=torch.bool)
    for i, e in enumerate(examples):
        p, c = len(e.prompt_ids), len(e.completion_ids)
        input_ids[i, :p] = torch.tensor(e.prompt_ids, dtype=torch.long)
        input_ids[i, p : p + c] = torch.tensor(e.completion_ids, dtype=torch.long)
        attention[i, : p + c] = 1
        completion_mask[i, p : p + c] = True
    labels = [e.label for e in examples]
    return {
        "input_ids": input_ids,
        "attention_mask": attention,
        "completion_mask": completion_mask,
        "completion_len": torch.tensor([len(e.completion_ids) for e in examples], dtype=torch.long),
        "prompt_len": torch.tensor([len(e.prompt_ids) for e in examples], dtype=torch.long),
        "ids": [e.id for e in examples],
        "labels": None if any(x is None for x in labels) else torch.tensor(labels, dtype=torch.bool),
        "pair_ids": [e.pair_id for e in examples],
    }


def pack_length_of(data) -> Optional[int]:
    """The length of the rows a forward packs its noisy sequences into (``data.padding: packed``; the ``data``
    section), or None: ``packed`` collates like ``none`` and the ELBO estimator does the packing."""
    return data.max_length if data.padding == "packed" else None


def _rng(seed: int, epoch: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([seed % (1 << 63), epoch]))


def plan_batches(
    lengths: Sequence[int],
    global_batch_size: int,
    seed: int,
    epoch: int = 0,
    group_by_length: bool = False,
    *,
    drop_last: bool = False,
    megabatch_factor: int = 50,
    longest_first: bool = True,
) -> list[list[int]]:
    """The epoch's global batches as lists of example indices (module docstring).

    A pure function of its arguments: no process count, no global RNG. All
    batches have ``global_batch_size`` rows except possibly the last one (kept
    last unless ``drop_last``).
    """
    if global_batch_size < 1:
        raise ValueError("global_batch_size must be >= 1")
    n = len(lengths)
    G = global_batch_size
    rng = _rng(seed, epoch)
    order = rng.permutation(n).tolist()
    chunks: list[list[int]] = []
    if group_by_length:
        mega = G * max(1, megabatch_factor)  # a multiple of G: only the final megabatch can leave a short batch
        for s in range(0, n, mega):
            m = sorted(order[s : s + mega], key=lambda i: (-lengths[i], i))
            chunks.extend(m[j : j + G] for j in range(0, len(m), G))
    else:
        chunks = [order[j : j + G] for j in range(0, n, G)]
    full = [c for c in chunks if len(c) == G]
    short = [c for c in chunks if len(c) < G]
    batches = [full[i] for i in rng.permutation(len(full)).tolist()]
    if longest_first and batches:
        k = max(range(len(batches)), key=lambda b: (max(lengths[i] for i in batches[b]), -b))
        batches.insert(0, batches.pop(k))
    if short and not drop_last:
        batches.append(short[0])
    return batches


def shard(batch: Sequence[int], rank: int, world: int, micro_batch_size: int) -> list[list[int]]:
    """This process's micro-batches of one global batch.

    The global batch is cut, in order, into micro-batches of ``micro_batch_size``
    (sorted batches give micro-batches of similar lengths); micro-batch k goes to
    process ``k % world``. A full batch of ``micro * world * accum`` rows gives every
    process ``accum`` micro-batches; a short last batch may give some fewer.
    """
    if not (0 <= rank < world):
        raise ValueError(f"rank {rank} is not in [0, {world})")
    if micro_batch_size < 1:
        raise ValueError("micro_batch_size must be >= 1")
    micro = [list(batch[j : j + micro_batch_size]) for j in range(0, len(batch), micro_batch_size)]
    return [m for k, m in enumerate(micro) if k % world == rank]


def micro_batches(batches: Sequence[Sequence[int]], micro_batch_size: int) -> list[list[int]]:
    """Every micro-batch of a plan, as one process would see them with world size 1."""
    out = []
    for b in batches:
        out.extend(shard(b, 0, 1, micro_batch_size))
    return out


def tokens_fed(lengths: Sequence[int], micro: Sequence[Sequence[int]], padding: str, max_length: int, k: int = 1) -> int:
    """Token positions the model processes for these micro-batches under a padding choice, with ``k`` noisy copies per row.

    ``packed``: each micro-batch's ``k`` copies of its rows packed into rows of
    ``max_length`` (:func:`pack_sequences`), each packed call as
    wide as its fullest row.
    """
    if padding == "paper":
        return k * sum(len(m) for m in micro) * max_length
    if padding == "none":
        return k * sum(len(m) * max(lengths[i] for i in m) for m in micro if m)
    if padding == "packed":

        total = 0
        for m in micro:
            if not m:
                continue
            seqs = [lengths[i] for i in m for _ in range(k)]
            bins = pack_sequences(seqs, max_length)
            total += len(bins) * max(sum(seqs[j] for j in b) for b in bins)
        return total
    raise ValueError(f"padding must be one of {PADDINGS}, got {padding!r}")


def padding_costs(
    lengths: Sequence[int],
    max_length: int,
    micro_batch_size: int,
    global_batch_size: Optional[int] = None,
    seed: int = 0,
    n_mc: int = 8,
) -> dict[str, int]:
    """Tokens fed per epoch under each padding choice, for ``data stats``.

    ``real``: the sum of row lengths (no padding at all); ``paper``: rows x
    max_length; ``none_grouped`` / ``none_random``: padding to each
    micro-batch's longest row, with and without length grouping;
    ``packed_random``: uniform batches, packed; the ``n_mc`` noisy copies of a
    micro-batch's rows share the packed rows (as in training), and the count
    is per copy, comparable with the others.
    """
    G = global_batch_size or micro_batch_size
    out = {"real": int(sum(lengths)), "paper": len(lengths) * max_length}
    for name, grouped in (("none_grouped", True), ("none_random", False)):
        plan = plan_batches(lengths, G, seed, 0, grouped)
        out[name] = tokens_fed(lengths, micro_batches(plan, micro_batch_size), "none", max_length)
    plan = plan_batches(lengths, G, seed, 0, False)
    out["packed_random"] = round(tokens_fed(lengths, micro_batches(plan, micro_batch_size), "packed", max_length, k=n_mc) / n_mc)
    return out


# --------------------------------------------------------------------------- packing
def _first_fit(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        L = int(lengths[i])
        for b, r in enumerate(room):
            if L <= r:
                bins[b].append(i)
                room[b] -= L
                break
        else:
            bins.append([i])
            room.append(capacity - L)
    return bins


def pack_sequences(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Bins of sequence indices whose lengths sum to at most ``capacity``: as few bins as first fit
    (longest first) finds, then as even as possible.

    A packed call is as wide as its fullest row, so after first fit fixes the
    number of rows R, the capacity is lowered towards total / R while R rows
    still suffice: the rows come out nearly equally full and the call wastes
    little on its tail. Deterministic (ties keep index order). A sequence longer
    than ``capacity`` gets a bin of its own.
    """
    bins = _first_fit(lengths, capacity)
    R = len(bins)
    if R <= 1:
        return bins
    longest = max(int(x) for x in lengths)
    lo = max(longest, -(-sum(int(x) for x in lengths) // R))
    if lo >= capacity:
        return bins
    step = max(1, (capacity - lo) // 16)
    for c in range(lo, capacity, step):
        even = _first_fit(lengths, c)
        if len(even) <= R:
            return even
    return bins


@dataclass
class PackedRows:
    """Noisy sequences packed into rows (block-diagonal attention, positions restarting per sequence)."""

    input_ids: torch.Tensor  # [R, C]
    layout: torch.Tensor  # [R, C] sequence index within the row; -1 on the unused tail
    row_of: torch.Tensor  # [S] packed row of each sequence
    offset: torch.Tensor  # [S] its first column there


def pack_rows(input_ids: torch.Tensor, lengths: Sequence[int], capacity: int) -> PackedRows:
    """Pack the first ``lengths[s]`` tokens of each row ``s`` of ``input_ids`` into as few rows of ``capacity`` as fit.

    The packed width is the fullest row's fill (at most ``capacity``). Tail
    positions hold token 0 and layout -1: they form their own block, which no
    real token sees.
    """
    bins = pack_sequences(lengths, capacity)
    S = len(lengths)
    width = max(sum(int(lengths[i]) for i in b) for b in bins) if bins else 0
    ids = torch.zeros(len(bins), width, dtype=input_ids.dtype)
    layout = torch.full((len(bins), width), -1, dtype=torch.long)
    row_of = torch.empty(S, dtype=torch.long)
    offset = torch.empty(S, dtype=torch.long)
    src = input_ids.cpu()
    for r, b in enumerate(bins):
        o = 0
        for j, s in enumerate(b):
            L = int(lengths[s])
            ids[r, o : o + L] = src[s, :L]
            layout[r, o : o + L] = j
            row_of[s], offset[s] = r, o
            o += L
    return PackedRows(ids, layout, row_of, offset)
