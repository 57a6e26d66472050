"""Block diffusion (LLaDA2.x, SDAR, BD3-LM): the training attention masks and the block ELBO.

Facts this module follows (from the published training code, dllm's ``core/trainers/bd3lm.py`` and the
serving tables that pair ``LLaDA2MoeModelLM`` with block 32 / mask 156895 and ``SDARForCausalLM`` with
block 4 / mask 151669):

* Blocks are counted from the start of the sequence: position ``p`` belongs to block ``p // b`` (the
  published collator pads each example with EOS to a multiple of ``b``; prompt blocks are clean context).
* The training forward feeds ``[x_t ; x_0]`` (length 2L, both halves at positions 0..L-1) under a
  three-part mask: block-diagonal inside ``x_t``; ``x_t`` block k sees ``x_0`` blocks < k; ``x_0`` is
  block-causal (block k sees blocks <= k). Only the ``x_t`` half is scored.
* One ``t ~ U(0, 1)`` per draw; each maskable (completion) token is masked independently with
  probability ``t``; a masked token's log-probability is weighted ``1/t`` (the linear schedule's
  ``-alpha'(t) / (1 - alpha(t))``).

The shared clean stream: ``x_0``'s hidden states depend on the example only, never on the noise draw,
because no ``x_0`` query ever attends to an ``x_t`` key. So K draws can be laid out as one sequence
``[x_t^1 ; ... ; x_t^K ; x_0]`` of length (K+1)L in which every noisy stream attends to its own block and
to the one shared clean stream, never to another noisy stream. Every ``x_t^k`` row then sees exactly the
keys and values it sees in the 2L form, so values and gradients are equal (tests/test_block_diffusion.py),
at (K+1)L tokens of body instead of 2KL.
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch


def block_of(positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """The block index of each absolute position (blocks counted from the sequence start)."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    return torch.div(positions, block_size, rounding_mode="floor")


def streams_mask(length: int, block_size: int, draws: int = 1, bidirectional: bool = False) -> torch.Tensor:
    """Boolean attention mask [(draws+1)L, (draws+1)L] (True: may attend) over ``[x_t^1; ...; x_t^K; x_0]``.

    ``draws=1`` is the published 2L mask. ``bidirectional=True`` is the deliberately wrong mask (every
    query sees every key of its own noisy stream and all of ``x_0``), kept for the tests that show the
    right mask matters.
    """
    n = draws + 1
    pos = torch.arange(length)
    blk = block_of(pos, block_size)
    stream = torch.arange(n).repeat_interleave(length)  # 0..K-1 noisy, K clean
    bq = blk.repeat(n)[:, None]
    bk = blk.repeat(n)[None, :]
    sq, sk = stream[:, None], stream[None, :]
    clean_q, clean_k = sq == draws, sk == draws
    if bidirectional:
        return (sq == sk) | clean_k
    own_block = (sq == sk) & ~clean_q & (bq == bk)
    to_clean = ~clean_q & clean_k & (bk < bq)
    clean_causal = clean_q & clean_k & (bk <= bq)
    return own_block | to_clean | clean_causal


def additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask as the additive float mask attention implementations take ([1, 1, Q, K])."""
    out = torch.zeros(mask.shape, dtype=dtype)
    out.masked_fill_(~mask, torch.finfo(dtype).min)
    return out[None, None]


TIME_EPSILON = 1e-3  # the published floor on t (dllm's ``time_epsilon``; SDAR's ``eps``)


def draw_t(n: int, generator: Optional[torch.Generator] = None, eps: float = TIME_EPSILON) -> torch.Tensor:
    """One masking rate per draw, as published: t = eps + (1 - eps) U, U ~ U(0, 1)."""
    return eps + (1 - eps) * torch.rand(n, generator=generator)


def noise(x0: torch.Tensor, maskable: torch.Tensor, t: torch.Tensor, mask_id: int,
          generator: Optional[torch.Generator] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One draw per row: ``t`` [B], each maskable token masked with probability t. Returns (x_t, masked)."""
    u = torch.rand(x0.shape, generator=generator, device=x0.device)
    masked = (u < t[:, None]) & maskable
    return torch.where(masked, torch.full_like(x0, mask_id), x0), masked


Forward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def hf_forward(model) -> Forward:
    """A transformers causal-LM body as ``(ids [B, T], positions [B, T], bool mask [T, T]) -> logits [B, T, V]``."""

    def run(ids, positions, mask):
        dtype = next(model.parameters()).dtype
        att = additive(mask, dtype).to(ids.device).expand(ids.shape[0], 1, -1, -1)
        return model(input_ids=ids, position_ids=positions, attention_mask=att, use_cache=False).logits

    return run


STREAMS_ATTENTION = "dllm_block_streams"


