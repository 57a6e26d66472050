"""Losses as pure tensor functions (paper eq. gb-kto-elbo, SPEC.md sections 4 and 6).

They take ELBO values (or margins) already computed; the training loop decides
how values are gathered across processes and micro-batches.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

SATURATION = 6.0  # |beta * s * (r - b)| beyond this: sigmoid'(.) < 2.5e-3, the row gives ~no gradient


@dataclass
class KTOTerms:
    loss: torch.Tensor  # scalar: this chunk's share of the step loss
    metrics: dict[str, float]


def baseline_of(margins: torch.Tensor, kind: str) -> torch.Tensor:
    """The reference point b_hat: the mean margin of the whole step batch (stop-gradient), or 0."""
    if kind == "global_mean":
        return margins.detach().mean()
    if kind == "none":
        return margins.new_zeros(())
    if kind == "kl":
        raise ValueError("baseline 'kl' comes from the mismatched pairs: use kl_reference_point")
    raise ValueError(f"unknown baseline {kind!r}")


def kl_reference_point(margin_sum, count) -> torch.Tensor:
    """KTO's z0 (``train.baseline: kl``): max(0, mean margin of the step's mismatched pairs), stop-gradient.

    z0 = max(0, (1/n) sum_j [B_pol(y_j' | x_j) - B_ref(y_j' | x_j)]), where (x_j, y_j')
    pairs a prompt of the step batch with another row's completion
    (:func:`dllm_align.data.examples.kl_examples`). ``margin_sum`` and ``count`` are
    totals over every process and micro-batch of the step, so the mean is the
    whole step's, as with ``global_mean``. The clamp is KTO's (and TRL's):
    KL is never negative, so a negative estimate is noise.
    """
    s = torch.as_tensor(margin_sum, dtype=torch.float64).detach()
    n = float(count)
    if n <= 0:
        raise ValueError("the kl reference point needs at least one mismatched pair")
    return (s / n).clamp_min(0.0).float()


def elbo_kto_loss(
    policy_elbo: torch.Tensor,
    ref_elbo: torch.Tensor,
    desirable: torch.Tensor,
    *,
    beta: float,
    lambda_desirable: float = 1.0,
    lambda_undesirable: float = 1.0,
    baseline: Optional[torch.Tensor] = None,
    baseline_kind: str = "global_mean",
    normalizer: Optional[float] = None,
) -> KTOTerms:
    """ELBO-KTO (eq. gb-kto-elbo).

    r_i = B_pol(y_i|x_i) - B_ref(y_i|x_i);  s_i = +1 (desirable) / -1;
    loss = (1/m) sum_i lambda_i * (1 - sigmoid(beta * s_i * (r_i - b))).

    ``baseline``: the step's b_hat when this call sees only part of the step
    (a micro-batch, one process); if None it is computed from these rows with
    ``baseline_kind``. ``normalizer``: m, the size of the whole step batch
    (default: the rows here). Gradients flow only through ``policy_elbo``.
    """
    ref_elbo = ref_elbo.detach().to(policy_elbo.dtype)
    r = policy_elbo - ref_elbo
    if baseline is None:
        baseline = baseline_of(r, baseline_kind)
    b = baseline.detach().to(r.dtype)
    s = desirable.to(r.dtype) * 2 - 1
    lam = torch.where(desirable.bool(), r.new_tensor(lambda_desirable), r.new_tensor(lambda_undesirable))
    z = beta * s * (r - b)
    m = float(normalizer if normalizer is not None else r.numel())
    loss = (lam * (1 - torch.sigmoid(z))).sum() / m
    with torch.no_grad():
        d = desirable.bool()
        metrics = {
            "loss_sum": float((lam * (1 - torch.sigmoid(z))).sum()),
            "n": int(r.numel()),
            "n_desirable": int(d.sum()),
            "n_undesirable": int((~d).sum()),
            "reward_sum_desirable": float(r[d].sum()) if d.any() else 0.0,
            "reward_sum_undesirable": float(r[~d].sum()) if (~d).any() else 0.0,
            "baseline": float(b),
            "saturated": int((z.abs() > SATURATION).sum()),
        }
    return KTOTerms(loss, metrics)


def vrpo_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    *,
    beta: float,
    normalizer: Optional[float] = None,
) -> KTOTerms:
    """The paired VRPO / DPO-with-ELBO objective of LLaDA 1.5 (SPEC.md section 6).

    loss = -(1/m) sum_j log sigmoid(beta * [(B_pol(w) - B_pol(l)) - (B_ref(w) - B_ref(l))]).
    """
    logits = beta * ((policy_chosen - policy_rejected) - (ref_chosen - ref_rejected).detach())
    m = float(normalizer if normalizer is not None else logits.numel())
    per = -F.logsigmoid(logits)
    with torch.no_grad():
        metrics = {
            "loss_sum": float(per.sum()),
            "n": int(logits.numel()),
            "reward_sum_chosen": float((policy_chosen - ref_chosen).sum()),
            "reward_sum_rejected": float((policy_rejected - ref_rejected).sum()),
            "accuracy_sum": float((logits > 0).float().sum()),
            "saturated": int((logits.abs() > SATURATION).sum()),
        }
    return KTOTerms(per.sum() / m, metrics)


def sft_loss(policy_elbo: torch.Tensor, completion_len: torch.Tensor, *, normalizer: Optional[float] = None) -> KTOTerms:
    """Masked-diffusion SFT: the negative ELBO per completion token, averaged over rows.

    loss = -(1/m) sum_i B_hat(y_i | x_i) / L_i  (LLaDA's SFT normalises by answer length).
    """
    per = -policy_elbo / completion_len.to(policy_elbo.dtype).clamp_min(1)
    m = float(normalizer if normalizer is not None else per.numel())
    with torch.no_grad():
        metrics = {"loss_sum": float(per.sum()), "n": int(per.numel())}
    return KTOTerms(per.sum() / m, metrics)
