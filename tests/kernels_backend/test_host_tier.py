"""The kernels backend's CPU tier and block moves, model-free: random move sequences, batched, leave the device
cache and the host tier exactly as the moves one by one would, in every cache format."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from ernie_serve.kernels_backend.framework import make_tensor_ops
from ernie_serve.kernels_backend.host_tier import HostKVTier, batches
from ernie_serve.kernels_backend.kv_cache import DeviceKVCache
from ernie_serve.step_contract import KVOp

L, NB, NH, BS, KVH, HD = 2, 7, 5, 4, 1, 24


def test_a_batch_ends_where_the_recorded_order_would_show():
    moves = [KVOp("swap_out", 1, 0), KVOp("swap_out", 2, 1),  # one gather
             KVOp("copy", 3, 4), KVOp("copy", 4, 5),  # 5 must get 4's new contents: a chain
             KVOp("copy", 6, 2), KVOp("copy", 3, 2),  # 2 written twice
             KVOp("swap_in", 0, 6)]
    assert batches(moves) == [("swap_out", [1, 2], [0, 1]), ("copy", [3], [4]), ("copy", [4, 6], [5, 2]),
                              ("copy", [3], [2]), ("swap_in", [0], [6])]
    with pytest.raises(ValueError, match="unknown KV block move 'move'"):
        batches([KVOp("move", 0, 1)])


def _cache(framework: str, fmt: str) -> DeviceKVCache:
    ops = make_tensor_ops(framework)
    if fmt == "bfloat16":  # the GPU's float cache, on the CPU
        class Bf16(type(ops)):
            act_dtype = "bfloat16"

        ops = Bf16()
    static = None
    if fmt == "static":
        scale = np.full(KVH * HD, 0.05, np.float32)
        static = ([ops.tensor(scale) for _ in range(L)],) * 2
    return DeviceKVCache(ops, L, NB, BS, KVH, HD, int8=fmt in ("static", "dynamic"), static_scales=static)


@pytest.mark.parametrize("fmt", ["float32", "bfloat16", "static", "dynamic"])
def test_random_move_sequences_batched_match_the_moves_one_by_one(framework, fmt):
    rng = np.random.default_rng(7)
    cache = _cache(framework, fmt)
    cache.write_blocks(list(range(NB)), rng.standard_normal((L, 2, NB, BS, KVH, HD)).astype(np.float32))
    tier = HostKVTier(cache, NH)
    # the reference: blocks as stored, moved one at a time in NumPy
    start = cache.export_blocks(list(range(NB)))
    dev_codes, host_codes = start.codes.copy(), np.zeros_like(tier.codes)
    dynamic = fmt == "dynamic"
    dev_scales = start.scales.copy() if dynamic else None
    host_scales = np.zeros_like(tier.scales) if dynamic else None
    kinds = ["swap_out", "swap_in", "copy"]
    for _ in range(12):
        moves = []
        for _ in range(int(rng.integers(1, 6))):
            kind = kinds[int(rng.integers(3))]
            src = int(rng.integers(NH if kind == "swap_in" else NB))
            dst = int(rng.integers(NH if kind == "swap_out" else NB))
            moves.append(KVOp(kind, src, dst))
        tier.apply(moves)
        for m in moves:
            src_codes, dst_codes = ((dev_codes, host_codes) if m.kind == "swap_out" else
                                    (host_codes, dev_codes) if m.kind == "swap_in" else (dev_codes, dev_codes))
            dst_codes[:, :, m.dst] = src_codes[:, :, m.src]
            if dynamic:
                src_s, dst_s = ((dev_scales, host_scales) if m.kind == "swap_out" else
                                (host_scales, dev_scales) if m.kind == "swap_in" else (dev_scales, dev_scales))
                dst_s[:, :, m.dst] = src_s[:, :, m.src]
        now = cache.export_blocks(list(range(NB)))
        np.testing.assert_array_equal(now.codes, dev_codes)
        np.testing.assert_array_equal(tier.codes, host_codes)
        if dynamic:
            np.testing.assert_array_equal(now.scales, dev_scales)
            np.testing.assert_array_equal(tier.scales, host_scales)


def test_the_host_tier_keeps_the_caches_format_so_swap_space_holds_more_blocks(framework):
    bf16, c8 = _cache(framework, "bfloat16"), _cache(framework, "dynamic")
    assert HostKVTier(bf16, 2).codes.dtype == np.dtype(ml_dtypes.bfloat16)
    fp32_bytes = DeviceKVCache.bytes_per_block(L, BS, KVH, HD, 4)
    assert HostKVTier.bytes_per_block(bf16) * 2 == fp32_bytes
    assert HostKVTier.bytes_per_block(c8) == fp32_bytes // 4 + 2 * L * KVH * 4  # int8 codes + a scale a head
    assert len(HostKVTier(c8, 3)) == 3 and HostKVTier(c8, 3).scales.shape == (L, 2, 3, KVH)
