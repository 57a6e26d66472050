"""The root ``dllm-align`` app and the manners every command shares.

Every command is registered through :func:`command`, which turns known errors
into one ``Error: ...`` line on stderr (exit 2 for bad input, 1 for run-time
failures), Ctrl-C into exit 130, and shows a traceback only when
``DLLM_ALIGN_DEBUG=1``. Command modules import only typer and the recipe schema
(for the defaults --help shows) at module level; torch and transformers are
imported inside the command bodies.

Flags that set recipe keys reach the recipe one way: ``load_recipe(..., flags=given({...}))``
(validated by the schema with the recipe, errors naming the flag), their --help defaults
from the schema (:func:`schema_default`), and ``--set`` is :data:`SetOpt` everywhere.
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
import typing
from typing import Annotated, Any, Callable, Optional

import typer
from typer.core import TyperCommand, TyperGroup

from dllm_align import __version__
from dllm_align.config.schema import Recipe

def _flags_without_a_value(params: list) -> list:
    # An on/off flag takes no value: Typer would show it as `<bool>` (--help, --install-completion, ...) unless
    # its metavar is empty, as the project's own flags set it.
    for p in params:
        if getattr(p, "is_flag", False) and p.metavar is None:
            p.metavar = ""
    return params


class Command(TyperCommand):
    """A command whose help shows flags without a value as flags (see :func:`_flags_without_a_value`)."""

    def get_params(self, ctx):
        return _flags_without_a_value(super().get_params(ctx))


class Group(TyperGroup):
    """A command group whose help shows flags without a value as flags."""

    def get_params(self, ctx):
        return _flags_without_a_value(super().get_params(ctx))


app = typer.Typer(
    cls=Group,
    name="dllm-align",
    help="Align masked diffusion LMs (LLaDA, ...) with unpaired thumbs-up / thumbs-down feedback (ELBO-KTO).",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
    context_settings={"help_option_names": ["-h", "--help"], "show_default": True},
)


# The recipe argument every recipe-driven command takes.
RecipeArg = Annotated[
    str, typer.Argument(metavar="RECIPE", help="A bundled recipe name (see `dllm-align recipes list`) or a path to a YAML file.")
]


# --set, as every recipe-driven command takes it.
SetOpt = Annotated[
    Optional[list[str]],
    typer.Option("--set", "-s", metavar="KEY=VALUE", help="Override a recipe key, e.g. --set train.beta=0.2 (repeatable)."),
]


def given(flags: dict[str, tuple[str, Any]]) -> dict[str, tuple[str, Any]]:
    """The flags the user gave, for ``load_recipe(flags=...)``: dotted recipe key -> (flag, value). A flag
    left out is None; every other value (0, False, "") is given and goes to the schema as it is."""
    return {key: (flag, value) for key, (flag, value) in flags.items() if value is not None}


def schema_default(key: str) -> str:
    """How --help shows the default of a flag that sets recipe key ``key`` (dotted): the key, whose value in
    the recipe wins, and the schema's default."""
    section, _, name = key.partition(".")
    cls = Recipe.model_fields[section].annotation
    cls = next((a for a in typing.get_args(cls) if isinstance(a, type)), cls)  # Optional[Section]
    value = cls.model_fields[name].get_default(call_default_factory=True)
    return f"{key}, {', '.join(map(str, value)) if isinstance(value, list) else value}"


def _debug() -> bool:
    return os.environ.get("DLLM_ALIGN_DEBUG", "") not in ("", "0", "false", "False")


# An error line names what is wrong; a value the user gave may be any length (a 20,000-character name), so a run
# of characters past LONG_RUN without a space is shown by its head and tail.
LONG_RUN = 120


def _bounded(text: str) -> str:
    def word(w: str) -> str:
        return w if len(w) <= LONG_RUN else f"{w[:60]}...({len(w):,} characters)...{w[-20:]}"

    return "\n".join(" ".join(map(word, line.split(" "))) for line in text.split("\n"))


def _error_line(msg: str, hint: str | None = None) -> None:
    # Plain writes (no rich markup) so that file names with brackets print as they are; one line each.
    sys.stderr.write(f"Error: {_bounded(msg)}\n")
    if hint:
        sys.stderr.write(f"Hint: {_bounded(hint)}\n")
    sys.stderr.flush()


def check_environment() -> None:
    """The environment settings a command may read late (after the model loaded and every prompt was sampled),
    read and checked before it starts: a bad value is refused (exit 2) before any work or any folder."""
    from dllm_align.core.usercode import call_seconds

    call_seconds()


