"""The continuous-time ELBO of a uniform-noise discrete diffusion LM (UDLM: Schiff et al. 2024,
arXiv 2412.10193, section 3, the continuous-time NELBO of uniform-state diffusion).

Forward process, independently per position (V = vocabulary size)::

    q(x_t | x_0) = alpha_t * onehot(x_0) + (1 - alpha_t) / V,    alpha_t = 1 - t,  t in (0, 1)

i.e. with probability 1 - alpha_t a position is replaced by a token drawn uniformly from all V
(possibly its own). The reverse step plugs the network's clean-token distribution x_theta(x_t)
into the bridge q(x_s | x_t, x_0 = x_theta); the negative ELBO is then

    -log p(x_0) <= sum over positions of  int_0^1  E_{x_t ~ q_t}[ nelbo_integrand(x_theta, x_0, x_t, t) ] dt

with the per-position integrand in closed form (:func:`per_token_nelbo`): with
xbar = V alpha onehot(x_0) + (1 - alpha), xbar_theta = V alpha x_theta + (1 - alpha) and i = x_t,

    integrand = -alpha'/(V alpha) * [ sum_{j != i} (xbar_j/xbar_i) log(xbar_theta_i xbar_j / (xbar_theta_j xbar_i))
                                      - V/xbar_i + V/xbar_theta_i ]

It is zero when x_theta is the one-hot of x_0 and positive otherwise. The prior term vanishes
(alpha_1 = 0: x_1 is uniform, the prior) and so does the reconstruction term (alpha_0 = 1). In
continuous time the bound's value depends on alpha only through its end points (the integrand
is g(alpha) d alpha), so the linear schedule alpha_t = 1 - t loses nothing; the schedule only
moves the Monte Carlo variance.

What the network's softmax is: under uniform noise the ELBO above is not minimised by the
denoising posterior p(x_0^l | x_t) but by the leave-one-out posterior p(x_0^l | x_t without
position l) (Gourevitch et al., arXiv 2605.22765). A network trained with the flat
cross-entropy learns the denoiser; :func:`loo_from_denoiser` converts it exactly (divide the
probability of the observed token x_t^l by 1 + V alpha / (1 - alpha), renormalise). Both
choices give a valid bound - each on the likelihood of the reverse process it plugs in - and
``parameterization`` records which one a run uses.

The draws: draw k of an example takes one time t per canvas (a block of ``canvas_length``
completion positions; the whole completion when None) and, per position, a replacement
decision and a replacement token, all pure functions of (seed, example id, draw, canvas,
position) through the same SplitMix64 counter hash and example key as the absorbing-mask draws
(:mod:`dllm_align.objective.draws`), on separate stream tags. Policy and reference therefore see
the same noisy canvases (common random numbers) on any device or process count.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch
from torch.utils.checkpoint import checkpoint

from dllm_align.core.errors import UserError
from dllm_align.objective.components import UniformSettings
from dllm_align.objective.draws import example_key, mix
from dllm_align.objective.likelihood import Footprint, Likelihood

PARAMETERIZATIONS = ("denoiser", "loo")

# Stream tags, distinct from the absorbing-mask draws' (1-4) so a shared seed and id give
# independent streams.
_TAG_TIME, _TAG_REPLACE, _TAG_TOKEN, _TAG_OFFSET = 11, 12, 13, 14


def _open_unit(h: np.ndarray) -> np.ndarray:
    """uint64 -> float64 uniform in the open interval (0, 1): t = 0 and t = 1 never occur, so
    alpha_t stays strictly inside (0, 1) where the integrand is finite."""
    return ((h >> np.uint64(11)).astype(np.float64) + 0.5) * (1.0 / (1 << 53))


# --------------------------------------------------------------------------- the noise process
def alpha(t: torch.Tensor) -> torch.Tensor:
    """The signal level alpha_t = 1 - t (linear schedule)."""
    return 1.0 - t


def time_weight(t: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """-alpha'_t / (V alpha_t) = 1 / (V (1 - t)): the time weight in front of the bracket."""
    return 1.0 / (vocab_size * alpha(t))


