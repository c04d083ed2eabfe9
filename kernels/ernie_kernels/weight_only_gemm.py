"""Quantized dense GEMM: y = x @ dequant(W), weights read as stored (1 B/param int8, 0.5 B int4, 1 B fp8).

Decode-time dense layers are weight-bandwidth bound, so halving or quartering the bytes read is the
whole win. wint8 / wint4: the per-output-channel scale is applied once to the fp32 accumulator, not per
element. block_wise_fp8: activations are quantized per token per 128-channel group as each A tile is
loaded (the tile is one group), the dot runs in fp8, and the 128x128 block scales apply per K step.
"""

from __future__ import annotations

from typing import Any

from ernie_kernels._dequant import (A_NONE, A_QUANT_CODES, QUANT_CODES, block_k_for, load_weight_tile,
                                    quantize_a_tile, tile_dot)
from ernie_kernels._runtime import INTERPRET, contiguous, dot_dtype, dtype_name, new_tensor, next_pow2, tl, triton

DENSE_METHODS = ("wint8", "wint4", "block_wise_fp8")


@triton.jit
def _wo_gemm_kernel(a_ptr, b_ptr, s_ptr, c_ptr, M, N, K, stride_am, stride_ak, stride_bk, stride_bn,
                    stride_cm, stride_cn, stride_sk, stride_sn, QUANT: tl.constexpr, A_QUANT: tl.constexpr,
                    DOT: tl.constexpr, FP8_DOT: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    # row offsets in int64: a 300B dense up_gate output is tokens x 57344, past 2^31 from 37450 tokens
    rows = offs_m.to(tl.int64)
    a_rows = a_ptr + rows[:, None] * stride_am
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        a = tl.load(a_rows + offs_k[None, :] * stride_ak,
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
        w = load_weight_tile(b_ptr, offs_k, offs_n, k_mask[:, None] & n_mask[None, :], stride_bk, stride_bn, s_ptr,
                             s_ptr, QUANT)
        if A_QUANT == 1:  # fp8: quantize the A tile (one 128 group per row), fp8 dot, block scales per K step
            aq, row_scale = quantize_a_tile(a, 1.0, A_QUANT, FP8_DOT)
            part = tile_dot(aq, w, A_QUANT, DOT, FP8_DOT)
            s = tl.load(s_ptr + (k0 // 128) * stride_sk + (offs_n // 128) * stride_sn, mask=n_mask, other=0.0)
            acc += part * row_scale[:, None] * s[None, :]
        else:
            acc += tile_dot(a, w, A_QUANT, DOT, FP8_DOT)
    if A_QUANT == 0:
        scale = tl.load(s_ptr + offs_n * stride_sn, mask=n_mask, other=0.0).to(tl.float32)
        acc = acc * scale[None, :]
    tl.store(c_ptr + rows[:, None] * stride_cm + offs_n[None, :] * stride_cn, acc.to(c_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


def weight_only_linear(x: Any, qweight: Any, scale: Any, method: str) -> Any:
    """x [M, K] (fp32/bf16/fp16) @ dequant(qweight) -> [M, N] in x's dtype; torch or Paddle tensors.

    wint8: qweight int8 [K, N]; wint4: formats.pack_int4 int8 [K//2, N]; scale f32 [N].
    block_wise_fp8: qweight float8_e4m3fn [K, N] (K a multiple of 128), scale f32 [ceil(K/128), ceil(N/128)].
    """
    if method not in DENSE_METHODS:
        raise ValueError(f"weight_only_linear method must be one of {', '.join(DENSE_METHODS)}, got {method!r}")
    m, k = x.shape
    kq, n = qweight.shape
    if kq * (2 if method == "wint4" else 1) != k:
        raise ValueError(f"qweight {list(qweight.shape)} does not match x [M, {k}] for {method}")
    if method == "block_wise_fp8" and k % 128:
        raise ValueError(f"block_wise_fp8 weight_only_linear needs K ({k}) to be a multiple of 128")
    x, qweight, scale = contiguous(x), contiguous(qweight), contiguous(scale)
    y = new_tensor(x, [m, n], dtype_name(x))
    if m == 0:
        return y
    bm = min(64, max(16, next_pow2(m)))
    bn, bk = 64, block_k_for(method)
    sk, sn = (scale.stride(0), scale.stride(1)) if method == "block_wise_fp8" else (0, scale.stride(0))
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
    _wo_gemm_kernel[grid](x, qweight, scale, y, m, n, k, x.stride(0), x.stride(1), qweight.stride(0),
                          qweight.stride(1), y.stride(0), y.stride(1), sk, sn, QUANT=QUANT_CODES[method],
                          A_QUANT=A_QUANT_CODES.get(method, A_NONE), DOT=dot_dtype(dtype_name(x)),
                          FP8_DOT=not INTERPRET, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk)
    return y
