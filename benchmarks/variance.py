"""Estimator variance: Var(r_hat) with independent masks vs shared masks vs shared + stratified l.

r_hat = B_hat_policy - B_hat_ref with K = 8 draws (the paper's kto-mix setting).
Policy and reference: when the demo's base model is given (``--models BASE
POLICY``) those two; by default the built-in tiny model and a copy whose
weights are moved by 0.25 x their init scale (a policy some way into
training). Rows: 24 real kto-mix-14k test rows (truncated to 160 tokens with
the byte tokenizer) - short enough for CPU. For each row, r_hat is computed
R times with different mask seeds; the per-row variance is averaged over rows.
"""

from __future__ import annotations

import copy
from pathlib import Path

N_MC = 8
REPO = Path(__file__).resolve().parents[1]


def _examples(folder: Path, tok, n_rows: int):
    from dllm_align.data.load import load_unpaired
    from dllm_align.config.schema import DataSection
    from dllm_align.data.tokenize import tokenize_rows

    rows = load_unpaired(str(folder / "chosen.jsonl"), label=True, quiet=True)[:n_rows]
    section = DataSection(max_length=160, truncation="prompt_left", max_prompt_length=96)
    return tokenize_rows(rows, tok, section, quiet=True)


def run(device: str = "cpu", quick: bool = False) -> dict:
    import numpy as np
    import torch

    from dllm_align.data.batching import collate
    from dllm_align.objective.elbo import DrawConfig, elbo_draws
    from dllm_align.data.public import Unavailable, kto_mix_test
    from dllm_align.models.load import load_model

    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda: no CUDA device is visible")
    try:
        data = kto_mix_test(REPO)
    except Unavailable as e:
        return {"variance_skipped": f"kto-mix-14k test split unavailable: {e}"}
    ref = load_model("builtin:tiny", device=device, dtype="auto")  # bf16 on CUDA, fp32 on CPU
    pol = copy.deepcopy(ref)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in pol.model.parameters():
            p.add_(torch.randn(p.shape, generator=g).to(p.device) * 0.005)
    n_rows, R = (8, 12) if quick else (24, 30)
    exs = _examples(data, ref.tokenizer, n_rows)
    batch = collate(exs, "none", 160, ref.tokenizer.pad_token_id)
    batch = {k: (v.to(device) if torch.is_tensor(v) else v) for k, v in batch.items()}

    def bhat(mp, seed, stratified):
        cfg = DrawConfig(n_mc=N_MC, seed=seed, stratified=stratified)
        with torch.no_grad():
            return elbo_draws(mp, batch["input_ids"], batch["attention_mask"], batch["completion_mask"],
                              batch["ids"], cfg).mean(1).double().cpu().numpy()

    indep, shared, strat = [], [], []
    for r in range(R):
        p_plain = bhat(pol, r, False)
        indep.append(p_plain - bhat(ref, 100_000 + r, False))
        shared.append(p_plain - bhat(ref, r, False))
        strat.append(bhat(pol, r, True) - bhat(ref, r, True))
    v = {k: float(np.var(np.stack(x), axis=0, ddof=1).mean()) for k, x in
         (("indep", indep), ("shared", shared), ("strat", strat))}
    return {
        "variance_ratio_shared": v["shared"] / v["indep"],
        "variance_ratio_stratified": v["strat"] / v["indep"],
        "variance_independent": v["indep"],
        "variance_shared": v["shared"],
        "variance_shared_stratified": v["strat"],
        "variance_settings": {"rows": n_rows, "repeats": R, "n_mc": N_MC, "policy": "tiny + N(0, 0.005^2) weight noise",
                              "device": device, "dtype": str(next(ref.model.parameters()).dtype).removeprefix("torch.")},
    }


if __name__ == "__main__":
    import json

    print(json.dumps(run(), indent=2))
