"""Run setup for the training loop: the learning-rate schedule, the policy wrapped as a module, the margin
watch, the accelerator (DDP / FSDP1 / FSDP2 with the family's layer wrapped), the number of
accumulation micro-batches, class weights, AdamW, and gradient clipping by the global norm.
"""

from __future__ import annotations

import contextlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from dllm_align.core.errors import UserError





# --------------------------------------------------------------------------- schedule
def lr_at(step: int, total: int, peak: float, warmup_ratio: float, kind: str) -> float:
    """Learning rate of optimiser step ``step`` (0-based) out of ``total`` (module docstring)."""
    warm = math.ceil(warmup_ratio * total) if warmup_ratio > 0 else 0
    if step < warm:
        return peak * (step + 1) / warm
    if kind == "constant":
        return peak
    progress = (step - warm) / max(1, total - warm)
    if kind == "linear":
        return peak * max(0.0, 1.0 - progress)
    return peak * 0.5 * (1.0 + math.cos(math.pi * progress))


# --------------------------------------------------------------------------- the policy as a module
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

    def forward(self, input_ids, attention_mask, rows, cols, targets, packed=None, streams=None):
        return self._mp.target_logprobs(input_ids, attention_mask, rows, cols, targets, packed=packed, streams=streams)


class _ViaModule:
    """Duck-typed MaskPredictor for ``elbo_draws`` that routes through a (wrapped) PolicyScorer."""

    def __init__(self, module, mask_token_id: int, block_size: Optional[int], likelihood: str):
        self.module = module
        self.mask_token_id = mask_token_id
        self.block_size = block_size
        self.likelihood = likelihood

    def target_logprobs(self, input_ids, attention_mask, rows, cols, targets, packed=None, streams=None):
        return self.module(input_ids, attention_mask, rows, cols, targets, packed, streams)


# --------------------------------------------------------------------------- margin watch
@dataclass
class MarginWatch:
    """Warn when the desirable class's mean margin keeps falling (SPEC.md section 4 caution).

    The per-step desirable margins are averaged over windows of ``window``
    steps; three consecutive falling windows ending below zero trigger one
    warning (again only after a new fall of three windows).
    """

    window: int
    current: list = field(default_factory=list)
    means: list = field(default_factory=list)
    warned_at: int = -1

    def add(self, step: int, desirable_margin: Optional[float]) -> Optional[str]:
        if desirable_margin is None or not math.isfinite(desirable_margin):
            return None
        self.current.append(desirable_margin)
        if len(self.current) < self.window:
            return None
        self.means.append(float(np.mean(self.current)))
        self.current = []
        m = self.means
        if len(m) >= 4 and m[-1] < m[-2] < m[-3] < m[-4] and m[-1] < 0 and len(m) - self.warned_at >= 3:
            self.warned_at = len(m)
            return (
                f"step {step}: the desirable rows' mean margin has fallen for 3 windows of {self.window} steps "
                f"({m[-4]:+.3g} -> {m[-1]:+.3g}); both classes may be pushed down (likelihood displacement). "
                "Consider a lower train.lr or a smaller train.lambda_undesirable."
            )
        return None

    def state(self) -> dict:
        return {"window": self.window, "current": self.current, "means": self.means, "warned_at": self.warned_at}

    @classmethod
    def from_state(cls, d: dict, window: int) -> "MarginWatch":
        if d.get("window") != window:
            return cls(window)
        return cls(window, list(d["current"]), list(d["means"]), int(d["warned_at"]))


# --------------------------------------------------------------------------- run setup
@dataclass
class TrainResult:
    output_dir: Path
    final_dir: Path
    steps: int
    seconds: float
    examples: int
    last_metrics: dict

    @property
    def steps_per_second(self) -> float:
        return self.steps / self.seconds if self.seconds > 0 else float("nan")

    @property
    def examples_per_second(self) -> float:
        return self.examples / self.seconds if self.seconds > 0 else float("nan")


