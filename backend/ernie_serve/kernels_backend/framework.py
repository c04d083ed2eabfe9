"""The one place the kernels backend touches a tensor framework: Paddle (production, paddlepaddle-gpu) or
torch (the GPU box this project borrows has torch and triton but no Paddle).

Everything else in the backend holds framework tensors opaquely and hands them to ernie_kernels, whose
launchers take both. What differs is only here: allocation, host <-> device copies, the dense matmul,
row gathers, the row-wise ops device sampling is written over, synchronization, memory figures and CUDA
graphs. On a machine without a GPU the same code runs on CPU tensors with the kernels in triton's interpreter
(TRITON_INTERPRET=1), in float32 (the 3.2 interpreter gets bf16 arithmetic wrong); on a GPU activations and float
weights are bfloat16.

ERNIE_TENSOR_FRAMEWORK=paddle|torch picks one; by default Paddle when it is installed, else torch.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import ml_dtypes
import numpy as np

from ..devices import FRAMEWORK_ENV, FRAMEWORKS, default_framework, installed



class TensorOps:
    """The operations the kernels backend needs from a framework (see the module doc)."""

    name: str
    on_gpu: bool

    @property
    def act_dtype(self) -> str:
        """Activations and float weights: bf16 on a GPU, fp32 in the interpreter."""
        return "bfloat16" if self.on_gpu else "float32"

    # ---- allocation and copies
    def tensor(self, a: np.ndarray, dtype: str | None = None) -> Any:
        """A new device tensor holding a copy of `a` (fp8 codes stay fp8), cast to `dtype` if given. The host copy
        comes first: checkpoint arrays may be read-only memory maps."""
        host = np.array(a, copy=True, order="C")
        carrier = _CARRIERS.get(host.dtype)  # fp8 and bf16 cross as same-size integers, then are viewed back
        t = self._from_host(host if carrier is None else host.view(carrier[0]))
        if carrier is not None:
            t = self._view(t, carrier[1])
        return t if dtype is None else self.cast(t, dtype)

    def _from_host(self, a: np.ndarray) -> Any:
        """A device tensor of a's dtype holding a's data (a is a fresh contiguous copy)."""
        raise NotImplementedError

    def _view(self, t: Any, dtype: str) -> Any:
        """t's bytes viewed as `dtype` (the same item size)."""
        raise NotImplementedError

    def empty(self, shape: Sequence[int], dtype: str) -> Any:
        raise NotImplementedError

    def zeros(self, shape: Sequence[int], dtype: str) -> Any:
        raise NotImplementedError

    def to_host(self, t: Any, keep_dtype: bool = False) -> np.ndarray:
        """A NumPy copy; floating tensors come back as float32 unless keep_dtype (bf16 / fp8 then come back as
        ml_dtypes arrays: KV blocks crossing in the cache's own format)."""
        raise NotImplementedError

    # ---- row-wise ops of [R, V] tensors for sampling on the device (kernels_backend/device_sampling.py); each
    # keeps the reduced dimension ([R, 1]) so the results broadcast against the rows
    def softmax_rows(self, t: Any) -> Any:
        raise NotImplementedError

    def log_softmax_rows(self, t: Any) -> Any:
        raise NotImplementedError

    def sort_rows_desc(self, t: Any) -> tuple[Any, Any]:
        """(values, int64 indices), each row in descending order."""
        raise NotImplementedError

    def cumsum_rows(self, t: Any) -> Any:
        raise NotImplementedError

    def cummax_rows(self, t: Any) -> Any:
        raise NotImplementedError

    def take_rows(self, t: Any, index: Any) -> Any:
        """t[r, index[r, j]] (take_along_axis on the last dimension)."""
        raise NotImplementedError

    def sum_rows(self, t: Any) -> Any:
        raise NotImplementedError

    def max_rows(self, t: Any) -> Any:
        """Each row's largest value (NaN where the row holds one)."""
        raise NotImplementedError

    def argmax_rows(self, t: Any) -> Any:
        """Each row's argmax, the first index of its largest value (int64)."""
        raise NotImplementedError

    def arange(self, n: int) -> Any:
        """[1, n] int64."""
        raise NotImplementedError

    def concat_rows(self, ts: Sequence[Any]) -> Any:
        """[sum R_i, V] from [R_i, V] tensors (the MTP drafts' q rows, gathered for verification)."""
        raise NotImplementedError

    def where(self, cond: Any, a: Any, b: Any) -> Any:
        raise NotImplementedError

    def concat_columns(self, ts: Sequence[Any]) -> Any:
        """[R, sum N_i] from [R, N_i] tensors (a vocab-parallel lm_head's logits, gathered in rank order)."""
        raise NotImplementedError

    def vocab_rows(self, table: Any, ids: Any, start: int) -> Any:
        """Rows ids - start of a vocab-parallel embedding table [V/N, H], zeros for ids outside [start, start + V/N)
        (other ranks' rows: the all-reduce adds them)."""
        raise NotImplementedError

    def write(self, dst: Any, a: np.ndarray) -> Any:
        """Copy host data into the leading rows of a persistent buffer; returns that view dst[:len(a)]."""
        n = int(a.shape[0])
        view = dst[:n]
        if n:
            self._write_rows(dst, view, np.ascontiguousarray(a, dtype=np.dtype(dtype_name(dst))))
        return view

    def _write_rows(self, dst: Any, view: Any, a: np.ndarray) -> None:
        """Copy a (dst's dtype, contiguous) into view, the leading len(a) rows of the contiguous buffer dst."""
        raise NotImplementedError

    # ---- math the kernels do not cover
    def matmul(self, x: Any, w: Any) -> Any:
        """x [T, K] @ w [K, N], in x's dtype (cuBLAS / MKL: dense float weights need no kernel of ours)."""
        raise NotImplementedError

    def matmul_nt(self, x: Any, w: Any) -> Any:
        """x [T, K] @ w [N, K]^T (a tied lm_head reads the embedding table as it is)."""
        raise NotImplementedError

    def rows(self, t: Any, index: Any) -> Any:
        """t[index] for an integer index tensor (embedding lookups, picking sampled rows)."""
        raise NotImplementedError

    def put_rows(self, t: Any, index: Any, values: Any) -> Any:
        """A copy of t with t[index] = values along the first dimension (distinct int64 indices; the sampler's
        penalties and masks on flat logits, grammar masks on whole rows)."""
        raise NotImplementedError

    def put_rows_(self, t: Any, index: Any, values: Any) -> None:
        """t[index] = values along the first dimension, in place (distinct int64 indices): KV blocks, whose tensors
        CUDA graphs and the kernels hold by address."""
        raise NotImplementedError

    def heads(self, fused: Any, col: int, num_heads: int, head_dim: int) -> Any:
        """Columns [col, col + num_heads * head_dim) of fused [T, W] as [T, num_heads, head_dim] (a view where
        the framework allows; the kernels take any token and head strides)."""
        raise NotImplementedError

    def cast(self, t: Any, dtype: str) -> Any:
        raise NotImplementedError

    def add_(self, dst: Any, src: Any) -> Any:
        raise NotImplementedError

    def copy_(self, dst: Any, src: Any) -> None:
        raise NotImplementedError

    # ---- device
    def synchronize(self) -> None:
        pass

    def memory_info(self) -> tuple[int, int]:
        """(free, total) bytes of device memory."""
        raise NotImplementedError

    def multiprocessor_count(self) -> int:
        """The GPU's SMs (what split-KV attention fills); 0 off a GPU."""
        return 0

    def device_count(self) -> int:
        """GPUs this process sees (0 off a GPU): a tensor-parallel engine needs one per rank."""
        return 0

    def device_capability(self) -> tuple[int, int] | None:
        """The GPU's compute capability ((9, 0) on Hopper); None off a GPU."""
        return None

    def device_name(self) -> str:
        return "CPU"

    def allocated(self) -> int:
        """Bytes this framework's allocator holds for tensors on the device now."""
        raise NotImplementedError

    def reset_peak(self) -> None:
        raise NotImplementedError

    def peak_allocated(self) -> int:
        """The most bytes allocated at once on the device since reset_peak."""
        raise NotImplementedError

    def release_cached(self) -> None:
        """Hand the allocator's cached, unused blocks back to the driver, so that free memory reads true (before the
        KV pool is sized) and a graph pool can take what a profile run left cached."""

    def graph_pool(self) -> Any:
        """A new memory pool handle for CUDA graphs to share: captured largest first, each later graph reuses the
        pool's memory instead of holding a private pool of its own."""
        raise NotImplementedError

    def cuda_graph(self, pool: Any = None) -> "Graph":
        """A graph that captures into `pool` (graph_pool's), or a private pool when None."""
        raise NotImplementedError

    @staticmethod
    def nbytes(t: Any) -> int:
        return int(np.prod([int(s) for s in t.shape])) * int(t.element_size())

    # -- top-k (logprobs without a full sort of the vocabulary)
    def topk_rows(self, t: Any, k: int) -> tuple[Any, Any]:
        """(the k largest values of each row, largest first, their int64 column indices); k >= 1. Which of equal
        values is taken is the framework's choice (callers rank ties by value)."""
        raise NotImplementedError


