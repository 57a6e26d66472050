"""Reference ELBO precompute and its cache (SPEC.md section 5).

B_hat_ref depends only on the frozen reference model and the masks, and the
masks are a pure function of (seed, example id, draw, L) (``elbo.draw_masks``),
so every draw's value can be computed once and reused by every training run,
on any number of processes: training then holds one model instead of two.

Cache layout (``<output_dir>/ref_cache`` unless ``reference.cache`` says otherwise)::

    manifest.json            written last, by the main process: the fingerprint,
                             K, the shard list with a sha256 per shard file
    shard-00000.safetensors  tensor ``elbo`` [n, K] float32 (draw k of example i);
                             metadata: the example ids and per-example token
                             digests (JSON), the fingerprint digest, and a
                             sha256 of the contents (detects a tampered shard)

Shards hold ``reference.shard_size`` consecutive examples; process r computes
shards r, r + world, ... and writes each one atomically, so an interrupted
precompute keeps its finished shards and skips them when run again.

The fingerprint names everything that changes the numbers: the reference
weights (a content digest), its config, the tokenizer, the mask token, the
dtype, max_length / padding / truncation / end-of-turn scoring, n_mc, the mask
seed, the estimator and stratification. It also records, without comparing them,
the batch grouping and the baseline kind of the recipe that made it. The dataset
is checked per example (id and token digest), so a cache made on the full set
also serves a subsampled run (the class-ratio ablations), while a changed row is
refused by name.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Optional, Sequence

import numpy as np
import torch

from dllm_align.core.errors import UserError

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
SHARD_FMT = "shard-{:05d}.safetensors"

# Fingerprint fields that must match exactly between a cache and a run. The
# model id and revision are recorded too, but the weights digest is what is
# compared: a moved folder or a re-download of the same revision is the same
# reference, and a different checkpoint behind the same name is not.
STRICT_FIELDS = (
    "format_version",
    "reference_weights",
    "tokenizer",
    "mask_token_id",
    "reference_dtype",
    "compute_dtype",
    "max_length",
    "padding",
    "truncation",
    "n_mc",
    "seed",
    "estimator",
    "stratified",
    "end_of_turn",
)
# Recorded for the reader, not compared: they do not change any cached value.
# (A kl baseline needs the mismatched pairs of its own batch plan; those are
# checked per example id like every other row.)
RECORDED_FIELDS = ("reference_model", "reference_revision", "dataset", "n_examples", "group_by_length", "baseline")

_HEX64 = set("0123456789abcdef")


# --------------------------------------------------------------------------- digests
def _sha256_file(path: Path) -> str:
    from dllm_align.core.io import sha256_file

    return sha256_file(path)


def example_digest(ex) -> str:
    """A 64-bit digest of the tokens of one example (what its reference value depends on)."""
    h = hashlib.sha256()
    h.update(np.asarray(ex.prompt_ids, dtype=np.int64).tobytes())
    h.update(b"|")
    h.update(np.asarray(ex.completion_ids, dtype=np.int64).tobytes())
    return h.hexdigest()[:16]


def dataset_digest(examples: Sequence) -> str:
    """Order-free digest of the tokenised examples: sha256 over sorted (id, token digest)."""
    h = hashlib.sha256()
    for i, d in sorted((ex.id, example_digest(ex)) for ex in examples):
        h.update(i.encode("utf-8"))
        h.update(b"\x00")
        h.update(d.encode("ascii"))
        h.update(b"\n")
    return h.hexdigest()


def tokenizer_digest(tok) -> str:
    """Digest of the tokenizer: its full serialisation (fast tokenizers), special tokens and chat template."""
    h = hashlib.sha256()
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is not None:
        h.update(backend.to_str().encode("utf-8"))
    else:
        h.update(json.dumps(sorted(tok.get_vocab().items())).encode("utf-8"))
    specials = {k: str(v) for k, v in sorted(getattr(tok, "special_tokens_map", {}).items())}
    h.update(json.dumps(specials, sort_keys=True).encode("utf-8"))
    h.update(str(getattr(tok, "chat_template", None) or "").encode("utf-8"))
    return h.hexdigest()


def state_dict_digest(model: torch.nn.Module) -> str:
    """Digest of a model's tensors (used for in-memory models such as ``builtin:tiny``)."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        t = t.detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}\n".encode("utf-8"))
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def _hub_blob_digest(path: Path) -> Optional[str]:
    """In a Hugging Face cache a snapshot file links to ``blobs/<sha256>``: the name is the digest."""
    if not path.is_symlink():
        return None
    target = Path(os.path.realpath(path))
    name = target.name
    if target.parent.name == "blobs" and len(name) == 64 and set(name) <= _HEX64:
        return name
    return None


