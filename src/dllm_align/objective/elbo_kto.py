"""ELBO-KTO (paper eq. gb-kto-elbo): unpaired labelled rows, the loss over ELBO margins, its reference points.

The step's reference point b (``train.baseline``)
    ``global_mean`` (the paper): the mean margin over the whole global batch of
    the optimiser step, stop-gradient. With one micro-batch per process the
    margins of the gradient pass are gathered between its forward and its
    backward. With gradient accumulation every margin of the step is needed
    before the first backward, so a no-grad pass over this process's
    micro-batches computes them first (the masks are a pure function of the
    example id, and the dropout masks are replayed), then the gradient pass uses
    that b. ``none``: 0. ``kl``: KTO's z0 from the step's mismatched pairs
    (:func:`kl_reference_point`), one extra no-grad policy pass.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from dllm_align.core.errors import UserError
from dllm_align.data.examples import kl_examples, planned_batches, step_count
from dllm_align.data.imbalance import check_weight_ratio
from dllm_align.objective.base import SATURATION, LossTerms, Objective, StepInputs, margin_status


def baseline_of(margins: torch.Tensor, kind: str) -> torch.Tensor:
    """The reference point b_hat: the mean margin of the whole step batch (stop-gradient), or 0.

    ``margins``: every margin of the step (all processes, all micro-batches). The
    mean is taken in float64: a step's margins can be many and close together.
    """
    if kind == "global_mean":
        m = margins.detach()
        return m.double().mean().to(m.dtype)
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
    units = ElboKto(t).make_units(examples)
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


class ElboKto(Objective):
    """ELBO-KTO over unpaired rows, each labelled desirable or undesirable."""

    name = "elbo_kto"
    replays_dropout = True  # the global_mean baseline's no-grad pass and the gradient pass see the same masks
    summed = ("loss_sum", "n", "n_desirable", "n_undesirable", "reward_sum_desirable", "reward_sum_undesirable", "saturated")
    metric_names = ("loss", "reward_desirable", "reward_undesirable", "baseline", "saturation")
    step_legend = (
        "r+ / r- = mean reward margin (policy ELBO minus reference ELBO, nats) of the desirable / undesirable rows, "
        "b = the step's mean-margin baseline, sat = share of rows with a saturated sigmoid (no gradient)"
    )

    def make_units(self, examples: Sequence) -> list[tuple]:
        missing = [ex.id for ex in examples if ex.label is None]
        if missing:
            raise UserError(f"objective elbo_kto needs a label on every row; row '{missing[0]}' has none")
        return [(ex,) for ex in examples]

    def is_extra_row(self, example) -> bool:
        return example.label is None  # the kl baseline's mismatched pairs carry no label

    def check_units(self, units: Sequence[tuple], global_batch: int, main: bool) -> None:
        if self.uses_extra_rows and global_batch < 2:
            raise UserError("train.baseline kl needs a global batch of at least 2 rows (each prompt is paired with another row's completion)")
        if main:
            n_d = sum(1 for u in units if u[0].label)
            # Weights the recipe sets on purpose (the demo's lambda_U = 0.3) are reported, not warned about.
            w = self.weights
            check_weight_ratio(n_d, len(units) - n_d, w.desirable, w.undesirable, chosen=w.chosen)

    @property
    def uses_extra_rows(self) -> bool:
        return self.t.baseline == "kl"

    def extra_rows_settings(self) -> dict:
        # the mismatched pairs of the kl baseline; the other baselines score none
        return {"baseline": self.t.baseline} if self.uses_extra_rows else {}

    def extra_rows(self, batch_units: Sequence[tuple], max_length: int) -> list:
        return kl_examples([u[0] for u in batch_units], max_length) if self.uses_extra_rows else []

    def reference_extras(self, recipe, examples: Sequence) -> list:
        return planned_kl_examples(recipe, examples) if self.uses_extra_rows else []

    def extra_rows_missing(self, cache, example_id, recorded):
        return UserError(
            f"reference cache {cache} holds no reference ELBOs for the kl baseline's mismatched pairs "
            f"(e.g. '{example_id}'; the cache was made with train.baseline {recorded.get('baseline')!r})",
            hint="run `dllm-align precompute-ref` with this recipe: train.baseline kl and the same "
            "train.global_batch_size, train.seed, data.group_by_length and step count",
        )

    def begin_step(self, step: StepInputs) -> None:
        kind = self.t.baseline
        baseline = None  # global_mean with one micro-batch: from the gradient pass's own margins (loss)
        if kind == "none":
            baseline = torch.zeros((), device=step.device)
        elif kind == "kl":
            baseline = self._kl_baseline(step)
        elif len(step.batches) > 1:
            margins = []
            with torch.no_grad():  # every margin of the step before any backward
                for a, (b, rf) in enumerate(zip(step.batches, step.references)):
                    with step.same_dropout(a):
                        margins.append(step.policy_elbo(b).float() - rf)
            baseline = baseline_of(step.gather(torch.cat(margins)), kind)
        step.state["baseline"] = baseline

    @torch.no_grad()
    def _kl_baseline(self, step: StepInputs) -> torch.Tensor:
        """z0 of the step (:func:`kl_reference_point`): every process's pairs, every micro-batch."""
        total = torch.zeros(2, dtype=torch.float64, device=step.device)
        for b in step.extra_batches:
            r = step.policy_elbo(b).float() - step.reference_elbo(b)
            total[0] += r.double().sum()
            total[1] += r.numel()
        total = step.sum_over_processes(total)
        return kl_reference_point(total[0], total[1]).to(step.device)

    def loss(self, policy, reference, batch, step):
        if step.state["baseline"] is None:
            step.state["baseline"] = baseline_of(step.gather(policy.detach().float() - reference), self.t.baseline)
        return elbo_kto_loss(
            policy, reference, batch["labels"].to(policy.device), beta=self.t.beta,
            lambda_desirable=self.weights.desirable, lambda_undesirable=self.weights.undesirable,
            baseline=step.state["baseline"], normalizer=step.normalizer,
        )

    def reduce(self, sums, step):
        n = max(sums["n"], 1.0)
        return {
            "loss": sums["loss_sum"] / n,
            "reward_desirable": sums["reward_sum_desirable"] / sums["n_desirable"] if sums["n_desirable"] else None,
            "reward_undesirable": sums["reward_sum_undesirable"] / sums["n_undesirable"] if sums["n_undesirable"] else None,
            "baseline": float(step.state["baseline"]),
            "saturation": sums["saturated"] / n,
        }

    def status(self, m):
        return margin_status(m)

    def watched_margin(self, m):
        return m["reward_desirable"]
