"""The kernels backend on CPU: its kernels run in triton's interpreter, which must be chosen before triton
is imported. Tests run on both tensor frameworks the backend supports (Paddle in production, torch on the
borrowed GPU box)."""
import os

import pytest

os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")


@pytest.fixture(params=["paddle", "torch"])
def framework(request, monkeypatch):
    pytest.importorskip(request.param)
    monkeypatch.setenv("ERNIE_TENSOR_FRAMEWORK", request.param)
    return request.param
