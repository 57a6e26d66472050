"""A bound for masked-plus-replaced corruption (LLaDA2.1's kind of noise; docs/design.md#a-bound-for-masked-and-replaced-tokens).

The forward process, independently per position, over the V real tokens and the mask (state V)::

    q_t(z | x) = alpha_t * onehot(x) + (1 - alpha_t) * pi,    pi = mask_share * onehot(mask) + (1 - mask_share) / V * 1_real

with alpha_t = 1 - t: a corrupted position is the mask with probability ``mask_share`` and a uniformly drawn real
token otherwise. It is the interpolating process of von Rütte et al. 2025 ("Generalized Interpolating Discrete
Diffusion") with a mixing distribution constant in time, whose forward rate from z to z' != z is
lambda_t * pi(z'), lambda_t = -alpha'_t / alpha_t = 1 / (1 - t). The reverse model plugs the network's distribution
over clean tokens x_theta into the same marginal, b = q_t(. | x_theta) = alpha_t x_theta + (1 - alpha_t) pi, and takes
the reverse rates lambda_t pi(z) b(z') / b(z). The continuous-time ELBO (Campbell et al. 2022; the prior term is 0:
q_1 = pi is the prior) is, per position, with a = q_t(. | x) and z the position's noisy state::

    -log p(x) <= int_0^1 E_{z ~ q_t}[ lambda_t pi(z) ( 1/b(z) - 1/a(z) + (1/a(z)) sum_{z' != z} a(z') log(a(z')/b(z'))
                                                     + ((1 - a(z))/a(z)) log(b(z)/a(z)) ) ] dt

summed over positions (x_theta at each position reads the whole noisy sequence). It is 0 where x_theta is the clean
token's one-hot. ``mask_share`` is not published for LLaDA2.1 (its report describes the mixture qualitatively): the
choice is the caller's (docs/design.md says which is documented).

The Monte Carlo estimator draws t = u^2 (u uniform on (0, 1)) with weight 2u: where a position is replaced (about
t of the time at small t) the integrand grows like log(1/t) / t, whose square is not integrable under a uniform t;
the u^2 draw keeps the estimator unbiased with a finite variance.

The functions above are the small reference implementation (float64 over the V + 1 states, for tiny vocabularies).
The likelihood component ``"hybrid"`` (:class:`HybridBound`, selected by ``reference.likelihood: hybrid`` on a family
that accepts it: LLaDA2.1) computes the same integrand in closed form from the network's log-softmax
(:func:`closed_form_integrand`), never forming a [V + 1] distribution per position, and applies the bound per block
as block diffusion factorises a completion: each noisy block is scored given the clean blocks before it, through the
block ELBO's streams layout (``objective.block.block_draw_sums``), every completion position read (a replaced token
looks clean). One time t per draw serves every block of the completion: each block's bound is an integral over t, so
the sum of the blocks' integrands at a shared t is unbiased for the sum of their bounds.

Its draws are pure functions of (seed, example id, draw, position) through the hash every likelihood uses
(``objective.draws``), on stream tags of their own: policy and reference see the same times, the same masked
positions and the same replacement tokens, so their margins are exactly 0 at step 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from dllm_align.core.errors import UserError
from dllm_align.models.predictor import MaskPredictor
from dllm_align.objective.block import BLOCK, block_draw_sums
from dllm_align.objective.draws import NoisyBatch, example_key, mix, noisy_finish, noisy_start
from dllm_align.objective.likelihood import Footprint, Likelihood


def mixing(vocab_size: int, mask_share: float) -> torch.Tensor:
    """pi over the V real tokens and the mask (index V), float64."""
    pi = torch.full((vocab_size + 1,), (1.0 - mask_share) / vocab_size, dtype=torch.float64)
    pi[vocab_size] = mask_share
    return pi


def marginal(x0: torch.Tensor, t: torch.Tensor, vocab_size: int, mask_share: float) -> torch.Tensor:
    """q_t(. | x0) [..., V + 1] for clean tokens ``x0`` [...] at times ``t`` (broadcast to ``x0``)."""
    alpha = (1.0 - t.double()).expand(x0.shape)[..., None]
    onehot = torch.nn.functional.one_hot(x0, vocab_size + 1).double()
    return alpha * onehot + (1.0 - alpha) * mixing(vocab_size, mask_share)


def model_marginal(x_theta: torch.Tensor, t: torch.Tensor, mask_share: float) -> torch.Tensor:
    """q_t(. | x_theta) [..., V + 1] for the network's clean-token distribution ``x_theta`` [..., V] (no mass on the
    mask)."""
    vocab_size = x_theta.shape[-1]
    alpha = (1.0 - t.double()).expand(x_theta.shape[:-1])[..., None]
    padded = torch.cat([x_theta.double(), torch.zeros(*x_theta.shape[:-1], 1, dtype=torch.float64)], -1)
    return alpha * padded + (1.0 - alpha) * mixing(vocab_size, mask_share)


def integrand(x_theta: torch.Tensor, x0: torch.Tensor, z: torch.Tensor, t: torch.Tensor, mask_share: float) -> torch.Tensor:
    """The bound's integrand at time ``t`` for positions in noisy state ``z`` (float64, [...])."""
    vocab_size = x_theta.shape[-1]
    a = marginal(x0, t, vocab_size, mask_share)
    b = model_marginal(x_theta, t, mask_share)
    az, bz = a.gather(-1, z[..., None])[..., 0], b.gather(-1, z[..., None])[..., 0]
    others = (a * (a / b).log()).sum(-1) - az * (az / bz).log()
    lam = 1.0 / (1.0 - t.double()).expand(z.shape)
    pi_z = mixing(vocab_size, mask_share)[z]
    return lam * pi_z * (1.0 / bz - 1.0 / az + others / az + (1.0 - az) / az * (bz / az).log())


