"""The one training step, for every objective: the run's data in global batches, the ELBOs of the policy and the
reference, forward/backward over this process's micro-batches, the global clip and the update.

An objective (:mod:`dllm_align.objective.base`) differs from another only in its units (a row, or a
(chosen, rejected) pair), its reference point and its loss; everything else - data order, the Monte Carlo
ELBO with masks shared with the reference, gradient accumulation, clipping - is this one step, run under
``accelerate`` (1 CPU process, DDP on 8 GPUs, or FSDP). :func:`dllm_align.training.train.setup_run` builds a
:class:`Run` from its named setup steps; :func:`dllm_align.training.train.train` drives it.

The optimiser step's batch
    A step consumes one *global batch* of ``G = batch_size x grad_accum x processes`` units, planned
    from (seed, epoch) alone (:func:`dllm_align.data.batching.plan_batches`), so the plan does not
    depend on how the work is split. Each process's loss is divided by G / processes, because DDP (and
    FSDP) average gradients over processes: the result is the gradient of the mean loss over the G units
    for any split of them over processes and micro-batches. An objective whose reference point needs
    every margin of the step (ELBO-KTO's mean-margin baseline) computes it in
    :meth:`~dllm_align.objective.base.Objective.begin_step`, before the first backward.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional

import torch

from dllm_align.config.schema import TrainSection
from dllm_align.core.errors import RunFailure, UserError
from dllm_align.data.batching import plan_batches, shard
from dllm_align.data.examples import load_training_examples, make_collate, step_count
from dllm_align.objective.base import StepInputs
from dllm_align.objective.elbo import elbo_draws
from dllm_align.training.checkpoint import RunRecord, Saver, TrainState
from dllm_align.training.distributed import seeded_rng
from dllm_align.training.optim import clip_global_grad_norm, lr_at
from dllm_align.training.plan import TrainPlan
from dllm_align.training.policy import Trainable

if TYPE_CHECKING:
    from accelerate import Accelerator

    from dllm_align.models.predictor import MaskPredictor
    from dllm_align.training.reference import TrainingReference


# --------------------------------------------------------------------------- the data
@dataclass
class TrainData:
    """The run's units and their order: global batches of every epoch, this process's share of each step."""

    examples: list
    units: list[tuple]
    lengths: list[int]  # tokens per unit (the plan groups by length)
    collate: Callable[[list], dict]
    steps_per_epoch: int
    total: int  # optimiser steps of the run
    dropped_per_epoch: int  # units that do not fill a global batch
    seed: int
    group_by_length: bool
    batch_size: int  # units per micro-batch
    max_length: int
    _plans: dict = field(default_factory=dict, repr=False)

    def global_batch(self, step: int, plan: TrainPlan) -> list[int]:
        """The units (indices) of global step ``step``."""
        epoch, j = divmod(step, self.steps_per_epoch)
        if epoch not in self._plans:  # one epoch's plan at a time
            self._plans = {epoch: plan_batches(self.lengths, plan.global_batch, self.seed, epoch, self.group_by_length,
                                               drop_last=True)}
        return self._plans[epoch][j]

    def micro_batches(self, step: int, plan: TrainPlan) -> list[list[tuple]]:
        """This process's micro-batches of global step ``step`` (lists of units)."""
        mine = shard(self.global_batch(step, plan), plan.rank, plan.world, self.batch_size)
        assert len(mine) == plan.accum, (len(mine), plan.accum)
        return [[self.units[i] for i in m] for m in mine]

    def extra_micro_batches(self, step: int, plan: TrainPlan) -> list[list]:
        """This process's extra rows of step ``step`` (the objective's, e.g. the kl baseline's pairs): row i goes
        where unit i goes."""
        batch = self.global_batch(step, plan)
        extra = plan.objective.extra_rows([self.units[i] for i in batch], self.max_length)
        return [[extra[p] for p in m] for m in shard(list(range(len(batch))), plan.rank, plan.world, self.batch_size)]


def load_data(recipe, plan: TrainPlan, tokenizer, examples: Optional[list] = None,
              block_size: Optional[int] = None, canvas_length: Optional[int] = None) -> TrainData:
    """The recipe's rows tokenised (or ``examples``), made into the objective's units and counted into steps.
    ``block_size`` / ``canvas_length``: the policy's (block-diffusion families / DiffusionGemma), for
    ``data.block_scoring``."""
    t = recipe.train
    if examples is None:
        examples = load_training_examples(recipe, tokenizer, quiet=not plan.main, block_size=block_size,
                                          canvas_length=canvas_length)
    objective = plan.objective
    units = objective.make_units(examples)
    G = plan.global_batch
    if len(units) < G:
        raise UserError(
            f"the training set has {len(units)} {objective.unit_name}, fewer than one global batch "
            f"(train.batch_size {t.batch_size} x grad_accum {plan.accum} x {plan.world} process(es) = {G})"
        )
    steps_per_epoch, total = step_count(t, len(units), G)
    objective.check_units(units, G, plan.main)
    return TrainData(
        examples=examples,
        units=units,
        lengths=[sum(ex.length for ex in u) for u in units],
        collate=make_collate(recipe, tokenizer),
        steps_per_epoch=steps_per_epoch,
        total=total,
        dropped_per_epoch=len(units) - steps_per_epoch * G,
        seed=t.seed,
        group_by_length=recipe.data.group_by_length,
        batch_size=t.batch_size,
        max_length=recipe.data.max_length,
    )


