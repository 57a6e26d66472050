"""The launch: the accelerator (DDP / FSDP1 / FSDP2), the family's layer wrapped by FSDP, activation checkpoints that
replay the RNG, and a seeded RNG scope.
"""

from __future__ import annotations

import contextlib
import hashlib
from functools import partial

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, is_tensorboard_available, is_wandb_available

from dllm_align.core.console import warn
from dllm_align.models.families.base import Family
from dllm_align.models.precision import accelerator_kwargs, resolve_mixed_precision

# lazy imports: torch.distributed.algorithms: checkpoint_wrapper's path is private (torch.distributed.algorithms._checkpoint)
# and only an FSDP run with gradient checkpointing needs it



def make_accelerator(recipe):
    cuda = torch.cuda.is_available()
    mp = resolve_mixed_precision(recipe.train.mixed_precision, "cuda" if cuda else "cpu")
    trackers = []
    for t in recipe.train.trackers:
        ok = {"tensorboard": is_tensorboard_available, "wandb": is_wandb_available}[t]()
        if ok:
            trackers.append(t)
        else:
            warn(f"train.trackers: {t} is not installed; not logging to it (pip install {t})")

    return Accelerator(
        cpu=not cuda,
        mixed_precision=mp,
        kwargs_handlers=accelerator_kwargs(recipe),
        log_with=trackers or None,
        project_dir=recipe.output_dir,
    )


def is_fsdp(accelerator) -> bool:
    return accelerator.distributed_type == DistributedType.FSDP


def fsdp_launch_of(accelerator) -> tuple[int, bool]:
    """The FSDP version an FSDP launch asks for (1 where it says none) and whether it checkpoints activations."""
    plugin = getattr(accelerator.state, "fsdp_plugin", None)
    return int(getattr(plugin, "fsdp_version", 1) or 1), bool(getattr(plugin, "activation_checkpointing", False))


def fsdp_wrap_family_layer(plugin, model) -> None:
    """Make FSDP wrap the model family's decoder layer.

    The shipped accelerate config names ``LlamaDecoderLayer`` (LLaDA's native body);
    a Dream (Qwen2) or LLaDA-MoE (Qwen3-MoE) body has other layer classes, and
    accelerate would stop on a class it cannot find. A config that names classes
    the model has is left as it is.
    """
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
    recompute replays the forward's masks, as without checkpointing.
    """
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    n = 0
    for m in model.modules():
        fn = getattr(m, "checkpoint_fn", None) if isinstance(m, CheckpointWrapper) else None
        if isinstance(fn, partial) and fn.keywords.get("preserve_rng_state") is False:
            m.checkpoint_fn = partial(fn.func, *fn.args, **{**fn.keywords, "preserve_rng_state": True})
            n += 1
    return n


@contextlib.contextmanager
def seeded_rng(key: tuple, device):
    """The torch random state seeded from ``key`` (a hash of it) for the block, the caller's own state restored after."""
    seed = int.from_bytes(hashlib.sha256(repr(key).encode()).digest()[:8], "little") >> 1
    devices = [device] if torch.device(device).type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield
