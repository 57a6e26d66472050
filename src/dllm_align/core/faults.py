"""Crash injection for the reliability tests: ``DLLM_ALIGN_FAULT=KIND:N[,KIND:N...]``.

A pre-empted GPU node does not get to run ``finally`` blocks, so the tests make
the process SIGKILL itself at chosen points and check that a rerun (or
``--resume``) ends exactly where an uninterrupted run ends. The points:

``kill_after_records:N``
    right after the N-th record of this process is durably written: a line of
    an append-only log (generations, judgements, training metrics) or a
    reference-cache shard;
``kill_mid_record:N``
    in the middle of writing the N-th record: half of the log line is on disk
    (a torn line), or the shard's temporary file is written but not renamed;
``kill_at:POINT``
    at a named point: ``batch_before_upload``, ``batch_after_upload`` (the file is
    on the server, its id not yet recorded), ``batch_after_create`` (the batch
    exists, its id not yet recorded), ``batch_polling`` (after the second poll),
    ``batch_downloading`` (results on disk, not yet cached);
``kill_after_step:N`` / ``kill_in_checkpoint:N`` / ``kill_in_final``
    training: after optimiser step N, halfway through writing checkpoint N,
    or after the final model folder is written but before it is renamed.

Without the variable every hook is a no-op costing one dictionary lookup.
"""

from __future__ import annotations

import os
import signal

ENV = "DLLM_ALIGN_FAULT"

# Records written by this process; reset in a forked child (it counts its own).
_count = {"pid": -1, "n": 0}


def _specs() -> set[str]:
    spec = os.environ.get(ENV, "")
    return {s.strip() for s in spec.split(",") if s.strip()} if spec else set()


def armed(kind: str, n: int | str | None = None) -> bool:
    """Whether ``DLLM_ALIGN_FAULT`` asks for ``kind`` (at ``n``, when given)."""
    specs = _specs()
    return (kind if n is None else f"{kind}:{n}") in specs


def kill() -> None:
    """Die as a pre-empted job does: SIGKILL, no cleanup, no exit handlers."""
    os.kill(os.getpid(), signal.SIGKILL)


def at(kind: str, n: int | str | None = None) -> None:
    """SIGKILL this process if ``kind[:n]`` is armed."""
    if os.environ.get(ENV) and armed(kind, n):
        kill()


def next_record() -> int:
    """Number (1-based) of the record this process is about to write; 0 when no fault is armed."""
    if not os.environ.get(ENV):
        return 0
    pid = os.getpid()
    if _count["pid"] != pid:
        _count["pid"], _count["n"] = pid, 0
    _count["n"] += 1
    return _count["n"]
