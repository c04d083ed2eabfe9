"""RoPE kernel vs the reference path's RotaryEmbedding (interleaved pairs, odd positions, compression)."""

import numpy as np
import paddle
import pytest

from ernie_kernels.rope import rope_inplace, rope_tables
from ernie_serve.model.layers import RotaryEmbedding


@pytest.mark.parametrize("heads,kv_heads,head_dim,ratio", [(4, 2, 32, 1.0), (4, 1, 24, 2.0)])
def test_rotates_query_and_key_heads_like_the_reference(fw, heads, kv_heads, head_dim, ratio):
    rng = np.random.default_rng(head_dim)
    t = 7
    qkv = rng.standard_normal((t, (heads + 2 * kv_heads) * head_dim)).astype(np.float32)
    positions = np.array([0, 1, 5, 17, 300, 301, 2], np.int64)
    rope = RotaryEmbedding(head_dim, 10000.0, 512, ratio)
    q = qkv[:, : heads * head_dim].reshape(t, heads, head_dim)
    k = qkv[:, heads * head_dim: (heads + kv_heads) * head_dim].reshape(t, kv_heads, head_dim)
    want_q, want_k = (x.numpy() for x in rope(paddle.to_tensor(positions), 301, paddle.to_tensor(q),
                                               paddle.to_tensor(k)))
    cos, sin = rope_tables(head_dim, 10000.0, 512, ratio)
    x = fw.tensor(qkv)
    rope_inplace(x, fw.tensor(positions), fw.tensor(cos), fw.tensor(sin), heads + kv_heads, head_dim)
    got = fw.numpy(x)
    np.testing.assert_allclose(got[:, : heads * head_dim].reshape(q.shape), want_q, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(got[:, heads * head_dim: (heads + kv_heads) * head_dim].reshape(k.shape), want_k,
                               rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(got[:, (heads + kv_heads) * head_dim:], qkv[:, (heads + kv_heads) * head_dim:])
