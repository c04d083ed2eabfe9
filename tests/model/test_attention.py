"""Paged attention against a dense numpy reference, model-free.

Steps mix decodes, draft verification, fresh prefills and prefix-cached chunks over random block tables;
the cached part of each sequence is written first, the step's new K/V go through paged_attention itself.
"""
from __future__ import annotations

import numpy as np
import paddle
import pytest

from ernie_serve.cpu_kernels import cpu_attention, cpu_ops
from ernie_serve.model import attention, reference_attention
from ernie_serve.model.attention import SCORE_TILE_ELEMENTS, AttentionMetadata, paged_attention
from ernie_serve.model.kv_cache import KVCacheQuant, PagedKVCache, transpose

SCALE = 0.3
# (q_len, context_len) per sequence, decodes first as the model runner orders them
STEP = [(1, 37), (3, 21), (1, 1), (29, 29), (11, 50), (40, 83)]


def _dense(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """q [n, nh, hd] at the last n of the L positions of k/v [L, nkv, hd] -> [n, nh*hd]."""
    n, nh, hd = q.shape
    L, nkv = k.shape[:2]
    kh, vh = np.repeat(k, nh // nkv, axis=1), np.repeat(v, nh // nkv, axis=1)  # query head h reads kv head h // g
    s = np.einsum("qhd,khd->hqk", q.astype(np.float64), kh) * SCALE
    s[:, np.arange(L)[None, :] > (L - n + np.arange(n))[:, None]] = -np.inf
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("hqk,khd->qhd", p, vh).reshape(n, nh * hd)


class _Step:
    """One step's sequences with random K/V and random block tables; the cached context already written."""

    def __init__(self, seqs, nh, nkv, hd, block_size, quant=None, seed=0):
        rng = np.random.default_rng(seed)
        self.seqs, self.block_size, self.nh = seqs, block_size, nh
        need = [-(-c // block_size) for _, c in seqs]
        ids = rng.permutation(sum(need) + 3)
        self.tables = [ids[sum(need[:i]) : sum(need[: i + 1])].tolist() for i in range(len(seqs))]
        self.cache = PagedKVCache(1, len(ids), block_size, nkv, hd, quant=quant)
        self.k = [rng.standard_normal((c, nkv, hd)).astype(np.float32) for _, c in seqs]
        self.v = [rng.standard_normal((c, nkv, hd)).astype(np.float32) for _, c in seqs]
        self.q = [rng.standard_normal((n, nh, hd)).astype(np.float32) for n, _ in seqs]
        for (n, c), t, k, v in zip(seqs, self.tables, self.k, self.v):
            if c > n:
                slots = self._slots(t, range(c - n))
                self.cache.write(0, slots, paddle.to_tensor(k[: c - n]), paddle.to_tensor(v[: c - n]))

    def _slots(self, table, positions) -> np.ndarray:
        pos = np.asarray(list(positions), dtype=np.int64)
        return np.asarray(table, dtype=np.int64)[pos // self.block_size] * self.block_size + pos % self.block_size

    def run(self, cached: bool = True, **tiles) -> np.ndarray:
        q_lens, ctx = [n for n, _ in self.seqs], [c for _, c in self.seqs]
        if cached:
            slots = np.concatenate([self._slots(t, range(c - n, c)) for t, (n, c) in zip(self.tables, self.seqs)])
            meta = AttentionMetadata.build(q_lens, ctx, self.tables, self.block_size, slots, max(ctx) - 1)
            cache = self.cache
        else:
            meta = AttentionMetadata.build(q_lens, ctx, None, self.block_size, None, max(ctx) - 1)
            cache = None
        q, k, v = (paddle.to_tensor(np.concatenate(x)) for x in (self.q, self._new(self.k), self._new(self.v)))
        with paddle.no_grad():  # as the engine runs the model (the C decode kernel serves only inference)
            return paged_attention(q, k, v, 0, meta, cache, SCALE, **tiles).numpy()

    def _new(self, xs: list[np.ndarray]) -> list[np.ndarray]:
        """Each sequence's rows for this step's new tokens."""
        return [x[c - n :] for x, (n, c) in zip(xs, self.seqs)]

    def reference(self, kv=None) -> np.ndarray:
        k, v = kv if kv is not None else (self.k, self.v)
        return np.concatenate([_dense(q, a, b) for q, a, b in zip(self.q, k, v)])


HEADS = [(4, 1, 16), (4, 2, 12), (4, 4, 8), (6, 2, 7), (3, 1, 13)]  # (nh, nkv, hd): MQA, GQA, MHA, odd dims
TILES = [{}, dict(kv_tile_tokens=8, score_tile_elements=4 * 8 * 5), dict(kv_tile_tokens=1, score_tile_elements=1)]


@pytest.fixture(params=["c_decodes", "paddle_decodes"])
def decode_path(request, monkeypatch):
    """The leading decodes run in cpu_attention.c when it is built, else (and here, forced) as a padded batch."""
    if request.param == "paddle_decodes":
        monkeypatch.setattr(cpu_ops, "serves", lambda x: False)
    elif not cpu_attention.available():
        pytest.skip("no C compiler to build the CPU kernels")
    return request.param


@pytest.mark.parametrize("nh,nkv,hd", HEADS)
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("tiles", TILES, ids=["default_tiles", "small_tiles", "one_key_tiles"])
@pytest.mark.parametrize("chunk_limit", [attention.NATIVE_CHUNK_WORK, 0], ids=["short_chunks", "long_chunks"])
def test_mixed_step_matches_dense_attention(nh, nkv, hd, block_size, tiles, decode_path, chunk_limit, monkeypatch):
    """Short chunks: the C kernel takes the whole step; a longer one keeps every chunk on the tiled path."""
    monkeypatch.setattr(attention, "NATIVE_CHUNK_WORK", chunk_limit)
    step = _Step(STEP, nh, nkv, hd, block_size, seed=nh * hd + block_size)
    np.testing.assert_allclose(step.run(**tiles), step.reference(), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("nh,nkv,hd", HEADS)
def test_fresh_sequences_without_a_cache_match_dense_attention(nh, nkv, hd):
    step = _Step([(9, 9), (1, 1), (70, 70), (5, 5)], nh, nkv, hd, 16, seed=hd)
    np.testing.assert_allclose(step.run(cached=False, kv_tile_tokens=16, score_tile_elements=nh * 16 * 7),
                               step.reference(), rtol=1e-4, atol=1e-5)


def test_multi_query_prefill_longer_than_the_batched_path():
    """One KV head (each rank of ERNIE-4.5-300B at tensor-parallel 8): its K/V transposes move only a unit axis."""
    step = _Step([(20, 20)], 8, 1, 16, 16)
    np.testing.assert_allclose(step.run(cached=False), step.reference(), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(step.run(cached=True), step.reference(), rtol=1e-4, atol=1e-5)


def test_transpose_that_moves_only_unit_axes_keeps_the_values():
    x = paddle.to_tensor(np.arange(2 * 5 * 3, dtype=np.float32).reshape(2, 5, 1, 3))
    for rows in (x, x[1:]):  # whole, and a row slice (a view of the step's K/V)
        for perm in ([0, 2, 1, 3], [2, 0, 1, 3], [1, 0, 2, 3]):
            np.testing.assert_array_equal(transpose(rows, perm).numpy(), rows.numpy().transpose(perm))


@pytest.mark.parametrize("kind", ["static", "dynamic"])
def test_int8_cache_attends_to_its_dequantized_blocks(kind):
    nh, nkv, hd, bs = 4, 2, 8, 4
    quant = KVCacheQuant() if kind == "dynamic" else KVCacheQuant([np.full(nkv * hd, 4.5, np.float32)],
                                                                  [np.full(nkv * hd, 4.5, np.float32)])
    seqs = [(1, 37), (2, 14), (11, 50), (30, 45)]  # all read from the cache: every chunk has cached context
    step = _Step(seqs, nh, nkv, hd, bs, quant=quant)
    got = step.run(kv_tile_tokens=8, score_tile_elements=nh * 8 * 4)
    blocks = step.cache.read_blocks(list(range(step.cache.num_blocks)))[0]  # [2, nb, bs, nkv, hd] dequantized
    kv = [[blocks[j][t].reshape(-1, nkv, hd)[:c] for t, (_, c) in zip(step.tables, seqs)] for j in range(2)]
    np.testing.assert_allclose(got, step.reference(kv), rtol=1e-4, atol=1e-5)
    assert np.abs(got - step.reference()).max() < 0.1  # and close to the fp32 K/V they quantize


def test_prefill_scores_stay_within_one_tile(monkeypatch):
    """A 1024-token prompt: no [q, L] score matrix is materialized, only tiles of SCORE_TILE_ELEMENTS."""
    largest = [0]
    matmul = paddle.matmul

    def spy(x, y, *args, **kwargs):
        out = matmul(x, y, *args, **kwargs)
        largest[0] = max(largest[0], int(np.prod(out.shape)))
        return out

    monkeypatch.setattr(reference_attention.paddle, "matmul", spy)
    step = _Step([(1024, 1024)], 4, 2, 8, 16)
    np.testing.assert_allclose(step.run(), step.reference(), rtol=1e-4, atol=1e-5)
    assert 0 < largest[0] <= SCORE_TILE_ELEMENTS < 4 * 1024 * 1024


def test_tiled_attention_gradients_match_dense_softmax():
    """The demo model is fitted through this path (no cache), so it must stay differentiable."""
    rng = np.random.default_rng(3)
    n, nh, nkv, hd = 19, 4, 2, 8
    arrays = [rng.standard_normal((n, h, hd)).astype(np.float32) for h in (nh, nkv, nkv)]
    meta = AttentionMetadata.build([n], [n], None, 16, None, n - 1)

    def grads(attend):
        q, k, v = (paddle.to_tensor(a, stop_gradient=False) for a in arrays)
        (attend(q, k, v) ** 2).sum().backward()
        return [t.grad.numpy() for t in (q, k, v)]

    def dense(q, k, v):
        kh, vh = (paddle.repeat_interleave(t, nh // nkv, axis=1).transpose([1, 0, 2]) for t in (k, v))
        s = paddle.matmul(q.transpose([1, 0, 2]), kh, transpose_y=True) * SCALE
        s = s + paddle.to_tensor(np.triu(np.full((n, n), -1e30, np.float32), 1))
        return paddle.matmul(paddle.nn.functional.softmax(s, -1), vh).transpose([1, 0, 2]).reshape([n, nh * hd])

    tiled = grads(lambda q, k, v: paged_attention(q, k, v, 0, meta, None, SCALE, kv_tile_tokens=4,
                                                  score_tile_elements=nh * 4 * 5))
    for a, b in zip(tiled, grads(dense)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_metadata_is_index_data_and_decodes_lead():
    meta = AttentionMetadata.build([1, 3, 12, 2], [9, 5, 12, 30], [[4, 2], [7], [1, 8], [3, 5, 6, 0]], 8,
                                   np.zeros(18, np.int64), 29, max_decode_query_len=8)
    assert meta.query_start_loc.tolist() == [0, 1, 4, 16, 18]
    assert meta.seq_lens.tolist() == [9, 5, 12, 30]
    assert meta.num_decodes == 2 and meta.num_decode_tokens == 4  # the 2-token one after a prefill is tiled
    assert meta.block_tables.tolist() == [[4, 2, 0, 0], [7, 0, 0, 0], [1, 8, 0, 0], [3, 5, 6, 0]]


def test_metadata_plan_is_derived_once_per_step():
    meta = AttentionMetadata.build([5], [5], None, 16, None, 4)
    calls = []
    for _ in range(3):
        meta.derive("x", lambda m: calls.append(m) or len(calls))
    assert calls == [meta]


@pytest.mark.parametrize("q_lens,ctx,tables,field", [
    ([4], [3], [[0]], "query_lens"),
    ([0], [3], [[0]], "query_lens"),
    ([2], [6], None, "context_lens"),
    ([2], [20], [[0]], "block_tables"),
])
def test_metadata_refuses_inconsistent_steps_naming_the_field(q_lens, ctx, tables, field):
    with pytest.raises(ValueError, match=field):
        AttentionMetadata.build(q_lens, ctx, tables, 16, None, max(ctx))
