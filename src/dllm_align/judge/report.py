"""What a judge run reports: statistics per judge, answer lengths, tokens and cost,
and the results table (terminal and results.md). Pure functions of the
per-prompt outcomes and of the cache rows; see :mod:`dllm_align.judge.stats` for the
maths."""

from __future__ import annotations

import sys
from typing import Any, Mapping, Optional, Sequence

import numpy as np
from rich.console import Console
from rich.table import Table
from rich.text import Text

from dllm_align.core.io import finite_json
from dllm_align.judge import stats

LENGTH_UNIT = "characters"


def summarize_outcomes(per_judge: Mapping[str, list[Optional[int]]], *, lengths: Optional[tuple[Sequence[int], Sequence[int]]] = None,
                       bootstrap: int = 5000, seed: int = 0, anchors: Optional[Mapping[str, list]] = None,
                       difficulty: Optional[Mapping[str, list]] = None, published_difficulty: bool = False) -> dict:
    """Statistics of per-prompt outcomes (+1 / 0 / -1, ``None`` for a prompt the judge
    could not finish), one list per judge, all lists in the same prompt order.

    Returns ``{"judges": {name: {n, wins, losses, ties, awr, ci90, failed_prompts}}}``
    and, with two judges, ``"majority_vote"`` and ``"cohen_kappa": {value, ci90, n}``
    over the prompts both judges finished. With ``lengths`` (answer lengths of A
    and of B per prompt) every AWR gets its length-controlled twin ``lc_awr`` and
    ``lc_ci90`` over the same prompts. Every interval uses the same resamples
    (same ``seed``) when the prompt counts agree. ``anchors`` (per judge: a list of
    ``(outcomes, lengths)`` of B's rewrites judged against B, one entry per prompt,
    None where missing) and ``difficulty`` (per judge: a second model's outcome per
    prompt, None where missing, counted as a tie; or a published table's values, ``published_difficulty``)
    enter the LC fit
    (:func:`dllm_align.judge.stats.lc_estimate`).
    """
    la = np.asarray(lengths[0], dtype=np.float64) if lengths is not None else None
    lb = np.asarray(lengths[1], dtype=np.float64) if lengths is not None else None

    def summ(outcomes: np.ndarray, keep: np.ndarray, judge: Optional[str] = None) -> dict:
        s = stats.summarize(outcomes, n_resamples=bootstrap, seed=seed)
        if la is not None:
            if s["n"]:
                idx = np.flatnonzero(keep)
                anc = [([o[i] for i in idx], [n[i] for i in idx]) for o, n in (anchors or {}).get(judge, ())] or None
                g = (difficulty or {}).get(judge)
                g = [0 if g[i] is None else g[i] for i in idx] if g is not None else None
                e = stats.lc_estimate(outcomes, la[keep], lb[keep], anchors=anc, difficulty=g,
                                      published_difficulty=published_difficulty and g is not None,
                                      n_resamples=bootstrap, seed=seed)
                if anc is not None:
                    s["lc_anchor_rows"] = int(sum(o is not None for a, _ in anc for o in a))
                if g is not None:
                    s["lc_difficulty_missing"] = int(sum(1 for i in idx if difficulty[judge][i] is None))
                s["lc_awr"], s["lc_ci90"], s["lc_withheld"], s["lc_vif"] = e["lc_awr"], e["ci90"], e["withheld"], e["vif"]
            else:
                s["lc_awr"], s["lc_ci90"], s["lc_withheld"], s["lc_vif"] = None, None, None, None
        return s

    out: dict[str, Any] = {"judges": {}}
    for j, outs in per_judge.items():
        keep = np.array([o is not None for o in outs], dtype=bool)
        done = np.array([o for o in outs if o is not None], dtype=np.int8)
        s = summ(done, keep, j)
        s["failed_prompts"] = len(outs) - len(done)
        out["judges"][j] = s
    if len(per_judge) == 2:
        l1, l2 = per_judge.values()
        keep = np.array([a is not None and b is not None for a, b in zip(l1, l2)], dtype=bool)
        o1 = np.array([a for a, b in zip(l1, l2) if a is not None and b is not None], dtype=np.int8)
        o2 = np.array([b for a, b in zip(l1, l2) if a is not None and b is not None], dtype=np.int8)
        out["majority_vote"] = summ(stats.majority_vote(o1, o2), keep)
        if o1.size:
            lo, hi = stats.kappa_ci(o1, o2, n_resamples=bootstrap, seed=seed)
            out["cohen_kappa"] = {"value": stats.cohen_kappa(o1, o2), "ci90": [lo, hi], "n": int(o1.size)}
        else:
            out["cohen_kappa"] = {"value": None, "ci90": None, "n": 0}
    return out


