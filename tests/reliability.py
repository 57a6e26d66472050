"""Helpers for the reliability suite (tests/test_reliability_*.py).

* :func:`run_cli` runs ``dllm_align.cli.app.main`` (the console script) in this
  process and captures its stdout / stderr / exit code, or the exception that
  would have printed a traceback.
* :func:`run_killed` forks, runs the CLI in the child with
  ``DLLM_ALIGN_FAULT`` set, and returns how the child ended. The child is a
  real process killed with a real SIGKILL (no ``finally``, no exit handlers, as
  on a pre-empted node); forking skips the ~8 s import of torch and
  transformers that a fresh interpreter would pay for each kill.
* :func:`files_under`, :func:`snapshot`, :func:`stray_temps`: what a run left on disk.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import signal
import sys
import tempfile
import time
import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Optional


@dataclass
class Run:
    code: int  # exit code; -9 when killed by SIGKILL
    out: str
    err: str
    exc: Optional[BaseException] = None  # DLLM_ALIGN_DEBUG=1: the exception that escaped main()

    @property
    def traceback(self) -> str:
        if self.exc is None:
            return ""
        return "".join(traceback.format_exception(type(self.exc), self.exc, self.exc.__traceback__))


@contextlib.contextmanager
def _env(extra: dict):
    old = {k: os.environ.get(k) for k in extra}
    try:
        for k, v in extra.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def run_cli(args: list, env: Optional[dict] = None, cwd: Optional[Path] = None) -> Run:
    """``dllm-align ARGS`` through the console entry point, in this process."""
    from dllm_align.cli.app import main

    out, err = io.StringIO(), io.StringIO()
    code, exc = 0, None
    env = {"DLLM_ALIGN_DEBUG": None, "DLLM_ALIGN_FAULT": None, **(env or {})}
    old_cwd = os.getcwd()
    with _env(env), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            if cwd is not None:
                os.chdir(cwd)
            main([str(a) for a in args])
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException as e:  # noqa: BLE001 - what the interpreter would print as a traceback
            code, exc = 1, e
        finally:
            os.chdir(old_cwd)
    return Run(code, out.getvalue(), err.getvalue(), exc)


def run_killed(args: list, fault: str, env: Optional[dict] = None, timeout: float = 180.0) -> Run:
    """Run the CLI in a forked child with ``DLLM_ALIGN_FAULT=fault``; returns code -9 if it was SIGKILLed."""
    import torch

    fd_out, p_out = tempfile.mkstemp(prefix="rel-out-")
    fd_err, p_err = tempfile.mkstemp(prefix="rel-err-")
    sys.stdout.flush()
    sys.stderr.flush()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # "multi-threaded process": the child only uses its own
        pid = os.fork()
    if pid == 0:  # the child: never return into pytest
        code = 70
        try:
            os.dup2(fd_out, 1)
            os.dup2(fd_err, 2)
            sys.stdout = io.TextIOWrapper(os.fdopen(1, "wb", closefd=False), write_through=True)
            sys.stderr = io.TextIOWrapper(os.fdopen(2, "wb", closefd=False), write_through=True)
            os.environ.update({"DLLM_ALIGN_FAULT": fault, "DLLM_ALIGN_NO_PROGRESS": "1", **(env or {})})
            os.environ.pop("DLLM_ALIGN_DEBUG", None)
            torch.set_num_threads(1)
            from dllm_align.cli.app import main

            try:
                main([str(a) for a in args])
                code = 0
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else 1
        except BaseException:  # noqa: BLE001
            traceback.print_exc()
            code = 71
        finally:
            try:
                sys.stdout.flush()
                sys.stderr.flush()
            finally:
                os._exit(code)
    os.close(fd_out)
    os.close(fd_err)
    deadline = time.monotonic() + timeout
    status = None
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.02)
    else:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        raise TimeoutError(f"dllm-align {' '.join(map(str, args))} with {fault} ran over {timeout} s")
    code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
    out, err = Path(p_out).read_text(errors="replace"), Path(p_err).read_text(errors="replace")
    os.unlink(p_out)
    os.unlink(p_err)
    return Run(code, out, err)


def files_under(*roots: Path) -> list[Path]:
    return sorted(p for r in roots if Path(r).exists() for p in Path(r).rglob("*") if p.is_file())


def snapshot(root: Path) -> dict[str, str]:
    """relative path -> sha256 of every file under ``root`` (empty if it does not exist)."""
    root = Path(root)
    if root.is_file():
        return {root.name: hashlib.sha256(root.read_bytes()).hexdigest()}
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest() for p in files_under(root)}


def stray_temps(*roots: Path) -> list[str]:
    """Temporary files or folders a crash could leave: ``*.tmp`` files, ``.tmp-*`` folders, ``*.part*`` logs."""
    found = []
    for r in roots:
        r = Path(r)
        if not r.exists():
            continue
        for p in r.rglob("*"):
            if p.name.endswith(".tmp") or p.name.startswith(".tmp-") or ".part" in p.name:
                found.append(str(p.relative_to(r)))
    return sorted(found)


if __name__ == "__main__":  # python tests/reliability.py --round 4 [...]: an adversarial round as a table
    args = sys.argv[1:]
    if args[:2] != ["--round", "4"]:
        sys.exit("usage: python tests/reliability.py --round 4 [--fast] [-k SUBSTRING] [--markdown FILE] [--json FILE]")
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from round4 import main

    sys.exit(main(args[2:]))
