"""Which likelihood ranks held-out rows better on the LLaDA2.1 toy: the block ELBO or the masked-plus-replaced bound.

Run: ``PYTHONPATH=src python benchmarks/llada21_bound_auc.py POLICY_DIR [--prompts 200] [--draws 8]
[--mask-share 0.5]`` with POLICY_DIR a trained ``final/`` of ``dllm-align demo --recipe demo_llada21`` (the
reference is the recipe's base). For the held-out prompts' desirable (ascending) and undesirable (descending) rows
it estimates each row's margin, log-likelihood under the policy minus under the reference, twice with the same
draws for policy and reference (common random numbers), both through ``objective.elbo.elbo_draws``, the call every
command makes, with the draws a recipe's ``reference`` section gives:

* ``block``: the block ELBO the family trains with (the default likelihood);
* ``hybrid``: the likelihood ``reference.likelihood: hybrid`` selects, minus the bound for masked-plus-replaced
  corruption (``reference.hybrid.mask_share`` of the corrupted positions masked, the rest replaced by a uniform real
  token; every completion position of each noisy block read, given the clean blocks before it).

It prints, per likelihood, the AUC of the margins (the chance that a desirable row's margin exceeds an undesirable
row's; ties count half) and the share of prompts whose desirable row has the larger margin.
"""

from __future__ import annotations

import argparse
import json

import torch


def auc(pos: list[float], neg: list[float]) -> float:
    a, b = torch.tensor(pos)[:, None], torch.tensor(neg)[None, :]
    return float(((a > b).double() + 0.5 * (a == b).double()).mean())


def main() -> None:
    from dllm_align.config.recipe import load_recipe
    from dllm_align.data.examples import block_layout_for
    from dllm_align.data.load import rows_from_section
    from dllm_align.data.tokenize import tokenize_rows
    from dllm_align.models.load import load_model
    from dllm_align.objective.draws import DrawConfig
    from dllm_align.objective.elbo import elbo_draws

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("policy")
    ap.add_argument("--prompts", type=int, default=200)
    ap.add_argument("--draws", type=int, default=8)
    ap.add_argument("--mask-share", type=float, default=0.5)
    ap.add_argument("--reference", default=None, help="the reference model (default: the recipe's base)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    rec = load_recipe("demo_llada21")
    pol, ref = load_model(args.policy), load_model(args.reference or rec.model.name_or_path)
    tok, b = ref.tokenizer, ref.block_size
    rows = rows_from_section(rec.data, "test", quiet=True)[: 2 * args.prompts]
    examples = tokenize_rows(rows, tok, rec.data, block=block_layout_for(rec.data, tok, b), quiet=True)
    # the draws of the recipe as shipped (the family's likelihood) and of the recipe selecting the bound
    chosen = load_recipe("demo_llada21", ["reference.likelihood=hybrid", f"reference.hybrid.mask_share={args.mask_share}"])
    cfgs = {"block": DrawConfig.from_reference(rec.reference, args.draws),
            "hybrid": DrawConfig.from_reference(chosen.reference, args.draws)}
    margins = {"block": {}, "hybrid": {}}
    for ex in examples:
        ids = torch.tensor(ex.prompt_ids + ex.completion_ids)[None]
        cm = torch.zeros_like(ids, dtype=torch.bool)
        cm[0, len(ex.prompt_ids):] = True
        for name, cfg in cfgs.items():
            with torch.no_grad():
                both = [float(elbo_draws(m, ids, None, cm, [ex.id], cfg).mean()) for m in (pol, ref)]
            margins[name][ex.id] = both[0] - both[1]
    labels = {ex.id: ex.label for ex in examples}
    report = {"prompts": args.prompts, "draws": args.draws, "mask_share": args.mask_share}
    for name, m in margins.items():
        good = [v for i, v in m.items() if labels[i]]
        bad = [v for i, v in m.items() if not labels[i]]
        # the paired layout's unpaired rows: PROMPT_ID:chosen and PROMPT_ID:rejected
        pairs = [(m[i], m[i.replace(":chosen", ":rejected")]) for i in m
                 if labels[i] and i.replace(":chosen", ":rejected") in m]
        report[name] = {"auc": round(auc(good, bad), 4),
                        "paired_share": round(sum(d > u for d, u in pairs) / max(1, len(pairs)), 4),
                        "mean_margin_desirable": round(sum(good) / len(good), 4),
                        "mean_margin_undesirable": round(sum(bad) / len(bad), 4)}
    print(json.dumps(report))


if __name__ == "__main__":
    main()
