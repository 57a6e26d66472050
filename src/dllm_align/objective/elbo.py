"""The Monte Carlo ELBO of a masked diffusion LM (paper Appendix A, eq. elbo-l).

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

Masks are a pure function of (seed, example id, draw index, L), computed with
a counter-based hash (SplitMix64) on the CPU, so they are the same on any
device, any process count, any library version and after a restart. Policy and
reference call the same function, so they share masks (common random numbers:
the VRPO variance reduction the paper relies on).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from dllm_align.objective.draws import (  # noqa: F401  (the draws' names, where callers import them)
    DrawConfig,
    NoisyBatch,
    draw_masks,
    example_key,
    make_noisy_batch,
    splitmix64,
)
from dllm_align.objective.masked import exact_elbo, masked_draw_sums  # noqa: F401


def elbo_draws(
    mp,
    input_ids: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    completion_mask: torch.Tensor,
    ids: Sequence[str],
    cfg: DrawConfig,
    max_rows_per_forward: Optional[int] = None,
    draws: Optional[Sequence[int]] = None,
    pack_length: Optional[int] = None,
) -> torch.Tensor:
    """Per-draw ELBO values [B, K] (fp32, differentiable through ``mp``).

    Value of draw k of row b: weight_k * sum over masked positions of
    log p(y_i | masked sequence). Logits are computed only at masked positions
    (``MaskPredictor.target_logprobs``). Rows (B*K noisy sequences) are run in
    forward calls of at most ``max_rows_per_forward`` rows (default: all).

    ``pack_length`` (``data.padding: packed``): the noisy sequences of each
    forward call are packed into as few rows of that many tokens as fit, with
    block-diagonal bidirectional attention and positions restarting per
    sequence, so no compute goes to padding. Every sequence sees exactly what
    it sees alone, so the values equal the padded ones up to float rounding.
    Needs right-padded rows with an ``attention_mask`` (``padding: none`` layout).
    A family that scores position j from the output at j-1 (Dream's shifted
    logits) stays inside the sequence: a scored (completion) position is never
    a sequence's first, since the prompt comes before it.

    A block-diffusion family (``mp.block_size``) scores each draw given its own
    noisy block and the clean earlier blocks: the draws of a row go through the
    network as one streams row ``[x_t^1; ...; x_t^K; x_0]`` with the clean
    stream computed once (:func:`dllm_align.objective.block.block_draw_sums`;
    ``pack_length`` packs its rows too).
    The masks and weights are the same function of (seed, id, draw, L): the
    l-estimator's expectation is the block ELBO with t uniform on (0, 1], since
    a mask hiding n of L tokens gets the same total weight, 1 / (n C(L, n)),
    under both (``objective/block.py``, ``mask_weight``).
    """
    nb = make_noisy_batch(input_ids, attention_mask, completion_mask, ids, cfg, mp.mask_token_id, draws)
    block_size = getattr(mp, "block_size", None)
    if block_size:
        from dllm_align.objective.block import block_draw_sums

        total = block_draw_sums(mp, nb, input_ids, attention_mask, block_size, max_rows_per_forward, pack_length)
        return (total.double() * nb.weight).float().view(nb.B, nb.K)
    total = masked_draw_sums(mp, nb, max_rows_per_forward, pack_length)  # [B*K]
    return (total.double() * nb.weight).float().view(nb.B, nb.K)


def elbo(
    mp, batch: dict, cfg: DrawConfig, max_rows_per_forward: Optional[int] = None, pack_length: Optional[int] = None
) -> torch.Tensor:
    """B_hat [B]: the mean of the K draws for each row of a collated batch."""
    return elbo_draws(
        mp,
        batch["input_ids"],
        batch.get("attention_mask"),
        batch["completion_mask"],
        batch["ids"],
        cfg,
        max_rows_per_forward,
        pack_length=pack_length,
    ).mean(dim=1)
