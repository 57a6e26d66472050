"""Crash-safe file writing.

Whole files are written to a temporary file in the same folder, fsynced and
renamed over the target, so a kill leaves either the old file or the new one.
A temporary file left by a killed writer (its name carries the writer's host
and process id) is removed the next time the same target is written. Folders
(checkpoints, the final model) are written under a temporary name, fsynced
file by file (:func:`fsync_tree`) and renamed into place.

Append-only JSONL logs (generation, judging, training metrics) are recovered on
open: a torn last line (a kill mid-write) is cut off, so finished records are
never lost or duplicated. A damaged line *followed by good lines* is not a torn
write: it is refused, never cut away with the good lines after it.
"""

from __future__ import annotations

import errno
import hashlib
import json
import math
import os
import re
import socket
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

try:
    import fcntl
except ImportError:  # not on this platform: the locks below are best effort and lock nothing
    fcntl = None

from dllm_align.core import faults
from dllm_align.core.errors import RunFailure, UserError


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def fsync_dir(path: Path) -> None:
    """Flush ``path``'s entries (a file renamed or made in it) to disk; best effort: a folder that cannot be
    opened or synced is left as it is."""
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


def _host_tag() -> str:
    return hashlib.sha256(socket.gethostname().encode("utf-8")).hexdigest()[:8]


_WRITER_RE = re.compile(r"^([0-9a-f]{8})-([0-9]+)$")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def remove_stale_temps(target: str | Path) -> list[Path]:
    """Delete temporary files of ``target`` left by writers that were killed.

    Only files written on this host by a process that no longer exists are
    removed: a live writer's file (another process of the same run) is never
    touched, and files from other hosts on a shared filesystem are left alone.
    """
    target = Path(target)
    prefix = f".{target.name}."
    removed = []
    try:
        entries = list(os.scandir(target.parent))
    except OSError:
        return removed
    tag = _host_tag()
    for e in entries:
        if not (e.name.startswith(prefix) and e.name.endswith(".tmp")):
            continue
        m = _WRITER_RE.match(e.name[len(prefix):].split(".", 1)[0])
        if m is None or m.group(1) != tag or _pid_alive(int(m.group(2))):
            continue
        try:
            os.unlink(e.path)
            removed.append(Path(e.path))
        except OSError:
            pass
    return removed


# --------------------------------------------------------------------------- inputs are never outputs
# Every file a command reads as data (prompts, training rows, generations to judge,
# a recipe) is noted here; every writer below refuses to write, append to or
# delete a noted file. One guard for all commands, instead of one check per flag.
_INPUTS: dict[str, str] = {}


def _key(path: str | Path) -> str:
    return os.path.realpath(os.path.expanduser(str(path)))


def note_input(path: str | Path, what: str = "input") -> None:
    """Remember that the running command reads ``path`` (a file or a folder of data)."""
    _INPUTS.setdefault(_key(path), what)


def forget_inputs() -> None:
    """Start a new command with no noted inputs (the CLI calls this before each command)."""
    _INPUTS.clear()


def check_not_input(target: str | Path) -> None:
    """Refuse (UserError) to write over one of the running command's inputs."""
    if not _INPUTS:
        return
    key = _key(target)
    what = _INPUTS.get(key)
    if what is None:
        return

    raise UserError(
        f"{target} is one of this command's inputs ({what}); refusing to overwrite the input",
        hint="choose another output path (see the command's --output / -o)",
    )


def writing_error(target: str | Path, e: OSError, verb: str = "write"):
    """One clear error naming the user's path (never our temporary file) for a failed write."""
    target = Path(target)
    if isinstance(e, IsADirectoryError) or (target.is_dir() and not isinstance(e, FileNotFoundError)):
        return UserError(f"cannot {verb} {target}: it is a folder", hint="give a file name")
    if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return UserError(f"cannot {verb} {target}: permission denied or read-only filesystem",
                         hint="choose a writable location")
    if e.errno == errno.ENOSPC or e.errno == errno.EDQUOT:
        return RunFailure(f"cannot {verb} {target}: no space left on the device (or over quota); nothing was replaced",
                          hint="free some space and run the command again")
    if isinstance(e, (NotADirectoryError, FileExistsError)) or e.errno in (errno.ENOTDIR, errno.EEXIST):
        # mkdir of the run folder (or a folder above it) found a file in the way
        blocker = next((p for p in [target, *target.parents] if p.exists() and not p.is_dir()), None)
        where = f"{blocker} is a file, not a folder" if blocker is not None else "a part of its folder path is a file"
        return UserError(f"cannot {verb} {target}: {where}", hint="choose another run folder (-o) or output path")
    return RunFailure(f"cannot {verb} {target}: {e.strerror or type(e).__name__}")


