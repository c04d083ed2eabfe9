"""Process environment the CPU build of Paddle needs, set before Paddle is first imported.

Paddle's CPU wheel links Intel MKL, which takes a slow generic code path on AMD processors
(measured on this project's 2-core AMD EPYC box: 512x1024x4096 fp32 matmul 167 ms by default,
55 ms with MKL_DEBUG_CPU_TYPE=5, equal to numpy/OpenBLAS). The variable is harmless elsewhere.

Paddle also pins its CPU math to ONE thread unless OMP_NUM_THREADS says otherwise (paddle/base
sets it to 1 at import), so an engine would use one core of many; `use_all_cpu_threads` undoes
that for the process that runs the model, unless the user chose OMP_NUM_THREADS themselves.
"""
import os
import sys

os.environ.setdefault("MKL_DEBUG_CPU_TYPE", "5")
# If paddle came first, the 1 in OMP_NUM_THREADS is paddle's own default, not the user's choice.
_USER_OMP_THREADS = None if "paddle" in sys.modules else os.environ.get("OMP_NUM_THREADS")


def use_all_cpu_threads() -> int:
    """Give Paddle's CPU kernels every core this process may run on; returns the thread count."""
    from paddle.base import core

    n = int(_USER_OMP_THREADS) if _USER_OMP_THREADS else len(os.sched_getaffinity(0))
    core.set_num_threads(n)
    return n
