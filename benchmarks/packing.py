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

Rows: those of ``throughput.py`` (real kto-mix-14k test rows cut to a scaled
LLaDA-token length), K = 8, micro-batches of 4, scale 1/24 (``--quick``: 1/32,
16 rows; ``--smoke``: 1/64, 8 rows). Two models, each run through all three layouts:

``head``   the throughput model: a 2 x 64 bidirectional body under LLaDA's
           126,464-word head, where the head (applied only at masked positions,
           the same for every layout) is most of the work;
``body``   a 4 x 256 body under the byte-level tiny vocabulary (262 words),
           where the body is most of the work, as in LLaDA-8B (its head is ~6%
           of the FLOPs): the layout's positions then show in the speed.

Figures: positions fed to the body (K copies x padded or packed width, summed
over the forward calls of the training plan) against the real tokens (K x the
rows' lengths); training examples per second (the loop's per-step log, each layout's
rate the median over the repeats); precompute examples per second. Each repeat runs every layout in turn and
gives one ratio per pair compared; the headline ratios are their medians, with the spread under
``<key>_spread`` (``benchmarks/paired.py``). Before
timing, the packed and padded precomputes are checked to give the same value for
every row and draw. Targets: ``packed_uniform`` feeds <= 1.05x the real tokens
and trains at >= 0.9x the speed of ``grouped``.

