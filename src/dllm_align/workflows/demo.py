"""``dllm-align demo``: the whole method on a CPU in minutes, offline.

The toy task (:mod:`dllm_align.data.toy`): sort five digits; ascending is desirable,
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

import json
import os
from pathlib import Path
from typing import Optional

import torch
from rich.console import Console
from rich.table import Table

from dllm_align.config.recipe import load_recipe
from dllm_align.core import console
from dllm_align.core.console import result
from dllm_align.core.io import atomic_path, atomic_write_json, atomic_write_text
from dllm_align.data import toy
from dllm_align.generate.backend import check_serves_each_round
from dllm_align.training.plan import check_for_model
from dllm_align.workflows import pipeline
from dllm_align.workflows.online import markdown_table, refuse_set_by_online, run_online

# lazy imports: matplotlib: an optional extra (pip install dllm-align[plot]); without it the demo skips its plot

ROWS = (("aligned", "ELBO-KTO (aligned)"), ("chosen", "chosen target"), ("rejected", "rejected target"))


def one_thread_unless_chosen(environ=None) -> bool:
    """Run the demo's torch on one thread unless the user chose a number (``OMP_NUM_THREADS``).

    The demo's models are tiny: on a shared or small box PyTorch's default of one thread per core
    makes its threads fight each other and other jobs (the demo took 46 minutes at 32% CPU on a loaded
    2-core box), and one thread is about as fast on a quiet one. Returns whether it chose."""
    environ = os.environ if environ is None else environ
    if environ.get("OMP_NUM_THREADS"):
        return False
    environ["OMP_NUM_THREADS"] = "1"  # for any process the demo starts
    torch.set_num_threads(1)
    return True


def run_demo(recipe_name: str = "demo", output_dir: Optional[str] = None, overrides: Optional[list[str]] = None) -> dict:
    """Run (or finish) the demo in ``output_dir``; returns the content of results.json."""
    rec = load_recipe(recipe_name, overrides, output_dir)
    if rec.online is not None:
        # before its folder is made
        check_serves_each_round(rec.generate.backend, "the online demo", rec.generate.own_settings(rec.generate.backend))
    check_for_model(rec)  # what the training and generation steps would refuse, refused before the folder is made
    out = Path(rec.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    base_model = rec.model.name_or_path

    rounds = None
    if rec.online is not None:
        # Online ELBO-KTO: no labelled rows, the policy's own samples labelled by the verifier, in rounds.

        refuse_set_by_online(overrides)

        o = rec.online
        console.info(f"demo: [1-2/4] online ELBO-KTO: {o.rounds} round(s) of {o.n} samples per prompt labelled by {o.rule}")
        rounds = run_online(rec, out / "online", rounds=o.rounds, rule=o.rule, n=o.n, limit=o.limit, reference=o.reference,
                            keep_uniform=o.keep_uniform, temperature=o.temperature, heldout=o.heldout,
                            heldout_limit=o.heldout_limit, heldout_n=o.heldout_n, keep=o.keep, greedy=o.greedy)
        aligned = Path(json.loads((out / "online" / "rounds.json").read_text(encoding="utf-8"))["final_model"])
        console.info("online rounds:\n" + markdown_table(rounds))
    else:
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
    for r in rows.values():  # multiples of 1/(2n) and bootstrap percentiles: no float noise in the outputs
        r["awr"] = round(r["awr"], 6)
        r["ci90"] = [round(x, 6) for x in r["ci90"]]
    results = {
        "task": "toy-sort",
        "base_model": base_model,
        "aligned_model": str(aligned),
        "judges": list(rec.judge.judges),
        "awr": rows["aligned"]["awr"],
        "ci90": rows["aligned"]["ci90"],
        "rows": rows,
        "sorts": {k: sort_counts(files[k]) for k in ("base", "aligned")},
    }
    if rounds is not None:
        results["online_rounds"] = rounds
    metrics = out / "metrics.jsonl" if rounds is None else out / "online" / f"round-{len(rounds) - 1}" / "metrics.jsonl"
    figure = plot(results, metrics, out / "demo.png")
    # results.json says what the demo wrote, so `--json` and the file are the same object
    results["written"] = [str(out / w) for w in ["results.json", "results.md"] + (["demo.png"] if figure else [])]
    atomic_write_text(out / "results.md", markdown(results) + "\n" + "\n".join(explain(results)) + "\n")
    atomic_write_json(out / "results.json", results)
    return results


def closing_line(results: dict) -> str:
    """What the demo left on disk, said last."""
    out = Path(results["written"][0]).parent
    return (
        f"demo: wrote {', '.join(results['written'])}; also in {out}: the aligned model (final/), "
        "generations (gen.*.jsonl), judgements (judge/) and the training log (metrics.jsonl)"
    )


def sort_counts(path: Path) -> dict:
    """How many answers in a generation file are the exact ascending sort, the exact descending
    sort, or something else (the toy task's two labelled behaviours)."""
    counts = {"n": 0, "ascending": 0, "descending": 0, "other": 0}
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        digits, got = toy.digits_of(row["prompt"]), str(row["completion"]).strip()
        counts["n"] += 1
        kind = "ascending" if got == toy.desirable(digits) else "descending" if got == toy.undesirable(digits) else "other"
        counts[kind] += 1
    return counts


def explain(results: dict) -> list[str]:
    """Plain lines that make the table readable without the paper."""
    rows, sorts = results["rows"], results.get("sorts") or {}
    n = rows["aligned"]["n"]
    lines = [
        "What the table says:",
        "  Task: sort five digits. Ascending answers were labelled thumbs-up (desirable) and descending",
        "  answers thumbs-down (undesirable), one label per answer, never as pairs; the base model gives either.",
        f"  AWR (adjusted win rate) = (wins + ties / 2) / prompts, against the base model on {n} held-out prompts,",
        "  each judged in both answer orders by an exact rule (rule:sort); 50 means no better than the base.",
        "  The 90% CI comes from 5,000 bootstrap resamples of the prompts.",
        "  chosen target / rejected target: the held-out prompts' own ascending / descending answers judged",
        "  the same way, i.e. always giving the thumbs-up answer (the ceiling: a tie wherever the base sorts",
        "  correctly too) and always giving the thumbs-down one.",
    ]
    b, a = sorts.get("base"), sorts.get("aligned")
    if b and a:
        lines.append(
            f"  Exact ascending sorts: base {b['ascending']}/{b['n']}, aligned {a['ascending']}/{a['n']}; "
            f"descending answers: base {b['descending']}, aligned {a['descending']}."
        )
    return lines


def plot(results: dict, metrics: Path, path: Path) -> Optional[Path]:
    """demo.png: the reward margins over training, and the three AWR rows with their 90% intervals."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        console.info("demo: no figure (matplotlib is not installed: pip install matplotlib, or the 'plot' extra)")
        return None

    steps = [json.loads(x) for x in metrics.read_text(encoding="utf-8").splitlines() if x.strip()] if metrics.exists() else []
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))

    def smooth(v: list, k: int = 10) -> list:
        return [sum(v[max(0, i - k + 1): i + 1]) / len(v[max(0, i - k + 1): i + 1]) for i in range(len(v))]

    for key, label, colour in (("reward_desirable", "desirable rows (r+)", "#2ca02c"),
                               ("reward_undesirable", "undesirable rows (r-)", "#d62728"),
                               ("baseline", "baseline (b)", "#7f7f7f")):
        pts = [(m["step"], m[key]) for m in steps if m.get(key) is not None]
        if pts:
            x, y = zip(*pts)
            left.plot(x, y, color=colour, alpha=0.25, lw=0.8)
            left.plot(x, smooth(list(y)), color=colour, label=label)
    left.axhline(0, color="black", lw=0.6)
    left.set_xlabel("training step")
    left.set_ylabel("reward margin (nats)")
    left.set_title("ELBO-KTO: policy minus reference ELBO")
    left.legend(fontsize=8)
    left.grid(alpha=0.3)

    keys = [(k, label) for k, label in ROWS if k in results["rows"]]
    awr = [100 * results["rows"][k]["awr"] for k, _ in keys]
    err = [[100 * (results["rows"][k]["awr"] - results["rows"][k]["ci90"][0]) for k, _ in keys],
           [100 * (results["rows"][k]["ci90"][1] - results["rows"][k]["awr"]) for k, _ in keys]]
    right.bar(range(len(keys)), awr, yerr=err, capsize=5, color=["#1f77b4", "#2ca02c", "#d62728"][: len(keys)])
    right.axhline(50, color="grey", lw=0.8, ls="--")
    right.set_xticks(range(len(keys)))
    right.set_xticklabels([label for _, label in keys], fontsize=8)
    right.set_ylim(0, 100)
    right.set_ylabel("AWR vs base (%), 90% CI")
    right.set_title("Toy Table 1")
    fig.tight_layout()
    with atomic_path(path, suffix=".png") as tmp:
        fig.savefig(tmp, format="png", dpi=120)
    plt.close(fig)
    return path


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
    t = Table(title=f"Toy Table 1: AWR (%) vs base, judge {', '.join(results['judges'])}")
    for col in ("", "AWR", "90% CI", "wins", "losses", "ties", "n"):
        t.add_column(col, justify="left" if not col else "right")
    for key, label in ROWS:
        r = results["rows"].get(key)
        if r:
            lo, hi = r["ci90"]
            t.add_row(label, f"{100 * r['awr']:.1f}", f"[{100 * lo:.1f}, {100 * hi:.1f}]", str(r["wins"]), str(r["losses"]), str(r["ties"]), str(r["n"]))
    Console(highlight=False).print(t)

    result("\n".join(explain(results)))
