"""cpu_ops.c against the Paddle ops it stands in for (the model's definition), at decode and prefill row counts
and widths that are not multiples of the vector width, on every instruction-set tier this CPU has (the `isa`
fixture); the model layers take the C path only under no_grad."""
from __future__ import annotations

import numpy as np
import paddle
import pytest

from ernie_serve.cpu_kernels import build, cpu_ops
from ernie_serve.model.layers import RMSNorm, RotaryEmbedding, silu_and_mul

pytestmark = pytest.mark.skipif(not build.available(), reason="no C compiler to build the CPU kernels")


@pytest.fixture(autouse=True)
def inference():
    with paddle.no_grad():
        yield


def _paddle_path(fn, *args):
    """The layer's own Paddle ops: gradients on, so cpu_ops stands aside."""
    with paddle.set_grad_enabled(True):
        return fn(*args).numpy()


@pytest.mark.parametrize("t,h", [(1, 16), (5, 1024), (300, 37)])
def test_rms_norm(isa, t, h):
    rng = np.random.default_rng(t + h)
    norm = RMSNorm(h, 1e-5)
    norm.weight.set_value(rng.standard_normal(h).astype(np.float32))
    x = paddle.to_tensor(rng.standard_normal((t, h)).astype(np.float32) * 3)
    np.testing.assert_allclose(norm(x).numpy(), _paddle_path(norm, x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("nh,nkv,hd", [(8, 2, 128), (4, 1, 64), (3, 3, 10)])
def test_split_rope_equals_split_then_rotate(isa, nh, nkv, hd):
    rng = np.random.default_rng(nh * hd)
    t = 7
    rope = RotaryEmbedding(hd, 500000.0, 4096)
    qkv = paddle.to_tensor(rng.standard_normal((t, (nh + 2 * nkv) * hd)).astype(np.float32))
    positions = paddle.to_tensor(rng.integers(0, 3000, t))
    got = rope.split_rotate(qkv, positions, 2999, nh, nkv)
    with paddle.set_grad_enabled(True):
        want = rope.split_rotate(qkv, positions, 2999, nh, nkv)
    for g, w in zip(got, want):
        assert g.shape == w.shape
        np.testing.assert_allclose(g.numpy(), w.numpy(), rtol=1e-5, atol=1e-5)


def test_split_rope_refuses_a_position_past_the_table():
    rope = RotaryEmbedding(8, 10000.0, 256)
    with pytest.raises(ValueError, match="positions"):
        cpu_ops.split_rope(paddle.zeros([1, 24]), np.array([10_000]), rope._cos, rope._sin, 1, 1, 8)


@pytest.mark.parametrize("t,inter", [(1, 16), (16, 704), (33, 23)])
def test_silu_and_mul_including_saturated_gates(isa, t, inter):
    rng = np.random.default_rng(inter)
    gu = rng.standard_normal((t, 2 * inter)).astype(np.float32) * 4
    gu[0, :4] = [-200.0, 200.0, 0.0, -90.0]  # exp over- and underflow, silu(0) = 0
    x = paddle.to_tensor(gu)
    got = silu_and_mul(x).numpy()
    gate, up = gu[:, :inter].astype(np.float64), gu[:, inter:]
    np.testing.assert_allclose(got, gate / (1 + np.exp(-gate)) * up, rtol=2e-6, atol=1e-6)
    np.testing.assert_allclose(got, _paddle_path(silu_and_mul, x), rtol=2e-6, atol=1e-6)


def test_gather_rows_with_zero_padding(isa):
    x = paddle.to_tensor(np.arange(12, dtype=np.float32).reshape(4, 3))
    got = cpu_ops.gather_rows(x, np.array([2, -1, 0, 2])).numpy()
    np.testing.assert_array_equal(got, [[6, 7, 8], [0, 0, 0], [0, 1, 2], [6, 7, 8]])
    with pytest.raises(ValueError, match="past 4 rows"):
        cpu_ops.gather_rows(x, np.array([4]))


def test_weighted_combine_skips_other_ranks_choices(isa):
    rng = np.random.default_rng(0)
    ys = rng.standard_normal((5, 19)).astype(np.float32)
    src = np.array([[0, 3], [-1, 4], [-1, -1]])
    w = rng.random((3, 2)).astype(np.float32)
    got = cpu_ops.weighted_combine(paddle.to_tensor(ys), src, paddle.to_tensor(w)).numpy()
    want = np.stack([w[0, 0] * ys[0] + w[0, 1] * ys[3], w[1, 1] * ys[4], np.zeros(19)])
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_layers_keep_paddle_ops_when_gradients_are_on():
    x = paddle.to_tensor(np.ones((2, 8), np.float32), stop_gradient=False)
    with paddle.set_grad_enabled(True):
        assert not cpu_ops.serves(x)
        y = silu_and_mul(x)
        y.sum().backward()
    assert x.grad is not None


@pytest.mark.parametrize("t,h,e,k", [(1, 16, 8, 2), (16, 1024, 16, 4), (9, 40, 64, 8)])
def test_route_equals_the_paddle_router(isa, t, h, e, k):
    from ernie_serve.model.moe import TopKRouter

    rng = np.random.default_rng(e + k)
    router = TopKRouter(h, e, k, 1e-12)
    router.weight.set_value(rng.standard_normal((h, e)).astype(np.float32) * 0.05)
    router.e_score_correction_bias.set_value(rng.standard_normal((1, e)).astype(np.float32) * 0.01)
    x = paddle.to_tensor(rng.standard_normal((t, h)).astype(np.float32))
    ids, w = router(x)
    with paddle.set_grad_enabled(True):
        want_ids, want_w = router(x)
    np.testing.assert_array_equal(ids.numpy(), want_ids.numpy())
    np.testing.assert_allclose(w.numpy(), want_w.numpy(), rtol=1e-5, atol=1e-6)
