"""Paired VRPO / DPO over ELBOs (LLaDA 1.5): a unit is a (chosen, rejected) pair of rows."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from dllm_align.objective.base import SATURATION, LossTerms
from dllm_align.objective.paired import PairedObjective


def vrpo_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    *,
    beta: float,
    normalizer: Optional[float] = None,
) -> LossTerms:
    """The paired VRPO / DPO-with-ELBO objective of LLaDA 1.5 (docs/design.md#vrpo).

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
    return LossTerms(per.sum() / m, metrics)


class Vrpo(PairedObjective):
    """VRPO over (chosen, rejected) pairs (the units, metrics and step line are every paired objective's)."""

    name = "vrpo"

    def pair_loss(self, policy_chosen, policy_rejected, ref_chosen, ref_rejected, step):
        return vrpo_loss(policy_chosen, policy_rejected, ref_chosen, ref_rejected, beta=self.t.beta,
                         normalizer=step.normalizer)
