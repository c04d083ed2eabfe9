"""Unified paged attention vs a per-sequence gathered softmax: one mixed step holding a decode, a
draft verification, a prefill chunk over cached blocks and a fresh prefill."""

import numpy as np
import pytest

from ernie_kernels import reference as ref
from ernie_kernels.unified_attention import (MAX_SPLITS, attention_programs, kv_splits, queries_per_program,
                                             unified_attention)
from ernie_serve.quantization import formats as F

# (query tokens, tokens seen after the step) per sequence
MIXED = [(1, 6), (3, 30), (20, 33), (9, 9)]


def _step(rng, hq, kvh, d, block_size, seqs=MIXED):
    q_lens = np.array([q for q, _ in seqs])
    seq_lens = np.array([s for _, s in seqs], np.int32)
    need = -(-seq_lens // block_size)
    num_blocks = int(need.sum()) + 3
    order = rng.permutation(num_blocks)  # each sequence's blocks scattered over the pool
    tables = np.zeros((len(seqs), int(need.max()) + 1), np.int32)  # unused entries stay 0
    start = 0
    for i, n in enumerate(need):
        tables[i, :n] = order[start:start + n]
        start += n
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    q = rng.standard_normal((int(qsl[-1]), hq, d)).astype(np.float32)
    k = rng.standard_normal((num_blocks, block_size, kvh, d)).astype(np.float32)
    v = rng.standard_normal((num_blocks, block_size, kvh, d)).astype(np.float32)
    return q, k, v, tables, seq_lens, qsl


def _run(fw, q, k, v, tables, seq_lens, qsl, ks=None, vs=None, q_view=None, num_splits=1):
    hq, kvh = q.shape[1], k.shape[2]
    block_q = queries_per_program(hq // kvh, int(np.diff(qsl).max()))
    seq, q0 = attention_programs(qsl, block_q)
    t = lambda a: None if a is None else fw.tensor(a)  # noqa: E731
    qt = t(q) if q_view is None else q_view
    out = fw.tensor(np.full(q.shape, np.nan, np.float32))  # every row must be written
    unified_attention(qt, t(k), t(v), out, t(tables), t(seq_lens), t(qsl), t(seq), t(q0), block_q,
                      q.shape[2] ** -0.5, t(ks), t(vs), num_splits=num_splits)
    return fw.numpy(out)


@pytest.mark.parametrize("hq,kvh,d,block_size", [(4, 2, 32, 16), (4, 1, 24, 16), (2, 2, 16, 5), (8, 2, 64, 64)])
def test_mixed_step_matches_gathered_causal_softmax(fw, hq, kvh, d, block_size):
    rng = np.random.default_rng(hq * 100 + d + block_size)
    q, k, v, tables, seq_lens, qsl = _step(rng, hq, kvh, d, block_size)
    got = _run(fw, q, k, v, tables, seq_lens, qsl)
    expect = ref.unified_attention(q, k, v, tables, seq_lens, qsl, d ** -0.5)
    # fp32 in the interpreter; online vs two-pass softmax differ in rounding only
    np.testing.assert_allclose(got, expect, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kv", ["int8_channel", "int8_block"])
def test_int8_cache_is_dequantized_as_it_is_read(fw, kv):
    rng = np.random.default_rng(7)
    q, k, v, tables, seq_lens, qsl = _step(rng, 4, 2, 32, 16)
    if kv == "int8_channel":
        ks, vs = F.calibrate_kv_scale(k), F.calibrate_kv_scale(v)
        k, v = F.quantize_kv_static(k, ks), F.quantize_kv_static(v, vs)
    else:
        (k, ks), (v, vs) = F.quantize_kv_dynamic(k), F.quantize_kv_dynamic(v)
    got = _run(fw, q, k, v, tables, seq_lens, qsl, ks, vs)
    np.testing.assert_allclose(got, ref.unified_attention(q, k, v, tables, seq_lens, qsl, 32 ** -0.5, ks, vs),
                               rtol=1e-4, atol=1e-5)


def test_queries_read_in_place_from_a_fused_qkv_row(fw):
    """q is the leading columns of the step's [T, (Hq + 2 Hkv) * D] qkv projection: a strided view."""
    rng = np.random.default_rng(3)
    q, k, v, tables, seq_lens, qsl = _step(rng, 4, 2, 32, 16)
    qkv = np.concatenate([q.reshape(len(q), -1), rng.standard_normal((len(q), 2 * 2 * 32)).astype(np.float32)], 1)
    view = fw.tensor(qkv)[:, : 4 * 32].reshape([len(q), 4, 32])  # a view in both frameworks
    got = _run(fw, q, k, v, tables, seq_lens, qsl, q_view=view)
    np.testing.assert_allclose(got, ref.unified_attention(q, k, v, tables, seq_lens, qsl, 32 ** -0.5),
                               rtol=1e-4, atol=1e-5)


def test_programs_cover_every_query_once():
    qsl = np.array([0, 1, 4, 24, 33])
    seq, q0 = attention_programs(qsl, 8)
    covered = [(int(s), int(a) + j) for s, a in zip(seq, q0) for j in range(8) if int(a) + j < np.diff(qsl)[s]]
    assert sorted(covered) == [(s, j) for s in range(4) for j in range(int(np.diff(qsl)[s]))]


def test_decode_only_steps_pack_a_group_per_program():
    assert queries_per_program(group=4, max_query_len=1) == 4  # 4 decodes x 4 heads = 16 rows
    assert queries_per_program(group=2, max_query_len=300) == 32  # prefill: 64 rows


def test_int8_cache_needs_scales(fw):
    rng = np.random.default_rng(0)
    q, k, v, tables, seq_lens, qsl = _step(rng, 4, 2, 32, 16)
    with pytest.raises(ValueError, match="needs k_scale"):
        _run(fw, q, k.astype(np.int8), v.astype(np.int8), tables, seq_lens, qsl)


# a small decode batch over long contexts (split KV's case) and the mixed step (splits shorter than some queries'
# contexts, so a split can hold keys a row does not see yet)
LONG_DECODES = [(1, 300), (1, 77), (2, 129)]


@pytest.mark.parametrize("seqs", [LONG_DECODES, MIXED], ids=["decodes", "mixed"])
@pytest.mark.parametrize("num_splits", [2, 4, 16])
def test_split_kv_gives_the_unsplit_result(fw, seqs, num_splits):
    rng = np.random.default_rng(num_splits)
    q, k, v, tables, seq_lens, qsl = _step(rng, 4, 2, 32, 16, seqs=seqs)
    got = _run(fw, q, k, v, tables, seq_lens, qsl, num_splits=num_splits)
    np.testing.assert_allclose(got, ref.unified_attention(q, k, v, tables, seq_lens, qsl, 32 ** -0.5),
                               rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(got, _run(fw, q, k, v, tables, seq_lens, qsl), rtol=1e-5, atol=1e-6)


def test_split_kv_over_an_int8_cache_one_kv_head_and_head_dim_24(fw):
    rng = np.random.default_rng(11)
    q, k, v, tables, seq_lens, qsl = _step(rng, 4, 1, 24, 16, seqs=LONG_DECODES)
    (k, ks), (v, vs) = F.quantize_kv_dynamic(k), F.quantize_kv_dynamic(v)
    got = _run(fw, q, k, v, tables, seq_lens, qsl, ks, vs, num_splits=8)
    np.testing.assert_allclose(got, ref.unified_attention(q, k, v, tables, seq_lens, qsl, 24 ** -0.5, ks, vs),
                               rtol=1e-4, atol=1e-5)


def test_kv_splits_fill_the_gpu_only_when_the_step_does_not():
    assert kv_splits(num_programs=4, kv_heads=4, max_seq_len=32768, target_programs=264) == 16
    assert kv_splits(num_programs=16, kv_heads=4, max_seq_len=32768, target_programs=264) == 4  # 5 wanted: 4
    assert kv_splits(num_programs=128, kv_heads=4, max_seq_len=32768, target_programs=264) == 1  # full already
    assert kv_splits(num_programs=1, kv_heads=1, max_seq_len=300, target_programs=264) == 2  # >= 4 tiles a split
    assert kv_splits(num_programs=1, kv_heads=1, max_seq_len=100, target_programs=264) == 1
    assert kv_splits(num_programs=1, kv_heads=1, max_seq_len=10 ** 6, target_programs=264) == MAX_SPLITS
    assert kv_splits(num_programs=1, kv_heads=1, max_seq_len=10 ** 6, target_programs=0) == 1  # off


def test_num_splits_must_be_a_power_of_two(fw):
    rng = np.random.default_rng(0)
    q, k, v, tables, seq_lens, qsl = _step(rng, 4, 2, 32, 16)
    with pytest.raises(ValueError, match="num_splits must be a power of two"):
        _run(fw, q, k, v, tables, seq_lens, qsl, num_splits=3)
