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

Not yet a likelihood of the commands: scoring it needs the network's distribution at every position of the noisy
streams (a replaced token looks clean), which the block ELBO's scoring does not read.
"""

from __future__ import annotations

from typing import Optional

import torch


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


__all__ = ["draw", "estimate", "integrand", "marginal", "mixing", "model_marginal"]
