"""The policy as the distributed wrappers see it: a module whose forward scores the ELBO's positions.
"""

from __future__ import annotations

import torch

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

    def __init__(self, module, mask_token_id: int, block_size=None):
        self.module = module
        self.mask_token_id = mask_token_id
        self.block_size = block_size

    def target_logprobs(self, input_ids, attention_mask, rows, cols, targets, packed=None, streams=None):
        return self.module(input_ids, attention_mask, rows, cols, targets, packed, streams)
