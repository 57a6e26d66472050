"""The Monte Carlo ELBO (docs/design.md#the-masked-diffusion-elbo) against exact enumeration and hand-derived facts."""

from __future__ import annotations

import copy
import hashlib
import math
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from dllm_align.objective.elbo import DrawConfig, draw_masks, elbo_draws, exact_elbo, make_noisy_batch

SRC = str(Path(__file__).resolve().parents[1] / "src")


def _batch(mp, prompt: str, completion: str):
    tok = mp.tokenizer
    p = tok(prompt, add_special_tokens=False).input_ids
    c = tok(completion, add_special_tokens=False).input_ids
    ids = torch.tensor([p + c])
    cm = torch.zeros_like(ids, dtype=torch.bool)
    cm[0, len(p):] = True
    return p, c, ids, cm


# --------------------------------------------------------------------------- the draws themselves
def test_l_draws_are_uniform_in_l_and_subset():
    """l ~ U{1..L}; given l, every l-subset equally likely (chi-square bound on 20k draws)."""
    L, K = 4, 20000
    mask, w = draw_masks("ex-1", L, DrawConfig(n_mc=K, seed=3))
    l = mask.sum(1)
    assert set(np.unique(l)) == {1, 2, 3, 4}
    np.testing.assert_allclose(w, L / l)
    counts = Counter(l.tolist())
    # each l has prob 1/4: 5 sigma of a binomial(20000, 1/4) is ~306
    for v in range(1, 5):
        assert abs(counts[v] - K / 4) < 5 * math.sqrt(K * 0.25 * 0.75)
    # given l = 2, the 6 subsets are equally likely
    subs = Counter(tuple(np.nonzero(m)[0]) for m in mask[l == 2])
    n2 = sum(subs.values())
    assert len(subs) == 6
    for c in subs.values():
        assert abs(c - n2 / 6) < 5 * math.sqrt(n2 * (1 / 6) * (5 / 6))


def test_draws_are_pure_functions_and_prefix_stable():
    cfg8 = DrawConfig(n_mc=8, seed=1)
    cfg3 = DrawConfig(n_mc=3, seed=1)
    m8, w8 = draw_masks("abc", 17, cfg8)
    m8b, _ = draw_masks("abc", 17, cfg8)
    m3, w3 = draw_masks("abc", 17, cfg3)
    assert (m8 == m8b).all()
    assert (m8[:3] == m3).all() and (w8[:3] == w3).all()  # any K' <= K is a prefix
    assert not (draw_masks("abd", 17, cfg8)[0] == m8).all()  # another id, other masks
    assert not (draw_masks("abc", 17, DrawConfig(n_mc=8, seed=2))[0] == m8).all()


def test_stratified_l_is_evenly_spaced():
    L, K = 40, 8
    mask, w = draw_masks("x", L, DrawConfig(n_mc=K, seed=0, stratified=True))
    l = mask.sum(1)
    # one l in each of the K strata of width L/K
    for k in range(K):
        assert k * L / K < l[k] <= (k + 1) * L / K + 1


def _mask_digest(ids, L, cfg):
    h = hashlib.sha256()
    for i in ids:
        m, w = draw_masks(i, L, cfg)
        h.update(m.tobytes())
        h.update(w.tobytes())
    return h.hexdigest()


def test_masks_identical_in_another_process():
    ids = [f"row-{i}" for i in range(20)]
    cfg = DrawConfig(n_mc=8, seed=7, stratified=True)
    here = _mask_digest(ids, 33, cfg)
    code = (
        "from dllm_align.objective.elbo import DrawConfig\n"
        "import sys; sys.path.insert(0, %r)\n"
        "from test_elbo import _mask_digest\n"
        "print(_mask_digest([f'row-{i}' for i in range(20)], 33, DrawConfig(n_mc=8, seed=7, stratified=True)))"
    ) % str(Path(__file__).parent)
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env={"PYTHONPATH": SRC, "PATH": "/usr/bin"}, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == here


def test_golden_masks_survive_library_upgrades():
    """Masks must not change between versions (a reference cache would silently go stale).

    Regenerate only on purpose: print(_mask_digest(['a', 'b'], 10, DrawConfig(n_mc=4, seed=0))).
    """
    m, w = draw_masks("a", 10, DrawConfig(n_mc=4, seed=0))
    assert m.shape == (4, 10)
    assert _mask_digest(["a", "b"], 10, DrawConfig(n_mc=4, seed=0)) == GOLDEN_DIGEST


GOLDEN_DIGEST = "ff3b1c4c85aa5a13dfd4c22ffb3467c5253aaf71a659e8ada4c9f087eb58658c"


# --------------------------------------------------------------------------- against exact enumeration
@pytest.mark.parametrize("estimator,stratified", [("l", False), ("l", True), ("t", False)])
def test_monte_carlo_mean_matches_exact_elbo(tiny, estimator, stratified):
    p, c, ids, cm = _batch(tiny, "Q: 12", "3a9!x")
    L = len(c)
    assert L == 5
    exact = exact_elbo(tiny, p, c)
    K = 4000
    # many examples with the same tokens but different ids: independent draws
    cfg = DrawConfig(n_mc=K, seed=11, estimator=estimator, stratified=stratified)
    with torch.no_grad():
        vals = elbo_draws(tiny, ids, None, cm, ["same-row"], cfg, max_rows_per_forward=1000)[0].double()
    mean = float(vals.mean())
    se = float(vals.std()) / math.sqrt(K)
    if stratified:  # draws are not independent across k: bound by the iid SE (stratification only shrinks it)
        pass
    assert abs(mean - exact) < 4 * se, (mean, exact, se)
    # and the tolerance is meaningful: a wrong weight (no L/l) would be far off
    assert abs(exact) > 10 * se


