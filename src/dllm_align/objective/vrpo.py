"""Paired VRPO / DPO over ELBOs (LLaDA 1.5): a unit is a (chosen, rejected) pair of rows."""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from dllm_align.core.console import warn
from dllm_align.core.errors import UserError
from dllm_align.objective.base import SATURATION, LossTerms, Objective, margin_status, register_objective


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


@register_objective
class Vrpo(Objective):
    """VRPO over (chosen, rejected) pairs; a micro-batch's rows alternate chosen, rejected."""

    name = "vrpo"
    unit_name = "pairs"
    rows_per_unit = 2
    summed = ("loss_sum", "n", "reward_sum_chosen", "reward_sum_rejected", "accuracy_sum", "saturated")
    metric_names = ("loss", "reward_desirable", "reward_undesirable", "baseline", "saturation", "reward_accuracy")
    step_legend = (
        "r+ / r- = mean reward margin (policy ELBO minus reference ELBO, nats) of the chosen / rejected rows, "
        "sat = share of pairs with a saturated sigmoid (no gradient)"
    )

    def make_units(self, examples: Sequence) -> list[tuple]:
        by_pair: dict[str, list] = {}
        for ex in examples:
            if ex.pair_id is None:
                raise UserError(
                    f"objective vrpo needs paired data; row '{ex.id}' has no pair id",
                    hint="use a paired source (prompt, chosen, rejected) with data.format: paired",
                )
            by_pair.setdefault(ex.pair_id, []).append(ex)
        units, broken = [], []
        for pid, rows in by_pair.items():
            chosen = [r for r in rows if r.label]
            rejected = [r for r in rows if r.label is False]
            if len(chosen) == 1 and len(rejected) == 1 and len(rows) == 2:
                units.append((chosen[0], rejected[0]))
            else:
                broken.append(pid)
        if broken:
            warn(f"vrpo: {len(broken)} pair id(s) without exactly one chosen and one rejected row are skipped (e.g. '{broken[0]}')")
        if not units:
            raise UserError("objective vrpo: no complete (chosen, rejected) pairs in the training data")
        return units

    def loss(self, policy, reference, batch, step):
        return vrpo_loss(policy[0::2], policy[1::2], reference[0::2], reference[1::2], beta=self.t.beta,
                         normalizer=step.normalizer)

    def reduce(self, sums, step):
        n = max(sums["n"], 1.0)
        # The metrics file keeps one set of columns for the objectives over margins: chosen rows are
        # reported as the desirable ones, rejected as the undesirable; VRPO has no baseline.
        return {
            "loss": sums["loss_sum"] / n,
            "reward_desirable": sums["reward_sum_chosen"] / sums["n"] if sums["n"] else None,
            "reward_undesirable": sums["reward_sum_rejected"] / sums["n"] if sums["n"] else None,
            "baseline": None,
            "saturation": sums["saturated"] / n,
            "reward_accuracy": sums["accuracy_sum"] / n,
        }

    def status(self, m):
        return margin_status(m)
