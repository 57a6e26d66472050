"""The streams attention on the kernels a GPU picks: 4-D calls that the fused SDPA backends accept, and a
FlexAttention path that is compiled (or refused by name) so that it never materialises the score matrix."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from dllm_align.models.block_attention import Streams, dense_streams_mask, streams_attention

FUSED = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]


def _layout(b=2, k=3, t=12, block=4, heads=4, kv_heads=2, d=8, seed=0):
    """Random queries/keys/values for a (K+1)T streams row, GQA; a second row is left-padded by 3 and packed."""
    g = torch.Generator().manual_seed(seed)
    n = (k + 1) * t
    q = torch.randn(b, heads, n, d, generator=g, requires_grad=True)
    kk = torch.randn(b, kv_heads, n, d, generator=g, requires_grad=True)
    v = torch.randn(b, kv_heads, n, d, generator=g, requires_grad=True)
    valid = torch.ones(b, t, dtype=torch.bool)
    docs = torch.zeros(b, t, dtype=torch.long)
    if b > 1:
        valid[1, :3] = False
        docs[1, 8:] = 1  # the second row holds two sequences
    start = valid.long().argmax(1, keepdim=True)
    blocks = ((torch.arange(t)[None] - start).clamp_min(0) // block)
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


def _peak_rss_delta(fn) -> int:
    """Bytes the process's resident set grew to above where it stood, while ``fn`` ran (the kernel's peak
    high-water mark, reset first through /proc/self/clear_refs)."""
    def status(key):
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))

    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError as e:
        pytest.skip(f"cannot reset the peak resident set here ({e}): the memory comparison needs Linux's clear_refs")
    base = status("VmRSS")
    fn()
    return status("VmHWM") - base


def _flex_call(s, q, kk, v):
    from dllm_align.models.block_attention import streams_attention_flex

    with torch.no_grad():
        return streams_attention_flex(None, q, kk, v, None, dllm_streams=s)[0]


def test_flex_streams_attention_is_compiled_and_never_holds_the_score_matrix(monkeypatch):
    """At 3 draws x 1,024 tokens (N = 4,096, 2 heads) uncompiled FlexAttention materialises 128 MiB of fp32 scores
    (and create_block_mask a 16 MiB boolean square); the compiled path (kernel and mask construction) stays
    far under that, gives the same values, and doctor's arithmetic bounds what each path holds."""
    from dllm_align.models import block_attention as ba
    from dllm_align.models.attention_memory import flex_block_mask_bytes, flex_bytes

    if not ba.flex_compiles("cpu"):
        pytest.skip("no C++ compiler on this machine: torch.compile cannot build FlexAttention's CPU kernel")
    k, t, heads = 3, 1024, 2
    n = (k + 1) * t

    def layout():  # a fresh Streams each call: its BlockMask is built inside the measured call
        q, kk, v, s = _layout(b=1, k=k, t=t, block=64, heads=heads, kv_heads=heads, d=16)
        return s, q.detach(), kk.detach(), v.detach()

    s, q, kk, v = layout()
    compiled = _flex_call(s, q, kk, v)  # compile first: its own memory is not the kernel's
    s2 = layout()[0]
    mask = ba._flex_block_mask(s2, n, torch.device("cpu"), heads)
    held = sum(x.numel() * x.element_size() for x in (mask.kv_num_blocks, mask.kv_indices, mask.full_kv_num_blocks,
                                                     mask.full_kv_indices, mask.q_num_blocks, mask.q_indices,
                                                     mask.full_q_num_blocks, mask.full_q_indices) if x is not None)
    assert held <= flex_block_mask_bytes(1, n)
    peak_compiled = _peak_rss_delta(lambda: _flex_call(layout()[0], q, kk, v))

    monkeypatch.setattr(ba, "flex_compiles", lambda device: False)
    s3 = layout()[0]
    out = {}
    peak_eager = _peak_rss_delta(lambda: out.setdefault("v", _flex_call(s3, q, kk, v)))
    scores = flex_bytes(False, 1, heads, n).saved
    assert scores == 128 * 2**20
    assert peak_eager >= scores, (peak_eager, scores)  # doctor's figure for the uncompiled path is a floor
    assert peak_compiled < scores // 4, (peak_compiled, scores)
    real = torch.cat([s.valid[:1]] * (k + 1), dim=1)[0]
    assert torch.allclose(compiled[0, real], out["v"][0, real], atol=1e-5)


def test_uncompiled_flex_is_refused_by_name_where_its_scores_do_not_fit(monkeypatch):
    import psutil

    from dllm_align.core.errors import UserError
    from dllm_align.models import block_attention as ba
    from dllm_align.models.attention_memory import flex_refusal

    q, kk, v, s = _layout()
    q, kk, v = q.detach(), kk.detach(), v.detach()
    monkeypatch.setattr(ba, "flex_compiles", lambda device: False)
    # 2 rows x 4 heads x 48 x 48 tokens: 147 KiB of scores and probabilities, 64 KiB free
    monkeypatch.setattr(psutil, "virtual_memory", lambda: type("vm", (), {"available": 64 << 10})())
    with pytest.raises(UserError, match="flex_attention without torch.compile .* GiB"):
        _flex_call(s, q, kk, v)
    # at SDAR-1.7B's 16 heads, 8 draws x 4,096 tokens: 87 GB of fp32 scores per layer, refused on an 80 GB GPU
    assert "80.0 GiB available" in flex_refusal(1, 16, 9 * 4096, 80 * 2**30)
    assert flex_refusal(1, 2, 64, 1 << 30) is None
