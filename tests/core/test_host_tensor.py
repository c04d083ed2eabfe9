"""NumPy -> Paddle conversion that does not leak (Paddle's own constructors leak a list per call)."""
from __future__ import annotations

import gc

import numpy as np
import paddle
import pytest

from ernie_serve.host_tensor import empty_host, to_paddle


def _objects() -> int:
    gc.collect()
    return len(gc.get_objects())


@pytest.mark.parametrize("a", [np.arange(12, dtype=np.int64).reshape(3, 4), np.ones((2, 5), np.float32).T,
                               np.array([], np.int64), np.array([[True, False]]), [1, 2, 3]])
def test_to_paddle_copies_the_values(a):
    t = to_paddle(a)
    np.testing.assert_array_equal(t.numpy(), np.asarray(a))
    assert t.shape == list(np.asarray(a).shape)


def test_a_write_into_the_view_lands_in_the_tensor():
    t, view = empty_host((2, 3), np.float32)
    view[...] = [[1, 2, 3], [4, 5, 6]]
    assert paddle.sum(t).item() == 21.0


def test_conversions_leave_no_objects_behind():
    a = np.arange(64, dtype=np.int64)
    for _ in range(50):
        to_paddle(a)
    before = _objects()
    for _ in range(2000):
        to_paddle(a)
    assert _objects() - before < 50  # paddle.to_tensor leaves one list per call: +2000 here


def test_empty_weight_is_a_tensor_over_its_view_at_every_size():
    from ernie_serve.host_tensor import empty_weight

    for shape in [(3, 5), (1024, 1024 * 3)]:  # small: ordinary memory; 12 MB: a 2 MB-aligned mapping
        t, view = empty_weight(shape, np.float32)
        view[...] = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
        assert t.place.is_cpu_place() and list(t.shape) == list(shape) and t.data_ptr() == view.ctypes.data
        np.testing.assert_array_equal(t.numpy(), view)
    assert t.data_ptr() % (2 << 20) == 0


def test_mid_sized_weights_share_arena_mappings_without_overlapping():
    """Weights between 256 KB and 8 MB (the wint8 experts' codes, bfloat16 attention) are carved from shared
    huge-page mappings: page-aligned, each its own bytes, a new mapping when one fills."""
    from ernie_serve.host_tensor import empty_weight

    shapes = [(512, 1024), (1000, 700), (3, 5), (1024, 1536), (700, 1024)] * 12  # ~4 MB apiece: several mappings
    made = []
    for i, shape in enumerate(shapes):
        t, view = empty_weight(shape, np.uint8 if i % 2 else np.float32)
        view[...] = i % 251
        assert t.data_ptr() == view.ctypes.data and list(t.shape) == list(shape)
        if view.nbytes >= 256 << 10:
            assert view.ctypes.data % 4096 == 0
        made.append((i, t, view))
    spans = sorted((v.ctypes.data, v.ctypes.data + v.nbytes) for _, _, v in made)
    assert all(end <= nxt for (_, end), (nxt, _) in zip(spans, spans[1:]))
    for i, t, view in made:  # no later weight wrote over an earlier one
        assert (view == i % 251).all() and int(t.numpy().ravel()[-1]) == i % 251


@pytest.mark.parametrize("shape, dtype", [((4, 8), np.float32), ((2048, 64, 2, 128), np.uint16), ((300, 4096), np.int8)])
def test_zeros_huge_reads_as_zeros_and_is_writable(shape, dtype):
    from ernie_serve.host_tensor import zeros_huge

    z = zeros_huge(shape, dtype)
    assert z.shape == shape and z.dtype == dtype and z.flags.c_contiguous and z.flags.writeable
    assert not z.any()
    z[-1, ...] = 7
    assert int(z[-1].min()) == 7 and not z[:-1].any()
    if z.nbytes >= 8 << 20:  # its own mapping, the run 2 MB-aligned
        assert z.ctypes.data % (2 << 20) == 0
