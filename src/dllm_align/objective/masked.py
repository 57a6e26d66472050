"""Masked (absorbing) diffusion: the whole-sequence Monte Carlo ELBO of LLaDA, Dream and LLaDA-MoE (paper
Appendix A, eq. elbo-l), the likelihood component ``"masked"``, and its exact value by enumeration.

For a prompt x and a completion y of L tokens, one draw is

1. l ~ Uniform{1, ..., L};
2. exactly l of the L completion positions, uniformly without replacement, are
   replaced by the mask token;
3. one forward pass of the mask predictor on (x, masked y); sum log p(y_i | .)
   over the masked positions;
4. weight by L / l.

B_hat is the mean over K draws. The t-formulation (eq. elbo-t: mask each token
with probability t ~ U(0, 1], weight 1/t) has the same expectation:
sum_l g(l) / l, where g(l) is the expected log-likelihood sum of a random
l-subset (the Beta integral gives C(L,l) B(l, L-l+1) = 1/l). Its variance is
much larger (the 1/t weight has a heavy tail); it is here for comparison.
The masks and weights are :func:`dllm_align.objective.draws.draw_masks`.
"""

from __future__ import annotations

import itertools
import math
from typing import Optional, Sequence

import torch

from dllm_align.data.batching import pack_rows
from dllm_align.objective.draws import AbsorbingMask, NoisyBatch
from dllm_align.objective.likelihood import Footprint


def masked_draw_sums(mp, nb: NoisyBatch, max_rows_per_forward: Optional[int] = None,
                     pack_length: Optional[int] = None) -> torch.Tensor:
    """Per-draw sums of log p at the masked positions [B*K]: B*K noisy sequences, run in forward calls of at
    most ``max_rows_per_forward`` rows (default: all), logits only at the masked positions
    (``MaskPredictor.target_logprobs``).

    ``pack_length`` (``data.padding: packed``): the noisy sequences of each forward call are packed into as
    few rows of that many tokens as fit, with block-diagonal bidirectional attention and positions restarting
    per sequence, so no compute goes to padding. Every sequence sees exactly what it sees alone, so the values
    equal the padded ones up to float rounding. Needs right-padded rows with an ``attention_mask``
    (``padding: none`` layout). A family that scores position j from the output at j-1 (Dream's shifted
    logits) stays inside the sequence: a scored (completion) position is never a sequence's first, since the
    prompt comes before it.
    """
    BK = nb.B * nb.K
    chunk = max_rows_per_forward or BK
    if pack_length is not None:
        if nb.attention_mask is None:
            raise ValueError("packing needs the attention mask of right-padded rows")
        seq_len = nb.attention_mask.sum(dim=1).tolist()
    sums = []
    for start in range(0, BK, chunk):
        stop = min(start + chunk, BK)
        sel = (nb.rows >= start) & (nb.rows < stop)
        r, c, tgt = nb.rows[sel] - start, nb.cols[sel], nb.targets[sel]
        if pack_length is None:
            am = None if nb.attention_mask is None else nb.attention_mask[start:stop]
            lp = mp.target_logprobs(nb.input_ids[start:stop], am, r, c, tgt)  # [n] fp32
        else:
            p = pack_rows(nb.input_ids[start:stop], seq_len[start:stop], pack_length)
            dev = nb.input_ids.device
            pr, pc = p.row_of.to(dev)[r], p.offset.to(dev)[r] + c
            lp = mp.target_logprobs(p.input_ids.to(dev), None, pr, pc, tgt, packed=p.layout.to(dev))
        s = torch.zeros(stop - start, dtype=torch.float32, device=lp.device)
        sums.append(s.index_add(0, r, lp))
    return torch.cat(sums)  # [B*K]



class MaskedDiffusion(AbsorbingMask):
    """Whole-sequence masked diffusion: each draw is one noisy copy of the sequence (the module docstring)."""

    name = "masked"

    def draw_sums(self, mp, nb, input_ids, attention_mask, max_rows_per_forward, pack_length) -> torch.Tensor:
        return masked_draw_sums(mp, nb, max_rows_per_forward, pack_length)

    def footprint(self, shape, draws: int, length: int, compute_bytes: int, *, attn: str = "sdpa",
                  packed: bool = False) -> Footprint:
        # One draw is one row of the plain model: SDPA's fused kernels (flash, memory-efficient) and
        # compiled flex keep O(tokens), within the layer's working set. Packed rows under SDPA or eager hold
        # the dense [rows, 1, L, L] block mask and its bf16 additive form (3 bytes an entry; flash and flex
        # take sequence offsets instead); eager attention holds the score matrix.
        lines, notes = [], []
        if packed and attn in ("sdpa", "eager"):
            lines.append(("packed attention masks (bool + bf16 bias)", length * length * 3))
        if attn == "eager":
            lines.append(("eager attention scores", shape.heads * length * length * 4))
            notes.append("model.attn_implementation: eager materialises the attention scores; use sdpa")
        return Footprint(rows=draws, scored_rows=draws, row_lines=tuple(lines), notes=tuple(notes))


MASKED = MaskedDiffusion()


# --------------------------------------------------------------------------- reference values
@torch.no_grad()
def exact_elbo(mp, prompt_ids: Sequence[int], completion_ids: Sequence[int]) -> float:
    """The exact ELBO by enumerating every non-empty mask of the completion (L <= ~12).

    ELBO = sum_{l=1}^{L} (1/l) * mean over l-subsets M of sum_{i in M} log p(y_i | y with M masked),
    which is E_l[(L/l) * E_M[...]] with l uniform: the expectation of both estimators.
    """
    L = len(completion_ids)
    if L > 14:
        raise ValueError("exact enumeration is for short completions only (2^L forwards)")
    full = torch.tensor(list(prompt_ids) + list(completion_ids), dtype=torch.long)
    P = len(prompt_ids)
    seqs, subsets = [], []
    for l in range(1, L + 1):
        for M in itertools.combinations(range(L), l):
            x = full.clone()
            x[[P + i for i in M]] = mp.mask_token_id
            seqs.append(x)
            subsets.append(M)
    x = torch.stack(seqs).to(mp.device)
    logits = mp.logits(x, None).float()
    logp = torch.log_softmax(logits, dim=-1)
    total = 0.0
    for r, M in enumerate(subsets):
        l = len(M)
        s = sum(float(logp[r, P + i, completion_ids[i]]) for i in M)
        total += s / (l * math.comb(L, l))
    return total
