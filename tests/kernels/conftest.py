"""Kernel tests run under triton's CPU interpreter; the env var must be set before triton is imported."""

import os
import sys
from pathlib import Path

import numpy as np
import pytest

os.environ["TRITON_INTERPRET"] = "1"
_ROOT = Path(__file__).resolve().parents[2]
for sub in ("backend", "kernels"):
    if str(_ROOT / sub) not in sys.path:
        sys.path.insert(0, str(_ROOT / sub))

pytest.importorskip("triton")


def _to_torch(a: np.ndarray):
    import torch

    return torch.from_numpy(np.ascontiguousarray(a))


def _to_paddle(a: np.ndarray):
    import paddle

    return paddle.to_tensor(np.ascontiguousarray(a))


class Framework:
    """Moves NumPy test data into the framework under test and back."""

    def __init__(self, name: str):
        self.name = name
        if name == "torch":
            pytest.importorskip("torch")
        else:
            pytest.importorskip("paddle")

    def tensor(self, a: np.ndarray, fp8: bool = False, bf16: bool = False):
        t = (_to_torch if self.name == "torch" else _to_paddle)(a)
        if fp8:
            if self.name == "torch":
                import torch

                return t.view(torch.float8_e4m3fn)
            import paddle

            return t.view(paddle.float8_e4m3fn)
        if bf16:
            return t.to(dtype=__import__("torch").bfloat16) if self.name == "torch" else t.astype("bfloat16")
        return t

    def numpy(self, t) -> np.ndarray:
        if self.name == "torch":
            return t.float().numpy() if str(t.dtype) != "torch.float32" else t.numpy()
        return t.astype("float32").numpy()


@pytest.fixture(params=["torch", "paddle"])
def fw(request):
    return Framework(request.param)
