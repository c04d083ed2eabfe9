"""The GEMMs of cpu_gemm.c (float32 / bfloat16) and cpu_qgemm.c (int8 / int4 codes), called through ctypes.

y = (x @ W) * scale at every row count: float32 or bfloat16 W (bits 32 / 16; a bfloat16 weight is held as its bits
in an int16 array, NumPy and Paddle's CPU tensors having no bfloat16 the kernels read; on AMX x is rounded to
bfloat16 from 16 rows, bf16_on_amx) in the column-blocked
serving layout (model/layers.BlockedLinear,
model/moe.BlockedExperts; pack_columns), int8 or int4 codes of the weight-only formats in the integer kernel's
layout (model/quantized_layers.QuantLinear; pack_codes), and every routed expert of a layer in one call. Without the
library `available()` is False and callers keep their Paddle path.
"""
from __future__ import annotations

import ctypes

import ml_dtypes
import numpy as np
import paddle

from ..host_tensor import empty_host, empty_weight
from ..quantization.formats import pack_int4, unpack_int4
from . import build

def available() -> bool:
    return build.available()


def swiglu_fits(n: int) -> bool:
    """Whether a [K, n] gate-up weight (gate half first) can run with SwiGLU fused (`swiglu=True`)."""
    lib = build.library()
    return lib is not None and bool(lib.ernie_gemm_swiglu_fits(n))


def bf16_on_amx(rows: int, k: int) -> bool:
    """Whether `rows` rows times a bfloat16 weight of k rows run on AMX (cpu_amx.c), x rounded to bfloat16 as vLLM-CPU
    and FastDeploy compute bfloat16 (else x stays float32 and the weight is widened to it)."""
    lib = build.library()
    return lib is not None and bool(lib.ernie_bf16_on_amx(rows, k))


def int8_on_amx(rows: int, k: int) -> bool:
    """Whether `rows` rows times int8 codes of K rows run on AMX-INT8 (cpu_qgemm.c: the same integer sums as VNNI)."""
    lib = build.library()
    return bool(lib is not None and lib.ernie_int8_on_amx(rows, k))


def serves(t: paddle.Tensor) -> bool:
    """Whether cpu_gemm.c can multiply a weight held like `t`: on the CPU, with the library built."""
    return t.place.is_cpu_place() and available()


COLS = 32  # cpu_gemm.c's column block
FLOAT_BITS = {32: np.dtype(np.float32), 16: np.dtype(np.int16)}  # how a float weight of these bits is held


def bf16_bits(a: np.ndarray) -> np.ndarray:
    """float32 values rounded to bfloat16 (nearest even), as the int16 bits cpu_gemm.c reads."""
    return np.asarray(a, dtype=ml_dtypes.bfloat16).view(np.int16)


