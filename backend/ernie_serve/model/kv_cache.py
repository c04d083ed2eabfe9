"""Paged KV cache storage: one [num_blocks, block_size, kv_heads, head_dim] array per layer for K and V, float32 or
bfloat16 (with --dtype bfloat16: half the bytes; values cross the interface as float32, rounded to nearest even on
the way in).

The engine's block manager hands out block ids; this class only stores what those blocks hold.
On CPU the arrays are numpy and reach Paddle through zero-copy DLPack views: a block gather is
several times faster with np.take than with paddle.index_select, and the decode step gathers
every running sequence's blocks in every layer.

With a KVCacheQuant the arrays are int8 (the C8 cache, a quarter of the bytes): per-channel static
scales from the checkpoint (`cachek_matmul.activation_scale`), or, without them, one dynamic scale per
(block, kv head) that grows as the block fills. The interface is the same; K/V cross it as float32.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import paddle

from ..host_tensor import to_paddle, zeros_huge
from ..kv_blocks import CODE_DTYPES, KVBlocks
from ..quantization import formats as fmt


@dataclass
class KVCacheQuant:
    """C8 KV cache settings. k_scales / v_scales: one f32 [kv_heads * head_dim] per layer (static
    channel-wise absmax), or None for dynamic per-block scales."""

    k_scales: list[np.ndarray] | None = None
    v_scales: list[np.ndarray] | None = None

    @property
    def static(self) -> bool:
        return self.k_scales is not None


class PagedKVCache:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 quant: KVCacheQuant | None = None, dtype: str = "float32"):
        """`dtype`: a float cache's ("float32" / "bfloat16"); a KVCacheQuant makes it int8 whatever this says."""
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.quant = quant
        self.code_dtype = CODE_DTYPES["int8" if quant is not None else dtype]
        # untouched pages are mapped lazily, so a large pool costs memory only as it fills
        self.k = [zeros_huge(shape, self.code_dtype) for _ in range(num_layers)]
        self.v = [zeros_huge(shape, self.code_dtype) for _ in range(num_layers)]
        if quant is not None:
            self._int8 = _Int8Storage(self, quant)

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                        int8: bool = False, dtype: str = "float32") -> int:
        code_bytes = CODE_DTYPES["int8" if int8 else dtype].itemsize
        return 2 * num_layers * block_size * num_kv_heads * head_dim * code_bytes

    @staticmethod
    def host_dtype(dtype: str, int8: bool = False) -> str:
        """The CPU swap tier's dtype for a cache of `dtype` (int8: C8): a float cache's own, a C8 cache's float32."""
        return "float32" if int8 else dtype

    def write(self, layer: int, slots: np.ndarray, k: paddle.Tensor, v: paddle.Tensor) -> None:
        """Store the new tokens' K/V ([T, kv_heads, head_dim]) at their flat slot ids."""
        if self.quant is not None:
            return self._int8.write(layer, slots, k.numpy(), v.numpy())
        flat = (-1, self.num_kv_heads, self.head_dim)
        self.k[layer].reshape(flat)[slots] = k.numpy()
        self.v[layer].reshape(flat)[slots] = v.numpy()

    def gather(self, layer: int, block_ids: np.ndarray) -> tuple[paddle.Tensor, paddle.Tensor]:
        """K/V of the given blocks ([B, nb] ids) as contiguous [B, kv_heads, nb*block_size, head_dim].

        Heads-major is what the attention matmuls want; the transpose is done here in numpy
        because Paddle's CPU transpose/contiguous kernels are far slower than numpy's copy.
        """
        b, nb = block_ids.shape
        shape = (b, nb * self.block_size, self.num_kv_heads, self.head_dim)
        flat = block_ids.reshape(-1)
        if self.quant is not None:
            k, v = self._int8.blocks(layer, flat)
            return (to_paddle(k.reshape(shape).transpose(0, 2, 1, 3)),
                    to_paddle(v.reshape(shape).transpose(0, 2, 1, 3)))
        k = np.take(self.k[layer], flat, axis=0).reshape(shape).transpose(0, 2, 1, 3)
        v = np.take(self.v[layer], flat, axis=0).reshape(shape).transpose(0, 2, 1, 3)
        return to_paddle(k.astype(np.float32, copy=False)), to_paddle(v.astype(np.float32, copy=False))

    # Whole-block copies, all layers at once: the CPU swap tier and prefill/decode KV transfer use these.
    def read_blocks(self, block_ids: list[int]) -> np.ndarray:
        """[num_layers, 2, n, block_size, kv_heads, head_dim] copy of the given blocks (float32)."""
        idx = np.asarray(block_ids, dtype=np.int64)
        if self.quant is not None:
            return np.stack([np.stack(self._int8.blocks(i, idx)) for i in range(self.num_layers)])
        return np.stack([np.stack([self.k[i][idx], self.v[i][idx]])
                         for i in range(self.num_layers)]).astype(np.float32, copy=False)

    # Whole blocks as stored (prefill/decode transfer): float32 / bfloat16 values, or int8 codes and their scales.
    def export_blocks(self, block_ids: list[int]) -> KVBlocks:
        idx = np.asarray(block_ids, dtype=np.int64)
        codes = np.stack([np.stack([self.k[i][idx], self.v[i][idx]]) for i in range(self.num_layers)])
        if self.quant is None:
            return KVBlocks(codes)
        return KVBlocks(codes, self._int8.kind, self._int8.scales_of(idx))

    def import_blocks(self, block_ids: list[int], blocks: KVBlocks) -> None:
        """Codes stored as they came when this cache has their format, else through float32."""
        idx = np.asarray(block_ids, dtype=np.int64)
        kind = None if self.quant is None else self._int8.kind
        static = self._int8.scales_of(idx) if kind == "static" else None
        if not blocks.stored_as_is_by(self.code_dtype.name if kind is None else "int8", kind, static):
            return self.write_blocks(block_ids, blocks.to_float32())
        for i in range(self.num_layers):
            self.k[i][idx], self.v[i][idx] = blocks.codes[i, 0], blocks.codes[i, 1]
            if kind == "dynamic":
                for j in range(2):
                    self._int8.scales[i][j][idx] = blocks.scales[i, j]

    def write_blocks(self, block_ids: list[int], data: np.ndarray) -> None:
        idx = np.asarray(block_ids, dtype=np.int64)
        if self.quant is not None:
            for i in range(self.num_layers):
                self._int8.put_blocks(i, idx, data[i, 0], data[i, 1])
            return
        for i in range(self.num_layers):
            self.k[i][idx] = data[i, 0]
            self.v[i][idx] = data[i, 1]