_DISK_FULL_MARKS = ("No space left", "Errno 28", "code: 28", "unexpected pos", "file write failed", "Disk quota")


@contextmanager
def disk_errors(target: str | Path, verb: str = "write") -> Iterator[None]:
    """Inside, a failed write is one clear error naming ``target`` (:func:`writing_error`): also the
    ones that libraries report without an errno (safetensors' ``SafetensorError``, torch.save's
    ``RuntimeError: [enforce fail at inline_container.cc] . unexpected pos``) when they mean a full disk."""
    try:
        yield
    except OSError as e:
        raise writing_error(target, e, verb) from e
    except Exception as e:  # noqa: BLE001 - only recognised disk-full errors are translated
        if any(mark in str(e) for mark in _DISK_FULL_MARKS):
            raise writing_error(target, OSError(errno.ENOSPC, "No space left on device"), verb) from e
        raise


def user_path(name: str | Path) -> Path:
    """The file the user named, for a path that may be one of our temporary files
    (``DIR/.NAME.<host>-<pid>.XXXX.tmp`` -> ``DIR/NAME``)."""
    p = Path(name)
    m = re.match(r"^\.(.+)\.[0-9a-f]{8}-[0-9]+\..*\.tmp$", p.name)
    return p.with_name(m.group(1)) if m else p


@contextmanager
def atomic_path(target: str | Path, suffix: str = "") -> Iterator[Path]:
    """Yield a temporary path beside ``target``; rename it over ``target`` on success only.

    Refuses to replace one of the command's inputs; an OS error (a folder in the
    way, a read-only or full disk) becomes one error naming ``target``.
    """
    target = Path(target)
    check_not_input(target)
    if target.is_dir():
        raise writing_error(target, IsADirectoryError(target))
    tmp_path: Path | None = None
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_temps(target)
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.{_host_tag()}-{os.getpid()}.", suffix=suffix + ".tmp", dir=target.parent)
        os.close(fd)
        # mkstemp creates 0600; give the file the mode an ordinary open() would (0666 minus umask).
        os.chmod(tmp, 0o666 & ~_umask())
        tmp_path = Path(tmp)
        yield tmp_path
        with open(tmp_path, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp_path, target)
        fsync_dir(target.parent)
    except OSError as e:
        # Only faults of this write are ours to name; another file's error (read inside
        # the block) passes through unchanged.
        mine = (None, str(target), str(target.parent)) + ((str(tmp_path),) if tmp_path else ())
        if getattr(e, "filename", None) not in mine and not str(getattr(e, "filename", "")).startswith(str(target.parent / f".{target.name}.")):
            raise
        raise writing_error(target, e) from None
    finally:
        if tmp_path is not None and tmp_path.exists():
            tmp_path.unlink()


def fsync_tree(folder: str | Path) -> None:
    """fsync every file under ``folder`` and the folders themselves (before renaming it into place)."""
    folder = Path(folder)
    for root, dirs, files in os.walk(folder):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(root))


def atomic_write_bytes(target: str | Path, data: bytes) -> None:
    with atomic_path(target) as tmp:
        tmp.write_bytes(data)


def atomic_write_text(target: str | Path, text: str) -> None:
    atomic_write_bytes(target, text.encode("utf-8"))


def finite_json(obj: Any, path: str = "") -> tuple[Any, dict[str, str]]:
    """``obj`` with every float that JSON cannot hold (NaN, +-Infinity) replaced by None, and where each was
    (dotted path -> ``nan``, ``inf`` or ``-inf``): strict JSON for every reader, the reason kept beside it."""
    found: dict[str, str] = {}

    def walk(o: Any, where: str) -> Any:
        if isinstance(o, float) and not math.isfinite(o):
            found[where or "(top level)"] = "nan" if o != o else ("inf" if o > 0 else "-inf")
            return None
        if isinstance(o, dict):
            return {k: walk(v, f"{where}.{k}" if where else str(k)) for k, v in o.items()}
        if isinstance(o, (list, tuple)):
            return [walk(v, f"{where}[{i}]") for i, v in enumerate(o)]
        return o

    return walk(obj, path), found


def strict_json(obj: Any, **kw) -> str:
    """``json.dumps`` that never writes NaN or Infinity (they become null, :func:`finite_json`)."""
    return json.dumps(finite_json(obj)[0], allow_nan=False, **kw)


