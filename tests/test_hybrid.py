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


# --------------------------------------------------------------------------- the likelihood the commands select
# ``reference.likelihood: hybrid``: the closed form from log-probabilities (no [V + 1] distribution per position), the
# deterministic draws, the block streams layout, through ``objective.elbo.elbo_draws`` as every command calls it.


def test_the_closed_form_from_log_probabilities_equals_the_reference_integrand():
    """Every kind of noisy state (mask, kept, replaced by its own or another token), the mask id last or inside the
    vocabulary, t from 1e-4 to 0.999: the closed form equals the float64 reference to 1e-9 relative."""
    from dllm_align.objective.hybrid import bound_terms

    g = torch.Generator().manual_seed(5)
    for mask_id in (V, 1):
        real = [j for j in range(V + 1) if j != mask_id]
        index = {j: i for i, j in enumerate(real)} | {mask_id: V}  # model ids -> the reference's states
        n = 40
        logits = 3.0 * torch.randn(n, V + 1, generator=g, dtype=torch.float64)
        x0 = torch.tensor(real)[torch.randint(0, V, (n,), generator=g)]
        z = torch.randint(0, V + 1, (n,), generator=g)
        z[:8] = x0[:8]
        z[8:14] = mask_id
        for t in (1e-4, 0.05, 0.5, 0.999):
            mine = bound_terms(logits.float(), x0, z, torch.full((n,), t, dtype=torch.float64), mask_id=mask_id,
                               mask_share=SHARE)
            x_theta = torch.softmax(logits.float().double()[:, real], -1)
            ref = integrand(x_theta, torch.tensor([index[int(v)] for v in x0]), torch.tensor([index[int(v)] for v in z]),
                            T(t), SHARE)
            assert torch.allclose(mine, ref, rtol=1e-9, atol=1e-12), (mask_id, t, float((mine - ref).abs().max()))