The headline ratios (``packing_train_vs_grouped``, ``packing_precompute_vs_padded``)
are the ``body`` model's; the ``head`` model's are reported beside them.
"""

from __future__ import annotations

import json
import math
import shutil
import statistics
import tempfile
from pathlib import Path

import throughput as tp
from paired import spread

# size -> (rows, scale, batch, paired repeats: one ratio each, benchmarks/paired.py)
SETTINGS = {"full": (32, 1 / 24, 4, 3), "quick": (16, 1 / 32, 4, 2), "smoke": (8, 1 / 64, 4, 1)}
CONFIGS = {  # name -> (padding, group_by_length)
    "packed_uniform": ("packed", False),
    "padded_uniform": ("none", False),
    "grouped": ("none", True),
}


def save_body_model(folder: Path):
    """A body-dominated bidirectional model (4 x 256, the tiny tokenizer's vocabulary), random init, seed 0."""
    import torch
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM

    from dllm_align.models.load import build_tiny_tokenizer, require_transformers

    require_transformers(transformers.__version__)  # older releases make the body causal
    transformers.utils.logging.disable_progress_bar()  # save_pretrained's bar is noise on stderr
    tok = build_tiny_tokenizer()
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=4096,
                      is_causal=False, tie_word_embeddings=False, bos_token_id=tok.bos_token_id,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    cfg.mask_token_id = tok.mask_token_id
    LlamaForCausalLM(cfg).save_pretrained(str(folder))
    tok.save_pretrained(str(folder))
    return folder


def _recipe(folder: Path, root: Path, name: str, device: str, batch: int, max_length: int):
    from dllm_align.config.recipe import load_recipe

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


def run(device: str = "cpu", size: str = "full") -> dict:
    import torch
    from accelerate import Accelerator

    from dllm_align.training import cache, reference
    from dllm_align.data.batching import micro_batches, plan_batches, tokens_fed
    from dllm_align.core.console import info
    from dllm_align.data.examples import make_collate
    from dllm_align.data.public import Unavailable, kto_mix_test
    from dllm_align.models.load import load_model
    from dllm_align.training.train import train

    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda: no CUDA device is visible")
    try:
        data = kto_mix_test(tp.REPO)
    except Unavailable as e:
        return {"packing_skipped": f"kto-mix-14k test split unavailable: {e}"}
    n_rows, scale, batch, repeats = SETTINGS[size]
    examples = tp.load_examples(data, n_rows, scale)
    max_length = math.ceil(tp.MAX_LENGTH * scale)
    lengths = [e.length for e in examples]
    models = {"body": save_body_model, "head": tp.save_model}
    times = {(m, n): {"train": [], "pre": []} for m in models for n in CONFIGS}
    values = {}
    with tempfile.TemporaryDirectory(prefix="dllm-bench-pack-") as tmp:
        root = Path(tmp)
        folders = {m: save(root / f"model_{m}") for m, save in models.items()}
        acc = Accelerator(cpu=device == "cpu", mixed_precision="bf16" if device == "cuda" else "no")
        for rep_i in range(repeats):
            for m, folder in folders.items():
                for name in CONFIGS:  # interleaved, so that load from other jobs does not land on one side only
                    recipe = _recipe(folder, root, name, device, batch, max_length)
                    shutil.rmtree(cache.cache_dir(recipe), ignore_errors=True)
                    ref_mp = load_model(str(folder), dtype="auto", device=device)
                    rep = reference.precompute(recipe, examples, make_collate(recipe, ref_mp.tokenizer), acc, ref_mp)
                    del ref_mp
                    times[m, name]["pre"].append([rep.seconds])
                    ref_cache = cache.ReferenceCache.open(cache.cache_dir(recipe))
                    values[m, name] = ref_cache.lookup([e.id for e in examples], tp.K)
                    train(recipe, examples=examples, accelerator=acc, overwrite=True)
                    rows = [json.loads(x) for x in (root / f"run_{name}" / "metrics.jsonl").read_text().splitlines()]
                    times[m, name]["train"].append([r["seconds"] for r in rows])
                info(f"packing ({m} model, run {rep_i + 1}/{repeats}): " + ", ".join(
                    f"{n} train {len(examples) / sum(times[m, n]['train'][-1]):.2f} ex/s" for n in CONFIGS))
    tol = 2e-2 if device == "cuda" else 1e-4
    rel = max(
        float((values[m, "packed_uniform"] - values[m, "padded_uniform"]).abs().max() / values[m, "padded_uniform"].abs().max())
        for m in models
    )
    if rel > tol:
        raise RuntimeError(f"packed and padded precomputes differ: max relative difference {rel:.3g}")

    n = len(examples)

    def rate(m, name, what):  # the median over the repeats of this layout's examples per second
        return statistics.median(n / sum(r) for r in times[m, name][what])

    def ratio(m, a, b, what):  # a over b, one ratio per paired repeat (both ran in the same repeat)
        return spread([sum(y) / sum(x) for x, y in zip(times[m, a][what], times[m, b][what])])

    out: dict = {}
    real = tp.K * sum(lengths[i] for b in plan_batches(lengths, batch, 0, 0, False, drop_last=True) for i in b)
    for name, (padding, grouped) in CONFIGS.items():
        plan = plan_batches(lengths, batch, 0, 0, grouped, drop_last=True)  # the loop's own plan (train.seed 0)
        fed = tokens_fed(lengths, micro_batches(plan, batch), padding, max_length, k=tp.K)
        out[name] = {"positions_fed": fed, "real_tokens": tp.K * sum(lengths[i] for b in plan for i in b)}
        for m in models:
            out[name][f"train_ex_per_s_{m}"] = rate(m, name, "train")
            out[name][f"precompute_ex_per_s_{m}"] = rate(m, name, "pre")
    pu, gr, un = out["packed_uniform"], out["grouped"], out["padded_uniform"]
    ratios = {"packing_train_vs_grouped": ratio("body", "packed_uniform", "grouped", "train"),
              "packing_train_vs_grouped_head": ratio("head", "packed_uniform", "grouped", "train"),
              "packing_train_vs_padded": ratio("body", "packed_uniform", "padded_uniform", "train"),
              "packing_precompute_vs_padded": ratio("body", "packed_uniform", "padded_uniform", "pre"),
              "packing_precompute_vs_padded_head": ratio("head", "packed_uniform", "padded_uniform", "pre")}
    return {
        "packing_positions_ratio": pu["positions_fed"] / pu["real_tokens"],
        "packing_padded_uniform_positions_ratio": un["positions_fed"] / un["real_tokens"],
        "packing_grouped_positions_ratio": gr["positions_fed"] / gr["real_tokens"],
        **{k: sp["median"] for k, sp in ratios.items()},
        **{f"{k}_spread": sp for k, sp in ratios.items()},
        "packing_figures": out,
        "packing_check": {"precompute_values_max_rel_diff": rel, "tolerance": tol, "real_tokens_all": real},
        "packing_settings": {
            "device": device, "rows": n, "batch_size": batch, "n_mc": tp.K, "max_length": max_length,
            "mean_tokens_per_row": sum(lengths) / n, "repeats": repeats,
            "models": {"body": "Llama 4 x 256, vocabulary 262 (byte-level), bidirectional",
                       "head": f"Llama 2 x 64, vocabulary {tp.VOCAB:,} (LLaDA's), bidirectional"},
            "torch_threads": torch.get_num_threads(),
        },
    }


if __name__ == "__main__":
    import argparse
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--size", default="full", choices=list(SETTINGS))
    a = ap.parse_args()
    print(json.dumps(run(a.device, a.size), indent=2, default=str))
