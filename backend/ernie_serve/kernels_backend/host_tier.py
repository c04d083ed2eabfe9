"""The kernels backend's CPU tier (the prefix cache's host blocks, --swap-space): blocks kept as the device cache
stores them, and the step's recorded block moves carried out a batch at a time.

A float32 host copy would hold half the blocks of a bf16 cache in the same --swap-space (a quarter of a C8 one's)
and pay a conversion each way; here a block is its codes in the cache's dtype (bf16 on a GPU, int8 for C8 with its
dynamic per-block scales beside them: static scales stay in the cache). The moves (KVOp: swap_out, swap_in, copy,
in the order the block pool recorded them) run as batches of consecutive moves of one kind, so that a swap of n
blocks is one gather or scatter a layer instead of n host round trips; a batch ends where a move would read a block
an earlier move of the batch wrote, or write one twice, so every batch reads what the recorded order would have.
"""
from __future__ import annotations

import numpy as np

from ..kv_blocks import CODE_DTYPES
from ..step_contract import KVOp
from .kv_cache import DeviceKVCache


class HostKVTier:
    def __init__(self, cache: DeviceKVCache, num_blocks: int):
        self.cache = c = cache
        self.num_blocks = num_blocks
        self.codes = np.zeros((c.num_layers, 2, num_blocks, c.block_size, c.num_kv_heads, c.head_dim),
                              CODE_DTYPES[c.code_dtype])
        self.scales = (np.zeros((c.num_layers, 2, num_blocks, c.num_kv_heads), np.float32)
                       if c.dynamic is not None else None)

    def __len__(self) -> int:
        return self.num_blocks

    @staticmethod
    def bytes_per_block(cache: DeviceKVCache) -> int:
        """Host bytes a block takes here: its codes in the cache's dtype, plus dynamic C8's scales."""
        c = cache
        itemsize = CODE_DTYPES[c.code_dtype].itemsize
        scales = 2 * c.num_layers * c.num_kv_heads * 4 if c.dynamic is not None else 0
        return DeviceKVCache.bytes_per_block(c.num_layers, c.block_size, c.num_kv_heads, c.head_dim, itemsize) + scales

    def swap_out(self, device_ids: list[int], host_ids: list[int]) -> None:
        codes, scales = self.cache.read_stored(device_ids)
        self.codes[:, :, host_ids] = codes
        if self.scales is not None:
            self.scales[:, :, host_ids] = scales

    def swap_in(self, host_ids: list[int], device_ids: list[int]) -> None:
        scales = None if self.scales is None else self.scales[:, :, host_ids]
        self.cache.write_stored(device_ids, self.codes[:, :, host_ids], scales)

    def apply(self, moves: list[KVOp]) -> None:
        """Carry out the recorded moves (see the module doc for the batching)."""
        for kind, src, dst in batches(moves):
            if kind == "swap_out":
                self.swap_out(src, dst)
            elif kind == "swap_in":
                self.swap_in(src, dst)
            else:
                self.cache.copy_blocks(src, dst)


def batches(moves: list[KVOp]) -> list[tuple[str, list[int], list[int]]]:
    """(kind, sources, destinations) runs of consecutive moves of one kind, in order, each safe to run as one gather
    then one scatter: no move reads a block written earlier in its run (a copy chain, or a swap_in of a host slot
    that a swap_out of the run filled cannot be: they differ in kind), and no block is written twice."""
    out: list[tuple[str, list[int], list[int]]] = []
    written: set[int] = set()
    for op in moves:
        if op.kind not in ("swap_out", "swap_in", "copy"):
            raise ValueError(f"unknown KV block move {op.kind!r}")
        run = out[-1] if out else None
        reads_written = op.kind == "copy" and op.src in written
        if run is None or run[0] != op.kind or reads_written or op.dst in written:
            out.append((op.kind, [], []))
            written = set()
        out[-1][1].append(op.src)
        out[-1][2].append(op.dst)
        written.add(op.dst)
    return out
