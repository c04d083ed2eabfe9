"""Which tensor framework this process computes with, whether it sees a CUDA GPU, and what its CPU can do.

Neutral ground: the engine's config resolves execution_backend='auto' and explains a refused dtype with it, the
kernels backend picks its tensor operations and cpu_kernels keys its build with it, without the config importing
either.
"""
from __future__ import annotations

import importlib.util
import os

FRAMEWORK_ENV = "ERNIE_TENSOR_FRAMEWORK"
FRAMEWORKS = ("paddle", "torch")


def installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def default_framework() -> str:
    """ERNIE_TENSOR_FRAMEWORK, or Paddle when it is installed, else torch."""
    return os.environ.get(FRAMEWORK_ENV) or ("paddle" if installed("paddle") else "torch")


def gpu_visible() -> bool:
    """Whether the default framework sees a CUDA GPU (what execution_backend='auto' decides on)."""
    name = default_framework()
    if name not in FRAMEWORKS or not installed(name):
        return False
    if name == "torch":
        import torch

        return bool(torch.cuda.is_available())
    import paddle

    return bool(paddle.is_compiled_with_cuda() and paddle.device.cuda.device_count() > 0)


def cpu_flags_line() -> str:
    """This CPU's feature-flags line from /proc/cpuinfo ("flags" on x86, "Features" on Arm); "" where unknown."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return ""


def cpu_flags() -> set[str]:
    """This CPU's feature flags (empty where unknown)."""
    return set(cpu_flags_line().split(":", 1)[-1].split())
