import numpy as np
import pytest

from ernie_kernels import reference as ref
from ernie_kernels import weight_only_linear
from ernie_serve.quantization.formats import quantize_weight_only


@pytest.mark.parametrize("bits", [8, 4])
def test_weight_only_gemm_matches_dequantized_matmul(fw, bits):
    rng = np.random.default_rng(bits)
    x = rng.standard_normal((5, 128)).astype(np.float32)
    q, s = quantize_weight_only(rng.standard_normal((128, 80)).astype(np.float32), bits)
    y = weight_only_linear(fw.tensor(x), fw.tensor(q), fw.tensor(s), bits)
    assert tuple(y.shape) == (5, 80)
    # fp32 operands in the interpreter: only summation order differs from NumPy
    np.testing.assert_allclose(fw.numpy(y), ref.weight_only_linear(x, q, s, bits), rtol=1e-5, atol=1e-4)


def test_weight_only_gemm_rejects_mismatched_shapes(fw):
    with pytest.raises(ValueError, match="does not match"):
        weight_only_linear(fw.tensor(np.zeros((2, 64), np.float32)), fw.tensor(np.zeros((64, 8), np.int8)),
                           fw.tensor(np.ones(8, np.float32)), 4)
