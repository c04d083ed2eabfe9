"""Whole KV-cache blocks in the form a cache holds them, for prefill/decode transfer.

A float cache's blocks are their values in its dtype (float32 on the CPU, bfloat16 on a GPU); a C8 cache's are
int8 codes plus their scales, channel-wise static ones (one per KV head and channel, the same for every block) or
dynamic ones (one per block and KV head). Shipping them as they are moves a quarter (C8) or half (bf16) of the
bytes float32 would, and a decode engine whose cache has the same format (and, for static C8, the same scales)
stores the codes as they came: no rounding on the way. Any other pair of formats meets in float32.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

import ml_dtypes
import numpy as np

CODE_DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16), "int8": np.dtype(np.int8)}
SCALE_KINDS = (None, "static", "dynamic")


@dataclass
class KVBlocks:
    """codes [layers, 2 (K, V), n, block_size, kv_heads, head_dim]; scales (int8 codes only): static
    [layers, 2, kv_heads, head_dim] or dynamic [layers, 2, n, kv_heads], float32."""

    codes: np.ndarray
    scale_kind: str | None = None
    scales: np.ndarray | None = None

    def __post_init__(self) -> None:
        if self.codes.ndim != 6:
            raise ValueError(f"KV blocks must be [layers, 2, n, block_size, kv_heads, head_dim], got "
                             f"{list(self.codes.shape)}")
        if self.dtype not in CODE_DTYPES:
            raise ValueError(f"KV block codes of dtype {self.codes.dtype} (supported: {', '.join(CODE_DTYPES)})")
        if self.scale_kind not in SCALE_KINDS or (self.scale_kind is None) != (self.dtype != "int8"):
            raise ValueError(f"{self.dtype} KV codes with scales {self.scale_kind!r}: int8 codes need 'static' or "
                             "'dynamic' scales, float codes none")
        if self.scale_kind is not None and tuple(self.scales.shape) != self._scale_shape():
            raise ValueError(f"{self.scale_kind} KV scales of shape {list(self.scales.shape)}, expected "
                             f"{list(self._scale_shape())}")

    def _scale_shape(self) -> tuple[int, ...]:
        layers, two, n, _, heads, hd = self.codes.shape
        return (layers, two, heads, hd) if self.scale_kind == "static" else (layers, two, n, heads)

    @property
    def dtype(self) -> str:
        return "bfloat16" if self.codes.dtype == CODE_DTYPES["bfloat16"] else str(self.codes.dtype)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.codes.shape)

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + (0 if self.scales is None else self.scales.nbytes)

    def first(self, n: int) -> "KVBlocks":
        """The first n blocks."""
        scales = self.scales[:, :, :n] if self.scale_kind == "dynamic" else self.scales
        return KVBlocks(self.codes[:, :, :n], self.scale_kind, scales)

    def stored_as_is_by(self, dtype: str, scale_kind: str | None, static_scales: np.ndarray | None = None) -> bool:
        """Whether a cache of this format (static C8: with these scales [layers, 2, kv_heads, head_dim]) can store
        the codes as they are."""
        if (self.dtype, self.scale_kind) != (dtype, scale_kind):
            return False
        return scale_kind != "static" or np.array_equal(self.scales, static_scales)

    def to_float32(self) -> np.ndarray:
        """The blocks' values [layers, 2, n, block_size, kv_heads, head_dim] in float32 (formats.py's dequantize_kv_*
        arithmetic, in its order: the caches' own reads give the same floats)."""
        if self.scale_kind == "static":
            return self.codes.astype(np.float32) * self.scales[:, :, None, None] / 127.0
        if self.scale_kind == "dynamic":
            return self.codes.astype(np.float32) * self.scales[:, :, :, None, :, None] / 127.0
        return self.codes.astype(np.float32)

    # ---- the KV heads of tensor-parallel ranks
    def take_heads(self, heads: range) -> "KVBlocks":
        """Only KV heads [heads.start, heads.stop) (what one tensor-parallel rank holds)."""
        sl = slice(heads.start, heads.stop)
        scales = None
        if self.scale_kind == "static":
            scales = self.scales[:, :, sl]
        elif self.scale_kind == "dynamic":
            scales = self.scales[..., sl]
        return KVBlocks(np.ascontiguousarray(self.codes[..., sl, :]), self.scale_kind,
                        None if scales is None else np.ascontiguousarray(scales))

    @staticmethod
    def join_heads(parts: list["KVBlocks"], heads: list[range], num_kv_heads: int) -> "KVBlocks":
        """Whole blocks from each rank's part and the KV heads it holds (a replicated head's copies are equal)."""
        first = parts[0]
        codes = np.empty(first.shape[:4] + (num_kv_heads, first.shape[5]), first.codes.dtype)
        scales = None
        if first.scale_kind == "static":
            scales = np.empty(first.scales.shape[:2] + (num_kv_heads, first.scales.shape[3]), np.float32)
        elif first.scale_kind == "dynamic":
            scales = np.empty(first.scales.shape[:3] + (num_kv_heads,), np.float32)
        for part, r in zip(parts, heads):
            sl = slice(r.start, r.stop)
            if part.scale_kind != first.scale_kind or part.codes.dtype != first.codes.dtype:
                raise ValueError("tensor-parallel ranks read KV blocks of different formats")
            codes[..., sl, :] = part.codes
            if first.scale_kind == "static":
                scales[:, :, sl] = part.scales
            elif first.scale_kind == "dynamic":
                scales[..., sl] = part.scales
        return KVBlocks(codes, first.scale_kind, scales)

    # ---- the wire: a JSON header, then the raw arrays (pyzmq frames, or buffers a transfer engine reads; no pickling)
    def header(self) -> dict:
        return {"dtype": self.dtype, "shape": list(self.shape), "scale_kind": self.scale_kind}

    def arrays(self) -> list[np.ndarray]:
        """The raw bytes (codes, then scales), as contiguous uint8 arrays: views of the blocks, not copies, when
        they are contiguous (as exported), so a transport can send them or register their memory as they are."""
        arrays = [self.codes] if self.scales is None else [self.codes, self.scales]
        return [np.ascontiguousarray(a).view(np.uint8).reshape(-1) for a in arrays]

    def buffers(self) -> list[memoryview]:
        return [memoryview(a) for a in self.arrays()]

    @classmethod
    def from_wire(cls, header: dict, buffers: list) -> "KVBlocks":
        dtype = CODE_DTYPES.get(header["dtype"])
        if dtype is None:
            raise ValueError(f"KV blocks of dtype {header['dtype']!r} (supported: {', '.join(CODE_DTYPES)})")
        codes = np.frombuffer(buffers[0], dtype=dtype).reshape(header["shape"])
        kind = header.get("scale_kind")
        scales = None if kind is None else np.frombuffer(buffers[1], dtype=np.float32)
        if scales is not None:
            layers, two, n, _, heads, hd = codes.shape
            scales = scales.reshape((layers, two, heads, hd) if kind == "static" else (layers, two, n, heads))
        return cls(codes, kind, scales)

    def to_frames(self) -> list:
        return [json.dumps(self.header()).encode(), *self.buffers()]

    @classmethod
    def from_frames(cls, frames: list) -> "KVBlocks":
        return cls.from_wire(json.loads(bytes(frames[0])), frames[1:])