def handle_errors(fn: Callable) -> Callable:
    """Wrap a command body with the project's error manners."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        from dllm_align.core.errors import DllmAlignError
        from dllm_align.core.io import forget_inputs

        forget_inputs()  # each command guards its own inputs (io.check_not_input)
        try:
            check_environment()
            return fn(*args, **kwargs)
        except typer.Exit:
            raise
        except DllmAlignError as e:
            if _debug():
                raise
            _error_line(e.message, e.hint)
            raise typer.Exit(e.exit_code)
        except KeyboardInterrupt:
            sys.stderr.write("\nInterrupted.\n")
            raise typer.Exit(130)
        except BrokenPipeError:  # stdout piped into `head`: the reader went away, not an error to report
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            raise typer.Exit(1)
        except FileNotFoundError as e:
            if _debug():
                raise
            name = e.filename or str(e)
            _error_line(f"file not found: {name}")
            raise typer.Exit(2)
        except Exception as e:  # a bug, or a fault we did not foresee
            if _debug():
                raise
            from dllm_align.core.errors import lost_peer

            lost = lost_peer(e)
            if lost is not None:  # a node of a multi-node launch died: say so, not the backend's socket error
                _error_line(lost.message, lost.hint)
                raise typer.Exit(lost.exit_code)
            if isinstance(e, OSError) and e.filename is not None:
                # A write that failed outside our writers (a full disk under torch.save, ...):
                # name the user's file, not our temporary one.
                from dllm_align.core.io import user_path, writing_error

                err = writing_error(user_path(e.filename), e, verb="access")
                _error_line(err.message, err.hint)
                raise typer.Exit(err.exit_code)
            _error_line(
                f"{type(e).__name__}: {e}".splitlines()[0] if str(e) else type(e).__name__,
                "set DLLM_ALIGN_DEBUG=1 for the full traceback",
            )
            raise typer.Exit(1)

    return wrapper


def reflow(doc: str) -> str:
    """A docstring as help text: each prose paragraph on one logical line (the terminal wraps it), while
    paragraphs whose lines are a list or an indented block keep their line breaks."""
    out = []
    for para in inspect.cleandoc(doc or "").split("\n\n"):
        lines = para.split("\n")
        listed = any(line.startswith(("  ", "- ", "* ", "$ ")) for line in lines[1:])
        out.append(para if listed else " ".join(line.strip() for line in lines))
    return "\n\n".join(out)


def command(name: str | None = None, *, group: typer.Typer | None = None, **kwargs) -> Callable:
    """Register ``fn`` as a command of ``group`` (default: the root app) with the error manners; its
    docstring becomes the help, reflowed. (Boolean flags pass ``metavar=""``, so that the help shows them as
    flags rather than with a ``<bool>`` value.)"""

    def deco(fn: Callable) -> Callable:
        kwargs.setdefault("help", reflow(fn.__doc__ or ""))
        kwargs.setdefault("cls", Command)
        (group or app).command(name, **kwargs)(handle_errors(fn))
        return fn

    return deco


def _version(value: bool) -> None:
    if value:
        typer.echo(f"dllm-align {__version__}")
        raise typer.Exit()


@app.callback()
def root(
    version: Annotated[
        Optional[bool],
        typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.", metavar=""),
    ] = None,
) -> None:
    """dllm-align: ELBO-KTO for masked diffusion language models.

    Every command that takes a RECIPE accepts a bundled recipe name (see
    `dllm-align recipes list`) or a path to a YAML file.
    """


# Command modules register themselves on import. They must stay light (no torch at import).
from dllm_align.cli import recipes as _recipes  # noqa: E402,F401
from dllm_align.cli import convert as _convert  # noqa: E402,F401
from dllm_align.cli import data as _data  # noqa: E402,F401
from dllm_align.cli import judge as _judge  # noqa: E402,F401
from dllm_align.cli import evaluate as _evaluate  # noqa: E402,F401
from dllm_align.cli import generate as _generate  # noqa: E402,F401
from dllm_align.cli import precompute_ref as _precompute_ref  # noqa: E402,F401
from dllm_align.cli import train as _train  # noqa: E402,F401
from dllm_align.cli import demo as _demo  # noqa: E402,F401
from dllm_align.cli import ablate as _ablate  # noqa: E402,F401
from dllm_align.cli import doctor as _doctor  # noqa: E402,F401
from dllm_align.cli import label as _label  # noqa: E402,F401
from dllm_align.cli import online as _online  # noqa: E402,F401
from dllm_align.cli import serve as _serve  # noqa: E402,F401
from dllm_align.cli import parity as _parity  # noqa: E402,F401


def _usage_error(e: Exception) -> Optional[int]:
    """Print a command-line usage error (unknown option, bad value, missing argument)
    as one ``Error:`` line plus a hint, like every other error; returns its exit code.

    Typer's usage errors come from its vendored Click; they are recognised by their
    public shape (``exit_code`` and ``format_message()``) rather than by importing
    Click's classes.
    """
    fmt = getattr(e, "format_message", None)
    code = getattr(e, "exit_code", None)
    if not callable(fmt) or not isinstance(code, int):
        return None
    msg = " ".join(str(fmt()).split())
    if msg:  # empty when the help was shown instead (no arguments at all)
        ctx = getattr(e, "ctx", None)
        path = getattr(ctx, "command_path", None) or "dllm-align"
        _error_line(msg, f"see '{path} --help'")
    return code


def _close_process_group() -> None:
    """Tear down a torch.distributed group the command opened (torchrun / accelerate launches).

    Left to the interpreter's exit, gloo's worker threads are destroyed while still
    joinable and a rank can abort ("terminate called without an active exception")
    after its work is done, failing the whole launch.
    """
    dist = sys.modules.get("torch.distributed")  # never import torch here (--help stays fast)
    if dist is None:
        return
    try:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - best effort at exit; the command's result stands
        pass


def main(argv: Optional[list[str]] = None) -> None:
    """The ``dllm-align`` console script (and ``python -m dllm_align``)."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        try:
            rv = app(args=argv, prog_name="dllm-align", standalone_mode=False)
        finally:
            _close_process_group()
    except KeyboardInterrupt:  # Ctrl-C outside a command body (e.g. while parsing)
        sys.stderr.write("\nInterrupted.\n")
        sys.exit(130)
    except typer.Abort:
        sys.stderr.write("\nAborted.\n")
        sys.exit(1)
    except BrokenPipeError:  # `dllm-align ... | head`: the reader went away
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(1)
    except Exception as e:
        if _debug():
            raise
        code = _usage_error(e)
        if code is None:
            raise
        sys.exit(code)
    sys.exit(rv if isinstance(rv, int) else 0)


if __name__ == "__main__":
    main()
