"""The draws of the absorbing-mask likelihoods: masks and weights as pure functions of (seed, example id,
draw index, L), and the noisy batch they make.

Masks come from a counter-based hash (SplitMix64) on the CPU, so they are the same on any device, any
process count, any library version and after a restart. Policy and reference call the same function, so
they share masks (common random numbers: the VRPO variance reduction the paper relies on). The hash
(:func:`example_key`, :func:`mix`, :func:`splitmix64`) is for every likelihood's draws; a new noise process takes its
own stream tags. :class:`AbsorbingMask` is the part of the likelihood component (``objective.likelihood``)
that masked and block diffusion share.
"""

from __future__ import annotations

import hashlib
from abc import abstractmethod
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch

from dllm_align.config import components as registry
from dllm_align.objective.likelihood import Likelihood

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)
# Stream tags keep the different uses of one key independent.
_TAG_L, _TAG_POS, _TAG_OFFSET, _TAG_T = 1, 2, 3, 4
_TAG_REPLACE, _TAG_TOKEN = 5, 6


def splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64 finaliser on uint64 arrays (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        z = np.asarray(x, dtype=np.uint64) + _GOLDEN
        z = (z ^ (z >> _S30)) * _M1
        z = (z ^ (z >> _S27)) * _M2
        return z ^ (z >> _S31)


def mix(key: int | np.ndarray, *parts: int | np.ndarray) -> np.ndarray:
    """The hash of a key and a sequence of counters (stream tag, draw, position, ...), broadcast over arrays:
    the one source of every likelihood's random numbers."""
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
    # The likelihoods' own settings, (name, settings) pairs (the recipe's, by ``from_reference``); a likelihood
    # missing here reads its declaration's defaults (:meth:`settings_of`). The absorbing-mask draws have none.
    likelihood_settings: tuple = ()
    # The likelihood these draws are for when the recipe picks one (``reference.likelihood``); None: the model's
    # family's (``objective.elbo.elbo_draws``).
    likelihood: Optional[str] = None

    def __post_init__(self):
        if self.estimator not in ("l", "t"):
            raise ValueError(f"estimator must be 'l' or 't', got {self.estimator!r}")
        if self.n_mc < 1:
            raise ValueError("n_mc must be >= 1")

    @classmethod
    def from_reference(cls, ref, n_mc: Optional[int] = None) -> "DrawConfig":
        return cls(n_mc=n_mc or ref.n_mc, seed=ref.seed, estimator=ref.estimator, stratified=ref.stratified,
                   likelihood_settings=tuple((name, ref.own_settings(name)) for name in registry.names("likelihood")),
                   likelihood=ref.likelihood)

    def settings_of(self, likelihood: str):
        """The own settings of ``likelihood`` these draws are made with (its declaration's defaults if not given)."""
        for name, settings in self.likelihood_settings:
            if name == likelihood:
                return settings
        return registry.get("likelihood", likelihood).settings()


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
        u = _unit(mix(key, _TAG_OFFSET))  # one offset shared by the K draws
        strata = (np.arange(K, dtype=np.float64) + u) / K  # evenly spaced in [0, 1)
    else:
        strata = _unit(mix(key, _TAG_L, ks))  # independent uniforms
    # Position scores: independent uniforms per (draw, position).
    scores = _unit(mix(key, _TAG_POS, ks[:, None], pos[None, :]))  # [K, L]
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


def draw_replacements(example_id: str, mask: np.ndarray, cfg: DrawConfig, share: float, vocab_size: int,
                      mask_token_id: int, draws: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """Which completion tokens each draw leaves unmasked but replaces, and by what (``mask`` [K, L] from
    :func:`draw_masks`). Each unmasked position is replaced with probability ``share`` by a token drawn uniformly
    from the vocabulary without the mask token. Returns ``replaced`` [len(draws), L] bool and ``tokens`` [same]
    int64, pure functions of (seed, id, draw, position) like the masks."""
    key = example_key(cfg.seed, example_id)
    ks = np.asarray(list(draws), dtype=np.uint64)[:, None]
    pos = np.arange(mask.shape[1], dtype=np.uint64)[None, :]
    replaced = (_unit(mix(key, _TAG_REPLACE, ks, pos)) < share) & ~mask[list(draws)]
    tokens = np.minimum(np.floor(_unit(mix(key, _TAG_TOKEN, ks, pos)) * (vocab_size - 1)).astype(np.int64),
                        vocab_size - 2)
    tokens = tokens + (tokens >= mask_token_id)  # skip the mask token
    return replaced, tokens


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
    replace: Optional[tuple[float, int]] = None,
) -> NoisyBatch:
    """Build the noisy inputs of every draw of every row (on the CPU, then moved).

    ``draws`` selects a subset of the K draw indices (default all), used to
    split an example's draws across forward calls. ``replace`` = (share, vocab_size): besides the masked
    tokens, replace a share of the unmasked completion tokens by random ones (:func:`draw_replacements`) and
    score them too (their targets are the clean tokens).
    """
    B, cm, draw_idx, noisy, weight = noisy_start(input_ids, completion_mask, cfg, draws)
    K = len(draw_idx)
    rows, cols = [], []
    for b in range(B):
        positions = torch.nonzero(cm[b], as_tuple=False).squeeze(-1)
        L = positions.numel()
        mask, w = draw_masks(ids[b], L, cfg)
        if replace is not None:
            replaced, tokens = draw_replacements(ids[b], mask, cfg, replace[0], replace[1], mask_token_id, draw_idx)
        for j, k in enumerate(draw_idx):
            r = b * K + j
            sel = positions[torch.from_numpy(mask[k])]
            noisy[r, sel] = mask_token_id
            if replace is not None:
                swap = torch.from_numpy(replaced[j])
                noisy[r, positions[swap]] = torch.from_numpy(tokens[j])[swap]
                sel = torch.sort(torch.cat([sel, positions[swap]])).values
            rows.append(torch.full((sel.numel(),), r, dtype=torch.long))
            cols.append(sel)
            weight[r] = float(w[k])
    return noisy_finish(input_ids, attention_mask, noisy, rows, cols, weight, B, K)


def noisy_start(input_ids: torch.Tensor, completion_mask: torch.Tensor, cfg, draws: Optional[Sequence[int]]):
    """What building every draw's noisy rows starts from (on the CPU): ``(B, completion positions [B, T] bool, the
    draw indices, K clean copies of each row [B*K, T] to corrupt, the draws' weights [B*K] float64 to fill)``."""
    B = input_ids.shape[0]
    draw_idx = list(range(cfg.n_mc)) if draws is None else list(draws)
    noisy = input_ids.cpu().repeat_interleave(len(draw_idx), dim=0).clone()
    return B, completion_mask.bool().cpu(), draw_idx, noisy, torch.empty(B * len(draw_idx), dtype=torch.float64)


def noisy_finish(input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor], noisy: torch.Tensor, rows: list,
                 cols: list, weight: torch.Tensor, B: int, K: int) -> NoisyBatch:
    """The :class:`NoisyBatch` of the corrupted rows and each draw's scored positions (``rows`` / ``cols``: one
    tensor per draw), their clean targets gathered, moved to ``input_ids``' device."""
    rows_t = torch.cat(rows) if rows else torch.empty(0, dtype=torch.long)
    cols_t = torch.cat(cols) if cols else torch.empty(0, dtype=torch.long)
    targets = input_ids.cpu().repeat_interleave(K, dim=0)[rows_t, cols_t]
    dev = input_ids.device
    am = None if attention_mask is None else attention_mask.repeat_interleave(K, dim=0)
    return NoisyBatch(
        noisy.to(dev), am, rows_t.to(dev), cols_t.to(dev), targets.to(dev), weight.to(dev), B, K
    )


