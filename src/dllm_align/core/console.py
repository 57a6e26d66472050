"""Where output goes: results on stdout, everything else (logs, progress, errors) on stderr."""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from typing import Iterator

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

# Logs, warnings, progress bars. Rich turns colour and live bars off when
# stderr is not a terminal, so CI logs stay clean.
err = Console(stderr=True, highlight=False, soft_wrap=True)


def info(msg: str) -> None:
    err.print(msg, markup=False)


def warn(msg: str) -> None:
    err.print(f"Warning: {msg}", style="yellow", markup=False)


def result(text: str) -> None:
    """A result line on stdout (never decorated, safe to pipe)."""
    sys.stdout.write(text if text.endswith("\n") else text + "\n")
    sys.stdout.flush()


def global_rank() -> int:
    """This process's rank among all processes of all nodes (torchrun / accelerate set RANK); 0 alone."""
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def progress_enabled() -> bool:
    """Live bars on a terminal, from global rank 0 only: the first process of every other node also has
    LOCAL_RANK 0, and a bar per process (or per node) on a shared terminal or job log overwrites itself."""
    if os.environ.get("DLLM_ALIGN_NO_PROGRESS"):
        return False
    if global_rank() != 0:
        return False
    return err.is_terminal


@contextmanager
def progress(description: str, total: int | None, unit: str = "it") -> Iterator["_Bar"]:
    """A rich progress bar on stderr with a rate column; a no-op when not on a terminal."""
    if not progress_enabled():
        yield _Bar(None, None)
        return

    cols = [
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[rate]}"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        TextColumn("{task.fields[status]}"),
    ]
    with Progress(*cols, console=err, transient=False) as p:
        task = p.add_task(description, total=total, rate="", status="")
        yield _Bar(p, task, unit)


class _Bar:
    def __init__(self, p, task, unit: str = "it"):
        self._p, self._task, self._unit = p, task, unit

    def advance(self, n: float = 1, status: str | None = None) -> None:
        if self._p is None:
            return
        kw = {}
        if status is not None:
            kw["status"] = status
        self._p.advance(self._task, n)
        speed = self._p.tasks[self._task].speed
        if speed:
            kw["rate"] = f"{speed:.2f} {self._unit}/s"
        self._p.update(self._task, **kw)

    def update(self, status: str) -> None:
        if self._p is not None:
            self._p.update(self._task, status=status)