class TableStreams:
    """A stand-in predictor on V real tokens and the mask (id V) whose whole completion is one block: at each
    completion position, the table net's logits for the draw's noisy completion (read from the scored stream of the
    streams row), through the same ``position_terms`` call the real predictor answers."""

    def __init__(self, net_logits, prompt: int, n: int):
        self.logits, self.prompt, self.n = net_logits, prompt, n
        self.mask_token_id, self.vocab_size, self.block_size, self.likelihood = V, V + 1, 64, "block"

    def position_terms(self, ids, attention_mask, rows, cols, term, extra=(), packed=None, streams=None):
        T_ = streams.blocks.shape[1]
        out = []
        for r, c in zip(rows.tolist(), cols.tolist()):
            start = (c // T_) * T_ + self.prompt
            z = ids[r, start:start + self.n].tolist()
            index = sum(int(s) * STATES ** i for i, s in enumerate(z))
            lg = torch.cat([self.logits[index, c % T_ - self.prompt], torch.zeros(1, dtype=torch.float64)])
            out.append(lg)
        return term(torch.stack(out).float(), *extra)


def table_logits(seed: int, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return 2.0 * torch.randn(STATES ** n, n, V, generator=g, dtype=torch.float64)


def test_the_selectable_estimate_is_unbiased_for_the_exact_bound():
    """10,000 draws of ``elbo_draws`` with ``likelihood='hybrid'`` (the draws of the commands: hashed, t = u^2) on
    the table net: the mean is minus the bound enumerated exactly, within 3 standard errors."""
    from dllm_align.objective.draws import DrawConfig
    from dllm_align.objective.elbo import elbo_draws

    class Shares:
        mask_share = SHARE

    n, prompt = 2, 1
    logits = table_logits(3, n)
    net = lambda z: torch.softmax(logits[sum(int(s) * STATES ** i for i, s in enumerate(z.tolist()))].float().double(), -1)  # noqa: E731
    x0 = torch.tensor([1, 0])
    exact = exact_bound(net, x0)
    ids = torch.tensor([[2, 1, 0]])
    cm = torch.tensor([[False, True, True]])
    cfg = DrawConfig(n_mc=10_000, seed=0, likelihood="hybrid", likelihood_settings=(("hybrid", Shares()),))
    draws = -elbo_draws(TableStreams(logits, prompt, n), ids, None, cm, ["row"], cfg, max_rows_per_forward=2048)[0].double()
    se = float(draws.std()) / math.sqrt(len(draws))
    print(f"\nexact {exact:.5f}, selectable path {float(draws.mean()):.5f} +- {se:.5f} (10,000 draws)")
    assert abs(float(draws.mean()) - exact) <= 3 * se and se < 0.05 * exact


def test_the_draws_are_pure_functions_of_seed_id_and_draw():
    """The same (seed, id, draw) give the same times, masks and replacement tokens whatever K or the draws asked
    for; the mask share and the time set the rates; replacement tokens are never the mask."""
    from dllm_align.objective.draws import DrawConfig
    from dllm_align.objective.hybrid import draw_hybrid

    cfg = DrawConfig(n_mc=4000, seed=3)
    d = draw_hybrid("x", 50, cfg, 100, 40, 0.3)
    part = draw_hybrid("x", 50, DrawConfig(n_mc=8, seed=3), 100, 40, 0.3, draws=[5, 7])
    for name in ("t", "weight", "masked", "replaced", "token"):
        assert np.array_equal(getattr(d, name)[[5, 7]], getattr(part, name)), name
    assert np.allclose(d.weight, 2 * np.sqrt(d.t))
    corrupted = d.masked | d.replaced
    assert abs(corrupted.mean() - d.t.mean()) < 0.01 and abs(d.masked.sum() / corrupted.sum() - 0.3) < 0.01
    assert not (d.token == 40).any() and d.token.min() >= 0 and d.token.max() == 99
    assert not np.array_equal(d.masked, draw_hybrid("y", 50, cfg, 100, 40, 0.3).masked)


def test_the_block_streams_path_equals_the_reference_implementation_on_the_tiny_llada21():
    """``elbo_draws`` with the hybrid likelihood on ``builtin:tiny-llada21`` (blocks of 8, two rows of 11 completion
    tokens over two blocks, the K draws in one streams row and split over calls) equals, draw by draw, the small
    reference implementation (``integrand`` over the real tokens and the mask, float64) on the logits of the
    published 2L form [x_t ; x_0]; its gradient reaches the weights."""
    from dllm_align.models.load import load_model
    from dllm_align.objective.block import hf_forward, streams_mask
    from dllm_align.objective.draws import DrawConfig
    from dllm_align.objective.elbo import elbo_draws
    from dllm_align.objective.hybrid import draw_hybrid

    mp = load_model("builtin:tiny-llada21")
    vocab, mid, P, L = mp.vocab_size, mp.mask_token_id, 5, 11
    ids = torch.randint(0, 200, (2, P + L), generator=torch.Generator().manual_seed(0))
    cm = torch.zeros_like(ids, dtype=torch.bool)
    cm[:, P:] = True
    cfg = DrawConfig(n_mc=3, seed=7, likelihood="hybrid")
    share = cfg.settings_of("hybrid").mask_share
    with torch.no_grad():
        terms = elbo_draws(mp, ids, None, cm, ["a", "b"], cfg).double()
        split = elbo_draws(mp, ids, None, cm, ["a", "b"], cfg, max_rows_per_forward=2).double()
    assert torch.allclose(terms, split, rtol=1e-6)
    fwd, n = hf_forward(mp.model), P + L
    real = [j for j in range(vocab) if j != mid]

    def state(v):  # model ids -> the reference's states (the mask last)
        return torch.where(v == mid, torch.full_like(v, vocab - 1), v - (v > mid).long())

    for b, eid in enumerate(["a", "b"]):
        d = draw_hybrid(eid, L, cfg, vocab, mid, share)
        for k in range(3):
            comp = ids[b, P:].clone()
            rep, msk = torch.from_numpy(d.replaced[k]), torch.from_numpy(d.masked[k])
            comp[rep] = torch.from_numpy(d.token[k])[rep]
            comp[msk] = mid
            xt = torch.cat([ids[b, :P], comp])
            with torch.no_grad():
                logits = fwd(torch.cat([xt, ids[b]])[None], torch.arange(n).repeat(2)[None],
                             streams_mask(n, mp.block_size, 1))[0, P:n].double()
            ref = -d.weight[k] * float(integrand(torch.softmax(logits[:, real], -1), state(ids[b, P:]), state(comp),
                                                 T(float(d.t[k])), share).sum())
            assert float(terms[b, k]) == pytest.approx(ref, rel=1e-6), (b, k)
    assert (terms < 0).all()
    mp.model.train()
    elbo_draws(mp, ids, None, cm, ["a", "b"], cfg).sum().backward()
    assert sum(float(p.grad.abs().sum()) for p in mp.model.parameters() if p.grad is not None) > 0
