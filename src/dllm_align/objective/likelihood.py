"""The likelihood interface: a noise process and its Monte Carlo ELBO, as one component.

A model family names its likelihood (``Family.likelihood``: ``"masked"`` for whole-sequence absorbing-mask
diffusion, ``"block"`` for block diffusion); :mod:`dllm_align.objective.elbo` holds the registry by name and
gives every caller (the training loop, the reference cache, evaluation) the component of the model at hand,
and the memory model (``training.memory``) asks the same component what to count. Nothing else branches on
the kind of noise. A likelihood answers three questions:

* :meth:`Likelihood.draws`: the noise of the K draws of one example, a pure function of (seed, example id,
  draw index, length), so that policy and reference score the same draws on any device, in any process
  count and after a restart (the reference can then be precomputed);
* :meth:`Likelihood.draw_terms`: the per-draw ELBO terms [B, K] of a batch under one model, differentiable
  through it; policy and reference make the same call and get the same draws;
* :meth:`Likelihood.footprint`: what the K draws of one training unit put through the network, and what
  its attention needs on the chosen backend (:class:`Footprint`), in the memory model's terms.

A new likelihood is one module with a subclass and one line in ``objective.elbo.LIKELIHOODS``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch


@dataclass(frozen=True)
class Footprint:
    """What the K draws of one training unit put through the network body (``training.memory``).

    Counted in rows of the recipe's ``max_length`` tokens: the memory model takes every row at its full length.
    """

    rows: int  # rows one unit's draws put through the body (K; K + 1 with a shared clean stream)
    scored_rows: int  # of those, the rows whose positions the output head scores (a clean context row is not scored)
    # What the attention kernel keeps for the backward beyond the layer's working set (copied keys and values,
    # a mask's bias, a log-sum-exp, or the probabilities of a kernel that materialises them), bytes per unit and
    # layer, with the line of the estimate that shows them (0: none).
    attention_saved: int = 0
    attention_line: str = "attention (saved for backward)"
    # Attention masks one forward row holds (a row carries at most one unit's draws), bytes, and their line:
    # made once per forward, alive through every layer.
    mask_bytes: int = 0
    mask_line: str = "attention masks"
    # Lines of their own, bytes per training unit (name -> bytes): what only this likelihood holds.
    unit_lines: dict = field(default_factory=dict)
    # Lines of bytes per forward row, held once per forward (a dense packed mask, an eager score matrix).
    row_lines: tuple = ()
    notes: tuple = ()  # lines for doctor's notes, when the layout or the kernel needs saying


class Likelihood(ABC):
    """A noise process and its ELBO estimator (the module docstring).

    ``mp`` is a :class:`dllm_align.models.predictor.MaskPredictor` or anything with its scoring methods
    (``target_logprobs``, ``mask_token_id``, ``likelihood``, and what the likelihood itself reads, such as
    ``block_size``). ``cfg`` is a :class:`dllm_align.objective.draws.DrawConfig` (K, seed, estimator).
    """

    name: str = ""
    # Whether the noisy sequences of a forward can be packed into shared rows (``data.padding: packed``);
    # a likelihood that runs each example alone says False and the recipe's default padding becomes ``none``.
    packs: bool = True
    packs_reason: str = ""

    @abstractmethod
    def draws(self, example_id: str, length: int, cfg: Any) -> tuple:
        """The noise of draws 0..K-1 of one example with ``length`` scored tokens, as arrays whose first axis
        is the draw; a pure function of (cfg.seed, example_id, draw index, length)."""

    @abstractmethod
    def draw_terms(
        self,
        mp,
        input_ids: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
        completion_mask: torch.Tensor,
        ids: Sequence[str],
        cfg: Any,
        *,
        max_rows_per_forward: Optional[int] = None,
        draws: Optional[Sequence[int]] = None,
        pack_length: Optional[int] = None,
    ) -> torch.Tensor:
        """Per-draw ELBO terms [B, len(draws) or K] (fp32, differentiable through ``mp``); their mean over
        the draws is the row's ELBO estimate (``objective.elbo.elbo_draws`` says what the arguments mean)."""

    @abstractmethod
    def footprint(self, shape, draws: int, length: int, compute_bytes: int, *, attn: str = "sdpa",
                  packed: bool = False) -> Footprint:
        """What one training unit's ``draws`` draws of ``length`` tokens put through the body of a model of
        ``shape`` (``training.memory.ModelShape``: heads, head_dim, the family's block size, ..., and the
        config.json as read, ``shape.config``, for a size only this likelihood uses);
        ``compute_bytes``: bytes of one activation element in the compute precision; ``attn``: the attention
        implementation (``model.attn_implementation``, ``sdpa`` when unset), its bytes counted as the kernel
        CUDA chooses for it needs them (:mod:`dllm_align.models.attention_memory`); ``packed``: rows packed
        with several examples each."""
