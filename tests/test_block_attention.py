"""The streams attention on the kernels a GPU picks: 4-D calls that the fused SDPA backends accept, and a
FlexAttention path that is compiled (or refused by name) so that it never materialises the score matrix."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from dllm_align.models.block_attention import Streams, dense_streams_mask, streams_attention

FUSED = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]


def _layout(b=2, k=3, t=12, block=4, heads=4, kv_heads=2, d=8, seed=0):
    """Random queries/keys/values for a (K+1)T streams row, GQA, the second row left-padded by 3 and packed."""
    g = torch.Generator().manual_seed(seed)
    n = (k + 1) * t
    q = torch.randn(b, heads, n, d, generator=g, requires_grad=True)
    kk = torch.randn(b, kv_heads, n, d, generator=g, requires_grad=True)
    v = torch.randn(b, kv_heads, n, d, generator=g, requires_grad=True)
    valid = torch.ones(b, t, dtype=torch.bool)
    valid[1, :3] = False
    start = valid.long().argmax(1, keepdim=True)
    blocks = ((torch.arange(t)[None] - start).clamp_min(0) // block)
    docs = torch.zeros(b, t, dtype=torch.long)
    docs[1, 8:] = 1  # the second row holds two sequences
    return q, kk, v, Streams(k, t, blocks, valid, docs)


def _reference(q, kk, v, s):
    """The whole row under the dense mask, math kernel (what the eager variant computes)."""
    groups = q.shape[1] // kk.shape[1]
    kk, v = kk.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    with sdpa_kernel([SDPBackend.MATH]):
        return torch.nn.functional.scaled_dot_product_attention(q, kk, v, attn_mask=dense_streams_mask(s)).transpose(1, 2)


def test_streams_attention_runs_on_the_fused_sdpa_kernels_alone():
    """With SDPA restricted to the fused backends (on this CPU build: flash, which takes 4-D inputs and a boolean
    mask; a 5-D call finds "No available kernel"), the streams attention runs forward and backward and equals the
    dense reference, values and gradients, padded and packed rows included."""
    q, kk, v, s = _layout()
    with sdpa_kernel(FUSED):
        out, _ = streams_attention(None, q, kk, v, None, dllm_streams=s)
        out.square().sum().backward()
    got = [x.grad.clone() for x in (q, kk, v)]
    for x in (q, kk, v):
        x.grad = None
    want = _reference(q, kk, v, s)
    want.square().sum().backward()
    real = torch.cat([s.valid] * (s.draws + 1), dim=1)  # a padding query's output is never read
    assert torch.allclose(out[real], want[real], atol=1e-5), float((out - want)[real].abs().max())
    for a, x in zip(got, (q, kk, v)):
        # padding queries attend to themselves alone in both forms; their gradients flow the same way
        assert torch.allclose(a, x.grad, atol=1e-4), float((a - x.grad).abs().max())


def test_a_five_dimensional_sdpa_call_has_no_fused_kernel_here():
    """Why the layout matters: the check above could fail. The same call with the draws as a fifth dimension
    is refused when only fused kernels are allowed (CUDA then falls back to the math kernel)."""
    q = torch.randn(1, 2, 3, 8, 4)
    k = torch.randn(1, 2, 3, 16, 4)
    mask = torch.ones(1, 1, 1, 8, 16, dtype=torch.bool)
    with sdpa_kernel(FUSED), pytest.raises(RuntimeError):
        torch.nn.functional.scaled_dot_product_attention(q, k, k, attn_mask=mask)
    with sdpa_kernel(FUSED):  # the 4-D form of the same call runs
        torch.nn.functional.scaled_dot_product_attention(q.flatten(1, 2), k.flatten(1, 2), k.flatten(1, 2), attn_mask=mask[:, :, 0])