# --------------------------------------------------------------------------- the shared likelihood part
class AbsorbingMask(Likelihood):
    """What the absorbing-mask likelihoods share: the draws (:func:`draw_masks`) and the terms, each draw's
    weight times its sum of log p at the masked positions. A subclass says how the noisy rows go through the
    network (:meth:`draw_sums`) and what that costs (``footprint``)."""

    def draws(self, example_id: str, length: int, cfg: DrawConfig) -> tuple[np.ndarray, np.ndarray]:
        return draw_masks(example_id, length, cfg)

    def draw_terms(self, mp, input_ids, attention_mask, completion_mask, ids, cfg, *, max_rows_per_forward=None,
                   draws=None, pack_length=None) -> torch.Tensor:
        nb = make_noisy_batch(input_ids, attention_mask, completion_mask, ids, cfg, mp.mask_token_id, draws)
        total = self.draw_sums(mp, nb, input_ids, attention_mask, max_rows_per_forward, pack_length)  # [B*K]
        return (total.double() * nb.weight).float().view(nb.B, nb.K)

    @abstractmethod
    def draw_sums(self, mp, nb: NoisyBatch, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor],
                  max_rows_per_forward: Optional[int], pack_length: Optional[int]) -> torch.Tensor:
        """Per-draw sums of log p at the masked positions [B*K] (row b*K + j: draw j of row b)."""