def draw(x0: torch.Tensor, vocab_size: int, mask_share: float, generator: Optional[torch.Generator] = None):
    """One draw for each position of ``x0`` [n]: the time t = u^2 (one per sequence), its weight 2u, and the noisy
    states z [n] ~ q_t(. | x0)."""
    u = torch.rand((), generator=generator, dtype=torch.float64)
    t = u * u
    probs = marginal(x0, t, vocab_size, mask_share)
    z = torch.multinomial(probs.float(), 1, generator=generator)[..., 0]
    return t, 2.0 * u, z


def estimate(net, x0: torch.Tensor, vocab_size: int, mask_share: float, generator: Optional[torch.Generator] = None):
    """One unbiased draw of the bound for the sequence ``x0`` [n]; ``net(z) -> x_theta [n, V]`` reads the whole noisy
    sequence."""
    t, weight, z = draw(x0, vocab_size, mask_share, generator)
    return weight * integrand(net(z), x0, z, t, mask_share).sum()


# --------------------------------------------------------------------------- the integrand from log-probabilities
def _x_minus_log1p(y: torch.Tensor) -> torch.Tensor:
    """y - log(1 + y) for y >= 0, without the cancellation at small y (its series there)."""
    small = y < 1e-3
    ys = torch.where(small, y, torch.zeros_like(y))
    series = ys * ys * (0.5 - ys * (1.0 / 3 - ys * (0.25 - ys / 5)))
    return torch.where(small, series, y - torch.log1p(y))


def _log1p_minus_ratio(w: torch.Tensor) -> torch.Tensor:
    """log(1 + w) - w / (1 + w) for w >= 0, without the cancellation at small w (its series there)."""
    small = w < 1e-3
    ws = torch.where(small, w, torch.zeros_like(w))
    series = ws * ws * (0.5 - ws * (2.0 / 3 - ws * (0.75 - ws * 0.8)))
    return torch.where(small, series, torch.log1p(w) - w / (1.0 + w))