def folder_weights_digest(folder: Path, known: Optional[dict] = None) -> tuple[str, list[dict]]:
    """Content digest of a model folder: its config and every safetensors file.

    ``known`` maps file names to entries recorded earlier ({size, mtime_ns, sha256});
    an entry whose size and mtime still match is trusted without rereading the
    file (as git and make do), so checking an 8B reference at train start is
    instant. Returns (digest, per-file entries).
    """
    known = known or {}
    files = sorted(p for p in folder.iterdir() if p.suffix == ".safetensors" or p.name == "config.json")
    entries = []
    for p in files:
        st = p.stat()
        prev = known.get(p.name)
        blob = _hub_blob_digest(p)
        if blob is not None:
            digest = blob
        elif prev and prev.get("size") == st.st_size and prev.get("mtime_ns") == st.st_mtime_ns:
            digest = prev["sha256"]
        else:
            digest = _sha256_file(p)
        entries.append({"name": p.name, "size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": digest})
    h = hashlib.sha256()
    for e in entries:
        h.update(f"{e['name']}\x00{e['sha256']}\n".encode("utf-8"))
    return h.hexdigest(), entries


# --------------------------------------------------------------------------- fingerprint
@dataclass
class Fingerprint:
    """Everything that changes the cached numbers (SPEC.md section 5)."""

    fields: dict
    weight_files: list  # per-file digests, kept so later checks need not reread the weights

    def strict(self) -> dict:
        return {k: self.fields[k] for k in STRICT_FIELDS}

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.strict(), sort_keys=True).encode("utf-8")).hexdigest()


def reference_name(recipe) -> str:
    return recipe.reference.model or recipe.model.name_or_path


def fingerprint(
    recipe,
    *,
    tokenizer,
    mask_token_id: int,
    device,
    examples: Sequence,
    known_files: Optional[list] = None,
) -> Fingerprint:
    """The fingerprint of the reference values this recipe needs for ``examples``.

    Computable without loading the reference (training from a cache holds only
    the policy): the weights digest comes from the files (or, for the built-in
    model, from building it), the tokenizer is the one the examples were
    tokenised with, and the weights / compute dtypes are the training
    precision's (:func:`dllm_align.models.precision.precision_for`): a cache made in
    fp32 does not serve a bf16-autocast run, nor the reverse.
    """
    from dllm_align.models.load import BUILTIN_SPECS, build_tiny_model, resolve_model_path
    from dllm_align.models.precision import precision_for

    name = reference_name(recipe)
    revision = recipe.model.revision
    if name in BUILTIN_SPECS:
        weights, files = "state:" + state_dict_digest(build_tiny_model(spec=BUILTIN_SPECS[name])), []
    else:
        path = resolve_model_path(name, revision)
        known = {e["name"]: e for e in (known_files or [])}
        weights, files = folder_weights_digest(Path(path), known)
    d = recipe.data
    r = recipe.reference
    prec = precision_for(recipe, device)
    fields = {
        "format_version": FORMAT_VERSION,
        "reference_model": name,
        "reference_revision": revision,
        "reference_weights": weights,
        "tokenizer": tokenizer_digest(tokenizer),
        "mask_token_id": int(mask_token_id),
        "reference_dtype": prec.weights_label,
        "compute_dtype": prec.compute_label,
        "max_length": d.max_length,
        "padding": d.padding,
        "truncation": d.truncation,
        "n_mc": r.n_mc,
        "seed": r.seed,
        "estimator": r.estimator,
        "stratified": r.stratified,
        "end_of_turn": d.end_of_turn,
        "group_by_length": d.group_by_length,
        "baseline": recipe.train.baseline,
        "dataset": dataset_digest(examples),
        "n_examples": len(examples),
    }
    return Fingerprint(fields, files)


