"""``dllm-align parity``: the recipe's served backend against the in-process one on the same prompts, settings
and seeds (docs/serving.md#parity).

Thin: resolve the recipe and hand it to :func:`dllm_align.serve.parity.run_parity`. Only typer, the standard
library and cli.app are imported at module level; the rest inside the command body.
"""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from dllm_align.cli.app import RecipeArg, SetOpt, command


@command("parity")
def parity(
    recipe: RecipeArg,
    output_dir: Annotated[Optional[str], typer.Option("--output-dir", "-o", metavar="DIR", help="Run folder (default: the recipe's output_dir); the record goes to DIR/parity.json.")] = None,
    set_: SetOpt = None,
    prompts: Annotated[Optional[str], typer.Option("--prompts", help="Prompt file/folder instead of the recipe's data.")] = None,
    split: Annotated[str, typer.Option("--split", help="Which prompts of the recipe: test or train.")] = "test",
    limit: Annotated[int, typer.Option("--limit", min=1, help="Prompts compared.")] = 20,
    samples: Annotated[int, typer.Option("--samples", min=2, help="Seeds per prompt at temperature > 0.")] = 4,
    temperature: Annotated[float, typer.Option("--temperature", min=0.0, help="Temperature of the sampled comparison (> 0).")] = 1.0,
    rule: Annotated[Optional[str], typer.Option("--rule", help="A verifier whose pass rates are compared too (as in label).")] = None,
    min_match: Annotated[float, typer.Option("--min-match", min=0.0, max=1.0, help="Share of greedy completions that must match token for token.")] = 1.0,
    alpha: Annotated[float, typer.Option("--alpha", min=0.0, max=1.0, help="A permutation p-value below this fails.")] = 0.01,
    device: Annotated[Optional[str], typer.Option("--device", help="Device of the in-process reference.")] = None,
) -> None:
    """Check that a served engine decodes what the in-process samplers decode; exit 1 naming why when it does not.

    Example: dllm-align parity demo -o runs/parity --set generate.backend=openai --set generate.openai.base_url=http://127.0.0.1:8000/v1
    """
    from dllm_align.config.recipe import load_recipe
    from dllm_align.core.console import result
    from dllm_align.core.errors import RunFailure
    from dllm_align.serve.parity import RECORD, run_parity

    rec = load_recipe(recipe, set_, output_dir)
    record = run_parity(rec, rec.output_dir, prompts=prompts, split=split, limit=limit, samples=samples,
                        temperature=temperature, rule=rule, min_match=min_match, alpha=alpha, device=device)
    result(f"{rec.output_dir}/{RECORD}")
    if not record["passed"]:
        raise RunFailure("parity failed: " + "; ".join(record["reasons"]))
