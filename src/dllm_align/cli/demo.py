"""``dllm-align demo``: the embedded default, end to end on a CPU with no network.

Only typer, the standard library, cli.app and the recipe schema are imported at module level; the rest
inside the command body, so that `dllm-align --help` loads neither torch nor transformers.
"""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from dllm_align.cli.app import SetOpt, command


@command("demo")
def demo(
    output_dir: Annotated[Optional[str], typer.Option("--output-dir", "-o", metavar="DIR", help="Run folder (default: runs/demo).")] = None,
    recipe: Annotated[str, typer.Option("--recipe", help="The demo recipe (a bundled name or a YAML path).")] = "demo",
    set_: SetOpt = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print results.json instead of the table.", metavar="")] = False,
) -> None:
    """Run the whole method on the toy sorting task: precompute-ref, ELBO-KTO, generate, judge.

    Prints the toy version of the paper's Table 1 (aligned, chosen target and
    rejected target vs the base model; adjusted win rate with a 90% bootstrap
    interval), a few lines that explain it, and writes DIR/results.json, results.md
    and demo.png (reward margins over training, AWR bars). A rerun reuses every
    finished stage. PyTorch runs on one thread unless OMP_NUM_THREADS says otherwise
    (the models are tiny; more threads only fight over a shared box).

    Example: dllm-align demo --output-dir runs/demo
    """
    import json

    from dllm_align.core.console import info, result
    from dllm_align.workflows.demo import closing_line, one_thread_unless_chosen, print_table, run_demo

    one_thread_unless_chosen()

    res = run_demo(recipe, output_dir, set_)
    if json_out:
        result(json.dumps(res, indent=2))
    else:
        print_table(res)
    info(closing_line(res))
