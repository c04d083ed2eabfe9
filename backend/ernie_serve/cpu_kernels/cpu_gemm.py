"""The GEMM of cpu_gemm.c, called through ctypes (the library: cpu_kernels/build.py).

y = (x @ W) * scale for int8 or packed-int4 W at decode sizes, reading each weight byte once (see the C
file for why Paddle's fp32 matmul over a dequantized tile cannot be as fast), fp32 W at every size (the
serving layout of model/layers.BlockedLinear), and every routed expert of a layer in one call, quantized or
float32 (model/moe.BlockedExperts). Without the library `available()` is False and callers keep their Paddle path.
"""
from __future__ import annotations

import ctypes

import numpy as np
import paddle

from ..model.host_tensor import empty_host, empty_weight
from . import build

MAX_ROWS = 32  # beyond this (prefill chunks) Paddle's matmul over dequantized tiles is the faster path


def available() -> bool:
    return build.available()


def swiglu_fits(n: int) -> bool:
    """Whether a [K, n] gate-up weight (gate half first) can run with SwiGLU fused (`swiglu=True`)."""
    lib = build.library()
    return lib is not None and bool(lib.ernie_gemm_swiglu_fits(n))


def serves(t: paddle.Tensor) -> bool:
    """Whether cpu_gemm.c can multiply a weight held like `t`: on the CPU, with the library built."""
    return t.place.is_cpu_place() and available()


COLS = 32  # cpu_gemm.c's column block


def blocked_shape(q_shape: tuple[int, int]) -> tuple[int, int, int]:
    r, n = q_shape
    return -(-n // COLS), r, COLS


def pack_columns(q: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """A weight [R, N] (int8 codes with R = K or K/2 packed int4 rows, or float32; any strides) -> the
    column-blocked layout cpu_gemm.c streams: [ceil(N/32), R, 32], the last block zero-padded. Written into
    `out` when given (one copy, no temporary)."""
    r, n = q.shape
    out = np.empty(blocked_shape(q.shape), q.dtype) if out is None else out
    full = n // COLS
    out[:full] = q[:, :full * COLS].reshape(r, full, COLS).transpose(1, 0, 2)
    if full < out.shape[0]:
        out[full] = 0
        out[full, :, :n - full * COLS] = q[:, full * COLS:]
    return out


def packed(q: np.ndarray) -> paddle.Tensor:
    """pack_columns(q) as a new CPU tensor (host_tensor.empty_weight's memory), written in place."""
    t, view = empty_weight(blocked_shape(q.shape), q.dtype)
    pack_columns(q, out=view)
    return t


def unpack_columns(blocked: np.ndarray, n0: int, n1: int) -> np.ndarray:
    """Columns [n0, n1) of a column-blocked weight as [R, n1 - n0] (a copy)."""
    b0, b1 = n0 // COLS, -(-n1 // COLS)
    part = blocked[b0:b1]
    cols = part.transpose(1, 0, 2).reshape(part.shape[1], -1)
    return np.ascontiguousarray(cols[:, n0 - b0 * COLS: n1 - b0 * COLS])


def _fits(shape, k: int, n: int, bits: int) -> bool:
    """Whether a column-blocked weight of this shape is a [k, n] weight of this format."""
    return tuple(shape) == blocked_shape((k // 2 if bits == 4 else k, n))


def gemm(x: np.ndarray, blocked: paddle.Tensor, n: int, scale: paddle.Tensor | None, bits: int,
         swiglu: bool = False) -> paddle.Tensor:
    """(x [M, K] float32) @ W * scale -> a new [M, n] float32 tensor; W in pack_columns' layout: int8 (bits 8),
    int4-packed (bits 4), or float32 (bits 32, scale None). `swiglu`: W is a gate-up projection and the result
    is silu(gate) * up, [M, n / 2] (needs swiglu_fits(n)). Callers check available() first."""
    lib = build.library()
    x = np.ascontiguousarray(x, dtype=np.float32)
    m, k = x.shape
    if (not _fits(blocked.shape, k, n, bits) or (scale is None) != (bits == 32)
            or (scale is not None and scale.shape[0] != n) or (swiglu and not swiglu_fits(n))):
        raise ValueError(f"cpu_gemm.gemm: x [{m}, {k}] does not fit a {bits}-bit weight of {n} columns "
                         f"held as {blocked.shape} with scale {None if scale is None else scale.shape}"
                         f"{' (swiglu)' if swiglu else ''}")
    y, out = empty_host((m, n // 2 if swiglu else n), np.float32)
    lib.ernie_gemm(x.ctypes.data, m, k, blocked.data_ptr(), n, None if scale is None else scale.data_ptr(),
                   out.ctypes.data, bits, int(swiglu))
    return y


def moe_gemm(x: np.ndarray, rows: np.ndarray, blocked: list[paddle.Tensor], n: int,
             scales: list[paddle.Tensor] | None, bits: int, swiglu: bool = False) -> paddle.Tensor:
    """Every expert's matmul in one call. x padded [E, cap, K] float32 (expert e's tokens in its first rows[e] rows)
    -> y [E, cap, n] with y[e, :rows[e]] = x[e, :rows[e]] @ W_e * scale_e and rows past rows[e] zero; or x packed
    [sum(rows), K] (expert e's rows after those of experts < e) -> y [sum(rows), n]. `blocked` / `scales`: each
    expert's weight (pack_columns' layout) and scale; bits 8 / 4 (int codes) or 32 (float32 weights, scales None).
    `swiglu`: as gemm's, y rows of n / 2. Callers check available()."""
    lib = build.library()
    x = np.ascontiguousarray(x, dtype=np.float32)
    rows = np.ascontiguousarray(rows, dtype=np.int64)
    e, k = len(blocked), x.shape[-1]
    if x.ndim == 3:
        cap = x.shape[1]
        starts = np.arange(e, dtype=np.int64) * cap
        fits = x.shape[0] == e and rows.max(initial=0) <= cap
    else:
        starts = np.concatenate([[0], np.cumsum(rows)[:-1]]).astype(np.int64)
        fits = x.ndim == 2 and int(rows.sum()) == x.shape[0]
    if (not fits or (scales is None) != (bits == 32) or (scales is not None and len(scales) != e)
            or rows.shape != (e,) or not _fits(blocked[0].shape, k, n, bits) or (swiglu and not swiglu_fits(n))):
        raise ValueError(f"moe_gemm: x {list(x.shape)} with rows {rows.tolist()} does not fit {len(blocked)} "
                         f"{bits}-bit experts of {n} columns held as {blocked[0].shape}{' (swiglu)' if swiglu else ''}")
    w_ptrs = (ctypes.c_void_p * e)(*[w.data_ptr() for w in blocked])
    s_ptrs = None if scales is None else (ctypes.c_void_p * e)(*[s.data_ptr() for s in scales])
    y, out = empty_host((*x.shape[:-1], n // 2 if swiglu else n), np.float32)
    if x.ndim == 3:
        out.fill(0.0)
    lib.ernie_moe_gemm(x.ctypes.data, rows.ctypes.data, starts.ctypes.data, e, k, w_ptrs, n, s_ptrs, out.ctypes.data,
                       bits, int(swiglu))
    return y