_FIELD_HINTS = {
    "n_mc": "reference.n_mc",
    "seed": "reference.seed",
    "estimator": "reference.estimator",
    "stratified": "reference.stratified",
    "max_length": "data.max_length",
    "padding": "data.padding",
    "truncation": "data.truncation",
    "end_of_turn": "data.end_of_turn",
    "reference_weights": "the reference model's weights (reference.model / model.name_or_path)",
    "reference_dtype": "model.dtype",
    "compute_dtype": "train.mixed_precision (and the device: auto is bf16 on CUDA, no on CPU)",
    "tokenizer": "the tokenizer (model.tokenizer)",
    "mask_token_id": "model.mask_token_id",
    "format_version": "the cache format (made by another dllm-align version)",
}


def _short(v) -> str:
    s = json.dumps(v)
    return s if len(s) <= 24 else s[:20] + '..."'


def compare(cached: dict, wanted: dict, where: Path) -> None:
    """Raise UserError naming the first fingerprint field that differs."""
    for k in STRICT_FIELDS:
        if cached.get(k) != wanted[k]:
            raise UserError(
                f"reference cache {where} does not match this run: field '{k}' is {_short(cached.get(k))} "
                f"in the cache but {_short(wanted[k])} here ({_FIELD_HINTS.get(k, k)})",
                hint="run `dllm-align precompute-ref` with this recipe, or point reference.cache at a matching cache",
            )


# --------------------------------------------------------------------------- computing
def load_reference(recipe, device):
    """The frozen reference, loaded in the training precision (the policy's forward at step 0).

    Used by the online reference and by precompute, so that a cached value and an
    online one are the same function of the same weights as the policy before its
    first update (:mod:`dllm_align.models.precision`).
    """
    from dllm_align.models.load import load_from_section
    from dllm_align.models.precision import precision_for, prepare_reference

    prec = precision_for(recipe, device)
    section = recipe.model.model_copy(update={"dtype": prec.weights_label, "gradient_checkpointing": False})
    mp = load_from_section(section, device, name_or_path=reference_name(recipe))
    prepare_reference(mp.model, prec)
    mp.set_precision(prec)
    mp.model.eval()
    for p in mp.model.parameters():
        p.requires_grad_(False)
    return mp


def draw_config(recipe, n_mc: Optional[int] = None):
    from dllm_align.objective.elbo import DrawConfig

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
    from dllm_align.objective.elbo import elbo_draws

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


def elbo_range_problem(elbo: np.ndarray, ids: Sequence[str]) -> Optional[str]:
    """The first out-of-range value of a [n, K] block of ELBO draws, described, or None.

    A draw is a positive weight times a sum of log-probabilities (eq. elbo-l),
    so it is finite and <= 0. NaN / inf come from a broken or overflowing
    reference (float16); a positive value cannot come from the estimator at all.
    """
    vals = np.asarray(elbo, dtype=np.float64)
    with np.errstate(invalid="ignore"):
        bad = ~np.isfinite(vals) | (vals > 0)
    if not bad.any():
        return None
    i, k = (int(x) for x in np.argwhere(bad)[0])
    v = float(vals[i, k])
    why = "not finite" if not math.isfinite(v) else "a positive log-likelihood sum"
    return f"example '{ids[i]}' draw {k} is {v:g} ({why}; an ELBO is finite and <= 0); {int(bad.sum())} value(s) out of range"


def _contents_sha(elbo: np.ndarray, ids: list[str], digests: list[str]) -> str:
    h = hashlib.sha256()
    h.update(np.ascontiguousarray(elbo, dtype="<f4").tobytes())
    h.update(json.dumps([ids, digests]).encode("utf-8"))
    return h.hexdigest()


