"""The masked-plus-replaced bound (``dllm_align.objective.hybrid``; docs/design.md#a-bound-for-masked-and-replaced-tokens)
on a vocabulary of 3 real tokens and the mask: its forward rates give its marginals; its closed form equals the
continuous-time ELBO written from the rates, enumerated over every noisy state of two positions and integrated in t;
it bounds the exact likelihood of its reverse process (one position, the reverse chain solved as an ODE) and is 0
for the perfect denoiser; its Monte Carlo estimate is unbiased."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

from dllm_align.objective.hybrid import estimate, integrand, marginal, mixing, model_marginal

V, SHARE = 3, 0.7  # mask_share: an arbitrary value for the checks (the bound holds for any)
STATES = V + 1


def T(s: float) -> torch.Tensor:
    return torch.tensor(s, dtype=torch.float64)


def table_net(seed: int, n: int):
    """x_theta as an arbitrary function of the whole noisy sequence: a random softmax per joint state and position."""
    g = torch.Generator().manual_seed(seed)
    logits = 2.0 * torch.randn(STATES ** n, n, V, generator=g, dtype=torch.float64)

    def net(z: torch.Tensor) -> torch.Tensor:
        index = sum(int(s) * STATES ** i for i, s in enumerate(z.tolist()))
        return torch.softmax(logits[index], -1)

    return net


def test_the_forward_rates_give_the_marginals():
    """d q_t / dt = Q_t^T q_t with the rate from z to z' != z being pi(z') / (1 - t)."""
    pi = mixing(V, SHARE)
    for x0, t in itertools.product(range(V), (0.1, 0.5, 0.9)):
        q = lambda s: marginal(torch.tensor(x0), T(s), V, SHARE)  # noqa: E731
        h = 1e-6
        dq = (q(t + h) - q(t - h)) / (2 * h)
        rates = pi.expand(STATES, STATES).clone() / (1 - t)
        rates.fill_diagonal_(0)
        rates -= torch.diag(rates.sum(1))
        assert torch.allclose(dq, rates.T @ q(t), atol=1e-8)
    assert torch.allclose(marginal(torch.tensor(1), T(1.0), V, SHARE), pi)  # q_1 is the prior


def rate_form(net, x0: torch.Tensor, t: float) -> float:
    """E_z sum over positions and moves (R_theta - R + R log(R / R_theta)), written from the reverse rates and
    enumerated over every joint noisy state."""
    n = len(x0)
    pi = mixing(V, SHARE)
    a = marginal(x0, T(t), V, SHARE)
    lam = 1.0 / (1.0 - t)
    total = 0.0
    for z in itertools.product(range(STATES), repeat=n):
        zt = torch.tensor(z)
        weight = math.prod(float(a[i, z[i]]) for i in range(n))
        b = model_marginal(net(zt), T(t), SHARE)
        for i in range(n):
            for zp in range(STATES):
                if zp == z[i]:
                    continue
                true = lam * float(pi[z[i]]) * float(a[i, zp]) / float(a[i, z[i]])
                model = lam * float(pi[z[i]]) * float(b[i, zp]) / float(b[i, z[i]])
                total += weight * (model - true + true * math.log(true / model))
    return total


def closed_form(net, x0: torch.Tensor, t: float) -> float:
    n = len(x0)
    a = marginal(x0, T(t), V, SHARE)
    total = 0.0
    for z in itertools.product(range(STATES), repeat=n):
        zt = torch.tensor(z)
        weight = math.prod(float(a[i, z[i]]) for i in range(n))
        total += weight * float(integrand(net(zt), x0, zt, T(t), SHARE).sum())
    return total


def exact_bound(net, x0: torch.Tensor, form=closed_form, nodes: int = 96) -> float:
    """The bound by exact enumeration of the noisy states, integrated in t by Gauss-Legendre quadrature on
    t = u^2 (the integrand is smooth in u)."""
    u, w = np.polynomial.legendre.leggauss(nodes)
    u, w = (u + 1) / 2, w / 2
    return sum(float(wi) * 2 * float(ui) * form(net, x0, float(ui) ** 2) for ui, wi in zip(u, w))


def test_the_closed_form_equals_the_rate_form_enumerated():
    net = table_net(0, 2)
    x0 = torch.tensor([0, 2])
    for t in (0.01, 0.3, 0.77, 0.999):
        assert closed_form(net, x0, t) == pytest.approx(rate_form(net, x0, t), rel=1e-10, abs=1e-12)
    assert abs(exact_bound(net, x0, closed_form, 48) - exact_bound(net, x0, rate_form, 48)) <= 1e-6
    assert exact_bound(net, x0, nodes=96) == pytest.approx(exact_bound(net, x0, nodes=192), abs=1e-6)  # converged


def reverse_nll(net, x0: int, steps: int = 4000, y_max: float = 16.0, y_min: float = -25.0) -> float:
    """-log p_theta(x0) for one position: the reverse chain's state distribution solved from the prior pi near
    t = 1 down to t near 0, RK4 in y = logit(t), where the rates lambda_t pi(z) b(z') / b(z) dt become
    t pi(z) b(z') / b(z) dy: bounded at both ends (b(z) shrinks like t where z is not the clean token)."""
    pi = mixing(V, SHARE)

    def generator(y: float) -> torch.Tensor:
        t = 1.0 / (1.0 + math.exp(-y))
        rows = []
        for z in range(STATES):
            b = model_marginal(net(torch.tensor([z])), T(t), SHARE)[0]
            row = t * pi[z] * b / b[z]
            row[z] = 0
            row[z] = -row.sum()
            rows.append(row)
        return torch.stack(rows)

    p, h = pi.clone(), (y_max - y_min) / steps
    y = y_max
    for _ in range(steps):  # dp/d(-y) = p G(y): from y_max down to y_min
        k1 = p @ generator(y)
        k2 = (p + h / 2 * k1) @ generator(y - h / 2)
        k3 = (p + h / 2 * k2) @ generator(y - h / 2)
        k4 = (p + h * k3) @ generator(y - h)
        p, y = p + h / 6 * (k1 + 2 * k2 + 2 * k3 + k4), y - h
    assert abs(float(p.sum()) - 1) < 1e-9 and float(p.min()) > -1e-9
    return -math.log(float(p[x0]))


def test_it_bounds_the_reverse_chains_likelihood_and_is_zero_for_the_perfect_denoiser():
    for seed, x0 in ((1, 0), (2, 2)):
        net = table_net(seed, 1)
        bound, nll = exact_bound(net, torch.tensor([x0])), reverse_nll(net, x0)
        print(f"\nseed {seed}: bound {bound:.6f} >= -log p_theta(x0) {nll:.6f}")
        assert bound >= nll - 1e-6 and bound - nll > 1e-3, (bound, nll)  # a bound, and not a tight one here
    perfect = lambda z: torch.nn.functional.one_hot(torch.tensor([1]), V).double()  # noqa: E731
    assert exact_bound(perfect, torch.tensor([1])) == pytest.approx(0.0, abs=1e-12)
    assert reverse_nll(perfect, 1) == pytest.approx(0.0, abs=1e-6)


def test_the_monte_carlo_estimate_is_unbiased():
    net = table_net(3, 2)
    x0 = torch.tensor([1, 0])
    exact = exact_bound(net, x0)
    g = torch.Generator().manual_seed(0)
    draws = torch.tensor([float(estimate(net, x0, V, SHARE, g)) for _ in range(10_000)])
    se = float(draws.std()) / math.sqrt(len(draws))
    print(f"\nexact {exact:.5f}, Monte Carlo {float(draws.mean()):.5f} +- {se:.5f} (10,000 draws)")
    assert abs(float(draws.mean()) - exact) <= 3 * se and se < 0.05 * exact
