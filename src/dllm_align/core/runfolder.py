"""Run folders (``-o DIR``): what each command records there, refusing a reused folder whose settings
changed, and holding one while a command writes it (:func:`run_folder`: the lock, rank 0's decisions, no
empty folder left behind).

Every command writes its own record into the run folder, named after the
command (``recipe.<command>.yaml``, ``run_info.<command>.json``), so that
``generate`` or ``judge`` run into a training folder never replace the record
of how the model was trained.

A folder that is *continued* (``train --resume``, ``precompute-ref`` over an
existing cache, ``generate`` onto an existing output file) must be continued
with the settings that made it: otherwise the numbers of the two halves mix
and the record misdescribes the run. :func:`refuse_changes` compares the
recorded settings with the new ones and names *every* key that differs
(exit 2), unless the user lets each one through explicitly.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import os
import secrets
import socket
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any, Iterable, Optional

import yaml

from dllm_align.core.errors import DllmAlignError, RunFailure, UserError
from dllm_align.core.io import DirLock, atomic_write_bytes

# lazy imports: torch.distributed: core/ loads no torch, so that `--help` and `recipes check` start fast

# Recipe keys that do not change a training run's numbers: where things are
# written, how often, how progress is shown, how work is chunked (the chunking
# is tested to give the same numbers), and the sections of other commands.
TRAIN_NEUTRAL = (
    "name",
    "description",
    "output_dir",
    "model.published_code",  # only what final/ carries beside the weights
    "train.save_every",
    "train.keep_checkpoints",
    "train.log_every",
    "train.trackers",
    "train.rows_per_forward",
    "train.batch_size",
    "train.grad_accum",
    "train.margin_watch_window",
    "train.process_group_timeout_minutes",
    "model.gradient_checkpointing",
    "reference.batch_size",
    "reference.draws_per_forward",
    "reference.shard_size",
    "reference.cache",
    "reference.mode",
    "generate",
    "judge",
    "ablate",
    "evaluate",
    "online",  # how many rounds, which round is kept: online's own record checks what defines a round
)


def recipe_record(out_dir: str | Path, command: str) -> Path:
    """The resolved recipe a command wrote into a run folder."""
    return Path(out_dir) / f"recipe.{command}.yaml"


def flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}`` (lists stay values)."""
    if not isinstance(d, dict):
        return {prefix: d}
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if isinstance(v, dict) and v:
            out.update(flatten(v, key))
        else:
            out[key] = v
    return out


def _neutral(key: str, neutral: Iterable[str]) -> bool:
    return any(key == n or key.startswith(n + ".") for n in neutral)


def differing(old: dict, new: dict, neutral: Iterable[str] = ()) -> list[tuple[str, Any, Any]]:
    """Every flattened key whose value differs, as (key, old, new); ``neutral`` keys are ignored.

    A key the old record lacks (written before the key existed) is not compared;
    one the new settings lack counts as null.
    """
    a, b = flatten(old), flatten(new)
    out = []
    for k in sorted(a):
        if _neutral(k, neutral):
            continue
        va, vb = a.get(k), b.get(k)
        if va != vb:
            out.append((k, va, vb))
    return out


def _show(v: Any) -> str:
    s = json.dumps(v, ensure_ascii=False, default=str)
    return s if len(s) <= 40 else s[:36] + '..."'


def refuse_changes(
    what: str,
    diffs: list[tuple[str, Any, Any]],
    *,
    allow: Iterable[str] = (),
    hint: Optional[str] = None,
) -> list[tuple[str, Any, Any]]:
    """Raise UserError naming each differing key not in ``allow``; returns the allowed ones.

    ``allow`` holds dotted keys (``train.lr``) or ``all``.
    """
    allow = set(allow)
    if "all" in allow:
        return diffs
    refused = [d for d in diffs if not any(d[0] == a or d[0].startswith(a + ".") for a in allow)]
    if refused:
        listed = "; ".join(f"{k} (was {_show(a)}, now {_show(b)})" for k, a, b in refused)
        n = len(refused)
        flags = " ".join(f"--allow-change {k}" for k, _, _ in refused)
        raise UserError(
            f"{what}: {n} setting{'s' if n > 1 else ''} that change{'s' if n == 1 else ''} the results "
            f"differ{'s' if n == 1 else ''} from the recorded run: {listed}",
            hint=hint or f"use the recorded settings, another run folder, or let them through with {flags}",
        )
    return diffs