def atomic_write_json(target: str | Path, obj: Any) -> None:
    atomic_write_text(target, strict_json(obj, indent=2, ensure_ascii=False) + "\n")


def _parse_line(line: bytes) -> Any:
    """A JSON object from one log line; raises ValueError for anything else."""
    try:
        obj = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
        raise ValueError("not JSON") from None
    if not isinstance(obj, dict):
        raise ValueError("not a JSON object")
    return obj


def recover_jsonl(path: str | Path) -> list[dict]:
    """Read an append-only JSONL log, cutting off a torn last line (a kill mid-write).

    Only a damaged *tail* is cut: an unterminated last line, or bad lines with no
    good line after them (a crash can leave zero bytes at the end of a file). A
    damaged line with good lines after it means the file was edited or corrupted
    otherwise; cutting there would drop the good records, so it is refused
    (:class:`~dllm_align.core.errors.UserError` naming the line).
    """
    path = Path(path)
    if not path.exists():
        return []
    data = path.read_bytes()
    rows: list[dict] = []
    good_end = 0
    pos = 0
    lineno = 0
    while pos < len(data):
        nl = data.find(b"\n", pos)
        if nl < 0:
            break  # unterminated tail: a torn write
        lineno += 1
        line = data[pos:nl]
        if line.strip():
            try:
                rows.append(_parse_line(line))
            except ValueError:
                if _any_good_line(data[nl + 1:]):
                    raise UserError(
                        f"{path}:{lineno}: damaged line in the middle of an append-only log (good lines follow it)",
                        hint="a kill can only tear the last line: the file was edited or damaged; "
                        "delete that line, or move the file away to start afresh",
                    ) from None
                break
        pos = nl + 1
        good_end = pos
    if good_end < len(data):
        with open(path, "rb+") as f:
            f.truncate(good_end)
            os.fsync(f.fileno())
    return rows


def _any_good_line(data: bytes) -> bool:
    for line in data.split(b"\n")[:-1]:  # newline-terminated lines only
        if line.strip():
            try:
                _parse_line(line)
                return True
            except ValueError:
                pass
    return False