def widen(a: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """A held float weight's values as float32 (bfloat16 bits widened; float32 as it is), or written into `out`."""
    held = a.view(ml_dtypes.bfloat16) if a.dtype == np.int16 else a
    if out is not None:
        out[...] = held
        return out
    return held.astype(np.float32) if held is not a else a


def blocked_shape(q_shape: tuple[int, int]) -> tuple[int, int, int]:
    r, n = q_shape
    return -(-n // COLS), r, COLS


def pack_columns(q: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """A float32 weight [K, N] (any strides) -> the column-blocked layout cpu_gemm.c streams: [ceil(N/32), K, 32], the
    last block zero-padded. Written into `out` when given (one copy, no temporary); an int16 `out` gets the values
    rounded to bfloat16 (bf16_bits)."""
    r, n = q.shape
    out = np.empty(blocked_shape(q.shape), q.dtype) if out is None else out
    full = n // COLS
    if out.dtype == np.int16:  # a block of columns at a time: no whole-weight temporary
        for b in range(full):
            out[b] = bf16_bits(q[:, b * COLS:(b + 1) * COLS])
    else:
        out[:full] = q[:, :full * COLS].reshape(r, full, COLS).transpose(1, 0, 2)
    if full < out.shape[0]:
        out[full] = 0
        last = q[:, full * COLS:]
        out[full, :, :n - full * COLS] = bf16_bits(last) if out.dtype == np.int16 else last
    return out


def packed(q: np.ndarray, bits: int = 32) -> paddle.Tensor:
    """pack_columns(q) as a new CPU tensor of `bits` (32 float32, 16 bfloat16; host_tensor.empty_weight's memory),
    written in place."""
    t, view = empty_weight(blocked_shape(q.shape), FLOAT_BITS[bits])
    pack_columns(q, out=view)
    return t


def unpack_columns(blocked: np.ndarray, n0: int, n1: int) -> np.ndarray:
    """Columns [n0, n1) of a column-blocked weight as float32 [R, n1 - n0] (a copy)."""
    b0, b1 = n0 // COLS, -(-n1 // COLS)
    part = widen(blocked[b0:b1])
    cols = part.transpose(1, 0, 2).reshape(part.shape[1], -1)
    return np.ascontiguousarray(cols[:, n0 - b0 * COLS: n1 - b0 * COLS])


def codes_shape(k: int, n: int, bits: int) -> tuple[int, int, int, int]:
    """cpu_qgemm.c's layout of a [k, n] weight's int8 (bits 8) or int4 (bits 4) codes: [ceil(n/32), G, 32, 4] bytes,
    G = ceil(k/4) (int8) or ceil(k/8) (int4, two codes a byte)."""
    return -(-n // COLS), -(-k // (4 if bits == 8 else 8)), COLS, 4


def pack_codes(q: np.ndarray, bits: int, out: np.ndarray | None = None) -> np.ndarray:
    """A weight's codes in checkpoint layout (int8 [K, N], or int4 packed [K/2, N] as formats.pack_int4) -> the
    layout cpu_qgemm.c streams (codes_shape), offset to unsigned (int8 w + 128, int4 w + 8), K zero-padded."""
    codes = unpack_int4(q) if bits == 4 else np.asarray(q, np.int8)
    k, n = codes.shape
    nb, g, _, _ = codes_shape(k, n, bits)
    per = 4 if bits == 8 else 8  # k rows in a group
    u = np.full((g * per, nb * COLS), 128 if bits == 8 else 8, np.uint8)
    u[:k, :n] = codes.astype(np.int16) + (128 if bits == 8 else 8)
    if bits == 8:  # [g, 4, nb, 32] -> [nb, g, 32, 4]
        blocked = u.reshape(g, 4, nb, COLS).transpose(2, 0, 3, 1)
    else:  # low nibble k = 8g + j, high nibble k = 8g + 4 + j
        v = u.reshape(g, 2, 4, nb, COLS)
        blocked = (v[:, 0] | (v[:, 1] << 4)).transpose(2, 0, 3, 1)
    out = np.empty(codes_shape(k, n, bits), np.uint8) if out is None else out
    out[...] = blocked
    return out


def unpack_codes(blocked: np.ndarray, k: int, bits: int, n0: int, n1: int) -> np.ndarray:
    """Columns [n0, n1) of pack_codes' layout back in checkpoint layout (int8 [k, n], or int4 packed [k/2, n])."""
    codes = code_values(blocked, k, bits, n0, n1)
    return pack_int4(codes) if bits == 4 else codes


def code_values(blocked: np.ndarray, k: int, bits: int, n0: int, n1: int) -> np.ndarray:
    """Columns [n0, n1) of pack_codes' layout as the codes' values, int8 [k, n] (int4 ones in [-8, 7])."""
    b0, b1 = n0 // COLS, -(-n1 // COLS)
    part = np.asarray(blocked[b0:b1])  # [nb, g, 32, 4]
    if bits == 8:
        u = part.transpose(1, 3, 0, 2).reshape(-1, (b1 - b0) * COLS)
    else:
        lo, hi = part & 15, part >> 4  # [nb, g, 32, 4] each
        u = np.stack([lo, hi], axis=2).transpose(1, 2, 4, 0, 3).reshape(-1, (b1 - b0) * COLS)
    return (u[:k, n0 - b0 * COLS: n1 - b0 * COLS].astype(np.int16) - (128 if bits == 8 else 8)).astype(np.int8)


def packed_codes(q: np.ndarray, bits: int) -> paddle.Tensor:
    """pack_codes(q, bits) as a new CPU tensor (host_tensor.empty_weight's memory), written in place."""
    k = q.shape[0] * (2 if bits == 4 else 1)
    t, view = empty_weight(codes_shape(k, q.shape[1], bits), np.uint8)
    pack_codes(q, bits, out=view)
    return t


def fits_layout(shape, k: int, n: int, bits: int) -> bool:
    """Whether a weight held as `shape` is a [k, n] weight of this format (float32 / bfloat16: pack_columns; int:
    pack_codes)."""
    return tuple(shape) == (blocked_shape((k, n)) if bits in FLOAT_BITS else codes_shape(k, n, bits))


def held_bits(t: paddle.Tensor) -> int | None:
    """The bits of the float weight a tensor holds (FLOAT_BITS: float32 32, bfloat16's int16 bits 16); None else."""
    return 32 if t.dtype == paddle.float32 else 16 if t.dtype == paddle.int16 else None


def _held_as(t: paddle.Tensor, bits: int) -> bool:
    """Whether a float weight tensor holds `bits`; int codes pass."""
    return bits not in FLOAT_BITS or held_bits(t) == bits


def _check(rc: int) -> None:
    if rc != 0:
        raise MemoryError("cpu_qgemm.c could not allocate its quantized activations")


def gemm(x: np.ndarray, blocked: paddle.Tensor, n: int, scale: paddle.Tensor | None, bits: int,
         swiglu: bool = False, int_x: bool = False) -> paddle.Tensor:
    """(x [M, K] float32) @ W * scale -> a new [M, n] float32 tensor; W float32 / bfloat16 in pack_columns' layout
    (bits 32 / 16, scale None) or int8 / int4 codes in pack_codes' (bits 8 / 4; x enters at 16-bit precision, see
    cpu_qgemm.c, or exactly when `int_x` says it is integer-valued). `swiglu`: W is a gate-up projection and the
    result is silu(gate) * up, [M, n / 2] (needs swiglu_fits(n)). Callers check available() first."""
    lib = build.library()
    x = np.ascontiguousarray(x, dtype=np.float32)
    m, k = x.shape
    if (not fits_layout(blocked.shape, k, n, bits) or not _held_as(blocked, bits)
            or (scale is None) != (bits in FLOAT_BITS)
            or (scale is not None and scale.shape[0] != n) or (swiglu and not swiglu_fits(n))):
        raise ValueError(f"cpu_gemm.gemm: x [{m}, {k}] does not fit a {bits}-bit weight of {n} columns "
                         f"held as {blocked.shape} with scale {None if scale is None else scale.shape}"
                         f"{' (swiglu)' if swiglu else ''}")
    y, out = empty_host((m, n // 2 if swiglu else n), np.float32)
    _check(lib.ernie_gemm(x.ctypes.data, m, k, blocked.data_ptr(), n, None if scale is None else scale.data_ptr(),
                          out.ctypes.data, bits, int(swiglu), int(int_x)))
    return y


def gemm_argmax(x: np.ndarray, blocked: paddle.Tensor, n: int, n_valid: int,
                bits: int = 32) -> tuple[np.ndarray, np.ndarray]:
    """Each row's argmax and max over the first n_valid columns of (x [M, K] float32) @ W, W float32 / bfloat16 (bits
    32 / 16) in pack_columns' layout with n columns; the [M, n] product is never stored (cpu_gemm.c's
    ernie_gemm_argmax). Ties go to the lowest column and a NaN ranks above everything, as NumPy's argmax. Callers
    check available() first."""
    lib = build.library()
    x = np.ascontiguousarray(x, dtype=np.float32)
    m, k = x.shape
    if (bits not in FLOAT_BITS or not fits_layout(blocked.shape, k, n, bits) or not _held_as(blocked, bits)
            or not 0 < n_valid <= n):
        raise ValueError(f"cpu_gemm.gemm_argmax: x [{m}, {k}] does not fit a {bits}-bit float weight of {n} columns "
                         f"held as {blocked.shape} (n_valid {n_valid})")
    idx, best = np.empty(m, dtype=np.int64), np.empty(m, dtype=np.float32)
    _check(lib.ernie_gemm_argmax(x.ctypes.data, m, k, blocked.data_ptr(), n, n_valid, idx.ctypes.data,
                                 best.ctypes.data, bits))
    return idx, best


def moe_gemm(x: np.ndarray, rows: np.ndarray, blocked: list[paddle.Tensor], n: int,
             scales: list[paddle.Tensor] | None, bits: int, swiglu: bool = False, int_x: bool = False) -> paddle.Tensor:
    """Every expert's matmul in one call. x padded [E, cap, K] float32 (expert e's tokens in its first rows[e] rows)
    -> y [E, cap, n] with y[e, :rows[e]] = x[e, :rows[e]] @ W_e * scale_e and rows past rows[e] zero; or x packed
    [sum(rows), K] (expert e's rows after those of experts < e) -> y [sum(rows), n]. `blocked` / `scales`: each
    expert's weight and scale as gemm takes them: bits 32 / 16 (float32 / bfloat16, scales None) or 8 / 4 (codes).
    `swiglu`, `int_x`: as gemm's, y rows of n / 2. Callers check available()."""
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
    if (not fits or (scales is None) != (bits in FLOAT_BITS) or (scales is not None and len(scales) != e)
            or rows.shape != (e,) or not fits_layout(blocked[0].shape, k, n, bits) or not _held_as(blocked[0], bits)
            or (swiglu and not swiglu_fits(n))):
        raise ValueError(f"moe_gemm: x {list(x.shape)} with rows {rows.tolist()} does not fit {len(blocked)} "
                         f"{bits}-bit experts of {n} columns held as {blocked[0].shape}{' (swiglu)' if swiglu else ''}")
    w_ptrs = (ctypes.c_void_p * e)(*[w.data_ptr() for w in blocked])
    s_ptrs = None if scales is None else (ctypes.c_void_p * e)(*[s.data_ptr() for s in scales])
    y, out = empty_host((*x.shape[:-1], n // 2 if swiglu else n), np.float32)
    if x.ndim == 3:
        out.fill(0.0)
    _check(lib.ernie_moe_gemm(x.ctypes.data, rows.ctypes.data, starts.ctypes.data, e, k, w_ptrs, n, s_ptrs,
                              out.ctypes.data, bits, int(swiglu), int(int_x)))
    return y
