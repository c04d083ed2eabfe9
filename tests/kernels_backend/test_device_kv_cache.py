"""The kernels backend's device KV cache: whole-block reads and writes (the CPU swap tier, P/D transfer) hold
the same values as the reference PagedKVCache's, float and C8 (static and dynamic scales)."""
from __future__ import annotations

import ml_dtypes
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


@pytest.mark.parametrize("c8", [None, "static", "dynamic"])
def test_exported_blocks_are_the_reference_caches_own_codes_and_import_either_way(framework, c8):
    """P/D between the backends: a kernels cache exports the same int8 codes and scales as the reference cache of
    the same format, and each stores the other's blocks as they came."""
    ops = make_tensor_ops(framework)
    data = _data(2, seed=3)
    scales = [np.abs(data[layer]).max(axis=(0, 1, 2)).reshape(-1) * 1.5 for layer in range(L)]
    quant = None if c8 is None else KVCacheQuant(scales, scales) if c8 == "static" else KVCacheQuant()
    ref = PagedKVCache(L, NB, BS, KVH, HD, quant=quant)
    static = ([ops.tensor(s) for s in scales],) * 2 if c8 == "static" else None
    dev = DeviceKVCache(ops, L, NB, BS, KVH, HD, int8=c8 is not None, static_scales=static)
    ref.write_blocks([0, 3], data)
    dev.write_blocks([0, 3], data)
    a, b = ref.export_blocks([0, 3]), dev.export_blocks([0, 3])
    assert (a.dtype, a.scale_kind) == (b.dtype, b.scale_kind) == ("float32" if c8 is None else "int8", c8)
    np.testing.assert_array_equal(a.codes, b.codes)
    dev.import_blocks([5, 4], a)
    ref.import_blocks([5, 4], b)
    np.testing.assert_array_equal(dev.export_blocks([5, 4]).codes, a.codes)
    np.testing.assert_array_equal(ref.read_blocks([5, 4]), dev.read_blocks([5, 4]))


def test_a_bfloat16_cache_exports_bfloat16_and_a_float32_one_takes_it(framework):
    """On a GPU the float cache is bf16: its blocks cross as bf16 (half of float32's bytes). Here a bf16 cache on
    the CPU stands in for it."""
    ops = make_tensor_ops(framework)

    class Bf16(type(ops)):
        act_dtype = "bfloat16"

    bf16 = DeviceKVCache(Bf16(), L, NB, BS, KVH, HD)
    data = _data(2, seed=4)
    bf16.write_blocks([1, 2], data)
    blocks = bf16.export_blocks([1, 2])
    assert blocks.dtype == "bfloat16" and blocks.codes.nbytes * 2 == data.nbytes
    rounded = data.astype(ml_dtypes.bfloat16).astype(np.float32)
    np.testing.assert_array_equal(blocks.to_float32(), rounded)
    other = DeviceKVCache(Bf16(), L, NB, BS, KVH, HD)
    other.import_blocks([3, 0], blocks)  # bf16 -> bf16: as they came
    np.testing.assert_array_equal(other.read_blocks([3, 0]), rounded)
    fp32 = DeviceKVCache(ops, L, NB, BS, KVH, HD)
    fp32.import_blocks([3, 0], blocks)  # bf16 -> float32: through float32
    np.testing.assert_array_equal(fp32.read_blocks([3, 0]), rounded)
