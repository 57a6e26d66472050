"""Reward agreement between the two block scorings (``data.block_scoring``) on the demo_block toy.

Run: ``PYTHONPATH=src python benchmarks/block_scoring.py POLICY_DIR [--rows 12]`` with POLICY_DIR a trained
``final/`` of ``dllm-align demo --recipe demo_block`` (the reference is the recipe's base). For the first
``--rows`` training rows it prints the implicit reward beta (ELBO_policy - ELBO_ref) under the published layout
(reply + end-of-turn tail + filler to whole blocks, all scored: what SDAR's trainer scores) and under
``completion_only``, each ELBO by exact enumeration of every mask of the scored tokens with t on [1e-3, 1)
(at most 16 scored tokens per row), then the mean |difference|, the mean |published reward|, their
correlation and how many rows keep their sign.
"""

from __future__ import annotations

import argparse
import json

import torch


def exact_elbo(mp, ex, block_size: int, eps: float = 1e-3, chunk: int = 512) -> float:
    """The exact block ELBO of one example (every mask of its completion, weights ``mask_weight``)."""
    from dllm_align.objective.block import draw_terms_2l, hf_forward, mask_weight

    x0 = torch.tensor(ex.prompt_ids + ex.completion_ids)
    idx = list(range(len(ex.prompt_ids), len(x0)))
    n = len(idx)
    if n > 16:
        raise SystemExit(f"{ex.id}: {n} scored tokens; exact enumeration takes at most 16")
    masks = torch.tensor([[bits >> j & 1 for j in range(n)] for bits in range(1, 1 << n)], dtype=torch.bool)
    weights = torch.tensor([mask_weight(int(m.sum()), n, eps) for m in masks], dtype=torch.float64)
    fwd = hf_forward(mp.model)
    total = 0.0
    for s in range(0, len(masks), chunk):
        m = torch.zeros(len(masks[s:s + chunk]), len(x0), dtype=torch.bool)
        m[:, idx] = masks[s:s + chunk]
        xt = torch.where(m, torch.full(m.shape, mp.mask_token_id, dtype=torch.long), x0[None].expand(m.shape))
        with torch.no_grad():
            terms = draw_terms_2l(fwd, x0, xt, m, torch.ones(len(m)), block_size)
        total += float((terms.double() * weights[s:s + chunk]).sum())
    return total


def main() -> None:
    from dllm_align.config.recipe import load_recipe
    from dllm_align.data.examples import block_layout_for
    from dllm_align.data.load import rows_from_section
    from dllm_align.data.tokenize import tokenize_rows
    from dllm_align.models.load import load_model

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("policy")
    ap.add_argument("--rows", type=int, default=12)
    args = ap.parse_args()
    rec = load_recipe("demo_block")
    pol, ref = load_model(args.policy), load_model(rec.model.name_or_path)
    tok, b, beta = ref.tokenizer, ref.block_size, rec.train.beta
    rows = rows_from_section(rec.data, "train", quiet=True)[: args.rows]
    published = tokenize_rows(rows, tok, rec.data, block=block_layout_for(rec.data, tok, b))
    only = tokenize_rows(rows, tok, rec.data.model_copy(update={"block_scoring": "completion_only"}), block=None)
    rp, rc = [], []
    for ep, ec in zip(published, only):
        rp.append(beta * (exact_elbo(pol, ep, b) - exact_elbo(ref, ep, b)))
        rc.append(beta * (exact_elbo(pol, ec, b) - exact_elbo(ref, ec, b)))
        print(f"{ep.id}\tpublished {rp[-1]:+.4f}\tcompletion_only {rc[-1]:+.4f}", flush=True)
    p, c = torch.tensor(rp), torch.tensor(rc)
    print(json.dumps({"rows": len(rp), "mean_abs_difference": round(float((p - c).abs().mean()), 3),
                      "mean_abs_published_reward": round(float(p.abs().mean()), 3),
                      "correlation": round(float(torch.corrcoef(torch.stack([p, c]))[0, 1]), 3),
                      "same_sign": int(((p > 0) == (c > 0)).sum())}))


if __name__ == "__main__":
    main()
