"""The attention of block-diffusion training: K noisy streams and one shared clean stream.

A block-diffusion family (LLaDA2.x, SDAR) scores a noisy copy ``x_t`` of a sequence given its own
noisy block and the *clean* earlier blocks. The published training forward feeds ``[x_t ; x_0]`` (2L
tokens) under a three-part mask (``dllm_align.objective.block``). Since no clean query ever attends to
a noisy key, the clean stream's hidden states do not depend on the noise draw: K draws are laid out as
one row ``[x_t^1; ...; x_t^K; x_0]`` of (K+1)T tokens, and :func:`streams_attention` computes, stream
by stream,

* noisy stream k, query in block q: keys of its own stream in block q, and clean keys in blocks < q;
* the clean stream, query in block q: clean keys in blocks <= q;

never a key of another noisy stream. Every noisy query therefore sees exactly the keys and values it
sees in the 2L form, so the values and the gradients (through the shared clean stream, summed over the
draws) are those of K separate 2L rows, at (K+1)T tokens of body instead of 2KT.

Blocks are counted from each sequence's first real token (``blocks`` [B, T]: the block index of every
column); ``valid`` [B, T] marks real tokens, and padding is never a key, so a padded row scores exactly
what it scores alone.

The function is registered with transformers as the attention implementation ``dllm_block_sdpa``:
called without the ``dllm_streams`` argument (generation, ordinary forwards) it is transformers' own
SDPA attention, so a block family loads once, with this implementation, and every forward of it is
right (an activation-checkpointing recompute included, which re-runs the layer with the same arguments).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

STREAMS_ATTENTION = "dllm_block_sdpa"


@dataclass(frozen=True)
class Streams:
    """How a row of (draws+1) * length tokens is laid out: ``draws`` noisy streams, then the clean one."""

    draws: int
    length: int
    blocks: torch.Tensor  # [B, length] block index of each column
    valid: Optional[torch.Tensor] = None  # [B, length] True for real tokens (None: all)


def streams_masks(s: Streams) -> tuple[torch.Tensor, torch.Tensor]:
    """Boolean masks (True: may attend): noisy queries [B, 1, 1, T, 2T] over (own stream, clean stream)
    keys, and clean queries [B, 1, T, T]."""
    bq = s.blocks[:, :, None]
    bk = s.blocks[:, None, :]
    valid = s.valid if s.valid is not None else torch.ones_like(s.blocks, dtype=torch.bool)
    vk = valid[:, None, :]
    own = (bq == bk) & vk
    earlier_clean = (bk < bq) & vk
    clean = (bk <= bq) & vk
    noisy = torch.cat([own, earlier_clean], dim=-1)
    return noisy[:, None, None], clean[:, None]


def _repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def streams_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                      dllm_streams: Optional[Streams] = None, **kwargs):
    """Attention over ``[x_t^1; ...; x_t^K; x_0]`` stream by stream (module docstring); plain SDPA without
    ``dllm_streams``. ``query`` [B, H, N, D], ``key``/``value`` [B, H_kv, N, D]; returns [B, N, H, D]."""
    if dllm_streams is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    s = dllm_streams
    groups = query.shape[1] // key.shape[1]
    key, value = _repeat_kv(key, groups), _repeat_kv(value, groups)
    b, h, _, d = query.shape
    k, t = s.draws, s.length
    n = k * t
    noisy_mask, clean_mask = streams_masks(s)
    noisy_mask, clean_mask = noisy_mask.to(query.device), clean_mask.to(query.device)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    clean = sdpa(query[:, :, n:], key[:, :, n:], value[:, :, n:], attn_mask=clean_mask, scale=scaling)
    kc = key[:, :, n:].unsqueeze(2).expand(-1, -1, k, -1, -1)
    vc = value[:, :, n:].unsqueeze(2).expand(-1, -1, k, -1, -1)
    kn = torch.cat([key[:, :, :n].reshape(b, h, k, t, d), kc], dim=3)
    vn = torch.cat([value[:, :, :n].reshape(b, h, k, t, d), vc], dim=3)
    noisy = sdpa(query[:, :, :n].reshape(b, h, k, t, d), kn, vn, attn_mask=noisy_mask, scale=scaling)
    out = torch.cat([noisy.reshape(b, h, n, d), clean], dim=2)
    return out.transpose(1, 2).contiguous(), None


def register() -> None:
    """Make ``dllm_block_sdpa`` known to transformers (attention and mask creation: SDPA's masks)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(STREAMS_ATTENTION, streams_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(STREAMS_ATTENTION, sdpa_mask)


def use_streams_attention(model) -> None:
    """Switch a loaded block-diffusion model to :func:`streams_attention` (SDPA everywhere else)."""
    register()
    model.set_attn_implementation(STREAMS_ATTENTION)


def uses_streams_attention(model) -> bool:
    cfg = getattr(model, "config", None)
    return getattr(cfg, "_attn_implementation", None) == STREAMS_ATTENTION
