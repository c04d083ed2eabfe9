import numpy as np
import pytest

from ernie_kernels import reference as ref
from ernie_kernels import weight_only_linear
from ernie_serve.quantization.formats import quantize_block_fp8, quantize_weight_only


def _quantize(w: np.ndarray, method: str):
    if method == "block_wise_fp8":
        return quantize_block_fp8(w)
    return quantize_weight_only(w, 8 if method == "wint8" else 4)


# fp32 operands in the interpreter: only summation order differs from NumPy (fp8 also quantizes the
# activations per 128 group, exactly as the reference's fake quantization does)
@pytest.mark.parametrize("method,n", [("wint8", 80), ("wint4", 80), ("block_wise_fp8", 200)])
def test_weight_only_gemm_matches_dequantized_matmul(fw, method, n):
    rng = np.random.default_rng(len(method))
    x = rng.standard_normal((5, 256)).astype(np.float32)
    q, s = _quantize(rng.standard_normal((256, n)).astype(np.float32), method)
    y = weight_only_linear(fw.tensor(x), fw.tensor(q, fp8=method == "block_wise_fp8"), fw.tensor(s), method)
    assert tuple(y.shape) == (5, n)
    np.testing.assert_allclose(fw.numpy(y), ref.weight_only_linear(x, q, s, method), rtol=1e-5, atol=1e-4)


def test_weight_only_gemm_rejects_mismatched_shapes(fw):
    with pytest.raises(ValueError, match="does not match"):
        weight_only_linear(fw.tensor(np.zeros((2, 64), np.float32)), fw.tensor(np.zeros((64, 8), np.int8)),
                           fw.tensor(np.ones(8, np.float32)), "wint4")
    with pytest.raises(ValueError, match="method must be one of"):
        weight_only_linear(fw.tensor(np.zeros((2, 64), np.float32)), fw.tensor(np.zeros((64, 8), np.int8)),
                           fw.tensor(np.ones(8, np.float32)), "wint2")
