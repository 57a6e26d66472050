"""Block diffusion: the shared clean stream against the published 2L-per-draw training forward.

Both sides compute the block-ELBO terms of K noisy draws of each example (one t per draw, completion
tokens masked at rate t, 1/t weights) and back-propagate their sum: the straightforward form feeds K rows
of ``[x_t ; x_0]`` (2L tokens each, the published three-part mask); ours feeds one row
``[x_t^1 ; ... ; x_t^K ; x_0]`` ((K+1)L tokens), the clean stream computed once. Before timing, both sides
must give the same terms and gradients on the same draws. Ours runs the stream-by-stream attention
(``streams_attention``: each noisy stream meets its own L keys and the clean L, as a block-sparse kernel
would), the 2L side the published dense mask through sdpa. The body is a dense Qwen3-style model (SDAR's
architecture) sized so the body dominates, on the CPU.
"""

from __future__ import annotations

import contextlib
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # paired.py, when run as a script

from paired import spread  # noqa: E402


# size -> (width, intermediate, layers, L, examples, paired repeats: one ratio each, benchmarks/paired.py)
SETTINGS = {"full": (256, 1024, 4, 64, 8, 5), "quick": (128, 512, 2, 32, 4, 3), "smoke": (64, 128, 1, 16, 2, 3)}


def run(device: str = "cpu", size: str = "full") -> dict:
    return measure(device, *SETTINGS[size])


def measure(device: str, width: int, inter: int, layers: int, length: int, n_ex: int, repeats: int, heads: int = 4,
            kv_heads: int = 2, vocab: int = 512, dtype: str = "float32") -> dict:
    """The paired measurement at one shape (``run``'s sizes, or ``gpu_bench.py``'s full size): a Qwen3-style body
    of ``layers`` x ``width``, K = 8 draws of ``n_ex`` examples of ``length`` tokens."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from dllm_align.objective.block import draw_terms_2l, draw_terms_shared, hf_forward, hf_streams_forward, noise

    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda: no CUDA device is visible")
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=vocab, hidden_size=width, intermediate_size=inter, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=width // heads,
                      max_position_embeddings=max(512, 9 * length), tie_word_embeddings=False)
    cfg._attn_implementation = "sdpa"
    model = Qwen3ForCausalLM(cfg).to(device=device, dtype=getattr(torch, dtype)).train()
    fwd = hf_forward(model)
    k, block, mask_id = 8, 4, vocab - 1
    g = torch.Generator().manual_seed(1)
    examples = []
    for _ in range(n_ex):
        x0 = torch.randint(0, min(500, vocab - 12), (length,), generator=g)
        maskable = torch.arange(length) >= length // 4
        t = torch.rand(k, generator=g).clamp_min(0.05)
        xt, masked = noise(x0[None].expand(k, -1), maskable[None].expand(k, -1), t, mask_id, g)
        examples.append(tuple(v.to(device) for v in (x0, xt, masked, t)))

    streams = hf_streams_forward(model, k, length, block)

    # on CUDA both sides run as training does there: bf16 autocast over fp32 weights
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if device == "cuda" else contextlib.nullcontext()

    def step(fn, ex):
        model.zero_grad(set_to_none=True)
        with amp:
            terms = fn(fwd if fn is draw_terms_2l else streams, *ex, block)
        terms.sum().backward()
        return terms.detach()

    # same numbers first
    a = step(draw_terms_2l, examples[0])
    ga = [p.grad.clone() for p in model.parameters()]
    b = step(draw_terms_shared, examples[0])
    gb = [p.grad.clone() for p in model.parameters()]
    value_rel = float(((a - b).abs().max() / a.abs().max()))
    grad_rel = max(float((x - y).abs().max() / (x.abs().max() + 1e-30)) for x, y in zip(ga, gb))
    if value_rel > (2e-2 if device == "cuda" else 1e-4) or grad_rel > (5e-2 if device == "cuda" else 1e-3):
        raise AssertionError(f"shared clean stream differs from the 2L form: {value_rel:.2e} / {grad_rel:.2e}")

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    def timed(fn):
        sync()
        t0 = time.perf_counter()
        for ex in examples:
            step(fn, ex)
        sync()
        return len(examples) / (time.perf_counter() - t0)

    rates = {"2l": [], "shared": []}
    for _ in range(repeats):  # paired and interleaved: each repeat times both sides, one ratio
        rates["2l"].append(timed(draw_terms_2l))
        rates["shared"].append(timed(draw_terms_shared))
    sp = spread([s / t for s, t in zip(rates["shared"], rates["2l"])])
    return {
        "block_stream_speedup": sp["median"],
        "block_stream_speedup_spread": sp,
        "block_stream_figures": {"shared_ex_per_s": statistics.median(rates["shared"]),
                                 "2l_ex_per_s": statistics.median(rates["2l"]),
                                 "body_tokens_shared": (k + 1) * length, "body_tokens_2l": 2 * k * length,
                                 "value_rel_diff": value_rel, "grad_rel_diff": grad_rel},
        "block_stream_settings": {"K": k, "L": length, "block": block, "width": width, "intermediate": inter,
                                  "layers": layers, "examples": n_ex, "repeats": repeats, "device": device,
                                  "timing": "each repeat times both sides over the examples; rates: medians"},
    }


if __name__ == "__main__":
    import argparse
    import json

    p = argparse.ArgumentParser()
    p.add_argument("--size", default="full", choices=list(SETTINGS))
    p.add_argument("--device", default="cpu")
    a = p.parse_args()
    print(json.dumps(run(a.device, a.size), indent=1))
