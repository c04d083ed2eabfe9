"""Import triton once, the right way for the tensors we will hand it, plus framework-neutral helpers.

Launchers take torch or Paddle tensors and allocate outputs in the caller's framework. triton's GPU driver takes the
device and the stream of every launch from `torch` (`torch.cuda.current_device`, `_cuda_getCurrentRawStream`), bound
when the driver is first made. So in a process whose tensors are Paddle's (ERNIE_TENSOR_FRAMEWORK, by default Paddle
when installed) on a GPU, triton must see Paddle's torch proxy, paddle.enable_compat(scope={"triton"}), even where
real torch is installed too: else Paddle's kernels run on Paddle's stream and ours on torch's (a race, and nothing of
ours inside a Paddle CUDA graph capture), on whatever device torch thinks is current. enable_compat makes Paddle
`torch` for the whole process, so a torch process never enables it; and in triton's CPU interpreter (tests, which run
both frameworks in one process) no driver exists, so there compat is only enabled when no real torch is there to
give triton its `torch` (tests/kernels/test_runtime_framework.py). enable_compat is public from Paddle 3.3.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from typing import Any, Sequence


FRAMEWORK_ENV = "ERNIE_TENSOR_FRAMEWORK"  # the same switch as ernie_serve.devices' (this package imports none of it)
PADDLE_COMPAT_MIN = (3, 3)


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def process_framework() -> str:
    """The framework this process hands the kernels: ERNIE_TENSOR_FRAMEWORK, else Paddle when installed, else torch."""
    return os.environ.get(FRAMEWORK_ENV) or ("paddle" if _installed("paddle") else "torch")


def needs_paddle_compat(framework: str, interpret: bool, torch_installed: bool) -> bool:
    """Whether triton must see Paddle's torch proxy (see the module doc)."""
    if framework != "paddle":
        return False
    return not interpret or not torch_installed


def enable_paddle_compat(paddle) -> None:
    """paddle.enable_compat(scope={"triton"}), or an error naming the Paddle this needs."""
    if not hasattr(paddle, "enable_compat"):
        raise ImportError(f"ernie_kernels needs PaddlePaddle >= {'.'.join(map(str, PADDLE_COMPAT_MIN))} "
                          f"(paddle.enable_compat, which hands triton Paddle's device and stream); found "
                          f"{getattr(paddle, '__version__', 'unknown')}: pip install 'paddlepaddle-gpu>=3.3' from "
                          "Paddle's CUDA index (or set ERNIE_TENSOR_FRAMEWORK=torch to run the kernels on torch)")
    paddle.enable_compat(scope={"triton"}, silent=True)


def _load_triton():
    interpret = os.environ.get("TRITON_INTERPRET", "0") == "1"
    if "triton" not in sys.modules and needs_paddle_compat(process_framework(), interpret, _installed("torch")):
        import paddle

        enable_paddle_compat(paddle)
    import triton
    import triton.language as tl

    return triton, tl


triton, tl = _load_triton()

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def _keep_integer_sums_in_their_dtype() -> None:
    """triton 3.2's interpreter sums with np.sum, which widens int32 to int64 while the result stays typed int32,
    so `.to(tl.int32)` is a no-op and a store writes 8 bytes an element into the int32 buffer: the last element
    lands past its end (measured: moe_align's expert_ids, glibc "free(): invalid next size" a few steps later). A
    GPU compiles the sum in int32; make the interpreter do the same."""
    import numpy as np
    from triton.runtime import interpreter

    ops = getattr(interpreter, "ReduceOps", None)
    if ops is None or getattr(ops.sum, "_keeps_dtype", False):
        return

    def sum_(self, input):
        data = input.handle.data
        return self.to_tensor(np.sum(data, axis=self.axis, keepdims=self.keep_dims, dtype=data.dtype), input.dtype)

    sum_._keeps_dtype = True
    ops.sum = sum_


if INTERPRET:
    _keep_integer_sums_in_their_dtype()


_ARCHS: dict[int, int | None] = {}


def target_arch() -> int | None:
    """The compute capability triton compiles for now (80, 89, 90, ...), for launch configs that differ by
    architecture; None in the interpreter. Cached per driver object: a launch must not query the device."""
    if INTERPRET:
        return None
    active = triton.runtime.driver.active
    key = id(active)
    if key not in _ARCHS:
        try:
            arch = active.get_current_target().arch
        except Exception:  # noqa: BLE001 - no GPU driver: launch defaults
            arch = None
        _ARCHS[key] = arch if isinstance(arch, int) else None
    return _ARCHS[key]


def is_paddle(t: Any) -> bool:
    return type(t).__module__.startswith("paddle")


def dtype_name(t: Any) -> str:
    """'float32', 'bfloat16', 'int8', 'float8_e4m3fn', ... for torch and Paddle tensors alike."""
    return str(t.dtype).split(".")[-1]


def new_tensor(like: Any, shape: Sequence[int], dtype: str, fill: float | None = None) -> Any:
    """An uninitialized (or filled) tensor of the same framework and device as `like`."""
    shape = [int(s) for s in shape]
    if is_paddle(like):
        import paddle

        if fill is None:
            return paddle.empty(shape, dtype=dtype, device=like.place)
        return paddle.full(shape, fill, dtype=dtype, device=like.place)
    import torch

    dt = getattr(torch, dtype)
    if fill is None:
        return torch.empty(shape, dtype=dt, device=like.device)
    return torch.full(shape, fill, dtype=dt, device=like.device)


def contiguous(t: Any) -> Any:
    return t if t.is_contiguous() else t.contiguous()


def next_pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def dot_dtype(act_dtype: str):
    """Operand dtype for tl.dot: the activation's half type on GPU. The 3.2 interpreter gets bf16
    arithmetic wrong (casts into bf16 and bf16 dots, measured), so it dots in fp32 there."""
    if INTERPRET or act_dtype == "float32":
        return tl.float32
    return tl.float16 if act_dtype == "float16" else tl.bfloat16
