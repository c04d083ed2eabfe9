"""Paddle CPU tensors from NumPy data, without Paddle's constructor leak.

With paddle 3.3.1 every eager tensor built from host data (`paddle.to_tensor`, `paddle.Tensor(...)`,
`paddle.utils.dlpack.from_dlpack`) leaks one Python list (its keyword names) that `gc` never frees
(tests/model/test_host_tensor.py counts the objects). The engine builds a few hundred small index tensors a step,
so a server's resident memory grew steadily. Tensors that ops create (`paddle.empty`) do not leak, so host data is
copied into one of those, through a writable NumPy view of its memory; producers that make a fresh array anyway
(gathers, unpacking) write straight into that view and pay no extra copy. Every hot-path NumPy -> Paddle conversion goes through here.
"""
from __future__ import annotations

import ctypes
import math
import mmap

import numpy as np
import paddle

_DTYPES = {np.dtype(np.float32): "float32", np.dtype(np.int64): "int64", np.dtype(np.int32): "int32",
           np.dtype(np.int16): "int16", np.dtype(np.int8): "int8", np.dtype(np.uint8): "uint8",
           np.dtype(np.bool_): "bool", np.dtype(np.float64): "float64"}


def empty_host(shape: tuple[int, ...] | list[int], dtype) -> tuple[paddle.Tensor, np.ndarray]:
    """A new CPU tensor and a writable NumPy view of its memory (valid while the tensor lives)."""
    dtype = np.dtype(dtype)
    shape = [int(s) for s in shape]
    t = paddle.empty(shape, dtype=_DTYPES[dtype])
    n = math.prod(shape) * dtype.itemsize  # not np.prod: its overhead was a large share of this hot function
    if n == 0:
        return t, np.empty(shape, dtype)
    buf = (ctypes.c_char * n).from_address(t.data_ptr())
    return t, np.frombuffer(buf, dtype=dtype).reshape(shape)


def to_paddle(a) -> paddle.Tensor:
    """A CPU tensor holding a copy of `a` (any array-like: lists of ints, views, non-contiguous arrays)."""
    a = np.asarray(a)
    if a.dtype not in _DTYPES:
        raise TypeError(f"no Paddle dtype for {a.dtype}")
    t, view = empty_host(a.shape, a.dtype)
    view[...] = a
    return t


_HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14


def empty_weight(shape: tuple[int, ...] | list[int], dtype) -> tuple[paddle.Tensor, np.ndarray]:
    """As empty_host, for a weight streamed every step (the serving layouts): its memory is asked for transparent
    huge pages before it is first written, so streaming it walks one page table entry per 2 MB instead of per
    4 KB; on a VM, where each TLB miss walks two page tables, the experts' decode GEMM read measurably faster from
    huge pages. Small weights and kernels without THP get ordinary memory."""
    dtype = np.dtype(dtype)
    shape = [int(s) for s in shape]
    nbytes = int(np.prod(shape)) * dtype.itemsize
    if nbytes < 4 * _HUGE_PAGE:
        return empty_host(shape, dtype)
    region = mmap.mmap(-1, nbytes + _HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(region))
    offset = (-addr) % _HUGE_PAGE
    try:
        ctypes.CDLL(None).madvise(ctypes.c_void_p(addr + offset), ctypes.c_size_t(nbytes), _MADV_HUGEPAGE)
    except (OSError, AttributeError):
        pass  # no madvise here: ordinary pages
    view = np.frombuffer(region, dtype=dtype, count=int(np.prod(shape)), offset=offset).reshape(shape)
    # zero-copy: the tensor holds the array, the array holds the mapping (one-off at load: the constructor
    # leak described above is one list per weight)
    return paddle.utils.dlpack.from_dlpack(view), view
