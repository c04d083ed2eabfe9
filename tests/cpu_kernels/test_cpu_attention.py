"""cpu_attention.c against a plain NumPy softmax attention over the same paged cache, on shapes the demo
model does not have (one KV head, head_dim 64 / 80 / 96, block sizes 1-64, several query rows a sequence), on every
instruction-set tier this CPU has (the `isa` fixture)."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from ernie_serve.cpu_kernels import cpu_attention

pytestmark = pytest.mark.skipif(not cpu_attention.available(), reason="no C compiler to build the CPU kernels")


def reference(q, k_cache, v_cache, tables, qsl, lens, scale):
    t, nh, hd = q.shape
    bs, nkv = k_cache.shape[1], k_cache.shape[2]
    out = np.zeros((t, nh * hd), np.float64)
    for s in range(len(lens)):
        n, q_len = int(lens[s]), int(qsl[s + 1] - qsl[s])
        slots = [int(tables[s, j // bs]) * bs + j % bs for j in range(n)]
        k = k_cache.reshape(-1, nkv, hd)[slots].astype(np.float64)
        v = v_cache.reshape(-1, nkv, hd)[slots].astype(np.float64)
        for i in range(q_len):
            seen = n - q_len + i + 1
            for h in range(nh):
                g = h // (nh // nkv)
                sc = k[:seen, g] @ q[qsl[s] + i, h] * scale
                p = np.exp(sc - sc.max())
                out[qsl[s] + i, h * hd:(h + 1) * hd] = (p / p.sum()) @ v[:seen, g]
    return out


@pytest.mark.parametrize("nh,nkv,hd,bs", [(8, 2, 128, 64), (4, 1, 64, 16), (2, 2, 96, 1), (12, 4, 80, 32),
                                          (1, 1, 16, 8), (4, 2, 72, 16)])
@pytest.mark.parametrize("q_lens", [[1], [1, 1, 1, 1], [3, 1, 2], [8], [40], [17, 33], [1] * 9,
                                    [3, 1, 2, 1, 1, 5, 1, 1, 2, 1]])
@pytest.mark.parametrize("cache_dtype", ["float32", "bfloat16"])
def test_matches_numpy_attention_over_the_paged_cache(isa, nh, nkv, hd, bs, q_lens, cache_dtype):
    """A bfloat16 cache (--dtype bfloat16) gives the float32 kernel's result on its values bit for bit. Chunks of 17-40
    rows span blocks whose leading rows see none of them (the kernel skips those rows there). From 8 sequences (on 2
    threads) a task takes every KV head of its sequence."""
    rng = np.random.default_rng(nh * 100 + hd + bs + len(q_lens))
    num_blocks = 64
    k_cache = rng.standard_normal((num_blocks, bs, nkv, hd)).astype(np.float32)
    v_cache = rng.standard_normal((num_blocks, bs, nkv, hd)).astype(np.float32)
    lens = np.array([q + int(rng.integers(0, 3 * bs + 5)) for q in q_lens], np.int64)
    nb = int(-(-lens.max() // bs))
    tables = np.zeros((len(lens), nb), np.int64)
    for s, n in enumerate(lens):  # each sequence's blocks scattered over the pool
        need = -(-int(n) // bs)
        tables[s, :need] = rng.choice(num_blocks, need, replace=False)
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int64)
    q = rng.standard_normal((int(qsl[-1]), nh, hd)).astype(np.float32)
    scale = hd ** -0.5
    if cache_dtype == "bfloat16":
        k16, v16 = k_cache.astype(ml_dtypes.bfloat16), v_cache.astype(ml_dtypes.bfloat16)
        k_cache, v_cache = k16.astype(np.float32), v16.astype(np.float32)  # the values the bfloat16 cache holds
        got16 = cpu_attention.paged_attention(q, k16, v16, tables, qsl, lens, scale).numpy()
        np.testing.assert_array_equal(got16, cpu_attention.paged_attention(q, k_cache, v_cache, tables, qsl, lens,
                                                                           scale).numpy())
    got = cpu_attention.paged_attention(q, k_cache, v_cache, tables, qsl, lens, scale).numpy()
    np.testing.assert_allclose(got, reference(q, k_cache, v_cache, tables, qsl, lens, scale), rtol=1e-4, atol=1e-5)


def test_a_cache_that_does_not_fit_the_queries_is_refused():
    cache = np.zeros((4, 16, 2, 64), np.float32)
    with pytest.raises(ValueError, match="does not fit"):
        cpu_attention.paged_attention(np.zeros((1, 4, 32), np.float32), cache, cache, np.zeros((1, 1), np.int64),
                                       np.array([0, 1]), np.array([5]), 1.0)
