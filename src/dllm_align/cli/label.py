"""``dllm-align label``: the policy's own samples, labelled by a verifier, as unpaired training rows.

Only typer, the standard library, cli.app and the recipe schema are imported at module level; the rest
inside the command body, so that `dllm-align --help` loads neither torch nor transformers.
"""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from dllm_align.cli.app import RecipeArg, SetOpt, command, given


@command("label")
def label(
    recipe: RecipeArg,
    output_dir: Annotated[Optional[str], typer.Option("--output-dir", "-o", metavar="DIR", help="Run folder: the rows go to DIR/labelled.jsonl, the summary to DIR/label_summary.json (default: the recipe's output_dir).")] = None,
    rule: Annotated[Optional[str], typer.Option("--rule", "-r", metavar="RULE", show_default="online.rule, or sort", help="The verifier: a registered one by name (sort, math_answer, regex:PATTERN, judge:MODEL, a plugin's) or package.module:function (default: the recipe's online.rule, as online labels, else sort).")] = None,
    n: Annotated[int, typer.Option("--n", metavar="N", min=1, max=1024, help="Samples per prompt.")] = 4,
    prompts: Annotated[Optional[str], typer.Option("--prompts", metavar="FILE", help="Prompts file (.jsonl/.json/.parquet/.csv/.txt; default: the recipe's data.train).")] = None,
    split: Annotated[str, typer.Option("--split", metavar="SPLIT", help="Split of the recipe's data when no --prompts is given.")] = "train",
    model: Annotated[Optional[str], typer.Option("--model", "-m", metavar="MODEL", help="Model to sample from (default: the recipe's model.name_or_path).")] = None,
    limit: Annotated[Optional[int], typer.Option("--limit", metavar="N", min=1, help="Only the first N prompts.")] = None,
    temperature: Annotated[Optional[float], typer.Option("--temperature", metavar="T", min=0, max=10, help="Sampling temperature (default: the recipe's, or 1.0 when that is greedy).")] = None,
    answer_column: Annotated[str, typer.Option("--answer-column", metavar="NAME", help="The reference-answer column math_answer compares against.")] = "answer",
    batch: Annotated[bool, typer.Option("--batch", metavar="", help="With --rule judge:MODEL: ask the judge through the Batch API (as judge --batch); rerun to continue.")] = False,
    set_: SetOpt = None,
) -> None:
    """Sample the model's own completions and label each one desirable or not with a verifier.

    The rows (prompt, completion, label, and their provenance: round, model, sampler, labeller, verdict)
    are what precompute-ref and train read; the summary gives the desirable share and how many prompts
    got only good or only bad samples. math_answer stores each row's reason (correct, wrong, hedge,
    truncated, expression, none) and the summary counts them. Verifiers and their rules: docs/online.md.

    Example: dllm-align label demo -o runs/label --rule sort --n 4 --limit 50

    Example: dllm-align label online_gsm8k -o runs/gsm8k-r0 --rule math_answer --prompts gsm8k_train.jsonl
    """
    import json

    from dllm_align.config.recipe import load_recipe, write_run_info
    from dllm_align.core.console import result
    from dllm_align.online.label import label as run_label

    rec = load_recipe(recipe, set_, output_dir, flags=given({"judge.batch": ("--batch", True if batch else None)}))
    if rule is None:  # the recipe's verifier, so that its answer format is the one asked for and read, as online does
        rule = rec.online.rule if rec.online is not None else "sort"
    summary = run_label(rec, rec.output_dir, rule=rule, n=n, prompts=prompts, split=split, model=model, limit=limit,
                        temperature=temperature, answer_column=answer_column)
    write_run_info(rec, rec.output_dir, "label")
    result(json.dumps(summary, indent=2))
