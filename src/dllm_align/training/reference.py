"""Reference ELBO precompute and its cache (docs/design.md#the-reference-cache).

B_hat_ref depends only on the frozen reference model and the masks, and the
masks are a pure function of (seed, example id, draw, L) (``elbo.draw_masks``),
so every draw's value can be computed once and reused by every training run,
on any number of processes: training then holds one model instead of two.

Rows are scored in the micro-batches training will hold them in at epoch 0
(:func:`micro_batch_groups`), so a cached value is computed by the very
forward shapes the policy runs before its first update: the step-0 margins
are exactly 0 (kernels round by shape). Shards hold whole micro-batches; the
micro-batches of each shard are dealt out over the processes, and each shard
is written atomically, so an interrupted precompute keeps its finished shards
and skips them when run again.

The cache format, fingerprint and reader are in :mod:`dllm_align.training.cache`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np
import torch
from accelerate import Accelerator

from dllm_align.config.recipe import write_run_info
from dllm_align.core.console import info, progress, warn
from dllm_align.core.errors import RunFailure, UserError
from dllm_align.core.io import atomic_write_json, sha256_file
from dllm_align.core.runfolder import run_folder
from dllm_align.data.batching import pack_length_of, plan_batches
from dllm_align.data.examples import load_training_examples, make_collate, planned_batches
from dllm_align.models.load import ModelSource, check_max_length, load_from_section
from dllm_align.models.precision import Precision, accelerator_kwargs, precision_for, prepare_reference
from dllm_align.objective.base import objective_for
from dllm_align.objective.elbo import DrawConfig, elbo_draws
from dllm_align.training.plan import resolve_recipe
from dllm_align.training.reference_model import ShardedReference, read_reference, shard_reference, sharded_launch
from dllm_align.training.cache import (
    FORMAT_VERSION,
    MANIFEST,
    SHARD_FMT,
    Fingerprint,
    OPTIONAL_FIELDS,
    STRICT_FIELDS,
    ReferenceCache,
    ShardError,
    cache_dir,
    composition_global_batch,
    elbo_range_problem,
    example_digest,
    fingerprint,
    read_manifest,
    read_shard,
    reference_name,
    refuse_other_settings,
    write_shard,
)


# --------------------------------------------------------------------------- computing
def load_reference(recipe, device, *, precision: Optional[Precision] = None, source: Optional[ModelSource] = None,
                   accelerator=None):
    """The frozen reference, loaded in the training precision (the policy's forward at step 0).

    Used by the online reference and by precompute, so that a cached value and an
    online one are the same function of the same weights as the policy before its
    first update (:mod:`dllm_align.models.precision`). ``precision``: the run's (default: the recipe's on
    ``device``); ``source``: the recipe's model as already read, whose config.json is not read again when the
    reference is that model; ``accelerator``: the launch, whose FSDP2 shards the reference over its processes.
    A model whose folder names each weight is read without a whole copy at the weights' dtype anywhere
    (:mod:`dllm_align.training.reference_model`); any other is read whole on the host as before.
    """
    prec = precision if precision is not None else precision_for(recipe, device)
    name = reference_name(recipe)
    section = recipe.model.model_copy(update={"dtype": prec.weights_label, "gradient_checkpointing": False})
    config = source.config if source is not None and source.name_or_path == name else None
    mp = load_from_section(section, "cpu", name_or_path=name, config=config, empty=True)
    check_max_length(mp, recipe.data.max_length)
    mp.model.eval()
    for p in mp.model.parameters():
        p.requires_grad_(False)
    if mp.weight_sources and sharded_launch(accelerator):
        mp.set_precision(prec)
        return shard_reference(mp, accelerator)
    if mp.weight_sources:
        read_reference(mp, prec, device)
    else:
        mp.model.to(device)
    prepare_reference(mp.model, prec)
    mp.set_precision(prec)
    return mp


# --------------------------------------------------------------------------- during training
class TrainingReference:
    """B_hat_ref of a training step: the cached draws, or the resident reference model's (``reference.mode``)."""

    def __init__(self, cache=None, model=None):
        self.cache = cache
        self.model = model

    @torch.no_grad()
    def elbo(self, batch: dict, plan, rows_per_forward: Optional[int]) -> torch.Tensor:
        """[B]: the mean of draws 0..plan.k-1 (the policy's draws) of each row of a collated batch."""
        if self.cache is not None:
            return self.cache.lookup(batch["ids"], plan.k).mean(dim=1).to(plan.device)

        v = elbo_draws(
            self.model,
            batch["input_ids"],
            batch["attention_mask"],
            batch["completion_mask"],
            batch["ids"],
            plan.draws,
            max_rows_per_forward=rows_per_forward,
            draws=plan.draw_ids,
            pack_length=plan.pack_length,
        )
        return v.float().mean(dim=1)