# --------------------------------------------------------------------------- the run
@dataclass
class Run:
    """A set-up run: its plan, data, policy, reference and state; the step methods the loop and the checks call."""

    accelerator: "Accelerator"
    train: TrainSection
    plan: TrainPlan
    data: TrainData
    mp: "MaskPredictor"  # the policy unwrapped (tokenizer, config, block size)
    policy: Trainable
    reference: Optional["TrainingReference"]  # None when the objective needs none
    record: RunRecord
    state: TrainState

    @property
    def saver(self) -> Saver:
        p = self.plan
        return Saver(self.accelerator, self.policy.module, self.mp.tokenizer, p.fsdp, p.rank, p.main)

    # ---------------------------------------------------------------- ELBO values
    def to_device(self, batch: dict) -> dict:
        out = dict(batch)
        for k in ("input_ids", "attention_mask", "completion_mask", "completion_len"):
            if out.get(k) is not None:
                out[k] = out[k].to(self.plan.device)
        return out

    def policy_elbo(self, batch: dict) -> torch.Tensor:
        """B_hat_policy [B] (mean of draws 0..K'-1, the reference's masks), differentiable when grad is on."""
        v = elbo_draws(
            self.policy.view,
            batch["input_ids"],
            batch["attention_mask"],
            batch["completion_mask"],
            batch["ids"],
            self.plan.draws,
            max_rows_per_forward=self.train.rows_per_forward,
            draws=self.plan.draw_ids,
            pack_length=self.plan.pack_length,
        )
        return v.mean(dim=1)

    @torch.no_grad()
    def reference_elbo(self, batch: dict) -> torch.Tensor:
        """B_hat_ref [B] with the same draws, from the cache or the resident reference."""
        return self.reference.elbo(batch, self.plan, self.train.rows_per_forward)

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        """Every process's values (float32, detached), concatenated."""
        local = local.detach().float()
        return self.accelerator.gather(local.contiguous()) if self.plan.world > 1 else local

    def sum_over_processes(self, t: torch.Tensor) -> torch.Tensor:
        return self.accelerator.reduce(t, reduction="sum") if self.plan.world > 1 else t

    # ---------------------------------------------------------------- one optimiser step
    def same_dropout(self, micro: int):
        """Seed the RNG per (step, rank, micro-batch) when LoRA dropout is on.

        An objective's no-grad pass over the step's micro-batches before the gradient pass (ELBO-KTO's
        baseline under gradient accumulation) and the gradient pass then draw the same dropout masks, so
        the baseline is the mean of exactly the margins the gradient pass differentiates. The global RNG
        is restored afterwards, so nothing else changes.
        """
        lora = self.train.lora
        if not (lora.enabled and lora.dropout > 0):
            return contextlib.nullcontext()
        return seeded_rng((self.train.seed, self.state.step, self.plan.rank, micro), self.plan.device)

    def sync(self, last: bool):
        """Gradient synchronisation of one micro-batch's backward.

        DDP skips the all-reduce of all but the step's last micro-batch (its gradients are whole on every
        rank either way). FSDP reduce-scatters every micro-batch: skipping it (``no_sync``, FSDP2's
        ``set_requires_gradient_sync(False)``) would keep each rank's whole *unsharded* fp32 gradient until
        the last micro-batch, ~30 GiB per rank for an 8B model on top of its shards; reduced each time, a
        rank holds only its shard. The cost is one reduce-scatter per micro-batch instead of per step.
        """
        if last or self.plan.world == 1 or self.plan.fsdp:
            return contextlib.nullcontext()
        return self.accelerator.no_sync(self.policy.module)

    def run_step(self, micro: list[list[tuple]], extra_micro: Optional[list[list]] = None) -> dict:
        """Forward/backward over this process's micro-batches; returns the objective's summed metrics (local).

        ``extra_micro``: this process's extra rows of the step (:meth:`TrainData.extra_micro_batches`).
        """
        obj = self.plan.objective
        batches = [self.to_device(self.collate_units(units)) for units in micro]
        step = StepInputs(
            batches=batches,
            references=[self.reference_elbo(b) if obj.needs_reference else None for b in batches],
            extra_batches=[self.to_device(self.data.collate(exs)) for exs in extra_micro or []],
            normalizer=self.plan.global_batch / self.plan.world,  # DDP averages over processes: the sum over all units / G
            device=self.plan.device,
            policy_elbo=self.policy_elbo,
            reference_elbo=self.reference_elbo,
            gather=self.gather,
            sum_over_processes=self.sum_over_processes,
            same_dropout=self.same_dropout,
        )
        obj.begin_step(step)
        sums = dict.fromkeys(obj.summed, 0)
        A = len(batches)
        for a, (b, rf) in enumerate(zip(batches, step.references)):
            with self.sync(a == A - 1), (self.same_dropout(a) if obj.replays_dropout else contextlib.nullcontext()):
                terms = obj.loss(self.policy_elbo(b), rf, b, step)
                self.accelerator.backward(terms.loss)
            for k in obj.summed:
                sums[k] += terms.metrics[k]
        sums["tokens"] = sum(ex.length for units in micro for u in units for ex in u)  # real tokens, padding excluded
        return {"sums": sums, "step": step}

    def collate_units(self, units: list[tuple]) -> dict:
        """One micro-batch's rows, unit by unit (vrpo: chosen, rejected, chosen, rejected, ...)."""
        return self.data.collate([ex for u in units for ex in u])

    def step_once(self, last_ckpt: Optional[Path] = None) -> tuple[float, dict, float]:
        """One optimiser step: forward/backward, global clip, the rank-agreed finite check, update.

        Returns (lr, reduced metrics, gradient norm before clipping).
        """
        t, plan, step = self.train, self.plan, self.state.step
        lr = lr_at(step, self.data.total, t.lr, t.warmup_ratio, t.scheduler)
        for g in self.policy.optimizer.param_groups:
            g["lr"] = lr
        extra = self.data.extra_micro_batches(step, plan) if plan.objective.uses_extra_rows else None
        m = self.reduce(self.run_step(self.data.micro_batches(step, plan), extra))
        clip = t.max_grad_norm if t.max_grad_norm is not None else float("inf")
        self.accelerator.unscale_gradients()  # fp16 loss scaling (a no-op otherwise)
        grad_norm = clip_global_grad_norm(self.policy.params, clip, sharded=plan.fsdp, device=plan.device)
        human_step = step + 1
        # Both numbers are the same on every rank (reduced / all-reduced): all stop together.
        if not math.isfinite(m["loss"]) or not math.isfinite(grad_norm):
            what = f"loss {m['loss']}" if not math.isfinite(m["loss"]) else f"gradient norm {grad_norm}"
            keep_msg = f"the last good checkpoint is {last_ckpt}" if last_ckpt else "no checkpoint was written yet"
            raise RunFailure(
                f"non-finite {what} at step {human_step}; stopped before applying it ({keep_msg})",
                hint="lower train.lr, check the data, or resume from the checkpoint with other settings",
            )
        self.policy.optimizer.step()
        self.policy.optimizer.zero_grad(set_to_none=True)
        self.state.step = human_step
        return lr, m, grad_norm

    def reduce(self, local: dict) -> dict:
        """The step's metrics: the objective's sums over every process, reduced by the objective."""
        objective = self.plan.objective
        keys = [*objective.summed, "tokens"]
        t = torch.tensor([float(local["sums"][k]) for k in keys], dtype=torch.float64, device=self.plan.device)
        if self.plan.world > 1:
            t = self.accelerator.reduce(t, reduction="sum")
        s = dict(zip(keys, t.tolist()))
        out = objective.reduce(s, local["step"])
        out["tokens"] = int(s["tokens"])
        return out


