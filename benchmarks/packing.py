"""Packing: uniform mini-batches (the paper's sampling) without paying for padding.

Three ways to feed the same rows, all run through the library as a user runs it
(``reference.precompute``, then ``training.train`` on that cache), in one run:

``packed_uniform``
    uniform batches (``data.group_by_length: false``), ``data.padding: packed``:
    the K noisy copies of a micro-batch's rows packed into as few
    ``max_length`` rows as fit, block-diagonal attention;
``padded_uniform``
    uniform batches, ``padding: none``: each micro-batch padded to its longest row
    (the straightforward way to sample uniformly);
``grouped``
    length-grouped batches, ``padding: none`` (the previous default: little
    padding, but the batch statistic the baseline uses is no longer the paper's).

Rows and model: those of ``throughput.py`` (real kto-mix-14k test rows cut to a
scaled LLaDA-token length; a 2 x 64 bidirectional body with LLaDA's 126,464-word
head), K = 8, micro-batches of 4, scale 1/24 (``--quick``: 1/32, 16 rows).

Figures: positions fed to the body (K copies x padded or packed width, summed
over the forward calls of the training plan) against the real tokens (K x the
rows' lengths); training examples per second (the loop's per-step log, each
step its fastest of the repeats); precompute examples per second. Before
timing, the packed and padded precomputes are checked to give the same value for
every row and draw. Targets: ``packed_uniform`` feeds <= 1.05x the real tokens
and trains at >= 0.9x the speed of ``grouped``.

On this body the output head (126k wide, applied only at masked positions) is
most of the work and does not depend on the layout, so the training ratios sit
close to 1; on LLaDA-8B the body dominates and the positions ratio is the one
that carries over.
"""

from __future__ import annotations

import json
import math
import shutil
import tempfile
from pathlib import Path

import throughput as tp

SETTINGS = {False: (32, 1 / 24, 4, 2), True: (16, 1 / 32, 4, 1)}  # quick -> (rows, scale, batch, repeats)
CONFIGS = {  # name -> (padding, group_by_length)
    "packed_uniform": ("packed", False),
    "padded_uniform": ("none", False),
    "grouped": ("none", True),
}


def _recipe(folder: Path, root: Path, name: str, device: str, batch: int, max_length: int):
    from dllm_align.recipe import load_recipe

    padding, grouped = CONFIGS[name]
    return load_recipe(None, [
        f"model.name_or_path={folder}",
        f"data.max_length={max_length}",
        f"data.padding={padding}",
        f"data.group_by_length={str(grouped).lower()}",
        f"reference.n_mc={tp.K}",
        f"reference.batch_size={batch}",
        "reference.shard_size=100000",
        f"reference.cache={root / ('ref_cache_' + name)}",
        f"train.batch_size={batch}",
        f"train.beta={tp.BETA}",
        "train.log_every=1000000",
        f"train.mixed_precision={'bf16' if device == 'cuda' else repr('no')}",
    ], output_dir=str(root / f"run_{name}"))


def run(device: str = "cpu", quick: bool = False) -> dict:
    import torch
    from accelerate import Accelerator

    from dllm_align import reference
    from dllm_align.batching import micro_batches, plan_batches, tokens_fed
    from dllm_align.console import info
    from dllm_align.examples import make_collate
    from dllm_align.models import load_model
    from dllm_align.training import train

    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda: no CUDA device is visible")
    n_rows, scale, batch, repeats = SETTINGS[quick]
    examples = tp.load_examples(n_rows, scale)
    max_length = math.ceil(tp.MAX_LENGTH * scale)
    lengths = [e.length for e in examples]
    times: dict[str, dict[str, list]] = {n: {"train": [], "pre": []} for n in CONFIGS}
    values = {}
    with tempfile.TemporaryDirectory(prefix="dllm-bench-pack-") as tmp:
        root = Path(tmp)
        folder = tp.save_model(root / "model")
        acc = Accelerator(cpu=device == "cpu", mixed_precision="bf16" if device == "cuda" else "no")
        for rep_i in range(repeats):
            for name in CONFIGS:  # interleaved, so that load from other jobs does not land on one side only
                recipe = _recipe(folder, root, name, device, batch, max_length)
                shutil.rmtree(reference.cache_dir(recipe), ignore_errors=True)
                ref_mp = load_model(str(folder), dtype="auto", device=device)
                rep = reference.precompute(recipe, examples, make_collate(recipe, ref_mp.tokenizer), acc, ref_mp)
                del ref_mp
                times[name]["pre"].append([rep.seconds])
                cache = reference.ReferenceCache.open(reference.cache_dir(recipe))
                values[name] = cache.lookup([e.id for e in examples], tp.K)
                train(recipe, examples=examples, accelerator=acc, overwrite=True)
                rows = [json.loads(x) for x in (root / f"run_{name}" / "metrics.jsonl").read_text().splitlines()]
                times[name]["train"].append([r["seconds"] for r in rows])
            info(f"packing (run {rep_i + 1}/{repeats}): " + ", ".join(
                f"{n} train {len(examples) / sum(times[n]['train'][-1]):.2f} ex/s" for n in CONFIGS))
    tol = 2e-2 if device == "cuda" else 1e-4
    rel = float((values["packed_uniform"] - values["padded_uniform"]).abs().max() / values["padded_uniform"].abs().max())
    if rel > tol:
        raise RuntimeError(f"packed and padded precomputes differ: max relative difference {rel:.3g}")

    def fastest(runs):
        return sum(min(step) for step in zip(*runs))

    n = len(examples)
    out: dict = {}
    real = tp.K * sum(lengths[i] for b in plan_batches(lengths, batch, 0, 0, False, drop_last=True) for i in b)
    for name, (padding, grouped) in CONFIGS.items():
        plan = plan_batches(lengths, batch, 0, 0, grouped, drop_last=True)  # the loop's own plan (train.seed 0)
        fed = tokens_fed(lengths, micro_batches(plan, batch), padding, max_length, k=tp.K)
        out[name] = {
            "positions_fed": fed,
            "real_tokens": tp.K * sum(lengths[i] for b in plan for i in b),
            "train_ex_per_s": n / fastest(times[name]["train"]),
            "precompute_ex_per_s": n / fastest(times[name]["pre"]),
        }
    pu, gr, un = out["packed_uniform"], out["grouped"], out["padded_uniform"]
    return {
        "packing_positions_ratio": pu["positions_fed"] / pu["real_tokens"],
        "packing_train_vs_grouped": pu["train_ex_per_s"] / gr["train_ex_per_s"],
        "packing_padded_uniform_positions_ratio": un["positions_fed"] / un["real_tokens"],
        "packing_grouped_positions_ratio": gr["positions_fed"] / gr["real_tokens"],
        "packing_precompute_vs_padded": pu["precompute_ex_per_s"] / un["precompute_ex_per_s"],
        "packing_figures": out,
        "packing_check": {"precompute_values_max_rel_diff": rel, "tolerance": tol, "real_tokens_all": real},
        "packing_settings": {
            "device": device, "rows": n, "batch_size": batch, "n_mc": tp.K, "max_length": max_length,
            "mean_tokens_per_row": sum(lengths) / n, "repeats": repeats, "vocab": tp.VOCAB,
            "body": "Llama 2 layers x 64, bidirectional", "torch_threads": torch.get_num_threads(),
        },
    }


if __name__ == "__main__":
    import argparse
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args()
    print(json.dumps(run(a.device, a.quick), indent=2, default=str))