def closed_form_integrand(log_probs: torch.Tensor, x0: torch.Tensor, z: torch.Tensor, t: torch.Tensor,
                          mask_id: int, mask_share: float) -> torch.Tensor:
    """:func:`integrand` at n positions (float64 [n], >= 0, differentiable) from the network's log-probabilities.

    ``log_probs`` [n, V + 1] over the model's ids, the mask's column -inf (x_theta puts no mass on it); ``x0``, ``z``
    [n] clean and noisy ids (``z`` may be ``mask_id``); ``t`` [n] in (0, 1). The V real tokens are the other ids.
    With rho = (1 - s) / V, c = t rho, beta = (1 - t) / c (the odds of the signal against one noise token),
    g_j = log(1 + beta p_j), y = beta (1 - p_x) / (1 + beta p_x) and K = (1 + beta) log(1 + y) - sum_{j != x} g_j
    (docs/design.md#a-bound-for-masked-and-replaced-tokens), the integrand is

        z the mask:         rho K / (1 - t)
        z = x:              (rho K + (y - log(1 + y)) / t) / ((1 - t)(1 + beta))
        z = i, a real i != x: (rho K + (log(1 + beta p_i) - beta p_i / (1 + beta p_i)) / t) / (1 - t)

    each bracket's difference taken where it cannot cancel (1 - p_x from expm1, series at small arguments)."""
    lp = log_probs.double()
    V = lp.shape[-1] - 1
    t = t.double().to(lp.device)
    rho = (1.0 - mask_share) / V
    c = t * rho
    beta = (1.0 - t) / c
    g = torch.nn.functional.softplus(torch.log(beta)[:, None] + lp)  # log(1 + beta p_j); 0 at the mask's column
    others = g.scatter(-1, x0[:, None], 0.0).sum(-1)  # sum over the real j != x
    lp_x = lp.gather(-1, x0[:, None])[:, 0]
    q_x = (-torch.expm1(lp_x)).clamp_min(0.0)  # 1 - p_x
    y = beta * q_x / (1.0 + beta * lp_x.exp())
    big_k = (1.0 + beta) * torch.log1p(y) - others
    w = beta * lp.gather(-1, z[:, None])[:, 0].exp()  # beta p_z (0 where z is the mask)
    kept = (rho * big_k + _x_minus_log1p(y) / t) / (1.0 + beta)
    swapped = rho * big_k + _log1p_minus_ratio(w) / t
    value = torch.where(z == mask_id, rho * big_k, torch.where(z == x0, kept, swapped)) / (1.0 - t)
    # a divergence rate, >= 0 in exact arithmetic; where the network is all but certain and right, rounding leaves
    # values a few ulps either side of 0: those below are 0, so that no draw of an ELBO comes out positive
    return value.clamp_min(0.0)


def bound_terms(logits: torch.Tensor, x0: torch.Tensor, z: torch.Tensor, t: torch.Tensor, *, mask_id: int,
                mask_share: float) -> torch.Tensor:
    """:func:`closed_form_integrand` from fp32 logits [n, V + 1] (the mask's column dropped, normalised in float64:
    the integrand assumes the probabilities sum to 1)."""
    lg = logits.double().index_fill(-1, torch.tensor([mask_id], device=logits.device), float("-inf"))
    return closed_form_integrand(torch.log_softmax(lg, dim=-1), x0, z, t, mask_id, mask_share)


# --------------------------------------------------------------------------- deterministic draws
# Stream tags, distinct from the absorbing-mask draws' (1-6) and the uniform noise's (11-14).
_TAG_TIME, _TAG_CORRUPT, _TAG_KIND, _TAG_TOKEN, _TAG_OFFSET = 21, 22, 23, 24, 25


def _open_unit(h: np.ndarray) -> np.ndarray:
    """uint64 -> float64 uniform in (0, 1): t = 0 and t = 1 never occur, where the integrand is not finite."""
    return ((h >> np.uint64(11)).astype(np.float64) + 0.5) * (1.0 / (1 << 53))


