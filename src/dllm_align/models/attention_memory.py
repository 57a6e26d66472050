"""Bytes an attention kernel needs, per backend: pure arithmetic for ``doctor`` and for the FlexAttention refusal.

No tensor is allocated here. Each function returns bytes for one layer's attention of one forward, in
two parts: ``saved`` (kept for the backward: a checkpointed run keeps it for one layer at a time) and
``transient`` (alive only inside the call).

Which SDPA kernel CUDA runs (``torch.nn.functional.scaled_dot_product_attention``): flash when there is no
mask and the compute dtype is 16-bit; the memory-efficient kernel when a mask is given (flash takes none),
or in fp32; both keep only a log-sum-exp per query row besides their output. The memory-efficient kernel
turns a boolean mask into an additive bias in the query's dtype, its last dimension padded to a multiple of
16, and keeps it for the backward. The math kernel (the fallback, and the CPU's reference) materialises the
scores and the probabilities, each [rows, heads, queries, keys] in the compute dtype.

The streams attention of a block family (:mod:`dllm_align.models.block_attention`) makes two 4-D calls per
layer: the K noisy streams with the draws folded into the heads (queries [B, H*K, T], keys [B, H*K, 2T],
mask [B, 1, T, 2T]) and the clean stream ([B, H, T] over [B, H, T], mask [B, 1, T, T]); it also keeps the
noisy streams' concatenated keys and values ([B, H*K, 2T, D] each) for the backward.

FlexAttention compiled (``torch.compile``) is a fused kernel: a log-sum-exp per query row, plus the BlockMask,
which holds for every (row, query tile) the count and indices of the key tiles to visit, partial and full,
and the same transposed for the backward: 4 x rows x tiles x (tiles + 1) int32. Uncompiled it runs the
score matrix in fp32 ([rows, heads, N, N] 4-byte scores, and as many probabilities), and
``create_block_mask`` uncompiled evaluates the mask over the whole [rows, N, N] square first.
"""

from __future__ import annotations

from dataclasses import dataclass

FLEX_TILE = 128  # torch's default BlockMask tile (create_block_mask's BLOCK_SIZE)
LSE_BYTES = 4  # the fused kernels' per-row log-sum-exp is fp32


@dataclass(frozen=True)
class AttentionBytes:
    saved: int  # kept for the backward
    transient: int  # inside the call only

    def __add__(self, other: "AttentionBytes") -> "AttentionBytes":
        return AttentionBytes(self.saved + other.saved, self.transient + other.transient)

    @property
    def total(self) -> int:
        return self.saved + self.transient


def _pad16(n: int) -> int:
    return -(-n // 16) * 16


def sdpa_kernel(device_type: str, masked: bool, dtype_bytes: int) -> str:
    """The SDPA kernel a 4-D call runs on: ``flash``, ``efficient`` or ``math`` (CPU: its flash kernel takes
    masks and every dtype, but the CPU's choice for a float mask in training is treated as math: ``doctor``
    sizes GPUs)."""
    if device_type != "cuda":
        return "math"
    if not masked and dtype_bytes == 2:
        return "flash"
    return "efficient"


def sdpa_bytes(kernel: str, rows: int, heads: int, queries: int, keys: int, dtype_bytes: int,
               mask_rows: int = 0) -> AttentionBytes:
    """One 4-D SDPA call: [rows, heads, queries] over [rows, heads, keys]; ``mask_rows`` rows of a
    [mask_rows, 1, queries, keys] boolean mask (0: none), shared by every head."""
    mask_bool = mask_rows * queries * keys
    if kernel == "flash":
        return AttentionBytes(saved=rows * heads * queries * LSE_BYTES, transient=0)
    if kernel == "efficient":
        bias = mask_rows * queries * _pad16(keys) * dtype_bytes
        return AttentionBytes(saved=rows * heads * _pad16(queries) * LSE_BYTES + bias, transient=0)
    if kernel == "math":
        scores = rows * heads * queries * keys * dtype_bytes
        bias = mask_rows * queries * keys * dtype_bytes
        return AttentionBytes(saved=scores, transient=scores + bias + mask_bool)
    raise ValueError(f"unknown SDPA kernel {kernel!r}")


def streams_sdpa_bytes(kernel: str, rows: int, heads: int, head_dim: int, draws: int, length: int,
                       dtype_bytes: int) -> AttentionBytes:
    """The streams attention's two calls per layer (module docstring), plus the noisy streams' concatenated
    keys and values kept for the backward. The boolean masks themselves are built once per forward
    (``doctor``'s "stream masks" line), not per layer."""
    noisy = sdpa_bytes(kernel, rows, heads * draws, length, 2 * length, dtype_bytes, mask_rows=rows)
    clean = sdpa_bytes(kernel, rows, heads, length, length, dtype_bytes, mask_rows=rows)
    kv = 2 * rows * heads * draws * 2 * length * head_dim * dtype_bytes
    return noisy + clean + AttentionBytes(saved=kv, transient=0)


def flex_block_mask_bytes(rows: int, n: int, tile: int = FLEX_TILE) -> int:
    """A BlockMask for [rows, 1, n, n] at ``tile`` granularity: partial and full tiles, forward and transposed
    (the backward's), each a count per tile row and an index per tile pair, int32."""
    t = -(-n // tile)
    return 4 * rows * t * (t + 1) * 4


def flex_bytes(compiled: bool, rows: int, heads: int, n: int, tile: int = FLEX_TILE) -> AttentionBytes:
    """One FlexAttention call over [rows, heads, n] (the whole (K+1)T streams row), and its BlockMask's
    construction (transient: made once per forward)."""
    if compiled:
        return AttentionBytes(saved=rows * heads * n * LSE_BYTES, transient=flex_block_mask_bytes(rows, n, tile))
    scores = rows * heads * n * n * 4
    return AttentionBytes(saved=scores, transient=scores + rows * n * n)


def flex_refusal(rows: int, heads: int, n: int, available: int) -> str | None:
    """Why FlexAttention cannot run uncompiled here (its score matrix does not fit in ``available`` bytes),
    or None when it fits."""
    need = flex_bytes(False, rows, heads, n).total
    if need <= available:
        return None
    return (f"model.attn_implementation: flex_attention without torch.compile materialises the score matrix: "
            f"{need / 2**30:.1f} GiB for {rows} x {heads} heads x {n} x {n} tokens, {available / 2**30:.1f} GiB available; "
            "install a compiler for torch.compile (triton on CUDA, a C++ compiler on the CPU) or use sdpa")
