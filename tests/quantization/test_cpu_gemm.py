"""The CPU weight-only GEMM (cpu_gemm.c) against the dequantized reference, and QuantLinear's use of it."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import paddle
import pytest

from ernie_serve.quantization import cpu_gemm
from ernie_serve.quantization import formats as fmt
from ernie_serve.quantization.layers import QuantLinear

pytestmark = pytest.mark.skipif(not cpu_gemm.available(), reason="no C compiler to build cpu_gemm.c")


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("m,k,n", [(1, 64, 32), (3, 64, 96), (8, 128, 40), (9, 256, 64), (16, 1024, 1408),
                                   (17, 32, 33), (32, 96, 7)])
def test_matches_the_dequantized_matmul(bits, m, k, n):
    rng = np.random.default_rng(m * 1000 + n + bits)
    w = rng.standard_normal((k, n)).astype(np.float32)
    x = rng.standard_normal((m, k)).astype(np.float32)
    q, s = fmt.quantize_weight_only(w, bits)
    ref = x @ fmt.dequantize_weight_only(q, s, bits)
    got = cpu_gemm.weight_only_gemm(x, paddle.to_tensor(q), paddle.to_tensor(s), bits).numpy()
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-4 * np.abs(ref).max())


@pytest.mark.parametrize("method", ["wint8", "wint4", "w4a8"])
def test_quant_linear_gives_the_same_result_on_both_paths(method, monkeypatch):
    rng = np.random.default_rng(3)
    w = rng.standard_normal((256, 160)).astype(np.float32)
    x = paddle.to_tensor(rng.standard_normal((5, 256)).astype(np.float32))
    layer = QuantLinear.from_float(w, method, calib_x=rng.standard_normal((64, 256)).astype(np.float32)
                                   if method == "w4a8" else None)
    fast = layer(x).numpy()
    monkeypatch.setattr(cpu_gemm, "MAX_ROWS", 0)  # every row count takes the dequantized-tile path
    slow = layer(x).numpy()
    np.testing.assert_allclose(fast, slow, rtol=1e-5, atol=1e-4 * np.abs(slow).max())


def test_a_shape_mismatch_is_refused():
    q, s = fmt.quantize_weight_only(np.ones((64, 32), np.float32), 8)
    with pytest.raises(ValueError, match="does not fit"):
        cpu_gemm.weight_only_gemm(np.ones((2, 63), np.float32), paddle.to_tensor(q), paddle.to_tensor(s), 8)


def test_without_a_compiler_it_is_not_built_and_says_why(tmp_path):
    env = dict(os.environ, CC=str(tmp_path / "no-such-cc"), ERNIE_BUILD_DIR=str(tmp_path))
    code = ("import logging; logging.basicConfig(); from ernie_serve.quantization import cpu_gemm; "
            "print('available', cpu_gemm.available())")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert "available False" in r.stdout, r.stderr
    assert "CPU weight-only GEMM not built" in r.stderr
