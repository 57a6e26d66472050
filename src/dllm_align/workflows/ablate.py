"""``dllm-align ablate``: the paper's baseline study (Table 3) and class-imbalance study (Figure 1).

Each setting is one run folder: train -> generate -> judge against the base
model's generations. The reference cache and the base generations are shared
by every setting (the reference does not depend on the policy's settings, and
a full-set cache serves every class-ratio subset). A setting whose
``result.json`` exists is skipped, so a rerun finishes at once and a killed
sweep continues where it stopped.

Outputs in the sweep folder: ``results.csv``, ``results.md`` and a PNG plot in
the style of the paper's figure.
"""

from __future__ import annotations

import csv
import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from dllm_align.config.schema import Recipe
from dllm_align.core import console
from dllm_align.core.io import atomic_path, atomic_write_json, atomic_write_text
from dllm_align.data.imbalance import balance_weights, class_counts
from dllm_align.data.load import rows_from_section
from dllm_align.objective.base import objective_for
from dllm_align.workflows import pipeline

# lazy imports: matplotlib: an optional extra (pip install dllm-align[plot]); without it the ablation skips its plots


@dataclass
class Setting:
    name: str  # folder name
    overrides: dict  # dotted recipe keys -> values
    labels: dict  # columns of the results table


def _fmt(x: float) -> str:
    return f"{x:g}"


def baseline_settings(recipe) -> list[Setting]:
    a = recipe.ablate
    pairs = a.pairs if a.pairs else [(b, lr) for b in a.betas for lr in a.lrs]
    out = []
    for beta, lr in pairs:
        for base in a.baselines:
            out.append(
                Setting(
                    f"beta{_fmt(beta)}_lr{_fmt(lr)}_{base}",
                    {"train.beta": beta, "train.lr": lr, "train.baseline": base},
                    {"beta": beta, "lr": lr, "baseline": base},
                )
            )
    return out


def imbalance_settings(recipe, sides: list[str]) -> list[Setting]:
    a = recipe.ablate
    out = []
    for side in sides:
        for ratio in a.ratios:
            key = "data.desirable_ratio" if side == "desirable" else "data.undesirable_ratio"
            # both ratios always, so that equal settings (ratio 1 of both sweeps) have equal overrides
            ov = {"data.desirable_ratio": recipe.data.desirable_ratio, "data.undesirable_ratio": recipe.data.undesirable_ratio}
            ov[key] = ratio
            if a.balance_weights:
                sec = recipe.data.model_copy(update={key.split(".")[1]: ratio})
                rows = rows_from_section(sec, "train", quiet=True)
                lam_d, lam_u = balance_weights(rows)
                n_d, n_u = class_counts(rows)
                ov.update({"train.lambda_desirable": lam_d, "train.lambda_undesirable": lam_u})
            else:
                lam_d, lam_u = recipe.train.lambda_desirable, recipe.train.lambda_undesirable
                n_d = n_u = None
            out.append(
                Setting(
                    f"{side}_{_fmt(ratio)}",
                    ov,
                    {"subsampled": side, "ratio": ratio, "lambda_desirable": round(lam_d, 4),
                     "lambda_undesirable": round(lam_u, 4), "n_desirable": n_d, "n_undesirable": n_u},
                )
            )
    return out


def _setting_recipe(recipe, setting: Setting, folder: Path, cache: Path):
    raw = recipe.model_dump(mode="python")
    for dotted, value in setting.overrides.items():
        sec, key = dotted.split(".")
        raw[sec][key] = value
    raw["output_dir"] = str(folder)
    raw["reference"]["cache"] = str(cache)
    return Recipe.model_validate(raw)


def run_sweep(recipe, kind: str, settings: list[Setting], out_dir: Path) -> list[dict]:
    """Run every setting (skipping finished ones); returns one row per setting."""
    out_dir.mkdir(parents=True, exist_ok=True)
    shared = recipe.model_copy(deep=True)
    shared.output_dir = str(out_dir)
    cache = Path(recipe.reference.cache or out_dir / "ref_cache")
    shared.reference.cache = str(cache)
    for s in settings:
        # the shared cache holds every setting's extra rows (ELBO-KTO's kl baseline: the mismatched pairs), a
        # superset of the rows each run scores
        train = shared.train.model_copy(update={k.removeprefix("train."): v for k, v in s.overrides.items()
                                                if k.startswith("train.")})
        for key, value in objective_for(train).extra_rows_settings().items():
            setattr(shared.train, key, value)
    base_gen: Optional[Path] = None
    rows = []
    by_overrides: dict[str, dict] = {}  # settings that train the same thing (e.g. ratio 1 of both sweeps) run once
    for i, s in enumerate(settings, 1):
        folder = out_dir / s.name
        done = folder / "result.json"
        key = json.dumps(s.overrides, sort_keys=True)
        if done.exists():
            console.info(f"ablate {kind}: [{i}/{len(settings)}] {s.name}: done, reusing {done}")
            rows.append(json.loads(done.read_text()))
            by_overrides.setdefault(key, rows[-1])
            continue
        if key in by_overrides:
            twin = by_overrides[key]
            console.info(f"ablate {kind}: [{i}/{len(settings)}] {s.name}: same run as {twin['setting']}, reusing it")
            row = {**twin, "setting": s.name, **s.labels}
            atomic_write_json(done, row)
            rows.append(row)
            continue
        console.info(f"ablate {kind}: [{i}/{len(settings)}] {s.name}")
        if base_gen is None:
            pipeline.reference(shared)
            base_gen = pipeline.generations(shared, shared.model.name_or_path, out_dir / "gen.base.jsonl")
        rec = _setting_recipe(recipe, s, folder, cache)
        model = pipeline.trained_model(rec)
        gen = pipeline.generations(rec, model, folder / "gen.jsonl")
        res = pipeline.judged(rec, gen, base_gen, folder / "judge")
        head = pipeline.first_judge(res)
        row = {"setting": s.name, **s.labels, "awr": head["awr"], "ci90_low": head["ci90"][0],
               "ci90_high": head["ci90"][1], "wins": head["wins"], "losses": head["losses"],
               "ties": head["ties"], "n": head["n"]}
        atomic_write_json(done, row)
        rows.append(row)
        by_overrides[key] = row
    write_tables(rows, out_dir)
    return rows


