"""`dllm-align data stats`: counts, lengths and the padding cost of a data set.
"""


from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Optional, Sequence

import numpy as np

from dllm_align.data.imbalance import class_counts
from dllm_align.data.rows import Row
from dllm_align.data.tokenize import fit, tokenize_with_report

# lazy imports: dllm_align.data.batching: it imports torch, which `data stats` without a tokenizer never needs


# --------------------------------------------------------------------------- stats
def _percentiles(values: Sequence[int]) -> dict[str, float]:
    if not values:
        return {}
    a = np.asarray(values)
    out = {"min": int(a.min())}
    for q in (50, 90, 95, 99):
        out[f"p{q}"] = int(np.percentile(a, q, method="nearest"))
    out["max"] = int(a.max())
    out["mean"] = round(float(a.mean()), 1)
    return out


def dataset_stats(
    rows: Sequence[Row],
    tokenizer,
    data_section,
    batch_size: int,
    global_batch_size: Optional[int] = None,
    seed: int = 0,
) -> dict:
    """Counts, token-length percentiles and the tokens each padding choice feeds (``data stats``).

    Lengths are reported before truncation (what the data holds) and the padding
    costs after it (what training would see with ``data_section``).
    """
    from dllm_align.data.batching import padding_costs

    raw, _ = tokenize_with_report(
        rows, tokenizer, SimpleNamespace(
            max_length=1 << 62, max_prompt_length=None, truncation="completion",
            end_of_turn=getattr(data_section, "end_of_turn", "scored"),
        )
    )
    bos = tokenizer.bos_token_id
    fitted = []
    dropped = prompt_cut = completion_cut = 0
    for e in raw:
        f = fit(e.prompt_ids, [e.completion_ids], data_section.max_length, data_section.max_prompt_length, data_section.truncation, bos)
        if f is None:
            dropped += 1
            continue
        prompt_cut += f[2]
        completion_cut += f[3][0]
        fitted.append(len(f[0]) + len(f[1][0]))
    n_d, n_u = class_counts(rows)
    costs = padding_costs(fitted, data_section.max_length, batch_size, global_batch_size, seed) if fitted else {}
    return {
        "rows": len(rows),
        "desirable": n_d,
        "undesirable": n_u,
        "pairs": len({r.pair_id for r in rows if r.pair_id is not None}),
        "distinct_prompts": len({json.dumps(r.prompt, sort_keys=True) for r in rows}),
        "tokens": {
            "prompt": _percentiles([len(e.prompt_ids) for e in raw]),
            "completion": _percentiles([len(e.completion_ids) for e in raw]),
            "total": _percentiles([e.length for e in raw]),
        },
        "max_length": data_section.max_length,
        "max_prompt_length": data_section.max_prompt_length,
        "truncation": data_section.truncation,
        "over_max_length": sum(e.length > data_section.max_length for e in raw),
        "prompt_cut": prompt_cut,
        "completion_cut": completion_cut,
        "dropped": dropped,
        "rows_kept": len(fitted),
        "batch_size": batch_size,
        "global_batch_size": global_batch_size or batch_size,
        "seed": seed,
        "tokens_fed": costs,
    }