def open_reference(recipe, plan, policy_mp, data, accelerator=None) -> TrainingReference:
    """The reference of a training run: loaded resident (``online``; sharded as the policy is on an FSDP2 launch of
    ``accelerator``), or the cache, checked to hold every row the run will score (its units and the objective's
    extra rows) under this run's fingerprint."""
    if recipe.reference.mode == "online":
        ref = TrainingReference(model=load_reference(recipe, plan.device, precision=plan.precision, source=plan.source,
                                                     accelerator=accelerator))
        if plan.main:
            info(f"train: reference computed online ({reference_name(recipe)}, resident)")
        return ref
    folder = cache_dir(recipe)
    cache = ReferenceCache.open(folder)
    fp = fingerprint(
        recipe,
        tokenizer=policy_mp.tokenizer,
        mask_token_id=policy_mp.mask_token_id,
        block_size=policy_mp.block_size,
        canvas_length=policy_mp.canvas_length,
        device=plan.device,
        examples=data.examples,
        known_files=cache.weight_files(),
    )
    used = [ex for u in data.units for ex in u]
    objective = plan.objective
    if objective.uses_extra_rows:
        extra = {}
        for batch in planned_batches(recipe, data.lengths, plan.global_batch, data.total):
            for ex in objective.extra_rows([data.units[i] for i in batch], recipe.data.max_length):
                extra.setdefault(ex.id, ex)
        missing = next((i for i in extra if i not in cache._digests), None)
        if missing is not None:
            raise objective.extra_rows_missing(folder, missing, cache.manifest["fingerprint"])
        used += list(extra.values())
    cache.check(fp, used, plan.k)
    if plan.main:
        info(f"train: reference from cache {folder} (K={cache.K}, using {plan.k})")
    return TrainingReference(cache=cache)


def draw_config(recipe, n_mc: Optional[int] = None):
    return DrawConfig.from_reference(recipe.reference, n_mc)


@torch.no_grad()
def reference_values(
    ref_mp,
    examples: Sequence,
    collate: Callable[[list], dict],
    cfg,
    batch_size: int,
    rows_per_forward: Optional[int] = None,
    draws: Optional[Sequence[int]] = None,
    on_batch: Optional[Callable[[int], None]] = None,
    pack_length: Optional[int] = None,
) -> np.ndarray:
    """Per-draw reference ELBO values [n, K] (float32) for ``examples``, in their order.

    Examples are batched longest first (less padding); each value depends only on
    its own example's tokens and masks. ``pack_length``: pack the noisy
    sequences of each forward into rows of that length (``data.padding: packed``).
    """
    K = cfg.n_mc if draws is None else len(draws)
    out = np.zeros((len(examples), K), dtype=np.float32)
    order = sorted(range(len(examples)), key=lambda i: -(len(examples[i].prompt_ids) + len(examples[i].completion_ids)))
    dev = ref_mp.device
    for start in range(0, len(order), batch_size):
        idx = order[start:start + batch_size]
        batch = collate([examples[i] for i in idx])
        vals = elbo_draws(
            ref_mp,
            batch["input_ids"].to(dev),
            batch["attention_mask"].to(dev) if batch.get("attention_mask") is not None else None,
            batch["completion_mask"].to(dev),
            batch["ids"],
            cfg,
            max_rows_per_forward=rows_per_forward,
            draws=draws,
            pack_length=pack_length,
        )
        out[idx] = vals.float().cpu().numpy()
        if on_batch is not None:
            on_batch(len(idx))
    return out




