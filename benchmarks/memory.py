"""Loss memory: peak memory of one ELBO step (forward + backward) at LLaDA's vocabulary size.

Setting (issue: one example, L = 512 completion tokens, K = 4 draws, vocab
126,464, a tiny body): ours gathers the masked positions' hidden states and
scores them through the chunked head (``MaskPredictor.target_logprobs``); the
straightforward method materialises full [K, T, V] logits, log-softmaxes and
gathers. Each variant runs in a fresh process; on CPU the figure is the rise of
peak resident memory (ru_maxrss) over the process's memory after setup, on
CUDA ``torch.cuda.max_memory_allocated`` over the setup's allocation. Both
must give the same per-draw values and gradient norm (float tolerance), or the
benchmark fails. ``--quick`` keeps the full setting; ``--smoke``: L = 64, K = 2.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

VOCAB = 126_464
SETTINGS = {"full": (32, 512, 4), "quick": (32, 512, 4), "smoke": (16, 64, 2)}  # size -> (prompt, completion, K)


def _setup(device: str, P: int, L: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from dllm_align.models.predictor import MaskPredictor
    from dllm_align.models.load import build_tiny_tokenizer

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4, is_causal=False, tie_word_embeddings=False)
    cfg.mask_token_id = VOCAB - 1
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = LlamaForCausalLM(cfg).to(device=device, dtype=dtype).train()
    mp = MaskPredictor(model, build_tiny_tokenizer(), mask_token_id=VOCAB - 1)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB - 1, (1, P + L), generator=g).to(device)
    cm = torch.zeros_like(ids, dtype=torch.bool)
    cm[0, P:] = True
    return torch, mp, ids, cm


def _child(variant: str, device: str, size: str) -> dict:
    import resource

    P, L, K = SETTINGS[size]
    torch, mp, ids, cm = _setup(device, P, L)
    from dllm_align.objective.draws import DrawConfig, make_noisy_batch
    from dllm_align.objective.elbo import elbo_draws

    cfg = DrawConfig(n_mc=K, seed=0)
    if device == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    else:
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if variant == "ours":
        vals = elbo_draws(mp, ids, None, cm, ["bench"], cfg)
        per_pos = None
    else:
        nb = make_noisy_batch(ids, None, cm, ["bench"], cfg, mp.mask_token_id)
        logp = torch.log_softmax(mp.model(input_ids=nb.input_ids).logits.float(), dim=-1)  # [K, T, V]
        picked = logp[nb.rows, nb.cols, nb.targets]
        sums = torch.zeros(nb.B * nb.K, device=ids.device).index_add(0, nb.rows, picked)
        vals = (sums.double() * nb.weight).float().view(nb.B, nb.K)
    vals.sum().backward()
    if device == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    grad_norm = float(torch.sqrt(sum((p.grad.float() ** 2).sum() for p in mp.model.parameters() if p.grad is not None)))
    return {"peak_bytes": int(peak), "values": vals.detach().float().cpu().flatten().tolist(), "grad_norm": grad_norm}


def _run_child(variant: str, device: str, size: str) -> dict:
    env = dict(os.environ)
    src = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src")
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--child", variant, device, size],
        capture_output=True, text=True, env=env, timeout=1800,
    )
    if out.returncode != 0:
        raise RuntimeError(f"memory benchmark child ({variant}) failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def run(device: str = "cpu", size: str = "full") -> dict:
    P, L, K = SETTINGS[size]
    ours = _run_child("ours", device, size)
    base = _run_child("straightforward", device, size)
    max_diff = max(abs(a - b) for a, b in zip(ours["values"], base["values"]))
    rel = max(abs(a - b) / max(abs(b), 1e-9) for a, b in zip(ours["values"], base["values"]))
    grad_rel = abs(ours["grad_norm"] - base["grad_norm"]) / base["grad_norm"]
    tol = 2e-2 if device == "cuda" else 1e-4
    if len(ours["values"]) != len(base["values"]) or rel > tol or grad_rel > tol:
        raise RuntimeError(f"ours and full logits differ on the same masks: values {rel:.3g}, "
                           f"gradient norm {grad_rel:.3g} relative (tolerance {tol:g})")
    return {
        "loss_memory_ratio": ours["peak_bytes"] / base["peak_bytes"],
        "loss_memory_ours_mb": ours["peak_bytes"] / 2**20,
        "loss_memory_straightforward_mb": base["peak_bytes"] / 2**20,
        "loss_memory_max_abs_diff": max_diff,
        "loss_memory_max_rel_diff": rel,
        "loss_memory_grad_norm_rel_diff": grad_rel,
        "loss_memory_settings": {"vocab": VOCAB, "prompt": P, "completion": L, "n_mc": K, "body": "2 x 64 Llama"},
    }


if __name__ == "__main__":
    if len(sys.argv) >= 2 and sys.argv[1] == "--child":
        print(json.dumps(_child(sys.argv[2], sys.argv[3], sys.argv[4])))
    else:
        import argparse

        ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
        ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
        ap.add_argument("--size", default="full", choices=list(SETTINGS))
        a = ap.parse_args()
        print(json.dumps(run(a.device, a.size), indent=2))
