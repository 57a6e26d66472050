"""Block diffusion (LLaDA2.x, SDAR, BD3-LM): the training attention masks, the block ELBO and its likelihood
component (``"block"``, :class:`BlockDiffusion`).

Facts this module follows (from the published block-ELBO trainers, SDAR's LlamaFactory fork and dllm's
``core/trainers/bd3lm.py``, which trains models converted from autoregressive ones and ships no SDAR or
LLaDA2.0 training; and from the serving tables that pair ``LLaDA2MoeModelLM`` with block 32 / mask 156895
and ``SDARForCausalLM`` with block 4 / mask 151669; docs/block_diffusion.md):

* Blocks are counted from the start of each sequence: position ``p`` belongs to block ``p // b``. Both
  trainers fill each sample to a whole number of blocks (SDAR with its pad token, dllm with EOS) and score
  the filler; ``data.block_scoring: published`` tokenises rows that way
  (:class:`dllm_align.data.tokenize.BlockLayout`). Under left padding the positions, and so the blocks,
  start at each row's first real token; packed rows restart them with each sequence. Prompt blocks are
  clean context.
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

from dllm_align.data.batching import pack_rows
from dllm_align.models import attention_memory as am
from dllm_align.models.block_attention import Streams, use_streams_attention
from dllm_align.models.predictor import MaskPredictor, packed_positions
from dllm_align.objective.draws import AbsorbingMask, make_noisy_batch
from dllm_align.objective.likelihood import Footprint


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


def hf_streams_forward(model, draws: int, length: int, block_size: int) -> Forward:
    """A transformers body run with the streams attention (``dllm_align.models.block_attention``) for a
    (K+1)L streams layout of unpadded rows (the mask argument is ignored). The model is switched to that
    attention for good: it is plain SDPA whenever no streams layout is passed."""
    use_streams_attention(model)

    def run(ids, positions, mask):
        blocks = block_of(torch.arange(length, device=ids.device), block_size).expand(ids.shape[0], -1)
        return model(input_ids=ids, position_ids=positions, use_cache=False,
                     dllm_streams=Streams(draws, length, blocks)).logits

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


# --------------------------------------------------------------------------- the block ELBO of the commands
def block_draw_sums(mp, nb, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor], block_size: int,
                    max_rows_per_forward: Optional[int] = None, pack_length: Optional[int] = None,
                    score: Optional[Callable] = None) -> torch.Tensor:
    """Per-draw sums of log p at the masked positions [B*K], for a block-diffusion family.

    ``nb`` is :func:`dllm_align.objective.draws.make_noisy_batch`'s noisy batch (row b*K + j: draw j of row
    b). Each forward call takes a group of rows, each laid out as ``[x_t^{j1}; ...; x_t^{jc}; x_0]`` (c
    draws and the clean stream, (c+1)T tokens) and run with the streams attention
    (``dllm_align.models.block_attention``): the value of every draw is what the published 2L form gives,
    the clean stream once per row and call. Blocks are counted from each row's first real token;
    padding is never attended to. ``max_rows_per_forward`` bounds the tokens of one call to about that
    many rows of T (at least one row with one draw).

    ``pack_length`` (``data.padding: packed``, right-padded rows with an attention mask): the sequences are
    packed into rows of at most that many tokens first (``data.batching.pack_rows``), every stream of a
    packed row holding the same sequences at the same columns, and no sequence sees another
    (``Streams.docs``): the values of the padded layout, without the compute on padding.

    ``score(ids, rows, cols, sel, streams) -> [n]``: what each scored position adds (unpacked rows only; ``sel``
    picks the positions of ``nb`` the call scores); default log p of its target (``MaskPredictor.target_logprobs``).
    The sums take its dtype.
    """
    if pack_length is not None and attention_mask is not None:
        return _packed_block_draw_sums(mp, nb, input_ids, attention_mask, block_size, max_rows_per_forward, pack_length)

    B, K = nb.B, nb.K
    T = input_ids.shape[1]
    dev = nb.input_ids.device
    pos = MaskPredictor.position_ids(attention_mask, input_ids.shape, input_ids.device)
    blocks = block_of(pos, block_size).to(dev)
    valid = None if attention_mask is None else attention_mask.bool().to(dev)
    rows_per_call, draws_per_call = _calls(B, K, max_rows_per_forward)
    row_of = torch.div(nb.rows, K, rounding_mode="floor")
    draw_of = nb.rows - row_of * K
    if score is None:
        def score(ids, r, c, sel, streams):
            return mp.target_logprobs(ids, None, r, c, nb.targets[sel], streams=streams)
    parts = []
    for r0 in range(0, B, rows_per_call):
        r1 = min(r0 + rows_per_call, B)
        for j0 in range(0, K, draws_per_call):
            j1 = min(j0 + draws_per_call, K)
            c = j1 - j0
            noisy = nb.input_ids.view(B, K, T)[r0:r1, j0:j1].reshape(r1 - r0, c * T)
            ids = torch.cat([noisy, input_ids[r0:r1].to(dev)], dim=1)  # [rows, (c+1)T]
            sel = (row_of >= r0) & (row_of < r1) & (draw_of >= j0) & (draw_of < j1)
            rr, jj = row_of[sel], draw_of[sel]
            cc = (jj - j0) * T + nb.cols[sel]
            streams = Streams(c, T, blocks[r0:r1], None if valid is None else valid[r0:r1])
            lp = score(ids, rr - r0, cc, sel, streams)
            parts.append(torch.zeros(B * K, dtype=lp.dtype, device=lp.device).index_add(0, rr * K + jj, lp))
    return torch.stack(parts).sum(0)  # each draw's sum comes from one call: the others add exact zeros


def _calls(rows: int, draws: int, max_rows_per_forward: Optional[int]) -> tuple[int, int]:
    """Rows and draws per forward call for a budget of about ``max_rows_per_forward`` rows of T tokens."""
    budget = max_rows_per_forward or rows * (draws + 1)
    per_call = rows if budget >= 2 * rows else max(1, budget // 2)
    return per_call, max(1, min(draws, budget // per_call - 1))


def _packed_block_draw_sums(mp, nb, input_ids, attention_mask, block_size, max_rows_per_forward, pack_length):
    """:func:`block_draw_sums` on packed rows (its docstring)."""
    B, K = nb.B, nb.K
    dev = nb.input_ids.device
    p = pack_rows(input_ids, attention_mask.sum(dim=1).tolist(), pack_length)
    R, P = p.input_ids.shape
    layout = p.layout.to(dev)
    blocks = block_of(packed_positions(layout), block_size)
    row_of, offset = p.row_of.to(dev), p.offset.to(dev)
    seq = torch.div(nb.rows, K, rounding_mode="floor")
    draw = nb.rows - seq * K
    noisy = p.input_ids.to(dev)[:, None, :].repeat(1, K, 1)  # [R, K, P]: draw j of every sequence of the row
    noisy[row_of[seq], draw, offset[seq] + nb.cols] = mp.mask_token_id
    clean = p.input_ids.to(dev)
    rows_per_call, draws_per_call = _calls(R, K, max_rows_per_forward)
    parts = [torch.zeros(B * K, dtype=torch.float32, device=dev)]
    for r0 in range(0, R, rows_per_call):
        r1 = min(r0 + rows_per_call, R)
        for j0 in range(0, K, draws_per_call):
            j1 = min(j0 + draws_per_call, K)
            ids = torch.cat([noisy[r0:r1, j0:j1].reshape(r1 - r0, -1), clean[r0:r1]], dim=1)
            sel = (row_of[seq] >= r0) & (row_of[seq] < r1) & (draw >= j0) & (draw < j1)
            s, j = seq[sel], draw[sel]
            rr = row_of[s] - r0
            cc = (j - j0) * P + offset[s] + nb.cols[sel]
            streams = Streams(j1 - j0, P, blocks[r0:r1], layout[r0:r1] >= 0, layout[r0:r1])
            lp = mp.target_logprobs(ids, None, rr, cc, nb.targets[sel], streams=streams)
            parts.append(torch.zeros(B * K, dtype=torch.float32, device=lp.device).index_add(0, s * K + j, lp))
    return torch.stack(parts).sum(0)


# --------------------------------------------------------------------------- the likelihood component
class BlockDiffusion(AbsorbingMask):
    """Block diffusion, the likelihood component ``"block"``: each draw is scored given its own noisy block and
    the clean earlier blocks, the K draws of a row going through the network as one streams row
    ``[x_t^1; ...; x_t^K; x_0]`` with the clean stream computed once (:func:`block_draw_sums`; packed rows too).
    The block size is the model's (``mp.block_size``: the checkpoint's config, else the family's).

    The masks and weights are the masked-diffusion ones (:func:`dllm_align.objective.draws.draw_masks`): the
    l-estimator's expectation is the block ELBO with t uniform on (0, 1], since a mask hiding n of L tokens
    gets the same total weight, 1 / (n C(L, n)), under both (:func:`mask_weight`).
    """

    name = "block"

    def draw_terms(self, mp, input_ids, attention_mask, completion_mask, ids, cfg, *, max_rows_per_forward=None,
                   draws=None, pack_length=None) -> torch.Tensor:
        share = cfg.settings_of(self.name).replace_share
        if share == 0:
            return super().draw_terms(mp, input_ids, attention_mask, completion_mask, ids, cfg,
                                      max_rows_per_forward=max_rows_per_forward, draws=draws, pack_length=pack_length)
        # the SFT surrogate of LLaDA2.1's corruption (reference.replace_share; the recipe check keeps it to
        # unpacked SFT): replaced tokens are scored with the masked ones, under the draw's weight
        nb = make_noisy_batch(input_ids, attention_mask, completion_mask, ids, cfg, mp.mask_token_id, draws,
                              replace=(share, mp.vocab_size))
        total = self.draw_sums(mp, nb, input_ids, attention_mask, max_rows_per_forward, None)
        return (total.double() * nb.weight).float().view(nb.B, nb.K)

    def draw_sums(self, mp, nb, input_ids, attention_mask, max_rows_per_forward, pack_length) -> torch.Tensor:
        block_size = getattr(mp, "block_size", None)
        if not block_size:
            raise ValueError("the block-diffusion likelihood needs the model's block size (mp.block_size)")
        return block_draw_sums(mp, nb, input_ids, attention_mask, block_size, max_rows_per_forward, pack_length)

    def footprint(self, shape, draws: int, length: int, compute_bytes: int, *, attn: str = "sdpa",
                  packed: bool = False) -> Footprint:
        # Per backend, the attention bytes as the kernel CUDA runs needs them (models.attention_memory). One
        # unit is one row of K noisy streams and the shared clean stream, N = (K + 1) x T tokens; packed rows
        # run under the same streams masks, so no dense packed mask is added.
        k, T, cb = draws, length, compute_bytes
        N = (k + 1) * T
        notes = [f"block diffusion (block {shape.block_size}): {k} noisy streams and one shared clean stream, "
                 f"{k + 1} x {T} tokens of body per row (2 x {k} x {T} without the shared stream)"]
        mask_bytes, mask_line = 0, ""
        if attn == "flex_attention":
            # compiled (torch.compile with Triton on CUDA): a log-sum-exp per query and the BlockMask (made once
            # per forward); uncompiled it is refused where its score matrix does not fit
            att = am.flex_bytes(True, 1, shape.heads, N)
            raw = am.flex_bytes(False, 1, shape.heads, N).total
            line = "block-diffusion FlexAttention, compiled (log-sum-exp, saved for backward)"
            mask_bytes, mask_line = att.transient, "block-diffusion FlexAttention BlockMask"
            notes.append(f"model.attn_implementation: flex_attention counted compiled (torch.compile); without a "
                         f"compiler it needs {raw / 2**30:.1f} GiB per row and layer for its score matrix and is "
                         "refused where that does not fit")
        elif attn == "eager":
            # the whole row under one dense mask: scores and probabilities [heads, N, N] in the compute dtype
            att = am.sdpa_bytes("math", 1, shape.heads, N, N, cb, mask_rows=1)
            line = "block-diffusion eager attention probabilities (saved for backward)"
            mask_bytes, mask_line = att.transient, "block-diffusion eager attention scores and dense mask"
            notes.append("model.attn_implementation: eager materialises the ((K+1) x T)^2 attention scores; use sdpa")
        else:
            # two 4-D SDPA calls a layer (draws folded into the heads); both masked, so CUDA runs the
            # memory-efficient kernel (no score matrix: its bias and a log-sum-exp), and the backward keeps
            # the noisy streams' concatenated keys and values
            kernel = am.sdpa_kernel("cuda", True, cb)
            att = am.streams_sdpa_bytes(kernel, 1, shape.heads, shape.head_dim, k, T, cb)
            line = f"block-diffusion streams attention, SDPA {kernel} kernel (K/V copies, bias; saved for backward)"
            # the streams attention's boolean masks: noisy queries over (own, clean) keys, clean over clean
            mask_bytes, mask_line = 3 * T * T, "block-diffusion stream masks (bool)"
        return Footprint(rows=k + 1, scored_rows=k, attention_saved=att.saved, attention_line=line,
                         mask_bytes=mask_bytes, mask_line=mask_line, notes=tuple(notes))


BLOCK = BlockDiffusion()