def write_shard(path: Path, elbo: np.ndarray, ids: list[str], digests: list[str], fp_digest: str) -> None:
    """One shard, written atomically, with a checksum of its contents in the metadata."""
    from safetensors.torch import save

    meta = {
        "format": "pt",
        "dllm_align_format_version": str(FORMAT_VERSION),
        "fingerprint": fp_digest,
        "ids": json.dumps(ids),
        "digests": json.dumps(digests),
        "contents_sha256": _contents_sha(elbo, ids, digests),
    }
    data = save({"elbo": torch.from_numpy(np.ascontiguousarray(elbo, dtype=np.float32))}, metadata=meta)
    from dllm_align.core import faults
    from dllm_align.core.io import atomic_path

    n = faults.next_record()
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)
        if n:
            faults.at("kill_mid_record", n)  # the temporary file is written, not yet renamed
    if n:
        faults.at("kill_after_records", n)


class ShardError(Exception):
    pass


def read_shard(path: Path) -> tuple[np.ndarray, list[str], list[str], str]:
    """Read and verify one shard; ShardError when it is truncated, malformed or tampered with."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            elbo = f.get_tensor("elbo").numpy()
    except Exception as e:  # a truncated file fails to parse
        raise ShardError(f"{path.name}: unreadable ({type(e).__name__})") from None
    try:
        ids = json.loads(meta["ids"])
        digests = json.loads(meta["digests"])
        fp = meta["fingerprint"]
        want = meta["contents_sha256"]
        if not (isinstance(ids, list) and isinstance(digests, list) and all(isinstance(i, str) for i in ids)):
            raise ValueError
    except (KeyError, ValueError, RecursionError):
        raise ShardError(f"{path.name}: metadata missing or malformed") from None
    if elbo.dtype != np.float32 or elbo.ndim != 2 or elbo.shape[0] != len(ids) or len(ids) != len(digests):
        raise ShardError(f"{path.name}: tensor {elbo.dtype} {tuple(elbo.shape)} does not match {len(ids)} ids of float32 draws")
    if _contents_sha(elbo, ids, digests) != want:
        raise ShardError(f"{path.name}: checksum mismatch (the file was modified or damaged)")
    problem = elbo_range_problem(elbo, ids)
    if problem:
        raise ShardError(f"{path.name}: out-of-range reference ELBO: {problem}")
    return elbo, ids, digests, fp


def cache_dir(recipe) -> Path:
    return Path(recipe.reference.cache) if recipe.reference.cache else Path(recipe.output_dir) / "ref_cache"


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
    from dllm_align.core.console import info, progress, warn
    from dllm_align.core.io import atomic_write_json

    rank = accelerator.process_index if accelerator else 0
    world = accelerator.num_processes if accelerator else 1
    is_main = rank == 0
    device = accelerator.device if accelerator else torch.device("cpu")
    if not examples:
        raise UserError("precompute-ref: the training set is empty")
    ids = [ex.id for ex in examples]
    if len(set(ids)) != len(ids):
        dup = next(i for i in ids if ids.count(i) > 1)
        raise UserError(f"example id '{dup}' appears more than once; ids must be unique (they seed the masks)")

    out = cache_dir(recipe)
    out.mkdir(parents=True, exist_ok=True)
    from dllm_align.core.io import DirLock

    lock = DirLock(out, f"another `dllm-align precompute-ref` is writing to {out}") if is_main else None
    if lock is not None:
        lock.__enter__()
    try:
        if ref_mp is None:
            ref_mp = load_reference(recipe, device)
        elif ref_mp.precision is None:  # a model loaded by the caller: compute as training will
            from dllm_align.models.precision import precision_for

            ref_mp.set_precision(precision_for(recipe, device))
        ref_mp.model.eval()
        old = _read_manifest(out)
        fp = fingerprint(
            recipe,
            tokenizer=ref_mp.tokenizer,
            mask_token_id=ref_mp.mask_token_id,
            device=device,
            examples=examples,
            known_files=(old or {}).get("weight_files"),
        )
        fpd = fp.digest()
        cfg = draw_config(recipe)
        size = recipe.reference.shard_size
        n_shards = math.ceil(len(examples) / size)
        digests = [example_digest(ex) for ex in examples]

        if old is not None and not overwrite:
            was = old["fingerprint"]
            _refuse_other_settings(out, [(k, was.get(k), fp.fields[k]) for k in (*STRICT_FIELDS, "dataset") if was.get(k) != fp.fields[k]])

        todo, reused = [], 0
        for s in range(n_shards):  # every process checks every shard, so all refuse together
            p = out / SHARD_FMT.format(s)
            lo, hi = s * size, min((s + 1) * size, len(examples))
            if p.exists():
                try:
                    _, sids, sdig, sfp = read_shard(p)
                    if sfp == fpd and sids == ids[lo:hi] and sdig == digests[lo:hi]:
                        reused += 1
                        continue
                    if not overwrite:
                        _refuse_other_settings(out, [(p.name, "other settings or rows", "this run's")])
                except ShardError as e:
                    if is_main:
                        warn(f"reference cache: {e}; computing it again")
            todo.append(s)
        if world > 1:
            # Every process works on the main process's list (rows of each shard are dealt out
            # below), so a shard written meanwhile cannot make their lists differ.
            box = [(todo, reused)]
            torch.distributed.broadcast_object_list(box, src=0)
            todo, reused = box[0]
        if is_main and old is not None:
            (out / MANIFEST).unlink()  # the manifest marks a complete cache; it is rewritten at the end

        n_todo = sum(min((s + 1) * size, len(examples)) - s * size for s in todo)
        t0 = time.perf_counter()
        rows = recipe.reference.batch_size * (recipe.reference.draws_per_forward or cfg.n_mc)
        if is_main:
            info(
                f"precompute-ref: {len(examples)} examples, K={cfg.n_mc}, {n_shards} shard(s) of {size}; "
                + (f"the rows of each shard dealt out over {world} processes; " if world > 1 else "1 process; ")
                + f"{len(todo)} shard(s) to compute, {reused} already done"
            )
        with progress("reference ELBO", total=n_todo if is_main else None, unit="ex") as bar:
            for s in todo:
                lo, hi = s * size, min((s + 1) * size, len(examples))
                # Rows are dealt out interleaved, so every process has a near-equal share of every
                # shard: a process waits at most about one row's time for the others (whole shards
                # per process left 5 of 8 GPUs idle for a whole shard on kto-mix-14k).
                mine = list(range(lo + rank, hi, world))
                vals = reference_values(
                    ref_mp, [examples[i] for i in mine], collate, cfg, recipe.reference.batch_size, rows,
                    on_batch=(lambda n: bar.advance(n * world)) if is_main else None,
                    pack_length=recipe.data.max_length if recipe.data.padding == "packed" else None,
                )
                problem = elbo_range_problem(vals, [ids[i] for i in mine])
                parts = [(mine, vals, problem)]
                if world > 1:
                    parts = [None] * world
                    torch.distributed.all_gather_object(parts, (mine, vals, problem))
                problem = next((p for _, _, p in parts if p), None)
                if problem:  # every process sees it and stops together
                    from dllm_align.core.errors import RunFailure

                    raise RunFailure(
                        f"reference ELBO out of range in shard {s}: {problem}; the shard was not written",
                        hint="check the reference model's weights and model.dtype (float16 overflows: use bfloat16 or float32)",
                    )
                if is_main:
                    block = np.zeros((hi - lo, cfg.n_mc), dtype=np.float32)
                    for rows_i, v, _ in parts:
                        block[[i - lo for i in rows_i]] = v
                    write_shard(out / SHARD_FMT.format(s), block, ids[lo:hi], digests[lo:hi], fpd)
        seconds = time.perf_counter() - t0
        if accelerator is not None:
            accelerator.wait_for_everyone()
        if is_main:
            shards = []
            for s in range(n_shards):
                p = out / SHARD_FMT.format(s)
                try:
                    _, sids, sdig, sfp = read_shard(p)
                except (ShardError, FileNotFoundError) as e:
                    from dllm_align.core.errors import RunFailure

                    raise RunFailure(f"reference cache {out}: shard {s} missing or damaged after precompute ({e})")
                lo, hi = s * size, min((s + 1) * size, len(examples))
                if sfp != fpd or sids != ids[lo:hi] or sdig != digests[lo:hi]:
                    from dllm_align.core.errors import RunFailure

                    raise RunFailure(f"reference cache {out}: shard {s} was written by another run")
                shards.append({"file": p.name, "n": hi - lo, "sha256": _sha256_file(p)})
            manifest = {
                "format_version": FORMAT_VERSION,
                "fingerprint": fp.fields,
                "fingerprint_digest": fpd,
                "weight_files": fp.weight_files,
                "K": cfg.n_mc,
                "shard_size": size,
                "shards": shards,
                "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            }
            atomic_write_json(out / MANIFEST, manifest)
        if accelerator is not None:
            accelerator.wait_for_everyone()
        return PrecomputeReport(out, len(examples), n_shards, len(todo), reused, seconds)
    finally:
        if lock is not None:
            lock.__exit__(None, None, None)


def _refuse_other_settings(out: Path, diffs: list) -> None:
    from dllm_align.core.runfolder import refuse_changes

    if diffs:
        refuse_changes(
            f"reference cache {out} was made with other settings, and would be replaced",
            [(_FIELD_HINTS.get(k, k) if k in _FIELD_HINTS else k, a, b) for k, a, b in diffs],
            hint="run with the cache's settings, write to another folder (-o, or reference.cache), "
            "or pass --overwrite to replace it",
        )


def _read_manifest(folder: Path) -> Optional[dict]:
    p = folder / MANIFEST
    if not p.exists():
        return None
    try:
        m = json.loads(p.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise UserError(f"{p}: not valid JSON", hint="delete the cache folder and run precompute-ref again")
    if not isinstance(m, dict) or not isinstance(m.get("fingerprint"), dict) or not isinstance(m.get("shards"), list):
        raise UserError(f"{p}: not a dllm-align reference cache manifest", hint="delete the cache folder and run precompute-ref again")
    files = m.get("weight_files") or []
    shards_ok = all(
        isinstance(e, dict) and isinstance(e.get("file"), str) and Path(e["file"]).name == e["file"]
        and e["file"].endswith(".safetensors") for e in m["shards"]
    )
    if not shards_ok or not isinstance(files, list) or not all(isinstance(e, dict) and "name" in e for e in files):
        raise UserError(f"{p}: malformed manifest (shard or weight-file entries)", hint="delete the cache folder and run precompute-ref again")
    return m


# --------------------------------------------------------------------------- reading
class ReferenceCache:
    """Cached per-draw reference values, verified against the run's fingerprint."""

    def __init__(self, folder: Path, values: dict[str, np.ndarray], digests: dict[str, str], manifest: dict):
        self.folder = folder
        self._values = values
        self._digests = digests
        self.manifest = manifest
        self.K = int(manifest["K"])

    @classmethod
    def open(cls, folder: Path) -> "ReferenceCache":
        """Read every shard, checking each file's sha256 against the manifest and its own checksum."""
        folder = Path(folder)
        m = _read_manifest(folder)
        if m is None:
            some = folder.exists() and any(folder.glob("shard-*.safetensors"))
            if some:
                raise UserError(
                    f"reference cache {folder} is incomplete (no manifest.json: precompute was interrupted)",
                    hint="run `dllm-align precompute-ref` again: finished shards are kept",
                )
            raise UserError(
                f"no reference cache at {folder}",
                hint="run `dllm-align precompute-ref RECIPE` first, or set reference.mode: online",
            )
        values: dict[str, np.ndarray] = {}
        digests: dict[str, str] = {}
        try:
            fpd = Fingerprint(dict(m["fingerprint"]), []).digest()
            K = int(m["K"])
            entries = [(str(e["file"]), str(e["sha256"])) for e in m["shards"]]
        except (KeyError, TypeError, ValueError, AttributeError):
            raise UserError(f"{folder / MANIFEST}: malformed manifest (fields missing or of the wrong type)",
                            hint="delete the cache folder and run precompute-ref again") from None
        for name, sha in entries:
            entry = {"file": name, "sha256": sha}
            p = folder / entry["file"]
            if not p.exists():
                raise UserError(f"reference cache {folder}: shard {entry['file']} is missing", hint="run precompute-ref again")
            if _sha256_file(p) != entry["sha256"]:
                raise UserError(
                    f"reference cache {folder}: shard {entry['file']} does not match its checksum (damaged or modified)",
                    hint="run precompute-ref again: it recomputes damaged shards",
                )
            try:
                elbo, ids, dig, sfp = read_shard(p)
            except ShardError as e:
                raise UserError(f"reference cache {folder}: {e}", hint="run precompute-ref again") from None
            if sfp != fpd:
                raise UserError(
                    f"reference cache {folder}: {MANIFEST} does not match shard {entry['file']} "
                    "(their fingerprints differ: the manifest was edited, or the shard comes from another cache)",
                    hint="run precompute-ref again into a fresh cache folder",
                )
            if elbo.shape[1] != K:
                raise UserError(f"reference cache {folder}: shard {entry['file']} holds {elbo.shape[1]} draws per example, "
                                f"the manifest says K={K}", hint="run precompute-ref again into a fresh cache folder")
            for i, row, d in zip(ids, elbo, dig):
                values[i] = row
                digests[i] = d
        return cls(folder, values, digests, m)

    def check(self, fp: Fingerprint, examples: Iterable, n_mc: int) -> None:
        """Refuse the cache unless it matches the run: strict fields, then every example's tokens."""
        compare(self.manifest["fingerprint"], fp.fields, self.folder)
        if n_mc > self.K:
            raise UserError(f"train.n_mc is {n_mc} but the reference cache {self.folder} holds {self.K} draws per example")
        for ex in examples:
            have = self._digests.get(ex.id)
            if have is None:
                raise UserError(
                    f"reference cache {self.folder} was made for another dataset: field 'dataset' differs "
                    f"(example '{ex.id}' is not in the cache)",
                    hint="run `dllm-align precompute-ref` on this recipe's data",
                )
            if have != example_digest(ex):
                raise UserError(
                    f"reference cache {self.folder} was made for another dataset: field 'dataset' differs "
                    f"(example '{ex.id}' has other tokens)",
                    hint="run `dllm-align precompute-ref` on this recipe's data",
                )

    def lookup(self, ids: Sequence[str], n_mc: int) -> torch.Tensor:
        """Reference values [B, n_mc] for ``ids`` (the first n_mc draws)."""
        return torch.from_numpy(np.stack([self._values[i][:n_mc] for i in ids])).float()

    def weight_files(self) -> list:
        return self.manifest.get("weight_files") or []


