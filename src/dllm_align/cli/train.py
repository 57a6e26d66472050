"""``dllm-align train``: ELBO-KTO (default), masked-diffusion SFT or paired VRPO on accelerate.

Only typer, the standard library, cli.app and the recipe schema are imported at module level; the rest
inside the command body, so that `dllm-align --help` loads neither torch nor transformers.
"""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from dllm_align.cli.app import RecipeArg, SetOpt, command

OutputOpt = Annotated[Optional[str], typer.Option("--output-dir", "-o", metavar="DIR", help="Run folder (default: the recipe's output_dir).")]


@command("train")
def train(
    recipe: RecipeArg,
    output_dir: OutputOpt = None,
    set_: SetOpt = None,
    resume: Annotated[bool, typer.Option("--resume", help="Continue from the newest complete checkpoint in the run folder.", metavar="")] = False,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Discard a previous run's checkpoints, final model and metrics.", metavar="")] = False,
    allow_change: Annotated[
        Optional[list[str]],
        typer.Option("--allow-change", metavar="KEY", help="With --resume: let this recipe key differ from the recorded run (repeatable; 'all' for every key)."),
    ] = None,
) -> None:
    """Train the policy; writes checkpoints/step-N/, final/ and metrics.jsonl in the run folder.

    The reference ELBO comes from `precompute-ref`'s cache (reference.mode: cached)
    or from a resident reference model (reference.mode: online). The same command
    runs on one CPU, one GPU, or many with `accelerate launch` / `torchrun`.

    A resumed run refuses settings that change its results (every differing key
    is named) unless each is let through with --allow-change KEY.

    Example: dllm-align train demo -o runs/demo

    Example: accelerate launch --config_file recipes/accelerate/ddp_8gpu.yaml -m dllm_align train kto_mix_14k -o runs/kto
    """
    from dllm_align.core.console import info, result
    from dllm_align.core.errors import UserError
    from dllm_align.config.recipe import load_recipe
    from dllm_align.training.train import train as run_train

    if resume and overwrite:
        raise UserError("--resume and --overwrite contradict each other; pick one")
    r = load_recipe(recipe, set_, output_dir)
    res = run_train(r, resume=resume, overwrite=overwrite, allow_changes=allow_change or ())
    from accelerate.state import PartialState

    if PartialState().is_main_process:
        if res.steps:
            info(
                f"train: {res.steps} step(s) in {res.seconds:.1f} s ({res.steps_per_second:.2f} steps/s, "
                f"{res.examples_per_second:.1f} examples/s)"
            )
        result(str(res.final_dir))
