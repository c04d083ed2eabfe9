"""Attention of each sequence's new rows over its paged float32 or bfloat16 KV cache, in one C call per layer
(cpu_attention.c).

model/attention.paged_attention runs its decodes (one to a few query rows each) here in inference on a float
CPU cache, and the prefill chunks too when all are short; long chunks keep the tiled Paddle path, whose
matmuls are the faster way to do their many rows.
"""
from __future__ import annotations

import numpy as np
import paddle

from ..host_tensor import empty_host
from ..kv_blocks import CODE_DTYPES
from . import build



FLOAT_CACHES = (CODE_DTYPES["float32"], CODE_DTYPES["bfloat16"])  # the cache dtypes the kernel reads


def available() -> bool:
    return build.available()


def paged_attention(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, block_tables: np.ndarray,
                     query_start_loc: np.ndarray, seq_lens: np.ndarray, scale: float) -> paddle.Tensor:
    """q [T, heads, head_dim] float32 (sequence s's rows at query_start_loc[s]..[s+1]), caches [num_blocks,
    block_size, kv_heads, head_dim] float32 or bfloat16, block_tables [S, nb] -> [T, heads * head_dim] float32."""
    lib = build.library()
    t, nh, hd = q.shape
    nblocks, bs, nkv, hd_cache = k_cache.shape
    num_seqs = seq_lens.shape[0]
    if (hd_cache != hd or nh % nkv or v_cache.shape != k_cache.shape or k_cache.dtype not in FLOAT_CACHES
            or v_cache.dtype != k_cache.dtype
            or q.dtype != np.float32 or query_start_loc.shape != (num_seqs + 1,) or int(query_start_loc[-1]) != t
            or block_tables.shape[0] != num_seqs or block_tables.shape[1] * bs < int(seq_lens.max(initial=0))):
        raise ValueError(f"paged_attention: q {list(q.shape)} {q.dtype} does not fit a {k_cache.dtype} cache "
                         f"{list(k_cache.shape)} with {num_seqs} sequences, tables {list(block_tables.shape)}")
    q = np.ascontiguousarray(q)
    tables = np.ascontiguousarray(block_tables, dtype=np.int64)
    qsl = np.ascontiguousarray(query_start_loc, dtype=np.int64)
    lens = np.ascontiguousarray(seq_lens, dtype=np.int64)
    y, out = empty_host((t, nh * hd), np.float32)
    rc = lib.ernie_paged_attention(q.ctypes.data, k_cache.ctypes.data, v_cache.ctypes.data,
                                   int(k_cache.dtype == CODE_DTYPES["bfloat16"]), tables.ctypes.data, tables.shape[1],
                                   qsl.ctypes.data, lens.ctypes.data, num_seqs, nh, nkv, hd, bs, scale, out.ctypes.data)
    if rc != 0:
        raise MemoryError("paged_attention: no memory for the kernel's work buffers")
    return y
