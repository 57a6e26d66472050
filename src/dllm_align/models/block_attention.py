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
what it scores alone. Packed rows (``docs`` [B, T]: the sequence of each column) hold several
sequences, each stream of the row holding all of them at the same columns; no query sees another
sequence's keys, so each sequence scores what it scores alone.

The function is registered with transformers as the attention implementation ``dllm_block_sdpa``:
called without the ``dllm_streams`` argument (generation, ordinary forwards) it is transformers' own
SDPA attention, so a block family loads once, with this implementation, and every forward of it is
right (an activation-checkpointing recompute included, which re-runs the layer with the same arguments).
Two more carry the same streams layout to other kernels (``model.attn_implementation``):

* ``dllm_block_eager`` (``eager``): the whole (K+1)T row under one dense additive mask, transformers'
  eager attention (the reference the others are checked against; scores grow as ((K+1)T)^2);
* ``dllm_block_flex`` (``flex_attention``): torch's FlexAttention over the whole row with a BlockMask
  of the three-part rule (:func:`streams_mask_mod`), so that only the (query block, key block) pairs
  the rule allows are computed: a noisy block meets its own block and the earlier clean blocks, never
  another stream; ordinary forwards (generation) run SDPA. Trains on CUDA (torch has no FlexAttention
  backward on the CPU). The kernel and the BlockMask's construction are compiled (``torch.compile``; on the
  query's device, at FlexAttention's 128-token tile granularity): uncompiled, both materialise the whole
  (K+1)T square, and they are refused by name where it does not fit (:mod:`dllm_align.models.attention_memory`).

