"""The one precision policy: what dtype weights are kept in and what dtype the forward computes in.

Every forward that produces a number the loss compares - the policy during
training, the online reference, the reference precompute behind the cache, the
``doctor`` smoke steps - runs through :meth:`MaskPredictor.target_logprobs`
under the same :class:`Precision`, so that before the first update the policy
and the reference compute the same function and every margin is zero.

The policy (any launch: 1 process, DDP, FSDP1, FSDP2)
    fp32 master weights (``model.dtype: auto``); with ``train.mixed_precision:
    bf16`` the forward runs under ``torch.autocast(bf16)``: matmuls in bf16,
    the residual stream, norms, softmax and the rotary phases in fp32. Under
    FSDP the parameters are *not* cast to bf16 (``param_dtype=None``): casting
    them would give the embeddings, the norm weights and the head bf16 values,
    and (FSDP2's ``cast_forward_inputs``, FSDP1's input cast) the residual
    stream entering each unit bf16 too, so FSDP would compute a different
    function from DDP and from the cache (0.14 nats per draw on the toy).
    Buffers are a separate matter: FSDP2's ``MixedPrecisionPolicy`` never
    casts them, while FSDP1's ``MixedPrecision(buffer_dtype=bf16)`` (accelerate's
    default) casts the rotary ``inv_freq`` to bf16 - hence ``buffer_dtype=fp32``
    there and :func:`keep_fp32_buffers` after any cast. Gradients are reduced in
    fp32. The cost: FSDP all-gathers fp32 shards (twice the traffic of bf16 shards).
    Mixture-of-experts blocks (3-D weights multiplied by grouped matmuls, which
    autocast does not see) are routed through :func:`autocast_experts_forward`,
    which casts them to the autocast dtype as autocast does for a Linear.

The reference
    The same weights dtype, with every ``nn.Linear`` (and every experts block)
    stored in the compute dtype when autocast is on. Autocast casts a Linear's fp32 weight to bf16
    (round to nearest even) on every call; storing that rounding once gives
    bit-identical matmuls at half the memory (an 8B reference: ~17 GB instead
    of 32 GB).

Rotary frequencies
    ``inv_freq`` must stay fp32: in bf16 (8 mantissa bits) LLaDA's 64
    frequencies at theta 5e5 are off by up to 2^-9 relative, i.e. phase
    errors up to 7.3 rad at position 4,095 (12 of 64 pairs > 0.1 rad at 1,000). :func:`keep_fp32_buffers` recomputes
    them in fp32 after any dtype cast.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from datetime import timedelta
from typing import Optional

import torch

from dllm_align.core.errors import UserError

# The memory estimate reaches this module without a model, so these are imported where used:
# lazy imports: transformers: MoE experts only, and it takes longer to import than torch
# lazy imports: accelerate: the launch handlers only
# lazy imports: torch.distributed.fsdp: only an FSDP run needs it (FSDP2's names are public from torch 2.6,
# pyproject allows 2.4)

_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
_AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16, "no": None}


@dataclass(frozen=True)
class Precision:
    """Weights dtype (the policy's master copy) and autocast dtype (None: compute in the weights' dtype)."""

    weights: torch.dtype = torch.float32
    autocast: Optional[torch.dtype] = None

    @property
    def compute_label(self) -> str:
        """What the forward computes in, as recorded in the reference cache fingerprint."""
        w = _NAMES[self.weights]
        return w if self.autocast is None or self.autocast == self.weights else f"{w}+autocast:{_NAMES[self.autocast]}"

    @property
    def weights_label(self) -> str:
        return _NAMES[self.weights]


def resolve_mixed_precision(mode: str, device) -> str:
    """``train.mixed_precision`` with ``auto`` resolved: bf16 on a CUDA device that supports it, else no.
    fp16 is refused off CUDA: it needs accelerate's gradient scaler, which runs on CUDA only, and CPU
    autocast in fp16 is neither faster nor what a GPU run would compute."""
    dev = torch.device(device)
    if mode == "fp16" and dev.type != "cuda":
        raise UserError(f"train.mixed_precision fp16 needs a CUDA device (this run is on {dev.type})",
                        hint="use train.mixed_precision: bf16 (runs on CPU too, as on the GPU) or no")
    if mode != "auto":
        return mode
    if dev.type == "cuda" and torch.cuda.is_available() and torch.cuda.is_bf16_supported():
        return "bf16"
    return "no"


def training_weights_dtype(model_dtype: str) -> torch.dtype:
    """The policy's master weights: fp32 unless the recipe pins ``model.dtype``."""
    if model_dtype == "auto":
        return torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[model_dtype]


