"""The run's plan: what a training run derives from its recipe and its launch, computed once before anything
loads or the run folder changes (the model's family and likelihood from its config.json, read once; the padding
and FSDP settings that family allows; the objective and its class weights, the precision, the packed-row length,
the draws, the process layout and the global batch), as one frozen record the setup steps and the step take.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from dllm_align.config import components as registry
from dllm_align.config.schema import TrainSection, component_problems, noise_problem, rule_problems
from dllm_align.core.console import info
from dllm_align.core.errors import UserError
from dllm_align.data.batching import pack_length_of
from dllm_align.data.imbalance import read_weights_file
from dllm_align.models.families.base import Family
from dllm_align.models.export import check_remote_code, tokenizer_files
from dllm_align.models.load import BUILTIN_SPECS, ModelSource, model_source
from dllm_align.models.precision import Precision, precision_for
from dllm_align.objective.base import ClassWeights, Objective, objective_for
from dllm_align.objective.elbo import DrawConfig, get_likelihood, likelihood_for
from dllm_align.objective.likelihood import Likelihood
from dllm_align.training.distributed import fsdp_launch_of, is_fsdp


@dataclass(frozen=True)
class TrainPlan:
    """The derived values of one run on one process."""

    source: ModelSource  # the recipe's model: its family and config.json, read once
    objective: Objective
    class_weights: ClassWeights
    precision: Precision  # one precision for the policy and the reference (models.precision)
    pack_length: Optional[int]  # pack each forward's noisy rows into rows of this length (data.padding: packed)
    draws: DrawConfig  # the reference's draw set; the policy uses draws 0..k-1 of it
    k: int
    device: torch.device
    world: int  # processes
    rank: int
    main: bool
    fsdp: bool
    fsdp_version: int  # 1 or 2 (an FSDP launch's; 1 where it says none)
    fsdp_checkpointing: bool  # FSDP's activation checkpointing (it replaces the model's own)
    accum: int  # micro-batches per process and step
    global_batch: int  # units per optimiser step: train.batch_size x accum x world

    @property
    def draw_ids(self) -> list[int]:
        return list(range(self.k))

    @property
    def family(self) -> Optional[Family]:
        return self.source.family

    @property
    def likelihood(self) -> Optional[Likelihood]:
        return None if self.family is None else get_likelihood(self.draws.likelihood or self.family.likelihood)

    @property
    def fsdp2(self) -> bool:
        return self.fsdp and self.fsdp_version == 2


def plan_run(recipe, accelerator, quiet: Optional[bool] = None):
    """``(recipe, plan)``: the recipe as this model and launch can train it (:func:`resolve_recipe`) and the run's
    plan on this process of ``accelerator``. Everything here is refused before anything loads or is written.
    ``quiet``: no info lines (default: on the processes other than the main one)."""
    version, checkpointing = fsdp_launch_of(accelerator)
    recipe, source = resolve_recipe(recipe, fsdp=is_fsdp(accelerator), fsdp_version=version, checkpointing=checkpointing,
                                    quiet=not accelerator.is_main_process if quiet is None else quiet)
    return recipe, make_plan(recipe, accelerator, source)


def make_plan(recipe, accelerator, source: ModelSource) -> TrainPlan:
    """The plan of a resolved ``recipe`` on this process of ``accelerator`` (refuses what this device cannot train)."""
    t = recipe.train
    check_trainable_on(recipe, accelerator.device)
    world = accelerator.num_processes
    version, checkpointing = fsdp_launch_of(accelerator)
    ld, lu = class_weights(recipe)
    # Weights the recipe sets on purpose (the demo's lambda_U = 0.3) are reported, not warned about.
    chosen = bool({"lambda_desirable", "lambda_undesirable"} & t.model_fields_set) or bool(recipe.data.weights_file)
    weights = ClassWeights(ld, lu, chosen)
    accum = grad_accum_for(t, world)
    return TrainPlan(
        source=source,
        objective=objective_for(t, weights),
        class_weights=weights,
        precision=precision_for(recipe, accelerator.device),
        pack_length=pack_length_of(recipe.data),
        draws=DrawConfig.from_reference(recipe.reference),
        k=recipe.train_n_mc(),
        device=accelerator.device,
        world=world,
        rank=accelerator.process_index,
        main=accelerator.is_main_process,
        fsdp=is_fsdp(accelerator),
        fsdp_version=version,
        fsdp_checkpointing=checkpointing,
        accum=accum,
        global_batch=t.batch_size * accum * world,
    )


def resolve_recipe(recipe, *, fsdp: bool = False, fsdp_version: int = 1, checkpointing: bool = False,
                   quiet: bool = False):
    """``(recipe, source)``: the model's family read from its config.json (once), the family's and its likelihood's
    own checks against the recipe, ``data.padding`` as the likelihood allows (:func:`resolve_padding`) and the
    FSDP launch the family allows (:func:`check_fsdp`). Used by ``train``, ``precompute-ref`` and ``doctor``."""
    source = model_source(recipe.model.name_or_path, recipe.model.revision)
    if source.family is not None:
        refuse_component_problems(recipe, source.family)
        check_export_sources(recipe, source)
    recipe = resolve_padding(recipe, source, quiet=quiet)
    check_fsdp(recipe, source.family, fsdp, fsdp_version, checkpointing)
    return recipe, source


def check_export_sources(recipe, source: ModelSource) -> None:
    """What the export of ``final/`` will copy (the source folder's remote code and generation config,
    ``model.published_code``'s modeling files and what they import, the tokenizer's files, ``model.tokenizer``'s
    where it names a folder) checked before the first step: regular UTF-8 files inside their folder, a
    tokenizer_config.json that is JSON; a refusal names the file (``models.export.check_remote_code``)."""
    check_remote_code(source.folder, source.config, source.family.name)
    code = recipe.model.published_code
    if code:
        check_remote_code(Path(code).expanduser(), source.config, source.family.name)
    named = recipe.model.tokenizer
    tokenizer_files(Path(named).expanduser() if named and Path(named).expanduser().is_dir() else source.folder)


def check_for_model(recipe) -> None:
    """The recipe checked against its model where the model can be read here (a built-in model, a local folder; a
    hub id is left to the run), before a command makes any folder (``recipes check``, ``demo``, ``online``,
    ``ablate``): the settings its family and likelihood refuse, what its export would copy, the padding its
    likelihood allows (as ``train`` checks them), and with ``generate.sampler: auto`` the settings its family's
    decoding rule refuses (as ``generate`` checks them once the model is loaded)."""
    name = recipe.model.name_or_path
    if not (name in BUILTIN_SPECS or name.startswith("builtin:") or Path(name).expanduser().is_dir()):
        return
    recipe, source = resolve_recipe(recipe, quiet=True)
    fam = source.family
    backend = registry.get("backend", recipe.generate.backend, key="generate.backend")
    family_problem = backend.traits.get("family_problem")
    if fam is not None and family_problem is not None:
        problem = family_problem(recipe.generate.own_settings(backend.name), fam.name)
        if problem is not None:
            raise UserError(problem, hint="docs/serving.md lists the families each engine serves")
    if fam is not None and recipe.generate.sampler != "auto":
        problem = noise_problem(recipe.generate.sampler, fam.name, fam.likelihood)
        if problem is not None:
            raise UserError(f"generate.sampler: {problem}",
                            hint=f"set generate.sampler: {fam.sampler} (or auto, the family's own rule)")
    if source.family is not None and recipe.generate.sampler == "auto":
        problems = rule_problems(recipe.generate, source.family.sampler)
        if problems:
            key, message = problems[0]
            raise UserError(f"generate.{key}: {message}", hint=f"generate.sampler is auto: {source.family.name} "
                            f"models decode with the {source.family.sampler} rule")


def chosen_likelihood(recipe, fam: Family) -> str:
    """The likelihood a run of ``recipe`` on a model of ``fam`` uses (:func:`objective.elbo.likelihood_for`)."""
    return likelihood_for(fam, recipe.reference.likelihood)


def likelihood_of(source: ModelSource, recipe) -> Optional[Likelihood]:
    return get_likelihood(chosen_likelihood(recipe, source.family)) if source.family is not None else None


def refuse_component_problems(recipe, fam: Family) -> None:
    """Refuse the recipe's settings that the model's family or its likelihood has no use for (the uniform-noise
    settings on a masked-diffusion model), and their checks' problems, and a ``reference.likelihood`` the family does
    not take: the checkpoint's config.json names the family, so the recipe is checked against them here, once the
    family is known."""
    lik = chosen_likelihood(recipe, fam)
    unused = recipe.reference.settings_of_others(lik)  # another likelihood's own settings would do nothing
    if unused:
        raise UserError(f"reference.{unused[0]}: the settings of the likelihood {unused[0]!r}, which this run does not "
                        f"use ({fam.name} models use the {lik} likelihood here)",
                        hint=f"set reference.likelihood: {unused[0]} where the family takes it, or leave them out")
    for kind, name in (("family", fam.name), ("likelihood", lik)):
        problems = component_problems(recipe, registry.get(kind, name))
        if problems:
            raise UserError(f"{problems[0]} ({fam.name} models use the {lik} likelihood)")


def resolve_padding(recipe, source: ModelSource, quiet: bool = False):
    """The recipe with ``data.padding`` as the model's likelihood allows: a likelihood that does not pack
    (DiffusionGemma's uniform noise) turns the default ``packed`` into ``none`` with one info line; a ``packed``
    the recipe sets on purpose is refused by name. Other recipes come back unchanged."""
    if recipe.data.padding != "packed":
        return recipe
    fam, lik = source.family, likelihood_of(source, recipe)
    if lik is None or lik.packs:
        return recipe
    if "padding" in recipe.data.model_fields_set:
        raise UserError(f"data.padding: packed is not available for {fam.name} (the {lik.name} likelihood does not pack)",
                        hint=f"{lik.packs_reason}: use data.padding: none, or leave the key out")
    if not quiet:
        info(f"data.padding: none ({fam.name}'s {lik.name} likelihood does not pack: {lik.packs_reason})")
    return recipe.model_copy(update={"data": recipe.data.model_copy(update={"padding": "none"})})


def check_fsdp(recipe, fam: Optional[Family], fsdp: bool, version: int = 1, checkpointing: bool = False) -> None:
    """Refuse, before anything loads, an FSDP launch (``version`` 1 or 2, with activation ``checkpointing`` or
    not) for a family whose model that FSDP cannot shard or checkpoint (its reason)."""
    if not fsdp or fam is None:
        return
    if fam.fsdp_refusal:
        raise UserError(f"FSDP is not available for {fam.name}: {fam.fsdp_refusal}",
                        hint="launch with DDP (accelerate's MULTI_GPU) and LoRA, or on one device")
    if version != 2 and fam.fsdp1_refusal:
        raise UserError(f"FSDP1 is not available for {fam.name}: {fam.fsdp1_refusal}",
                        hint="set fsdp_version: 2 in the accelerate config's fsdp_config")
    if checkpointing and fam.fsdp_checkpointing_refusal:
        raise UserError(f"fsdp_activation_checkpointing is not available for {fam.name}: {fam.fsdp_checkpointing_refusal}",
                        hint="set fsdp_activation_checkpointing: false in the accelerate config's fsdp_config")
    if fam.fsdp_units is not None and recipe.train.fsdp_gather == "bf16_layers":
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
