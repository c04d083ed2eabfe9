"""The fused small ops of cpu_ops.c on Paddle CPU tensors: each reads its inputs in place (DLPack views) and
returns a new tensor. The model's layers call these instead of their Paddle op chains when `serves(x)`:
inference (under paddle.no_grad, as the engine runs the model) on the CPU with the library built; training,
other devices and builds without a compiler keep the Paddle ops, which remain the definition the tests hold
these to."""
from __future__ import annotations

import numpy as np
import paddle

from ..host_tensor import empty_host
from . import build



def serves(x: paddle.Tensor) -> bool:
    """Whether these kernels may stand in for the Paddle ops on x: float32 on the CPU, gradients off."""
    return (not paddle.is_grad_enabled() and x.dtype == paddle.float32 and x.place.is_cpu_place()
            and build.available())


def _rows(x: paddle.Tensor) -> np.ndarray:
    """x as a C-contiguous float32 [rows, cols] NumPy view (a copy only if x is not contiguous)."""
    a = np.from_dlpack(x)
    return np.ascontiguousarray(a.reshape(-1, a.shape[-1]) if a.ndim != 2 else a, dtype=np.float32)


def rms_norm(x: paddle.Tensor, weight: paddle.Tensor, eps: float) -> paddle.Tensor:
    a = _rows(x)
    y, out = empty_host(a.shape, np.float32)
    build.library().ernie_rms_norm(a.ctypes.data, weight.data_ptr(), a.shape[0], a.shape[1], eps, out.ctypes.data)
    return y.reshape(x.shape)


def split_rope(qkv: paddle.Tensor, positions: np.ndarray, cos: paddle.Tensor, sin: paddle.Tensor, nh: int, nkv: int,
               hd: int) -> tuple[paddle.Tensor, paddle.Tensor, paddle.Tensor]:
    """qkv [T, (nh + 2 nkv) hd] -> q [T, nh, hd], k and v [T, nkv, hd], q and k rotated at their positions
    (cos / sin [positions, hd] tables covering every position)."""
    a = _rows(qkv)
    t = a.shape[0]
    pos = np.ascontiguousarray(positions, dtype=np.int64)
    if a.shape[1] != (nh + 2 * nkv) * hd or pos.shape != (t,) or (t and int(pos.max()) >= cos.shape[0]):
        raise ValueError(f"split_rope: qkv {list(a.shape)} with {pos.shape[0]} positions does not fit {nh} + 2 x "
                         f"{nkv} heads of {hd} and a table of {cos.shape[0]} positions")
    (q, qv), (k, kv), (v, vv) = (empty_host((t, n, hd), np.float32) for n in (nh, nkv, nkv))
    build.library().ernie_split_rope(a.ctypes.data, pos.ctypes.data, cos.data_ptr(), sin.data_ptr(), t, nh, nkv, hd,
                          qv.ctypes.data, kv.ctypes.data, vv.ctypes.data)
    return q, k, v


def silu_and_mul(gate_up: paddle.Tensor) -> paddle.Tensor:
    a = _rows(gate_up)
    inter = a.shape[1] // 2
    y, out = empty_host((a.shape[0], inter), np.float32)
    build.library().ernie_silu_and_mul(a.ctypes.data, a.shape[0], inter, out.ctypes.data)
    return y.reshape(list(gate_up.shape[:-1]) + [inter])


def gather_rows(x: paddle.Tensor, idx: np.ndarray) -> paddle.Tensor:
    """x[idx] [n, H], zero rows where idx < 0."""
    a = _rows(x)
    idx = np.ascontiguousarray(idx, dtype=np.int64)
    if idx.size and int(idx.max()) >= a.shape[0]:
        raise ValueError(f"gather_rows: index {int(idx.max())} past {a.shape[0]} rows")
    y, out = empty_host((idx.shape[0], a.shape[1]), np.float32)
    build.library().ernie_gather_rows(a.ctypes.data, idx.ctypes.data, idx.shape[0], a.shape[1], out.ctypes.data)
    return y


def weighted_combine(ys: paddle.Tensor, src: np.ndarray, weights: paddle.Tensor) -> paddle.Tensor:
    """out [T, H]: out[t] = sum_j weights[t, j] * ys[src[t, j]] over the choices with src >= 0."""
    a = _rows(ys)
    src = np.ascontiguousarray(src, dtype=np.int64)
    w = np.ascontiguousarray(np.from_dlpack(weights), dtype=np.float32)
    if src.shape != w.shape or (src.size and int(src.max()) >= a.shape[0]):
        raise ValueError(f"weighted_combine: sources {list(src.shape)} (max {int(src.max(initial=-1))}) do not fit "
                         f"weights {list(w.shape)} and {a.shape[0]} expert rows")
    t, k = src.shape
    y, out = empty_host((t, a.shape[1]), np.float32)
    build.library().ernie_weighted_combine(a.ctypes.data, src.ctypes.data, w.ctypes.data, t, k, a.shape[1], out.ctypes.data)
    return y


def route(x: paddle.Tensor, weight: paddle.Tensor, bias: paddle.Tensor, k: int,
          norm_min: float) -> tuple[paddle.Tensor, paddle.Tensor]:
    """model/moe.TopKRouter's choice in one pass: x [T, H], weight [H, E], bias [1, E] -> ids [T, k] int64,
    weights [T, k]."""
    a = _rows(x)
    h, e = weight.shape
    if a.shape[1] != h or bias.size != e or not 0 < k <= e:
        raise ValueError(f"route: x {list(a.shape)} does not fit a router of {h} x {e} choosing {k}")
    (ids, iv), (w, wv) = empty_host((a.shape[0], k), np.int64), empty_host((a.shape[0], k), np.float32)
    build.library().ernie_route(a.ctypes.data, weight.data_ptr(), bias.data_ptr(), a.shape[0], h, e, k, norm_min,
                        iv.ctypes.data, wv.ctypes.data)
    return ids, w