@torch.no_grad()
def invariant_margins(run: Run, steps: int = 1) -> dict[str, float]:
    """Per-row margins B_policy - B_ref of this process's rows in global steps 0..steps-1, before any update.

    With the policy's weights equal to the reference's, each is 0: exactly when
    the forward is fp32 and deterministic, within the bf16 tolerance under
    autocast (tests/test_invariants.py derives it). Both sides go through the
    training path (the wrapped policy module; the cache or the online reference).
    """
    return {rid: pol - ref for rid, (pol, ref, _) in invariant_values(run, steps).items()}


@torch.no_grad()
def invariant_values(run: Run, steps: int = 1) -> dict[str, tuple[float, float, int]]:
    """(B_policy, B_ref, completion tokens) per row of this process's rows in global steps 0..steps-1: what
    :func:`invariant_margins` subtracts, with what the step-0 check's tolerance reads (``training.doctor``)."""
    out: dict[str, tuple[float, float, int]] = {}
    for step in range(steps):
        for units in run.data.micro_batches(step, run.plan):
            b = run.to_device(run.collate_units(units))
            pol, ref = run.policy_elbo(b).float(), run.reference_elbo(b)
            n = b["completion_mask"].sum(dim=1).tolist()
            out.update(zip(b["ids"], zip(pol.tolist(), ref.tolist(), n)))
    return out
