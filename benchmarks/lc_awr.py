"""Checks of the length-controlled AWR (:func:`dllm_align.judge.stats.lc_estimate`).

``alpacaeval DIR``: AlpacaEval 2's published per-prompt annotations (``weighted_alpaca_eval_gpt4_turbo``,
baseline gpt4_1106_preview) against its published LC figures. DIR holds ``<model>.json`` copies of
``results/<model>/weighted_alpaca_eval_gpt4_turbo/annotations.json`` from a checkout of
tatsu-lab/alpaca_eval (kept outside this repository); the published LC figures are read from the same
checkout's leaderboard CSV (``--leaderboard``). The preference (1 = baseline, 2 = model, fractional) is
fitted as it is: y = preference - 1, d = len(model) - len(baseline) in characters. Each model is fitted
without anchors, and with the instruction-difficulty term taken from a second model's preferences on
the same prompts (``2 y - 1``).

``simulate``: data sets with a known length-free truth. Each prompt has a quality gap q_i ~ N(mu, 1) and a
length difference d_i; the judge's two-order outcome is a win with probability
sigmoid(q_i + b tanh(d_i / s)) squared-ish (two independent orders, both must agree), a loss likewise, a
tie otherwise; the truth is the AWR the same judge gives at d = 0 (computed exactly by averaging over
a large draw of q). Anchors are B rewritten longer and shorter, q = 0, judged by the same judge. Reports
coverage of the 90% interval, how often the figure is withheld, and the RMSE, per scenario.

    python benchmarks/lc_awr.py alpacaeval /tmp/ae --leaderboard /tmp/alpaca_eval_leaderboard.csv
    python benchmarks/lc_awr.py simulate --sets 40 --resamples 400
    python benchmarks/lc_awr.py simulate --sets 200 --resamples 300 --only "balanced, length-loving, anchors"
"""

from __future__ import annotations

import argparse
import csv
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


def alpacaeval(args) -> None:
    published = {}
    with open(args.leaderboard) as f:
        for r in csv.DictReader(f):
            published[r[""]] = (float(r["win_rate"]), float(r["length_controlled_winrate"] or "nan"))
    files = sorted(Path(args.dir).glob("*.json"))
    data = {p.stem: _load(p) for p in files}
    print("| model | prompts | model longer | AlpacaEval win rate | AlpacaEval LC | ours: win rate | ours: LC, no anchors [90% CI] "
          "| VIF | ours: LC + difficulty (from) [90% CI] |")
    print("|---|---:|---:|---:|---:|---:|---|---:|---|")
    names = sorted(data)
    for m in names:
        ids, y, d = data[m]
        other = args.second if args.second != m else args.second_alt
        est = stats.lc_from_preferences(d, y, n_resamples=args.resamples, seed=0)
        pos = {k: i for i, k in enumerate(data[other][0])}
        g = np.array([2 * data[other][1][pos[k]] - 1 if k in pos else 0.0 for k in ids])
        est_g = stats.lc_from_preferences(d, y, difficulty=g, n_resamples=args.resamples, seed=0)
        wr, lc = published.get(m, (float("nan"), float("nan")))

        def fmt(e):
            if e["lc_awr"] is None:
                return "withheld"
            return f"{100 * e['lc_awr']:.1f} [{100 * e['ci90'][0]:.1f}, {100 * e['ci90'][1]:.1f}]"

        print(f"| {m} | {d.size} | {int((d > 0).sum())} | {wr:.1f} | {lc:.1f} | {100 * y.mean():.1f} | {fmt(est)} "
              f"| {est['vif']:.3g} | {fmt(est_g)} ({other}) |")


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
    a.add_argument("--second", default="gpt-3.5-turbo-1106", help="the model whose preferences give the difficulty term")
    a.add_argument("--second-alt", default="claude-2.1", help="the second model for --second itself")
    a.add_argument("--resamples", type=int, default=1000)
    s = sub.add_parser("simulate")
    s.add_argument("--sets", type=int, default=40)
    s.add_argument("--n", type=int, default=400)
    s.add_argument("--resamples", type=int, default=400)
    s.add_argument("--only", action="append", metavar="SCENARIO", help="only this scenario (repeatable; its name as the table prints it)")
    args = ap.parse_args()
    unknown = [x for x in (getattr(args, "only", None) or []) if x not in SCENARIOS]
    if unknown:
        ap.error(f"unknown scenario(s) {', '.join(map(repr, unknown))}; choose from {'; '.join(SCENARIOS)}")
    alpacaeval(args) if args.what == "alpacaeval" else simulate(args)


if __name__ == "__main__":
    main()
