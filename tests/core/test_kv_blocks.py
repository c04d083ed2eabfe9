"""KV blocks in the cache's own format for prefill/decode transfer (kv_blocks.py): the wire, tensor-parallel
heads, and the reference cache's export / import between formats (as-is when they match, through float32
otherwise)."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from ernie_serve.engine.kv_transfer import KVTransfer
from ernie_serve.kv_blocks import KVBlocks
from ernie_serve.model.kv_cache import KVCacheQuant, PagedKVCache
from ernie_serve.quantization import formats as fmt

LAYERS, BLOCK, HEADS, HD = 2, 4, 2, 8


def _values(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((LAYERS, 2, n, BLOCK, HEADS, HD)).astype(np.float32)


def _static_scales(seed: int = 1) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.uniform(1.0, 3.0, HEADS * HD).astype(np.float32) for _ in range(LAYERS)]


def _cache(kind: str | None, scales: tuple | None = None) -> PagedKVCache:
    quant = None
    if kind == "static":
        k, v = scales or (_static_scales(1), _static_scales(2))
        quant = KVCacheQuant(k, v)
    elif kind == "dynamic":
        quant = KVCacheQuant()
    return PagedKVCache(LAYERS, 8, BLOCK, HEADS, HD, quant)


def _filled(kind: str | None, ids: list[int], seed: int = 0, **kw) -> PagedKVCache:
    cache = _cache(kind, **kw)
    cache.write_blocks(ids, _values(len(ids), seed))
    return cache


@pytest.mark.parametrize("kind", [None, "static", "dynamic"])
def test_blocks_cross_the_wire_bit_for_bit_and_c8_in_a_quarter_of_the_bytes(kind):
    blocks = _filled(kind, [3, 1, 5]).export_blocks([3, 1, 5])
    transfer = KVTransfer("r", [1, 2, 3], [4], 3, BLOCK, blocks)
    back = KVTransfer.from_frames([bytes(f) for f in transfer.to_frames()]).blocks
    assert back.dtype == blocks.dtype and back.scale_kind == kind
    np.testing.assert_array_equal(back.codes, blocks.codes)
    if kind is not None:
        np.testing.assert_array_equal(back.scales, blocks.scales)
        assert blocks.codes.nbytes * 4 == _values(3).nbytes  # int8 codes; scales are per channel or per block


def test_bfloat16_blocks_cross_as_bfloat16():
    codes = _values(2).astype(ml_dtypes.bfloat16)
    back = KVBlocks.from_frames([bytes(f) for f in KVBlocks(codes).to_frames()])
    assert back.dtype == "bfloat16" and back.codes.nbytes == codes.nbytes
    np.testing.assert_array_equal(back.to_float32(), codes.astype(np.float32))


@pytest.mark.parametrize("kind", [None, "static", "dynamic"])
def test_a_cache_of_the_same_format_stores_the_codes_as_they_came(kind):
    src = _filled(kind, [0, 2, 4])
    blocks = src.export_blocks([0, 2, 4])
    dst = _cache(kind)
    dst.import_blocks([7, 6, 5], blocks)
    again = dst.export_blocks([7, 6, 5])
    np.testing.assert_array_equal(again.codes, blocks.codes)  # no requantization on the way
    if kind is not None:
        np.testing.assert_array_equal(again.scales, blocks.scales)
    np.testing.assert_array_equal(dst.read_blocks([7, 6, 5]), src.read_blocks([0, 2, 4]))


@pytest.mark.parametrize("src_kind,dst_kind", [(None, "static"), (None, "dynamic"), ("static", None),
                                               ("dynamic", None), ("static", "dynamic"), ("dynamic", "static")])
def test_other_formats_meet_in_float32(src_kind, dst_kind):
    blocks = _filled(src_kind, [1, 2]).export_blocks([1, 2])
    dst = _cache(dst_kind)
    dst.import_blocks([3, 4], blocks)
    want = _cache(dst_kind)
    want.write_blocks([3, 4], blocks.to_float32())  # what the destination makes of the float values
    np.testing.assert_array_equal(dst.read_blocks([3, 4]), want.read_blocks([3, 4]))


def test_static_c8_with_other_scales_is_requantized_not_copied():
    blocks = _filled("static", [0]).export_blocks([0])
    other = (_static_scales(5), _static_scales(6))
    dst = _cache("static", scales=other)
    dst.import_blocks([1], blocks)
    want = _cache("static", scales=other)
    want.write_blocks([1], blocks.to_float32())
    np.testing.assert_array_equal(dst.export_blocks([1]).codes, want.export_blocks([1]).codes)


def test_dequantized_blocks_are_the_formats_definitions():
    cache = _filled("dynamic", [2, 3])
    blocks = cache.export_blocks([2, 3])
    layer0_k = fmt.dequantize_kv_dynamic(blocks.codes[0, 0], blocks.scales[0, 0])
    np.testing.assert_array_equal(blocks.to_float32()[0, 0], layer0_k)
    np.testing.assert_array_equal(blocks.to_float32(), cache.read_blocks([2, 3]))


@pytest.mark.parametrize("kind", [None, "static", "dynamic"])
def test_ranks_heads_join_into_whole_blocks_and_split_back(kind):
    """Two ranks each holding one KV head, and four ranks replicating them (two per head)."""
    whole = _filled(kind, [0, 1, 2]).export_blocks([0, 1, 2])
    for heads in ([range(0, 1), range(1, 2)], [range(0, 1), range(0, 1), range(1, 2), range(1, 2)]):
        parts = [whole.take_heads(h) for h in heads]
        joined = KVBlocks.join_heads(parts, heads, HEADS)
        np.testing.assert_array_equal(joined.codes, whole.codes)
        if kind is not None:
            np.testing.assert_array_equal(joined.scales, whole.scales)


def test_malformed_blocks_are_refused_naming_what_is_wrong():
    with pytest.raises(ValueError, match="int8 codes need 'static' or 'dynamic' scales"):
        KVBlocks(np.zeros((1, 2, 1, 4, 2, 8), np.int8))
    with pytest.raises(ValueError, match=r"static KV scales of shape \[1, 2, 2\], expected \[1, 2, 2, 8\]"):
        KVBlocks(np.zeros((1, 2, 1, 4, 2, 8), np.int8), "static", np.ones((1, 2, 2), np.float32))
    with pytest.raises(ValueError, match="float64"):
        KVBlocks(np.zeros((1, 2, 1, 4, 2, 8), np.float64))


def test_a_bfloat16_cache_holds_rounded_values_and_exchanges_them_with_every_format():
    """--dtype bfloat16's cache: values rounded to nearest even as they are written, read back as float32, exported
    as bfloat16 codes (half float32's bytes), stored as they came by another bfloat16 cache, and met in float32 by
    the other formats."""
    values = _values(3)
    rounded = values.astype(ml_dtypes.bfloat16).astype(np.float32)
    src = PagedKVCache(LAYERS, 8, BLOCK, HEADS, HD, dtype="bfloat16")
    src.write_blocks([3, 1, 5], values)
    np.testing.assert_array_equal(src.read_blocks([3, 1, 5]), rounded)
    k, _ = src.gather(0, np.array([[3, 1]]))
    np.testing.assert_array_equal(k.numpy()[0].transpose(1, 0, 2), rounded[0, 0, :2].reshape(-1, HEADS, HD))
    blocks = src.export_blocks([3, 1, 5])
    assert blocks.dtype == "bfloat16" and blocks.codes.nbytes * 2 == values.nbytes
    assert PagedKVCache.bytes_per_block(LAYERS, BLOCK, HEADS, HD, dtype="bfloat16") * 2 == \
        PagedKVCache.bytes_per_block(LAYERS, BLOCK, HEADS, HD)
    same = PagedKVCache(LAYERS, 8, BLOCK, HEADS, HD, dtype="bfloat16")
    same.import_blocks([0, 2, 4], blocks)
    np.testing.assert_array_equal(same.export_blocks([0, 2, 4]).codes, blocks.codes)
    for kind in (None, "static", "dynamic"):
        dst, want = _cache(kind), _cache(kind)
        dst.import_blocks([0, 2, 4], blocks)
        want.write_blocks([0, 2, 4], rounded)
        np.testing.assert_array_equal(dst.read_blocks([0, 2, 4]), want.read_blocks([0, 2, 4]))
    from_f32 = PagedKVCache(LAYERS, 8, BLOCK, HEADS, HD, dtype="bfloat16")
    from_f32.import_blocks([6, 7], _filled(None, [1, 2]).export_blocks([1, 2]))
    np.testing.assert_array_equal(from_f32.read_blocks([6, 7]), _values(2).astype(ml_dtypes.bfloat16)
                                  .astype(np.float32))
