"""The kernels backend under a Paddle whose default place is a GPU (after `paddle.set_device("gpu:N")`), without a GPU:
Paddle's constructors are wrapped so that a tensor made without an explicit CPU place stands for a device tensor,
whose address a host write would fault on (the first step's buffer fill did that during start-up)."""
from __future__ import annotations

import numpy as np
import pytest

paddle = pytest.importorskip("paddle")


@pytest.fixture
def gpu_default_place(monkeypatch):
    """Constructors that refuse to allocate on the default place; returns what each was asked for."""
    asked: list[str] = []
    for name in ("empty", "zeros", "full", "to_tensor", "ones"):
        real = getattr(paddle, name)

        def wrapped(*args, _real=real, _name=name, **kwargs):
            asked.append(_name)
            if kwargs.get("device", kwargs.get("place")) is None:
                raise AssertionError(f"paddle.{_name} on the default place (a GPU there): host data would be "
                                     "written through a device address")
            return _real(*args, **kwargs)

        monkeypatch.setattr(paddle, name, wrapped)
    return asked


def test_host_tensors_are_placed_on_the_cpu_whatever_the_default_place(gpu_default_place):
    from ernie_serve.host_tensor import empty_host, to_paddle

    t = to_paddle(np.arange(6, dtype=np.int64).reshape(2, 3))
    assert t.place.is_cpu_place() and t.numpy().tolist() == [[0, 1, 2], [3, 4, 5]]
    t, view = empty_host((4,), np.float32)
    view[:] = 1.5
    assert t.place.is_cpu_place() and t.numpy().tolist() == [1.5] * 4
    assert gpu_default_place  # the wrapped constructors were the ones used


def test_a_gpu_steps_buffer_writes_stage_through_a_cpu_tensor(gpu_default_place):
    from ernie_serve.kernels_backend.framework import PaddleOps

    ops = PaddleOps()
    dst = ops.zeros([8, 3], "int32")  # placed where the ops say (on a GPU: its CUDAPlace)
    ops.on_gpu = True  # the GPU branch of the row writes: host rows staged in a tensor, then copied up
    view = ops.write(dst, np.arange(6, dtype=np.int64).reshape(2, 3))
    assert ops.to_host(view).tolist() == [[0, 1, 2], [3, 4, 5]]
    assert ops.to_host(dst)[2:].sum() == 0


def test_the_ops_allocate_on_their_own_place(gpu_default_place):
    from ernie_serve.kernels_backend.framework import PaddleOps

    ops = PaddleOps()
    for t in (ops.empty([2, 2], "float32"), ops.zeros([3], "int64"), ops.arange(4), ops.tensor(np.ones(3))):
        assert t.place.is_cpu_place()