def micro_batch_groups(recipe, examples: Sequence) -> list[list[int]]:
    """Indices of ``examples`` grouped exactly as training's epoch-0 micro-batches will hold them, in plan order.

    Training scores a row in a forward shaped by its micro-batch: the batch width
    (``padding: none``), the packed rows it shares with its batch-mates' noisy copies
    (``packed``), the ``train.rows_per_forward`` chunks. Kernels block their
    reductions by shape, so the same row scored among other rows can differ in the
    last bits (in bf16: up to 0.07 nats per draw on 175-578-token rows). Precompute
    therefore scores each training row in the micro-batch, row order and call layout
    training uses at epoch 0 (:func:`dllm_align.data.batching.plan_batches`, then
    cuts of ``train.batch_size`` units, which do not depend on the process count
    unless ``data.group_by_length`` is on and ``train.global_batch_size`` is unset:
    one process is then assumed). The rows no micro-batch holds (the kl baseline's
    mismatched pairs) follow, longest first, in groups of ``reference.batch_size``.
    """
    t = recipe.train
    objective = objective_for(t)
    pos = {ex.id: i for i, ex in enumerate(examples)}
    rows = [ex for ex in examples if not objective.is_extra_row(ex)]
    try:
        units = objective.make_units(rows) if rows else []
    except UserError:
        units = []
    groups: list[list[int]] = []
    if units:
        lengths = [sum(ex.length for ex in u) for u in units]
        for batch in plan_batches(lengths, composition_global_batch(recipe), t.seed, 0, recipe.data.group_by_length):
            for j in range(0, len(batch), t.batch_size):
                groups.append([pos[ex.id] for i in batch[j:j + t.batch_size] for ex in units[i]])
    seen = {i for g in groups for i in g}
    rest = sorted((i for i in range(len(examples)) if i not in seen), key=lambda i: (-examples[i].length, i))
    bs = recipe.reference.batch_size
    groups.extend(rest[j:j + bs] for j in range(0, len(rest), bs))
    return groups


@torch.no_grad()
def group_values(ref_mp, examples: Sequence, collate: Callable[[list], dict], cfg, k_train: int,
                 rows_per_forward: Optional[int], pack_length: Optional[int]) -> np.ndarray:
    """[n, K] draws of one micro-batch, computed by the very call training's reference makes.

    Draws 0..k_train-1 come from one :func:`elbo_draws` call as in training
    (same collated rows, ``rows_per_forward`` chunks, packing); draws beyond them
    (a cache with more draws than this recipe's run uses) from a second call.
    """
    dev = ref_mp.device
    b = collate(list(examples))
    args = (ref_mp, b["input_ids"].to(dev), b["attention_mask"].to(dev) if b.get("attention_mask") is not None else None,
            b["completion_mask"].to(dev), b["ids"], cfg)
    k = min(k_train, cfg.n_mc)
    parts = [elbo_draws(*args, max_rows_per_forward=rows_per_forward, draws=list(range(k)), pack_length=pack_length)]
    if k < cfg.n_mc:
        parts.append(elbo_draws(*args, max_rows_per_forward=rows_per_forward, draws=list(range(k, cfg.n_mc)),
                                pack_length=pack_length))
    return torch.cat(parts, dim=1).float().cpu().numpy()


def _shard_bounds(groups: list[list[int]], size: int) -> list[tuple[int, int]]:
    """Shards of about ``size`` rows that never split a micro-batch: [lo, hi) in the grouped order."""
    bounds, lo, n = [], 0, 0
    for g in groups:
        n += len(g)
        if n - lo >= size:
            bounds.append((lo, n))
            lo = n
    if n > lo:
        bounds.append((lo, n))
    return bounds


@dataclass
class PrecomputeReport:
    cache: Path
    n_examples: int
    n_shards: int
    computed_shards: int
    reused_shards: int
    seconds: float

    @property
    def examples_per_second(self) -> float:
        n = self.n_examples * self.computed_shards / max(self.n_shards, 1)
        return n / self.seconds if self.seconds > 0 else float("nan")


