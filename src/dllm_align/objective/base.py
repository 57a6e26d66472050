"""The objective as a component: what the training loop, the reference precompute, the memory model and
``doctor`` ask of an objective, and the lookup that finds one by its ``train.objective`` name.

An objective is one module: a subclass of :class:`Objective`, declared by one ``Component("objective", ...)``
line (the built-in ones in ``objective/components.py``), which also holds its own settings (``train.<name>``,
read as :attr:`Objective.settings`), the ``train`` keys it ignores and its checks against the recipe. It says
what a training unit is (one row, or a (chosen, rejected) pair) and how units are made from the tokenised examples,
whether it needs reference ELBOs and for which rows, how a step's reference
point is set, the loss of a micro-batch from the policy's and the reference's
ELBOs, which of its loss metrics add up over micro-batches and processes, how
they reduce to the step's metrics, and what the step line shows. Everything
else (data order, the Monte Carlo ELBO with masks shared with the reference,
gradient accumulation, clipping, checkpoints) is the one training loop's.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, ContextManager, Optional, Sequence

import torch

from dllm_align.config import components as registry
from dllm_align.core.errors import UserError

SATURATION = 6.0  # |beta * s * (r - b)| beyond this: sigmoid'(.) < 2.5e-3, the row gives ~no gradient


@dataclass
class LossTerms:
    loss: torch.Tensor  # scalar: this chunk's share of the step loss
    metrics: dict[str, float]


@dataclass(frozen=True)
class ClassWeights:
    """lambda_D and lambda_U, and whether the recipe chose them on purpose (set keys or ``data.weights_file``)."""

    desirable: float = 1.0
    undesirable: float = 1.0
    chosen: bool = False


@dataclass
class StepInputs:
    """What the loop hands an objective for one optimiser step on this process.

    ``batches`` are this process's micro-batches (on the device), ``references`` their
    reference ELBOs (None when the objective needs none), ``extra_batches`` the step's
    extra rows (:meth:`Objective.extra_rows`) as this process holds them. ``normalizer``
    makes the sum of every process's losses the mean over the global batch (DDP and
    FSDP average gradients over processes). The callables are the loop's: the policy's
    ELBO (differentiable when grad is on), the reference's, the values of every process
    gathered, a sum over processes, and the dropout seed of micro-batch ``a``.
    """

    batches: list[dict]
    references: list[Optional[torch.Tensor]]
    extra_batches: list[dict]
    normalizer: float
    device: torch.device
    policy_elbo: Callable[[dict], torch.Tensor]
    reference_elbo: Callable[[dict], torch.Tensor]
    gather: Callable[[torch.Tensor], torch.Tensor]
    sum_over_processes: Callable[[torch.Tensor], torch.Tensor]
    same_dropout: Callable[[int], ContextManager] = lambda a: contextlib.nullcontext()
    state: dict[str, Any] = field(default_factory=dict)  # the objective's own values for this step


class Objective:
    """Base of every objective; the defaults describe an objective of single rows with no reference."""

    name: ClassVar[str]
    unit_name: ClassVar[str] = "rows"  # what a unit is called in messages ("pairs")
    rows_per_unit: ClassVar[int] = 1
    needs_reference: ClassVar[bool] = True
    # The gradient pass of micro-batch a draws its dropout masks from a seed of (step, rank, a): an
    # objective whose reference point comes from a no-grad pass over the same micro-batches needs the
    # two passes to see the same masks.
    replays_dropout: ClassVar[bool] = False
    summed: ClassVar[tuple[str, ...]] = ("loss_sum", "n")  # loss metrics added over micro-batches and processes
    metric_names: ClassVar[tuple[str, ...]] = ("loss",)  # the step's metrics (metrics.jsonl columns), in order
    step_legend: ClassVar[Optional[str]] = None  # said once, when the step line uses abbreviations

    def __init__(self, train, weights: Optional[ClassWeights] = None):
        self.t = train
        self.weights = weights or ClassWeights(train.lambda_desirable, train.lambda_undesirable)

    @property
    def settings(self):
        """This objective's own settings (``train.<name>``: its declaration's settings model, defaults unless set)."""
        return self.t.own_settings(self.name)

    # ---------------------------------------------------------------- data
    def make_units(self, examples: Sequence) -> list[tuple]:
        """The units of the global batch, from the tokenised examples (UserError when none can be made)."""
        return [(ex,) for ex in examples]

    def is_extra_row(self, example) -> bool:
        """True for a row the reference scores but no unit holds (ELBO-KTO's mismatched pairs)."""
        return False

    def check_units(self, units: Sequence[tuple], global_batch: int, main: bool) -> None:
        """Refuse (or report on) units this objective cannot train with in global batches of ``global_batch``."""

    @property
    def uses_extra_rows(self) -> bool:
        """Whether a step scores extra rows besides its units (:meth:`extra_rows`)."""
        return False

    def extra_rows_settings(self) -> dict[str, Any]:
        """The ``train`` keys (and values) that make a reference cache hold this objective's extra rows: a cache
        shared by several runs (``ablate``) is made with them, so that it holds every run's rows; empty: none."""
        return {}

    def extra_rows(self, batch_units: Sequence[tuple], max_length: int) -> list:
        """The extra rows of one global batch, one per unit, in the batch's order (row i goes where unit i goes)."""
        return []

    def reference_extras(self, recipe, examples: Sequence) -> list:
        """Every extra row a run of ``recipe`` will score, for the reference precompute to cache."""
        return []

    def extra_rows_missing(self, cache, example_id: str, recorded: dict) -> UserError:
        """The error for a reference cache that lacks extra row ``example_id`` (``recorded``: the cache's fingerprint)."""
        return UserError(f"reference cache {cache} holds no reference ELBOs for the step's extra rows (e.g. '{example_id}')",
                         hint="run `dllm-align precompute-ref` with this recipe")

    # ---------------------------------------------------------------- one step
    def begin_step(self, step: StepInputs) -> None:
        """Set the step's own values in ``step.state`` before the gradient pass (a reference point)."""

    def loss(self, policy: torch.Tensor, reference: Optional[torch.Tensor], batch: dict, step: StepInputs) -> LossTerms:
        """The loss of one micro-batch (its share of the step's mean) from the policy's ELBOs [B] and the reference's."""
        raise NotImplementedError

    def reduce(self, sums: dict[str, float], step: StepInputs) -> dict[str, Optional[float]]:
        """The step's metrics (:attr:`metric_names`) from the :attr:`summed` totals over every process."""
        return {"loss": sums["loss_sum"] / max(sums["n"], 1.0)}

    def status(self, m: dict) -> list[str]:
        """The step line's parts for metrics ``m`` (the loop adds the learning rate and throughput)."""
        return [f"loss {m['loss']:.4f}"]

    def watched_margin(self, m: dict) -> Optional[float]:
        """The margin the margin watch follows (the desirable rows'), or None."""
        return None


def margin_status(m: dict) -> list[str]:
    """The step line of an objective over reward margins: loss, r+ / r-, the baseline b, the saturated share."""
    parts = [f"loss {m['loss']:.4f}"]
    if m.get("reward_desirable") is not None:
        parts.append(f"r+ {m['reward_desirable']:+.3f}")
    if m.get("reward_undesirable") is not None:
        parts.append(f"r- {m['reward_undesirable']:+.3f}")
    if m.get("baseline") is not None:
        parts.append(f"b {m['baseline']:+.3f}")
    if m.get("saturation") is not None:
        parts.append(f"sat {m['saturation']:.0%}")
    return parts


# --------------------------------------------------------------------------- registry
def objective_names() -> list[str]:
    return registry.names("objective")


def get_objective(name: str) -> type[Objective]:
    """The objective class declared as ``name`` (``dllm_align.objective.components``, or a plugin's declaration);
    a UserError naming ``train.objective`` otherwise."""
    return registry.load("objective", name, key="train.objective")


def objective_for(train, weights: Optional[ClassWeights] = None) -> Objective:
    """The objective of a ``train`` section; ``weights``: the class weights (default: the section's lambdas)."""
    return get_objective(train.objective)(train, weights)
