"""Which tensor framework this process computes with, whether it sees a CUDA GPU (and whether the machine shows NVIDIA
GPUs it cannot use), and what its CPU can do.

Neutral ground: the engine's config resolves execution_backend='auto' and explains a refused dtype with it, the
kernels backend picks its tensor operations and cpu_kernels keys its build with it, without the config importing
either.
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
from importlib.metadata import packages_distributions
from pathlib import Path

FRAMEWORK_ENV = "ERNIE_TENSOR_FRAMEWORK"
FRAMEWORKS = ("paddle", "torch")
# Where the NVIDIA driver's device nodes appear (nvidia0, nvidia1, ...). A module attribute so that tests can show
# the probe a stand-in machine; nothing else changes it.
NVIDIA_DEVICE_DIR = Path("/dev")
# The GPU builds, and where each comes from (Paddle's 3.x GPU wheels are not on PyPI; docs/gpu-images.md).
PADDLE_GPU_INDEX = "https://www.paddlepaddle.org.cn/packages/stable/cu126/"
TORCH_CUDA_INDEX = "https://download.pytorch.org/whl/cu126"


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


def nvidia_device_nodes() -> list[str]:
    """The NVIDIA driver's GPU device nodes (/dev/nvidia0, ...: one a GPU, what a container started with --gpus
    shows), asked of no framework."""
    try:
        return sorted(str(p) for p in NVIDIA_DEVICE_DIR.glob("nvidia[0-9]*"))
    except OSError:
        return []


def nvidia_gpus_on_machine() -> list[str]:
    """What shows that the host has NVIDIA GPUs, asking no tensor framework: the driver's device nodes, the
    GPUs `nvidia-smi -L` lists, a CUDA_VISIBLE_DEVICES naming devices. Empty where nothing does, or where
    CUDA_VISIBLE_DEVICES hides every GPU ("" or "-1"): running on the CPU is then what was asked for.

    The one probe of the machine's view (tests point NVIDIA_DEVICE_DIR and PATH at a stand-in machine): it is
    what tells "no GPU here" apart from "a GPU the installed framework cannot use"."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    named: list[str] = []
    if visible is not None:
        # CUDA reads the list up to its first negative index: "-1" and "" hide every device
        for entry in visible.split(","):
            entry = entry.strip()
            if not entry or entry.startswith("-"):
                break
            named.append(entry)
        if not named:
            return []
    seen = [f"CUDA_VISIBLE_DEVICES={visible}"] if named else []
    nodes = nvidia_device_nodes()
    if nodes:
        seen.append("device nodes " + ", ".join(nodes))
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            listed = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=15).stdout
        except (OSError, subprocess.SubprocessError):
            listed = ""
        gpus = [line.strip() for line in listed.splitlines() if line.startswith("GPU ")]
        if gpus:
            seen.append("nvidia-smi -L: " + "; ".join(gpus))
    return seen


def framework_build(name: str) -> tuple[str, bool]:
    """The installed build of a tensor framework as a person would name it, and whether it was built with CUDA."""
    if not installed(name):
        return f"no {name} installed", False
    if name == "torch":
        import torch

        cuda = torch.version.cuda
        return f"torch {torch.__version__} ({f'CUDA {cuda}' if cuda else 'built without CUDA'})", bool(cuda)
    import paddle

    dists = ", ".join(packages_distributions().get("paddle", [])) or "paddle"
    cuda = paddle.is_compiled_with_cuda()
    return f"{dists} {paddle.__version__} ({'CUDA build' if cuda else 'CPU build'})", bool(cuda)


def unusable_gpu_reason() -> str | None:
    """Why execution_backend='auto' must not fall back to the CPU: the machine shows NVIDIA GPUs that the installed
    tensor framework does not see. None where it sees one, or where the machine shows none. A GPU box serving a
    large model from host memory is a misinstall (a CPU wheel over the GPU one), never a choice: the choice is
    --execution-backend reference, or CUDA_VISIBLE_DEVICES=-1."""
    if gpu_visible():
        return None
    seen = nvidia_gpus_on_machine()
    if not seen:
        return None
    name = default_framework()
    build, with_cuda = framework_build(name)
    if with_cuda:
        return (f"execution_backend auto: this machine shows NVIDIA GPUs ({'; '.join(seen)}) but the installed "
                f"{build} sees none of them: check the driver (nvidia-smi) and, in a container, --gpus. To run on "
                "the CPU on purpose, pass --execution-backend reference (or set CUDA_VISIBLE_DEVICES=-1)")
    if name == "torch" and (installed("torch") or os.environ.get(FRAMEWORK_ENV) == "torch"):
        fix = f"install a CUDA build of torch (pip install torch --index-url {TORCH_CUDA_INDEX})"
    else:
        fix = ('install the GPU build of Paddle in place of the CPU one (pip uninstall paddlepaddle; '
               f'pip install "ernie-triton[gpu]" --extra-index-url {PADDLE_GPU_INDEX}, i.e. paddlepaddle-gpu>=3.3)')
    return (f"execution_backend auto: this machine shows NVIDIA GPUs ({'; '.join(seen)}) but the installed tensor "
            f"framework cannot use them: {build}. To serve on the GPU, {fix}. To run on the CPU on purpose, pass "
            "--execution-backend reference (or set CUDA_VISIBLE_DEVICES=-1)")


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
