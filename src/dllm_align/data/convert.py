"""Paired -> unpaired conversion (`dllm-align convert`) and writing rows atomically as JSONL or Parquet.
"""


from __future__ import annotations

import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from dllm_align.core import console
from dllm_align.core.errors import UserError
from dllm_align.core.io import atomic_path, atomic_write_bytes, atomic_write_json, check_not_input, note_input
from dllm_align.data.rows import Format, Row
from dllm_align.data.imbalance import balance_weights, check_weight_ratio, class_counts, subsample, weights_path_for
from dllm_align.data.load import load_unpaired

# lazy imports: pyarrow: slow to import, and only a Parquet output needs it


# --------------------------------------------------------------------------- writing
def write_rows(rows: Sequence[Row], output: str | Path) -> Path:
    """Write rows atomically as JSONL, or Parquet when the name ends in ``.parquet``."""
    out = Path(output)
    if out.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        table = pa.Table.from_pylist(
            [{"id": r.id, "prompt": r.prompt, "completion": r.completion, "label": r.label, "pair_id": r.pair_id} for r in rows],
            schema=pa.schema(
                [
                    ("id", pa.string()),
                    ("prompt", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
                    ("completion", pa.string()),
                    ("label", pa.bool_()),
                    ("pair_id", pa.string()),
                ]
            ),
        )
        with atomic_path(out, suffix=".parquet") as tmp:
            pq.write_table(table, tmp)
    elif out.suffix == ".jsonl":
        buf = io.BytesIO()
        for r in rows:
            buf.write((json.dumps(r.to_dict(), ensure_ascii=False) + "\n").encode("utf-8"))
        atomic_write_bytes(out, buf.getvalue())
    else:
        raise UserError(f"{out}: output must end in .jsonl or .parquet")
    return out


# --------------------------------------------------------------------------- convert
@dataclass
class ConvertSummary:
    rows_in: int
    n_desirable: int
    n_undesirable: int
    output: Path
    weights: Optional[tuple[float, float]] = None
    weights_file: Optional[Path] = None


def convert(
    source: str | Path,
    output: str | Path,
    *,
    split: Optional[str] = None,
    format: Format = "auto",
    label: Optional[bool] = None,
    skip_invalid: bool = False,
    desirable_ratio: float = 1.0,
    undesirable_ratio: float = 1.0,
    seed: int = 0,
    balance: bool = False,
    limit: Optional[int] = None,
) -> ConvertSummary:
    """``dllm-align convert``: any layout -> validated unpaired rows, optionally subsampled and weighted.

    Nothing is written unless every step succeeds; the data file and the weights
    sidecar (:func:`weights_path_for`) are each written atomically.
    """
    out = Path(output)
    if out.suffix not in (".jsonl", ".parquet"):
        raise UserError(f"{out}: output must end in .jsonl or .parquet")

    src = Path(str(source)).expanduser()
    if src.is_file():  # refused before reading; files found inside a folder are guarded as they are read
        note_input(src, "input data")
    check_not_input(out)
    check_not_input(weights_path_for(out))
    for name, r in (("--desirable-ratio", desirable_ratio), ("--undesirable-ratio", undesirable_ratio)):
        if not (0 < r <= 1):
            raise UserError(f"{name} must be in (0, 1], got {r}")
    rows = load_unpaired(source, split=split, format=format, label=label, skip_invalid=skip_invalid)
    n_in = len(rows)
    if limit is not None:
        rows = rows[:limit]
    n_d0, n_u0 = class_counts(rows)
    if desirable_ratio < 1 or undesirable_ratio < 1:
        rows = subsample(rows, desirable_ratio, undesirable_ratio, seed)
    n_d, n_u = class_counts(rows)
    if (n_d, n_u) != (n_d0, n_u0):
        console.info(
            f"subsampled with seed {seed}: desirable {n_d0:,} -> {n_d:,} (ratio {desirable_ratio:g}), "
            f"undesirable {n_u0:,} -> {n_u:,} (ratio {undesirable_ratio:g})"
        )
    weights = balance_weights(rows) if balance else None
    write_rows(rows, out)
    console.info(f"wrote {out}: {len(rows):,} rows ({n_d:,} desirable, {n_u:,} undesirable)")
    wfile = None
    if weights is not None:
        wfile = weights_path_for(out)
        atomic_write_json(
            wfile,
            {
                "lambda_desirable": weights[0],
                "lambda_undesirable": weights[1],
                "n_desirable": n_d,
                "n_undesirable": n_u,
                "rule": "lambda_desirable * n_desirable = lambda_undesirable * n_undesirable; the larger class has weight 1",
                "data": out.name,
                "desirable_ratio": desirable_ratio,
                "undesirable_ratio": undesirable_ratio,
                "seed": seed,
            },
        )
        console.info(
            f"wrote {wfile}: lambda_desirable {weights[0]:.6g}, lambda_undesirable {weights[1]:.6g} "
            f"(set data.weights_file: {wfile})"
        )
    elif n_d and n_u:
        check_weight_ratio(n_d, n_u, 1.0, 1.0)
    return ConvertSummary(n_in, n_d, n_u, out, weights, wfile)



