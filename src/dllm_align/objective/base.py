"""What every objective shares: the loss terms a loss function returns, and the saturation threshold."""

from __future__ import annotations

from dataclasses import dataclass

import torch

SATURATION = 6.0  # |beta * s * (r - b)| beyond this: sigmoid'(.) < 2.5e-3, the row gives ~no gradient


@dataclass
class LossTerms:
    loss: torch.Tensor  # scalar: this chunk's share of the step loss
    metrics: dict[str, float]
