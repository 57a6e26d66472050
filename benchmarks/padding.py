"""Padding: model positions fed per epoch over the real kto-mix-14k test rows.

Token counts come from a characters-per-token model (CHARS_PER_TOKEN, about
what LLaMA-3-class BPE tokenizers, LLaDA's included, give on English text;
the byte-level tiny tokenizer's counts are reported too). Prompt = the chat
template's rendering of the prompt messages plus the generation header;
completion = the reply plus the end-of-turn token; rows capped at 4,096.

The straightforward method is the paper's: every row right-padded to 4,096.
Ours: ``data.padding: none`` with length-grouped micro-batches of 8 rows (the
paper's global batch), each padded only to its longest row.
"""

from __future__ import annotations

import math
from pathlib import Path

CHARS_PER_TOKEN = 4.0
MAX_LENGTH = 4096
MICRO = 8
REPO = Path(__file__).resolve().parents[1]


def _lengths(folder: Path, tokenize) -> list[int]:
    from dllm_align.data.load import load_unpaired

    rows = load_unpaired(str(folder / "chosen.jsonl"), label=True, quiet=True) + load_unpaired(
        str(folder / "rejected.jsonl"), label=False, quiet=True
    )
    return [min(tokenize(r), MAX_LENGTH) for r in rows]


def run(device: str = "cpu", size: str = "full") -> dict:
    """Every size counts all the rows: it takes seconds and needs no model."""
    from dllm_align.data.batching import padding_costs
    from dllm_align.models.load import build_tiny_tokenizer
    from dllm_align.data.public import Unavailable, kto_mix_test

    try:
        # ../shared beside the checkout, a cached copy, or the hub through `datasets`
        folder = kto_mix_test(REPO)
    except Unavailable as e:
        return {"padding_skipped": f"kto-mix-14k test split unavailable: {e}"}
    tok = build_tiny_tokenizer()

    def chat_chars(r) -> int:
        rendered = tok.apply_chat_template(r.prompt, tokenize=False, add_generation_prompt=True)
        return len(rendered) + len(r.completion)

    out = {}
    for name, fn in (
        ("cpt", lambda r: math.ceil(chat_chars(r) / CHARS_PER_TOKEN) + 1),
        ("bytes", lambda r: len(tok.apply_chat_template(r.prompt, add_generation_prompt=True, tokenize=True))
         + len(r.completion.encode("utf-8")) + 1),
    ):
        lengths = _lengths(folder, fn)
        costs = padding_costs(lengths, MAX_LENGTH, MICRO, MICRO, seed=0)
        out[name] = {"rows": len(lengths), **costs}
    c = out["cpt"]
    return {
        "padding_ratio": c["none_grouped"] / c["real"],
        "padding_ratio_paper": c["paper"] / c["real"],
        "padding_ratio_ungrouped": c["none_random"] / c["real"],
        "padding_ratio_bytes": out["bytes"]["none_grouped"] / out["bytes"]["real"],
        "padding_settings": {
            "rows": c["rows"], "chars_per_token": CHARS_PER_TOKEN, "max_length": MAX_LENGTH,
            "micro_batch": MICRO, "real_tokens": c["real"], "paper_tokens": c["paper"],
            "ours_tokens": c["none_grouped"], "data": str(folder),
        },
    }


if __name__ == "__main__":
    import json

    print(json.dumps(run(), indent=2))
