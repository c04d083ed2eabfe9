"""Process environment the CPU build of Paddle needs, set before Paddle is first imported.

Paddle's CPU wheel links Intel MKL, which takes a slow generic code path on AMD processors; MKL_DEBUG_CPU_TYPE=5
makes an fp32 matmul there as fast as numpy/OpenBLAS, and is harmless elsewhere.

Paddle also pins its CPU math to ONE thread unless OMP_NUM_THREADS says otherwise (paddle/base
sets it to 1 at import), so an engine would use one core of many; `setup_model_process` undoes
that for the process that runs the model, unless the user chose OMP_NUM_THREADS themselves.

Intel's OpenMP runtime (libiomp5, which Paddle loads; our cpu_kernels' OpenMP regions run on it too) keeps its
worker threads spinning for 200 ms after each parallel region (KMP_BLOCKTIME). Between two steps of a served
engine those spinning workers take the cores that tritonserver, the detokenizer stub and the client need. But
with 0 a worker sleeps after every one of a step's ~100 parallel regions and the next one waits for the kernel
to wake it. So the default is 1 ms (vLLM-CPU sets 5), which keeps them awake through a step, and at the end of
each step the reference backend puts them to sleep at once (cpu_kernels.build.park_threads), leaving the cores
to the host work between steps as 0 did. Re-checked by `.venv/bin/python scripts/served_ab.py --a-env
KMP_BLOCKTIME=0` (served) and `scripts/bench_cpu_dtypes.py` run with KMP_BLOCKTIME=0 and 1 (the decode step).

And glibc hands every allocation over 128 KB back to the kernel when it is freed, so each big activation of a
prefill step (a few MB each, hundreds a step) is faulted in afresh, page by page, which on a VM can cost more
than the arithmetic. The model process keeps freed memory for reuse instead (its resident size then stays at
its peak, as a server's would anyway).
"""
import ctypes
import ctypes.util
import gc
import os
import sys

os.environ.setdefault("MKL_DEBUG_CPU_TYPE", "5")
os.environ.setdefault("KMP_BLOCKTIME", "1")  # ms
# If paddle came first, the 1 in OMP_NUM_THREADS is paddle's own default, not the user's choice.
_USER_OMP_THREADS = None if "paddle" in sys.modules else os.environ.get("OMP_NUM_THREADS")


def setup_model_process(threads: int | None = None) -> int:
    """For the process that runs the model: Paddle's CPU kernels and ours (cpu_kernels) get `threads` (default:
    every core this process may run on, or the user's OMP_NUM_THREADS), freed host memory is kept for reuse.
    Returns the thread count."""
    from paddle.base import core

    from .cpu_kernels import build

    n = threads or (int(_USER_OMP_THREADS) if _USER_OMP_THREADS else len(os.sched_getaffinity(0)))
    core.set_num_threads(n)
    build.set_threads(n)  # for whichever thread steps the engine (OpenMP's setting is per thread)
    _keep_freed_memory()
    return n


def child_environment() -> dict[str, str]:
    """The environment for a process that will run the model (the engine core): this one's, with OMP_NUM_THREADS as
    the user set it. Paddle's import here put its own 1 there, which the child would take for the user's."""
    env = dict(os.environ)
    if _USER_OMP_THREADS is None:
        env.pop("OMP_NUM_THREADS", None)
    else:
        env["OMP_NUM_THREADS"] = _USER_OMP_THREADS
    return env


def _keep_freed_memory() -> None:
    """Allocations under 64 MB from the heap, and up to 1 GB of freed heap kept (glibc's mallopt; elsewhere a no-op)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt(-3, 64 << 20)  # M_MMAP_THRESHOLD
        libc.mallopt(-1, 1 << 30)  # M_TRIM_THRESHOLD
    except (OSError, AttributeError):
        pass


def freeze_startup_objects() -> None:
    """Move every object alive after start-up (the model, its weights' Python wrappers, the tokenizer: many
    thousands of objects even for the tiny model) out of the garbage collector's reach, as vLLM does after loading.
    Otherwise each full collection walks them all again while the engine makes a few objects a request a step, a
    visible share of the engine's host time a step at 256 running. Cycles made later are still collected; what is
    frozen is freed by reference counting as usual, and unfreeze_startup_objects (at the engine's close) hands it back
    to the collector. An engine dropped without close() is a frozen cycle the collector cannot see: the next engine's
    start-up therefore unfreezes first, so the collection below frees it (nine tensor-parallel kernels engines in
    one test process, none closed, had kept all their memory and left their workers running; the whole test suite
    ran out of memory)."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()


def unfreeze_startup_objects() -> None:
    gc.unfreeze()
