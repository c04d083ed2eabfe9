"""Kernel offsets of 2^31 elements and more (300B's fused MoE at 32768 tokens x top-8 x hidden 8192 writes 2^31
elements of slot outputs), checked in the interpreter without 8 GB of data: the kernel's buffers are views with a
row stride of 2^30 elements into a sparse anonymous mapping (only the touched pages take memory), so row 2 sits
2^31 elements past row 0.

What this proves: the interpreter computes `row * stride` in the kernel's own integer types with NumPy's wrapping
arithmetic, as the GPU does; an int32 product wraps to -2^31 and lands 8 GB below the view, still inside the
mapping (so a wrong kernel writes there instead of crashing), while an int64 one lands on the row. It does not run
the compiled GPU code, whose integer types triton derives by the same rules.
"""

import mmap
import sys

import numpy as np
import pytest

from ernie_kernels import reference as ref

_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000 if sys.platform.startswith("linux") else 0)
STRIDE = 1 << 30  # elements between rows: row 2 starts 2^31 elements in
BELOW = 2 * STRIDE  # room below the views for a row offset that wrapped to -2^31


class SparseFloats:
    """float32 views with a huge row stride into one sparse anonymous mapping."""

    def __init__(self, rows: int, views: int, width: int):
        torch = pytest.importorskip("torch")
        self.width = width
        self.numel = BELOW + rows * STRIDE + views * width
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _NORESERVE
        try:
            self.map = mmap.mmap(-1, self.numel * 4, flags=flags)
        except OSError as e:  # a strict overcommit policy refuses the address space
            pytest.skip(f"no sparse mapping of {self.numel * 4 >> 30} GiB: {e}")
        self.all = torch.frombuffer(self.map, dtype=torch.float32, count=self.numel)
        self.next = 0

    def view(self, rows: int, cols: int):
        """[rows, cols] with row stride STRIDE, at its own column offset so views never share an element."""
        assert cols <= self.width
        offset = BELOW + self.next * self.width
        self.next += 1
        return self.all.as_strided([rows, cols], [STRIDE, 1], offset)

    def wrapped(self, view, row: int):
        """Where an int32 row offset of `row` lands: row * STRIDE wrapped to 32 bits."""
        off = (row * STRIDE + 2**31) % 2**32 - 2**31
        start = view.storage_offset() + off
        return self.all[start:start + view.shape[1]]