def _repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def streams_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, dllm_streams=None, **_):
    """Attention over ``[x_t^1; ...; x_t^K; x_0]`` computed stream by stream (what a block-sparse kernel does).

    Each noisy stream's queries meet only their own L keys and the clean stream's L keys (2L), the clean
    stream's queries only its own L: K*2L^2 + L^2 scores instead of ((K+1)L)^2 under a dense mask. The
    masks are the same three parts as :func:`streams_mask`. ``query`` [B, H, T, D]; returns [B, T, H, D].
    """
    draws, length, block_size = dllm_streams
    groups = query.shape[1] // key.shape[1]
    key, value = _repeat_kv(key, groups), _repeat_kv(value, groups)
    b, h, _, d = query.shape
    two = streams_mask(length, block_size, 1).to(query.device)
    n = draws * length
    clean = torch.nn.functional.scaled_dot_product_attention(
        query[:, :, n:], key[:, :, n:], value[:, :, n:], attn_mask=two[length:, length:], scale=scaling)
    kc = key[:, :, n:].unsqueeze(2).expand(-1, -1, draws, -1, -1)
    vc = value[:, :, n:].unsqueeze(2).expand(-1, -1, draws, -1, -1)
    kn = torch.cat([key[:, :, :n].view(b, h, draws, length, d), kc], dim=3)
    vn = torch.cat([value[:, :, :n].view(b, h, draws, length, d), vc], dim=3)
    noisy = torch.nn.functional.scaled_dot_product_attention(
        query[:, :, :n].view(b, h, draws, length, d), kn, vn, attn_mask=two[:length], scale=scaling)
    out = torch.cat([noisy.reshape(b, h, n, d), clean], dim=2)
    return out.transpose(1, 2).contiguous(), None


def _register_streams_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(STREAMS_ATTENTION, streams_attention)


def hf_streams_forward(model, draws: int, length: int, block_size: int) -> Forward:
    """A transformers body run with :func:`streams_attention` for a (K+1)L streams layout (mask argument ignored)."""
    _register_streams_attention()

    def run(ids, positions, mask):
        previous = model.config._attn_implementation
        model.config._attn_implementation = STREAMS_ATTENTION
        try:
            return model(input_ids=ids, position_ids=positions, use_cache=False,
                         dllm_streams=(draws, length, block_size)).logits
        finally:
            model.config._attn_implementation = previous

    return run


def draw_terms_2l(forward: Forward, x0: torch.Tensor, xt: torch.Tensor, masked: torch.Tensor,
                  t: torch.Tensor, block_size: int, bidirectional: bool = False) -> torch.Tensor:
    """Per-draw weighted terms sum_i masked_i * log p(x0_i | x_t, x_0<block) / t via the published 2L form.

    ``x0`` [L] (one example), ``xt``/``masked`` [K, L], ``t`` [K]: K rows of length 2L.
    """
    k, length = xt.shape
    ids = torch.cat([xt, x0[None].expand(k, -1)], dim=1)
    pos = torch.arange(length, device=x0.device).repeat(2)[None].expand(k, -1)
    logits = forward(ids, pos, streams_mask(length, block_size, 1, bidirectional))[:, :length]
    logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, x0[None, :, None].expand(k, -1, 1))[..., 0]
    return (logp * masked).sum(-1) / t


def draw_terms_shared(forward: Forward, x0: torch.Tensor, xt: torch.Tensor, masked: torch.Tensor,
                      t: torch.Tensor, block_size: int) -> torch.Tensor:
    """The same K terms from one sequence ``[x_t^1; ...; x_t^K; x_0]`` of (K+1)L tokens (the clean stream once)."""
    k, length = xt.shape
    ids = torch.cat([xt.reshape(-1), x0])[None]
    pos = torch.arange(length, device=x0.device).repeat(k + 1)[None]
    logits = forward(ids, pos, streams_mask(length, block_size, k))[0, : k * length].view(k, length, -1)
    logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, x0[None, :, None].expand(k, -1, 1))[..., 0]
    return (logp * masked).sum(-1) / t


def mask_weight(n: int, n_tok: int, eps: float = 0.0) -> float:
    """E_t[t^n (1-t)^(N-n) / t] for t uniform on [eps, 1): the weight of one mask hiding n of N tokens.

    With eps = 0 this is the Beta function B(n, N-n+1) = (n-1)! (N-n)! / N!; otherwise expand (1-t)^(N-n)
    and integrate term by term.
    """
    m = n_tok - n
    total = sum(math.comb(m, j) * (-1) ** j * (1 - eps ** (n + j)) / (n + j) for j in range(m + 1))
    return total / (1 - eps)


def exact_block_elbo(forward: Forward, x0: torch.Tensor, maskable: torch.Tensor, mask_id: int,
                     block_size: int, bidirectional: bool = False, eps: float = 0.0) -> float:
    """E_t E_mask[sum_masked log p / t] by enumerating every mask of the maskable tokens (small N only).

    A mask with n of the N maskable tokens has probability t^n (1-t)^(N-n); integrated against the 1/t
    weight over t ~ U[eps, 1) this is :func:`mask_weight`.
    """
    idx = maskable.nonzero().flatten().tolist()
    n_tok = len(idx)
    if n_tok > 16:
        raise ValueError("exact enumeration is for at most 16 maskable tokens")
    total = 0.0
    for bits in range(1, 1 << n_tok):
        chosen = [idx[j] for j in range(n_tok) if bits >> j & 1]
        m = torch.zeros_like(maskable)
        m[chosen] = True
        xt = torch.where(m, torch.full_like(x0, mask_id), x0)
        n = len(chosen)
        weight = mask_weight(n, n_tok, eps)
        term = draw_terms_2l(forward, x0, xt[None], m[None], torch.ones(1), block_size, bidirectional)
        total += weight * float(term[0])
    return total