@dataclass
class HybridDraws:
    """The K noisy versions of one example's completion of L tokens."""

    t: np.ndarray  # [K] float64 in (0, 1): the draw's time, t = u^2
    weight: np.ndarray  # [K] float64: dt/du = 2u
    masked: np.ndarray  # [K, L] bool: the position holds the mask
    replaced: np.ndarray  # [K, L] bool: the position holds a uniformly drawn real token (possibly its own)
    token: np.ndarray  # [K, L] int64: that token's id (used where replaced; never the mask's)


def draw_hybrid(example_id: str, L: int, cfg, vocab_size: int, mask_id: int, mask_share: float,
                draws: Optional[list] = None) -> HybridDraws:
    """Draws ``draws`` (default 0..K-1) of one example: a pure function of (seed, id, draw, position), plus K when
    ``cfg.stratified`` (then the K values of u are (k + v) / K for one shared offset v). Each position is corrupted
    with probability t, and a corrupted one is the mask with probability ``mask_share``, else a token drawn
    uniformly from the ``vocab_size - 1`` ids that are not the mask."""
    if L < 1:
        raise ValueError(f"example {example_id!r} has no completion tokens to noise")
    key = example_key(cfg.seed, example_id)
    ks = np.asarray(list(range(cfg.n_mc)) if draws is None else list(draws), dtype=np.uint64)
    pos = np.arange(L, dtype=np.uint64)[None, :]
    if cfg.stratified:
        u = (ks.astype(np.float64) + _open_unit(mix(key, _TAG_OFFSET))) / cfg.n_mc
    else:
        u = _open_unit(mix(key, _TAG_TIME, ks))
    t = u * u
    corrupted = _open_unit(mix(key, _TAG_CORRUPT, ks[:, None], pos)) < t[:, None]
    masked = corrupted & (_open_unit(mix(key, _TAG_KIND, ks[:, None], pos)) < mask_share)
    real = vocab_size - 1
    h = mix(key, _TAG_TOKEN, ks[:, None], pos)
    index = np.minimum(np.floor((h >> np.uint64(11)).astype(np.float64) / (1 << 53) * real), real - 1).astype(np.int64)
    return HybridDraws(t=t, weight=2.0 * u, masked=masked, replaced=corrupted & ~masked,
                       token=index + (index >= mask_id))  # the real tokens' ids skip the mask's


def hybrid_noisy_batch(input_ids: torch.Tensor, completion_mask: torch.Tensor, ids, cfg, vocab_size: int,
                       mask_id: int, mask_share: float, draws: Optional[list] = None) -> tuple[NoisyBatch, torch.Tensor]:
    """The noisy rows of every draw of every row [B*K, T] and every completion position of each as a scored
    position (``rows``, ``cols``, clean ``targets``), the draws' weights 2u, and each scored position's time [N]."""
    B, cm, draw_idx, noisy, weight = noisy_start(input_ids, completion_mask, cfg, draws)
    K = len(draw_idx)
    rows, cols, times = [], [], []
    for b in range(B):
        positions = torch.nonzero(cm[b], as_tuple=False).squeeze(-1)
        d = draw_hybrid(ids[b], positions.numel(), cfg, vocab_size, mask_id, mask_share, draw_idx)
        for j in range(K):
            r = b * K + j
            swap = torch.from_numpy(d.replaced[j])
            noisy[r, positions[swap]] = torch.from_numpy(d.token[j])[swap]
            noisy[r, positions[torch.from_numpy(d.masked[j])]] = mask_id
            rows.append(torch.full((positions.numel(),), r, dtype=torch.long))
            cols.append(positions)
            times.append(torch.full((positions.numel(),), float(d.t[j]), dtype=torch.float64))
            weight[r] = float(d.weight[j])
    return noisy_finish(input_ids, None, noisy, rows, cols, weight, B, K), torch.cat(times).to(input_ids.device)


