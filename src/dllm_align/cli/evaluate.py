"""``dllm-align evaluate``: downstream benchmarks through lm-evaluation-harness (paper Table 4).

Only typer, the standard library, cli.app and the recipe schema are imported at module level; the rest
inside the command body, so that `dllm-align --help` loads neither torch nor transformers.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated, Optional

import typer

from dllm_align.cli.app import SetOpt, command, given

HINT_INSTALL = "install the optional extra: pip install 'dllm-align[eval]'"


def _split(tasks: Optional[str]) -> Optional[list[str]]:
    if tasks is None:
        return None
    out = [t.strip() for t in tasks.split(",") if t.strip()]
    return out or None


def _require_harness():
    from dllm_align.core.errors import UserError

    try:
        import lm_eval  # noqa: F401
    except ImportError:
        raise UserError("lm-evaluation-harness (lm-eval) is not installed", hint=HINT_INSTALL) from None


@command("evaluate")
def evaluate(
    recipe: Annotated[str, typer.Argument(metavar="RECIPE", help="A bundled recipe name (e.g. table4_downstream) or a YAML file.")],
    model: Annotated[
        Optional[str], typer.Option("--model", "-m", metavar="MODEL", help="Checkpoint to evaluate (default: the recipe's model.name_or_path).")
    ] = None,
    compare: Annotated[
        Optional[str],
        typer.Option("--compare", "-c", metavar="MODEL", help="A second checkpoint, evaluated the same way and shown side by side (default: evaluate.compare)."),
    ] = None,
    tasks: Annotated[
        Optional[str], typer.Option("--tasks", "-t", metavar="TASKS", help="Comma-separated recipe task keys or harness task names (default: all of evaluate.tasks).")
    ] = None,
    limit: Annotated[Optional[int], typer.Option("--limit", metavar="N", min=1, help="Only the first N documents of each task (smoke runs).")] = None,
    output_dir: Annotated[Optional[str], typer.Option("--output-dir", "-o", metavar="DIR", help="Run folder (default: the recipe's output_dir); results go to DIR/eval/.")] = None,
    include_path: Annotated[Optional[str], typer.Option("--include-path", metavar="DIR", help="Folder of your own task YAMLs (lm-eval format).")] = None,
    chat_template: Annotated[
        bool, typer.Option("--apply-chat-template", help="Wrap prompts in the chat template (default: evaluate.apply_chat_template).", metavar="")
    ] = False,
    no_chat_template: Annotated[
        bool, typer.Option("--no-apply-chat-template", help="Give prompts without the chat template.", metavar="")
    ] = False,
    allow_code_execution: Annotated[
        bool, typer.Option("--allow-code-execution", help="Let code tasks (HumanEval) execute model-written code.", metavar="")
    ] = False,
    rerun: Annotated[bool, typer.Option("--rerun", help="Run tasks again even when a result with the same settings exists.", metavar="")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the scores (and comparison) as JSON on stdout.", metavar="")] = False,
    set_: SetOpt = None,
) -> None:
    """Run downstream benchmarks (GSM8K, MMLU, ...) on a checkpoint, optionally next to another one.

    Each task runs through lm-evaluation-harness with its own decoding settings
    (gen length / block / steps / shots from the recipe's evaluate.tasks).
    Writes DIR/eval/<model>/results.json (the harness's JSON), per-sample logs,
    and with two models DIR/eval/comparison.md. Multi-GPU: `accelerate launch
    -m dllm_align evaluate ...` splits the documents over the processes.

    Example: dllm-align evaluate table4_downstream --compare runs/ufb/final --limit 50
    """
    _require_harness()
    from dllm_align.config.recipe import load_recipe, write_run_info
    from dllm_align.core.console import info
    from dllm_align.core.errors import UserError
    from dllm_align.evaluate import run as E

    if chat_template and no_chat_template:
        raise UserError("--apply-chat-template and --no-apply-chat-template contradict each other; pick one")
    flags = given({
        "evaluate.include_path": ("--include-path", include_path),
        "evaluate.apply_chat_template": ("--apply-chat-template", True) if chat_template
        else ("--no-apply-chat-template", False) if no_chat_template else ("", None),
        "evaluate.allow_code_execution": ("--allow-code-execution", True if allow_code_execution else None),
    })
    rec = load_recipe(recipe, set_, output_dir, flags=flags)
    _quiet_libraries()
    plans = E.plan_tasks(rec, _split(tasks), limit)

    models, labels = _models_and_labels(rec, model, compare)
    eval_dir = Path(rec.output_dir) / "eval"
    rank0 = int(os.environ.get("RANK", "0")) == 0
    # Every task name is checked before anything is written (an unknown task left an empty eval/ behind).
    tm = E.task_manager([p.harness_task for p in plans], rec.evaluate.include_path)
    E.check_likelihood(rec, models)
    if rank0:
        write_run_info(rec, eval_dir, "evaluate")

    merged = []
    for name, label in zip(models, labels):
        res = E.evaluate_model(rec, name, plans, eval_dir / label, rerun=rerun, tm=tm)
        merged.append(res)
        if rank0:
            info(f"wrote {eval_dir / label / 'results.json'}")
    if not rank0:
        return
    if any(m is None for m in merged):
        raise UserError("no results were produced (every task failed?)")
    _report(models, labels, merged, plans, eval_dir, as_json)


def _quiet_libraries() -> None:
    """lm-eval's log at WARNING unless DLLM_ALIGN_DEBUG is set; no dataset-building bars off a terminal."""
    import logging

    from dllm_align.core.console import progress_enabled

    if os.environ.get("DLLM_ALIGN_DEBUG", "") in ("", "0"):
        logging.getLogger("lm_eval").setLevel(logging.WARNING)
    if not progress_enabled():  # keep CI logs readable: no dataset-building bars
        import datasets

        datasets.disable_progress_bars()


def _models_and_labels(rec, model: Optional[str], compare: Optional[str]) -> tuple[list[str], list[str]]:
    """The checkpoints to evaluate (the flag, else the recipe) and their folder names under eval/ (made distinct)."""
    from dllm_align.evaluate import run as E

    first = rec.model.name_or_path if model is None else model
    second = rec.evaluate.compare if compare is None else compare
    models = [first] + ([second] if second else [])
    labels = [E.model_label(m) for m in models]
    if len(labels) == 2 and labels[0] == labels[1]:
        labels[1] += "-2"
    return models, labels


def _report(models: list[str], labels: list[str], merged: list, plans, eval_dir: Path, as_json: bool) -> None:
    """The scores on stdout (a table, or JSON with --json); with two models the comparison, also written to eval/."""
    from dllm_align.core.console import info, result
    from dllm_align.core.io import atomic_write_json, atomic_write_text
    from dllm_align.evaluate import run as E

    payload: dict = {
        "models": {label: {"model": name, "results": str(eval_dir / label / "results.json"), "scores": m["dllm_align"]["scores"]}
                   for name, label, m in zip(models, labels, merged)},
    }
    if len(models) == 2:
        rows = E.comparison_rows(merged[0], merged[1], plans)
        table = E.comparison_markdown(rows, labels[0], labels[1])
        atomic_write_text(eval_dir / "comparison.md", table)
        atomic_write_json(eval_dir / "comparison.json", {"a": models[0], "b": models[1], "rows": rows})
        info(f"wrote {eval_dir / 'comparison.md'}")
        payload["comparison"] = {"a": labels[0], "b": labels[1], "rows": rows}
    else:
        table = E.scores_markdown(merged[0], plans, labels[0])
    result(json.dumps(payload, indent=2) if as_json else table)
