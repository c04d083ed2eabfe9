"""The kernels backend's device KV cache: whole-block reads and writes (the CPU swap tier, P/D transfer) hold
the same values as the reference PagedKVCache's, float and C8 (static and dynamic scales)."""
from __future__ import annotations

import numpy as np
import pytest

from ernie_serve.step_contract import KVOp, apply_kv_ops
from ernie_serve.kernels_backend.framework import make_tensor_ops
from ernie_serve.kernels_backend.kv_cache import DeviceKVCache
from ernie_serve.model.kv_cache import KVCacheQuant, PagedKVCache

L, NB, BS, KVH, HD = 2, 6, 4, 1, 24  # one KV head, head_dim 24


def _data(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((L, 2, n, BS, KVH, HD)).astype(np.float32)


@pytest.mark.parametrize("c8", [None, "static", "dynamic"])
def test_block_writes_and_reads_hold_what_the_reference_cache_holds(framework, c8):
    ops = make_tensor_ops(framework)
    data = _data(3)
    scales = [np.abs(data[layer]).max(axis=(0, 1, 2)).reshape(-1) for layer in range(L)]  # calibrated absmax
    quant = None if c8 is None else KVCacheQuant(scales, scales) if c8 == "static" else KVCacheQuant()
    ref = PagedKVCache(L, NB, BS, KVH, HD, quant=quant)
    static = ([ops.tensor(s) for s in scales],) * 2 if c8 == "static" else None
    dev = DeviceKVCache(ops, L, NB, BS, KVH, HD, int8=c8 is not None, static_scales=static)
    ref.write_blocks([4, 1, 2], data)
    dev.write_blocks([4, 1, 2], data)
    got = dev.read_blocks([2, 4])
    np.testing.assert_array_equal(got, ref.read_blocks([2, 4]))
    if c8 is None:
        np.testing.assert_array_equal(got, data[:, :, [2, 0]])
    else:
        assert np.abs(got - data[:, :, [2, 0]]).max() <= np.abs(data).max() / 127  # half a step of the largest scale, twice
    apply_kv_ops([KVOp("copy", 1, 5)], dev, None)
    np.testing.assert_array_equal(dev.read_blocks([5]), dev.read_blocks([1]))