def recorded_recipe(out_dir: str | Path, command: str) -> Optional[dict]:
    """The recipe a command recorded in ``out_dir`` (``recipe.<command>.yaml``), or None.

    Folders written before per-command records have only ``recipe.resolved.yaml``,
    which any command may have rewritten last; it is not trusted as the run's record.
    """
    for p in (recipe_record(out_dir, command),):
        if p.is_file():
            try:
                raw = yaml.safe_load(p.read_text(encoding="utf-8"))
            except (yaml.YAMLError, UnicodeDecodeError):
                raise UserError(f"{p}: the run's record is not valid YAML", hint="restore it, or start a new run folder") from None
            return raw if isinstance(raw, dict) else None
    return None


def _fixed_lr(raw: dict) -> bool:
    t = raw.get("train") or {}
    return t.get("scheduler") == "constant" and not t.get("warmup_ratio")


def check_allow_keys(allow: Iterable[str], new: dict) -> None:
    """Every ``--allow-change KEY`` must name a recipe key or section (or be ``all``): a typo would
    otherwise let nothing through and be silently ignored, or worse, look like permission."""
    keys = set(flatten(new))
    known = keys | {".".join(k.split(".")[:i]) for k in keys for i in range(1, k.count(".") + 1)}
    for a in allow:
        if a == "all" or a in known:
            continue
        close = difflib.get_close_matches(a, sorted(known), n=1)
        raise UserError(f"--allow-change {a}: no such recipe key" + (f"; did you mean '{close[0]}'?" if close else ""),
                        hint="name a key as --set does (section.key), or 'all'")


def state_as_recipe(state: dict) -> dict:
    """The settings a checkpoint's trainer_state.json records, as a (partial) recipe to compare against:
    its full recipe when it has one, else the fields every checkpoint records."""
    if isinstance(state.get("recipe"), dict):
        return state["recipe"]
    return {"model": {"name_or_path": state.get("model")},
            "train": {"objective": state.get("objective"), "seed": state.get("seed"), "lora": {"enabled": state.get("lora")}},
            "data": {"group_by_length": state.get("group_by_length")}}


def check_training_settings(recipe, out_dir: str | Path, allow: Iterable[str] = (),
                            checkpoint_state: Optional[dict] = None) -> list[tuple[str, Any, Any]]:
    """Refuse to continue (or reuse) the training run in ``out_dir`` with settings that change its
    numbers; returns the changes the user let through (empty when nothing changed). The run's record
    is ``recipe.train.yaml``; without it, what the checkpoint being resumed records itself."""
    new = recipe.model_dump(mode="json")
    check_allow_keys(allow, new)
    old = recorded_recipe(out_dir, "train")
    if old is None and checkpoint_state is not None:
        old = state_as_recipe(checkpoint_state)
    if old is None:
        return []
    neutral = TRAIN_NEUTRAL
    if all(_fixed_lr(r) for r in (old, new)):
        # a constant lr without warm-up does not depend on the run's length: extending it is exact
        neutral = neutral + ("train.max_steps", "train.epochs")
    diffs = differing(old, new, neutral)
    return refuse_changes(
        f"cannot continue the training run in {out_dir}",
        diffs,
        allow=allow,
        hint=None,
    )


# -- several nodes: the run folder must be one folder that every process sees

SHARED_PROBE = ".shared-probe-"


