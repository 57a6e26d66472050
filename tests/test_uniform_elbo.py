"""The uniform-noise continuous-time ELBO (objective/uniform.py) against exact enumeration, the
discrete-time bound derived from Bayes' rule, an independent transcription of the UDLM formula,
and the leave-one-out facts of arXiv 2605.22765.

The toy model: V = 3 tokens, a completion of L = 3, and a fixed "network" that maps each of the
27 noisy canvases to a distribution per position (a seeded random table), so every expectation
over the noise is a finite sum.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

from dllm_align.objective.uniform import (
    UniformDrawConfig,
    denoiser_from_loo,
    draw_nelbo,
    draw_uniform_noise,
    flat_ce_terms,
    forward_marginal,
    gauss_legendre_unit,
    loo_from_denoiser,
    per_token_nelbo,
)

V, L = 3, 3
CANVASES = torch.tensor(list(itertools.product(range(V), repeat=L)))  # [27, L]
X0 = torch.tensor([2, 0, 1])


def _index(xt: torch.Tensor) -> torch.Tensor:
    """Row of CANVASES for each canvas in xt [..., L]."""
    return (xt * torch.tensor([V ** (L - 1 - l) for l in range(L)])).sum(-1)


def _toy_table(seed: int = 0, scale: float = 2.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.log_softmax(scale * torch.randn(len(CANVASES), L, V, generator=g, dtype=torch.float64), -1)


TABLE = _toy_table()


# --------------------------------------------------------------------------- independent references
def _direct_integrand(lp: torch.Tensor, x0: torch.Tensor, xt: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """The UDLM integrand transcribed term by term (explicit sum over j != x_t), float64."""
    out = torch.empty(len(x0), dtype=torch.float64)
    for n in range(len(x0)):
        Vn = lp.shape[-1]
        a = 1.0 - float(t[n])
        xbar = torch.full((Vn,), 1.0 - a, dtype=torch.float64)
        xbar[x0[n]] += Vn * a
        xbar_theta = Vn * a * lp[n].double().exp() + (1.0 - a)
        i = int(xt[n])
        s = 0.0
        for j in range(Vn):
            if j != i:
                s += float(xbar[j] / xbar[i]) * math.log(
                    float(xbar_theta[i] * xbar[j]) / float(xbar_theta[j] * xbar[i])
                )
        bracket = s - Vn / float(xbar[i]) + Vn / float(xbar_theta[i])
        out[n] = bracket / (Vn * a)  # -alpha'/(V alpha) with alpha = 1 - t
    return out


def _q_canvas(x0: torch.Tensor, t: float) -> torch.Tensor:
    """q(x_t | x_0) of each of the 27 canvases (product over positions)."""
    a = 1.0 - t
    per = torch.where(CANVASES == x0[None, :], a + (1 - a) / V, (1 - a) / V).double()
    return per.prod(-1)


def _expected_integrand(x0: torch.Tensor, t: float, table: torch.Tensor = TABLE) -> float:
    """E_{x_t ~ q_t}[sum over positions of the integrand], the noise enumerated exactly."""
    n = len(CANVASES)
    lp = table.reshape(n * L, V)
    xt = CANVASES.reshape(-1)
    x0s = x0.repeat(n)
    f = per_token_nelbo(lp, x0s, xt, torch.full((n * L,), t, dtype=torch.float64)).view(n, L).sum(-1)
    return float((_q_canvas(x0, t) * f).sum())


def _exact_nelbo(x0: torch.Tensor, n_nodes: int = 96, table: torch.Tensor = TABLE) -> float:
    """The t-integral by Gauss-Legendre after t = u**3 (the integrand grows like log(1/t) at 0)."""
    u, w = gauss_legendre_unit(n_nodes)
    return float(sum(wk * 3 * uk**2 * _expected_integrand(x0, uk**3, table) for uk, wk in zip(u, w)))


def _plugin_bridge(p_s_prior: torch.Tensor, xt_tok: torch.Tensor, a_t: float, a_s: float) -> torch.Tensor:
    """q(x_s | x_t, x_0) by Bayes' rule, with q(x_s | x_0) = ``p_s_prior`` [..., V] (a one-hot x_0
    gives the true posterior, x_theta in its place the plug-in reverse step)."""
    r = a_t / a_s
    trans = r * torch.nn.functional.one_hot(xt_tok, V).double() + (1 - r) / V  # q(x_t = i | x_s = v), over v
    joint = trans * p_s_prior
    return joint / joint.sum(-1, keepdim=True)


def _discrete_time(x0: torch.Tensor, T: int, table: torch.Tensor = TABLE) -> tuple[float, float]:
    """(ELBO_T, log p_T(x_0)) of the T-step chain on t_i = i / T whose reverse steps plug the toy
    network into the bridge; both exact (27 states)."""
    probs = table.exp()  # [27, L, V]
    elbo = 0.0
    vec = torch.full((len(CANVASES),), 1.0 / len(CANVASES), dtype=torch.float64)  # p(x_1): uniform
    onehot0 = torch.nn.functional.one_hot(x0, V).double()
    for i in range(T, 0, -1):
        a_t, a_s = 1.0 - i / T, 1.0 - (i - 1) / T
        a_t = max(a_t, 0.0)
        xt = CANVASES  # [27, L]
        prior_true = a_s * onehot0 + (1 - a_s) / V  # [L, V]
        prior_model = a_s * probs + (1 - a_s) / V  # [27, L, V]
        post = _plugin_bridge(prior_true[None].expand(len(CANVASES), L, V), xt, a_t, a_s)
        model = _plugin_bridge(prior_model, xt, a_t, a_s)
        kl = (torch.where(post > 0, post * (post.clamp_min(1e-300).log() - model.log()), 0.0)).sum(-1).sum(-1)
        elbo -= float((_q_canvas(x0, i / T) * kl).sum())
        # p(x_s | x_t) over whole canvases: the product over positions of the model's step
        trans = torch.ones(len(CANVASES), len(CANVASES), dtype=torch.float64)  # [x_t, x_s]
        for l in range(L):
            trans = trans * model[:, l, :][:, CANVASES[:, l]]
        vec = vec @ trans
    return elbo, float(vec[_index(x0)].log())


# --------------------------------------------------------------------------- (c) the closed form
@pytest.mark.parametrize("vocab", [2, 3, 17, 300])
def test_closed_form_matches_the_formula_term_by_term(vocab):
    g = torch.Generator().manual_seed(vocab)
    N = 60
    lp = torch.log_softmax(3 * torch.randn(N, vocab, generator=g, dtype=torch.float64), -1)
    x0 = torch.randint(0, vocab, (N,), generator=g)
    xt = torch.where(torch.rand(N, generator=g) < 0.5, x0, torch.randint(0, vocab, (N,), generator=g))
    t = torch.rand(N, generator=g, dtype=torch.float64) * 0.998 + 0.001
    ours = per_token_nelbo(lp, x0, xt, t)
    ref = _direct_integrand(lp, x0, xt, t)
    np.testing.assert_allclose(ours.numpy(), ref.numpy(), rtol=1e-9, atol=1e-12)
    assert (ours >= 0).all()


def test_integrand_is_zero_only_for_the_clean_token_and_finite_at_the_ends():
    x0 = torch.tensor([1, 1, 4, 4])
    xt = torch.tensor([1, 3, 4, 0])
    t = torch.tensor([1e-9, 1e-9, 1 - 1e-9, 1 - 1e-9], dtype=torch.float64)
    perfect = torch.log(torch.nn.functional.one_hot(x0, 6).double().clamp_min(1e-300))
    assert per_token_nelbo(perfect, x0, xt, torch.full((4,), 0.3, dtype=torch.float64)).abs().max() < 1e-9
    lp = torch.log_softmax(torch.randn(4, 6, dtype=torch.float64), -1)
    f = per_token_nelbo(lp, x0, xt, t)
    assert torch.isfinite(f).all() and (f > 0).all()
    # the duo-style expression in 1/xbar loses everything at t -> 1; ours approaches its limit smoothly
    f2 = per_token_nelbo(lp, x0, xt, torch.tensor([1e-9, 1e-9, 1 - 1e-7, 1 - 1e-7], dtype=torch.float64))
    assert abs(float(f[2] - f2[2])) < 1e-5 and abs(float(f[3] - f2[3])) < 1e-5


def test_flat_ce_is_the_plain_cross_entropy():
    lp = torch.log_softmax(torch.randn(5, 7, dtype=torch.float64), -1)
    x0 = torch.tensor([0, 6, 3, 3, 1])
    np.testing.assert_allclose(flat_ce_terms(lp, x0).numpy(), -lp[torch.arange(5), x0].numpy())


# --------------------------------------------------------------------------- (a) exact enumeration
def test_quadrature_over_t_has_converged():
    a, b = _exact_nelbo(X0, 64), _exact_nelbo(X0, 128)
    assert abs(a - b) < 1e-7 * abs(b)


def test_continuous_time_bound_is_the_limit_of_the_discrete_time_elbo():
    """The closed form, integrated exactly, equals the T -> infinity limit of the discrete-time
    ELBO built from Bayes' rule (Richardson extrapolation of T = 256, 512), and every
    discrete-time ELBO is below the exact log-likelihood of its chain."""
    exact = -_exact_nelbo(X0)
    e256, lp256 = _discrete_time(X0, 256)
    e512, lp512 = _discrete_time(X0, 512)
    assert e256 <= lp256 and e512 <= lp512
    extrapolated = 2 * e512 - e256
    assert abs(extrapolated - exact) < 2e-4 * abs(exact), (e256, e512, extrapolated, exact)
    assert abs(e512 - exact) < abs(e256 - exact)  # converging, not just close by chance


# --------------------------------------------------------------------------- (b) Monte Carlo
def _mc_values(example_id: str, cfg: UniformDrawConfig, x0: torch.Tensor = X0) -> np.ndarray:
    d = draw_uniform_noise(example_id, L, cfg, V)
    xt = d.noisy(x0)  # [K, L]
    lp = TABLE[_index(xt)]  # [K, L, V]
    K = cfg.n_mc
    f = draw_nelbo(
        lp.reshape(K * L, V), x0.repeat(K), xt.reshape(-1), torch.from_numpy(d.t).reshape(-1)
    ).view(K, L)
    return (f * torch.from_numpy(d.weight)).sum(-1).numpy()


@pytest.mark.parametrize("power,stratified", [(2, False), (3, False), (2, True)])
def test_monte_carlo_estimate_is_unbiased(power, stratified):
    exact = _exact_nelbo(X0)
    vals = _mc_values("ex-unbiased", UniformDrawConfig(n_mc=40000, seed=7, time_power=power, stratified=stratified))
    se = vals.std(ddof=1) / math.sqrt(len(vals))
    assert abs(vals.mean() - exact) < 4 * se, (vals.mean(), exact, se)
    assert se < 0.02 * exact  # the estimate is informative, not just wide


def test_parameterization_loo_plugs_in_the_converted_distribution():
    """``loo`` plugs in the leave-one-out posterior of the network's distribution: for a network
    that is the exact denoiser of TABLE's leave-one-out law, it gives TABLE's own bound."""
    n = len(CANVASES)
    for t in (0.01, 0.3, 0.9):
        tt = torch.full((n * L,), t, dtype=torch.float64)
        xt, x0 = CANVASES.reshape(-1), X0.repeat(n)
        net = denoiser_from_loo(TABLE.reshape(n * L, V), xt, tt)
        np.testing.assert_allclose(
            draw_nelbo(net, x0, xt, tt, "loo").numpy(),
            draw_nelbo(TABLE.reshape(n * L, V), x0, xt, tt, "denoiser").numpy(),
            rtol=1e-9,
        )
    with pytest.raises(ValueError):
        draw_nelbo(TABLE[0], X0, X0, torch.full((L,), 0.5, dtype=torch.float64), "posterior")


def test_loo_bound_of_a_network_that_is_not_a_denoiser_diverges_at_small_t():
    """The caveat of ``loo``: converting divides the observed token's probability by about V/t,
    so unless the network's probability of the observed token tends to 1 as t -> 0 (as the Bayes
    denoiser's does), the expected integrand grows like 1/t and the bound is infinite. The raw
    (``denoiser``) plug-in of the same network stays integrable (log(1/t) at worst)."""
    n = len(CANVASES)

    def t_times_expected(t: float, param: str) -> float:
        tt = torch.full((n * L,), t, dtype=torch.float64)
        f = draw_nelbo(TABLE.reshape(n * L, V), X0.repeat(n), CANVASES.reshape(-1), tt, param).view(n, L).sum(-1)
        return t * float((_q_canvas(X0, t) * f).sum())

    loo = [t_times_expected(t, "loo") for t in (1e-4, 1e-5, 1e-6)]
    raw = [t_times_expected(t, "denoiser") for t in (1e-4, 1e-5, 1e-6)]
    assert min(loo) > 0.1 and max(loo) / min(loo) < 1.01  # t * E[f] -> a positive constant
    assert raw[2] < raw[1] < raw[0] < 1e-2  # t * E[f] -> 0


# --------------------------------------------------------------------------- the draws
def test_draws_are_pure_functions_and_prefix_stable():
    cfg = UniformDrawConfig(n_mc=6, seed=3)
    a = draw_uniform_noise("row-9", 40, cfg, 1000, canvas_length=16)
    b = draw_uniform_noise("row-9", 40, cfg, 1000, canvas_length=16)
    for f in ("t", "weight", "replaced", "token"):
        np.testing.assert_array_equal(getattr(a, f), getattr(b, f))
    short = draw_uniform_noise("row-9", 40, UniformDrawConfig(n_mc=3, seed=3), 1000, canvas_length=16)
    np.testing.assert_array_equal(short.t, a.t[:3])
    np.testing.assert_array_equal(short.token, a.token[:3])
    other = draw_uniform_noise("row-10", 40, cfg, 1000, canvas_length=16)
    assert not np.array_equal(other.t, a.t)
    other_seed = draw_uniform_noise("row-9", 40, UniformDrawConfig(n_mc=6, seed=4), 1000, canvas_length=16)
    assert not np.array_equal(other_seed.token, a.token)
    # one time per canvas: positions 0-15, 16-31, 32-39
    for k in range(6):
        assert len(set(a.t[k, :16])) == 1 and len(set(a.t[k, 16:32])) == 1 and len(set(a.t[k, 32:])) == 1
        assert len({a.t[k, 0], a.t[k, 16], a.t[k, 32]}) == 3
    assert ((a.t > 0) & (a.t < 1)).all()
    np.testing.assert_allclose(a.weight, 2 * np.sqrt(a.t))


def test_noise_follows_the_forward_process():
    """Per position: replaced with probability t, and the replacement uniform over V."""
    K, Ln, Vn = 4000, 50, 7
    d = draw_uniform_noise("stats", Ln, UniformDrawConfig(n_mc=K, seed=1, time_power=1), Vn)
    t = d.t[:, 0]
    frac = d.replaced.mean(1)
    # replaced-fraction against t: the residual has variance t(1-t)/Ln per draw
    z = (frac - t) / np.sqrt(t * (1 - t) / Ln + 1e-12)
    assert abs(z.mean()) < 4 / math.sqrt(K) * 1.5 and 0.8 < z.std() < 1.2
    tokens = d.token[d.replaced]
    counts = np.bincount(tokens, minlength=Vn)
    expected = len(tokens) / Vn
    chi2 = ((counts - expected) ** 2 / expected).sum()
    assert chi2 < 22.5  # chi-square, 6 dof, p ~ 0.001
    # x_t's marginal matches q(x_t | x_0)
    x0 = torch.full((Ln,), 3)
    xt = d.noisy(x0)
    same = (xt == 3).double().mean(1).numpy()
    q_same = forward_marginal(torch.tensor([3]), torch.tensor([0.0]), Vn)  # t = 0: all signal
    assert float(q_same[0, 3]) == 1.0
    np.testing.assert_allclose(same.mean(), np.mean(1 - t + t / Vn), atol=0.01)


def test_stratified_times_cover_the_unit_interval():
    d = draw_uniform_noise("strat", 5, UniformDrawConfig(n_mc=10, seed=0, stratified=True, time_power=1), 11)
    u = np.sort(d.t[:, 0])
    assert np.all((u >= np.arange(10) / 10) & (u < np.arange(1, 11) / 10))


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError):
        draw_uniform_noise("empty", 0, UniformDrawConfig(), 10)
    with pytest.raises(ValueError):
        UniformDrawConfig(n_mc=0)
    with pytest.raises(ValueError):
        UniformDrawConfig(time_power=0)


# --------------------------------------------------------------------------- leave-one-out (2605.22765)
def test_loo_conversion_round_trips():
    lp = torch.log_softmax(torch.randn(8, 5, dtype=torch.float64), -1)
    xt = torch.tensor([0, 1, 2, 3, 4, 0, 1, 2])
    t = torch.linspace(0.05, 0.95, 8, dtype=torch.float64)
    back = denoiser_from_loo(loo_from_denoiser(lp, xt, t), xt, t)
    np.testing.assert_allclose(back.numpy(), lp.numpy(), atol=1e-12)


def test_the_bound_is_minimised_by_the_leave_one_out_posterior_not_the_denoiser():
    """Two positions, V = 3, a correlated data law p(x_0), one t. The expected integrand at
    position 0, as a function of x_theta(x_t), is stationary at p(x_0^0 | x_t^1) (the
    leave-one-out posterior), the denoiser p(x_0^0 | x_t) does worse, and the exact conversion
    of the denoiser is the leave-one-out posterior."""
    g = torch.Generator().manual_seed(5)
    pdata = torch.rand(V, V, generator=g, dtype=torch.float64) ** 3
    pdata /= pdata.sum()  # p(x_0^0, x_0^1)
    t = 0.4
    a = 1 - t
    qt = a * torch.eye(V, dtype=torch.float64) + (1 - a) / V  # qt[x0, xt]
    # joint over (x0a, x0b, xta, xtb)
    joint = pdata[:, :, None, None] * qt[:, None, :, None] * qt[None, :, None, :]
    denoiser = joint.sum(1) / joint.sum(1).sum(0, keepdim=True)  # p(x0a | xta, xtb): [x0a, xta, xtb]
    m = pdata @ qt  # p(x0a, xtb) summed: [x0a, xtb]
    loo = m / m.sum(0, keepdim=True)  # p(x0a | xtb)

    def objective(logits: torch.Tensor) -> torch.Tensor:  # logits [xta, xtb, V]
        total = 0.0
        for x0a, xta, xtb in itertools.product(range(V), repeat=3):
            w = joint[x0a, :, xta, xtb].sum()
            f = per_token_nelbo(
                torch.log_softmax(logits[xta, xtb], -1)[None], torch.tensor([x0a]), torch.tensor([xta]),
                torch.tensor([t], dtype=torch.float64),
            )
            total = total + w * f[0]
        return total

    # the leave-one-out posterior depends on xtb only: the same row for every xta
    loo_logits = torch.stack([loo.T.log()] * V, 0).clone().requires_grad_(True)  # [xta, xtb, V]
    val = objective(loo_logits)
    (grad,) = torch.autograd.grad(val, loo_logits)
    assert grad.abs().max() < 1e-10
    den_logits = denoiser.permute(1, 2, 0).log()  # [xta, xtb, V]
    assert float(objective(den_logits)) > float(val.detach()) + 1e-6
    # the exact conversion maps the denoiser to the leave-one-out posterior
    xta = torch.arange(V).repeat_interleave(V)
    conv = loo_from_denoiser(den_logits.reshape(V * V, V), xta, torch.full((V * V,), t, dtype=torch.float64))
    np.testing.assert_allclose(conv.exp().numpy(), torch.stack([loo.T] * V, 0).reshape(V * V, V).numpy(), atol=1e-12)


def test_bound_in_recomputed_chunks_keeps_only_the_logits_and_changes_nothing(monkeypatch):
    """The likelihood's per-position terms in chunks recomputed in the backward pass: the same values and gradients
    as one plain call, and what autograd keeps is the fp32 logits (4 bytes an entry), not the bound's float64
    tensors (24 bytes an entry kept by the plain call)."""
    import dllm_align.objective.uniform as u

    N, V = 96, 512
    g = torch.Generator().manual_seed(0)
    base = torch.randn(N, V, generator=g)
    x0, xt = torch.randint(0, V, (N,), generator=g), torch.randint(0, V, (N,), generator=g)
    t = torch.rand(N, generator=g) * 0.98 + 0.01

    def run(fn):
        logits = base.clone().requires_grad_(True)
        kept = {}

        def pack(x):
            if x.numel() >= N * V // 8:
                kept[(x.data_ptr(), x.dtype, x.numel())] = x.numel() * x.element_size()
            return x

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
            v = fn(logits)
        v.sum().backward()
        return v.detach(), logits.grad, sum(kept.values()) / (N * V)

    plain = run(lambda lg: u.draw_nelbo(torch.log_softmax(lg.double(), -1), x0, xt, t, "denoiser"))
    monkeypatch.setattr(u, "BOUND_CHUNK", 40 * V)  # three chunks
    chunked = run(lambda lg: u._bound_terms(lg, x0, xt, t, "denoiser", "elbo"))
    assert torch.equal(plain[0], chunked[0]) and torch.equal(plain[1], chunked[1])
    assert plain[2] >= 24 and chunked[2] <= 4