def _fault(kind: str, step: Optional[int] = None) -> None:
    from dllm_align.core import faults

    faults.at(kind, step)


def make_accelerator(recipe):
    from accelerate import Accelerator
    from accelerate.utils import is_tensorboard_available, is_wandb_available

    from dllm_align.core.console import warn

    from dllm_align.models.precision import resolve_mixed_precision

    cuda = torch.cuda.is_available()
    mp = resolve_mixed_precision(recipe.train.mixed_precision, "cuda" if cuda else "cpu")
    trackers = []
    for t in recipe.train.trackers:
        ok = {"tensorboard": is_tensorboard_available, "wandb": is_wandb_available}[t]()
        if ok:
            trackers.append(t)
        else:
            warn(f"train.trackers: {t} is not installed; not logging to it (pip install {t})")
    from dllm_align.models.precision import accelerator_kwargs

    return Accelerator(
        cpu=not cuda,
        mixed_precision=mp,
        kwargs_handlers=accelerator_kwargs(recipe),
        log_with=trackers or None,
        project_dir=recipe.output_dir,
    )


def check_trainable_on(recipe, device) -> None:
    """Refuse, before anything loads, a setting this device cannot train with. torch's FlexAttention has a
    CPU forward but no CPU backward: said here, not as a NotImplementedError inside the first step
    (scoring with it, as precompute-ref does, stays allowed)."""
    if recipe.model.attn_implementation == "flex_attention" and torch.device(device).type == "cpu":
        raise UserError("model.attn_implementation flex_attention cannot train on a CPU: FlexAttention has no backward there",
                        hint="use sdpa (or eager) for CPU training; flex_attention on CUDA")


def grad_accum_for(t, world: int) -> int:
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


def fsdp_wrap_family_layer(plugin, model) -> None:
    """Make FSDP wrap the model family's decoder layer.

    The shipped accelerate config names ``LlamaDecoderLayer`` (LLaDA's native body);
    a Dream (Qwen2) or LLaDA-MoE (Qwen3-MoE) body has other layer classes, and
    accelerate would stop on a class it cannot find. A config that names classes
    the model has is left as it is.
    """
    from dllm_align.models.families.base import Family

    cls = Family.decoder_layer_class(model)
    if cls is None:
        return
    names = getattr(plugin, "transformer_cls_names_to_wrap", None)
    present = {type(m).__name__ for m in model.modules()}
    if not names or any(n not in present for n in names):
        plugin.transformer_cls_names_to_wrap = [cls.__name__]


def preserve_checkpoint_rng(model: torch.nn.Module) -> int:
    """Make every activation-checkpoint wrapper restore the RNG state before it recomputes; returns how many changed.

    accelerate 1.15 wraps FSDP2 layers with ``checkpoint_wrapper(preserve_rng_state=False)``:
    the backward's recompute then draws new dropout masks (LoRA dropout), and the gradient
    belongs to another forward than the loss (26% relative gradient error at dropout 0.3).
    The wrapper's checkpoint function is rebuilt with ``preserve_rng_state=True``: the
    recompute replays the forward's masks, as without checkpointing (issue 22, defect 3).
    """
    from functools import partial

    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    n = 0
    for m in model.modules():
        fn = getattr(m, "checkpoint_fn", None) if isinstance(m, CheckpointWrapper) else None
        if isinstance(fn, partial) and fn.keywords.get("preserve_rng_state") is False:
            m.checkpoint_fn = partial(fn.func, *fn.args, **{**fn.keywords, "preserve_rng_state": True})
            n += 1
    return n


def _is_fsdp(accelerator) -> bool:
    from accelerate.utils import DistributedType

    return accelerator.distributed_type == DistributedType.FSDP


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flat(v, key + "."))
        elif isinstance(v, (int, float, str, bool)) or v is None:
            out[key] = v if v is not None else "null"
        else:
            out[key] = json.dumps(v)
    return out


