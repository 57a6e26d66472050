"""What a run derives from its recipe and launch before anything loads: accumulation, class weights, the device check.
"""

from __future__ import annotations

import torch

from dllm_align.core.errors import UserError

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


def class_weights(recipe) -> tuple[float, float]:
    if recipe.data.weights_file:
        from dllm_align.core.console import info
        from dllm_align.data.imbalance import read_weights_file

        ld, lu = read_weights_file(recipe.data.weights_file)
        info(f"class weights from {recipe.data.weights_file}: lambda_D {ld:g}, lambda_U {lu:g}")
        return ld, lu
    return recipe.train.lambda_desirable, recipe.train.lambda_undesirable
