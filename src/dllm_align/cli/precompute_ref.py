"""``dllm-align precompute-ref``: compute and cache the reference ELBO of every training example.

The cache and what invalidates it: docs/design.md#the-reference-cache.

Only typer, the standard library, cli.app and the recipe schema are imported at module level; the rest
inside the command body, so that `dllm-align --help` loads neither torch nor transformers.
"""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from dllm_align.cli.app import RecipeArg, SetOpt, command

OutputOpt = Annotated[
    Optional[str], typer.Option("--output-dir", "-o", metavar="DIR", help="Run folder (default: the recipe's output_dir); the cache goes to DIR/ref_cache.")
]


@command("precompute-ref")
def precompute_ref(
    recipe: RecipeArg,
    output_dir: OutputOpt = None,
    set_: SetOpt = None,
    overwrite: Annotated[
        bool, typer.Option("--overwrite", help="Replace a cache in the folder that was made with other settings (refused otherwise).", metavar="")
    ] = False,
) -> None:
    """Compute every training example's K reference ELBO draws once and cache them.

    The cache (safetensors shards + a fingerprinted manifest) is what `train`
    reads by default; an interrupted run keeps its finished shards. Runs on
    several GPUs with `accelerate launch` (each process takes its share).

    Example: dllm-align precompute-ref kto_mix_14k --output-dir runs/kto

    Example: accelerate launch --num_processes 8 -m dllm_align precompute-ref kto_mix_14k -o runs/kto
    """
    from dllm_align.training import reference as ref
    from dllm_align.core.console import info, result
    from dllm_align.config.recipe import load_recipe

    r = load_recipe(recipe, set_, output_dir)
    rep, acc = ref.run_precompute(r, overwrite=overwrite)
    if acc.is_main_process:
        local = rep.n_examples * rep.computed_shards / max(rep.n_shards, 1)
        if rep.computed_shards:
            info(
                f"precompute-ref: {rep.computed_shards} shard(s) computed on this process in {rep.seconds:.1f} s "
                f"({local / max(rep.seconds, 1e-9):.1f} examples/s per process), {rep.reused_shards} reused"
            )
        else:
            info("precompute-ref: every shard was already done; manifest rewritten")
        result(str(rep.cache))
