"""QuantLinear / QuantMoEExperts equal dequantize-then-fp32-matmul, and the float experts."""

import numpy as np
import paddle
import pytest

from ernie_serve.quantization import formats as F
from ernie_serve.model.moe import FusedExperts
from ernie_serve.model.quantized_layers import METHODS, QuantLinear, QuantMoEExperts, model_memory_bytes

K, N, T = 256, 160, 7


@pytest.fixture
def data():
    rng = np.random.default_rng(0)
    return rng.standard_normal((K, N)).astype(np.float32) * 0.05, rng.standard_normal((T, K)).astype(np.float32)


def _reference(w, x, method, layer):
    """Dequantize with formats.py (NumPy), fake-quantize activations the same way, fp32 matmul."""
    t = layer.export()  # checkpoint layouts (the layer holds int codes in cpu_qgemm.c's layout)
    if method == "wint8":
        return x @ F.dequantize_weight_only(t["quant_weight"], t["weight_scale"], 8)
    if method == "wint4":
        return x @ F.dequantize_weight_only(t["quant_weight"], t["weight_scale"], 4)
    if method == "block_wise_fp8":
        xq = F.dequantize_act_fp8(*F.quantize_act_fp8(x))
        codes = t["quant_weight"].view(np.uint8)
        return xq @ F.dequantize_block_fp8(codes, t["weight_scale_inv"])
    if method == "wint2":
        return x @ F.dequantize_wint2(t["quant_weight"], t["weight_scale"], t["code_scale"], t["code_zp"],
                                      t["super_scales"])
    a = t["activation_scale"]
    return (F.quantize_act_int8_static(x, a).astype(np.float32) @
            F.unpack_int4(t["quant_weight"]).astype(np.float32)) * a * t["weight_scale"]


def _activation_rounding(method: str, ref: np.ndarray) -> float:
    """wint8 / wint4 on the CPU kernel take activations at 16-bit precision (cpu_qgemm.c): ~1e-5 of the output's
    scale; the other formats compute on the dequantized weight (fp32 rounding only)."""
    return 1e-4 * float(np.abs(ref).max()) if method in ("wint8", "wint4") else 1e-5


@pytest.mark.parametrize("method", METHODS)
def test_quant_linear_equals_dequantize_then_matmul(data, method):
    w, x = data
    layer = QuantLinear.from_float(w, method, calib_x=x)
    layer.tile_n = 128  # exercise the column tiling (N=160 -> tiles of 128 and 32)
    y = layer(paddle.to_tensor(x)).numpy()
    assert y.shape == (T, N)
    ref = _reference(w, x, method, layer)
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=_activation_rounding(method, ref))


@pytest.mark.parametrize("method,max_rel", [("wint8", 0.01), ("wint4", 0.15), ("block_wise_fp8", 0.05),
                                            ("wint2", 0.45), ("w4a8", 0.15)])
def test_quant_linear_is_close_to_the_float_matmul(data, method, max_rel):
    w, x = data
    y = QuantLinear.from_float(w, method, calib_x=x)(paddle.to_tensor(x)).numpy()
    ref = x @ w
    assert np.sqrt(((y - ref) ** 2).mean() / (ref ** 2).mean()) < max_rel


def test_from_checkpoint_accepts_torch_layout_fp8_and_reports_bytes(data):
    w, x = data
    q, s = F.quantize_block_fp8(w)
    a = QuantLinear.from_checkpoint({"quant_weight": q, "weight_scale_inv": s}, "block_wise_fp8")
    b = QuantLinear.from_checkpoint({"quant_weight": q.T.copy(), "weight_scale_inv": s.T.copy()},
                                    "block_wise_fp8", transposed=True)
    np.testing.assert_array_equal(a.dequantize().numpy(), b.dequantize().numpy())
    assert a.nbytes == K * N + s.size * 4
    w4 = QuantLinear.from_float(w, "wint4")
    assert w4.nbytes == K * N // 2 + N * 4
    with pytest.raises(ValueError, match="missing"):
        QuantLinear.from_checkpoint({"quant_weight": q}, "wint8")
    with pytest.raises(ValueError, match="unknown quantization method"):
        QuantLinear.from_float(w, "int3")