class Graph:
    """A captured CUDA graph: capture(fn) runs fn once under capture, replay() reruns its kernels on
    whatever the persistent buffers it read hold now."""

    def capture(self, fn: Callable[[], Any]) -> Any:
        raise NotImplementedError

    def replay(self) -> None:
        raise NotImplementedError


# host dtypes NumPy frameworks cannot take: (the integer dtype they cross as, the framework dtype viewed back)
_CARRIERS = {np.dtype(ml_dtypes.float8_e4m3fn): (np.uint8, "float8_e4m3fn"),
             np.dtype(ml_dtypes.bfloat16): (np.int16, "bfloat16")}
_HOST_CARRIERS = {name: (np.dtype(carrier).name, host.type) for host, (carrier, name) in _CARRIERS.items()}


def dtype_name(t: Any) -> str:
    """'int64', 'float32', 'bfloat16', ... for torch and Paddle tensors alike."""
    return str(t.dtype).split(".")[-1]


class TorchOps(TensorOps):
    name = "torch"

    def __init__(self, device_index: int = 0):
        import torch

        self.torch = torch
        self.on_gpu = torch.cuda.is_available()
        self.device = torch.device("cuda", device_index) if self.on_gpu else torch.device("cpu")
        if self.on_gpu:
            torch.cuda.set_device(self.device)  # triton launches on the current device

    def _dtype(self, name: str):
        return getattr(self.torch, name)

    def _from_host(self, a):
        return self.torch.from_numpy(a).to(self.device)

    def _view(self, t, dtype):
        return t.view(self._dtype(dtype))

    def empty(self, shape, dtype):
        return self.torch.empty([int(s) for s in shape], dtype=self._dtype(dtype), device=self.device)

    def zeros(self, shape, dtype):
        return self.torch.zeros([int(s) for s in shape], dtype=self._dtype(dtype), device=self.device)

    def to_host(self, t, keep_dtype=False):
        name = dtype_name(t)
        if name == "float8_e4m3fn" or (keep_dtype and name == "bfloat16"):
            carrier, host = _HOST_CARRIERS[name]
            return t.view(self._dtype(carrier)).cpu().numpy().view(host)
        if t.is_floating_point() and not keep_dtype:
            t = t.float()
        return t.detach().cpu().numpy()

    def softmax_rows(self, t):
        return self.torch.softmax(t, dim=1)

    def log_softmax_rows(self, t):
        return self.torch.log_softmax(t, dim=1)

    def sort_rows_desc(self, t):
        return self.torch.sort(t, dim=1, descending=True)

    def cumsum_rows(self, t):
        return self.torch.cumsum(t, dim=1)

    def cummax_rows(self, t):
        return self.torch.cummax(t, dim=1).values

    def take_rows(self, t, index):
        return self.torch.gather(t, 1, index)

    def sum_rows(self, t):
        return t.sum(dim=1, keepdim=True)

    def max_rows(self, t):
        return self.torch.amax(t, dim=1, keepdim=True)  # a NaN is the largest value, as NumPy's max has it

    def argmax_rows(self, t):
        return self.torch.argmax(t, dim=1, keepdim=True)

    def arange(self, n):
        return self.torch.arange(n, device=self.device).reshape(1, n)

    def concat_rows(self, ts):
        return self.torch.cat(list(ts), dim=0)

    def where(self, cond, a, b):
        return self.torch.where(cond, a, b)

    def concat_columns(self, ts):
        return self.torch.cat(list(ts), dim=1)

    def vocab_rows(self, table, ids, start):
        local = ids - start
        inside = (local >= 0) & (local < table.shape[0])
        out = self.torch.index_select(table, 0, self.torch.where(inside, local, 0))
        return out * inside.unsqueeze(1).to(out.dtype)

    def _write_rows(self, dst, view, a):
        view.copy_(self.torch.from_numpy(a))

    def matmul(self, x, w):
        return self.torch.matmul(x, w)

    def matmul_nt(self, x, w):
        return self.torch.matmul(x, w.t())

    def rows(self, t, index):
        return self.torch.index_select(t, 0, index)

    def put_rows(self, t, index, values):
        return t.index_copy(0, index, values)

    def put_rows_(self, t, index, values):
        t.index_copy_(0, index, values)

    def heads(self, fused, col, num_heads, head_dim):
        return fused[:, col:col + num_heads * head_dim].view(fused.shape[0], num_heads, head_dim)

    def cast(self, t, dtype):
        return t.to(self._dtype(dtype))

    def add_(self, dst, src):
        return dst.add_(src)

    def copy_(self, dst, src):
        dst.copy_(src)

    def synchronize(self):
        if self.on_gpu:
            self.torch.cuda.synchronize()

    def memory_info(self):
        if not self.on_gpu:
            raise RuntimeError("device memory figures need a GPU")
        free, total = self.torch.cuda.mem_get_info(self.device)
        return int(free), int(total)

    def multiprocessor_count(self):
        return int(self.torch.cuda.get_device_properties(self.device).multi_processor_count) if self.on_gpu else 0

    def device_count(self):
        return int(self.torch.cuda.device_count()) if self.on_gpu else 0

    def device_capability(self):
        return tuple(self.torch.cuda.get_device_capability(self.device)) if self.on_gpu else None

    def device_name(self):
        return self.torch.cuda.get_device_name(self.device) if self.on_gpu else "CPU"

    def allocated(self):
        return int(self.torch.cuda.memory_allocated(self.device)) if self.on_gpu else 0

    def reset_peak(self):
        if self.on_gpu:
            self.torch.cuda.reset_peak_memory_stats(self.device)

    def peak_allocated(self):
        return int(self.torch.cuda.max_memory_allocated(self.device)) if self.on_gpu else 0

    def release_cached(self):
        if self.on_gpu:
            self.torch.cuda.empty_cache()

    def graph_pool(self):
        return self.torch.cuda.graph_pool_handle()

    def cuda_graph(self, pool=None):
        return _TorchGraph(self.torch, pool)

    # -- top-k
    def topk_rows(self, t, k):
        return self.torch.topk(t, k, dim=1, largest=True, sorted=True)


