"""Weight-only int8/int4 dense GEMM: y = x @ (q * scale[n]), weights read quantized (1 or 0.5 B/param).

Decode-time dense layers are weight-bandwidth bound, so halving or quartering the bytes read is the
whole win. The per-output-channel scale is applied once to the fp32 accumulator, not per element.
"""

from __future__ import annotations

from typing import Any

from ernie_kernels._dequant import load_weight_tile
from ernie_kernels._runtime import contiguous, dot_dtype, dtype_name, new_tensor, next_pow2, tl, triton


@triton.jit
def _wo_gemm_kernel(a_ptr, b_ptr, s_ptr, c_ptr, M, N, K, stride_am, stride_ak, stride_bk, stride_bn,
                    stride_cm, stride_cn, QUANT: tl.constexpr, DOT: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        a = tl.load(a_ptr + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak,
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w = load_weight_tile(b_ptr, offs_k, offs_n, k_mask[:, None] & n_mask[None, :], stride_bk, stride_bn, s_ptr,
                             s_ptr, QUANT)
        acc += tl.dot(a.to(DOT), w.to(tl.float32).to(DOT))
    scale = tl.load(s_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    acc = acc * scale[None, :]
    tl.store(c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn, acc.to(c_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


def weight_only_linear(x: Any, qweight: Any, scale: Any, bits: int) -> Any:
    """x [M, K] (fp32/bf16/fp16) @ dequant(qweight) -> [M, N] in x's dtype; torch or Paddle tensors.

    qweight int8 [K, N] (bits=8) or formats.pack_int4 int8 [K//2, N] (bits=4); scale f32 [N].
    """
    if bits not in (4, 8):
        raise ValueError(f"weight_only_linear bits must be 4 or 8, got {bits}")
    m, k = x.shape
    kq, n = qweight.shape
    if kq * (2 if bits == 4 else 1) != k:
        raise ValueError(f"qweight {list(qweight.shape)} does not match x [M, {k}] for bits={bits}")
    x, qweight, scale = contiguous(x), contiguous(qweight), contiguous(scale)
    y = new_tensor(x, [m, n], dtype_name(x))
    bm = min(64, max(16, next_pow2(m)))
    bn, bk = 64, 64
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
    _wo_gemm_kernel[grid](x, qweight, scale, y, m, n, k, x.stride(0), x.stride(1), qweight.stride(0),
                          qweight.stride(1), y.stride(0), y.stride(1), QUANT=1 if bits == 8 else 2,
                          DOT=dot_dtype(dtype_name(x)), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk)
    return y
