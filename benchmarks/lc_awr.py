"""Checks of the length-controlled AWR (:func:`dllm_align.judge.stats.lc_estimate`).

``alpacaeval DIR``: AlpacaEval 2's published per-prompt annotations (``weighted_alpaca_eval_gpt4_turbo``,
baseline gpt4_1106_preview) against its published LC figures. DIR holds ``<model>.json`` copies of
``results/<model>/weighted_alpaca_eval_gpt4_turbo/annotations.json`` from a checkout of
tatsu-lab/alpaca_eval (kept outside this repository); the published LC figures are read from the same
checkout's leaderboard CSV (``--leaderboard``). The preference (1 = baseline, 2 = model, fractional) is
fitted as it is: y = preference - 1, d = len(model) - len(baseline) in characters. Each model is fitted
without anchors, once with no difficulty term and once with AlpacaEval's per-instruction difficulty, looked
up by instruction text (:func:`dllm_align.judge.stats.difficulty_lookup`): AlpacaEval's own
``instruction_difficulty.csv`` (``--difficulty``; it lives on the HF Hub, tatsu-lab/alpaca_eval) or, where
that cannot be fetched, the difficulty re-estimated from the published GLM weights (``--weights``) and the
tune split's annotations. The models are split in two by a hash of the name (:func:`split_of`), fixed
before either giving rule was chosen; ``--search`` prints the grids the rules were chosen from (the tune split
only: the held-out models are not fitted), one for the fit with the difficulty term (variance inflation,
interval width) and one for the plain fit (variance inflation, length correction |LC - AWR|, the interval's
margin as a share of it); the default run prints the figures under the library's rules for both splits: share
given, error against the published LC (mean and worst), how often the 90% interval holds it, and what becomes
of gpt4_gamed (AlpacaEval's length-gamed entry).

``simulate``: data sets with a known length-free truth. Each prompt has a quality gap q_i ~ N(mu, 1) and a
length difference d_i; the judge's two-order outcome is a win with probability
sigmoid(q_i + b tanh(d_i / s)) squared-ish (two independent orders, both must agree), a loss likewise, a
tie otherwise; the truth is the AWR the same judge gives at d = 0 (computed exactly by averaging over
a large draw of q). Anchors are B rewritten longer and shorter, q = 0, judged by the same judge. Reports
coverage of the 90% interval, how often the figure is withheld, and the RMSE, per scenario.

    python benchmarks/lc_awr.py alpacaeval /tmp/ae --leaderboard /tmp/leaderboard.csv --weights /tmp/weights.csv
    python benchmarks/lc_awr.py simulate --sets 40 --resamples 400
    python benchmarks/lc_awr.py simulate --sets 200 --resamples 300 --only "balanced, length-loving, anchors"
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import json
import sys
from pathlib import Path

import numpy as np

from dllm_align.judge import stats


def _load(path: Path) -> tuple[list[str], np.ndarray, np.ndarray]:
    rows = json.loads(path.read_text())
    rows = [r for r in rows if r.get("preference") not in (None, "")]
    ids = [r["instruction"] for r in rows]
    y = np.array([float(r["preference"]) for r in rows]) - 1.0
    y = np.where(y == -1.0, 0.5, y)  # a preference of 0 is AlpacaEval's draw
    d = np.array([len(r["output_2"] or "") - len(r["output_1"] or "") for r in rows], dtype=np.float64)
    return ids, np.clip(y, 0.0, 1.0), d


BASELINE = "gpt4_1106_preview"
W_LEN, W_DIFF, W_BIAS = "np.tanh(std_delta_len)", "instruction_difficulty", "not_gamed_baseline.astype(float)"


def split_of(model: str) -> str:
    """The fixed split, made before the giving rule was chosen: the first byte of sha256(name), even -> tune."""
    return "tune" if hashlib.sha256(model.encode()).digest()[0] % 2 == 0 else "held-out"


def _difficulty_from_weights(data: dict, models: list[str], weights: dict, order: list[str]) -> np.ndarray:
    """AlpacaEval's per-instruction difficulty re-estimated from its published GLM weights: with each model's
    published (bias, length slope, difficulty slope) held fixed, g_i maximises the likelihood of those models'
    preferences on instruction i (a one-dimensional fit per instruction; ridge 0.1 keeps an instruction every
    model wins or loses finite). The models are the tune split only, so held-out figures do not use their
    own annotations twice."""
    pos = {k: i for i, k in enumerate(order)}
    idx, y, off, slope = [], [], [], []
    for m in models:
        ins, ym, dm = data[m]
        bias, phi, psi = weights[m]
        x = np.tanh(-dm / dm.std(ddof=1))  # AlpacaEval's delta is len(baseline) - len(model)
        idx.append(np.array([pos[k] for k in ins]))
        y.append(ym)
        off.append(bias + phi * x)
        slope.append(np.full(ym.size, psi))
    idx, y, off, slope = map(np.concatenate, (idx, y, off, slope))
    g, n = np.zeros(len(order)), len(order)
    for _ in range(100):
        p = 1.0 / (1.0 + np.exp(-(off + slope * g[idx])))
        grad = np.bincount(idx, slope * (y - p), n) - 0.1 * g
        hess = np.bincount(idx, slope * slope * p * (1 - p), n) + 0.1
        step = np.clip(grad / hess, -2, 2)
        g += step
        if np.abs(step).max() < 1e-9:
            break
    return g


def _read_difficulty(args, data: dict, tune: list[str]) -> tuple[dict, str]:
    """``instruction_key -> difficulty`` and where it came from."""
    order = next(data[m][0] for m in sorted(data) if len(data[m][0]) == 805)  # every full file has this order
    if args.difficulty:
        with open(args.difficulty) as f:
            vals = {int(r["index"]): float(r["instruction_difficulty"]) for r in csv.DictReader(f)}
        g = np.array([vals[i] for i in range(len(order))])
        source = f"AlpacaEval's instruction_difficulty.csv ({args.difficulty})"
    else:
        weights = {}
        with open(args.weights) as f:
            for r in csv.DictReader(f):
                weights[r[""]] = (float(r[W_BIAS]), float(r[W_LEN]), float(r[W_DIFF]))
        fit = [m for m in tune if m in weights and m != BASELINE]
        g = _difficulty_from_weights(data, fit, weights, order)
        source = f"re-estimated from AlpacaEval's published GLM weights and the {len(fit)} tune models' annotations"
    table = {stats.instruction_key(k): float(v) for k, v in zip(order, g)}
    if args.weights:
        source += "; " + _fidelity(args, g)
    return table, source


def _fidelity(args, g: np.ndarray) -> str:
    """How near a difficulty vector comes to the published one: AlpacaEval's LC of every leaderboard model
    with published weights is mean_i sigmoid(bias + psi g_i); recomputed with ``g`` against the published LC."""
    with open(args.weights) as f:
        weights = {r[""]: (float(r[W_BIAS]), float(r[W_DIFF])) for r in csv.DictReader(f)}
    with open(args.leaderboard) as f:
        lc = {r[""]: float(r["length_controlled_winrate"]) for r in csv.DictReader(f) if r["length_controlled_winrate"]}
    out = []
    for part in ("tune", "held-out"):
        err = np.abs([100 * np.mean(1 / (1 + np.exp(-(b + psi * g)))) - lc[m] for m, (b, psi) in weights.items()
                      if m in lc and m != BASELINE and split_of(m) == part])
        out.append(f"{part}: {err.size} leaderboard models, mean |error| {err.mean():.2f}, worst {err.max():.2f}")
    return "AlpacaEval's own LC recomputed with this difficulty and the published weights: " + "; ".join(out)


def _row_estimate(d, y, g, resamples):
    est = stats.lc_from_preferences(d, y, difficulty=g, published_difficulty=g is not None, n_resamples=resamples, seed=0)
    return {k: est[k] for k in ("lc_awr", "ci90", "vif", "withheld")}


def _summary(rows: list[dict], key: str) -> str:
    given = [r for r in rows if r[key]["lc_awr"] is not None]
    if not given:
        return f"0/{len(rows)} given"
    err = np.array([100 * r[key]["lc_awr"] - r["published_lc"] for r in given])
    cov = sum(100 * r[key]["ci90"][0] <= r["published_lc"] <= 100 * r[key]["ci90"][1] for r in given)
    return (f"{len(given)}/{len(rows)} given ({100 * len(given) / len(rows):.0f}%), MAE {np.abs(err).mean():.1f}, "
            f"worst {np.abs(err).max():.1f}, within 5 points {int((np.abs(err) <= 5).sum())}/{len(given)}, "
            f"90% interval holds the published LC {cov}/{len(given)} ({100 * cov / len(given):.0f}%)")


def _search(rows: list[dict]) -> None:
    """The grids the giving rules were chosen from, on the tune split only (fits made with no bounds)."""
    print("| fit | VIF at most | interval at most (points) | given | worst error | interval holds the published LC | meets the targets |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for key in ("difficulty",):
        for v in (4, 6, 8, 10, 15, float("inf")):
            for w in (5, 7.5, 10, 12.5, 15, 17.5, 20, float("inf")):
                g = [r for r in rows if r[key]["vif"] <= v and 100 * (r[key]["ci90"][1] - r[key]["ci90"][0]) <= w]
                if not g:
                    continue
                err = np.abs([100 * r[key]["lc_awr"] - r["published_lc"] for r in g])
                cov = sum(100 * r[key]["ci90"][0] <= r["published_lc"] <= 100 * r[key]["ci90"][1] for r in g)
                ok = err.max() <= 5 and cov >= 0.85 * len(g)
                print(f"| {key} | {v:g} | {w:g} | {len(g)}/{len(rows)} | {err.max():.1f} | {cov}/{len(g)} | {'yes' if ok else 'no'} |")
    # the fit with neither anchors nor a difficulty term: given when VIF <= V and the length correction
    # |LC - AWR| <= T points, its bootstrap interval widened on both sides by k times that correction
    print("\n| fit | VIF at most | correction at most (points) | margin (share of the correction) | given | worst error "
          "| interval holds the published LC | meets the targets |")
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    for v in (4, 6, 8, float("inf")):
        for t in (3, 4, 5, 6, 7, 8, 10, float("inf")):
            for k in (0, 0.25, 0.5, 0.75, 1.0):
                g = [r for r in rows if r["plain"]["vif"] <= v and abs(100 * r["plain"]["lc_awr"] - r["ours_wr"]) <= t]
                if not g:
                    continue
                err = np.abs([100 * r["plain"]["lc_awr"] - r["published_lc"] for r in g])
                cov = 0
                for r in g:
                    m = k * abs(100 * r["plain"]["lc_awr"] - r["ours_wr"])
                    cov += 100 * r["plain"]["ci90"][0] - m <= r["published_lc"] <= 100 * r["plain"]["ci90"][1] + m
                ok = err.max() <= 5 and cov >= 0.85 * len(g)
                print(f"| plain | {v:g} | {t:g} | {k:g} | {len(g)}/{len(rows)} | {err.max():.1f} | {cov}/{len(g)} "
                      f"| {'yes' if ok else 'no'} |")


def alpacaeval(args) -> None:
    published = {}
    with open(args.leaderboard) as f:
        for r in csv.DictReader(f):
            if r["length_controlled_winrate"]:
                published[r[""]] = (float(r["win_rate"]), float(r["length_controlled_winrate"]))
    data = {p.stem: _load(p) for p in sorted(Path(args.dir).glob("*.json"))}
    names = [m for m in sorted(data) if m in published and m != BASELINE]
    tune = [m for m in names if split_of(m) == "tune"]
    table, source = _read_difficulty(args, data, tune)
    print(f"difficulty: {source}\n")
    if args.write_table:  # the table `dllm-align judge --difficulty-table` reads (kept outside the repository)
        with open(args.write_table, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["instruction_sha256", "difficulty"])
            w.writerows(sorted(table.items()))
    if args.search:  # every fit given with its bare bootstrap interval, so the grid sees them all
        stats.LC_MAX_VIF = stats.LC_DIFFICULTY_MAX_VIF = stats.LC_MAX_CI_WIDTH = stats.LC_MAX_CORRECTION = float("inf")
        stats.LC_CORRECTION_MARGIN = 0.0
        names = tune  # the held-out models are not even fitted while the rule is chosen
    rows = []
    for m in names:
        ids, y, d = data[m]
        g, matched = stats.difficulty_lookup(ids, table)
        plain = _row_estimate(d, y, None, args.resamples)
        with_g = _row_estimate(d, y, g, args.resamples)
        rows.append({"model": m, "split": split_of(m), "prompts": int(d.size), "longer": int((d > 0).sum()),
                     "win_rate": published[m][0], "published_lc": published[m][1], "ours_wr": 100 * float(y.mean()),
                     "plain": plain, "difficulty": with_g, "matched": matched})
        print(f"{m}: {with_g}", file=sys.stderr, flush=True)
    if args.dump:
        Path(args.dump).write_text(json.dumps(rows, indent=1))
    if args.search:
        _search([r for r in rows if r["split"] == "tune"])
        return

    def fmt(e):
        if e["lc_awr"] is None:
            return "withheld"
        return f"{100 * e['lc_awr']:.1f} [{100 * e['ci90'][0]:.1f}, {100 * e['ci90'][1]:.1f}]"

    print("| model | split | model longer | AlpacaEval win rate | AlpacaEval LC | ours: win rate | ours: LC, plain [90% CI] "
          "| ours: LC + AlpacaEval difficulty, rule [90% CI] | VIF |")
    print("|---|---|---:|---:|---:|---:|---|---|---:|")
    for r in sorted(rows, key=lambda r: (r["split"] != "tune", r["model"])):
        e = r["difficulty"]
        print(f"| {r['model']} | {r['split']} | {r['longer']}/{r['prompts']} | {r['win_rate']:.1f} | {r['published_lc']:.1f} "
              f"| {r['ours_wr']:.1f} | {fmt(r['plain'])} | {fmt(e)} | {e['vif']:.3g} |")
    print()
    for part in ("tune", "held-out"):
        sub = [r for r in rows if r["split"] == part]
        print(f"- {part} ({len(sub)} models), plain fit and its giving rule: {_summary(sub, 'plain')}")
        print(f"- {part} ({len(sub)} models), with the difficulty term and the giving rule: {_summary(sub, 'difficulty')}")
    for r in rows:
        if r["model"] == "gpt4_gamed":  # AlpacaEval's length-gamed entry: no rule may give it
            print(f"- gpt4_gamed (published LC {r['published_lc']:.1f}): plain fit {fmt(r['plain'])}"
                  f"{' (' + r['plain']['withheld'] + ')' if r['plain']['withheld'] else ''}; with the difficulty term "
                  f"{fmt(r['difficulty'])}{' (' + r['difficulty']['withheld'] + ')' if r['difficulty']['withheld'] else ''}")


# --------------------------------------------------------------------------- simulation
SCENARIOS = {
    # name: (quality mean mu, length bias b, share of prompts where A is longer, anchors?)
    "balanced, length-blind judge": (0.5, 0.0, 0.5, False),
    "balanced, length-loving judge": (0.5, 1.5, 0.5, False),
    "lopsided 80/20, length-loving": (0.0, 1.5, 0.8, False),
    "lopsided 96/4, length-loving": (-1.0, 1.5, 0.96, False),
    "lopsided 100/0, length-loving": (0.5, 1.5, 1.0, False),
    "lopsided 96/4, length-loving, anchors": (-1.0, 1.5, 0.96, True),
    "lopsided 100/0, length-loving, anchors": (0.5, 1.5, 1.0, True),
    "balanced, length-loving, anchors": (0.5, 1.5, 0.5, True),
}


def _p_pref(z):
    return 1.0 / (1.0 + np.exp(-z))


def _two_order(rng, z):
    """Two independent judgements of the same pair; a win when both prefer A, a loss when both prefer B."""
    p = _p_pref(z)
    a1, a2 = rng.random(z.shape) < p, rng.random(z.shape) < p
    return np.where(a1 & a2, 1, np.where(~a1 & ~a2, -1, 0)).astype(np.int8)


def _truth(mu: float) -> float:
    q = np.random.default_rng(12345).normal(mu, 1.0, 2_000_000)
    p = _p_pref(q)
    return float((p * p + 0.5 * 2 * p * (1 - p)).mean())  # E[win + tie / 2] at d = 0


def _draw(rng, n, mu, b, share, anchors):
    longer = rng.random(n) < share
    mag = rng.lognormal(6.0, 0.6, n)
    d = np.where(longer, mag, -mag)
    lb = rng.lognormal(6.5, 0.4, n)
    la = np.maximum(lb + d, 1.0)
    d = la - lb
    s = np.std(d) if np.std(d) > 0 else 1.0
    q = rng.normal(mu, 1.0, n)
    o = _two_order(rng, q + b * np.tanh(d / s))
    anc = None
    if anchors:
        anc = []
        for sign in (1, -1):
            dl = sign * rng.lognormal(6.0, 0.6, n)
            lr = np.maximum(lb + dl, 1.0)
            anc.append((_two_order(rng, b * np.tanh((lr - lb) / s)).tolist(), lr.tolist()))
    return o, la, lb, anc


def simulate(args) -> None:
    print(f"{args.sets} data sets of {args.n} prompts per scenario, {args.resamples} bootstrap resamples each\n")
    print("| scenario | truth (%) | AWR mean (%) | LC given | 90% CI covers truth (of given) | LC RMSE (pp) | AWR RMSE (pp) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, (mu, b, share, anchors) in SCENARIOS.items():
        if args.only and name not in args.only:
            continue
        truth = _truth(mu)
        rng = np.random.default_rng(7)
        given = cover = 0
        err, awr_err, awrs = [], [], []
        for _ in range(args.sets):
            o, la, lb, anc = _draw(rng, args.n, mu, b, share, anchors)
            e = stats.lc_estimate(o, la, lb, anchors=anc, n_resamples=args.resamples, seed=0)
            a = stats.awr(o)
            awrs.append(a)
            awr_err.append(a - truth)
            if e["lc_awr"] is not None:
                given += 1
                cover += e["ci90"][0] <= truth <= e["ci90"][1]
                err.append(e["lc_awr"] - truth)
        rmse = f"{100 * np.sqrt(np.mean(np.square(err))):.1f}" if err else "-"
        cov = f"{cover}/{given} ({100 * cover / given:.0f}%)" if given else "-"
        print(f"| {name} | {100 * truth:.1f} | {100 * np.mean(awrs):.1f} | {given}/{args.sets} | {cov} | {rmse} "
              f"| {100 * np.sqrt(np.mean(np.square(awr_err))):.1f} |")
        sys.stdout.flush()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="what", required=True)
    a = sub.add_parser("alpacaeval")
    a.add_argument("dir")
    a.add_argument("--leaderboard", required=True)
    a.add_argument("--weights", help="AlpacaEval's published GLM weights (metrics/weights/weighted_alpaca_eval_gpt4_turbo/"
                   "length_controlled_v1/baseline_gpt4_1106_preview.csv): the difficulty is re-estimated from them")
    a.add_argument("--difficulty", help="AlpacaEval's instruction_difficulty.csv (index, instruction_difficulty), used as it is")
    a.add_argument("--resamples", type=int, default=1000)
    a.add_argument("--dump", help="write the per-model figures here (JSON)")
    a.add_argument("--write-table", metavar="CSV", help="write the difficulty table (instruction_sha256, difficulty) for judge --difficulty-table")
    a.add_argument("--search", action="store_true", help="print the grid the giving rule was chosen from (tune split)")
    s = sub.add_parser("simulate")
    s.add_argument("--sets", type=int, default=40)
    s.add_argument("--n", type=int, default=400)
    s.add_argument("--resamples", type=int, default=400)
    s.add_argument("--only", action="append", metavar="SCENARIO", help="only this scenario (repeatable; its name as the table prints it)")
    args = ap.parse_args()
    unknown = [x for x in (getattr(args, "only", None) or []) if x not in SCENARIOS]
    if unknown:
        ap.error(f"unknown scenario(s) {', '.join(map(repr, unknown))}; choose from {'; '.join(SCENARIOS)}")
    if args.what == "alpacaeval" and not (args.weights or args.difficulty):
        ap.error("alpacaeval needs --difficulty or --weights")
    alpacaeval(args) if args.what == "alpacaeval" else simulate(args)


if __name__ == "__main__":
    main()