E, H, I, TOPK = 4, 128, 128, 2


@pytest.fixture
def moe():
    rng = np.random.default_rng(1)
    ug = rng.standard_normal((E, H, 2 * I)).astype(np.float32) * 0.1
    dn = rng.standard_normal((E, I, H)).astype(np.float32) * 0.1
    x = rng.standard_normal((9, H)).astype(np.float32)
    ids = np.stack([rng.permutation(E)[:TOPK] for _ in range(9)]).astype(np.int64)
    ids[:, 0] = np.where(np.arange(9) < 6, 0, ids[:, 0])  # expert 3 may stay idle; expert 0 is busy
    ids[:, 1] = np.where(ids[:, 1] == ids[:, 0], (ids[:, 0] + 1) % E, ids[:, 1])
    wts = rng.random((9, TOPK)).astype(np.float32)
    return ug, dn, x, ids, wts


def _moe_loop(x, ids, wts, up_gate, down):
    """Per-token loop over dense fp32 expert weights: the obviously correct MoE."""
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = ids[t, j]
            h = x[t] @ up_gate[e]
            g, u = h[:I], h[I:]
            out[t] += wts[t, j] * ((g / (1 + np.exp(-g)) * u) @ down[e])
    return out


def _pd(*arrays):
    return [paddle.to_tensor(a) for a in arrays]


def test_float_experts_match_a_per_token_loop(moe):
    ug, dn, x, ids, wts = moe
    y = FusedExperts.from_weights(ug, dn)(*_pd(x, ids, wts)).numpy()
    np.testing.assert_allclose(y, _moe_loop(x, ids, wts, ug, dn), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("method", ["wint8", "wint4", "wint2"])
def test_quant_experts_equal_float_experts_on_dequantized_weights(moe, method):
    ug, dn, x, ids, wts = moe
    qe = QuantMoEExperts.from_float(ug, dn, method)
    ug_d = np.stack([m.dequantize().numpy() for m in qe.up_gate_proj])
    dn_d = np.stack([m.dequantize().numpy() for m in qe.down_proj])
    y = qe(*_pd(x, ids, wts)).numpy()
    ref = FusedExperts.from_weights(ug_d, dn_d)(*_pd(x, ids, wts)).numpy()
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=_activation_rounding(method, ref))


@pytest.mark.parametrize("method,max_rel", [("block_wise_fp8", 0.1), ("w4a8", 0.3), ("wint4", 0.3)])
def test_quant_experts_are_close_to_float_experts(moe, method, max_rel):
    ug, dn, x, ids, wts = moe
    ref = FusedExperts.from_weights(ug, dn)(*_pd(x, ids, wts)).numpy()
    y = QuantMoEExperts.from_float(ug, dn, method, calib_x=x)(*_pd(x, ids, wts)).numpy()
    assert np.sqrt(((y - ref) ** 2).mean() / (ref ** 2).mean()) < max_rel


def test_quant_experts_from_stacked_checkpoint_tensors(moe):
    ug, dn, x, ids, wts = moe
    q1, s1 = F.quantize_weight_only(ug, 8)
    q2, s2 = F.quantize_weight_only(dn, 8)
    qe = QuantMoEExperts.from_checkpoint({"quant_weight": q1, "weight_scale": s1},
                                         {"quant_weight": q2, "weight_scale": s2}, "wint8")
    ref = FusedExperts.from_weights(F.dequantize_weight_only(q1, s1, 8), F.dequantize_weight_only(q2, s2, 8))
    want = ref(*_pd(x, ids, wts)).numpy()
    np.testing.assert_allclose(qe(*_pd(x, ids, wts)).numpy(), want, rtol=1e-5, atol=_activation_rounding("wint8", want))
    fe = FusedExperts.from_weights(ug, dn)
    assert model_memory_bytes([qe]) == q1.size + q2.size + (s1.size + s2.size) * 4
    assert model_memory_bytes([fe, paddle.zeros([10])]) == (ug.size + dn.size) * 4 + 40