def test_fused_moe_rows_past_2_31_elements_land_on_their_rows(monkeypatch):
    """The intermediate (GEMM1's output, GEMM2's input) and the slot outputs (GEMM2's output, the slot sum's input)
    both have rows 2^31 elements apart: the result is the reference's, each slot output is on its own row, and
    nothing was written where an int32 offset would have wrapped to."""
    torch = pytest.importorskip("torch")
    import ernie_kernels.moe_fused as moe

    t, topk, e, h, inter = 3, 1, 2, 32, 16
    rng = np.random.default_rng(0)
    x = rng.standard_normal((t, h)).astype(np.float32)
    ug = (rng.standard_normal((e, h, 2 * inter)) * 0.2).astype(np.float32)
    dn = (rng.standard_normal((e, inter, h)) * 0.2).astype(np.float32)
    ids = np.array([[0], [1], [0]], np.int64)
    wts = np.array([[1.0], [0.5], [2.0]], np.float32)
    sparse = SparseFloats(rows=t * topk, views=2, width=64)
    views = {}
    plain = moe.new_tensor

    def strided(like, shape, dtype, fill=None):
        shape = [int(s) for s in shape]
        if dtype == "float32" and shape in ([t * topk, inter], [t * topk, h]) and fill is None:
            views[shape[1]] = sparse.view(*shape)
            return views[shape[1]]
        return plain(like, shape, dtype, fill)

    monkeypatch.setattr(moe, "new_tensor", strided)
    y = moe.fused_moe(torch.from_numpy(x), torch.from_numpy(ug), torch.from_numpy(dn), torch.from_numpy(ids),
                      torch.from_numpy(wts))
    assert set(views) == {inter, h}
    np.testing.assert_allclose(y.numpy(), ref.fused_moe(x, ug, dn, ids, wts), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(views[h].numpy(), y.numpy(), rtol=1e-6, atol=1e-6)  # top-1: a slot's row is its token's
    for v in views.values():
        assert (sparse.wrapped(v, 2).numpy() == 0).all()


def test_weight_only_gemm_rows_past_2_31_elements_land_on_their_rows(monkeypatch):
    """The dense quantized GEMM's output rows 2^31 elements apart (300B's dense up_gate is tokens x 57344)."""
    torch = pytest.importorskip("torch")
    import ernie_kernels.weight_only_gemm as gemm
    from ernie_serve.quantization import formats as F

    m, k, n = 3, 64, 32
    rng = np.random.default_rng(1)
    x = rng.standard_normal((m, k)).astype(np.float32)
    q, s = F.quantize_weight_only(rng.standard_normal((k, n)).astype(np.float32), 8)
    sparse = SparseFloats(rows=m, views=1, width=n)
    views = []
    monkeypatch.setattr(gemm, "new_tensor", lambda like, shape, dtype, fill=None: views.append(sparse.view(*shape))
                        or views[-1])
    y = gemm.weight_only_linear(torch.from_numpy(x), torch.from_numpy(q), torch.from_numpy(s), "wint8")
    assert y.stride(0) == 1 << 30
    np.testing.assert_allclose(y.numpy(), ref.weight_only_linear(x, q, s, "wint8"), rtol=1e-4, atol=1e-4)
    assert (sparse.wrapped(y, 2).numpy() == 0).all()


def _sparse_pool(blocks: int, block_size: int, kv_heads: int, head_dim: int):
    """A contiguous float32 KV pool [blocks, block_size, kv_heads, head_dim] on a sparse anonymous mapping, with
    2^31 elements of room below it for an int32 offset that wrapped (read as zeros instead of a crash)."""
    torch = pytest.importorskip("torch")
    numel = blocks * block_size * kv_heads * head_dim
    below = 1 << 31
    try:
        buf = mmap.mmap(-1, (below + numel) * 4, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _NORESERVE)
    except OSError as e:
        pytest.skip(f"no sparse mapping of {(below + numel) * 4 >> 30} GiB: {e}")
    flat = torch.frombuffer(buf, dtype=torch.float32, count=below + numel)
    return flat[below:].view(blocks, block_size, kv_heads, head_dim), buf


def test_kv_pool_blocks_past_2_31_elements_are_written_and_read_in_place():
    """An 80 GB pool holds blocks whose first element is past 2^31: kv_write and unified attention address them
    in int64 (block id x block stride), so the last block of a 2^31 + 4-block-element pool is written in place
    and attention over it equals attention over the same values in a one-block pool."""
    torch = pytest.importorskip("torch")
    from ernie_kernels.kv_write import kv_write
    from ernie_kernels.unified_attention import attention_programs, queries_per_program, unified_attention

    bs, kvh, d, hq = 16, 1, 16, 2
    blocks = (1 << 31) // (bs * kvh * d) + 4
    last = blocks - 1
    (kc, kbuf), (vc, vbuf) = _sparse_pool(blocks, bs, kvh, d), _sparse_pool(blocks, bs, kvh, d)
    assert last * bs * kvh * d >= 1 << 31
    rng = np.random.default_rng(3)
    n = 5
    k, v = (rng.standard_normal((n, kvh, d)).astype(np.float32) for _ in range(2))
    slots = torch.from_numpy(last * bs + np.arange(n, dtype=np.int64))
    kv_write(torch.from_numpy(k), torch.from_numpy(v), kc, vc, slots)
    np.testing.assert_array_equal(kc[last, :n].numpy(), k)
    np.testing.assert_array_equal(vc[last, :n].numpy(), v)

    q = rng.standard_normal((n, hq, d)).astype(np.float32)
    qsl = np.array([0, n], np.int32)
    block_q = queries_per_program(hq // kvh, n)
    seq, q0 = attention_programs(qsl, block_q)

    def attend(k_cache, v_cache, table):
        out = torch.full((n, hq, d), float("nan"))
        unified_attention(torch.from_numpy(q), k_cache, v_cache, out, torch.tensor([[table]], dtype=torch.int32),
                          torch.tensor([n], dtype=torch.int32), torch.from_numpy(qsl), torch.from_numpy(seq),
                          torch.from_numpy(q0), block_q, d ** -0.5)
        return out.numpy()

    small_k, small_v = (torch.zeros(1, bs, kvh, d) for _ in range(2))
    small_k[0, :n], small_v[0, :n] = torch.from_numpy(k), torch.from_numpy(v)
    np.testing.assert_allclose(attend(kc, vc, last), attend(small_k, small_v, 0), rtol=1e-6, atol=1e-6)


def test_silu_and_mul_rows_past_2_31_elements_land_on_their_rows(monkeypatch):
    """The dense MLP's activation reads and writes rows 2^31 elements apart (300B's dense up_gate is tokens x 57344:
    past 2^31 from ~37k tokens)."""
    torch = pytest.importorskip("torch")
    import ernie_kernels.activation as act

    t, inter = 3, 16
    rng = np.random.default_rng(4)
    gate_up = rng.standard_normal((t, 2 * inter)).astype(np.float32)
    sparse = SparseFloats(rows=t, views=2, width=2 * inter)
    x = sparse.view(t, 2 * inter)
    x.copy_(torch.from_numpy(gate_up))
    views = []
    monkeypatch.setattr(act, "new_tensor", lambda like, shape, dtype, fill=None: views.append(sparse.view(*shape))
                        or views[-1])
    y = act.silu_and_mul(x)
    assert y.stride(0) == 1 << 30
    g, u = gate_up[:, :inter], gate_up[:, inter:]
    np.testing.assert_allclose(y.numpy(), g / (1 + np.exp(-g)) * u, rtol=1e-5, atol=1e-6)
    assert (sparse.wrapped(y, 2).numpy() == 0).all()