def test_exact_elbo_by_brute_force_definition(tiny):
    """exact_elbo equals E_l[(L/l) E_M[sum]] computed literally with l uniform."""
    p, c, ids, cm = _batch(tiny, "hi", "abc")
    L = len(c)
    import itertools

    tot = 0.0
    with torch.no_grad():
        for l in range(1, L + 1):
            subsets = list(itertools.combinations(range(L), l))
            for M in subsets:
                x = ids.clone()
                for i in M:
                    x[0, len(p) + i] = tiny.mask_token_id
                lp = torch.log_softmax(tiny.logits(x).float(), -1)[0]
                s = sum(float(lp[len(p) + i, c[i]]) for i in M)
                tot += (1 / L) * (1 / len(subsets)) * (L / l) * s
    assert exact_elbo(tiny, p, c) == pytest.approx(tot, rel=1e-6)


# --------------------------------------------------------------------------- masked-only scoring
def test_masked_only_scoring_equals_full_logits_values_and_grads(tiny):
    mp = copy.deepcopy(tiny)
    mp.model.train()
    p, c, ids, cm = _batch(mp, "prompt: ", "a completion of some length")
    ids2 = torch.cat([ids, ids.flip(1)])  # a second row
    cm2 = torch.cat([cm, cm.flip(1)])
    cfg = DrawConfig(n_mc=4, seed=5)
    fast = elbo_draws(mp, ids2, None, cm2, ["r0", "r1"], cfg)
    g_fast = torch.autograd.grad(fast.sum(), list(mp.model.parameters()))

    # the straightforward way: full [rows, T, V] logits, log-softmax, gather
    nb = make_noisy_batch(ids2, None, cm2, ["r0", "r1"], cfg, mp.mask_token_id)
    logp = torch.log_softmax(mp.logits(nb.input_ids).float(), dim=-1)
    picked = logp[nb.rows, nb.cols, nb.targets]
    sums = torch.zeros(nb.B * nb.K).index_add(0, nb.rows, picked)
    slow = (sums.double() * nb.weight).float().view(nb.B, nb.K)
    g_slow = torch.autograd.grad(slow.sum(), list(mp.model.parameters()))

    # per-position log-probabilities within 1e-5; the weighted sums (~-150) to fp32 rounding
    h = mp.target_logprobs(nb.input_ids, None, nb.rows, nb.cols, nb.targets)
    torch.testing.assert_close(h, picked, atol=1e-5, rtol=0)
    torch.testing.assert_close(fast, slow, atol=1e-5, rtol=1e-6)
    for a, b in zip(g_fast, g_slow):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)


def test_chunked_forwards_equal_one_forward(tiny):
    p, c, ids, cm = _batch(tiny, "x", "the same values in any chunking")
    cfg = DrawConfig(n_mc=6, seed=2)
    with torch.no_grad():
        a = elbo_draws(tiny, ids, None, cm, ["q"], cfg)
        b = elbo_draws(tiny, ids, None, cm, ["q"], cfg, max_rows_per_forward=4)
    torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


# --------------------------------------------------------------------------- shared masks (CRN)
def _perturbed(mp, scale=0.005, seed=0):
    """A policy a little way from the reference (init std is 0.02), as after some training."""
    q = copy.deepcopy(mp)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for prm in q.model.parameters():
            prm.add_(torch.randn(prm.shape, generator=g) * scale)
    return q


def test_shared_masks_zero_margin_and_lower_variance(tiny):
    p, c, ids, cm = _batch(tiny, "Sort: 3 1 2", "1 2 3 and some more text here")
    with torch.no_grad():
        same_a = elbo_draws(tiny, ids, None, cm, ["e"], DrawConfig(n_mc=4, seed=0))
        same_b = elbo_draws(tiny, ids, None, cm, ["e"], DrawConfig(n_mc=4, seed=0))
    assert torch.equal(same_a, same_b)  # policy == reference: r_hat exactly 0
    assert float((same_a.mean() - same_b.mean()).abs()) == 0.0

    policy = _perturbed(tiny)
    shared, indep = [], []
    with torch.no_grad():
        for s in range(150):
            cfg = DrawConfig(n_mc=2, seed=s)
            pol = elbo_draws(policy, ids, None, cm, ["e"], cfg).mean()
            ref_same = elbo_draws(tiny, ids, None, cm, ["e"], cfg).mean()
            ref_other = elbo_draws(tiny, ids, None, cm, ["e"], DrawConfig(n_mc=2, seed=10_000 + s)).mean()
            shared.append(float(pol - ref_same))
            indep.append(float(pol - ref_other))
    v_shared, v_indep = np.var(shared), np.var(indep)
    assert v_shared < 0.5 * v_indep, (v_shared, v_indep)


def test_chunked_head_equals_plain_head_values_and_grads():
    from dllm_align.models.predictor import chunked_target_logprobs

    g = torch.Generator().manual_seed(0)
    h = torch.randn(37, 16, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(300, 16, generator=g, dtype=torch.float64, requires_grad=True)
    t = torch.randint(0, 300, (37,), generator=g)
    gout = torch.randn(37, generator=g, dtype=torch.float64)
    plain = torch.log_softmax(h @ w.t(), -1).gather(-1, t[:, None]).squeeze(-1)
    gh, gw = torch.autograd.grad((plain * gout).sum(), [h, w])
    for chunk in (1, 8, 64):
        fast = chunked_target_logprobs(h, w, t, chunk)
        fh, fw = torch.autograd.grad((fast.double() * gout).sum(), [h, w])
        torch.testing.assert_close(fast.double(), plain, atol=1e-5, rtol=0)
        torch.testing.assert_close(fh, gh, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(fw, gw, atol=1e-5, rtol=1e-5)
