"""Masked-diffusion SFT: the negative ELBO per completion token; no reference."""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from dllm_align.core.errors import UserError
from dllm_align.objective.base import LossTerms, Objective


def sft_loss(policy_elbo: torch.Tensor, completion_len: torch.Tensor, *, normalizer: Optional[float] = None) -> LossTerms:
    """Masked-diffusion SFT: the negative ELBO per completion token, averaged over rows.

    loss = -(1/m) sum_i B_hat(y_i | x_i) / L_i  (LLaDA's SFT normalises by answer length).
    """
    per = -policy_elbo / completion_len.to(policy_elbo.dtype).clamp_min(1)
    m = float(normalizer if normalizer is not None else per.numel())
    with torch.no_grad():
        metrics = {"loss_sum": float(per.sum()), "n": int(per.numel())}
    return LossTerms(per.sum() / m, metrics)


class Sft(Objective):
    """SFT on every row, or on the desirable rows only (``train.sft_rows``)."""

    name = "sft"
    needs_reference = False

    def make_units(self, examples: Sequence) -> list[tuple]:
        keep = [ex for ex in examples if self.t.sft_rows == "all" or ex.label]
        if not keep:
            raise UserError("objective sft with train.sft_rows 'desirable': there are no desirable rows")
        return [(ex,) for ex in keep]

    def loss(self, policy, reference, batch, step):
        return sft_loss(policy, batch["completion_len"], normalizer=step.normalizer)
