"""Masked-diffusion SFT: the negative ELBO per completion token."""

from __future__ import annotations

from typing import Optional

import torch

from dllm_align.objective.base import LossTerms


def sft_loss(policy_elbo: torch.Tensor, completion_len: torch.Tensor, *, normalizer: Optional[float] = None) -> LossTerms:
    """Masked-diffusion SFT: the negative ELBO per completion token, averaged over rows.

    loss = -(1/m) sum_i B_hat(y_i | x_i) / L_i  (LLaDA's SFT normalises by answer length).
    """
    per = -policy_elbo / completion_len.to(policy_elbo.dtype).clamp_min(1)
    m = float(normalizer if normalizer is not None else per.numel())
    with torch.no_grad():
        metrics = {"loss_sum": float(per.sum()), "n": int(per.numel())}
    return LossTerms(per.sum() / m, metrics)
