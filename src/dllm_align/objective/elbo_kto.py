"""ELBO-KTO (paper eq. gb-kto-elbo): the loss over ELBO margins, its baselines and KTO's z0."""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from dllm_align.core.errors import UserError
from dllm_align.data.examples import kl_examples, make_units, planned_batches, step_count
from dllm_align.objective.base import SATURATION, LossTerms


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
) -> LossTerms:
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
    return LossTerms(loss, metrics)


def planned_kl_examples(recipe, examples: Sequence) -> list:
    """Every mismatched pair a ``train.baseline: kl`` run of this recipe will score (for ``precompute-ref``), deduplicated.

    Needs ``train.global_batch_size``: the pairs come from the global batches,
    which must not depend on how many processes train.
    """
    t = recipe.train
    if t.global_batch_size is None:
        raise UserError(
            "train.baseline kl with a cached reference needs train.global_batch_size: its mismatched pairs come from the "
            "global batches, which precompute-ref must know before training",
            hint="set train.global_batch_size (paper: 8), or use reference.mode: online",
        )
    units = make_units(examples, t.objective, t.sft_rows)
    G = t.global_batch_size
    per_epoch, total = step_count(t, len(units), G)
    if per_epoch < 1:
        return []
    lengths = [sum(ex.length for ex in u) for u in units]
    seen: dict[str, object] = {}
    for batch in planned_batches(recipe, lengths, G, total):
        for ex in kl_examples([units[i][0] for i in batch], recipe.data.max_length):
            seen.setdefault(ex.id, ex)
    return list(seen.values())
