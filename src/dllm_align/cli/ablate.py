"""``dllm-align ablate``: sweeps that reproduce the paper's Table 3 and Figure 1.

Only typer, the standard library, cli.app and the recipe schema are imported at module level; the rest
inside the command body, so that `dllm-align --help` loads neither torch nor transformers.
"""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from dllm_align.cli.app import Group, SetOpt, app, command, given

group = typer.Typer(cls=Group, help="The paper's studies as resumable sweeps: baseline (Table 3) and class imbalance (Figure 1).",
                    no_args_is_help=True)
app.add_typer(group, name="ablate")

RecipeArg = Annotated[str, typer.Argument(metavar="RECIPE", help="Recipe (bundled name or YAML path); the demo task by default.")]
OutputOpt = Annotated[Optional[str], typer.Option("--output-dir", "-o", metavar="DIR", help="Sweep folder (default: <output_dir>/ablate-<study>).")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print the rows as JSON instead of the markdown table.", metavar="")]


def _floats(text: Optional[str], what: str) -> Optional[list[float]]:
    from dllm_align.core.errors import UserError

    if text is None:
        return None
    try:
        vals = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"{what}: expected comma-separated numbers, got {text!r}")
    if not vals:
        raise UserError(f"{what}: no values given")
    return vals


def _finish(rows, out, kind: str, json_out: bool) -> None:
    import json

    from dllm_align.workflows.ablate import markdown
    from dllm_align.core.console import info, result

    info(f"ablate {kind}: table and plot in {out}")
    result(json.dumps(rows, indent=2) if json_out else markdown(rows))


@command("baseline", group=group)
def baseline(
    recipe: RecipeArg = "demo",
    betas: Annotated[Optional[str], typer.Option(help="Comma-separated betas (grid with --lrs).")] = None,
    lrs: Annotated[Optional[str], typer.Option(help="Comma-separated learning rates (grid with --betas).")] = None,
    output_dir: OutputOpt = None,
    set_: SetOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """ELBO-KTO with each reference point of ablate.baselines (none, global mean, KTO's kl) over a (beta, lr) grid (paper Table 3).

    Example: dllm-align ablate baseline demo --betas 0.1,0.2 --lrs 1e-5,3e-5
    """
    from pathlib import Path

    from dllm_align.workflows import ablate
    from dllm_align.config.recipe import load_recipe

    flags = given({"ablate.betas": ("--betas", _floats(betas, "--betas")), "ablate.lrs": ("--lrs", _floats(lrs, "--lrs"))})
    if flags:
        flags["ablate.pairs"] = next(iter(flags.values()))[0], None  # a grid from the flags replaces the recipe's pairs
    r = load_recipe(recipe, set_, flags=flags)
    out = Path(r.output_dir) / "ablate-baseline" if output_dir is None else Path(output_dir)
    rows = ablate.run_sweep(r, "baseline", ablate.baseline_settings(r), out)
    ablate.plot_baseline(rows, out / "baseline.png")
    _finish(rows, out, "baseline", json_out)


@command("imbalance", group=group)
def imbalance(
    recipe: RecipeArg = "demo",
    ratios: Annotated[Optional[str], typer.Option(help="Comma-separated fractions of the subsampled class kept, e.g. 0.1,0.5,1.")] = None,
    subsample: Annotated[Optional[str], typer.Option(help="desirable, undesirable or both (one sweep each, as in Figure 1).")] = None,
    output_dir: OutputOpt = None,
    set_: SetOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Subsample one class with lambda_D * n_D = lambda_U * n_U and measure AWR (paper Figure 1).

    Example: dllm-align ablate imbalance demo --ratios 0.1,0.5,1 --subsample both
    """
    from pathlib import Path

    from dllm_align.workflows import ablate
    from dllm_align.config.recipe import load_recipe

    r = load_recipe(recipe, set_, flags=given({"ablate.ratios": ("--ratios", _floats(ratios, "--ratios")),
                                               "ablate.subsample": ("--subsample", subsample)}))
    sides = ["desirable", "undesirable"] if r.ablate.subsample == "both" else [r.ablate.subsample]
    out = Path(r.output_dir) / "ablate-imbalance" if output_dir is None else Path(output_dir)
    rows = ablate.run_sweep(r, "imbalance", ablate.imbalance_settings(r, sides), out)
    ablate.plot_imbalance(rows, out / "imbalance.png")
    _finish(rows, out, "imbalance", json_out)
