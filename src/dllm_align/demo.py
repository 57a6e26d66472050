"""``dllm-align demo``: the whole method on a CPU in minutes, offline.

The toy task (:mod:`dllm_align.toy`): sort five digits; ascending is desirable,
descending undesirable. The base model (``builtin:toy-sort-base``, shipped in
the package; rebuilt by the ``toy_sort_base`` recipe) was trained by
masked-diffusion SFT on both, so it answers either way. The demo then runs
the paper's pipeline on unpaired labels:

precompute-ref -> ELBO-KTO -> generate (base and aligned) -> judge (rule:sort)

and prints the toy version of the paper's Table 1: aligned vs base, and the
test split's own chosen and rejected answers vs base, each an adjusted win
rate with a 90% bootstrap interval.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from dllm_align import console, pipeline

ROWS = (("aligned", "ELBO-KTO (aligned)"), ("chosen", "chosen target"), ("rejected", "rejected target"))


def run_demo(recipe_name: str = "demo", output_dir: Optional[str] = None, overrides: Optional[list[str]] = None) -> dict:
    """Run (or finish) the demo in ``output_dir``; returns the content of results.json."""
    from dllm_align.io import atomic_write_json, atomic_write_text
    from dllm_align.recipe import load_recipe

    rec = load_recipe(recipe_name, overrides, output_dir)
    out = Path(rec.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    base_model = rec.model.name_or_path

    console.info(f"demo: [1/4] reference ELBOs of {base_model} -> {out / 'ref_cache'}")
    pipeline.reference(rec)
    console.info("demo: [2/4] ELBO-KTO training")
    aligned = pipeline.trained_model(rec)
    console.info("demo: [3/4] generating with the base and the aligned model")
    files = {
        "base": pipeline.generations(rec, base_model, out / "gen.base.jsonl"),
        "aligned": pipeline.generations(rec, aligned, out / "gen.aligned.jsonl"),
    }
    files.update(pipeline.targets(rec, out))
    console.info(f"demo: [4/4] judging with {', '.join(rec.judge.judges)} (both orders)")
    rows = {}
    for key, _ in ROWS:
        if key in files:
            res = pipeline.judged(rec, files[key], files["base"], out / "judge" / key)
            head = pipeline.first_judge(res)
            rows[key] = {k: head[k] for k in ("awr", "ci90", "wins", "losses", "ties", "n")}
    results = {
        "task": "toy-sort",
        "base_model": base_model,
        "aligned_model": str(aligned),
        "judges": list(rec.judge.judges),
        "awr": rows["aligned"]["awr"],
        "ci90": rows["aligned"]["ci90"],
        "rows": rows,
    }
    atomic_write_json(out / "results.json", results)
    atomic_write_text(out / "results.md", markdown(results))
    return results


def markdown(results: dict) -> str:
    lines = [
        f"AWR (%) vs the base model ({results['base_model']}), judge {', '.join(results['judges'])}",
        "",
        "| | AWR | 90% CI | wins | losses | ties | n |",
        "|---|---|---|---|---|---|---|",
    ]
    for key, label in ROWS:
        r = results["rows"].get(key)
        if r:
            lo, hi = r["ci90"]
            lines.append(
                f"| {label} | {100 * r['awr']:.1f} | [{100 * lo:.1f}, {100 * hi:.1f}] | {r['wins']} | {r['losses']} | {r['ties']} | {r['n']} |"
            )
    return "\n".join(lines) + "\n"


def print_table(results: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"Toy Table 1: AWR (%) vs base, judge {', '.join(results['judges'])}")
    for col in ("", "AWR", "90% CI", "wins", "losses", "ties", "n"):
        t.add_column(col, justify="left" if not col else "right")
    for key, label in ROWS:
        r = results["rows"].get(key)
        if r:
            lo, hi = r["ci90"]
            t.add_row(label, f"{100 * r['awr']:.1f}", f"[{100 * lo:.1f}, {100 * hi:.1f}]", str(r["wins"]), str(r["losses"]), str(r["ties"]), str(r["n"]))
    Console(highlight=False).print(t)
