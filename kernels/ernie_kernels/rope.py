"""Interleaved (GPT-J style) rotary embedding, in place on the query and key heads of the fused qkv rows.

ERNIE rotates the pairs (2i, 2i+1) of every head: out[2i] = x[2i] cos - x[2i+1] sin, out[2i+1] =
x[2i+1] cos + x[2i] sin, with angle position * theta^(-2i/head_dim) / compression_ratio. The cos/sin
tables [max_position, head_dim/2] are built once on the host with the reference path's float32 numbers
(rope_tables), so both paths rotate by the same values. The qkv projection's rows are [Q | K | V], so
the query and key heads are one run of num_heads + num_kv_heads heads that one program per token rotates.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ernie_kernels._runtime import next_pow2, tl, triton


@triton.jit
def _rope_kernel(x_ptr, pos_ptr, cos_ptr, sin_ptr, stride_xt, stride_c, NUM_HEADS: tl.constexpr,
                 HEADS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, HALF_PAD: tl.constexpr):
    t = tl.program_id(0)
    p = tl.load(pos_ptr + t).to(tl.int64)
    i = tl.arange(0, HALF_PAD)
    h = tl.arange(0, HEADS_PAD)
    i_mask = i < HEAD_DIM // 2
    c = tl.load(cos_ptr + p * stride_c + i, mask=i_mask, other=0.0)[None, :]
    s = tl.load(sin_ptr + p * stride_c + i, mask=i_mask, other=0.0)[None, :]
    mask = (h < NUM_HEADS)[:, None] & i_mask[None, :]
    even = x_ptr + t * stride_xt + h[:, None] * HEAD_DIM + 2 * i[None, :]
    x0 = tl.load(even, mask=mask, other=0.0).to(tl.float32)
    x1 = tl.load(even + 1, mask=mask, other=0.0).to(tl.float32)
    tl.store(even, (x0 * c - x1 * s).to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(even + 1, (x1 * c + x0 * s).to(x_ptr.dtype.element_ty), mask=mask)


def rope_tables(head_dim: int, theta: float, num_positions: int,
                compression_ratio: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """float32 cos and sin [num_positions, head_dim // 2]: the reference RotaryEmbedding's values."""
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    pos = np.arange(num_positions, dtype=np.float32) / compression_ratio
    freqs = np.outer(pos, inv_freq).astype(np.float32)
    return np.ascontiguousarray(np.cos(freqs)), np.ascontiguousarray(np.sin(freqs))


def rope_inplace(qkv: Any, positions: Any, cos: Any, sin: Any, num_heads: int, head_dim: int) -> None:
    """Rotate the first num_heads heads (query then key heads) of each row of qkv [T, >= num_heads*head_dim]
    at its token's position; positions int [T], cos/sin from rope_tables on qkv's device."""
    if head_dim % 2:
        raise ValueError(f"rotary embedding needs an even head_dim, got {head_dim}")
    if qkv.stride(1) != 1 or qkv.shape[1] < num_heads * head_dim:
        raise ValueError(f"qkv must be [T, >= {num_heads * head_dim}] with contiguous rows")
    t = int(qkv.shape[0])
    if t:
        _rope_kernel[(t,)](qkv, positions, cos, sin, qkv.stride(0), cos.stride(0), NUM_HEADS=num_heads,
                           HEADS_PAD=next_pow2(num_heads), HEAD_DIM=head_dim, HALF_PAD=next_pow2(head_dim // 2))