def length_report(len_a: Sequence[int], len_b: Sequence[int], threshold: float) -> dict:
    """Mean and median answer length of each side, and whether the means differ by
    more than ``threshold`` (relative to the shorter side's mean)."""
    a, b = stats.length_summary(len_a), stats.length_summary(len_b)
    rel = None
    if a["mean"] is not None and min(a["mean"], b["mean"]) > 0:
        rel = (a["mean"] - b["mean"]) / min(a["mean"], b["mean"])
    return {"unit": LENGTH_UNIT, "a": a, "b": b, "relative_difference": rel, "threshold": threshold,
            "beyond_threshold": rel is not None and abs(rel) > threshold, "balance": stats.lc_balance(len_a, len_b)}


def usage_report(rows: list[dict], prices: Mapping[str, Sequence[float]], batch_price_factor: float) -> dict:
    """Tokens per judge from the cache rows used by this result, and the cost when
    a price (USD per million prompt / completion tokens) is given for the judge or
    for ``*``; tokens of batch judgements are charged at ``batch_price_factor``."""
    usage: dict[str, dict] = {}
    for row in rows:
        u = usage.setdefault(row["judge"], {"judgements": 0, "live": 0, "batch": 0, "prompt_tokens": 0, "completion_tokens": 0})
        u["judgements"] += 1
        mode = "batch" if row.get("mode") == "batch" else "live"
        u[mode] += 1
        cu = row.get("usage") or {}
        for f in ("prompt_tokens", "completion_tokens"):
            if isinstance(cu.get(f), int):
                u[f] += cu[f]
                u.setdefault(f"{mode}_{f}", 0)
                u[f"{mode}_{f}"] += cu[f]
    for j, u in usage.items():
        price = prices.get(j, prices.get("*"))
        if price is not None:
            p_in, p_out = float(price[0]), float(price[1])
            live = u.get("live_prompt_tokens", 0) * p_in + u.get("live_completion_tokens", 0) * p_out
            batch = u.get("batch_prompt_tokens", 0) * p_in + u.get("batch_completion_tokens", 0) * p_out
            u["price_per_mtok"] = [p_in, p_out]
            u["cost_usd"] = (live + batch_price_factor * batch) / 1e6
    return dict(sorted(usage.items()))


# =========================================================================== tables
def _pct(x: Optional[float]) -> str:
    return "-" if x is None else f"{100 * x:.2f}"


def _ci_pct(ci: Optional[list]) -> str:
    return "-" if ci is None else f"[{100 * ci[0]:.2f}, {100 * ci[1]:.2f}]"


LENGTH_MARK = "†"
HEADERS = ["Judge", "AWR (%)", "90% CI", "LC-AWR (%)", "LC 90% CI", "wins", "losses", "ties", "n"]


def table_rows(results: dict) -> list[list[str]]:
    """Rows ``[judge, AWR %, 90% CI, LC-AWR %, LC CI, wins, losses, ties, n]``, as in the
    paper's Tables 1 and 2 plus the length-controlled columns. The AWR carries
    :data:`LENGTH_MARK` when the two sides' mean lengths differ beyond the threshold."""
    mark = LENGTH_MARK if (results.get("lengths") or {}).get("beyond_threshold") else ""

    def row(name: str, r: dict) -> list[str]:
        awr = _pct(r["awr"]) + (mark if r["awr"] is not None else "")
        return [name, awr, _ci_pct(r["ci90"]), _pct(r.get("lc_awr")), _ci_pct(r.get("lc_ci90")),
                str(r["wins"]), str(r["losses"]), str(r["ties"]), str(r["n"])]

    rows = [row(j, r) for j, r in results["judges"].items()]
    if "majority_vote" in results:
        rows.append(row("MV (two judges)", results["majority_vote"]))
    if "cohen_kappa" in results:
        k = results["cohen_kappa"]
        v = "-" if k["value"] is None else f"{k['value']:.3f}"
        ci = "-" if k["ci90"] is None else f"[{k['ci90'][0]:.3f}, {k['ci90'][1]:.3f}]"
        rows.append(["Cohen's kappa", v, ci, "", "", "", "", "", str(k["n"])])
    return rows


