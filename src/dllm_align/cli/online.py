"""``dllm-align online``: ELBO-KTO on the policy's own samples, labelled by a verifier, in rounds."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from dllm_align.cli.app import RecipeArg, command


@command("online")
def online(
    recipe: RecipeArg,
    output_dir: Annotated[Optional[str], typer.Option("--output-dir", "-o", metavar="DIR", help="Run folder: one round-<r>/ folder per round, rounds.json, rounds.png (default: the recipe's output_dir).")] = None,
    rounds: Annotated[int, typer.Option("--rounds", metavar="R", min=1, max=100, help="Rounds of label -> reference -> ELBO-KTO.")] = 2,
    rule: Annotated[str, typer.Option("--rule", "-r", metavar="RULE", help="The verifier: sort, math_answer, regex:PATTERN or module:function.")] = "sort",
    n: Annotated[int, typer.Option("--n", metavar="N", min=1, max=1024, help="Samples per prompt and round.")] = 4,
    prompts: Annotated[Optional[str], typer.Option("--prompts", metavar="FILE", help="Prompts file (default: the recipe's data.train).")] = None,
    limit: Annotated[Optional[int], typer.Option("--limit", metavar="N", min=1, help="Only the first N prompts.")] = None,
    reference: Annotated[str, typer.Option("--reference", metavar="WHICH", help="The reference of each round: initial (the recipe's model) or previous (the policy entering the round).")] = "initial",
    drop_uniform: Annotated[bool, typer.Option("--drop-uniform", metavar="", help="Drop prompts whose samples are all desirable or all undesirable (kept by default).")] = False,
    temperature: Annotated[Optional[float], typer.Option("--temperature", metavar="T", min=0, max=10, help="Sampling temperature (default: the recipe's, or 1.0 when that is greedy).")] = None,
    answer_column: Annotated[str, typer.Option("--answer-column", metavar="NAME", help="The reference-answer column math_answer compares against.")] = "answer",
    set_: Annotated[Optional[list[str]], typer.Option("--set", "-s", metavar="KEY=VALUE", help="Override a recipe key (repeatable).")] = None,
) -> None:
    """Align a model from its own samples: label them with a verifier, then ELBO-KTO on them, in rounds.

    Each round labels n samples per prompt from the current policy, balances the class weights
    (lambda_D n_D = lambda_U n_U), computes the reference ELBOs (the initial model by default) and
    trains from the current policy; the next round samples the trained model. A killed run continues
    where it stopped. The per-round table is printed on stdout. Details: docs/online.md.

    Example: dllm-align online demo -o runs/online --rounds 2 --rule sort --n 4 --limit 200
    """
    from dllm_align.config.recipe import load_recipe
    from dllm_align.core.console import result
    from dllm_align.workflows.online import markdown_table, run_online

    rec = load_recipe(recipe, set_, output_dir)
    table = run_online(rec, rec.output_dir, rounds=rounds, rule=rule, n=n, limit=limit, prompts=prompts, reference=reference,
                       keep_uniform=not drop_uniform, temperature=temperature, answer_column=answer_column)
    result(markdown_table(table))
