"""Crash-safe file writing.

Whole files are written to a temporary file in the same folder, fsynced and
renamed over the target, so a kill leaves either the old file or the new one.
Append-only JSONL logs (generation, judging) are recovered on open: a torn last
line (a kill mid-write) is cut off, so finished records are never lost or
duplicated.
"""

from __future__ import annotations

import json
import os
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(str(path), os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextmanager
def atomic_path(target: str | Path, suffix: str = "") -> Iterator[Path]:
    """Yield a temporary path beside ``target``; rename it over ``target`` on success only."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=suffix + ".tmp", dir=target.parent)
    os.close(fd)
    # mkstemp creates 0600; give the file the mode an ordinary open() would (0666 minus umask).
    os.chmod(tmp, 0o666 & ~_umask())
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        with open(tmp_path, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp_path, target)
        _fsync_dir(target.parent)
    finally:
        if tmp_path.exists():
            tmp_path.unlink()


def atomic_write_bytes(target: str | Path, data: bytes) -> None:
    with atomic_path(target) as tmp:
        tmp.write_bytes(data)


def atomic_write_text(target: str | Path, text: str) -> None:
    atomic_write_bytes(target, text.encode("utf-8"))


def atomic_write_json(target: str | Path, obj: Any) -> None:
    atomic_write_text(target, json.dumps(obj, indent=2, ensure_ascii=False) + "\n")


def recover_jsonl(path: str | Path) -> list[dict]:
    """Read an append-only JSONL log, cutting off a torn (unterminated or unparsable) last line."""
    path = Path(path)
    if not path.exists():
        return []
    data = path.read_bytes()
    rows: list[dict] = []
    good_end = 0
    pos = 0
    while pos < len(data):
        nl = data.find(b"\n", pos)
        if nl < 0:
            break  # unterminated tail: a torn write
        line = data[pos:nl]
        try:
            if line.strip():
                rows.append(json.loads(line))
        except (json.JSONDecodeError, UnicodeDecodeError):
            break
        pos = nl + 1
        good_end = pos
    if good_end < len(data):
        with open(path, "rb+") as f:
            f.truncate(good_end)
            os.fsync(f.fileno())
    return rows


class JsonlAppender:
    """Append records one line at a time, flushed and fsynced, so a kill loses at most the line being written."""

    def __init__(self, path: str | Path, fsync: bool = True):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.path, "ab")
        self._fsync = fsync

    def write(self, row: dict) -> None:
        self._f.write((json.dumps(row, ensure_ascii=False) + "\n").encode("utf-8"))
        self._f.flush()
        if self._fsync:
            os.fsync(self._f.fileno())

    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> "JsonlAppender":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