def forward_marginal(x0: torch.Tensor, t: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """q(x_t | x_0) as a distribution over the V tokens, shape [..., V] (float64)."""
    a = alpha(t.double())[..., None]
    onehot = torch.nn.functional.one_hot(x0, vocab_size).double()
    return a * onehot + (1.0 - a) / vocab_size


def _log1p_beta_p(log_probs: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """log(1 + beta p) for p = exp(log_probs), accurate for small and large beta."""
    # logaddexp(0, log beta + log p): exact for large beta*p, log1p-accurate for small.
    return torch.nn.functional.softplus(torch.log(beta)[..., None] + log_probs)


def per_token_nelbo(
    log_probs: torch.Tensor, x0: torch.Tensor, xt: torch.Tensor, t: torch.Tensor
) -> torch.Tensor:
    """The NELBO integrand at time t for each position (float64, >= 0, differentiable).

    ``log_probs`` [N, V]: log x_theta, the distribution plugged into the bridge; ``x0``, ``xt``
    [N] clean and noisy tokens; ``t`` [N] the position's time in (0, 1). One Monte Carlo draw
    (t ~ U(0, 1), x_t ~ q_t) of the sequence's negative ELBO is the sum over its positions.

    Written in beta = V alpha / (1 - alpha), the odds of the signal against one noise token, so
    that no term cancels catastrophically as t -> 0 or t -> 1: with g_j = log(1 + beta p_j),
    G = sum_j g_j and i = x_t, the sum over j != i is

        x_t == x_0:  (V g_i - G - (V - 1) log(1 + beta)) / (1 + beta)
        x_t != x_0:  V g_i - G + beta (g_i - g_{x_0}) + (1 + beta) log(1 + beta)

    and V/xbar_theta_i - V/xbar_i = V beta (p_i - [i == x_0]) / ((1 - alpha)(1 + beta [i == x_0])(1 + beta p_i)).
    The common factor 1/(V alpha) = 1/(beta (1 - alpha)).
    """
    lp = log_probs.double()
    V = lp.shape[-1]
    t = t.double().to(lp.device)
    a = alpha(t)
    one_minus_a = t
    beta = V * a / one_minus_a
    g = _log1p_beta_p(lp, beta)  # [N, V]
    G = g.sum(-1)
    g_i = g.gather(-1, xt[:, None]).squeeze(-1)
    g_0 = g.gather(-1, x0[:, None]).squeeze(-1)
    l1b = torch.log1p(beta)
    same = xt == x0
    sum_same = (V * g_i - G - (V - 1) * l1b) / (1.0 + beta)
    sum_diff = V * g_i - G + beta * (g_i - g_0) + (1.0 + beta) * l1b
    log_sum = torch.where(same, sum_same, sum_diff)
    p_i = lp.gather(-1, xt[:, None]).squeeze(-1).exp()
    delta = same.double()
    term1 = V * beta * (p_i - delta) / (one_minus_a * (1.0 + beta * delta) * (1.0 + beta * p_i))
    # integrand = (1/(V alpha)) * (log_sum + (V/xbar_theta_i - V/xbar_i)), V/xbar_theta_i - V/xbar_i = -term1
    # It is a divergence rate, >= 0 in exact arithmetic; where the network is all but certain and right, rounding
    # (of log-probabilities that sum to 1 only to within their precision) leaves values a few ulps either side of
    # 0: those below are 0, so that no draw of an ELBO comes out positive.
    return ((log_sum - term1) / (beta * one_minus_a)).clamp_min(0.0)


def loo_from_denoiser(log_probs: torch.Tensor, xt: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """The leave-one-out posterior from the denoiser, exactly (arXiv 2605.22765).

    p(x_0^l | x_t) is proportional to p(x_0^l | x_t^{-l}) q(x_t^l | x_0^l), and q(x_t^l | x_0^l) is
    1 + V alpha / (1 - alpha) times larger when x_0^l = x_t^l than otherwise; dividing it out
    and renormalising gives the leave-one-out posterior. Returns log-probabilities [N, V].
    """
    V = log_probs.shape[-1]
    t = t.to(log_probs.device, log_probs.dtype)
    shift = torch.log1p(V * alpha(t) / t)  # [N]
    onehot = torch.nn.functional.one_hot(xt, V).to(log_probs.dtype)
    return torch.log_softmax(log_probs - shift[:, None] * onehot, dim=-1)


def denoiser_from_loo(log_probs: torch.Tensor, xt: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`loo_from_denoiser`."""
    V = log_probs.shape[-1]
    t = t.to(log_probs.device, log_probs.dtype)
    shift = torch.log1p(V * alpha(t) / t)
    onehot = torch.nn.functional.one_hot(xt, V).to(log_probs.dtype)
    return torch.log_softmax(log_probs + shift[:, None] * onehot, dim=-1)


def plug_in(log_probs: torch.Tensor, xt: torch.Tensor, t: torch.Tensor, parameterization: str) -> torch.Tensor:
    """What enters the bridge: the network's distribution as it is (``denoiser``: the bound on
    the plug-in reverse process of the raw softmax) or converted to the leave-one-out posterior
    (``loo``: the bound's minimiser, when the network is a denoiser)."""
    if parameterization == "denoiser":
        return log_probs
    if parameterization == "loo":
        return loo_from_denoiser(log_probs, xt, t)
    raise ValueError(f"parameterization must be one of {PARAMETERIZATIONS}, got {parameterization!r}")


def flat_ce_terms(log_probs: torch.Tensor, x0: torch.Tensor) -> torch.Tensor:
    """The published SFT surrogate: the unweighted cross-entropy -log p(x_0) at each corrupted
    canvas position, whatever t. A training loss, not a bound on -log p(x_0)."""
    return -log_probs.double().gather(-1, x0[:, None]).squeeze(-1)


# --------------------------------------------------------------------------- deterministic draws
@dataclass(frozen=True)
class UniformDrawConfig:
    """How the K draws of an example are made.

    Each draw takes u uniform on (0, 1) per canvas and the time t = u ** ``time_power`` with the
    weight dt/du = time_power * u ** (time_power - 1), so the weighted draw is unbiased for any
    power. The power matters for the variance: with t uniform (power 1) a position replaced at a
    small t contributes about log(1/t)/t with probability about t, whose second moment
    (the integral of log(1/t)**2 / t) diverges; with power 2 it is the integral of log(1/t)**2 / sqrt(t),
    finite. ``stratified``: the K values of u of a canvas are (k + v)/K for one shared offset v,
    instead of K independent uniforms (lower variance, same expectation)."""

    n_mc: int = 8
    seed: int = 0
    stratified: bool = False
    time_power: int = UniformSettings.model_fields["time_power"].default

    def __post_init__(self):
        if self.n_mc < 1:
            raise ValueError("n_mc must be >= 1")
        if self.time_power < 1:
            raise ValueError("time_power must be >= 1")


@dataclass
class UniformDraws:
    """The K noisy versions of one example's completion of L tokens."""

    t: np.ndarray  # [K, L] float64 in (0, 1): the time of each position's canvas
    weight: np.ndarray  # [K, L] float64: dt/du of that time (1 when time_power is 1)
    replaced: np.ndarray  # [K, L] bool: the position was resampled
    token: np.ndarray  # [K, L] int64: the uniform token it was resampled to (used where replaced)

    def noisy(self, x0: np.ndarray | torch.Tensor):
        """x_t [K, L] from the clean completion x_0 [L]."""
        if isinstance(x0, torch.Tensor):
            rep = torch.from_numpy(self.replaced).to(x0.device)
            tok = torch.from_numpy(self.token).to(x0.device, x0.dtype)
            return torch.where(rep, tok, x0[None, :].expand_as(tok))
        return np.where(self.replaced, self.token, np.asarray(x0)[None, :])


def draw_uniform_noise(
    example_id: str, L: int, cfg: UniformDrawConfig, vocab_size: int, canvas_length: Optional[int] = None
) -> UniformDraws:
    """The K draws of one example: a pure function of (seed, id, draw, canvas, position).

    Draw k does not depend on K unless ``stratified``, so the first K' draws of a K-draw set are
    the K'-draw set. Position p belongs to canvas p // canvas_length; each canvas has its own
    time, so a completion longer than one canvas gets an independent t per canvas (the sum of
    per-canvas bounds is the block-diffusion bound; each term is unbiased either way).
    """
    if L < 1:
        raise ValueError(f"example {example_id!r} has no completion tokens to noise")
    if vocab_size < 2:
        raise ValueError("uniform noise needs a vocabulary of at least 2 tokens")
    C = L if canvas_length is None else int(canvas_length)
    if C < 1:
        raise ValueError("canvas_length must be >= 1")
    K = cfg.n_mc
    key = example_key(cfg.seed, example_id)
    ks = np.arange(K, dtype=np.uint64)
    pos = np.arange(L, dtype=np.uint64)
    canvas = (np.arange(L) // C).astype(np.uint64)
    n_canvas = int(canvas[-1]) + 1
    cs = np.arange(n_canvas, dtype=np.uint64)
    if cfg.stratified:
        v = _open_unit(mix(key, _TAG_OFFSET, cs))  # [n_canvas], shared by the K draws
        u_canvas = (np.arange(K, dtype=np.float64)[:, None] + v[None, :]) / K
    else:
        u_canvas = _open_unit(mix(key, _TAG_TIME, ks[:, None], cs[None, :]))  # [K, n_canvas]
    u = u_canvas[:, canvas.astype(np.int64)]  # [K, L]
    p = cfg.time_power
    t = u**p
    weight = p * u ** (p - 1)
    r = _open_unit(mix(key, _TAG_REPLACE, ks[:, None], pos[None, :]))
    replaced = r < t  # probability 1 - alpha_t = t
    h = mix(key, _TAG_TOKEN, ks[:, None], pos[None, :])
    # top 53 bits -> [0, 1) -> {0..V-1}; the bias of a 53-bit draw over V <= 2^20 is below 1e-9.
    token = np.minimum(np.floor(((h >> np.uint64(11)).astype(np.float64) / (1 << 53)) * vocab_size), vocab_size - 1)
    return UniformDraws(t=t, weight=weight, replaced=replaced, token=token.astype(np.int64))


def draw_nelbo(
    log_probs: torch.Tensor,
    x0: torch.Tensor,
    xt: torch.Tensor,
    t: torch.Tensor,
    parameterization: str = "denoiser",
) -> torch.Tensor:
    """Per-position NELBO integrand of one draw, with the recipe's parameterization applied.

    ``log_probs`` [N, V] is the network's log-softmax at the N scored positions given the noisy
    canvas ``xt``; the draw's estimate of -ELBO is the sum over an example's positions of these
    values times the draw's ``weight`` (:class:`UniformDraws`), and the mean over its K draws is
    the Monte Carlo estimate."""
    return per_token_nelbo(plug_in(log_probs, xt, t, parameterization), x0, xt, t)


def gauss_legendre_unit(n: int) -> tuple[np.ndarray, np.ndarray]:
    """Nodes and weights of the n-point Gauss-Legendre rule on (0, 1) (the t-integral of
    exact reference values)."""
    x, w = np.polynomial.legendre.leggauss(n)
    return 0.5 * (x + 1.0), 0.5 * w


# --------------------------------------------------------------------------- the likelihood component
SELF_CONDITIONING = ("none", "detached")
SURROGATES = ("elbo", "flat_ce")


def _row_parts(input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor], completion_mask: torch.Tensor,
               b: int, example_id: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(context, completion) of row b: the real tokens before the completion, and the completion's tokens
    (which must be one contiguous run; padding on either side is dropped)."""
    cm = completion_mask[b].bool()
    pos = torch.nonzero(cm, as_tuple=False).squeeze(-1)
    if pos.numel() == 0:
        raise ValueError(f"example {example_id!r} has no completion tokens to noise")
    first, last = int(pos[0]), int(pos[-1])
    if last - first + 1 != pos.numel():
        raise ValueError(f"example {example_id!r}: the uniform likelihood needs one contiguous completion")
    valid = torch.ones_like(cm) if attention_mask is None else attention_mask[b].bool()
    before = valid.clone()
    before[first:] = False
    context = input_ids[b][before]
    if context.numel() == 0:
        raise ValueError(f"example {example_id!r} has no context: the encoder needs at least one token (a BOS)")
    return context, input_ids[b, first:last + 1]


# Positions x vocabulary entries of one chunk of the bound (:func:`_bound_terms`): its float64 working set is
# about 28 bytes an entry (the log-softmax, softplus's input and output, the fp32 logits' copy), 470 MB here.
BOUND_CHUNK = 1 << 24


def _bound_chunk(logits: torch.Tensor, x0: torch.Tensor, xt: torch.Tensor, t: torch.Tensor, par: str,
                 surrogate: str) -> torch.Tensor:
    # normalised in float64: the integrand assumes the probabilities sum to 1 (fp32's do only to ~1e-7)
    lp = torch.log_softmax(logits.double(), dim=-1)
    return flat_ce_terms(lp, x0) if surrogate == "flat_ce" else draw_nelbo(lp, x0, xt, t, par)


def _bound_terms(logits: torch.Tensor, x0: torch.Tensor, xt: torch.Tensor, t: torch.Tensor, par: str,
                 surrogate: str) -> torch.Tensor:
    """Per-position terms [N] (float64) from fp32 logits [N, V], in chunks of positions whose float64 working set
    is recomputed in the backward pass (``torch.utils.checkpoint``) instead of kept: what stays between forward and
    backward is the logits the model returned, 4 bytes an entry, not the bound's 24 bytes of float64 tensors
    (measured with saved-tensor hooks). The values are those of one unchunked call: every operation is per
    position."""
    rows = max(1, BOUND_CHUNK // max(1, logits.shape[-1]))
    out = []
    for s in range(0, logits.shape[0], rows):
        args = (logits[s:s + rows], x0[s:s + rows], xt[s:s + rows], t[s:s + rows], par, surrogate)
        if torch.is_grad_enabled() and logits.requires_grad:
            out.append(checkpoint(_bound_chunk, *args, use_reentrant=False))
        else:
            out.append(_bound_chunk(*args))
    return torch.cat(out) if len(out) > 1 else out[0]


class UniformNoise(Likelihood):
    """Uniform-noise block diffusion (DiffusionGemma): the per-canvas continuous-time ELBO above, each canvas
    conditioned on the clean context before it (the block-diffusion factorisation).

    One draw of an example noises every canvas of its completion (:func:`draw_uniform_noise`, a canvas being
    ``canvas_length`` positions of the model's config); the model encodes the clean context once and scores
    the K noisy canvases against its cache (``MaskPredictor.canvas_logits``). The term of a draw is
    -sum over positions of weight * integrand (an ELBO on log p(completion | prompt), <= 0), or with
    ``surrogate: flat_ce`` minus the unweighted cross-entropy summed over the canvas (the published SFT
    loss; not a bound). ``time_power``, ``parameterization``, ``self_conditioning`` and ``surrogate`` are this
    likelihood's own settings (``cfg.settings_of("uniform")``; recipe keys ``reference.time_power``, ...)."""

    name = "uniform"
    packs = False
    packs_reason = ("each example's clean context runs through the encoder alone and its canvases against that "
                    "cache, so no compute goes to padding and there is nothing to pack")

    def _draw_config(self, cfg) -> UniformDrawConfig:
        return UniformDrawConfig(n_mc=cfg.n_mc, seed=cfg.seed, stratified=cfg.stratified,
                                 time_power=cfg.settings_of(self.name).time_power)

    def draws(self, example_id: str, length: int, cfg, vocab_size: int = 2, canvas_length: Optional[int] = None):
        return draw_uniform_noise(example_id, length, self._draw_config(cfg), vocab_size, canvas_length)

    def draw_terms(self, mp, input_ids, attention_mask, completion_mask, ids, cfg, *, max_rows_per_forward=None,
                   draws=None, pack_length=None) -> torch.Tensor:
        if pack_length is not None:
            raise UserError("data.padding: packed is not available for uniform-noise models (DiffusionGemma)",
                            hint=self.packs_reason + ": use data.padding: none")
        own = cfg.settings_of(self.name)  # this likelihood's settings (objective/components.py: UniformSettings)
        par, sc, surrogate = own.parameterization, own.self_conditioning, own.surrogate
        if par not in PARAMETERIZATIONS or sc not in SELF_CONDITIONING or surrogate not in SURROGATES:
            raise ValueError(f"uniform likelihood: bad choice (parameterization {par!r}, self_conditioning {sc!r}, "
                             f"surrogate {surrogate!r})")
        ucfg = self._draw_config(cfg)
        V = int(mp.vocab_size)
        C = int(mp.canvas_length)
        draw_idx = list(range(cfg.n_mc)) if draws is None else list(draws)
        K = len(draw_idx)
        B = input_ids.shape[0]
        cpu_ids = input_ids.cpu()
        cpu_am = None if attention_mask is None else attention_mask.cpu()
        cm = completion_mask.cpu()
        rows = []  # per row: (context, canvases, noisy canvases, x0 [L], xt [K, L], t [K, L], weight [K, L])
        for b in range(B):
            context, x0 = _row_parts(cpu_ids, cpu_am, cm, b, ids[b])
            L = x0.numel()
            d = draw_uniform_noise(ids[b], L, ucfg, V, C)
            sel = np.asarray(draw_idx)
            xt = torch.where(torch.from_numpy(d.replaced[sel]), torch.from_numpy(d.token[sel]), x0[None, :])
            cuts = list(range(0, L, C))
            rows.append((context, [x0[s:s + C] for s in cuts], [xt[:, s:s + C] for s in cuts], x0, xt,
                         torch.from_numpy(d.t[sel]), torch.from_numpy(d.weight[sel])))
        per_call = max(1, (max_rows_per_forward or B * K) // K)
        terms = []
        for start in range(0, B, per_call):
            group = rows[start:start + per_call]
            logits = mp.canvas_logits([(r[0], r[1], r[2]) for r in group], self_conditioning=sc)
            for r, per_canvas in zip(group, logits):
                x0, xt, t, w = r[3], r[4], r[5], r[6]
                dev = per_canvas[0].device
                cols, at = [], 0
                for lg in per_canvas:  # [K, C_b, V] each
                    C_b = lg.shape[1]
                    cols.append(_bound_terms(lg.reshape(-1, lg.shape[-1]),
                                             x0[at:at + C_b].to(dev)[None, :].expand(K, -1).reshape(-1),
                                             xt[:, at:at + C_b].to(dev).reshape(-1), t[:, at:at + C_b].to(dev).reshape(-1),
                                             par, surrogate).view(K, C_b))
                    at += C_b
                per_pos = torch.cat(cols, dim=1)  # [K, L] float64
                if surrogate != "flat_ce":
                    per_pos = per_pos * w.to(dev)
                terms.append(-per_pos.sum(dim=1))  # [K] float64
        return torch.stack(terms).float()  # [B, K]

    def footprint(self, shape, draws: int, length: int, compute_bytes: int, *, attn: str = "sdpa",
                  packed: bool = False) -> Footprint:
        # K noisy canvases plus the clean context through the body; the per-position logits over the whole
        # vocabulary are kept in fp32 for the bound (it sums over every token), counted by the memory model's
        # head line for the scored rows.
        # The bound sums over the whole vocabulary at every canvas position, so the per-position logits of every
        # canvas of the unit's completion are kept in fp32 until the backward pass, twice (the soft-cap's saved
        # tanh and the logits returned: K x C x V x 4 bytes each per canvas, 2.1 GB at K = 8 for the published 26B),
        # the completion taken at its longest (``length``); the bound's float64 tensors exist one chunk at a time
        # (``BOUND_CHUNK`` entries, about 28 bytes each) and are recomputed in the backward pass.
        line = {}
        cfg = getattr(shape, "config", None) or {}
        C = int(cfg.get("canvas_length") or 0)
        if C and shape is not None:
            canvases = -(-length // C)
            line["uniform-noise logits, fp32, twice (K x canvas x vocab x canvases)"] = \
                2 * canvases * draws * C * int(shape.vocab) * 4
            line["uniform-noise bound, float64 working set of one chunk"] = BOUND_CHUNK * 28
        return Footprint(rows=draws + 1, scored_rows=draws, unit_lines=line,
                         notes=("uniform noise: the bound reads full-vocabulary fp32 logits at every canvas position",))


UNIFORM = UniformNoise()


__all__ = [
    "PARAMETERIZATIONS",
    "UniformDrawConfig",
    "UniformDraws",
    "alpha",
    "time_weight",
    "forward_marginal",
    "per_token_nelbo",
    "loo_from_denoiser",
    "denoiser_from_loo",
    "plug_in",
    "flat_ce_terms",
    "draw_uniform_noise",
    "draw_nelbo",
    "gauss_legendre_unit",
    "UniformNoise",
    "UNIFORM",
]