@dataclass
class ShardLayout:
    """The cache's rows in training's micro-batch order (:func:`micro_batch_groups`), cut into shards of whole
    micro-batches, with the fingerprint every shard carries."""

    examples: list
    ids: list[str]
    digests: list[str]  # each row's token digest
    groups: list[list[int]]  # the micro-batches, as positions in ``examples``
    bounds: list[tuple[int, int]]  # shard s holds rows [lo, hi)
    fingerprint: Fingerprint
    digest: str  # the fingerprint's
    draws: DrawConfig
    shard_size: int


def precompute(
    recipe, examples: Sequence, collate: Callable[[list], dict], accelerator=None, ref_mp=None, overwrite: bool = False
) -> PrecomputeReport:
    """Compute and cache every example's K reference draws (``dllm-align precompute-ref``).

    Sharded across processes (shard s goes to rank s mod world); finished shards
    whose contents, ids, token digests and fingerprint check out are kept, so a
    rerun after an interruption only computes what is missing. A cache (or a
    shard) made with other settings is refused, naming every field that
    differs, unless ``overwrite``: it is never silently replaced.
    """
    rank = accelerator.process_index if accelerator else 0
    world = accelerator.num_processes if accelerator else 1
    device = accelerator.device if accelerator else torch.device("cpu")
    check_unique_examples(examples)
    out = cache_dir(recipe)
    # rank 0 writes the shards and the manifest that the other ranks (and `train` on every node) read
    with run_folder(out, f"{out} is in use by another dllm-align command: a `precompute-ref` writing it, or a "
                         "`train` reading it as its reference cache (that run must finish first)",
                    rank=rank, world=world, shared="reference cache"):
        out.mkdir(parents=True, exist_ok=True)
        if ref_mp is None:
            ref_mp = load_reference(recipe, device, accelerator=accelerator)
        elif ref_mp.precision is None:  # a model loaded by the caller: compute as training will
            ref_mp.set_precision(precision_for(recipe, device))
        ref_mp.model.eval()
        old = read_manifest(out)
        layout = shard_layout(recipe, examples, ref_mp, device, old)
        if old is not None and not overwrite:
            was, now = old["fingerprint"], layout.fingerprint.fields
            refuse_other_settings(out, [(k, was.get(k), now.get(k)) for k in (*STRICT_FIELDS, *OPTIONAL_FIELDS, "dataset")
                                         if was.get(k) != now.get(k)])
        todo, reused = shards_to_compute(out, layout, overwrite, rank, world)
        if rank == 0 and old is not None:
            (out / MANIFEST).unlink()  # the manifest marks a complete cache; it is rewritten at the end
        if rank == 0:
            info(
                f"precompute-ref: {len(layout.examples)} examples, K={layout.draws.n_mc}, {len(layout.bounds)} shard(s) "
                f"of ~{layout.shard_size} (whole training micro-batches of {recipe.train.batch_size}); "
                + (f"the rows of each shard dealt out over {world} processes; " if world > 1 else "1 process; ")
                + f"{len(todo)} shard(s) to compute, {reused} already done"
            )
        t0 = time.perf_counter()
        compute_shards(recipe, out, layout, todo, ref_mp, collate, rank, world)
        seconds = time.perf_counter() - t0
        if accelerator is not None:
            accelerator.wait_for_everyone()
        if rank == 0:
            write_manifest(out, layout)
        if accelerator is not None:
            accelerator.wait_for_everyone()
        return PrecomputeReport(out, len(layout.examples), len(layout.bounds), len(todo), reused, seconds)


def check_unique_examples(examples: Sequence) -> None:
    """Refuse an empty training set, or one whose ids repeat (the ids seed the masks)."""
    if not examples:
        raise UserError("precompute-ref: the training set is empty")
    ids = [ex.id for ex in examples]
    if len(set(ids)) != len(ids):
        dup = next(i for i in ids if ids.count(i) > 1)
        raise UserError(f"example id '{dup}' appears more than once; ids must be unique (they seed the masks)")