def precision_for(recipe, device) -> Precision:
    """The precision the recipe's training runs in on ``device`` (shared by policy, reference and precompute)."""
    mode = resolve_mixed_precision(recipe.train.mixed_precision, device)
    return Precision(training_weights_dtype(recipe.model.dtype), _AUTOCAST[mode])


def autocast(precision: Optional[Precision], device_type: str):
    """The forward's autocast context (a no-op without autocast)."""
    if precision is None or precision.autocast is None or precision.autocast == precision.weights:
        return contextlib.nullcontext()
    # cache_enabled=False: autocast would otherwise keep a bf16 copy of every fp32 weight it
    # casts until the forward ends - under FSDP that is the whole model (16 GB for 8B params)
    # held beside the shards. Each cast is then redone where used (the same values).
    return torch.autocast(device_type=device_type, dtype=precision.autocast, cache_enabled=False)


def keep_fp32_buffers(model: torch.nn.Module) -> int:
    """Recompute every rotary ``inv_freq`` buffer in fp32 (after a cast to bf16/fp16 rounded it); returns how many.

    A rotary module that knows how to rebuild its frequencies (transformers'
    ``rope_init_fn`` / ``compute_default_rope_parameters``) is rebuilt exactly;
    otherwise the buffer is upcast (exact only if it was never rounded).
    """
    n = 0
    for mod in model.modules():
        inv = getattr(mod, "inv_freq", None)
        if not isinstance(inv, torch.Tensor) or inv.dtype == torch.float32:
            continue
        fresh = None
        cfg = getattr(mod, "config", None)
        init = getattr(mod, "rope_init_fn", None) or getattr(mod, "compute_default_rope_parameters", None)
        if cfg is not None and init is not None:
            try:
                fresh = init(cfg)[0]
            except Exception:  # another signature: fall back to the upcast
                fresh = None
        if fresh is None or fresh.shape != inv.shape:
            fresh = inv.float()
        fresh = fresh.to(device=inv.device, dtype=torch.float32)
        mod.inv_freq = fresh  # registered buffer: assignment keeps it a buffer
        if isinstance(getattr(mod, "original_inv_freq", None), torch.Tensor):
            mod.original_inv_freq = fresh.clone()
        n += 1
    return n


def prepare_reference(model: torch.nn.Module, precision: Precision) -> None:
    """Store each Linear and each mixture-of-experts weight block in the autocast dtype (bit-identical
    to the policy's per-call cast, half the memory). A Linear whose weight an embedding shares (a head tied
    to the input embeddings, as DiffusionGemma's) keeps it: autocast does not cast an embedding lookup, so
    casting the shared weight would round the policy's fp32 embeddings on the reference side only."""
    for mod in reference_cast_modules(model, precision):
        mod.to(precision.autocast)


def reference_cast_modules(model: torch.nn.Module, precision: Precision) -> list:
    """The modules :func:`prepare_reference` stores in the autocast dtype (none without autocast)."""
    if precision.autocast is None or precision.autocast == precision.weights:
        return []
    embedded = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    return [mod for mod in model.modules()
            if (isinstance(mod, torch.nn.Linear) and id(mod.weight) not in embedded) or _is_experts(mod)]


# ----------------------------------------------------------------- mixture-of-experts blocks
# transformers' experts (LLaDA-MoE's native Qwen3-MoE body) keep their weights as 3-D tensors and
# multiply them with grouped matmuls, which autocast does not see: with fp32 master weights the
# experts ran in fp32 under bf16 autocast (on CUDA a per-expert fallback loop with a host sync per
# MoE layer, and expert activations at twice the memory). The experts function registered here
# casts the expert weights to the autocast dtype first, as autocast does for a Linear; it then
# calls transformers' own grouped-matmul experts forward.
EXPERTS_IMPL = "dllm_align_autocast_grouped_mm"
_EXPERT_WEIGHTS = ("gate_up_proj", "up_proj", "down_proj", "gate_up_proj_bias", "up_proj_bias", "down_proj_bias")


def _is_experts(mod: torch.nn.Module) -> bool:
    w = getattr(mod, "down_proj", None)
    return hasattr(mod, "num_experts") and isinstance(w, torch.Tensor) and w.dim() == 3


