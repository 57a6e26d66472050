"""The policy: loaded in the run's precision (with its LoRA adapters, or a checkpoint's weights when resuming),
wrapped as a module so that DDP / FSDP see every forward, and handed to the optimiser.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from safetensors.torch import load_file

from dllm_align.config.schema import LoraSection, ModelSection, TrainSection
from dllm_align.core.console import info
from dllm_align.core.errors import UserError
from dllm_align.models.families import family_of
from dllm_align.models.families.base import Family
from dllm_align.models.load import check_max_length, load_from_section
from dllm_align.models.shards import read_weight_shards
from dllm_align.models.precision import fsdp2_bf16_layer_units, fsdp_mixed_precision
from dllm_align.training.distributed import fsdp_wrap_family_layer, preserve_checkpoint_rng
from dllm_align.training.checkpoint import ADAPTER
from dllm_align.training.optim import build_optimizer
from dllm_align.training.plan import TrainPlan

# lazy imports: peft: an optional extra (`pip install 'dllm-align[lora]'`), imported where LoRA is applied
# lazy imports: torch.distributed.fsdp: fully_shard is public from torch 2.6 (pyproject allows 2.4); only FSDP2 runs use it


class PolicyScorer(torch.nn.Module):
    """The policy wrapped so that DDP / FSDP see every forward: log p at the scored positions only.

    The ELBO code calls :meth:`MaskPredictor.target_logprobs`, which runs the
    network body and the output head separately; going through this module's
    ``forward`` keeps the distributed wrappers (and accelerate's autocast) in
    the loop.
    """

    def __init__(self, mp):
        super().__init__()
        self.model = mp.model
        self.__dict__["_mp"] = mp  # not a submodule: it only holds references

    # The MaskPredictor scoring calls a likelihood may make through the wrapper.
    CALLS = ("target_logprobs", "canvas_logits", "position_terms")

    def forward(self, *args, call: str = "target_logprobs", **kwargs):
        if call not in self.CALLS:
            raise ValueError(f"PolicyScorer: no scoring call {call!r} (known: {', '.join(self.CALLS)})")
        return getattr(self._mp, call)(*args, **kwargs)


class PolicyView:
    """Duck-typed MaskPredictor for ``elbo_draws`` that routes through a (wrapped) PolicyScorer."""

    def __init__(self, module, mask_token_id: int, block_size: Optional[int], likelihood: str,
                 vocab_size: Optional[int] = None, canvas_length: Optional[int] = None):
        # The likelihood's name has no default: a block model must never fall back to the masked path.
        self.module = module
        self.vocab_size = vocab_size
        self.canvas_length = canvas_length
        self.mask_token_id = mask_token_id
        self.block_size = block_size
        self.likelihood = likelihood

    def target_logprobs(self, input_ids, attention_mask, rows, cols, targets, packed=None, streams=None):
        return self.module(input_ids, attention_mask, rows, cols, targets, packed=packed, streams=streams)

    def canvas_logits(self, examples, self_conditioning: str = "none"):
        return self.module(examples, self_conditioning=self_conditioning, call="canvas_logits")

    def position_terms(self, input_ids, attention_mask, rows, cols, term, extra=(), packed=None, streams=None):
        return self.module(input_ids, attention_mask, rows, cols, term, extra, packed=packed, streams=streams,
                           call="position_terms")


# --------------------------------------------------------------------------- loading
def load_policy(model: ModelSection, lora: LoraSection, max_length: int, plan: TrainPlan, resume_from: Optional[Path]):
    """The policy's MaskPredictor in training mode: fp32 master weights unless the recipe pins a dtype (autocast
    does bf16 on GPU), its LoRA adapters, or a resumed full fine-tune's weights. ``max_length``: data.max_length."""
    section = model
    if section.dtype == "auto":
        section = section.model_copy(update={"dtype": "float32"})
    if plan.fsdp and plan.fsdp_checkpointing:
        section = section.model_copy(update={"gradient_checkpointing": False})  # FSDP does it
    src = str(resume_from) if (resume_from is not None and not lora.enabled) else None
    # the recipe's model's config.json as the plan read it (a resumed full fine-tune loads another folder's)
    config = plan.source.config if src is None else None
    # An FSDP2 launch of several processes loads no weight here: each process reads its own shard of each once the
    # model is sharded (wrap_policy), so no process ever holds the whole model (a family whose weights are
    # transformed as they load is read whole, as before: mp.weight_sources None).
    empty = plan.fsdp2 and plan.world > 1
    mp = load_from_section(section, "cpu" if plan.fsdp else plan.device, name_or_path=src, config=config, empty=empty)
    check_max_length(mp, max_length)
    # The policy's forward computes under the plan's precision whatever wraps the module (DDP, FSDP).
    mp.set_precision(plan.precision)
    if lora.enabled:
        apply_lora(mp.model, lora, resume_from)
    mp.model.train()
    return mp