class _TorchGraph(Graph):
    def __init__(self, torch, pool):
        self.torch = torch
        self.graph = torch.cuda.CUDAGraph()
        self.pool = pool

    def capture(self, fn):
        torch = self.torch
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm up off the default stream: triton compiles, allocators settle
            fn()
        torch.cuda.current_stream().wait_stream(stream)
        with torch.cuda.graph(self.graph, pool=self.pool):
            out = fn()
        return out

    def replay(self):
        self.graph.replay()


class PaddleOps(TensorOps):
    name = "paddle"

    def __init__(self, device_index: int = 0):
        import paddle

        self.paddle = paddle
        self.on_gpu = paddle.is_compiled_with_cuda() and paddle.device.cuda.device_count() > 0
        self.place = paddle.CUDAPlace(device_index) if self.on_gpu else paddle.CPUPlace()
        if self.on_gpu:
            paddle.set_device(f"gpu:{device_index}")  # triton's launches (through Paddle's compat driver) go here

    def _from_host(self, a):
        if self.on_gpu:
            return self.paddle.to_tensor(a, place=self.place)
        from ..host_tensor import to_paddle  # Paddle's own constructors leak a list per call on CPU

        return to_paddle(a)

    def _view(self, t, dtype):
        return t.view(getattr(self.paddle, dtype))

    def empty(self, shape, dtype):
        return self.paddle.empty([int(s) for s in shape], dtype=dtype, device=self.place)

    def zeros(self, shape, dtype):
        return self.paddle.zeros([int(s) for s in shape], dtype=dtype, device=self.place)

    def to_host(self, t, keep_dtype=False):
        name = dtype_name(t)
        if name == "float8_e4m3fn" or (keep_dtype and name == "bfloat16"):
            carrier, host = _HOST_CARRIERS[name]
            return t.view(getattr(self.paddle, carrier)).numpy().view(host)
        if t.is_floating_point() and not keep_dtype:
            t = t.astype("float32")
        return t.numpy()

    def softmax_rows(self, t):
        return self.paddle.nn.functional.softmax(t, axis=1)

    def log_softmax_rows(self, t):
        return self.paddle.nn.functional.log_softmax(t, axis=1)

    def sort_rows_desc(self, t):
        index = self.paddle.argsort(t, axis=1, descending=True)
        return self.paddle.take_along_axis(t, index, axis=1), index

    def cumsum_rows(self, t):
        return self.paddle.cumsum(t, axis=1)

    def cummax_rows(self, t):
        return self.paddle.cummax(t, axis=1)[0]

    def take_rows(self, t, index):
        return self.paddle.take_along_axis(t, index, axis=1)

    def sum_rows(self, t):
        return t.sum(axis=1, keepdim=True)

    def max_rows(self, t):
        return self.paddle.max(t, axis=1, keepdim=True)

    def argmax_rows(self, t):
        return self.paddle.argmax(t, axis=1, keepdim=True)

    def arange(self, n):
        return self.paddle.arange(n, dtype="int64", device=self.place).reshape([1, n])

    def concat_rows(self, ts):
        return self.paddle.concat(list(ts), axis=0)

    def where(self, cond, a, b):
        return self.paddle.where(cond, a, b)

    def concat_columns(self, ts):
        return self.paddle.concat(list(ts), axis=1)

    def vocab_rows(self, table, ids, start):
        local = ids - start
        inside = (local >= 0) & (local < table.shape[0])
        out = self.paddle.index_select(table, self.paddle.where(inside, local, self.paddle.zeros_like(local)))
        return out * inside.unsqueeze(1).astype(out.dtype)

    def _write_rows(self, dst, view, a):
        if self.on_gpu:  # staged in a CPU tensor (host_tensor places it there explicitly), then copied up
            from ..host_tensor import to_paddle

            view.copy_(to_paddle(a), blocking=True)
        else:  # straight into the CPU buffer's memory: no Paddle constructor on the step path
            _numpy_view(dst)[: a.shape[0]] = a

    def matmul(self, x, w):
        return self.paddle.matmul(x, w)

    def matmul_nt(self, x, w):
        return self.paddle.matmul(x, w, transpose_y=True)

    def rows(self, t, index):
        return self.paddle.gather(t, index)  # index_select has no CPU int8 kernel (C8 KV blocks)

    def put_rows(self, t, index, values):
        return self.paddle.scatter(t, index, values, overwrite=True)

    def put_rows_(self, t, index, values):
        t.index_put_((index,), values)  # scatter_ has no CPU int8 / bfloat16 kernel

    def heads(self, fused, col, num_heads, head_dim):
        return fused[:, col:col + num_heads * head_dim].reshape([fused.shape[0], num_heads, head_dim])

    def cast(self, t, dtype):
        return t.astype(dtype)

    def add_(self, dst, src):
        return dst.add_(src)

    def copy_(self, dst, src):
        dst.copy_(src, blocking=True)

    def synchronize(self):
        if self.on_gpu:
            self.paddle.device.synchronize()

    def memory_info(self):
        if not self.on_gpu:
            raise RuntimeError("device memory figures need a GPU")
        free, total = self.paddle.cuda.mem_get_info(self.place)
        return int(free), int(total)

    def release_cached(self):
        if self.on_gpu:
            self.paddle.device.cuda.empty_cache()

    def multiprocessor_count(self):
        cuda = self.paddle.device.cuda
        return int(cuda.get_device_properties(self.place).multi_processor_count) if self.on_gpu else 0

    def device_count(self):
        return int(self.paddle.device.cuda.device_count()) if self.on_gpu else 0

    def device_capability(self):
        return tuple(self.paddle.device.cuda.get_device_capability(self.place)) if self.on_gpu else None

    def device_name(self):
        return self.paddle.device.cuda.get_device_name(self.place) if self.on_gpu else "CPU"

    def allocated(self):
        return int(self.paddle.device.cuda.memory_allocated(self.place)) if self.on_gpu else 0

    def reset_peak(self):
        if self.on_gpu:
            self.paddle.device.cuda.reset_max_memory_allocated(self.place)

    def peak_allocated(self):
        return int(self.paddle.device.cuda.max_memory_allocated(self.place)) if self.on_gpu else 0

    def graph_pool(self):
        from paddle.base.core import CUDAGraph

        return CUDAGraph.gen_new_memory_pool_id()

    def cuda_graph(self, pool=None):
        return _PaddleGraph(self.place, pool)

    # -- top-k
    def topk_rows(self, t, k):
        return self.paddle.topk(t, k, axis=1, largest=True, sorted=True)