class _CastExperts:
    """An experts module seen with its weight blocks in ``dtype`` (every other attribute is the module's)."""

    def __init__(self, mod: torch.nn.Module, dtype: torch.dtype):
        self.__dict__["_mod"], self.__dict__["_dtype"] = mod, dtype

    def __getattr__(self, name):
        v = getattr(self._mod, name)
        if name in _EXPERT_WEIGHTS and isinstance(v, torch.Tensor) and v.is_floating_point():
            return v.to(self._dtype)
        return v


def autocast_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    from transformers.integrations.moe import grouped_mm_experts_forward

    dev = hidden_states.device.type
    dt = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else None
    w = getattr(self, "gate_up_proj", None)
    w = w if isinstance(w, torch.Tensor) else self.down_proj
    if dt is None or w.dtype == dt:
        return grouped_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights)
    return grouped_mm_experts_forward(_CastExperts(self, dt), hidden_states, top_k_index, top_k_weights)


def experts_in_compute_precision(model: torch.nn.Module) -> bool:
    """Route a mixture-of-experts model's experts through :func:`autocast_experts_forward`; False if it has none."""
    if not any(_is_experts(m) for m in model.modules()):
        return False
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    if EXPERTS_IMPL not in ALL_EXPERTS_FUNCTIONS:
        ALL_EXPERTS_FUNCTIONS.register(EXPERTS_IMPL, autocast_experts_forward)
    configs = {id(m.config): m.config for m in model.modules() if _is_experts(m) and getattr(m, "config", None) is not None}
    for cfg in configs.values():
        cfg._experts_implementation = EXPERTS_IMPL
    return True


def _is_norm(mod: torch.nn.Module) -> bool:
    name = type(mod).__name__
    return name.endswith(("RMSNorm", "LayerNorm")) and not any(True for _ in mod.children())


def fsdp2_bf16_layer_units(model: torch.nn.Module, layer_class: type, *, reshard_after_forward=True, mesh=None) -> int:
    """``train.fsdp_gather: bf16_layers``: shard each decoder layer as a unit gathered in bf16.

    Every norm inside a layer (input / post-attention norms, MoE's q / k norms) becomes its
    own fp32 unit first, then the layer a unit with ``MixedPrecisionPolicy(param_dtype=bf16,
    reduce_dtype=fp32, cast_forward_inputs=False)``: the residual stream stays fp32, and
    the layer's Linear and expert weights arrive in bf16 - exactly what autocast would have
    cast them to (round to nearest even), so the forward computes the same values as the
    fp32-gathered policy and as the cache, on any weights (benchmarks/fsdp2_policy.py:
    max |delta| 0.0 with weights off the bf16 grid; gathering the norms in bf16 too gave
    4.9e-3 nats per position there). accelerate then shards the rest (embeddings, final
    norm, head, root) with the fp32 policy, skipping these units. Returns how many layers.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    f32 = MixedPrecisionPolicy(param_dtype=None, reduce_dtype=torch.float32)
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=False)
    kw = {"reshard_after_forward": reshard_after_forward, "mesh": mesh}
    layers = [m for m in model.modules() if isinstance(m, layer_class)]
    for layer in layers:
        for m in [m for m in layer.modules() if m is not layer and _is_norm(m)]:
            fully_shard(m, mp_policy=f32, **kw)
        fully_shard(layer, mp_policy=bf16, **kw)
    return len(layers)


def fsdp_mixed_precision(fsdp_version: int):
    """FSDP's policy for :class:`Precision`: no parameter cast, fp32 gradient reduction, fp32 buffers."""
    if fsdp_version == 2:
        from torch.distributed.fsdp import MixedPrecisionPolicy

        return MixedPrecisionPolicy(param_dtype=None, reduce_dtype=torch.float32, output_dtype=None)
    from torch.distributed.fsdp import MixedPrecision

    return MixedPrecision(param_dtype=None, reduce_dtype=torch.float32, buffer_dtype=torch.float32)


def accelerator_kwargs(recipe) -> list:
    """accelerate handlers every launch uses: the process-group timeout and autocast without a weight cache."""
    from accelerate.utils import AutocastKwargs, InitProcessGroupKwargs

    return [
        InitProcessGroupKwargs(timeout=timedelta(minutes=recipe.train.process_group_timeout_minutes)),
        AutocastKwargs(cache_enabled=False),
    ]
