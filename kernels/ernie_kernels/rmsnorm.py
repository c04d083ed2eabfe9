"""Fused (residual add +) RMSNorm: one read of x (and residual), one write of y (and the new residual).

ERNIE's pre-norm blocks do `h = x + f(x_norm)` then normalize h; fusing the add saves a full pass over
the activations per layer. Statistics in fp32 whatever the activation dtype.
"""

from __future__ import annotations

from typing import Any

from ernie_kernels._runtime import contiguous, dtype_name, new_tensor, next_pow2, tl, triton


@triton.jit
def _rmsnorm_kernel(x_ptr, r_ptr, w_ptr, y_ptr, rout_ptr, H, stride_x, stride_r, stride_y, stride_ro, eps,
                    HAS_RESIDUAL: tl.constexpr, BLOCK_H: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_H)
    mask = cols < H
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        x += tl.load(r_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(rout_ptr + row * stride_ro + cols, x.to(rout_ptr.dtype.element_ty), mask=mask)
    inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / H + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_y + cols, (x * inv * w).to(y_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: Any, weight: Any, eps: float = 1e-5, residual: Any = None) -> Any:
    """y = weight * (h * rsqrt(mean(h^2) + eps)) with h = x (+ residual); x [T, H] torch or Paddle.

    Returns y, or (y, h) when residual is given (h is the next block's residual). Output dtype = x's.
    """
    if len(x.shape) != 2:
        raise ValueError(f"rms_norm expects x [T, H], got shape {list(x.shape)}")
    t, h = x.shape
    if x.stride(1) != 1:
        x = contiguous(x)
    weight = contiguous(weight)
    y = new_tensor(x, [t, h], dtype_name(x))
    if residual is not None:
        residual = contiguous(residual)
        r_out = new_tensor(x, [t, h], dtype_name(residual))
        r, sr, sro = residual, residual.stride(0), r_out.stride(0)
    else:
        r, r_out, sr, sro = x, y, 0, 0
    if t > 0:
        _rmsnorm_kernel[(t,)](x, r, weight, y, r_out, h, x.stride(0), sr, y.stride(0), sro, float(eps),
                              HAS_RESIDUAL=residual is not None, BLOCK_H=next_pow2(h), num_warps=4 if h <= 4096 else 8)
    return (y, r_out) if residual is not None else y
