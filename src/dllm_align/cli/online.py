"""``dllm-align online``: ELBO-KTO on the policy's own samples, labelled by a verifier, in rounds."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from dllm_align.cli.app import RecipeArg, command


@command("online")
def online(
    recipe: RecipeArg,
    output_dir: Annotated[Optional[str], typer.Option("--output-dir", "-o", metavar="DIR", help="Run folder: one round-<r>/ folder per round, rounds.json, rounds.png (default: the recipe's output_dir).")] = None,
    rounds: Annotated[Optional[int], typer.Option("--rounds", metavar="R", min=1, max=100, show_default="online.rounds, 2", help="Rounds of label -> reference -> ELBO-KTO.")] = None,
    rule: Annotated[Optional[str], typer.Option("--rule", "-r", metavar="RULE", show_default="online.rule, sort", help="The verifier: sort, math_answer, regex:PATTERN or module:function.")] = None,
    n: Annotated[Optional[int], typer.Option("--n", metavar="N", min=1, max=1024, show_default="online.n, 4", help="Samples per prompt and round.")] = None,
    prompts: Annotated[Optional[str], typer.Option("--prompts", metavar="FILE", help="Prompts file (default: the recipe's data.train).")] = None,
    limit: Annotated[Optional[int], typer.Option("--limit", metavar="N", min=1, help="Only the first N prompts (default: online.limit).")] = None,
    reference: Annotated[Optional[str], typer.Option("--reference", metavar="WHICH", show_default="online.reference, initial", help="The reference of each round: initial (the recipe's model) or previous (the policy entering the round).")] = None,
    drop_uniform: Annotated[bool, typer.Option("--drop-uniform", metavar="", help="Drop prompts whose samples are all desirable or all undesirable (kept by default).")] = False,
    temperature: Annotated[Optional[float], typer.Option("--temperature", metavar="T", min=0, max=10, help="Sampling temperature (default: the recipe's, or 1.0 when that is greedy).")] = None,
    answer_column: Annotated[str, typer.Option("--answer-column", metavar="NAME", help="The reference-answer column math_answer compares against.")] = "answer",
    set_: Annotated[Optional[list[str]], typer.Option("--set", "-s", metavar="KEY=VALUE", help="Override a recipe key (repeatable).")] = None,
) -> None:
    """Align a model from its own samples: label them with a verifier, then ELBO-KTO on them, in rounds.

    The recipe's `online` section (if any) gives the defaults. Each round labels n samples per prompt from the current policy, balances the class weights
    (lambda_D n_D = lambda_U n_U), computes the reference ELBOs (the initial model by default) and
    trains from the current policy; the next round samples the trained model. A killed run continues
    where it stopped. The per-round table is printed on stdout. Details: docs/online.md.

    Example: dllm-align online demo -o runs/online --rounds 2 --rule sort --n 4 --limit 200
    """
    from dllm_align.config.recipe import load_recipe
    from dllm_align.core.console import result
    from dllm_align.workflows.online import markdown_table, run_online

    from dllm_align.config.schema import OnlineSection

    rec = load_recipe(recipe, set_, output_dir)
    o = rec.online or OnlineSection()  # the recipe's online section gives the defaults; flags win
    table = run_online(rec, rec.output_dir, rounds=rounds or o.rounds, rule=rule or o.rule, n=n or o.n, limit=limit or o.limit,
                       prompts=prompts, reference=reference or o.reference, keep_uniform=o.keep_uniform and not drop_uniform,
                       temperature=temperature if temperature is not None else o.temperature, answer_column=answer_column)
    result(markdown_table(table))