The noisy streams' SDPA call is 4-D, the draws folded into the heads: CUDA's fused kernels take 4-D inputs only.
"""

from __future__ import annotations

import importlib.util
import shutil
from dataclasses import dataclass
from functools import cached_property
from typing import Optional

import psutil
import torch

from dllm_align.core.errors import UserError
from dllm_align.models.attention_memory import flex_refusal

# lazy imports: transformers: it takes longer to import than torch, and the family records reach this module
# without a model
# lazy imports: torch.nn.attention: FlexAttention is in torch from 2.5 on (pyproject allows 2.4); only the flex
# variant needs it

STREAMS_ATTENTION = "dllm_block_sdpa"
STREAMS_EAGER = "dllm_block_eager"
STREAMS_FLEX = "dllm_block_flex"
# model.attn_implementation -> the streams variant a block family is loaded with
VARIANTS = {None: STREAMS_ATTENTION, "sdpa": STREAMS_ATTENTION, "eager": STREAMS_EAGER, "flex_attention": STREAMS_FLEX}


@dataclass(frozen=True)
class Streams:
    """How a row of (draws+1) * length tokens is laid out: ``draws`` noisy streams, then the clean one."""

    draws: int
    length: int
    blocks: torch.Tensor  # [B, length] block index of each column
    valid: Optional[torch.Tensor] = None  # [B, length] True for real tokens (None: all)
    docs: Optional[torch.Tensor] = None  # [B, length] the sequence of each column in packed rows (None: one)

    @cached_property
    def masks(self) -> tuple[torch.Tensor, torch.Tensor]:
        """:func:`streams_masks`, built once per forward (every layer reads the same two masks)."""
        return streams_masks(self)


def streams_masks(s: Streams) -> tuple[torch.Tensor, torch.Tensor]:
    """Boolean masks (True: may attend): noisy queries [B, 1, 1, T, 2T] over (own stream, clean stream)
    keys, and clean queries [B, 1, T, T]."""
    bq = s.blocks[:, :, None]
    bk = s.blocks[:, None, :]
    valid = s.valid if s.valid is not None else torch.ones_like(s.blocks, dtype=torch.bool)
    vk = valid[:, None, :]
    if s.docs is not None:  # packed rows: never across sequences
        vk = vk & (s.docs[:, :, None] == s.docs[:, None, :])
    # a query that is not a real token (padding, a packed row's tail) sees itself, so that no row of the
    # softmax is empty; its output is never read
    alone = ~valid[:, :, None] & torch.eye(s.length, dtype=torch.bool, device=s.blocks.device)
    own = (bq == bk) & vk | alone
    earlier_clean = (bk < bq) & vk
    clean = (bk <= bq) & vk | alone
    noisy = torch.cat([own, earlier_clean], dim=-1)
    return noisy[:, None, None], clean[:, None]


def dense_streams_mask(s: Streams) -> torch.Tensor:
    """The whole row's boolean mask [B, 1, N, N], N = (draws+1) * length (the eager variant's)."""
    k, t = s.draws, s.length
    noisy, clean = s.masks
    b = s.blocks.shape[0]
    full = torch.zeros(b, (k + 1) * t, (k + 1) * t, dtype=torch.bool, device=s.blocks.device)
    for j in range(k):
        rows = slice(j * t, (j + 1) * t)
        full[:, rows, rows] = noisy[:, 0, 0, :, :t]
        full[:, rows, k * t:] = noisy[:, 0, 0, :, t:]
    full[:, k * t:, k * t:] = clean[:, 0]
    return full[:, None]


def streams_mask_mod(s: Streams, device=None):
    """The three-part rule as a FlexAttention ``mask_mod`` over the whole (K+1)T row (its tensors on ``device``)."""
    k, t = s.draws, s.length
    blocks = s.blocks.to(device) if device is not None else s.blocks
    valid = s.valid.to(blocks.device) if s.valid is not None else torch.ones_like(blocks, dtype=torch.bool)
    docs = s.docs.to(blocks.device) if s.docs is not None else torch.zeros_like(blocks)

    def mask_mod(b, h, q_idx, kv_idx):
        sq, sk = q_idx // t, kv_idx // t
        pq, pk = q_idx % t, kv_idx % t
        bq, bk = blocks[b, pq], blocks[b, pk]
        clean_q, clean_k = sq == k, sk == k
        own = (sq == sk) & ~clean_q & (bq == bk)
        to_clean = ~clean_q & clean_k & (bk < bq)
        clean_causal = clean_q & clean_k & (bk <= bq)
        same = (docs[b, pq] == docs[b, pk]) & valid[b, pk]
        alone = ~valid[b, pq] & (q_idx == kv_idx)
        return ((own | to_clean | clean_causal) & same) | alone

    return mask_mod


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
    noisy_mask, clean_mask = (m.to(query.device) for m in s.masks)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    clean = sdpa(query[:, :, n:], key[:, :, n:], value[:, :, n:], attn_mask=clean_mask, scale=scaling)
    # The noisy streams go through one 4-D call with the draws folded into the head dimension ([B, H*K, T, D]
    # queries over [B, H*K, 2T, D] keys): CUDA's fused kernels (memory-efficient, cuDNN, flash) take 4-D
    # inputs only, and a 5-D call falls back to the math kernel, which materialises every score. The mask
    # [B, 1, T, 2T] is shared by every head and draw of a row, so it broadcasts with no copy.
    kc = key[:, :, n:].unsqueeze(2).expand(-1, -1, k, -1, -1)
    vc = value[:, :, n:].unsqueeze(2).expand(-1, -1, k, -1, -1)
    kn = torch.cat([key[:, :, :n].reshape(b, h, k, t, d), kc], dim=3).reshape(b, h * k, 2 * t, d)
    vn = torch.cat([value[:, :, :n].reshape(b, h, k, t, d), vc], dim=3).reshape(b, h * k, 2 * t, d)
    qn = query[:, :, :n].reshape(b, h * k, t, d)
    noisy = sdpa(qn, kn, vn, attn_mask=noisy_mask[:, :, 0], scale=scaling)
    out = torch.cat([noisy.reshape(b, h, n, d), clean], dim=2)
    return out.transpose(1, 2).contiguous(), None


def streams_attention_eager(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                            dllm_streams: Optional[Streams] = None, **kwargs):
    """The streams layout under one dense additive mask (:func:`dense_streams_mask`), transformers' eager
    attention; plain eager attention without ``dllm_streams``."""
    from transformers.models.llama.modeling_llama import eager_attention_forward

    if dllm_streams is not None:
        allowed = dense_streams_mask(dllm_streams).to(query.device)
        attention_mask = torch.zeros(allowed.shape, dtype=query.dtype, device=query.device).masked_fill_(
            ~allowed, torch.finfo(query.dtype).min)
    return eager_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)


_COMPILED: dict = {}


def flex_compiles(device) -> bool:
    """Whether ``torch.compile`` can build FlexAttention's fused kernels on ``device``: Triton on CUDA, a C++
    compiler on the CPU (inductor's code generators)."""
    kind = torch.device(device).type
    if kind == "cuda":
        return importlib.util.find_spec("triton") is not None
    if kind == "cpu":
        return any(shutil.which(c) for c in ("g++", "c++", "clang++"))
    return False


def _compiled(name: str, device):
    """``torch.compile`` of FlexAttention's entry points, made once per process and device type (every layer and
    forward shares the compiled graphs). On CUDA, shapes that change between batches get one dynamic recompile,
    torch's default. On the CPU each shape is compiled on its own (``dynamic=False``): torch 2.13's C++ code
    generation for FlexAttention with symbolic sizes emitted code that does not compile (an undeclared
    ``cur_qSplitSize`` variable) once a second shape arrived in one process."""
    kind = torch.device(device).type
    key = (name, kind)
    if key not in _COMPILED:
        from torch.nn.attention import flex_attention as fa

        _COMPILED[key] = torch.compile(getattr(fa, name), dynamic=None if kind == "cuda" else False)
    return _COMPILED[key]


def _refuse_uncompiled(rows: int, heads: int, n: int, device) -> None:
    dev = torch.device(device)
    if dev.type == "cuda":
        available = torch.cuda.mem_get_info(dev)[0]
    else:
        available = psutil.virtual_memory().available
    why = flex_refusal(rows, heads, n, available)
    if why:
        raise UserError(why)


def _flex_block_mask(s: Streams, n: int, device, heads: int):
    """The BlockMask of the three-part rule at FlexAttention's tile granularity, built on ``device``: compiled
    (tile by tile, never the whole square) where torch.compile works; uncompiled only where its [rows, n, n]
    evaluation fits (else refused by name)."""
    from torch.nn.attention.flex_attention import create_block_mask

    cache = s.__dict__.setdefault("_flex", {})
    if device not in cache:  # one BlockMask per forward (every layer reads it)
        rows = s.blocks.shape[0]
        if flex_compiles(device):
            make = _compiled("create_block_mask", device)
        else:
            _refuse_uncompiled(rows, heads, n, device)
            make = create_block_mask
        cache[device] = make(streams_mask_mod(s, device), rows, None, n, n, device=device)
    return cache[device]


def streams_attention_flex(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                           dllm_streams: Optional[Streams] = None, **kwargs):
    """The streams layout with torch's FlexAttention and a BlockMask of the three-part rule; SDPA without
    ``dllm_streams`` (generation's short block-causal forwards gain nothing from a compiled kernel).
    Compiled wherever torch.compile works (uncompiled, FlexAttention materialises the whole score matrix:
    about 87 GB per layer for SDAR-1.7B at 8 draws x 4,096 tokens); uncompiled only at sizes that fit."""
    if dllm_streams is None:
        return streams_attention(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    from torch.nn.attention.flex_attention import flex_attention

    b, h, n, _ = query.shape
    block_mask = _flex_block_mask(dllm_streams, n, query.device, h)
    if flex_compiles(query.device):
        attend = _compiled("flex_attention", query.device)
    else:
        _refuse_uncompiled(b, h, n, query.device)
        attend = flex_attention
    groups = query.shape[1] // key.shape[1]
    out = attend(query, key, value, block_mask=block_mask, scale=scaling, enable_gqa=groups > 1)
    return out.transpose(1, 2).contiguous(), None


def register() -> None:
    """Make the streams variants known to transformers (attention, and mask creation: each kernel's own)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask, sdpa_mask

    for name, fn, masks in ((STREAMS_ATTENTION, streams_attention, sdpa_mask),
                            (STREAMS_EAGER, streams_attention_eager, eager_mask),
                            (STREAMS_FLEX, streams_attention_flex, sdpa_mask)):
        AttentionInterface.register(name, fn)
        ALL_MASK_ATTENTION_FUNCTIONS.register(name, masks)


def use_streams_attention(model, impl: Optional[str] = None) -> None:
    """Switch a loaded block-diffusion model to the streams variant of ``impl`` (sdpa, eager or
    flex_attention; :data:`VARIANTS`), which is the plain kernel everywhere else."""
    register()
    model.set_attn_implementation(VARIANTS[impl])


def uses_streams_attention(model) -> bool:
    cfg = getattr(model, "config", None)
    return getattr(cfg, "_attn_implementation", None) in (STREAMS_ATTENTION, STREAMS_EAGER, STREAMS_FLEX)
