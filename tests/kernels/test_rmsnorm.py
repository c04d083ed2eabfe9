import numpy as np

from ernie_kernels import reference as ref
from ernie_kernels import rms_norm


def test_rmsnorm_matches_reference_fp32(fw):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 96)).astype(np.float32)
    w = rng.standard_normal(96).astype(np.float32)
    y = rms_norm(fw.tensor(x), fw.tensor(w), 1e-5)
    np.testing.assert_allclose(fw.numpy(y), ref.rms_norm(x, w), rtol=1e-5, atol=1e-5)


def test_fused_residual_add_returns_the_sum_as_next_residual(fw):
    rng = np.random.default_rng(1)
    x, r = rng.standard_normal((2, 3, 64)).astype(np.float32)
    w = rng.standard_normal(64).astype(np.float32)
    y, h = rms_norm(fw.tensor(x), fw.tensor(w), 1e-6, residual=fw.tensor(r))
    ry, rh = ref.rms_norm(x, w, 1e-6, residual=r)
    np.testing.assert_allclose(fw.numpy(y), ry, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(fw.numpy(h), rh, rtol=1e-6, atol=1e-6)


def test_bf16_activations_stay_bf16_and_round_once(fw):
    x = np.random.default_rng(2).standard_normal((4, 64)).astype(np.float32)
    w = np.ones(64, np.float32)
    xb = fw.tensor(x, bf16=True)
    y = rms_norm(xb, fw.tensor(w))
    assert "bfloat16" in str(y.dtype)
    # one rounding of the fp32 result to bf16 (8 significant bits): <= 2^-8 relative when rounding to
    # nearest (GPU); the 3.2 interpreter truncates (measured), <= 2^-7
    np.testing.assert_allclose(fw.numpy(y), ref.rms_norm(fw.numpy(xb), w), rtol=2 ** -7, atol=1e-6)
