"""Class imbalance (the paper's section on KTO under class imbalance): class counts, deterministic
subsampling of one class, class weights with lambda_D * n_D = lambda_U * n_U, and the weights file.
"""


from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import Iterable, Sequence

from dllm_align.core import console
from dllm_align.core.errors import UserError
from dllm_align.data.rows import KTO_RATIO_RANGE, Row, show_value


def class_counts(rows: Iterable[Row]) -> tuple[int, int]:
    """(n_desirable, n_undesirable)."""
    n_d = n_u = 0
    for r in rows:
        if r.label:
            n_d += 1
        else:
            n_u += 1
    return n_d, n_u


def _keep_count(n: int, ratio: float) -> int:
    if ratio >= 1 or n == 0:
        return n
    # Round half up; keep at least one row of a class that had some.
    return max(1, math.floor(ratio * n + 0.5))


def subsample(rows: Sequence[Row], desirable_ratio: float = 1.0, undesirable_ratio: float = 1.0, seed: int = 0) -> list[Row]:
    """Keep ``round(ratio * n)`` rows of each class (the paper's class-imbalance study).

    Which rows stay is a pure function of (seed, row id): rows are ranked by
    ``sha256(seed:id)`` and the lowest ranks are kept. So the choice does not
    depend on the file order, and with one seed a smaller ratio keeps a subset
    of what a larger ratio keeps. The kept rows are returned in their input order.
    """
    for name, r in (("desirable_ratio", desirable_ratio), ("undesirable_ratio", undesirable_ratio)):
        if not (0 < r <= 1):
            raise UserError(f"{name} must be in (0, 1], got {r}")
    keep: set[str] = set()
    for lab, ratio in ((True, desirable_ratio), (False, undesirable_ratio)):
        cls = [r for r in rows if r.label == lab]
        k = _keep_count(len(cls), ratio)
        ranked = sorted(cls, key=lambda r: hashlib.sha256(f"{seed}:{r.id}".encode("utf-8")).hexdigest())
        keep.update(r.id for r in ranked[:k])
    return [r for r in rows if r.id in keep]


def balance_weights(rows: Iterable[Row]) -> tuple[float, float]:
    """(lambda_D, lambda_U) with lambda_D * n_D = lambda_U * n_U, the larger class weighted 1.

    This is the weighting of the paper's class-imbalance study (section "KTO under
    class imbalance"). Normalisation: the class with more rows keeps weight 1 and
    the rarer class gets n_larger / n_smaller (>= 1), so the common class trains
    exactly as with default weights.
    """
    n_d, n_u = class_counts(rows)
    if n_d == 0 or n_u == 0:
        missing = "desirable" if n_d == 0 else "undesirable"
        raise UserError(f"cannot balance class weights: there are no {missing} rows")
    if n_d >= n_u:
        return 1.0, n_d / n_u
    return n_u / n_d, 1.0


def weight_ratio(n_d: int, n_u: int, lambda_d: float, lambda_u: float) -> float:
    """lambda_D * n_D / (lambda_U * n_U), the quantity the KTO paper keeps in [1, 4/3]."""
    if n_u == 0 or lambda_u == 0:
        return math.inf
    return lambda_d * n_d / (lambda_u * n_u)


def check_weight_ratio(n_d: int, n_u: int, lambda_d: float, lambda_u: float, *, warn: bool = True, chosen: bool = False) -> bool:
    """True when the class weights sit in KTO's recommended range; warns (stderr) otherwise.

    ``chosen``: the weights were set on purpose (recipe keys or a weights file), so
    the ratio is reported as information rather than as a warning.
    """
    q = weight_ratio(n_d, n_u, lambda_d, lambda_u)
    lo, hi = KTO_RATIO_RANGE
    ok = lo - 1e-9 <= q <= hi + 1e-9
    what = f"lambda_D*n_D / (lambda_U*n_U) = {lambda_d:g}*{n_d} / ({lambda_u:g}*{n_u}) = {q:.3g}"
    if not ok and warn and chosen:
        console.info(f"class weights: {what}, as the recipe chose (the KTO paper's range is [1, 4/3])")
    elif not ok and warn:
        console.warn(f"{what}, outside the KTO paper's recommended [1, 4/3] (convert --balance-weights gives 1)")
    return ok


def weights_path_for(output: str | Path) -> Path:
    """The sidecar written by ``convert --balance-weights``: ``OUT.jsonl`` -> ``OUT.weights.json``."""
    p = Path(output)
    name = p.name
    for suf in (".jsonl", ".parquet", ".json"):
        if name.endswith(suf):
            name = name[: -len(suf)]
            break
    return p.with_name(name + ".weights.json")


def read_weights_file(path: str | Path) -> tuple[float, float]:
    """(lambda_desirable, lambda_undesirable) from a ``convert --balance-weights`` sidecar."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"weights file not found: {p}", hint="write it with `dllm-align convert ... --balance-weights`")
    try:
        obj = json.loads(p.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{p}: not a valid JSON weights file ({e})") from None
    out = []
    for key in ("lambda_desirable", "lambda_undesirable"):
        v = obj.get(key) if isinstance(obj, dict) else None
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0 or not math.isfinite(v):
            raise UserError(f"{p}: '{key}' must be a positive number, got {show_value(v)}")
        out.append(float(v))
    return out[0], out[1]



