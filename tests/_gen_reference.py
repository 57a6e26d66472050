"""A straightforward, independent implementation of the LLaDA rule (docs/design.md#the-llada-rule) for the tests.

One prompt at a time, no padding, one full forward per step (two with CFG),
logits over the whole sequence, candidates scored and ranked with plain Python.
It follows the reproducibility conventions documented in dllm_align.generate.sampler
(per-prompt generator; per step Gumbel uniforms [c, V] then remasking uniforms [c];
score ties to the leftmost position; steps that commit nothing are skipped).
"""

from __future__ import annotations

import torch


@torch.no_grad()
def reference_generate(mp, prompt, *, gen_length, block_length, steps, remasking="low_confidence",
                       temperature=0.0, cfg=0.0, seed=0, trace=None):
    """Generated token ids (the whole span); ``trace`` (a list) receives the span after each block."""
    mask = mp.mask_token_id
    g = torch.Generator().manual_seed(seed)
    P = len(prompt)
    x = torch.tensor([list(prompt) + [mask] * gen_length])
    n_blocks = gen_length // block_length
    s = steps // n_blocks
    for b in range(n_blocks):
        end = P + (b + 1) * block_length
        n = int((x[0, P + b * block_length : end] == mask).sum())
        for i in range(s):
            k = n // s + (1 if i < n % s else 0)
            if k == 0:
                continue
            logits = mp.logits(x)[0].float()
            if cfg > 0:
                un_x = x.clone()
                un_x[0, :P] = mask
                un = mp.logits(un_x)[0].float()
                logits = un + (cfg + 1) * (logits - un)
            cand = [p for p in range(P, end) if int(x[0, p]) == mask]
            lg = logits[cand]
            if temperature > 0:
                u = torch.rand((len(cand), lg.shape[1]), dtype=torch.float64, generator=g)
                x0 = (lg.to(torch.float64).exp() / (-torch.log(u)) ** temperature).argmax(-1)
            else:
                x0 = lg.argmax(-1)
            if remasking == "random":
                score = torch.rand(len(cand), dtype=torch.float64, generator=g).tolist()
            else:
                probs = torch.softmax(lg, dim=-1)
                score = [float(probs[j, x0[j]]) for j in range(len(cand))]
            best = sorted(range(len(cand)), key=lambda j: (-score[j], j))[:k]
            for j in best:
                x[0, cand[j]] = x0[j]
        if trace is not None:
            trace.append(x[0, P:].tolist())
    return x[0, P:].tolist()
