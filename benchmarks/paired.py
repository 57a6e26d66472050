"""Speed ratios from repeated paired measurements, and how ``run.py`` judges them against a target.

A speed ratio measured once on a shared machine moves with whatever else runs (on this project's CPU the
fast sampler gave 2.0x, 3.0x and 5.1x in three runs minutes apart). Each benchmark that reports one
therefore repeats the paired measurement (both sides in one process, interleaved, so a burst of load
lands on both) and reports the median ratio with its spread (min-max over the repeats) under
``<key>_spread``. ``run.py`` judges the target on the median and says ``straddles`` when the spread
reaches both sides of the target.
"""

from __future__ import annotations

import statistics


def spread(ratios: list[float]) -> dict:
    """The median ratio, its min-max and interquartile range over the repeats, and the ratios themselves."""
    if not ratios:
        raise ValueError("no repeats measured")
    s = sorted(ratios)
    q = statistics.quantiles(s, n=4, method="inclusive") if len(s) > 1 else [s[0]] * 3
    return {"median": statistics.median(s), "min": s[0], "max": s[-1], "q1": q[0], "q3": q[2], "repeats": len(s),
            "ratios": list(ratios)}


def verdict(check, median: float, sp: dict | None, results: dict) -> str:
    """``yes`` / ``NO`` on the median; ``straddles`` when the repeats' range holds values on both sides of the
    target (then the median decides only which way it leans: ``yes, spread straddles`` or ``straddles (median
    misses)``)."""
    met = check(median, results)
    if sp is None or sp["repeats"] < 2:
        return "yes" if met else "NO"
    ends = {check(sp["min"], results), check(sp["max"], results)}
    if ends == {True, False}:
        return "yes, spread straddles" if met else "straddles (median misses)"
    return "yes" if met else "NO"
