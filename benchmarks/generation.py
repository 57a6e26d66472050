"""Generation throughput: exact mode, a straightforward sampler (docs/design.md#generation), and fast mode.

Run: ``PYTHONPATH=src python benchmarks/generation.py [--size full|quick|smoke] [--device cpu]``
or call :func:`run` (``benchmarks/run.py`` does). Batch 1, the prompt below,
a randomly initialised tiny bidirectional Llama a little larger than the
built-in one (so the cache has something to save), temperature 0,
low_confidence. Reports, per sampler: tokens/s (generated positions per
second), model positions processed per generated token, and for the fast
samplers their token agreement with exact mode.

Caveat: with random weights the predictions are nearly flat, so a small change
in context (the stale cached keys/values) flips many argmaxes, and no
candidate ever clears a 0.9 confidence threshold. Agreement on a trained model
is expected to be higher, and the threshold's step savings appear only there.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # paired.py, when run as a script

PROMPT = (
    "Translate to Turkish:\n\nWith the recession, the purchase price for recycled plastic waste has "
    "nose-dived. Explain your choice of words in one sentence."
)


@torch.no_grad()
def straightforward(mp, prompt, gen_length, block_length, steps):
    """The sampler of docs/design.md#generation written plainly: one prompt, one full forward per step, logits everywhere, no cache.

    Temperature 0, low_confidence; score ties go to the leftmost position (as in exact mode).
    """
    mask = mp.mask_token_id
    P = len(prompt)
    x = torch.tensor([list(prompt) + [mask] * gen_length], device=mp.device)
    n_blocks = gen_length // block_length
    s = steps // n_blocks
    positions = 0
    for b in range(n_blocks):
        end = P + (b + 1) * block_length
        n = int((x[0, P + b * block_length : end] == mask).sum())
        for i in range(s):
            k = n // s + (1 if i < n % s else 0)
            if k == 0:
                continue
            logits = mp.logits(x)[0].float()
            positions += x.shape[1]
            x0 = logits.argmax(-1)
            p = torch.softmax(logits, -1).gather(-1, x0[:, None]).squeeze(-1).double()
            idx = torch.arange(x.shape[1], device=x.device)
            p = torch.where((x[0] == mask) & (idx >= P) & (idx < end), p, torch.tensor(-float("inf"), device=x.device, dtype=p.dtype))
            top = torch.sort(p, descending=True, stable=True).indices[:k]
            x[0, top] = x0[top]
    return x[0, P:].tolist(), positions


def _tiny(device):
    from dllm_align.models.predictor import MaskPredictor
    from dllm_align.models.load import TinySpec, build_tiny_model, build_tiny_tokenizer

    spec = TinySpec(hidden_size=256, layers=4, heads=4, intermediate_size=512)
    tok = build_tiny_tokenizer()
    dtype = torch.bfloat16 if device == "cuda" else torch.float32  # GPUs decode in bf16
    return MaskPredictor(build_tiny_model(tok, spec).to(device=device, dtype=dtype), tok), spec


SETTINGS = {"full": (256, 32), "quick": (64, 16), "smoke": (16, 8)}  # size -> (gen_length, block_length)
REPEATS = {"full": 5, "quick": 3, "smoke": 3}  # paired measurements; each gives one ratio (benchmarks/paired.py)


def run(device: str = "cpu", size: str = "full", repeats: int | None = None, threads: int | None = None) -> dict:
    """Measure the samplers at batch 1; returns a JSON-able dict of figures and settings.

    Each repeat times every sampler once, in turn (straightforward, exact, the fast ones), and gives one
    exact/straightforward and one fast/exact ratio; the headline ratios are their medians, with the spread under
    ``<key>_spread``. ``threads``: torch CPU threads (None: leave as is). On a shared or busy CPU, 1 thread
    gives steadier figures for a model this small.
    """
    from paired import spread

    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda: no CUDA device is visible")
    if threads is not None:
        torch.set_num_threads(threads)
    from dllm_align.config.schema import FAST_CACHE, FAST_THRESHOLD
    from dllm_align.generate.settings import SamplerSettings, SamplerStats, encode_prompt
    from dllm_align.generate.sampler import generate_batch

    repeats = repeats or REPEATS[size]
    mp, spec = _tiny(device)
    prompt = encode_prompt(mp.tokenizer, [{"role": "user", "content": PROMPT}])
    gen, block = SETTINGS[size]
    steps = gen  # one token per step: the paper's ratio (512 / 512)
    base = SamplerSettings(gen_length=gen, block_length=block, steps=steps)
    # Warm-up (allocator, kernels), not timed.
    generate_batch(mp, [prompt], SamplerSettings(gen_length=block, block_length=block, steps=2), stop_early=False)
    variants = {
        "exact": base,
        "fast_prefix": SamplerSettings(**{**base.to_dict(), "cache": "prefix"}),
        "fast_dual": SamplerSettings(**{**base.to_dict(), "cache": "dual"}),
        "fast": SamplerSettings(**{**base.to_dict(), "cache": FAST_CACHE, "threshold": FAST_THRESHOLD}),
    }
    seconds = {name: [] for name in ["straightforward", *variants]}
    tokens, counts = {}, {}

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    for _ in range(repeats):  # interleaved: each repeat runs every sampler once
        sync()
        t0 = time.perf_counter()
        tokens["straightforward"], ref_pos = straightforward(mp, prompt, gen, block, steps)
        sync()
        seconds["straightforward"].append(time.perf_counter() - t0)
        for name, st in variants.items():
            stats = SamplerStats()
            sync()
            t0 = time.perf_counter()
            res = generate_batch(mp, [prompt], st, stop_early=False, stats=stats)
            sync()
            seconds[name].append(time.perf_counter() - t0)
            tokens[name], counts[name] = res[0].raw, stats
    figures = {"straightforward": {"positions_per_token": ref_pos / gen}}
    for name, st in counts.items():
        figures[name] = {"positions_per_token": st.positions / gen, "forwards": st.forwards}
    for name, t in seconds.items():
        med = statistics.median(t)
        figures[name].update(tokens_per_s=gen / med, seconds=med, seconds_each=t)
    exact, ref_tokens = tokens["exact"], tokens["straightforward"]
    figures["exact"]["identical_to_straightforward"] = exact == ref_tokens
    if exact != ref_tokens and next(mp.model.parameters()).dtype == torch.float32:
        # in fp32 exact mode is the same computation; bf16 may flip near-ties, so there it is only reported
        raise RuntimeError("exact mode and the straightforward sampler decoded different tokens (fp32): "
                           f"{sum(x != y for x, y in zip(exact, ref_tokens))} of {gen} differ")
    ratios = {name: spread([e / f for e, f in zip(seconds["exact"], seconds[name])]) for name in variants if name != "exact"}
    for name, sp in ratios.items():
        figures[name]["agreement_with_exact"] = sum(a == b for a, b in zip(tokens[name], exact)) / gen
        figures[name]["speedup_vs_exact"] = sp["median"]
        figures[name]["speedup_vs_exact_spread"] = sp
    exact_sp = spread([s / e for s, e in zip(seconds["straightforward"], seconds["exact"])])
    figures["exact"]["speedup_vs_straightforward"] = exact_sp["median"]
    figures["exact"]["agreement_with_straightforward"] = sum(a == b for a, b in zip(exact, ref_tokens)) / gen
    return {
        # the figures benchmarks/run.py tabulates
        "generate_exact_speedup": exact_sp["median"],
        "generate_exact_speedup_spread": exact_sp,
        "generate_exact_identical": figures["exact"]["identical_to_straightforward"],
        "generate_fast_speedup": ratios["fast"]["median"],
        "generate_fast_speedup_spread": ratios["fast"],
        "generation_settings": {
            "device": device,
            "dtype": str(next(mp.model.parameters()).dtype).removeprefix("torch."),
            "model": f"random tiny Llama (bidirectional) hidden {spec.hidden_size}, {spec.layers} layers, "
            f"{spec.heads} heads, mlp {spec.intermediate_size}, vocab {mp.vocab_size}",
            "batch_size": 1,
            "prompt_tokens": len(prompt),
            "gen_length": gen,
            "block_length": block,
            "steps": steps,
            "temperature": 0.0,
            "remasking": "low_confidence",
            "fast": f"cache={FAST_CACHE}, threshold={FAST_THRESHOLD}",
            "torch_threads": torch.get_num_threads(),
            "repeats": repeats,
            "timing": "each repeat times every sampler once, in turn; tokens/s from the median seconds; "
                      "ratios: the median of the per-repeat ratios",
        },
        "generation_figures": figures,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--size", default="full", choices=list(SETTINGS),
                    help="gen_length / block_length: full 256 / 32, quick 64 / 16, smoke 16 / 8")
    ap.add_argument("--repeats", type=int, default=None, help="paired measurements (default: 5 full, 3 quick and smoke)")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    ap.add_argument("--json", action="store_true", help="print the raw JSON")
    args = ap.parse_args()
    out = run(args.device, args.size, args.repeats, args.threads)
    if args.json:
        print(json.dumps(out, indent=2))
        return
    for k, v in out["generation_settings"].items():
        print(f"{k:>16}: {v}")
    print(f"\n{'sampler':<16}{'tokens/s':>10}{'pos/token':>11}{'speed-up':>10}{'agreement':>11}")
    for name, f in out["generation_figures"].items():
        sp = f.get("speedup_vs_exact", f.get("speedup_vs_straightforward"))
        ag = f.get("agreement_with_exact")
        same = f.get("identical_to_straightforward")
        print(
            f"{name:<16}{f['tokens_per_s']:>10.1f}{f['positions_per_token']:>11.1f}"
            f"{'' if sp is None else f'{sp:.2f}x':>10}"
            f"{'' if ag is None else f'{ag:.3f}':>11}"
            f"{'' if same is None else ('  identical to straightforward' if same else '  DIFFERS from straightforward')}"
        )
    print("\nspeed-up: exact vs straightforward; fast samplers vs exact.")


if __name__ == "__main__":
    main()