class JsonlAppender:
    """Append records one line at a time, flushed and fsynced, so a kill loses at most the line being written."""

    def __init__(self, path: str | Path, fsync: bool = True):
        self.path = Path(path)
        check_not_input(self.path)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._f = open(self.path, "ab")
        except OSError as e:
            raise writing_error(self.path, e) from None
        self._fsync = fsync

    def write(self, row: dict) -> None:
        data = (json.dumps(row, ensure_ascii=False) + "\n").encode("utf-8")
        n = faults.next_record()
        if n and faults.armed("kill_mid_record", n):
            self._f.write(data[: len(data) // 2])
            self._f.flush()
            os.fsync(self._f.fileno())
            faults.kill()
        try:
            self._f.write(data)
            self._f.flush()
            if self._fsync:
                os.fsync(self._f.fileno())
        except OSError as e:
            raise writing_error(self.path, e) from None
        if n:
            faults.at("kill_after_records", n)

    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> "JsonlAppender":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# --------------------------------------------------------------------------- folder checksums
CHECKSUMS = "checksums.json"
CHECKSUMS_FORMAT = "dllm-align-checksums/1"


def sha256_file(path: str | Path, bufsize: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            chunk = f.read(bufsize)
            if not chunk:
                break
            h.update(chunk)
    return h.hexdigest()


def write_checksums(folder: str | Path) -> Path:
    """Record the size and sha256 of every file under ``folder`` in ``folder/checksums.json``.

    Written last into a folder that is then renamed into place (checkpoints, the
    final model), so a folder with a valid checksums file is complete.
    """
    folder = Path(folder)
    files = {}
    for p in sorted(folder.rglob("*")):
        if p.is_file() and p.name != CHECKSUMS:
            rel = p.relative_to(folder).as_posix()
            files[rel] = {"size": p.stat().st_size, "sha256": sha256_file(p)}
    atomic_write_json(folder / CHECKSUMS, {"format": CHECKSUMS_FORMAT, "files": files})
    return folder / CHECKSUMS


def verify_checksums(folder: str | Path, *, what: str = "folder", required: bool = True, hint: str | None = None) -> bool:
    """Check every file listed in ``folder/checksums.json`` (size, then sha256).

    Raises :class:`~dllm_align.core.errors.UserError` naming the first file that is
    missing, truncated or modified. Returns False when there is no checksums
    file and ``required`` is off (a folder written by another tool).
    """
    folder = Path(folder)
    path = folder / CHECKSUMS
    if not path.is_file():
        if required:
            raise UserError(f"{what} {folder}: no {CHECKSUMS}, so its files cannot be verified (incomplete, or not written by dllm-align)", hint=hint)
        return False
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        files = data["files"]
        if data.get("format") != CHECKSUMS_FORMAT or not isinstance(files, dict):
            raise ValueError
        entries = [(str(k), int(v["size"]), str(v["sha256"])) for k, v in files.items()]
    except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError):
        raise UserError(f"{what} {folder}: {CHECKSUMS} is damaged (not the expected JSON)", hint=hint) from None
    root = folder.resolve()
    for rel, size, sha in entries:
        p = (folder / rel)
        if root not in p.resolve().parents:
            raise UserError(f"{what} {folder}: {CHECKSUMS} names a file outside the folder ({rel})", hint=hint)
        if not p.is_file():
            raise UserError(f"{what} {folder}: {rel} is missing", hint=hint)
        have = p.stat().st_size
        if have != size:
            raise UserError(f"{what} {folder}: {rel} is {have:,} bytes but was written with {size:,} (truncated or modified)", hint=hint)
        if sha256_file(p) != sha:
            raise UserError(f"{what} {folder}: {rel} does not match its sha256 checksum (modified or damaged)", hint=hint)
    return True


# --------------------------------------------------------------------------- one writer per folder
class DirLock:
    """An exclusive lock on a folder (``flock`` on the folder itself, so no lock file is left behind).

    Two runs writing into one folder would interleave their logs and repeat work;
    the second one is refused with ``message``. Best effort: a no-op where
    ``flock`` is unavailable (non-POSIX, some network filesystems).
    """

    def __init__(self, folder: str | Path, message: str, *, shared: bool = False):
        self.folder = Path(folder)
        self.message = message
        # shared: a reader that must not see the folder replaced under it (train reading its reference
        # cache); any number of readers, but no writer (precompute-ref takes the exclusive lock).
        self.shared = shared
        self._fd: int | None = None

    def __enter__(self) -> "DirLock":
        if fcntl is None:
            return self
        if self.shared and not self.folder.is_dir():
            return self  # nothing to read yet: nothing to protect
        self.folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(str(self.folder), os.O_RDONLY)
        try:
            fcntl.flock(fd, (fcntl.LOCK_SH if self.shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)

            raise UserError(self.message) from None
        except OSError:  # the filesystem does not support locks: carry on unlocked
            os.close(fd)
            return self
        self._fd = fd
        return self

    def __exit__(self, *exc) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class FileLock:
    """An exclusive lock on one output file (``flock`` on the file itself), for outputs that
    several runs could share a folder with (``generate``): a second writer of the same
    file is refused with ``message``. Creates the file if needed; :meth:`release` removes
    it again when it was created here and is still empty (a refused or failed run leaves
    nothing behind). Best effort where ``flock`` is unavailable, like :class:`DirLock`.
    """

    def __init__(self, path: str | Path, message: str):
        self.path = Path(path)
        self.message = message
        self._fd: int | None = None
        self.created = False

    def __enter__(self) -> "FileLock":
        check_not_input(self.path)
        if fcntl is None:
            return self
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.created = not self.path.exists()
            fd = os.open(str(self.path), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o666)
        except OSError as e:
            raise writing_error(self.path, e) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)

            raise UserError(self.message, hint="wait for the other run to finish, or write to another file") from None
        except OSError:
            os.close(fd)
            return self
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            if self.created and self.path.exists() and self.path.stat().st_size == 0:
                self.path.unlink()
        except OSError:
            pass
        os.close(self._fd)
        self._fd = None

    def __exit__(self, *exc) -> None:
        self.release()


@contextmanager
def waiting_lock(path: str | Path, timeout_s: float, what: str) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path`` (created if needed), waiting at most ``timeout_s`` seconds for the
    process that holds it (one download per node: the others wait, then find the files in place). Waiting longer
    is a :class:`RunFailure` naming ``what``. Best effort where ``flock`` is unavailable: no lock."""
    path = Path(path)
    if fcntl is None:
        yield
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(str(path), os.O_WRONLY | os.O_CREAT, 0o666)
    except OSError:
        yield
        return
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise RunFailure(f"waited {timeout_s:.0f} s for another process's {what} to finish",
                                     hint=f"if no other process is running, remove {path}") from None
                time.sleep(0.2)
            except OSError:  # no locks on this filesystem
                break
        yield
    finally:
        os.close(fd)
