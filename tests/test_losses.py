"""ELBO-KTO, VRPO and SFT losses against hand-derived numbers (docs/design.md#the-elbo-kto-loss, #vrpo, #sft)."""

from __future__ import annotations

import math

import pytest
import torch

from dllm_align.objective.elbo_kto import elbo_kto_loss
from dllm_align.objective.sft import sft_loss
from dllm_align.objective.vrpo import vrpo_loss


def _inputs():
    # margins r = policy - reference = [1.0, -0.5, 2.0, 0.0]
    policy = torch.tensor([1.5, 0.5, 2.5, -1.0], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([0.5, 1.0, 0.5, -1.0], dtype=torch.float64, requires_grad=True)
    desirable = torch.tensor([True, False, True, False])
    return policy, ref, desirable


def test_elbo_kto_hand_derived_global_mean():
    """beta 0.1, lambda_D 1, lambda_U 0.5, m = 4.

    b = mean(r) = 0.625; z = beta * s * (r - b) = [0.0375, 0.1125, 0.1375, 0.0625];
    1 - sigmoid(z) = [0.4906261, 0.4719046, 0.4656791, 0.4843801];
    loss = (0.4906261 + 0.5*0.4719046 + 0.4656791 + 0.5*0.4843801) / 4 = 0.3586119.
    """
    policy, ref, d = _inputs()
    out = elbo_kto_loss(policy, ref, d, beta=0.1, lambda_desirable=1.0, lambda_undesirable=0.5)
    assert float(out.loss) == pytest.approx(0.35861187743583334, abs=1e-12)
    assert out.metrics["baseline"] == pytest.approx(0.625)
    assert out.metrics["reward_sum_desirable"] == pytest.approx(3.0)
    assert out.metrics["reward_sum_undesirable"] == pytest.approx(-0.5)
    assert out.metrics["saturated"] == 0


def test_elbo_kto_hand_derived_no_baseline():
    """Same rows with b = 0: z = beta * s * r = [0.1, 0.05, 0.2, 0]; loss = 0.3547345."""
    policy, ref, d = _inputs()
    out = elbo_kto_loss(policy, ref, d, beta=0.1, lambda_undesirable=0.5, baseline_kind="none")
    assert float(out.loss) == pytest.approx(0.3547345292416192, abs=1e-12)
    assert out.metrics["baseline"] == 0.0


def test_gradient_formula_and_only_policy():
    """d loss / d r_i = -lambda_i s_i beta sigma'(beta s_i (r_i - b)) / m, with b stop-gradient.

    Hand values: [-0.0062478, 0.0031151, -0.0062206, 0.0031220].
    """
    policy, ref, d = _inputs()
    out = elbo_kto_loss(policy, ref, d, beta=0.1, lambda_undesirable=0.5)
    out.loss.backward()
    expected = [-0.006247803249256556, 0.003115133124210657, -0.006220551820641211, 0.0031219502279100737]
    assert policy.grad.tolist() == pytest.approx(expected, abs=1e-12)
    assert ref.grad is None  # the reference is detached: no gradient reaches it
    # and the general formula, for random inputs
    torch.manual_seed(0)
    pol = torch.randn(7, dtype=torch.float64, requires_grad=True)
    rf = torch.randn(7, dtype=torch.float64)
    lab = torch.tensor([1, 0, 1, 1, 0, 0, 1], dtype=torch.bool)
    beta, lD, lU = 0.3, 1.3, 0.7
    o = elbo_kto_loss(pol, rf, lab, beta=beta, lambda_desirable=lD, lambda_undesirable=lU)
    o.loss.backward()
    r = (pol - rf).detach()
    b = r.mean()
    s = lab.double() * 2 - 1
    lam = torch.where(lab, torch.tensor(lD, dtype=torch.float64), torch.tensor(lU, dtype=torch.float64))
    sg = torch.sigmoid(beta * s * (r - b))
    torch.testing.assert_close(pol.grad, -lam * s * beta * sg * (1 - sg) / 7)


def test_external_baseline_and_normalizer_split_equals_whole():
    """Splitting a step into chunks with the step's baseline and m gives the whole-batch loss and grads."""
    torch.manual_seed(1)
    pol = torch.randn(8, dtype=torch.float64, requires_grad=True)
    ref = torch.randn(8, dtype=torch.float64)
    lab = torch.tensor([1, 0] * 4, dtype=torch.bool)
    whole = elbo_kto_loss(pol, ref, lab, beta=0.2)
    g_whole = torch.autograd.grad(whole.loss, pol)[0]
    b = (pol - ref).detach().mean()
    parts = [elbo_kto_loss(pol[i:i + 2], ref[i:i + 2], lab[i:i + 2], beta=0.2, baseline=b, normalizer=8) for i in range(0, 8, 2)]
    total = sum(p.loss for p in parts)
    g_parts = torch.autograd.grad(total, pol)[0]
    assert float(total) == pytest.approx(float(whole.loss), abs=1e-12)
    torch.testing.assert_close(g_parts, g_whole)


def test_saturation_counted():
    pol = torch.tensor([100.0, -100.0, 0.0])
    ref = torch.zeros(3)
    out = elbo_kto_loss(pol, ref, torch.tensor([True, True, False]), beta=0.1, baseline_kind="none")
    assert out.metrics["saturated"] == 2


def test_vrpo_hand_derived():
    """beta 0.5: margins [(2-1)-(0.5-0.5), (0-1)-(0-0)] = [1, -1] -> logits [0.5, -0.5].

    loss = (log(1+e^-0.5) + log(1+e^0.5)) / 2 = (0.474077 + 0.974077) / 2 = 0.724077.
    """
    out = vrpo_loss(
        torch.tensor([2.0, 0.0]), torch.tensor([1.0, 1.0]), torch.tensor([0.5, 0.0]), torch.tensor([0.5, 0.0]), beta=0.5
    )
    expected = (math.log(1 + math.exp(-0.5)) + math.log(1 + math.exp(0.5))) / 2
    assert float(out.loss) == pytest.approx(expected, abs=1e-6)
    assert out.metrics["accuracy_sum"] == 1.0


def test_sft_is_negative_elbo_per_token():
    out = sft_loss(torch.tensor([-10.0, -6.0]), torch.tensor([5, 2]))
    assert float(out.loss) == pytest.approx((2.0 + 3.0) / 2)


def test_kl_reference_point_hand_derived():
    """KTO's z0 = max(0, mean margin of the mismatched pairs).

    Margins [1.0, -0.5, 0.25, 0.75]: mean 0.375. Margins [-1.0, 0.5]: mean -0.25, clamped to 0.
    Totals from two processes (1.0 - 0.5 | 0.25 + 0.75) give the one-process mean.
    """
    from dllm_align.objective.elbo_kto import baseline_of, kl_reference_point

    m = torch.tensor([1.0, -0.5, 0.25, 0.75])
    assert float(kl_reference_point(m.sum(), 4)) == 0.375
    assert float(kl_reference_point(torch.tensor(-0.5), 2)) == 0.0
    assert float(kl_reference_point(torch.tensor(0.5) + torch.tensor(1.0), 2 + 2)) == 0.375
    z = kl_reference_point(torch.tensor(1.5, requires_grad=True), 4)
    assert not z.requires_grad  # stop-gradient
    with pytest.raises(ValueError):
        kl_reference_point(torch.tensor(0.0), 0)
    with pytest.raises(ValueError, match="mismatched pairs"):
        baseline_of(m, "kl")
    # with z0 as the baseline the loss is the global-mean formula with b = z0
    policy, ref, d = _inputs()
    a = elbo_kto_loss(policy, ref, d, beta=0.1, baseline=kl_reference_point(m.sum(), 4))
    b = elbo_kto_loss(policy, ref, d, beta=0.1, baseline=torch.tensor(0.375, dtype=torch.float64))
    assert float(a.loss) == pytest.approx(float(b.loss), abs=1e-7)
