"""The paged KV cache as device tensors: per layer K and V [num_blocks, block_size, kv_heads, head_dim], in
the activation dtype, or int8 for the C8 cache with static channel-wise scales [kv_heads * head_dim] (from
the checkpoint) or dynamic per-(block, kv head) scales [num_blocks, kv_heads] that the KV-write kernel
keeps up to date. The interface is model/kv_cache.PagedKVCache's where the engine uses it: whole-block
reads and writes in float32 on the host, and whole blocks as stored (export / import: prefill/decode KV transfer and
the CPU tier, host_tier.py). Every block move is one gather or one in-place scatter a layer for all its blocks, and
a device-to-device copy never leaves the device.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ..kv_blocks import KVBlocks
from ..quantization import formats as fmt
from .framework import TensorOps, dtype_name


class DeviceKVCache:
    def __init__(self, ops: TensorOps, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, int8: bool = False, static_scales: tuple[list[Any], list[Any]] | None = None):
        self.ops = ops
        self.num_layers, self.num_blocks, self.block_size = num_layers, num_blocks, block_size
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        shape = [num_blocks, block_size, num_kv_heads, head_dim]
        self.int8 = int8
        self.k = [ops.zeros(shape, self.code_dtype) for _ in range(num_layers)]
        self.v = [ops.zeros(shape, self.code_dtype) for _ in range(num_layers)]
        self.static = static_scales
        self.dynamic = None
        if int8 and static_scales is None:
            self.dynamic = [[ops.zeros([num_blocks, num_kv_heads], "float32") for _ in range(2)]
                            for _ in range(num_layers)]

    @property
    def code_dtype(self) -> str:
        """What a block is stored as: int8 codes for C8, else the activation dtype."""
        return "int8" if self.int8 else self.ops.act_dtype

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, itemsize: int) -> int:
        return 2 * num_layers * block_size * num_kv_heads * head_dim * itemsize

    def scales(self, layer: int) -> tuple[Any, Any]:
        """(k_scale, v_scale) as the kernels take them; (None, None) for a float cache."""
        if self.static is not None:
            return self.static[0][layer], self.static[1][layer]
        if self.dynamic is not None:
            return self.dynamic[layer][0], self.dynamic[layer][1]
        return None, None

    def _rows(self, t: Any, ids: list[int], keep_dtype: bool = False) -> np.ndarray:
        """Host copy of t[ids], all blocks in one gather."""
        return self.ops.to_host(self.ops.rows(t, self.ops.tensor(np.asarray(ids, np.int64))), keep_dtype)

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        """Blocks dst[i] = src[i] on the device, codes and dynamic scales as stored (dst distinct, and no dst among
        the src: the caller splits chains)."""
        if not src:
            return
        ops = self.ops
        s, d = ops.tensor(np.asarray(src, np.int64)), ops.tensor(np.asarray(dst, np.int64))
        stores = [*self.k, *self.v, *(scale for pair in (self.dynamic or []) for scale in pair)]
        for store in stores:
            ops.put_rows_(store, d, ops.rows(store, s))

    # ---- whole blocks as stored (prefill/decode transfer): codes in the cache's dtype, C8 scales with them
    @property
    def scale_kind(self) -> str | None:
        return "static" if self.static is not None else ("dynamic" if self.dynamic is not None else None)

    def _static_scales(self) -> np.ndarray:
        """[layers, 2, kv_heads, head_dim]."""
        shape = (self.num_kv_heads, self.head_dim)
        return np.stack([np.stack([self.ops.to_host(self.static[j][layer]).reshape(shape) for j in range(2)])
                         for layer in range(self.num_layers)])

    def read_stored(self, block_ids: list[int]) -> tuple[np.ndarray, np.ndarray | None]:
        """Blocks as stored: codes [layers, 2, n, block_size, kv_heads, head_dim] in code_dtype, and dynamic C8's
        scales [layers, 2, n, kv_heads] (None for the other formats)."""
        codes = np.stack([np.stack([self._rows(store, block_ids, keep_dtype=True) for store in (self.k[i], self.v[i])])
                          for i in range(self.num_layers)])
        if self.dynamic is None:
            return codes, None
        return codes, np.stack([np.stack([self._rows(s, block_ids) for s in pair]) for pair in self.dynamic])

    def write_stored(self, block_ids: list[int], codes: np.ndarray, dynamic_scales: np.ndarray | None) -> None:
        """The inverse of read_stored: codes already in this cache's format, written as they are."""
        ids = np.asarray(block_ids, dtype=np.int64)
        for layer in range(self.num_layers):
            for j, store in enumerate((self.k[layer], self.v[layer])):
                self._put_rows(store, ids, codes[layer, j])
                if self.dynamic is not None:
                    self._put_rows(self.dynamic[layer][j], ids, dynamic_scales[layer, j])

    def export_blocks(self, block_ids: list[int]) -> KVBlocks:
        codes, scales = self.read_stored(block_ids)
        kind = self.scale_kind
        return KVBlocks(codes, kind, self._static_scales() if kind == "static" else scales)

    def import_blocks(self, block_ids: list[int], blocks: KVBlocks) -> None:
        """Codes stored as they came when this cache has their format, else through float32."""
        kind = self.scale_kind
        static = self._static_scales() if kind == "static" else None
        if not blocks.stored_as_is_by(self.code_dtype, kind, static):
            return self.write_blocks(block_ids, blocks.to_float32())
        self.write_stored(block_ids, blocks.codes, blocks.scales if kind == "dynamic" else None)

    def read_blocks(self, block_ids: list[int]) -> np.ndarray:
        """[num_layers, 2, n, block_size, kv_heads, head_dim] float32 host copy (dequantized for C8)."""
        out = np.empty((self.num_layers, 2, len(block_ids), self.block_size, self.num_kv_heads, self.head_dim),
                       np.float32)
        for layer in range(self.num_layers):
            for j, store in enumerate((self.k[layer], self.v[layer])):
                out[layer, j] = self._dequantize(layer, j, self._rows(store, block_ids), block_ids)
        return out

    def _dequantize(self, layer: int, j: int, codes: np.ndarray, block_ids: list[int]) -> np.ndarray:
        if not self.int8:
            return codes
        if self.static is not None:
            return fmt.dequantize_kv_static(codes, self.ops.to_host(self.static[j][layer]))
        return fmt.dequantize_kv_dynamic(codes, self._rows(self.dynamic[layer][j], block_ids))

    def write_blocks(self, block_ids: list[int], data: np.ndarray) -> None:
        """Overwrite whole blocks from a read_blocks-shaped float32 array."""
        ids = np.asarray(block_ids, dtype=np.int64)
        for layer in range(self.num_layers):
            for j, store in enumerate((self.k[layer], self.v[layer])):
                x = data[layer, j]
                if not self.int8:
                    codes = x
                elif self.static is not None:
                    codes = fmt.quantize_kv_static(x, self.ops.to_host(self.static[j][layer]))
                else:
                    codes, s = fmt.quantize_kv_dynamic(x)
                    self._put_rows(self.dynamic[layer][j], ids, np.where(np.abs(x).max(axis=(1, 3)) > 0, s, 0.0))
                self._put_rows(store, ids, codes)

    def _put_rows(self, t: Any, ids: np.ndarray, rows: np.ndarray) -> None:
        """t[ids] = rows in place, all blocks in one scatter."""
        self.ops.put_rows_(t, self.ops.tensor(ids), self.ops.tensor(rows, dtype_name(t)))