def run_precompute(recipe, accelerator=None, overwrite: bool = False):
    """``precompute-ref`` as a library call: load the reference and the examples, fill the cache.

    Returns (PrecomputeReport, accelerator). Finished shards are reused.
    """
    from accelerate import Accelerator

    from dllm_align.config.recipe import write_run_info
    from dllm_align.data.examples import load_training_examples, make_collate

    from dllm_align.models.precision import accelerator_kwargs

    acc = accelerator or Accelerator(cpu=not torch.cuda.is_available(), kwargs_handlers=accelerator_kwargs(recipe))
    ref_mp = load_reference(recipe, acc.device)
    examples = load_training_examples(recipe, ref_mp.tokenizer, quiet=not acc.is_main_process)
    if recipe.train.objective == "elbo_kto" and recipe.train.baseline == "kl":
        from dllm_align.data.examples import planned_kl_examples

        examples = examples + planned_kl_examples(recipe, examples)  # the mismatched pairs of every step
    rep = precompute(recipe, examples, make_collate(recipe, ref_mp.tokenizer), acc, ref_mp, overwrite=overwrite)
    if acc.is_main_process:  # after the inputs were checked: a refused run leaves nothing behind
        write_run_info(recipe, recipe.output_dir, "precompute-ref")
    return rep, acc
