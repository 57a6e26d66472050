"""The reference cache: its layout, fingerprint, shards and reader (docs/design.md#the-reference-cache).

Cache layout (``<output_dir>/ref_cache`` unless ``reference.cache`` says otherwise)::

    manifest.json            written last, by the main process: the fingerprint,
                             K, the shard list with a sha256 per shard file
    shard-00000.safetensors  tensor ``elbo`` [n, K] float32 (draw k of example i);
                             metadata: the example ids and per-example token
                             digests (JSON), the fingerprint digest, and a
                             sha256 of the contents (detects a tampered shard)


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
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional, Sequence

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save

from dllm_align.core import faults
from dllm_align.core.errors import UserError
from dllm_align.core.io import atomic_path, sha256_file
from dllm_align.core.runfolder import refuse_changes
from dllm_align.data.examples import block_scoring
from dllm_align.models.load import BUILTIN_SPECS, build_tiny_model, resolve_model_path
from dllm_align.models.precision import precision_for
from dllm_align.objective.components import UniformSettings


FORMAT_VERSION = 1
MANIFEST = "manifest.json"
SHARD_FMT = "shard-{:05d}.safetensors"

# Fingerprint fields that must match exactly between a cache and a run. The
# model id and revision are recorded too, but the weights digest is what is
# compared: a moved folder or a re-download of the same revision is the same
# reference, and a different checkpoint behind the same name is not.
# The uniform-noise likelihood's settings and their defaults: in the fingerprint only when they differ from
# the defaults (a cache that lacks one was made with its default).
UNIFORM_FIELDS_DEFAULTS = {k: f.default for k, f in UniformSettings.model_fields.items()}
UNIFORM_FIELDS = tuple(UNIFORM_FIELDS_DEFAULTS)
# Fields present only where they apply; a cache that lacks one was made where it did not (or before it existed).
# ``likelihood`` and its ``likelihood_settings``: a likelihood the recipe picks (``reference.likelihood``); a cache
# that lacks them was made with the family's.
OPTIONAL_FIELDS = (*UNIFORM_FIELDS, "tied_head", "likelihood", "likelihood_settings")
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
    "block_scoring",
    "attn_implementation",
)
# Recorded for the reader, not compared: they do not change any cached value.
# (A kl baseline needs the mismatched pairs of its own batch plan; those are
# checked per example id like every other row.)
RECORDED_FIELDS = ("reference_model", "reference_revision", "dataset", "n_examples", "group_by_length", "baseline",
                   "composition")

_HEX64 = set("0123456789abcdef")


# --------------------------------------------------------------------------- digests
def _sha256_file(path: Path) -> str:
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
    """Everything that changes the cached numbers (docs/design.md#the-reference-cache)."""

    fields: dict
    weight_files: list  # per-file digests, kept so later checks need not reread the weights

    def strict(self) -> dict:
        return {k: self.fields[k] for k in STRICT_FIELDS} | {k: self.fields[k] for k in OPTIONAL_FIELDS if k in self.fields}

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.strict(), sort_keys=True).encode("utf-8")).hexdigest()


def reference_name(recipe) -> str:
    return recipe.reference.model or recipe.model.name_or_path


def composition_global_batch(recipe) -> int:
    t = recipe.train
    return t.global_batch_size or t.batch_size * t.grad_accum


def composition(recipe) -> dict:
    """What the cached values' forward shapes follow (recorded in the fingerprint; see
    :func:`dllm_align.training.reference.micro_batch_groups`)."""
    t = recipe.train
    return {"plan": "epoch-0 micro-batches", "batch_size": t.batch_size, "rows_per_forward": t.rows_per_forward,
            "n_mc_train": recipe.train_n_mc(), "seed": t.seed, "group_by_length": recipe.data.group_by_length,
            "global_batch": composition_global_batch(recipe)}


