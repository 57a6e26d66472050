"""Errors the CLI turns into one ``Error: ...`` line and an exit code.

``UserError`` (exit 2) is for anything the user can fix: a malformed row, an
unknown recipe key, a missing file, a cache made for another model.
``RunFailure`` (exit 1) is for faults at run time: a NaN loss, an API that kept
failing. Anything else is a bug and gets a traceback with ``DLLM_ALIGN_DEBUG=1``.
"""

from __future__ import annotations

import os
import sys


class DllmAlignError(Exception):
    exit_code = 1

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint


class UserError(DllmAlignError):
    """Bad input, recipe, argument or file: exit code 2."""

    exit_code = 2


class RunFailure(DllmAlignError):
    """A failure while running (numerical fault, remote service): exit code 1."""

    exit_code = 1


# What gloo and NCCL say when a peer of the process group went away (its sockets closed, or silent past
# the timeout): matched on the text, because the backends raise plain RuntimeError / DistBackendError.
_PEER_LOST = (
    "connection reset by peer", "connection closed by peer", "connection refused", "broken pipe",
    "read error", "write error", "socket closed", "timed out", "timeout", "ncclremoteerror",
    "ncclsystemerror", "nccl communicator was aborted", "watchdog caught collective operation timeout",
    "some nccl operations have failed or timed out",
)


def lost_peer(exc: BaseException) -> "RunFailure | None":
    """The one-line RunFailure for a collective that failed because another node or process of a multi-process
    launch stopped (or stopped answering); None for anything else, or outside such a launch."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not (dist.is_available() and dist.is_initialized()):
        return None
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
    except Exception:  # noqa: BLE001 - a group torn down half-way
        rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    if world < 2 or not isinstance(exc, RuntimeError):
        return None
    text = str(exc).lower()
    from_backend = "gloo" in text or "nccl" in text or type(exc).__name__ == "DistBackendError"
    if not from_backend or not any(k in text for k in _PEER_LOST):
        return None
    others = f"rank {1 - rank}" if world == 2 else f"one of the other {world - 1} ranks"
    what = "stopped answering" if "time" in text and "out" in text else "stopped"
    detail = " ".join(str(exc).split())
    detail = detail if len(detail) <= 160 else detail[:157] + "..."
    return RunFailure(
        f"another node or process of this launch {what} ({others}; this is rank {rank} of {world}): "
        f"the collective failed with: {detail}",
        hint="see that node's log for why it stopped; a run with checkpoints continues with --resume on every node",
    )
