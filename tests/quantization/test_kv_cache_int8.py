"""The C8 (int8) storage option of PagedKVCache: same interface, K/V in and out as float32."""

import numpy as np
import paddle
import pytest

from ernie_serve.model.kv_cache import KVCacheQuant, PagedKVCache
from ernie_serve.quantization import formats as F

L, NB, BS, KVH, HD = 2, 6, 4, 2, 8


def _kv(rng, t):
    return [paddle.to_tensor(rng.standard_normal((t, KVH, HD)).astype(np.float32)) for _ in range(2)]


def _static_quant():
    # calibrated absmax per channel; N(0, 1) test data stays inside them
    return KVCacheQuant([np.full(KVH * HD, 6.0, np.float32)] * L, [np.full(KVH * HD, 5.5, np.float32)] * L)


@pytest.mark.parametrize("kind", ["static", "dynamic"])
def test_int8_cache_gathers_what_was_written_within_one_step(kind):
    rng = np.random.default_rng(0)
    quant = _static_quant() if kind == "static" else KVCacheQuant()
    fp, c8 = PagedKVCache(L, NB, BS, KVH, HD), PagedKVCache(L, NB, BS, KVH, HD, quant=quant)
    assert c8.k[0].dtype == np.int8 and PagedKVCache.bytes_per_block(L, BS, KVH, HD, int8=True) * 4 == \
        PagedKVCache.bytes_per_block(L, BS, KVH, HD)
    # a sequence in blocks [3, 1]: a 6-token prefill, then three decode writes (the last grows block 1's scale)
    writes = [np.array([12, 13, 14, 15, 4, 5])] + [np.array([s]) for s in (6, 7)]
    for slots in writes:
        k, v = _kv(rng, len(slots))
        if kind == "dynamic" and slots[0] == 7:
            k = k * 3.0  # a larger value than the block has seen (a static scale would clip it)
        for layer in range(L):
            fp.write(layer, slots, k, v)
            c8.write(layer, slots, k, v)
    ids = np.array([[3, 1]])
    for layer in range(L):
        for a, b in zip(fp.gather(layer, ids), c8.gather(layer, ids)):
            a, b = a.numpy(), b.numpy()
            assert a.shape == b.shape == (1, KVH, 2 * BS, HD) and b.dtype == np.float32
            step = (6.0 if kind == "static" else np.abs(a).max()) / 127  # a step at the largest scale
            assert np.abs(a - b).max() <= 1.01 * step


def test_dynamic_scale_restarts_when_a_reused_block_is_written_from_slot_zero():
    rng = np.random.default_rng(1)
    c8 = PagedKVCache(1, 2, BS, KVH, HD, quant=KVCacheQuant())
    big = [t * 100.0 for t in _kv(rng, BS)]
    c8.write(0, np.arange(BS), *big)
    k, v = _kv(rng, 2)  # the block is freed and reused by another sequence
    c8.write(0, np.arange(2), k, v)
    got = c8.gather(0, np.array([[0]]))[0].numpy()[0, :, :2]  # [KVH, 2, HD]
    np.testing.assert_allclose(got, k.numpy().transpose(1, 0, 2), atol=np.abs(k.numpy()).max() / 127 * 0.51)


@pytest.mark.parametrize("kind", ["static", "dynamic"])
def test_read_blocks_write_blocks_round_trip_exactly(kind):
    rng = np.random.default_rng(2)
    quant = _static_quant() if kind == "static" else KVCacheQuant()
    c8 = PagedKVCache(L, NB, BS, KVH, HD, quant=quant)
    for layer in range(L):
        c8.write(layer, np.arange(8), *_kv(rng, 8))
    data = c8.read_blocks([0, 1])
    assert data.dtype == np.float32 and data.shape == (L, 2, 2, BS, KVH, HD)
    c8.write_blocks([4, 5], data)  # a copy (swap / transfer) lands on other blocks
    np.testing.assert_array_equal(c8.read_blocks([4, 5]), data)
    for layer in range(L):
        np.testing.assert_array_equal(c8.k[layer][[4, 5]], c8.k[layer][[0, 1]])


def test_static_codes_are_formats_quantize_kv_static():
    rng = np.random.default_rng(3)
    quant = _static_quant()
    c8 = PagedKVCache(L, NB, BS, KVH, HD, quant=quant)
    k, v = _kv(rng, 3)
    c8.write(1, np.array([0, 1, 2]), k, v)
    np.testing.assert_array_equal(c8.k[1].reshape(-1, KVH, HD)[:3], F.quantize_kv_static(k.numpy(), quant.k_scales[1]))
    np.testing.assert_array_equal(c8.v[1].reshape(-1, KVH, HD)[:3], F.quantize_kv_static(v.numpy(), quant.v_scales[1]))
