"""The attention bytes doctor counts per backend (models/attention_memory.py): the figures the GPU review measured,
and the math kernel's floor checked against what a real call holds on this CPU."""

from __future__ import annotations

import torch

from dllm_align.models.attention_memory import (
    flex_block_mask_bytes,
    flex_bytes,
    sdpa_bytes,
    sdpa_kernel,
    streams_sdpa_bytes,
)

GiB = 2**30


def test_kernel_choice_follows_cuda_dispatch():
    assert sdpa_kernel("cuda", masked=True, dtype_bytes=2) == "efficient"  # flash takes no mask
    assert sdpa_kernel("cuda", masked=False, dtype_bytes=2) == "flash"
    assert sdpa_kernel("cuda", masked=False, dtype_bytes=4) == "efficient"  # flash needs 16-bit inputs
    assert sdpa_kernel("cpu", masked=True, dtype_bytes=4) == "math"


def test_sdar_streams_attention_bytes_per_backend():
    """SDAR-1.7B (16 heads of 128), 8 draws x 4,096 tokens: the math kernel's fp32 probabilities of the noisy
    call alone are 16 GiB per layer; the memory-efficient kernel keeps a log-sum-exp and the bf16 bias."""
    math = sdpa_bytes("math", 1, 16 * 8, 4096, 8192, 4)
    assert math.saved == 16 * GiB
    eff = streams_sdpa_bytes("efficient", 1, 16, 128, 8, 4096, 2)
    kv = 2 * 16 * 8 * 8192 * 128 * 2  # the noisy streams' concatenated keys and values, bf16
    bias = 4096 * 8192 * 2 + 4096 * 4096 * 2
    lse = 16 * 8 * 4096 * 4 + 16 * 4096 * 4
    assert eff.saved == kv + bias + lse and eff.transient == 0
    assert eff.saved < math.saved / 10


def test_flex_bytes_compiled_against_uncompiled():
    n = 9 * 4096
    assert flex_bytes(False, 1, 16, n).saved == 16 * n * n * 4  # ~87 GB per layer
    tiles = n // 128
    assert flex_block_mask_bytes(1, n) == 16 * tiles * (tiles + 1)
    assert flex_bytes(True, 1, 16, n).total < 2**30


def _peak_rss_delta(fn) -> int:
    from test_block_attention import _peak_rss_delta as peak

    return peak(fn)


def test_math_kernel_holds_at_least_what_doctor_counts():
    # scores of 128 MiB: above glibc's largest mmap threshold (32 MiB), so every such buffer is fresh memory
    # and shows in the resident set whatever earlier tests freed
    q = torch.randn(1, 4, 2048, 16)
    k = torch.randn(1, 4, 4096, 16)
    mask = torch.rand(1, 1, 2048, 4096) > 0.5
    from torch.nn.attention import SDPBackend, sdpa_kernel as restrict

    with restrict([SDPBackend.MATH]):
        peak = _peak_rss_delta(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, k, attn_mask=mask))
    assert peak >= sdpa_bytes("math", 1, 4, 2048, 4096, 4).saved  # 128 MiB of fp32 scores