def length_line(results: dict) -> Optional[str]:
    ln = results.get("lengths")
    if not ln or ln["a"]["mean"] is None:
        return None
    a, b = ln["a"], ln["b"]
    line = (f"Answer length ({ln['unit']}), mean / median: A {a['mean']:.0f} / {a['median']:.0f}, "
            f"B {b['mean']:.0f} / {b['median']:.0f}")
    if ln["beyond_threshold"]:
        longer, rel = ("A", ln["relative_difference"]) if ln["relative_difference"] > 0 else ("B", -ln["relative_difference"])
        line += (f". {LENGTH_MARK} {longer}'s answers are {100 * rel:.0f}% longer on average (more than "
                 f"{100 * ln['threshold']:.0f}%): a judge that favours length inflates the AWR; read the LC-AWR beside it.")
    bal = ln.get("balance")
    if bal and bal["a_longer_share"] is not None:
        line += f". A's answer is the longer one on {100 * bal['a_longer_share']:.1f}% of prompts ({bal['a_longer']} A, {bal['b_longer']} B, {bal['equal']} equal)"
    withheld = sorted({name for name, r in [*results["judges"].items(), ("MV", results.get("majority_vote") or {})]
                       if r.get("lc_withheld")})
    if withheld:
        r = next(r for r in [*results["judges"].values(), results.get("majority_vote") or {}] if r.get("lc_withheld"))
        line += f". LC-AWR withheld ({', '.join(withheld)}): {r['lc_withheld']}"
    return line


def usage_lines(results: dict) -> list[str]:
    lines = []
    for j, u in (results.get("usage") or {}).items():
        s = (f"{j}: {u['judgements']} judgements ({u['live']} live, {u['batch']} batch), "
             f"{u['prompt_tokens']:,} prompt + {u['completion_tokens']:,} completion tokens")
        if "cost_usd" in u:
            s += f", ${u['cost_usd']:.4f}"
        lines.append(s)
    return lines


def results_markdown(results: dict) -> str:
    lines = [
        "# Pairwise judging",
        "",
        f"A = `{results['a']}` vs B = `{results['b']}`, {results['n']} prompts, each judged in both orders.",
        "",
        "| " + " | ".join(HEADERS) + " |",
        "|" + "|".join(["---"] + ["---:"] * (len(HEADERS) - 1)) + "|",
    ]
    lines += ["| " + " | ".join(r) + " |" for r in table_rows(results)]
    lines += [
        "",
        "AWR = (wins of A + 0.5 ties) / n; A wins a prompt only if both orders prefer it, B likewise, else a tie. "
        f"90% CI: 5th and 95th percentiles of {results['settings']['bootstrap_resamples']} bootstrap resamples of prompts "
        f"(seed {results['settings']['seed']}). MV: a win or loss only when both judges agree on it, else a tie. "
        "LC-AWR: the AWR predicted at zero length difference by a logistic regression of the outcome on "
        "tanh(standardised length difference), A-longer and B-longer prompts weighted equally, refitted on each of the "
        "same resamples; withheld (-) when the data cannot tell the length slope from the intercept (variance "
        "inflation above 4) or, with neither length anchors nor a difficulty term, when the length correction "
        "exceeds 5 points. See docs/judging.md for how it compares with AlpacaEval's figure.",
    ]
    ln = length_line(results)
    if ln:
        lines += ["", ln]
    if results.get("usage"):
        lines += ["", "Tokens: " + "; ".join(usage_lines(results)) + "."]
    if results["failed_judgements"]:
        unj = results.get("unjudgeable_judgements") or 0
        lines += ["", f"**{results['failed_judgements']} judgement(s) failed**"
                  + (f" ({unj} unjudgeable: the judge gave no verdict even when asked for it alone)" if unj else "")
                  + "; their prompts are excluded for that judge (see n)."]
    return "\n".join(lines) + "\n"


def print_table(results: dict, file=None) -> None:
    """The results as a rich table (percent), on stdout by default."""
    con = Console(file=file or sys.stdout, highlight=False, soft_wrap=False)
    if not con.is_terminal:  # piped or captured: room for every column rather than wrapped intervals
        con = Console(file=file or sys.stdout, highlight=False, soft_wrap=False, width=max(con.width, 150))
    title = Text(f"A = {results['a']}  vs  B = {results['b']}  ({results['n']} prompts)")
    t = Table(title=title, title_justify="left")
    for i, h in enumerate(HEADERS):
        t.add_column(h, justify="left" if i == 0 else "right")
    rows = table_rows(results)
    n_judges = len(results["judges"])
    for i, r in enumerate(rows):
        # rules between the judges, the majority vote and kappa, as in the paper's Table 2
        end = i + 1 < len(rows) and (i == n_judges - 1 or rows[i + 1][0] == "Cohen's kappa")
        t.add_row(*(Text(c) for c in r), end_section=end)
    con.print(t)
    ln = length_line(results)
    if ln:
        con.print(Text(ln))


def strict_results(results: dict) -> dict:
    """results.json as strict JSON: a number these data leave undefined (an interval over one prompt, the odds when
    one side wins every judgement) is null, and ``undefined`` says which and why."""
    results, found = finite_json(results)
    if found:
        results["undefined"] = {where: f"{what}: not defined for these data (too few prompts, or one side won or lost "
                                       f"every judgement)" for where, what in found.items()}
    return results