def class_weights(recipe) -> tuple[float, float]:
    if recipe.data.weights_file:
        from dllm_align.core.console import info
        from dllm_align.data.imbalance import read_weights_file

        ld, lu = read_weights_file(recipe.data.weights_file)
        info(f"class weights from {recipe.data.weights_file}: lambda_D {ld:g}, lambda_U {lu:g}")
        return ld, lu
    return recipe.train.lambda_desirable, recipe.train.lambda_undesirable


def build_optimizer(named_parameters, t, *, fused_ok: bool = True) -> torch.optim.AdamW:
    """AdamW over the trainable parameters (``train`` section t); no weight decay on biases and norms.

    The fused kernel (one pass over each tensor, torch >= 2.4 on CPU and CUDA) is used
    when every parameter is a plain floating tensor on such a device and fp16 loss
    scaling is off; it gives the same update as the per-tensor loop up to float
    rounding, ~10x faster on CPU (where the loop's step is a visible part of a small
    model's training step). FSDP's sharded parameters keep the default implementation.
    """
    decay, no_decay = [], []
    for name, p in named_parameters:
        if not p.requires_grad:
            continue
        (no_decay if (name.endswith("bias") or "norm" in name.lower()) else decay).append(p)
    params = decay + no_decay
    fused = (
        fused_ok
        and t.mixed_precision != "fp16"
        and bool(params)
        and all(type(p.data) is torch.Tensor and p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in params)
    )
    groups = [{"params": decay, "weight_decay": t.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(
        [g for g in groups if g["params"]],
        lr=t.lr,
        betas=(t.adam_beta1, t.adam_beta2),
        eps=t.adam_eps,
        fused=fused or None,
    )


@contextlib.contextmanager
def _seeded_rng(key: tuple, device):
    import hashlib

    seed = int.from_bytes(hashlib.sha256(repr(key).encode()).digest()[:8], "little") >> 1
    devices = [device] if torch.device(device).type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield


def clip_global_grad_norm(params: list, max_norm: float, *, sharded: bool, device) -> float:
    """Clip by the norm of the whole gradient, the same on every rank; returns that norm.

    Under FSDP each rank holds a disjoint shard of every gradient (FSDP1 views
    on the flat shard, FSDP2 DTensor shards): the squared norms are summed over
    the ranks, so every rank gets the true global norm, clips by the same
    factor and sees the same non-finite value (a NaN or inf anywhere reaches
    all ranks through the sum). The per-shard fallback accelerate uses when
    not given every parameter (LoRA: only the adapters train) clipped each rank
    by its own shard's norm (issue 13, defect 3). Under DDP and on one process
    the gradients are whole and identical on every rank.
    """
    grads = []
    for p in params:
        g = p.grad
        if g is None:
            continue
        grads.append(g.to_local() if hasattr(g, "to_local") else g)
    sq = torch.zeros((), dtype=torch.float64, device=device)
    for g in grads:
        if g.numel():
            sq += g.detach().double().pow(2).sum().to(device)
    dist = torch.distributed.is_available() and torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1
    if dist and sharded:
        torch.distributed.all_reduce(sq, op=torch.distributed.ReduceOp.SUM)
    elif dist:
        # Whole gradients are equal on every rank after DDP's all-reduce; the decision to stop
        # is still made together (one flag), so no rank can raise while another waits.
        bad = torch.tensor(0.0 if torch.isfinite(sq) else 1.0, device=device)
        torch.distributed.all_reduce(bad, op=torch.distributed.ReduceOp.MAX)
        if bad.item():
            sq = torch.full_like(sq, float("nan"))
    norm = float(sq.sqrt())
    if math.isfinite(norm) and math.isfinite(max_norm) and norm > max_norm:
        coef = max_norm / (norm + 1e-6)
        for g in grads:
            g.detach().mul_(coef)
    return norm