def check_shared_folder(folder: str | Path, what: str = "run folder", *, settle_s: float = 5.0, create: bool = True) -> None:
    """Refuse a folder that the processes of a multi-node launch do not all see (exit 2, every rank).

    Rank 0 writes every run folder's records, checkpoints, merged outputs and cache manifests, and the
    other ranks read them back (the cache, a checkpoint to resume, the part files of ``generate``): a
    path on a node-local disk names a different, diverging folder on each node. Rank 0 writes a file
    with a fresh random name and content into ``folder``; every rank looks for it (for up to ``settle_s``
    seconds: a network filesystem may show a new file late) and the verdicts are gathered, so that all
    ranks refuse together. The probe is removed; nothing else is written. A no-op in one process.
    Without ``create``, a folder rank 0 does not have is not made and not checked (on every rank).
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return
    rank, world = dist.get_rank(), dist.get_world_size()
    folder = Path(folder)
    box: list = [None]
    probe = None
    made = rank == 0 and not folder.exists()
    if rank == 0 and not create and not folder.is_dir():
        box = [("absent", "")]
    elif rank == 0:
        nonce = secrets.token_hex(16)
        probe = folder / f"{SHARED_PROBE}{nonce[:12]}"
        try:
            folder.mkdir(parents=True, exist_ok=True)
            with open(probe, "w", encoding="utf-8") as f:
                f.write(nonce)
                f.flush()
                os.fsync(f.fileno())
            box = [(probe.name, hashlib.sha256(nonce.encode()).hexdigest())]
        except OSError as e:
            box = [("error", f"{folder}: rank 0 cannot write its {what} ({e.strerror or e})")]
    dist.broadcast_object_list(box, src=0)
    name, digest = box[0]
    if name == "error":
        raise UserError(digest)
    if name == "absent":
        return
    seen = False
    deadline = time.monotonic() + settle_s
    while True:
        try:
            os.listdir(folder)  # revalidates the folder's entries on NFS before the lookup
            text = (folder / name).read_text(encoding="utf-8")
            seen = hashlib.sha256(text.encode()).hexdigest() == digest
        except OSError:
            seen = False
        if seen or time.monotonic() >= deadline:
            break
        time.sleep(0.2)
    verdicts: list = [None] * world
    dist.all_gather_object(verdicts, (seen, socket.gethostname()))
    if probe is not None:
        try:
            probe.unlink()
        except OSError:
            pass
    blind = [(r, host) for r, (ok, host) in enumerate(verdicts) if not ok]
    if blind:
        if made:  # refused: leave no empty folder behind
            try:
                folder.rmdir()
            except OSError:
                pass
        ranks = ", ".join(f"{r} ({host})" for r, host in blind)
        raise UserError(
            f"{folder}: the {what} is not shared between the nodes: rank(s) {ranks} cannot see the file rank 0 "
            f"({verdicts[0][1]}) wrote there",
            hint="put it on a disk that every node mounts at the same path (NFS, Lustre, GPFS ...), or run on one node",
        )


def wait_visible(path: str | Path, timeout_s: float) -> bool:
    """Whether ``path`` (a folder another node made) shows up here within ``timeout_s`` seconds.

    On NFS a client caches a folder's entries for a few seconds (``actimeo``): listing the parent
    revalidates them before each look.
    """
    path = Path(path)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            os.listdir(path.parent)
        except OSError:
            pass
        if path.is_dir():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.2)


def check_all_see(path: str | Path, what: str, timeout_s: float = 60.0) -> None:
    """Every rank waits (up to ``timeout_s``) until it sees the folder rank 0 made, then all agree: a
    rank that still cannot see it makes every rank stop with one line (RunFailure), before any rank
    writes into a folder that is not there. A no-op in one process."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return
    seen = wait_visible(path, timeout_s) if dist.get_rank() else True
    verdicts: list = [None] * dist.get_world_size()
    dist.all_gather_object(verdicts, seen)
    blind = [r for r, ok in enumerate(verdicts) if not ok]
    if blind:
        raise RunFailure(
            f"{path}: rank(s) {', '.join(map(str, blind))} cannot see the {what} rank 0 made {timeout_s:.0f} s ago",
            hint="the run folder must be on a disk every node mounts at the same path; on NFS, a lower actimeo helps",
        )


# -- rank 0 writes the run folder: its lock, and its outcomes said to every rank

@contextmanager
def rank0_lock(folder: Path, message: str, rank: int, world: int):
    """``folder``'s :class:`~dllm_align.core.io.DirLock` (``message`` when another command holds it), taken by rank 0
    alone, which alone writes; when several processes run, whether it got the lock is said to every rank (a
    refusal is raised on every rank), so that no rank goes on while rank 0 has stopped."""
    lock = DirLock(folder, message) if rank == 0 else None

    def take() -> None:  # returns nothing: the result is broadcast, and the lock stays on rank 0
        lock.__enter__()

    if world > 1:
        from_rank0(take)
    elif lock is not None:
        take()
    try:
        yield
    finally:
        if lock is not None:
            lock.__exit__(None, None, None)


