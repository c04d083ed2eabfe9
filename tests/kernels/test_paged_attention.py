import numpy as np
import pytest

from ernie_kernels import paged_decode_attention
from ernie_kernels import reference as ref
from ernie_serve.quantization import formats as F

B, HQ, KVH, D, PAGE, NBLK = 3, 4, 2, 16, 16, 9


def _case(seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, HQ, D)).astype(np.float32)
    k = rng.standard_normal((NBLK, PAGE, KVH, D)).astype(np.float32)
    v = rng.standard_normal((NBLK, PAGE, KVH, D)).astype(np.float32)
    lens = np.array([5, 33, 16], np.int32)
    tables = np.zeros((B, 4), np.int32)  # pages scattered over the pool, unused entries left 0
    tables[0, :1] = [7]
    tables[1, :3] = [2, 8, 4]
    tables[2, :1] = [1]
    return q, k, v, tables, lens


@pytest.mark.parametrize("kv", ["float", "int8_channel", "int8_block"])
def test_paged_decode_attention_matches_gathered_softmax(fw, kv):
    q, k, v, tables, lens = _case()
    ks = vs = None
    if kv == "int8_channel":
        ks, vs = F.calibrate_kv_scale(k), F.calibrate_kv_scale(v)
        k, v = F.quantize_kv_static(k, ks), F.quantize_kv_static(v, vs)
    elif kv == "int8_block":
        (k, ks), (v, vs) = F.quantize_kv_dynamic(k), F.quantize_kv_dynamic(v)
    t = lambda a: None if a is None else fw.tensor(a)  # noqa: E731
    out = paged_decode_attention(t(q), t(k), t(v), t(tables), t(lens), None, t(ks), t(vs))
    expect = ref.paged_decode_attention(q, k, v, tables, lens, None, ks, vs)
    # fp32 throughout in the interpreter; online vs two-pass softmax differ in rounding only
    np.testing.assert_allclose(fw.numpy(out), expect, rtol=1e-4, atol=1e-5)


def test_int8_cache_needs_scales(fw):
    q, k, v, tables, lens = _case()
    with pytest.raises(ValueError, match="needs k_scale"):
        paged_decode_attention(fw.tensor(q), fw.tensor(k.astype(np.int8)), fw.tensor(v.astype(np.int8)),
                               fw.tensor(tables), fw.tensor(lens))