# --------------------------------------------------------------------------- the likelihood component
class HybridBound(Likelihood):
    """The masked-plus-replaced bound over the family's blocks, the likelihood component ``"hybrid"`` (the module
    docstring): the term of a draw is -2u times the sum over every completion position of the integrand at the draw's
    time (an ELBO on log p(completion | prompt), <= 0). ``mask_share`` is its own setting
    (``reference.hybrid.mask_share``, ``cfg.settings_of("hybrid")``)."""

    name = "hybrid"
    packs = False
    packs_reason = ("the packed block layout rebuilds each noisy stream from the clean rows by placing masks, which "
                    "would drop the replaced tokens")

    def draws(self, example_id: str, length: int, cfg, vocab_size: int = 2, mask_id: int = 1) -> HybridDraws:
        return draw_hybrid(example_id, length, cfg, vocab_size, mask_id, cfg.settings_of(self.name).mask_share)

    def draw_terms(self, mp, input_ids, attention_mask, completion_mask, ids, cfg, *, max_rows_per_forward=None,
                   draws=None, pack_length=None) -> torch.Tensor:
        if pack_length is not None:
            raise UserError("data.padding: packed is not available with reference.likelihood: hybrid",
                            hint=self.packs_reason + ": use data.padding: none")
        block_size = getattr(mp, "block_size", None)
        if not block_size:
            raise ValueError("the masked-plus-replaced likelihood needs the model's block size (mp.block_size)")
        share = cfg.settings_of(self.name).mask_share
        mask_id = int(mp.mask_token_id)
        nb, times = hybrid_noisy_batch(input_ids, completion_mask, ids, cfg, int(mp.vocab_size), mask_id, share, draws)

        def score(streams_ids, r, c, sel, streams):
            # the noisy token at each scored position: its own stream's column of the draw's row
            z = nb.input_ids[nb.rows[sel], nb.cols[sel]]
            return mp.position_terms(streams_ids, None, r, c, _Terms(mask_id, share),
                                     (nb.targets[sel], z, times[sel]), streams=streams)

        total = block_draw_sums(mp, nb, input_ids, attention_mask, block_size, max_rows_per_forward, None, score=score)
        return (-(total * nb.weight)).float().view(nb.B, nb.K)

    def footprint(self, shape, draws: int, length: int, compute_bytes: int, *, attn: str = "sdpa",
                  packed: bool = False) -> Footprint:
        # the block ELBO's streams layout and attention, plus the bound's float64 working set on one chunk of
        # full-vocabulary logits (MaskPredictor.position_terms; recomputed in the backward pass, not kept)
        foot = BLOCK.footprint(shape, draws, length, compute_bytes, attn=attn, packed=False)
        chunk = MaskPredictor.TERM_CHUNK
        lines = dict(foot.unit_lines)
        lines["masked-plus-replaced bound, fp32 logits and float64 working set of one chunk"] = chunk * (4 + 28)
        return Footprint(rows=foot.rows, scored_rows=foot.scored_rows, attention_saved=foot.attention_saved,
                         attention_line=foot.attention_line, mask_bytes=foot.mask_bytes, mask_line=foot.mask_line,
                         unit_lines=lines, row_lines=foot.row_lines,
                         notes=foot.notes + ("masked-plus-replaced bound: every completion position's full-vocabulary "
                                             "distribution is read, a chunk at a time",))


class _Terms:
    """The per-position term :meth:`MaskPredictor.position_terms` applies: a picklable callable, so that a wrapped
    policy's forward (DDP, FSDP) can take it as an argument."""

    def __init__(self, mask_id: int, mask_share: float):
        self.mask_id, self.mask_share = mask_id, mask_share

    def __call__(self, logits, x0, z, t):
        return bound_terms(logits, x0, z, t, mask_id=self.mask_id, mask_share=self.mask_share)


HYBRID = HybridBound()


__all__ = ["HYBRID", "HybridBound", "HybridDraws", "bound_terms", "closed_form_integrand", "draw", "draw_hybrid",
           "estimate", "hybrid_noisy_batch", "integrand", "marginal", "mixing", "model_marginal"]