def from_rank0(fn):
    """``fn()`` run on rank 0 (the other ranks pass a function returning None), its result given to every
    rank, or its error raised on every rank: no rank waits for a rank 0 that has stopped."""
    import torch.distributed as dist

    box: list = [None]
    err = None
    if dist.get_rank() == 0:
        try:
            box = [("ok", fn())]
        except DllmAlignError as e:
            box, err = [("error", e.exit_code, e.message, e.hint)], e
        except Exception as e:  # noqa: BLE001 - said to the other ranks, then raised here as it is
            box, err = [("error", 1, f"rank 0 stopped: {type(e).__name__}: {e}", None)], e
    dist.broadcast_object_list(box, src=0)
    if err is not None:
        raise err
    if box[0][0] == "error":
        _, code, message, hint = box[0]
        raise (UserError if code == 2 else RunFailure)(message, hint=hint)
    return box[0][1]


class HeldFolder:
    """A run folder as :func:`run_folder` holds it: rank 0 writes, every rank learns what rank 0 decided."""

    def __init__(self, folder: Path, rank: int, world: int, stack: ExitStack):
        self.folder = folder
        self.rank = rank
        self.world = world
        self._stack = stack

    def decide(self, fn):
        """``fn()`` run on rank 0 alone (it inspects the folder), its result given to every rank, its refusal
        raised on every rank (:func:`from_rank0`)."""
        if self.world > 1:
            return from_rank0(fn if self.rank == 0 else (lambda: None))
        return fn()

    def hold(self, context):
        """Enter ``context`` (another lock, say) until the folder is let go; returns what it gives."""
        return self._stack.enter_context(context)


@contextmanager
def run_folder(folder: str | Path, message: str, *, rank: int = 0, world: int = 1, shared: Optional[str] = None):
    """Hold the run folder ``folder`` while a command writes it; yields a :class:`HeldFolder`.

    ``shared``: first refuse a folder the nodes of a multi-node launch do not all see (:func:`check_shared_folder`;
    the word names it in the message). Then rank 0 takes the folder's lock (:func:`rank0_lock`, ``message`` when
    another command holds it); what rank 0 decides about the folder reaches every rank (:meth:`HeldFolder.decide`).
    A command that stops before writing anything (a refusal, an error, Ctrl-C) leaves no empty folder of its own
    making behind.
    """
    folder = Path(folder)
    made = rank == 0 and not folder.exists()
    try:
        if shared is not None:
            check_shared_folder(folder, shared)
        with rank0_lock(folder, message, rank, world), ExitStack() as stack:
            yield HeldFolder(folder, rank, world, stack)
    except BaseException:
        if made and folder.is_dir() and not any(folder.iterdir()):
            folder.rmdir()
        raise


# The records a run keeps beside its outputs (settings, manifests, round recipes): small JSON and YAML files.
RECORD_SUFFIXES = (".json", ".yaml")
RECORD_MAX_BYTES = 1 << 20


@contextmanager
def records_kept_on_refusal(folder: str | Path, depth: int = 3, main: bool = True):
    """A command that is refused (``UserError``) part-way leaves the records it found as it found them: the
    ``*.json`` / ``*.yaml`` files up to ``depth`` folders below ``folder`` are read first, and any a refused run
    changed are written back byte for byte (a rerun refused for a changed prompts file must not have rewritten
    the run's settings, a cache manifest or a round's recipe on its way to the refusal). Records it created are
    left: they describe the refused attempt and bind nothing until a stage behind them finished. ``main``: the
    process that writes the records (the others keep nothing)."""
    folder = Path(folder)
    found: dict[Path, bytes] = {}
    if main and folder.is_dir():
        for p in folder.rglob("*"):
            if (p.suffix in RECORD_SUFFIXES and len(p.relative_to(folder).parts) <= depth + 1 and p.is_file()
                    and not p.is_symlink() and p.stat().st_size <= RECORD_MAX_BYTES):
                found[p] = p.read_bytes()
    try:
        yield
    except UserError:
        for p, data in found.items():
            try:
                same = p.is_file() and p.read_bytes() == data
            except OSError:
                same = False
            if not same:
                atomic_write_bytes(p, data)
        raise
