"""Fused MoE kernel vs the per-token NumPy loop over dequantized experts (activations fake-quantized
exactly as the kernel quantizes its A tiles)."""

import numpy as np
import pytest

from ernie_kernels import fused_moe
from ernie_kernels import reference as ref
from ernie_serve.quantization import formats as F

E, H, I, T, TOPK = 4, 128, 128, 6, 2


def _routing(rng):
    ids = np.stack([rng.permutation(E)[:TOPK] for _ in range(T)]).astype(np.int64)
    return ids, rng.random((T, TOPK)).astype(np.float32)


def _quantize(w, method):
    if method is None:
        return w, None
    if method == "block_wise_fp8":
        return F.quantize_block_fp8(w)
    if method == "wint2":
        q = F.quantize_wint2(w)
        return q.pop("quant_weight"), q
    return F.quantize_weight_only(w, 8 if method == "wint8" else 4)


def _problem(seed: int, method):
    """Activations, the experts quantized by `method` (codes and scales) and a routing."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((T, H)).astype(np.float32)
    ug = (rng.standard_normal((E, H, 2 * I)) * 0.1).astype(np.float32)
    dn = (rng.standard_normal((E, I, H)) * 0.1).astype(np.float32)
    ids, wts = _routing(rng)
    return x, _quantize(ug, method), _quantize(dn, method), ids, wts


# fp32 operands in the interpreter; w4a8's int32 dot is exact. Tolerances cover summation order, plus for
# the activation-quantizing methods a rare flip of one rounding decision between kernel and NumPy.
@pytest.mark.parametrize("method,tol", [(None, 1e-4), ("wint8", 1e-4), ("wint4", 1e-4), ("block_wise_fp8", 2e-3),
                                        ("w4a8", 2e-3), ("wint2", 1e-4)])
def test_fused_moe_matches_reference(fw, method, tol):
    x, (qug, sug), (qdn, sdn), ids, wts = _problem(0, method)
    a1 = a2 = None
    if method == "w4a8":
        a1 = np.full(E, F.calibrate_activation_scale(x), np.float32)
        a2 = np.full(E, 0.02, np.float32)
    fp8 = method == "block_wise_fp8"
    def t(a, **kw):
        if isinstance(a, dict):
            return {k: fw.tensor(v) for k, v in a.items()}
        return None if a is None else fw.tensor(a, **kw)

    y = fused_moe(t(x), t(qug, fp8=fp8), t(qdn, fp8=fp8), t(ids), t(wts), method, t(sug), t(sdn), t(a1), t(a2))
    expect = ref.fused_moe(x, qug, qdn, ids, wts, method, sug, sdn, a1, a2)
    assert tuple(y.shape) == (T, H)
    np.testing.assert_allclose(fw.numpy(y), expect, rtol=tol, atol=tol)


@pytest.mark.parametrize("method", [None, "wint4"])
def test_expert_parallel_ranks_sum_to_the_whole_moe(fw, method):
    """Each rank holds half the experts and gets the global routing: its output is its experts' share (slots
    routed to the other rank add nothing), and the two shares add up to the unsplit MoE."""
    x, (qug, sug), (qdn, sdn), ids, wts = _problem(5, method)
    whole = ref.fused_moe(x, qug, qdn, ids, wts, method, sug, sdn)
    half = E // 2
    total = np.zeros_like(whole)
    for start in (0, half):
        part = slice(start, start + half)
        cut = (lambda a: None if a is None else fw.tensor(a[part]))
        y = fw.numpy(fused_moe(fw.tensor(x), cut(qug), cut(qdn), fw.tensor(ids), fw.tensor(wts), method, cut(sug),
                               cut(sdn), expert_start=start))
        expect = ref.fused_moe(x, qug[part], qdn[part], ids, wts, method, None if sug is None else sug[part],
                               None if sdn is None else sdn[part], expert_start=start)
        np.testing.assert_allclose(y, expect, rtol=1e-4, atol=1e-4)
        total += y
    np.testing.assert_allclose(total, whole, rtol=1e-4, atol=1e-4)


def test_fused_moe_bf16_activations(fw):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((T, H)).astype(np.float32)
    ug = (rng.standard_normal((E, H, 2 * I)) * 0.1).astype(np.float32)
    dn = (rng.standard_normal((E, I, H)) * 0.1).astype(np.float32)
    ids, wts = _routing(rng)
    q1, s1 = F.quantize_weight_only(ug, 8)
    q2, s2 = F.quantize_weight_only(dn, 8)
    xb = fw.tensor(x, bf16=True)
    y = fused_moe(xb, fw.tensor(q1), fw.tensor(q2), fw.tensor(ids), fw.tensor(wts), "wint8", fw.tensor(s1),
                  fw.tensor(s2))
    assert "bfloat16" in str(y.dtype)
    expect = ref.fused_moe(fw.numpy(xb), q1, q2, ids, wts, "wint8", s1, s2)
    # the intermediate and the per-slot outputs are stored in bf16 (truncated in the interpreter)
    np.testing.assert_allclose(fw.numpy(y), expect, rtol=3e-2, atol=3e-2)


def test_fused_moe_needs_scales_for_quantized_weights(fw):
    z = fw.tensor(np.zeros((1, 4), np.float32))
    with pytest.raises(ValueError, match="needs up_gate_scale"):
        fused_moe(z, z, z, fw.tensor(np.zeros((1, 1), np.int64)), z, "wint8")


def test_wint2_reference_dequant_is_the_engines():
    """The kernels' NumPy wint2 decoding (restated, no engine import) equals formats.dequantize_wint2."""
    w = np.random.default_rng(3).standard_normal((2, 192, 80)).astype(np.float32)
    q = F.quantize_wint2(w)
    expect = F.dequantize_wint2(q["quant_weight"], q["weight_scale"], q["code_scale"], q["code_zp"],
                                q["super_scales"])
    np.testing.assert_array_equal(ref.dequant(q["quant_weight"], q, "wint2"), expect)


def test_fused_moe_wint2_refuses_incomplete_scales(fw):
    z = fw.tensor(np.zeros((1, 64), np.float32))
    with pytest.raises(ValueError, match="wint2 scales must be dicts"):
        fused_moe(z, z, z, fw.tensor(np.zeros((1, 1), np.int64)), z, "wint2", z, z)
