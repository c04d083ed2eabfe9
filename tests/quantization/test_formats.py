"""Round trips of every quantized format, with the error bound each format promises."""

import ml_dtypes
import numpy as np
import pytest

from ernie_serve.quantization import formats as F


@pytest.fixture
def w():
    return np.random.default_rng(0).standard_normal((2, 256, 96)).astype(np.float32)  # [E, K, N]


@pytest.mark.parametrize("bits", [8, 4])
def test_weight_only_error_is_at_most_half_a_step_per_channel(w, bits):
    q, s = F.quantize_weight_only(w, bits)
    assert s.shape == (2, 96) and s.dtype == np.float32
    assert q.dtype == np.int8 and q.shape == ((2, 256, 96) if bits == 8 else (2, 128, 96))
    np.testing.assert_allclose(s, np.abs(w).max(axis=1) / (127 if bits == 8 else 7), rtol=1e-6)
    err = np.abs(F.dequantize_weight_only(q, s, bits) - w)
    assert (err <= s[:, None, :] * 0.5 + 1e-6).all()


def test_int4_packing_is_low_nibble_first_twos_complement():
    q = np.array([[-8], [7], [-1], [3]], np.int8)
    p = F.pack_int4(q)
    assert p.view(np.uint8).tolist() == [[0x78], [0x3F]]
    np.testing.assert_array_equal(F.unpack_int4(p), q)
    allq = np.random.default_rng(1).integers(-8, 8, (3, 64, 5)).astype(np.int8)
    np.testing.assert_array_equal(F.unpack_int4(F.pack_int4(allq)), allq)


def test_int4_needs_even_k():
    with pytest.raises(ValueError, match="even K"):
        F.quantize_weight_only(np.ones((3, 4), np.float32), 4)


def test_fp8_codec_matches_ml_dtypes_and_saturates():
    x = np.array([0.0, 1.0, -2.5, 0.1, 500.0, -1e4, 448.0], np.float32)
    codes = F.fp8_e4m3_encode(x)
    assert codes.dtype == np.uint8
    np.testing.assert_array_equal(F.fp8_e4m3_decode(codes),
                                  np.clip(x, -448, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float32))


def test_block_fp8_has_one_scale_per_128_block_and_relative_error_below_2_pow_minus_4(w):
    w = np.random.default_rng(2).standard_normal((200, 300)).astype(np.float32)
    q, s = F.quantize_block_fp8(w)
    assert q.shape == w.shape and s.shape == (2, 3)
    np.testing.assert_allclose(s[1, 2], np.abs(w[128:, 256:]).max() / 448, rtol=1e-6)
    d = F.dequantize_block_fp8(q, s)
    # e4m3 has 3 mantissa bits: relative rounding error <= 2^-4 for normal values; subnormals below
    # 2^-6 * scale lose at most half the subnormal step 2^-10 * scale.
    full = np.repeat(np.repeat(s, 128, 0), 128, 1)[:200, :300]
    assert (np.abs(d - w) <= np.maximum(np.abs(w) * 2 ** -4, full * 2 ** -10) + 1e-7).all()


def test_act_fp8_is_per_token_per_128_group():
    x = np.random.default_rng(3).standard_normal((4, 200)).astype(np.float32)
    x[1, 130] = 50.0
    q, s = F.quantize_act_fp8(x)
    assert s.shape == (4, 2)
    assert s[1, 1] == np.float32(50.0 / 448) and s[1, 0] < 1.0
    d = F.dequantize_act_fp8(q, s)
    assert (np.abs(d - x) <= np.abs(x) * 2 ** -4 + np.repeat(s, 128, 1)[:, :200] * 2 ** -10).all()


def test_wint2_decoder_follows_the_ccq_bit_layout():
    # one byte, code_scale 1, zp 0: v = b, fields (v>>9,6,3,0)&63 - 32 at k = 0..3
    codes = np.array([[0b10110101]], np.uint8)
    f = F.wint2_fields(codes, np.ones(1, np.float32), np.zeros(1, np.float32))
    b = 0b10110101
    assert f[:, 0].tolist() == [((b >> 9) & 63) - 32, ((b >> 6) & 63) - 32, ((b >> 3) & 63) - 32, (b & 63) - 32]
    # code affine map: v = floor(b*cs + zp + 0.5)
    f2 = F.wint2_fields(np.array([[3]], np.uint8), np.full(1, 100.0, np.float32), np.full(1, 7.4, np.float32))
    v = 307
    assert f2[:, 0].tolist() == [((v >> s) & 63) - 32 for s in (9, 6, 3, 0)]


def test_wint2_local_scales_are_high_nibble_for_even_groups():
    ls = np.array([[0x3A]], np.uint8)  # groups 0 and 1 of a K=128 column
    gs = F.wint2_group_scales(ls, np.array([2.0], np.float32), 128)
    assert gs[:, 0].tolist() == [6.0, 20.0]


def test_wint2_encoder_round_trips_through_the_decoder_with_2bit_error(w):
    t = F.quantize_wint2(w)
    assert t["quant_weight"].shape == (2, 64, 96) and t["weight_scale"].shape == (2, 2, 96)
    d = F.dequantize_wint2(t["quant_weight"], t["weight_scale"], t["code_scale"], t["code_zp"], t["super_scales"])
    rel = np.sqrt(((d - w) ** 2).mean() / (w ** 2).mean())
    assert rel < 0.42  # measured 0.37: about what an optimal 2-bit scalar quantizer gets (0.34)


def test_w4a8_activation_quantization_rounds_half_away_and_clips():
    q = F.quantize_act_int8_static(np.array([0.5, -0.5, 1.49, 300.0, -300.0], np.float32), 1.0)
    assert q.tolist() == [1, -1, 1, 127, -127]
    w = np.random.default_rng(4).standard_normal((64, 16)).astype(np.float32)
    t = F.quantize_w4a8(w, 0.05)
    assert t["activation_scale"].shape == () and t["quant_weight"].shape == (32, 16)


def test_c8_static_kv_round_trip_within_half_step_per_channel():
    rng = np.random.default_rng(5)
    x = rng.standard_normal((6, 4, 2, 8)).astype(np.float32)  # [blocks, block_size, kv_heads, head_dim]
    s = F.calibrate_kv_scale(x)
    assert s.shape == (16,)
    q = F.quantize_kv_static(x, s)
    err = np.abs(F.dequantize_kv_static(q, s) - x)
    assert (err <= s.reshape(2, 8) / 127 * 0.5 + 1e-6).all()


def test_c8_dynamic_kv_scale_per_block_and_head():
    x = np.random.default_rng(6).standard_normal((3, 4, 2, 8)).astype(np.float32)
    q, s = F.quantize_kv_dynamic(x)
    assert s.shape == (3, 2)
    np.testing.assert_allclose(s[1, 0], np.abs(x[1, :, 0, :]).max())
    err = np.abs(F.dequantize_kv_dynamic(q, s) - x)
    assert (err <= s[:, None, :, None] / 127 * 0.5 + 1e-6).all()
