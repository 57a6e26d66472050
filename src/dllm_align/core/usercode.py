"""Running code the user names (``package.module:function``: verifiers, rule judges) without letting it
take the command over.

What is contained, and how:

* **printing**: while the module is imported and while the function runs, ``sys.stdout`` is the
  command's stderr, so a result printed on stdout stays one document. (Writes to file descriptor 1
  itself, ``os.write(1, ...)`` or a child process, are not redirected.)
* **exiting**: ``sys.exit()`` / ``SystemExit`` at import is bad input (one ``Error:`` line, exit 2); inside
  the function it is a failure at run time (exit 1), whatever code it asked for. ``KeyboardInterrupt``
  is Ctrl-C and passes through (exit 130). ``os._exit`` ends the process and cannot be contained.
* **raising**: an exception at import (a syntax error included) is exit 2 naming the module; the caller
  decides what an exception inside the function is (:func:`call` re-raises it).
* **hanging**: the import and every call run under a wall-clock bound (:data:`IMPORT_SECONDS`,
  :func:`call_seconds`: ``DLLM_ALIGN_RULE_TIMEOUT`` seconds, 10 by default), enforced with ``SIGALRM``,
  which interrupts Python code, ``time.sleep`` and the ``re`` engine's backtracking alike; past it the
  call raises :class:`OverTime`, which stops the command with exit 1 naming the function unless the caller
  has an answer for a slow input (``label`` makes that row's verdict unsure). The bound needs the main thread of a POSIX process:
  elsewhere the code runs unbounded.

May import: the standard library only.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import os
import signal
import sys
import threading
from typing import Any, Callable, Optional

from dllm_align.core.console import warn
from dllm_align.core.errors import RunFailure, UserError

IMPORT_SECONDS = 30.0
_DEFAULT_CALL_SECONDS = 10.0


MIN_CALL_SECONDS = 0.01


def call_seconds() -> float:
    """The bound on one call of a user's function: ``DLLM_ALIGN_RULE_TIMEOUT`` seconds (10 by default)."""
    raw = os.environ.get("DLLM_ALIGN_RULE_TIMEOUT")
    if raw is None or raw == "":
        return _DEFAULT_CALL_SECONDS
    try:
        v = float(raw)
    except ValueError:
        v = -1.0
    # the floor: a bound far below any call's running time (1e-9 was taken) times every call out, and the run
    # labels every sample unsure only after sampling them all
    if not MIN_CALL_SECONDS <= v < 86400:
        raise UserError(f"DLLM_ALIGN_RULE_TIMEOUT={raw!r}: seconds, a number from {MIN_CALL_SECONDS} to below a day")
    return v


class TimedOut(BaseException):
    """Raised inside the user's code when its bound is spent (a BaseException: an ``except Exception`` in the
    user's code must not swallow it)."""


@contextlib.contextmanager
def bounded(seconds: Optional[float]):
    """Raise :class:`TimedOut` in this (main) thread after ``seconds``; a no-op off the main thread or without
    ``SIGALRM``, or when an outer bound is already running (it keeps its own deadline)."""
    usable = (seconds and hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()
              and signal.getitimer(signal.ITIMER_REAL)[0] == 0)
    if not usable:
        yield
        return

    def _alarm(signum, frame):
        raise TimedOut()

    old = signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


@contextlib.contextmanager
def _stdout_to_stderr():
    with contextlib.redirect_stdout(sys.stderr):
        yield


def _exit_code(e: SystemExit) -> str:
    return "sys.exit()" if e.code is None else f"sys.exit({e.code!r})"


SPEC_PROBLEM = ("expected package.module:function (a module importable from the Python path and a function in it; "
                "not a file path)")


def spec_problem(spec: Any) -> Optional[str]:
    """What is wrong with ``spec`` as ``package.module:function`` (a path such as ``../x:f`` or ``/etc/passwd:f``
    is not a module name), or None; nothing is imported."""
    if not isinstance(spec, str):
        return SPEC_PROBLEM
    mod, sep, attr = spec.partition(":")
    if not sep or not mod or not attr or not all(p.isidentifier() for p in mod.split(".")) or not attr.isidentifier():
        return SPEC_PROBLEM
    return None