def shard_layout(recipe, examples: Sequence, ref_mp, device, old: Optional[dict]) -> ShardLayout:
    """The rows in training's micro-batch order, their shards and the fingerprint (``old``: the cache's manifest,
    whose weight-file digests are trusted while size and mtime match)."""
    fp = fingerprint(
        recipe,
        tokenizer=ref_mp.tokenizer,
        mask_token_id=ref_mp.mask_token_id,
        block_size=ref_mp.block_size,
        canvas_length=ref_mp.canvas_length,
        device=device,
        examples=examples,
        known_files=(old or {}).get("weight_files"),
    )
    size = recipe.reference.shard_size
    # Rows in training's micro-batch order; shards hold whole micro-batches (micro_batch_groups).
    groups = micro_batch_groups(recipe, examples)
    perm = [i for g in groups for i in g]
    where = {i: j for j, i in enumerate(perm)}
    ordered = [examples[i] for i in perm]
    groups = [[where[i] for i in g] for g in groups]
    return ShardLayout(examples=ordered, ids=[ex.id for ex in ordered], digests=[example_digest(ex) for ex in ordered],
                       groups=groups, bounds=_shard_bounds(groups, size), fingerprint=fp, digest=fp.digest(),
                       draws=draw_config(recipe), shard_size=size)


def _shard_matches(layout: ShardLayout, s: int, sids, sdig, sfp) -> bool:
    lo, hi = layout.bounds[s]
    return sfp == layout.digest and sids == layout.ids[lo:hi] and sdig == layout.digests[lo:hi]


def shards_to_compute(out: Path, layout: ShardLayout, overwrite: bool, rank: int, world: int) -> tuple[list[int], int]:
    """``(shards to compute, shards reused)``: a finished shard of this layout and fingerprint is kept, one of other
    settings refused (unless ``overwrite``), a damaged one computed again. Every process checks every shard, so
    all refuse together; the main process's list is then every process's."""
    todo, reused = [], 0
    for s in range(len(layout.bounds)):
        p = out / SHARD_FMT.format(s)
        if p.exists():
            try:
                _, sids, sdig, sfp = read_shard(p)
                if _shard_matches(layout, s, sids, sdig, sfp):
                    reused += 1
                    continue
                if not overwrite:
                    refuse_other_settings(out, [(p.name, "other settings or rows", "this run's")])
            except ShardError as e:
                if rank == 0:
                    warn(f"reference cache: {e}; computing it again")
        todo.append(s)
    if world > 1:
        # Every process works on the main process's list (rows of each shard are dealt out
        # below), so a shard written meanwhile cannot make their lists differ.
        box = [(todo, reused)]
        torch.distributed.broadcast_object_list(box, src=0)
        todo, reused = box[0]
    return todo, reused