def fingerprint(
    recipe,
    *,
    tokenizer,
    mask_token_id: int,
    device,
    examples: Sequence,
    known_files: Optional[list] = None,
    block_size: Optional[int] = None,
    canvas_length: Optional[int] = None,
) -> Fingerprint:
    """The fingerprint of the reference values this recipe needs for ``examples``.

    Computable without loading the reference (training from a cache holds only
    the policy): the weights digest comes from the files (or, for the built-in
    model, from building it), the tokenizer is the one the examples were
    tokenised with, and the weights / compute dtypes are the training
    precision's (:func:`dllm_align.models.precision.precision_for`): a cache made in
    fp32 does not serve a bf16-autocast run, nor the reverse. ``block_size`` / ``canvas_length``: the
    model's (block-diffusion families / DiffusionGemma), for the layout ``data.block_scoring`` gives.
    """
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
        # The block or canvas layout (None for a whole-sequence model, where data.block_scoring does nothing).
        "block_scoring": block_scoring(d, block_size, canvas_length),
        # The attention kernel is part of the function computed (flash / flex / sdpa round differently).
        "attn_implementation": recipe.model.attn_implementation or "sdpa",
        "composition": composition(recipe),
        "group_by_length": d.group_by_length,
        "baseline": recipe.train.baseline,
        "dataset": dataset_digest(examples),
        "n_examples": len(examples),
    }
    # Under autocast the reference's Linears are stored in the compute dtype, except a head tied to the input
    # embeddings, kept in the weights' dtype (models.precision.prepare_reference). Caches made before that rule
    # rounded such a head, and with it the embeddings: they lack the field and are refused under autocast. Without
    # autocast nothing changed, the field is left out, and the caches made before still match.
    if prec.autocast is not None and prec.autocast != prec.weights:
        fields["tied_head"] = prec.weights_label
    # The uniform-noise likelihood's choices change its values; recorded when they differ from the defaults,
    # so that the caches of the other likelihoods (which ignore them) keep their fingerprints.
    for key, default in UNIFORM_FIELDS_DEFAULTS.items():
        if getattr(r, key) != default:
            fields[key] = getattr(r, key)
    fields.update(r.likelihood_record())
    return Fingerprint(fields, files)


_FIELD_HINTS = {
    "n_mc": "reference.n_mc",
    "seed": "reference.seed",
    "estimator": "reference.estimator",
    "stratified": "reference.stratified",
    "time_power": "reference.time_power",
    "parameterization": "reference.parameterization",
    "self_conditioning": "reference.self_conditioning",
    "surrogate": "reference.surrogate",
    "likelihood": "reference.likelihood",
    "likelihood_settings": "the chosen likelihood's own settings (reference.<likelihood>.<key>)",
    "max_length": "data.max_length",
    "padding": "data.padding",
    "truncation": "data.truncation",
    "end_of_turn": "data.end_of_turn",
    "block_scoring": "data.block_scoring",
    "reference_weights": "the reference model's weights (reference.model / model.name_or_path)",
    "reference_dtype": "model.dtype",
    "compute_dtype": "train.mixed_precision (and the device: auto is bf16 on CUDA, no on CPU)",
    "tokenizer": "the tokenizer (model.tokenizer)",
    "mask_token_id": "model.mask_token_id",
    "format_version": "the cache format (made by another dllm-align version)",
    "attn_implementation": "model.attn_implementation",
    "tied_head": "a cache made before a bf16 reference kept a head tied to the embeddings in full precision "
                 "(recompute it with precompute-ref)",
}


def _short(v) -> str:
    s = json.dumps(v)
    return s if len(s) <= 24 else s[:20] + '..."'


def compare(cached: dict, wanted: dict, where: Path) -> None:
    """Raise UserError naming the first fingerprint field that differs."""
    for k in STRICT_FIELDS + OPTIONAL_FIELDS:
        if cached.get(k) != wanted.get(k):
            raise UserError(
                f"reference cache {where} does not match this run: field '{k}' is {_short(cached.get(k))} "
                f"in the cache but {_short(wanted.get(k))} here ({_FIELD_HINTS.get(k, k)})",
                hint="run `dllm-align precompute-ref` with this recipe, or point reference.cache at a matching cache",
            )




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
    meta = {
        "format": "pt",
        "dllm_align_format_version": str(FORMAT_VERSION),
        "fingerprint": fp_digest,
        "ids": json.dumps(ids),
        "digests": json.dumps(digests),
        "contents_sha256": _contents_sha(elbo, ids, digests),
    }
    data = save({"elbo": torch.from_numpy(np.ascontiguousarray(elbo, dtype=np.float32))}, metadata=meta)

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




def refuse_other_settings(out: Path, diffs: list) -> None:
    """Refuse (exit 2) to replace the cache in ``out`` when ``diffs`` (key, cached, now) is not empty, naming each key."""
    if diffs:
        refuse_changes(
            f"reference cache {out} was made with other settings, and would be replaced",
            [(_FIELD_HINTS.get(k, k) if k in _FIELD_HINTS else k, a, b) for k, a, b in diffs],
            hint="run with the cache's settings, write to another folder (-o, or reference.cache), "
            "or pass --overwrite to replace it",
        )


def read_manifest(folder: Path) -> Optional[dict]:
    """The cache manifest in ``folder``, or None when there is none."""
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
        m = read_manifest(folder)
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