def check_spec(spec: Any, label: str) -> tuple[str, str]:
    """``package.module:function`` split into (module, function), or one error naming ``label``."""
    problem = spec_problem(spec)
    if problem:
        raise UserError(f"{label}: {problem}", hint="e.g. my_rules:is_correct with my_rules.py in the working folder "
                        "(PYTHONPATH=.)")
    mod, _, attr = spec.partition(":")
    return mod, attr


def load_module(mod_name: str, label: str, *, announce: bool = False) -> Any:
    """Module ``mod_name`` imported under the bounds above (its prints to stderr, a hang, an exit or an exception
    one error naming ``label`` and the module); ``announce``: say on stderr whose code this is (a user's module
    named by a setting, e.g. ``DLLM_ALIGN_PLUGINS``). The one place code named at run time is imported."""
    try:
        with _stdout_to_stderr(), bounded(IMPORT_SECONDS):
            mod = importlib.import_module(mod_name)
    except TimedOut:
        raise RunFailure(f"{label}: importing module {mod_name!r} did not finish in {IMPORT_SECONDS:.0f} s") from None
    except ModuleNotFoundError as e:
        raise UserError(f"{label}: cannot import module {mod_name!r} ({e})") from None
    except SystemExit as e:
        raise UserError(f"{label}: module {mod_name!r} called {_exit_code(e)} while being imported",
                        hint="a module of rules or components defines them; it does not exit") from None
    except Exception as e:  # noqa: BLE001 - the user's module failed to import (SyntaxError included): say which
        raise UserError(f"{label}: importing module {mod_name!r} failed: {type(e).__name__}: {e}"[:400]) from None
    if announce:
        warn(f"{label}: importing your module {mod_name} from {getattr(mod, '__file__', None) or mod_name}")
    return mod


def load_function(spec: str, label: str, *, args: Optional[tuple] = None, what: str = "") -> tuple[Callable, str]:
    """The function ``spec`` names, imported under the bounds above, announced on stderr. ``args``: a sample
    call it must accept (its arity, checked before it ever runs; ``what`` says what it must take)."""
    mod_name, attr = check_spec(spec, label)
    mod = load_module(mod_name, label)
    f = getattr(mod, attr, None)
    if not callable(f):
        raise UserError(f"{label}: module {mod_name!r} has no function {attr!r}")
    if args is not None:
        try:
            inspect.signature(f).bind(*args)
        except TypeError:
            raise UserError(f"{label}: {attr}() must take {what or f'{len(args)} arguments'}") from None
        except ValueError:  # no signature to read (some builtins): its first call will tell
            pass
    # Code named by a flag or a recipe runs here: say whose.
    warn(f"{label}: running your function {attr}() from {getattr(mod, '__file__', None) or mod_name}")
    return f, attr


class OverTime(RunFailure):
    """A call that did not return within its bound (:func:`call`): a run-time failure, which a caller that has
    another answer for one slow input (a verifier's ``unsure``) may catch; ``seconds`` is the bound."""

    def __init__(self, message: str, seconds: float, hint: Optional[str] = None):
        super().__init__(message, hint=hint)
        self.seconds = seconds


def call(fn: Callable, args: tuple, label: str, where: str, *, seconds: Optional[float] = None) -> Any:
    """``fn(*args)`` with stdout sent to stderr, a ``sys.exit`` and a hang turned into one run-time failure
    naming ``label`` and ``where`` (:class:`OverTime` for a hang); exceptions are the caller's to describe."""
    limit = call_seconds() if seconds is None else seconds
    try:
        with _stdout_to_stderr(), bounded(limit):
            return fn(*args)
    except TimedOut:
        raise OverTime(f"{label} did not return within {limit:g} s on {where}", limit,
                       hint="make it faster, or raise the bound with DLLM_ALIGN_RULE_TIMEOUT=SECONDS") from None
    except SystemExit as e:
        raise RunFailure(f"{label} called {_exit_code(e)} on {where}; a rule returns its verdict, it does not exit") from None


def call_named(fn: Callable, args: tuple, label: str, name: str, where: str) -> Any:
    """:func:`call`, with an exception the function raised turned into one error naming ``label``, the function
    (``name``) and ``where`` instead of a bare ``ZeroDivisionError`` line."""
    try:
        return call(fn, args, label, where)
    except (RunFailure, UserError):
        raise
    except Exception as e:  # noqa: BLE001 - the user's function failed: say whose, not a traceback
        raise UserError(f"{label}: {name}() raised {type(e).__name__} on {where}: {e}"[:400]) from None
