"""Paddle CPU tensors from NumPy data, without Paddle's constructor leak.

With paddle 3.3.1 every eager tensor built from host data (`paddle.to_tensor`, `paddle.Tensor(...)`,
`paddle.utils.dlpack.from_dlpack`) leaks one Python list (its keyword names) that `gc` never frees
(tests/core/test_host_tensor.py counts the objects). The engine builds a few hundred small index tensors a step,
so a server's resident memory grew steadily. Tensors that ops create (`paddle.empty`) do not leak, so host data is
copied into one of those, through a writable NumPy view of its memory; producers that make a fresh array anyway
(gathers, unpacking) write straight into that view and pay no extra copy. Every hot-path NumPy -> Paddle conversion goes through here.

Every tensor here is placed on the CPU explicitly: after `paddle.set_device("gpu:N")` (the kernels backend on a GPU)
Paddle's default place is the GPU, and writing host data through a device address faults
(tests/kernels_backend/test_paddle_gpu_place.py runs these under a Paddle whose default place refuses host writes).
"""
from __future__ import annotations

import ctypes
import math
import mmap
import threading

import numpy as np
import paddle

_DTYPES = {np.dtype(np.float32): "float32", np.dtype(np.int64): "int64", np.dtype(np.int32): "int32",
           np.dtype(np.int16): "int16", np.dtype(np.int8): "int8", np.dtype(np.uint8): "uint8",
           np.dtype(np.bool_): "bool", np.dtype(np.float64): "float64"}
_CPU = paddle.CPUPlace()  # a Place object, not "cpu": Paddle parses a device string on every call


def empty_host(shape: tuple[int, ...] | list[int], dtype) -> tuple[paddle.Tensor, np.ndarray]:
    """A new CPU tensor and a writable NumPy view of its memory (valid while the tensor lives)."""
    dtype = np.dtype(dtype)
    shape = [int(s) for s in shape]
    t = paddle.empty(shape, dtype=_DTYPES[dtype], device=_CPU)
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
_OWN_MAPPING = 4 * _HUGE_PAGE  # weights this large get a mapping each; smaller ones share the arena's
_ARENA_MIN = 256 << 10  # below this, ordinary memory: norms, routers, a tiny model's layers
_ARENA_CHUNK = 32 * _HUGE_PAGE


def _huge_page_mapping(nbytes: int) -> tuple[mmap.mmap, int]:
    """An anonymous mapping with a 2 MB-aligned run of `nbytes` asked for transparent huge pages (before it is
    first written, so its pages fault in huge), and that run's offset in it."""
    region = mmap.mmap(-1, nbytes + _HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(region))
    offset = (-addr) % _HUGE_PAGE
    try:
        ctypes.CDLL(None).madvise(ctypes.c_void_p(addr + offset), ctypes.c_size_t(nbytes), _MADV_HUGEPAGE)
    except (OSError, AttributeError):
        pass  # no madvise here: ordinary pages
    return region, offset


class _WeightArena:
    """Weights under _OWN_MAPPING carved one after another from shared huge-page mappings of _ARENA_CHUNK bytes.
    A mapping each would round each one's last huge page up (a 1.4 MB int8 expert would hold 2 MB), and ordinary
    memory puts them on 4 KB pages: the wint8 experts and the bfloat16 attention and shared-expert weights are such
    sizes. Nothing returns to the arena: a mapping is unmapped when the last view into it (and the arena, for the
    current one) lets go, as weights live as long as their model."""

    def __init__(self):
        self._lock = threading.Lock()
        self._region: mmap.mmap | None = None
        self._next = self._end = 0

    def take(self, nbytes: int) -> tuple[mmap.mmap, int]:
        """A mapping and the offset of `nbytes` of it no one else holds, 4 KB-aligned."""
        with self._lock:
            if self._region is None or self._next + nbytes > self._end:
                self._region, self._next = _huge_page_mapping(_ARENA_CHUNK)
                self._end = self._next + _ARENA_CHUNK
            offset = self._next
            self._next += -(-nbytes // 4096) * 4096
            return self._region, offset


_ARENA = _WeightArena()


def empty_weight(shape: tuple[int, ...] | list[int], dtype) -> tuple[paddle.Tensor, np.ndarray]:
    """As empty_host, for a weight streamed every step (the serving layouts): in transparent huge pages, so
    streaming it walks one page table entry per 2 MB instead of per 4 KB (under a hypervisor each TLB miss walks
    two page tables); a wint8 decode step is faster with its experts' codes there (scripts/bench_cpu_dtypes.py
    --formats wint8-bf16 re-checks it). Small weights and kernels without THP get ordinary memory."""
    dtype = np.dtype(dtype)
    shape = [int(s) for s in shape]
    count = math.prod(shape)
    nbytes = count * dtype.itemsize
    if nbytes < _ARENA_MIN:
        return empty_host(shape, dtype)
    region, offset = _huge_page_mapping(nbytes) if nbytes >= _OWN_MAPPING else _ARENA.take(nbytes)
    view = np.frombuffer(region, dtype=dtype, count=count, offset=offset).reshape(shape)
    # zero-copy: the tensor holds the array, the array holds the mapping (once per weight at load: the constructor
    # leak described above is one list per weight)
    return paddle.utils.dlpack.from_dlpack(view), view


def zeros_huge(shape: tuple[int, ...] | list[int], dtype) -> np.ndarray:
    """Zeros for a large pool a step reads scattered (the paged KV cache), in transparent huge pages: an anonymous
    mapping reads as zeros and takes memory only where written (2 MB at a time here), as np.zeros does, but np.zeros'
    pages are 4 KB (NumPy asks for huge pages for np.empty, not for zeros). Attention reads a cold cache a few KB a
    sequence at a time, a page walk each 4 KB page, so a decode step on a few hundred tokens a sequence is faster
    with its cache here (scripts/bench_cpu_dtypes.py re-checks it)."""
    dtype = np.dtype(dtype)
    count = math.prod(int(s) for s in shape)
    if count * dtype.itemsize < _OWN_MAPPING:
        return np.zeros(shape, dtype)
    region, offset = _huge_page_mapping(count * dtype.itemsize)
    return np.frombuffer(region, dtype=dtype, count=count, offset=offset).reshape(shape)
