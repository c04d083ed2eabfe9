"""KV-write kernel vs the reference cache (ernie_serve.model.kv_cache.PagedKVCache): the same slots get the
same values, and the C8 codes and dynamic scales are bit-identical, written step by step as an engine does."""

import numpy as np
import paddle
import pytest

from ernie_kernels.kv_write import block_runs, kv_write
from ernie_serve.model.kv_cache import KVCacheQuant, PagedKVCache

NB, BS, KVH, HD = 6, 4, 2, 24

# one sequence in blocks [3, 1] and another in [5]: prefills, then decodes (one grows block 1's values)
STEPS = [np.array([12, 13, 14, 15, 4, 5, 20, 21, 22]), np.array([6, 23]), np.array([7])]


def _quant(kind):
    if kind == "float":
        return None
    if kind == "static":
        return KVCacheQuant([np.linspace(3.0, 6.0, KVH * HD).astype(np.float32)],
                            [np.linspace(5.5, 2.0, KVH * HD).astype(np.float32)])
    return KVCacheQuant()


@pytest.mark.parametrize("kind", ["float", "static", "dynamic"])
def test_kernel_writes_what_the_reference_cache_stores(fw, kind):
    rng = np.random.default_rng(0)
    quant = _quant(kind)
    ref = PagedKVCache(1, NB, BS, KVH, HD, quant=quant)
    dtype = np.float32 if quant is None else np.int8
    kc, vc = (fw.tensor(np.zeros((NB, BS, KVH, HD), dtype)) for _ in range(2))
    ks = vs = None
    if kind == "static":
        ks, vs = fw.tensor(quant.k_scales[0]), fw.tensor(quant.v_scales[0])
    elif kind == "dynamic":
        ks, vs = (fw.tensor(np.zeros((NB, KVH), np.float32)) for _ in range(2))
    for i, slots in enumerate(STEPS):
        k, v = (rng.standard_normal((len(slots), KVH, HD)).astype(np.float32) * (1 + 2 * i) for _ in range(2))
        ref.write(0, slots, paddle.to_tensor(k), paddle.to_tensor(v))
        runs = fw.tensor(block_runs(slots, BS)) if kind == "dynamic" else None
        kv_write(fw.tensor(k), fw.tensor(v), kc, vc, fw.tensor(slots.astype(np.int64)), ks, vs, runs)
    written = np.concatenate(STEPS)
    for got, want in ((kc, ref.k[0]), (vc, ref.v[0])):
        flat = fw.numpy(got).reshape(-1, KVH, HD) if quant is None else _int8(fw, got).reshape(-1, KVH, HD)
        np.testing.assert_array_equal(flat[written], want.reshape(-1, KVH, HD)[written])
    if kind == "dynamic":
        touched = np.unique(written // BS)
        for got, want in ((ks, ref._int8.scales[0][0]), (vs, ref._int8.scales[0][1])):
            np.testing.assert_array_equal(fw.numpy(got)[touched], want[touched])


def _int8(fw, t):
    return t.numpy() if fw.name == "torch" else t.numpy().astype(np.int8)


def test_padding_slots_are_not_written(fw):
    kc, vc = (fw.tensor(np.zeros((2, BS, KVH, HD), np.float32)) for _ in range(2))
    k = fw.tensor(np.ones((2, KVH, HD), np.float32))
    kv_write(k, k, kc, vc, fw.tensor(np.array([1, -1], np.int64)))
    got = fw.numpy(kc).reshape(-1, KVH, HD)
    assert (got[1] == 1).all() and (np.delete(got, 1, axis=0) == 0).all()


def test_block_runs_split_the_step_by_block():
    runs = block_runs(np.array([12, 13, 14, 15, 4, 5, -1, 20]), 4)
    np.testing.assert_array_equal(runs, [[3, 0, 4, 0], [1, 4, 2, 0], [5, 7, 1, 0]])


def test_dynamic_cache_needs_the_block_runs(fw):
    z = fw.tensor(np.zeros((1, KVH, HD), np.float32))
    c = fw.tensor(np.zeros((NB, BS, KVH, HD), np.int8))
    s = fw.tensor(np.zeros((NB, KVH), np.float32))
    with pytest.raises(ValueError, match="needs runs"):
        kv_write(z, z, c, c, fw.tensor(np.array([0], np.int64)), s, s)
