"""Objectives over (chosen, rejected) pairs of rows: what every pairwise objective shares (the units, the step's
metrics, the step line), so that one (VRPO; IPO, say) is only its loss of a pair's four ELBOs."""

from __future__ import annotations

from typing import Sequence

from dllm_align.core.console import warn
from dllm_align.core.errors import UserError
from dllm_align.objective.base import LossTerms, Objective, margin_status

class PairedObjective(Objective):
    """Base of the objectives over (chosen, rejected) pairs; a micro-batch's rows alternate chosen, rejected.
    A subclass gives its ``name`` and :meth:`pair_loss`; the loss metrics it returns are :attr:`summed`'s."""

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
                    f"objective {self.name} needs paired data; row '{ex.id}' has no pair id",
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
            warn(f"{self.name}: {len(broken)} pair id(s) without exactly one chosen and one rejected row are skipped (e.g. '{broken[0]}')")
        if not units:
            raise UserError(f"objective {self.name}: no complete (chosen, rejected) pairs in the training data")
        return units

    def loss(self, policy, reference, batch, step):
        return self.pair_loss(policy[0::2], policy[1::2], reference[0::2], reference[1::2], step)

    def pair_loss(self, policy_chosen, policy_rejected, ref_chosen, ref_rejected, step) -> LossTerms:
        """The loss of the micro-batch's pairs from their policy and reference ELBOs (each [pairs])."""
        raise NotImplementedError

    def reduce(self, sums, step):
        n = max(sums["n"], 1.0)
        # The metrics file keeps one set of columns for the objectives over margins: chosen rows are
        # reported as the desirable ones, rejected as the undesirable; a paired objective has no baseline.
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
