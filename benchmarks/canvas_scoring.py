"""Reward agreement between DiffusionGemma's two canvas scorings (``data.block_scoring``) on the demo_gemma toy.

Run: ``PYTHONPATH=src python benchmarks/canvas_scoring.py [POLICY ...] [--rows 64] [--draws 256] [--json OUT]``
with each POLICY a trained ``final/`` of ``dllm-align demo --recipe demo_gemma`` (the reference is the recipe's
base, ``builtin:toy-sort-base-gemma``). For the first ``--rows`` training rows of the recipe it scores every row
twice: in the published layout (reply, ``<turn|>\\n``, EOS to the end of the last canvas, all noised and scored:
what TRL's DiffusionGemma example trains and ``generate`` decodes) and ``completion_only`` (the reply and
``<turn|>``, the last canvas partial). Each ELBO is the mean of ``--draws`` draws of the recipe's uniform-noise
estimator; policy and reference share the draws (the same noisy canvases), as training does.

It prints, for the base, the correlation of the two scorings' ELBOs; for each policy, the implicit reward
beta (ELBO_policy - ELBO_ref) under each scoring, how many rows the two scorings give the same sign, their
Pearson and Spearman correlations (scipy), the mean |difference| against the mean |published reward|, and
per scoring how many rewards have the label's sign (positive for a desirable row, negative for an undesirable
one). ``--json OUT`` writes the same figures and the settings.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from cli_args import Parser, check_json_out  # benchmarks/ is on the path when this script runs

RECIPE = "demo_gemma"
MAX_ROWS, MAX_DRAWS = 4000, 4096


def check_args(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Every flag checked before any model is loaded or anything is written."""
    if not 1 <= args.rows <= MAX_ROWS:
        ap.error(f"--rows {args.rows}: a number of rows from 1 to {MAX_ROWS} (the recipe's training set)")
    if not 2 <= args.draws <= MAX_DRAWS:
        ap.error(f"--draws {args.draws}: a number of draws from 2 to {MAX_DRAWS}")
    if not 1 <= args.batch <= 1024:
        ap.error(f"--batch {args.batch}: rows per forward, from 1 to 1024")
    for p in args.policy:
        if not p.startswith("builtin:") and not (Path(p).is_dir() and (Path(p) / "config.json").is_file()):
            ap.error(f"{p}: not a model folder (a trained final/ with a config.json) nor a builtin: name")
    check_json_out(ap, args.json)


def elbos(mp, examples, cfg, batch: int):
    """Per-row, per-draw ELBOs [n, K] (float64 numpy) of ``examples`` under ``mp``."""
    import numpy as np
    import torch

    from dllm_align.data.batching import collate
    from dllm_align.data.tokenize import pad_token_id
    from dllm_align.objective.elbo import elbo_draws

    out = []
    for s in range(0, len(examples), batch):
        b = collate(examples[s:s + batch], padding="none", max_length=10**6, pad_id=pad_token_id(mp.tokenizer))
        with torch.no_grad():
            out.append(elbo_draws(mp, b["input_ids"], b["attention_mask"], b["completion_mask"], b["ids"], cfg)
                       .double().numpy())
    return np.concatenate(out)


def compare(p, c, labels) -> dict:
    """Agreement of two reward vectors (published ``p``, completion-only ``c``) over the same rows."""
    import numpy as np
    from scipy import stats

    want = np.where(labels, 1.0, -1.0)
    return {"rows": int(len(p)), "same_sign": int(((p > 0) == (c > 0)).sum()),
            "pearson": round(float(stats.pearsonr(p, c)[0]), 3), "spearman": round(float(stats.spearmanr(p, c)[0]), 3),
            "mean_abs_difference": round(float(np.abs(p - c).mean()), 3),
            "mean_abs_published": round(float(np.abs(p).mean()), 3),
            "mean_abs_completion_only": round(float(np.abs(c).mean()), 3),
            "label_sign_published": int((np.sign(p) == want).sum()),
            "label_sign_completion_only": int((np.sign(c) == want).sum())}


def main(argv=None) -> int:
    ap = Parser(description=__doc__.splitlines()[0])
    ap.add_argument("policy", nargs="*", help="trained final/ folders of demo --recipe demo_gemma")
    ap.add_argument("--rows", type=int, default=64, help="the first N training rows of the recipe (default 64)")
    ap.add_argument("--draws", type=int, default=256, help="noise draws per row, shared by policy and reference")
    ap.add_argument("--batch", type=int, default=16, help="rows per forward")
    ap.add_argument("--json", metavar="OUT", help="write the figures and settings as JSON")
    args = ap.parse_args(argv)
    check_args(ap, args)

    import numpy as np

    from dllm_align.config.recipe import load_recipe
    from dllm_align.data.examples import block_layout_for
    from dllm_align.data.load import rows_from_section
    from dllm_align.data.tokenize import tokenize_rows
    from dllm_align.models.load import load_model
    from dllm_align.objective.draws import DrawConfig

    rec = load_recipe(RECIPE)
    ref = load_model(rec.model.name_or_path)
    tok, C, beta = ref.tokenizer, ref.canvas_length, rec.train.beta
    rows = rows_from_section(rec.data, "train", quiet=True)[: args.rows]
    published = tokenize_rows(rows, tok, rec.data, quiet=True, block=block_layout_for(rec.data, tok, None, C))
    only = rec.data.model_copy(update={"block_scoring": "completion_only"})
    completion_only = tokenize_rows(rows, tok, only, quiet=True, block=block_layout_for(only, tok, None, C))
    labels = np.array([bool(e.label) for e in published])
    cfg = DrawConfig.from_reference(rec.reference, args.draws)
    base = {name: elbos(ref, exs, cfg, args.batch) for name, exs in
            (("published", published), ("completion_only", completion_only))}
    from scipy import stats

    bp, bc = base["published"].mean(1), base["completion_only"].mean(1)
    result = {"recipe": RECIPE, "reference": rec.model.name_or_path, "canvas_length": C, "beta": beta,
              "rows": len(rows), "draws": args.draws,
              "completion_tokens": {"published": sorted({len(e.completion_ids) for e in published}),
                                    "completion_only": sorted({len(e.completion_ids) for e in completion_only})},
              "base": {"mean_elbo_published": round(float(bp.mean()), 3),
                       "mean_elbo_completion_only": round(float(bc.mean()), 3),
                       "pearson": round(float(stats.pearsonr(bp, bc)[0]), 3),
                       "spearman": round(float(stats.spearmanr(bp, bc)[0]), 3)},
              "policies": {}}
    print(f"base {rec.model.name_or_path}: ELBO published {bp.mean():.3f}, completion_only {bc.mean():.3f} "
          f"(mean over {len(rows)} rows); pearson {result['base']['pearson']}, spearman {result['base']['spearman']}",
          flush=True)
    for path in args.policy:
        pol = load_model(path)
        rewards, se = {}, {}
        for name, exs in (("published", published), ("completion_only", completion_only)):
            d = beta * (elbos(pol, exs, cfg, args.batch) - base[name])  # [n, K]: the shared draws' differences
            rewards[name] = d.mean(1)
            se[name] = d.std(1, ddof=1) / np.sqrt(d.shape[1])
        fig = compare(rewards["published"], rewards["completion_only"], labels)
        fig["mean_mc_se_published"] = round(float(se["published"].mean()), 4)
        fig["mean_mc_se_completion_only"] = round(float(se["completion_only"].mean()), 4)
        result["policies"][path] = fig
        print(f"{path}: {json.dumps(fig)}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