def apply_lora(model: torch.nn.Module, lora: LoraSection, resume_from: Optional[Path]) -> None:
    """Inject the LoRA adapters into ``model`` in place; when resuming, load the checkpoint's adapter weights."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        raise UserError("train.lora.enabled needs the peft package", hint="pip install 'dllm-align[lora]'") from None
    family = family_of(model)
    targets = list(lora.target_modules)
    if family.lora_modules is not None:  # tied stacks (DiffusionGemma): the family names the modules to adapt
        targets = family.lora_modules(model, targets)
    cfg = LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=targets, bias="none")
    try:
        with warnings.catch_warnings():  # peft asks the deprecated name of transformers 5.2x (a warning per run)
            warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
            get_peft_model(model, cfg)  # injects the adapter layers into the model in place
    except ValueError as e:
        raise UserError(f"train.lora.target_modules: {str(e).splitlines()[0][:200]}") from None
    if family.after_lora is not None:
        family.after_lora(model)
    if resume_from is None:
        return

    adapter = load_file(str(resume_from / ADAPTER))
    named = dict(model.named_parameters())
    extra = sorted(set(adapter) - set(named))
    if extra:
        raise UserError(f"cannot resume from {resume_from}: its LoRA adapter has weights this run's model lacks ({extra[0]})",
                        hint="resume with the recipe's original train.lora settings and model")
    for k, v in adapter.items():
        if named[k].shape != v.shape:
            raise UserError(
                f"cannot resume from {resume_from}: LoRA weight {k} is {tuple(v.shape)} there but {tuple(named[k].shape)} now "
                "(train.lora.r or the model changed)"
            )
        named[k].data.copy_(v)


# --------------------------------------------------------------------------- wrapping and the optimiser
@dataclass
class Trainable:
    """The policy as the step trains it: the wrapped module, its view for the ELBO code, the optimiser."""

    module: torch.nn.Module  # PolicyScorer as DDP / FSDP wrapped it
    view: PolicyView
    optimizer: torch.optim.Optimizer
    params: list  # the trainable parameters (this rank's shards under FSDP)


def wrap_policy(mp, t: TrainSection, plan: TrainPlan, accelerator) -> Trainable:
    """Wrap the policy for the launch (FSDP: the family's layers as units, fp32 gathers unless asked) and build AdamW."""
    if plan.fsdp:
        # accelerate's default casts parameters and buffers (the rotary frequencies) to
        # bf16 and reduces gradients in bf16; ours keeps fp32 and lets autocast do bf16.
        plugin = accelerator.state.fsdp_plugin
        plugin.mixed_precision_policy = fsdp_mixed_precision(plan.fsdp_version)
        fsdp_wrap_family_layer(plugin, mp.model)
        if family_of(mp.model).fsdp_units is not None:
            tied_units(mp.model, plugin, accelerator)
        elif t.fsdp_gather == "bf16_layers":
            bf16_layer_units(mp.model, plugin, plan, accelerator)
    elif t.fsdp_gather != "fp32" and plan.main:
        info("train: train.fsdp_gather applies to FSDP2 launches only; ignored here")
    scorer = PolicyScorer(mp)
    if plan.fsdp2:
        # FSDP2 swaps the parameters for sharded DTensors: the optimiser is built on the
        # originals and handed over with the model, which accelerate then remaps.
        opt = build_optimizer(scorer.named_parameters(), t, fused_ok=False)
        module, optimizer = accelerator.prepare(scorer, opt)
    else:
        module = accelerator.prepare(scorer)
        opt = build_optimizer(module.named_parameters(), t, fused_ok=not plan.fsdp)
        optimizer = accelerator.prepare(opt)
    if mp.weight_sources:
        read_weight_shards(module, mp.weight_sources, prefix="model.")
    if plan.fsdp:
        preserve_checkpoint_rng(module)  # FSDP2's layer checkpoints replay the forward's dropout masks
    view = PolicyView(module, mp.mask_token_id, mp.block_size, mp.likelihood, mp.vocab_size, mp.canvas_length)
    return Trainable(module, view, optimizer, [p for p in module.parameters() if p.requires_grad])


def fsdp2_mesh(accelerator):
    mesh = getattr(accelerator, "torch_device_mesh", None)
    if mesh is not None:
        mesh = mesh[tuple(accelerator.parallelism_config.fsdp_dim_names)]
    return mesh


def tied_units(model: torch.nn.Module, plugin, accelerator) -> None:
    """Shard the family's groups of tied layers (``Family.fsdp_units``), each group one FSDP2 unit, before
    accelerate shards the rest; accelerate then finds the grouped layers by their FSDP class names (and skips
    them, already sharded) for its wrap policy and its activation checkpointing."""
    from torch.distributed.fsdp import fully_shard

    groups, mesh = family_of(model).fsdp_units(model), fsdp2_mesh(accelerator)
    for group in groups:
        fully_shard(group, mesh=mesh, mp_policy=plugin.mixed_precision_policy,
                    reshard_after_forward=plugin.reshard_after_forward)
    plugin.transformer_cls_names_to_wrap = sorted({type(m).__name__ for g in groups for m in g})


def bf16_layer_units(model: torch.nn.Module, plugin, plan: TrainPlan, accelerator) -> None:
    """``train.fsdp_gather: bf16_layers`` (FSDP2 + bf16 autocast): decoder layers gathered in bf16."""
    if plan.fsdp_version != 2:
        raise UserError("train.fsdp_gather bf16_layers needs an FSDP2 launch (fsdp_version: 2 in the accelerate config)")
    if plan.precision.autocast != torch.bfloat16:
        raise UserError("train.fsdp_gather bf16_layers needs train.mixed_precision bf16 (it gathers what autocast "
                        "would cast to bf16)", hint="set train.mixed_precision: bf16, or train.fsdp_gather: fp32")
    mesh = fsdp2_mesh(accelerator)
    cls = Family.decoder_layer_class(model)
    fsdp2_bf16_layer_units(model, cls, reshard_after_forward=plugin.reshard_after_forward, mesh=mesh)
    # fully_shard renames a unit's class FSDP<name>: accelerate finds the layers by that name (and
    # skips them, already sharded) for its wrap policy and its activation checkpointing
    plugin.transformer_cls_names_to_wrap = [type(m).__name__ for m in model.modules() if isinstance(m, cls)][:1]