class _Int8Storage:
    """The C8 arithmetic over a PagedKVCache's int8 arrays (formats.py's quantize_kv_* definitions).

    Dynamic scales: scale[block, head] is the absmax written to that block so far. A write that raises
    it rescales the block's existing codes (one extra rounding); a write at offset 0 starts the block
    afresh, since blocks are filled in order and a freed block is reused from its first slot.
    """

    def __init__(self, cache: PagedKVCache, quant: KVCacheQuant):
        self.cache = cache
        c = cache
        if quant.static:
            hw = (c.num_kv_heads, c.head_dim)
            self.static = [(np.asarray(ks, np.float32).reshape(hw), np.asarray(vs, np.float32).reshape(hw))
                           for ks, vs in zip(quant.k_scales, quant.v_scales)]
            if len(self.static) != c.num_layers:
                raise ValueError(f"C8 KV cache: {len(self.static)} layers of static scales for {c.num_layers} layers")
        else:
            self.static = None
            self.scales = [[np.zeros((c.num_blocks, c.num_kv_heads), np.float32) for _ in range(2)]
                           for _ in range(c.num_layers)]

    def write(self, layer: int, slots: np.ndarray, k: np.ndarray, v: np.ndarray) -> None:
        c = self.cache
        for j, (store, x) in enumerate(((c.k[layer], k), (c.v[layer], v))):
            flat = store.reshape(-1, c.num_kv_heads, c.head_dim)
            if self.static is not None:
                flat[slots] = fmt.quantize_kv_static(x, self.static[layer][j])
                continue
            scale = self.scales[layer][j]
            blocks = slots // c.block_size
            scale[np.unique(blocks[slots % c.block_size == 0])] = 0.0
            amax = np.zeros_like(scale)
            np.maximum.at(amax, blocks, np.abs(x).max(axis=-1))
            touched = np.unique(blocks)
            old, new = scale[touched], np.maximum(scale[touched], amax[touched])
            grow = (old > 0) & (new > old)
            if grow.any():
                rows = touched[grow.any(axis=1)]
                ratio = np.where(new > 0, old / np.where(new > 0, new, 1.0), 1.0)[grow.any(axis=1)]
                store[rows] = fmt.round_half_away(store[rows] * ratio[:, None, :, None]).astype(np.int8)
            scale[touched] = new
            s = np.where(scale[blocks] > 0, scale[blocks], 1.0)[:, :, None]
            flat[slots] = np.clip(fmt.round_half_away(x * 127.0 / s), -127, 127).astype(np.int8)

    @property
    def kind(self) -> str:
        return "static" if self.static is not None else "dynamic"

    def scales_of(self, ids: np.ndarray) -> np.ndarray:
        """KVBlocks' scales for these blocks: static [layers, 2, kv_heads, head_dim], dynamic [layers, 2, n, kv_heads]."""
        if self.static is not None:
            return np.stack([np.stack(pair) for pair in self.static])
        return np.stack([np.stack([k[ids], v[ids]]) for k, v in self.scales])

    def blocks(self, layer: int, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Dequantized float32 [n, block_size, kv_heads, head_dim] K and V of the given blocks."""
        c = self.cache
        out = []
        for j, store in enumerate((c.k[layer], c.v[layer])):
            q = np.take(store, ids, axis=0)
            if self.static is not None:
                out.append(fmt.dequantize_kv_static(q, self.static[layer][j]))
            else:
                out.append(fmt.dequantize_kv_dynamic(q, self.scales[layer][j][ids]))
        return out[0], out[1]

    def put_blocks(self, layer: int, ids: np.ndarray, k: np.ndarray, v: np.ndarray) -> None:
        c = self.cache
        for j, (store, x) in enumerate(((c.k[layer], k), (c.v[layer], v))):
            if self.static is not None:
                store[ids] = fmt.quantize_kv_static(x, self.static[layer][j])
            else:
                q, s = fmt.quantize_kv_dynamic(x)
                store[ids] = q
                self.scales[layer][j][ids] = np.where(np.abs(x).max(axis=(1, 3)) > 0, s, 0.0)


def transpose(x: paddle.Tensor, perm: list[int]) -> paddle.Tensor:
    """A contiguous transpose. On CPU tensors outside autograd it goes through numpy (zero-copy
    in, one copy out): Paddle's strided CPU matmul on a transposed view is far slower than the
    contiguous one, and its contiguous() kernel is no faster."""
    moved = [p for p in perm if x.shape[p] != 1]
    if moved == sorted(moved):  # only size-1 axes move (one KV head, say): the order of the data is kept
        return x.reshape([x.shape[p] for p in perm])
    if x.stop_gradient and x.place.is_cpu_place():
        return to_paddle(np.from_dlpack(x).transpose(perm))
    return paddle.transpose(x, perm).contiguous()
