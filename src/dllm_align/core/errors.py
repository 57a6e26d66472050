"""Errors the CLI turns into one ``Error: ...`` line and an exit code.

``UserError`` (exit 2) is for anything the user can fix: a malformed row, an
unknown recipe key, a missing file, a cache made for another model.
``RunFailure`` (exit 1) is for faults at run time: a NaN loss, an API that kept
failing. Anything else is a bug and gets a traceback with ``DLLM_ALIGN_DEBUG=1``.
"""

from __future__ import annotations


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
