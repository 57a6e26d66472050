"""``dllm-align online``: ELBO-KTO on the policy's own samples, labelled by a verifier, in rounds.

Only typer, the standard library, cli.app and the recipe schema are imported at module level; the rest
inside the command body, so that `dllm-align --help` loads neither torch nor transformers.
"""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from dllm_align.cli.app import RecipeArg, SetOpt, command, given, schema_default as d


@command("online")
def online(
    recipe: RecipeArg,
    output_dir: Annotated[Optional[str], typer.Option("--output-dir", "-o", metavar="DIR", help="Run folder: one round-<r>/ folder per round, rounds.json, rounds.png (default: the recipe's output_dir).")] = None,
    rounds: Annotated[Optional[int], typer.Option("--rounds", metavar="R", show_default=d("online.rounds"), help="Rounds of label -> reference -> ELBO-KTO.")] = None,
    rule: Annotated[Optional[str], typer.Option("--rule", "-r", metavar="RULE", show_default=d("online.rule"), help="The verifier: a registered one by name (sort, math_answer, regex:PATTERN, judge:MODEL, a plugin's) or package.module:function.")] = None,
    n: Annotated[Optional[int], typer.Option("--n", metavar="N", show_default=d("online.n"), help="Samples per prompt and round.")] = None,
    prompts: Annotated[Optional[str], typer.Option("--prompts", metavar="FILE", help="Prompts file (default: the recipe's data.train).")] = None,
    limit: Annotated[Optional[int], typer.Option("--limit", metavar="N", show_default=d("online.limit"), help="Only the first N prompts.")] = None,
    reference: Annotated[Optional[str], typer.Option("--reference", metavar="WHICH", show_default=d("online.reference"), help="The reference of each round: initial (the recipe's model) or previous (the policy entering the round).")] = None,
    drop_uniform: Annotated[bool, typer.Option("--drop-uniform", metavar="", help="Drop prompts whose samples are all desirable or all undesirable (kept by default).")] = False,
    no_greedy: Annotated[bool, typer.Option("--no-greedy", metavar="", help="Train on the samples alone, without each prompt's labelled greedy decode (online.greedy).")] = False,
    temperature: Annotated[Optional[float], typer.Option("--temperature", metavar="T", show_default=d("online.temperature"), help="Sampling temperature (default: the recipe's, or 1.0 when that is greedy).")] = None,
    answer_column: Annotated[str, typer.Option("--answer-column", metavar="NAME", help="The reference-answer column math_answer compares against.")] = "answer",
    heldout: Annotated[Optional[str], typer.Option("--heldout", metavar="FILE", help="Held-out prompts for the per-round evaluation (default: the recipe's data.test).")] = None,
    heldout_limit: Annotated[Optional[int], typer.Option("--heldout-limit", metavar="N", show_default=d("online.heldout_limit"), help="Only the first N held-out prompts.")] = None,
    keep: Annotated[Optional[str], typer.Option("--keep", metavar="WHICH", show_default=d("online.keep"), help="The final model: guard (the last round's, but a round whose held-out greedy share falls below the previous model's 90% interval is rolled back and the loop stops), last (the last round's, whatever it scored) or best (the round with the highest held-out greedy share).")] = None,
    batch: Annotated[bool, typer.Option("--batch", metavar="", help="With --rule judge:MODEL: ask the judge through the Batch API (as judge --batch); rerun to continue.")] = False,
    allow_change: Annotated[Optional[list[str]], typer.Option("--allow-change", metavar="KEY", help="Continue a run folder although this recorded setting differs (repeatable; 'all' for every key).")] = None,
    parity: Annotated[Optional[str], typer.Option("--parity", metavar="FILE", help="A passing parity record (dllm-align parity) for the served backend of generate.backend; a served backend needs one.")] = None,
    skip_parity: Annotated[bool, typer.Option("--skip-parity", metavar="", help="Run a served backend without a parity record (recorded in online.json).")] = False,
    set_: SetOpt = None,
) -> None:
    """Align a model from its own samples: label them with a verifier, then ELBO-KTO on them, in rounds.

    The recipe's `online` section (if any) gives the defaults. Each round labels n samples per prompt from the
    current policy, and its greedy decode of each prompt (math_answer also stores each verdict's reason: correct, wrong, hedge, truncated,
    expression, none, counted per round), balances the class weights (lambda_D n_D = lambda_U n_U, times the
    recipe's train.lambda_*), computes the reference ELBOs (the initial model by default), trains from the
    current policy with the recipe's train settings, and evaluates the trained model on held-out prompts
    (greedy and sampled). Seeds change from round to round. A killed run continues where it stopped; a rerun
    with other settings, or fewer rounds than the folder finished, is refused by name. The per-round table
    is printed on stdout. Details: docs/online.md.

    Example: dllm-align online demo_online -o runs/online --rounds 5
    """
    from dllm_align.config.recipe import load_recipe
    from dllm_align.core.console import result
    from dllm_align.workflows.online import markdown_table, run_online

    from dllm_align.config.schema import OnlineSection

    flags = given({
        "online.rounds": ("--rounds", rounds), "online.rule": ("--rule", rule), "online.n": ("--n", n),
        "online.limit": ("--limit", limit), "online.reference": ("--reference", reference),
        "online.keep_uniform": ("--drop-uniform", False if drop_uniform else None),
        "online.greedy": ("--no-greedy", False if no_greedy else None),
        "online.temperature": ("--temperature", temperature),
        "online.heldout": ("--heldout", heldout), "online.heldout_limit": ("--heldout-limit", heldout_limit),
        "online.keep": ("--keep", keep),
        "judge.batch": ("--batch", True if batch else None),
    })
    from dllm_align.workflows.online import refuse_set_by_online

    refuse_set_by_online(set_)
    rec = load_recipe(recipe, set_, output_dir, flags=flags)
    o = rec.online or OnlineSection()  # the recipe's online section (flags included), else the schema's defaults
    table = run_online(rec, rec.output_dir, rounds=o.rounds, rule=o.rule, n=o.n, limit=o.limit, prompts=prompts,
                       reference=o.reference, keep_uniform=o.keep_uniform, temperature=o.temperature,
                       answer_column=answer_column, heldout=o.heldout, heldout_limit=o.heldout_limit,
                       heldout_n=o.heldout_n, keep=o.keep, greedy=o.greedy, allow_changes=allow_change or (),
                       parity=parity, skip_parity=skip_parity)
    result(markdown_table(table))
