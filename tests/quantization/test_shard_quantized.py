"""Splitting quantized weights across tensor-parallel ranks in their quantized form: a rank's part must
dequantize to exactly the same slice of the full quantized weight (so every rank count serves the same
model), and a split that breaks a format's row packing or scale blocks is refused, naming it."""
from __future__ import annotations

import numpy as np
import pytest

from ernie_serve.quantization import formats as F

K, N = 512, 384


def _dequantize(method: str, t: dict[str, np.ndarray]) -> np.ndarray:
    if method == "wint8":
        return F.dequantize_weight_only(t["quant_weight"], t["weight_scale"], 8)
    if method in ("wint4", "w4a8"):
        return F.dequantize_weight_only(t["quant_weight"], t["weight_scale"], 4)
    if method == "block_wise_fp8":
        return F.dequantize_block_fp8(t["quant_weight"].view(np.uint8), t["weight_scale_inv"])
    return F.dequantize_wint2(t["quant_weight"], t["weight_scale"], t["code_scale"], t["code_zp"], t["super_scales"])


@pytest.fixture(scope="module")
def quantized() -> dict[str, dict[str, np.ndarray]]:
    w = np.random.default_rng(0).standard_normal((K, N)).astype(np.float32)
    out = {}
    for m in F.METHODS:
        t = F.quantize_float(w, m, activation_scale=0.05 if m == "w4a8" else None)
        out[m] = F.normalize_quantized(m, t, K, N)
    return out


def _runs(*ranges: tuple[int, int]) -> np.ndarray:
    return np.concatenate([np.arange(a, b) for a, b in ranges])


# what real layouts ask: contiguous halves / quarters (row-parallel o_proj and down_proj, column-parallel
# experts), and qkv-like columns made of several runs (this rank's Q heads, then its K and V heads)
SPLITS = [(0, _runs((0, 256))), (0, _runs((256, 512))), (0, _runs((128, 256))),
          (1, _runs((0, 192))), (1, _runs((128, 256), (384, 384))), (1, _runs((0, 128), (256, 384)))]


@pytest.mark.parametrize("method", F.METHODS)
@pytest.mark.parametrize("axis,keep", SPLITS)
def test_a_rank_part_dequantizes_to_the_slice_of_the_full_quantized_weight(quantized, method, axis, keep):
    full = quantized[method]
    part = F.shard_quantized(method, full, axis, keep)
    want = np.take(_dequantize(method, full), keep, axis=axis)
    got = _dequantize(method, part)
    np.testing.assert_array_equal(got, want)
    shape = (keep.size, N) if axis == 0 else (K, keep.size)
    F.normalize_quantized(method, part, *shape)  # the part is a well-formed quantized weight of its shape
    if method == "w4a8":
        assert part["activation_scale"] == full["activation_scale"]


def test_fp8_column_blocks_that_a_rank_only_partly_holds_still_read_their_own_scale(quantized):
    """64 columns inside one 128-column block: the local block 0 reads the full block's scale."""
    full = quantized["block_wise_fp8"]
    keep = np.arange(192, 256)
    part = F.shard_quantized("block_wise_fp8", full, 1, keep)
    np.testing.assert_array_equal(_dequantize("block_wise_fp8", part),
                                  _dequantize("block_wise_fp8", full)[:, keep])


@pytest.mark.parametrize("method,axis,keep,unit", [
    ("wint4", 0, _runs((1, 129)), "2-row packed"),
    ("w4a8", 0, _runs((0, 63)), "2-row packed"),
    ("wint2", 0, _runs((0, 96)), "64-row"),
    ("wint2", 0, _runs((32, 96)), "64-row"),
    ("block_wise_fp8", 0, _runs((64, 256)), "128-row"),
    ("block_wise_fp8", 1, _runs((0, 64), (128, 192)), "128-column"),
])
def test_a_split_across_packed_rows_or_scale_blocks_is_refused_naming_it(quantized, method, axis, keep, unit):
    with pytest.raises(ValueError, match=f"layers.0.o_proj: .* do not fall on {method}'s {unit} groups"):
        F.shard_quantized(method, quantized[method], axis, keep, what="layers.0.o_proj")