def compute_shards(recipe, out: Path, layout: ShardLayout, todo: list[int], ref_mp, collate, rank: int, world: int) -> None:
    """Each shard of ``todo``: its micro-batches dealt out over the processes, scored as training will score them,
    gathered, range-checked and written (main process) atomically."""
    cfg, examples, ids = layout.draws, layout.examples, layout.ids
    rows = recipe.reference.batch_size * (recipe.reference.draws_per_forward or cfg.n_mc)
    pack = pack_length_of(recipe.data)
    objective = objective_for(recipe.train)
    n_todo = sum(layout.bounds[s][1] - layout.bounds[s][0] for s in todo)
    # a sharded reference's forwards are collectives: a process whose share of a shard is done joins the others'
    # forwards until all are (reference_model.ShardedReference.finish), before the shard's values are gathered
    lockstep = isinstance(ref_mp, ShardedReference) and world > 1
    if lockstep:
        ref_mp.lockstep = True
        probe = partial(group_values, ref_mp, examples[:1], collate, cfg, 1, None, pack)
    with progress("reference ELBO", total=n_todo if rank == 0 else None, unit="ex") as bar:
        for s in todo:
            lo, hi = layout.bounds[s]
            # Micro-batches are dealt out interleaved, so every process has a near-equal share of
            # every shard: a process waits at most about one micro-batch's time for the others
            # (whole shards per process left 5 of 8 GPUs idle for a whole shard on kto-mix-14k).
            in_shard = [g for g in layout.groups if lo <= g[0] < hi]
            my_groups = in_shard[rank::world]
            mine = [i for g in my_groups for i in g]
            vals = np.zeros((len(mine), cfg.n_mc), dtype=np.float32)
            at = 0
            for g in my_groups:
                exs = [examples[i] for i in g]
                if any(objective.is_extra_row(ex) for ex in exs):
                    # not a training micro-batch (the kl baseline's pairs): batched as before
                    v = reference_values(ref_mp, exs, collate, cfg, len(exs), rows, pack_length=pack)
                else:
                    v = group_values(ref_mp, exs, collate, cfg, recipe.train_n_mc(), recipe.train.rows_per_forward, pack)
                vals[at:at + len(g)] = v
                at += len(g)
                if rank == 0:
                    bar.advance(len(g) * world)
            if lockstep:
                ref_mp.finish(probe)
            problem = elbo_range_problem(vals, [ids[i] for i in mine])
            parts = [(mine, vals, problem)]
            if world > 1:
                parts = [None] * world
                torch.distributed.all_gather_object(parts, (mine, vals, problem))
            problem = next((p for _, _, p in parts if p), None)
            if problem:  # every process sees it and stops together
                raise RunFailure(
                    f"reference ELBO out of range in shard {s}: {problem}; the shard was not written",
                    hint="check the reference model's weights and model.dtype (float16 overflows: use bfloat16 or float32)",
                )
            if rank == 0:
                block = np.zeros((hi - lo, cfg.n_mc), dtype=np.float32)
                for rows_i, v, _ in parts:
                    block[[i - lo for i in rows_i]] = v
                write_shard(out / SHARD_FMT.format(s), block, ids[lo:hi], layout.digests[lo:hi], layout.digest)


def write_manifest(out: Path, layout: ShardLayout) -> None:
    """Check every shard once more (written by this layout and fingerprint) and write the manifest that marks the
    cache complete."""
    shards = []
    for s, (lo, hi) in enumerate(layout.bounds):
        p = out / SHARD_FMT.format(s)
        try:
            _, sids, sdig, sfp = read_shard(p)
        except (ShardError, FileNotFoundError) as e:
            raise RunFailure(f"reference cache {out}: shard {s} missing or damaged after precompute ({e})")
        if not _shard_matches(layout, s, sids, sdig, sfp):
            raise RunFailure(f"reference cache {out}: shard {s} was written by another run")
        shards.append({"file": p.name, "n": hi - lo, "sha256": sha256_file(p)})
    fp = layout.fingerprint
    manifest = {
        "format_version": FORMAT_VERSION,
        "fingerprint": fp.fields,
        "fingerprint_digest": layout.digest,
        "weight_files": fp.weight_files,
        "K": layout.draws.n_mc,
        "shard_size": layout.shard_size,
        "shards": shards,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    atomic_write_json(out / MANIFEST, manifest)


def run_precompute(recipe, accelerator=None, overwrite: bool = False):
    """``precompute-ref`` as a library call: load the reference and the examples, fill the cache.

    Returns (PrecomputeReport, accelerator). Finished shards are reused.
    """
    acc = accelerator or Accelerator(cpu=not torch.cuda.is_available(), kwargs_handlers=accelerator_kwargs(recipe))
    recipe, source = resolve_recipe(recipe, quiet=not acc.is_main_process)
    ref_mp = load_reference(recipe, acc.device, source=source, accelerator=acc)
    examples = load_training_examples(recipe, ref_mp.tokenizer, quiet=not acc.is_main_process,
                                      block_size=ref_mp.block_size, canvas_length=ref_mp.canvas_length)
    # the objective's extra rows of every step (the kl baseline's mismatched pairs)
    examples = examples + objective_for(recipe.train).reference_extras(recipe, examples)
    rep = precompute(recipe, examples, make_collate(recipe, ref_mp.tokenizer), acc, ref_mp, overwrite=overwrite)
    if acc.is_main_process:  # after the inputs were checked: a refused run leaves nothing behind
        write_run_info(recipe, recipe.output_dir, "precompute-ref")
    return rep, acc