class _PaddleGraph(Graph):
    def __init__(self, place, pool):
        from paddle.device.cuda.graphs import CUDAGraph

        self.graph = CUDAGraph(place=place, pool_id=pool)  # without a place: FLAGS_selected_gpus, i.e. GPU 0

    def capture(self, fn):
        fn()  # warm-up: triton compiles outside the capture
        self.graph.capture_begin()
        try:
            out = fn()
        finally:
            self.graph.capture_end()
        return out

    def replay(self):
        self.graph.replay()


def _numpy_view(t: Any) -> np.ndarray:
    """A writable NumPy view of a contiguous CPU tensor's memory (np.from_dlpack's is read-only)."""
    import ctypes

    dtype = np.dtype(dtype_name(t))
    n = int(np.prod([int(s) for s in t.shape])) * dtype.itemsize
    buf = (ctypes.c_char * n).from_address(t.data_ptr())
    return np.frombuffer(buf, dtype=dtype).reshape([int(s) for s in t.shape])


def make_tensor_ops(name: str | None = None, device_index: int = 0) -> TensorOps:
    """The framework named (or the default one, see default_framework), on GPU `device_index` when there is one
    (a tensor-parallel rank's own GPU)."""
    name = name or default_framework()
    if name not in FRAMEWORKS:
        raise ValueError(f"{FRAMEWORK_ENV}={name!r}: supported: {', '.join(FRAMEWORKS)}")
    if not installed(name):
        raise ValueError(f"{FRAMEWORK_ENV}={name!r} but {name} is not installed")
    return PaddleOps(device_index) if name == "paddle" else TorchOps(device_index)
