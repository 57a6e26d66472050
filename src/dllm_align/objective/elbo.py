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

import hashlib
import itertools
import math
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch

from dllm_align.data.batching import pack_rows

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)
# Stream tags keep the different uses of one key independent.
_TAG_L, _TAG_POS, _TAG_OFFSET, _TAG_T = 1, 2, 3, 4


def splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64 finaliser on uint64 arrays (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        z = np.asarray(x, dtype=np.uint64) + _GOLDEN
        z = (z ^ (z >> _S30)) * _M1
        z = (z ^ (z >> _S27)) * _M2
        return z ^ (z >> _S31)


def _mix(key: int | np.ndarray, *parts: int | np.ndarray) -> np.ndarray:
    h = np.asarray(key, dtype=np.uint64)
    for p in parts:
        h = splitmix64(h ^ splitmix64(np.asarray(p, dtype=np.uint64)))
    return h


def _unit(h: np.ndarray) -> np.ndarray:
    """uint64 -> float64 uniform in [0, 1) (top 53 bits)."""
    return (h >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def example_key(seed: int, example_id: str) -> int:
    """The 64-bit key of an example: a hash of (seed, id), stable everywhere."""
    digest = hashlib.sha256(f"{int(seed)}\x00{example_id}".encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "little")


@dataclass(frozen=True)
class DrawConfig:
    """How the K draws of an example are made (recipe section ``reference``)."""

    n_mc: int = 8
    seed: int = 0
    estimator: str = "l"  # "l" (paper) or "t"
    stratified: bool = False

    def __post_init__(self):
        if self.estimator not in ("l", "t"):
            raise ValueError(f"estimator must be 'l' or 't', got {self.estimator!r}")
        if self.n_mc < 1:
            raise ValueError("n_mc must be >= 1")

    @classmethod
    def from_reference(cls, ref, n_mc: Optional[int] = None) -> "DrawConfig":
        return cls(n_mc=n_mc or ref.n_mc, seed=ref.seed, estimator=ref.estimator, stratified=ref.stratified)


def draw_masks(example_id: str, L: int, cfg: DrawConfig) -> tuple[np.ndarray, np.ndarray]:
    """Masks and weights for the K draws of one example.

    Returns ``mask`` [K, L] bool (True = replaced by the mask token) and
    ``weight`` [K] float64 (L / l, or 1 / t). Draw k depends only on
    (seed, id, k, L) - plus K itself when ``stratified`` - so the first K'
    draws of a non-stratified set are exactly the K'-draw set.
    """
    if L < 1:
        raise ValueError(f"example {example_id!r} has no completion tokens to mask")
    K = cfg.n_mc
    key = example_key(cfg.seed, example_id)
    ks = np.arange(K, dtype=np.uint64)
    pos = np.arange(L, dtype=np.uint64)
    if cfg.stratified:
        u = _unit(_mix(key, _TAG_OFFSET))  # one offset shared by the K draws
        strata = (np.arange(K, dtype=np.float64) + u) / K  # evenly spaced in [0, 1)
    else:
        strata = _unit(_mix(key, _TAG_L, ks))  # independent uniforms
    # Position scores: independent uniforms per (draw, position).
    scores = _unit(_mix(key, _TAG_POS, ks[:, None], pos[None, :]))  # [K, L]
    if cfg.estimator == "l":
        l = np.minimum(np.floor(strata * L).astype(np.int64) + 1, L)  # uniform on {1..L}
        ranks = np.argsort(np.argsort(scores, axis=1, kind="stable"), axis=1, kind="stable")
        mask = ranks < l[:, None]  # the l positions with the smallest scores: a uniform l-subset
        weight = L / l.astype(np.float64)
    else:
        t = 1.0 - strata  # in (0, 1]
        mask = scores < t[:, None]
        weight = 1.0 / t
    return mask, weight


# --------------------------------------------------------------------------- batched ELBO
@dataclass
class NoisyBatch:
    """K noisy copies of each row of a batch, flattened to [B*K, T]."""

    input_ids: torch.Tensor  # [B*K, T] with mask tokens placed
    attention_mask: Optional[torch.Tensor]  # [B*K, T]
    rows: torch.Tensor  # [N] row (in B*K) of each masked position
    cols: torch.Tensor  # [N] column of each masked position
    targets: torch.Tensor  # [N] the clean token there
    weight: torch.Tensor  # [B*K] L/l (or 1/t), float64
    B: int
    K: int


def make_noisy_batch(
    input_ids: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    completion_mask: torch.Tensor,
    ids: Sequence[str],
    cfg: DrawConfig,
    mask_token_id: int,
    draws: Optional[Sequence[int]] = None,
) -> NoisyBatch:
    """Build the noisy inputs of every draw of every row (on the CPU, then moved).

    ``draws`` selects a subset of the K draw indices (default all), used to
    split an example's draws across forward calls.
    """
    B, T = input_ids.shape
    cm = completion_mask.bool().cpu()
    draw_idx = list(range(cfg.n_mc)) if draws is None else list(draws)
    K = len(draw_idx)
    noisy = input_ids.cpu().repeat_interleave(K, dim=0).clone()
    weight = torch.empty(B * K, dtype=torch.float64)
    rows, cols = [], []
    for b in range(B):
        positions = torch.nonzero(cm[b], as_tuple=False).squeeze(-1)
        L = positions.numel()
        mask, w = draw_masks(ids[b], L, cfg)
        for j, k in enumerate(draw_idx):
            r = b * K + j
            sel = positions[torch.from_numpy(mask[k])]
            noisy[r, sel] = mask_token_id
            rows.append(torch.full((sel.numel(),), r, dtype=torch.long))
            cols.append(sel)
            weight[r] = float(w[k])
    rows_t = torch.cat(rows) if rows else torch.empty(0, dtype=torch.long)
    cols_t = torch.cat(cols) if cols else torch.empty(0, dtype=torch.long)
    targets = input_ids.cpu().repeat_interleave(K, dim=0)[rows_t, cols_t]
    dev = input_ids.device
    am = None if attention_mask is None else attention_mask.repeat_interleave(K, dim=0)
    return NoisyBatch(
        noisy.to(dev), am, rows_t.to(dev), cols_t.to(dev), targets.to(dev), weight.to(dev), B, K
    )


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
    total = torch.cat(sums)  # [B*K]
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
