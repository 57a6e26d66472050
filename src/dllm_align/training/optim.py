"""The optimisation: the learning-rate schedule, AdamW, and gradient clipping by the global norm.

Learning-rate schedule
    Linear warm-up over ``ceil(warmup_ratio x total)`` steps, reaching the peak
    at the last warm-up step (the first step does not waste itself on lr 0),
    then cosine decay towards 0 (or linear / constant).
"""

from __future__ import annotations

import math

import torch


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


def clip_global_grad_norm(params: list, max_norm: float, *, sharded: bool, device) -> float:
    """Clip by the norm of the whole gradient, the same on every rank; returns that norm.

    Under FSDP each rank holds a disjoint shard of every gradient (FSDP1 views
    on the flat shard, FSDP2 DTensor shards): the squared norms are summed over
    the ranks, so every rank gets the true global norm, clips by the same
    factor and sees the same non-finite value (a NaN or inf anywhere reaches
    all ranks through the sum). The per-shard fallback accelerate uses when
    not given every parameter (LoRA: only the adapters train) would clip each rank
    by its own shard's norm, and the ranks would step with different factors. Under DDP and on one process
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
