"""The run's plan: what a training run derives from its recipe and its launch, computed once before anything
loads (the objective and its class weights, the precision, the packed-row length, the draws, the process layout
and the global batch), as one frozen record the setup steps and the step take.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from dllm_align.config import components as registry
from dllm_align.config.schema import TrainSection, component_problems
from dllm_align.core.console import info
from dllm_align.core.errors import UserError
from dllm_align.data.batching import pack_length_of
from dllm_align.data.imbalance import read_weights_file
from dllm_align.models.precision import Precision, precision_for
from dllm_align.objective.base import ClassWeights, Objective, objective_for
from dllm_align.objective.elbo import DrawConfig
from dllm_align.training.distributed import fsdp_launch_of, is_fsdp


@dataclass(frozen=True)
class TrainPlan:
    """The derived values of one run on one process."""

    objective: Objective
    precision: Precision  # one precision for the policy and the reference (models.precision)
    pack_length: Optional[int]  # pack each forward's noisy rows into rows of this length (data.padding: packed)
    draws: DrawConfig  # the reference's draw set; the policy uses draws 0..k-1 of it
    k: int
    device: torch.device
    world: int  # processes
    rank: int
    main: bool
    fsdp: bool
    accum: int  # micro-batches per process and step
    global_batch: int  # units per optimiser step: train.batch_size x accum x world

    @property
    def draw_ids(self) -> list[int]:
        return list(range(self.k))


def make_plan(recipe, accelerator) -> TrainPlan:
    """The plan of ``recipe`` on this process of ``accelerator`` (refuses what this device cannot train first)."""
    t = recipe.train
    check_trainable_on(recipe, accelerator.device)
    check_fsdp(recipe, is_fsdp(accelerator), *fsdp_launch_of(accelerator))
    world = accelerator.num_processes
    ld, lu = class_weights(recipe)
    # Weights the recipe sets on purpose (the demo's lambda_U = 0.3) are reported, not warned about.
    chosen = bool({"lambda_desirable", "lambda_undesirable"} & t.model_fields_set) or bool(recipe.data.weights_file)
    accum = grad_accum_for(t, world)
    return TrainPlan(
        objective=objective_for(t, ClassWeights(ld, lu, chosen)),
        precision=precision_for(recipe, accelerator.device),
        pack_length=pack_length_of(recipe.data),
        draws=DrawConfig.from_reference(recipe.reference),
        k=recipe.train_n_mc(),
        device=accelerator.device,
        world=world,
        rank=accelerator.process_index,
        main=accelerator.is_main_process,
        fsdp=is_fsdp(accelerator),
        accum=accum,
        global_batch=t.batch_size * accum * world,
    )


def refuse_component_problems(recipe, fam) -> None:
    """Refuse the recipe's settings that the model's family or its likelihood has no use for (the uniform-noise
    settings on a masked-diffusion model), and their checks' problems: no recipe key selects them, so the recipe
    is checked against them once the family is known."""
    for kind, name in (("family", fam.name), ("likelihood", fam.likelihood)):
        problems = component_problems(recipe, registry.get(kind, name))
        if problems:
            raise UserError(f"{problems[0]} ({fam.name} models use the {fam.likelihood} likelihood)")


def resolve_padding(recipe, quiet: bool = False):
    """The recipe with ``data.padding`` as the model's likelihood allows, decided from its config.json before
    anything loads or is written (settings the family or its likelihood ignores refused first): a likelihood that
    does not pack (DiffusionGemma's uniform noise) turns the default ``packed`` into ``none`` with one info line;
    a ``packed`` the recipe sets on purpose is refused by name. Other recipes come back unchanged."""
    from dllm_align.models.load import family_of_source
    from dllm_align.objective.elbo import get_likelihood

    fam = family_of_source(recipe.model.name_or_path, recipe.model.revision)
    if fam is not None:
        refuse_component_problems(recipe, fam)
    if recipe.data.padding != "packed":
        return recipe
    lik = get_likelihood(fam.likelihood) if fam is not None else None
    if lik is None or lik.packs:
        return recipe
    if "padding" in recipe.data.model_fields_set:
        raise UserError(f"data.padding: packed is not available for {fam.name} (the {lik.name} likelihood does not pack)",
                        hint=f"{lik.packs_reason}: use data.padding: none, or leave the key out")
    if not quiet:
        from dllm_align.core.console import info

        info(f"data.padding: none ({fam.name}'s {lik.name} likelihood does not pack: {lik.packs_reason})")
    return recipe.model_copy(update={"data": recipe.data.model_copy(update={"padding": "none"})})


def check_fsdp(recipe, fsdp: bool, version: int = 1, checkpointing: bool = False) -> None:
    """Refuse, before anything loads, an FSDP launch (``version`` 1 or 2, with activation ``checkpointing`` or
    not) for a family whose model that FSDP cannot shard or checkpoint (its reason)."""
    if not fsdp:
        return
    from dllm_align.models.load import family_of_source

    fam = family_of_source(recipe.model.name_or_path, recipe.model.revision)
    if fam is not None and fam.fsdp_refusal:
        raise UserError(f"FSDP is not available for {fam.name}: {fam.fsdp_refusal}",
                        hint="launch with DDP (accelerate's MULTI_GPU) and LoRA, or on one device")
    if fam is not None and version != 2 and fam.fsdp1_refusal:
        raise UserError(f"FSDP1 is not available for {fam.name}: {fam.fsdp1_refusal}",
                        hint="set fsdp_version: 2 in the accelerate config's fsdp_config")
    if fam is not None and checkpointing and fam.fsdp_checkpointing_refusal:
        raise UserError(f"fsdp_activation_checkpointing is not available for {fam.name}: {fam.fsdp_checkpointing_refusal}",
                        hint="set fsdp_activation_checkpointing: false in the accelerate config's fsdp_config")
    if fam is not None and fam.fsdp_units is not None and recipe.train.fsdp_gather == "bf16_layers":
        raise UserError(f"train.fsdp_gather bf16_layers is not available for {fam.name}: its FSDP2 units are groups "
                        "of tied layers, gathered in fp32", hint="use train.fsdp_gather: fp32")


def check_trainable_on(recipe, device) -> None:
    """Refuse, before anything loads, a setting this device cannot train with. torch's FlexAttention has a
    CPU forward but no CPU backward: said here, not as a NotImplementedError inside the first step
    (scoring with it, as precompute-ref does, stays allowed)."""
    if recipe.model.attn_implementation == "flex_attention" and torch.device(device).type == "cpu":
        raise UserError("model.attn_implementation flex_attention cannot train on a CPU: FlexAttention has no backward there",
                        hint="use sdpa (or eager) for CPU training; flex_attention on CUDA")


def grad_accum_for(t: TrainSection, world: int) -> int:
    """Micro-batches per step: train.grad_accum, or derived from train.global_batch_size and the process count."""
    if t.global_batch_size is None:
        return t.grad_accum
    per = t.batch_size * world
    if t.global_batch_size % per:
        raise UserError(
            f"train.global_batch_size {t.global_batch_size} is not a multiple of train.batch_size {t.batch_size} "
            f"x {world} process(es)",
            hint="change the process count or train.batch_size so that they divide the global batch",
        )
    return t.global_batch_size // per


def class_weights(recipe) -> tuple[float, float]:
    if recipe.data.weights_file:
        ld, lu = read_weights_file(recipe.data.weights_file)
        info(f"class weights from {recipe.data.weights_file}: lambda_D {ld:g}, lambda_U {lu:g}")
        return ld, lu
    return recipe.train.lambda_desirable, recipe.train.lambda_undesirable