def write_tables(rows: list[dict], out_dir: Path) -> None:
    cols = list(rows[0].keys()) if rows else []
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=cols)
    w.writeheader()
    w.writerows(rows)
    atomic_write_text(out_dir / "results.csv", buf.getvalue())
    atomic_write_text(out_dir / "results.md", markdown(rows))


def markdown(rows: list[dict]) -> str:
    if not rows:
        return ""
    label_cols = [c for c in rows[0] if c not in ("setting", "awr", "ci90_low", "ci90_high", "wins", "losses", "ties", "n")]
    head = "| " + " | ".join(label_cols + ["AWR (%)", "90% CI", "W / L / T"]) + " |"
    lines = [head, "|" + "---|" * (len(label_cols) + 3)]
    for r in rows:
        cells = [str(r[c]) for c in label_cols]
        cells += [f"{100 * r['awr']:.1f}", f"[{100 * r['ci90_low']:.1f}, {100 * r['ci90_high']:.1f}]",
                  f"{r['wins']} / {r['losses']} / {r['ties']}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        console.warn("no plot: matplotlib is not installed (pip install 'dllm-align[plot]')")
        return None
    return plt


def plot_imbalance(rows: list[dict], path: Path) -> Optional[Path]:
    """AWR vs the fraction of the subsampled class kept; one panel per class (the paper's Figure 1)."""
    plt = _pyplot()
    if plt is None:
        return None

    sides = [s for s in ("desirable", "undesirable") if any(r["subsampled"] == s for r in rows)]
    fig, axes = plt.subplots(1, len(sides), figsize=(4.2 * len(sides), 3.4), sharey=True, squeeze=False)
    for ax, side in zip(axes[0], sides):
        rs = sorted((r for r in rows if r["subsampled"] == side), key=lambda r: r["ratio"])
        x = [r["ratio"] for r in rs]
        y = [100 * r["awr"] for r in rs]
        err = [[100 * (r["awr"] - r["ci90_low"]) for r in rs], [100 * (r["ci90_high"] - r["awr"]) for r in rs]]
        ax.errorbar(x, y, yerr=err, marker="o", capsize=4, color="#1f77b4" if side == "desirable" else "#d62728")
        ax.axhline(50, color="grey", lw=0.8, ls="--")
        ax.set_xscale("log")
        ax.set_xticks(x)
        ax.set_xticklabels([f"{v:g}" for v in x])
        ax.set_xlabel(f"fraction of {side} rows kept")
        ax.set_title(f"{side} subsampled")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("AWR vs base (%) with 90% CI")
    fig.tight_layout()
    with atomic_path(path, suffix=".png") as tmp:
        fig.savefig(tmp, format="png", dpi=130)
    plt.close(fig)
    return path


def plot_baseline(rows: list[dict], path: Path) -> Optional[Path]:
    """AWR per (beta, lr) for each reference point: none, global mean, KTO's kl (the paper's Table 3 as bars)."""
    plt = _pyplot()
    if plt is None:
        return None

    keys = []
    for r in rows:
        k = (r["beta"], r["lr"])
        if k not in keys:
            keys.append(k)
    names = {"none": "no baseline", "global_mean": "global mean", "kl": "KTO's z0 (kl)"}
    bases = [b for b in names if any(r["baseline"] == b for r in rows)]
    fig, ax = plt.subplots(figsize=(1.6 + 1.6 * len(keys), 3.4))
    width = 0.8 / max(len(bases), 1)
    for j, b in enumerate(bases):
        xs, ys, lo, hi = [], [], [], []
        for i, k in enumerate(keys):
            r = next((r for r in rows if (r["beta"], r["lr"]) == k and r["baseline"] == b), None)
            if r is None:
                continue
            xs.append(i + (j - (len(bases) - 1) / 2) * width)
            ys.append(100 * r["awr"])
            lo.append(100 * (r["awr"] - r["ci90_low"]))
            hi.append(100 * (r["ci90_high"] - r["awr"]))
        ax.bar(xs, ys, width, yerr=[lo, hi], capsize=3, label=names[b])
    ax.axhline(50, color="grey", lw=0.8, ls="--")
    ax.set_xticks(range(len(keys)))
    ax.set_xticklabels([f"beta {b:g}\nlr {lr:g}" for b, lr in keys])
    ax.set_ylabel("AWR vs base (%) with 90% CI")
    ax.legend(frameon=False)
    fig.tight_layout()
    with atomic_path(path, suffix=".png") as tmp:
        fig.savefig(tmp, format="png", dpi=130)
    plt.close(fig)
    return path
