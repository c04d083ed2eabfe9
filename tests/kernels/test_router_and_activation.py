"""Router top-k (with the correction bias) and SiLU-and-mul kernels vs the reference model's layers."""

import numpy as np
import paddle
import paddle.nn.functional as F

from ernie_kernels.activation import silu_and_mul
from ernie_kernels.router import router_topk
from ernie_serve.model.layers import silu_and_mul as reference_silu_and_mul
from ernie_serve.model.moe import TopKRouter


def test_router_picks_the_biased_top_k_and_weights_by_unbiased_probs(fw):
    rng = np.random.default_rng(0)
    t, h, e, k = 9, 16, 12, 3
    router = TopKRouter(h, e, k, 1e-12)
    router.weight.set_value(rng.standard_normal((h, e)).astype(np.float32))
    bias = (rng.standard_normal((1, e)) * 0.3).astype(np.float32)  # large enough to change choices
    router.e_score_correction_bias.set_value(bias)
    x = rng.standard_normal((t, h)).astype(np.float32)
    want_ids, want_w = (a.numpy() for a in router(paddle.to_tensor(x)))
    logits = x @ router.weight.numpy()
    ids, w = router_topk(fw.tensor(logits), fw.tensor(bias[0]), k, 1e-12)
    unbiased = np.argsort(-F.softmax(paddle.to_tensor(logits)).numpy(), axis=1)[:, :k]
    assert (np.sort(unbiased, 1) != np.sort(want_ids, 1)).any()  # the bias matters in this case
    np.testing.assert_array_equal(fw.numpy(ids).astype(np.int64), want_ids)
    np.testing.assert_allclose(fw.numpy(w), want_w, rtol=1e-5, atol=1e-6)


def test_silu_and_mul_matches_the_reference(fw):
    x = np.random.default_rng(1).standard_normal((5, 2 * 300)).astype(np.float32)
    want = reference_silu_and_mul(paddle.to_tensor(x)).numpy()
    np.testing.assert_allclose(fw.numpy(silu_and_mul(fw.tensor(x))), want, rtol=1e-5, atol=1e-6)


def test_router_logits_are_the_fp32_product_of_hidden_and_gate(fw):
    """Rows past a program's 32 and channels past a K step's 32 (masked tails), a bf16 hidden widened as loaded:
    the fp32 product to fp32 rounding (float64 reference)."""
    from ernie_kernels.router import router_logits

    rng = np.random.default_rng(2)
    t, h, e = 45, 200, 12
    x = rng.standard_normal((t, h)).astype(np.float32)
    gate = rng.standard_normal((h, e)).astype(np.float32)
    want = x.astype(np.float64) @ gate.astype(np.float64)
    np.testing.assert_allclose(fw.numpy(router_logits(fw.tensor(x), fw.tensor(gate))), want, rtol=1e-5, atol=1e-4)
    xb = fw.tensor(x, bf16=True)
    want_b = fw.numpy(xb).astype(np.float64) @ gate.astype(np.float64)
    np.testing.assert_allclose(fw.numpy(router_logits(xb, fw.tensor(gate))), want_b, rtol=1e-5, atol=1e-4)
    assert tuple(router_logits(fw.tensor(x[:0]), fw.tensor(gate)).shape) == (0, e)
