"""Builds the C kernels of this package into one shared library for the host CPU, once, and loads it.

Compiled with the system C compiler for this CPU (-march=native) and linked against the OpenMP runtime Paddle
ships, so the kernels' threads are Paddle's threads and the two never compete for the cores. The library is
keyed by the sources' hash and the compiler switches, so an edited kernel is rebuilt; a file lock keeps concurrent
processes (tests, tensor-parallel workers) from building it twice. Without a compiler (or with ERNIE_CPU_KERNELS=0)
`library()` is None, callers keep their Paddle path, and one warning says why.

Instruction sets (isa.py): the kernels' paths are picked at compile time, so ERNIE_CPU_ISA=scalar|avx2|avx512|
avx512_vnni|amx caps them by building a library for that tier (-march=native with the higher tiers' instruction
sets switched off: a few seconds, cached like the CPU's own); unset, the CPU's highest tier runs. A tier the CPU
lacks is refused at start-up, naming the variable and the CPU's tiers. ERNIE_CPU_AMX=0 keeps bfloat16 GEMMs and
int8 codes off AMX (cpu_amx.c) on a CPU that has it: the same as capping at avx512_vnni, which shares the CPU's own
library with AMX switched off at run time (ERNIE_CPU_ISA=amx with ERNIE_CPU_AMX=0 is refused). `use_isa` switches a
running process between tiers (the kernel tests run each tier the CPU has, tests/cpu_kernels/conftest.py).
"""
from __future__ import annotations

import ctypes
import fcntl
import hashlib
import logging
import os
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import paddle

from ..devices import cpu_flags, cpu_flags_line
from ..paths import build_dir
from . import isa as _isa

log = logging.getLogger(__name__)
_P, _I, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
# Every function the library exports: argument types, return type (None: void). One table for all the .c files,
# declared once when the library loads.
_SIGNATURES = {
    "ernie_gemm": ([_P, _I, _I, _P, _I, _P, _P, _I, _I, _I], _I),
    "ernie_moe_gemm": ([_P, _P, _P, _I, _I, _P, _I, _P, _P, _I, _I, _I], _I),
    "ernie_gemm_swiglu_fits": ([_I], _I),
    "ernie_bf16_on_amx": ([_I, _I], _I),
    "ernie_int8_on_amx": ([_I, _I], _I),
    "ernie_set_amx": ([_I], None),
    "ernie_isa": ([], _I),
    "ernie_gemm_argmax": ([_P, _I, _I, _P, _I, _I, _P, _P, _I], _I),
    "ernie_paged_attention": ([_P, _P, _P, _I, _P, _I, _P, _P, _I, _I, _I, _I, _I, _F, _P], _I),
    "ernie_rms_norm": ([_P, _P, _I, _I, _F, _P], None),
    "ernie_split_rope": ([_P, _P, _P, _P, _I, _I, _I, _I, _P, _P, _P], None),
    "ernie_silu_and_mul": ([_P, _I, _I, _P], None),
    "ernie_gather_rows": ([_P, _P, _I, _I, _P], None),
    "ernie_weighted_combine": ([_P, _P, _P, _I, _I, _I, _P], None),
    "ernie_route": ([_P, _P, _P, _I, _I, _I, _I, _F, _P, _P], None),
    "ernie_set_num_threads": ([_I], None),
    "ernie_threads": ([], _I),
    "ernie_park_threads": ([], None),
    "ernie_task_run": ([_P, _I, _I, _I, _I, _I, _P, _P], None),
    "ernie_next_task": ([_I, _I, _I, _P], _I),
    "ernie_decoder_layers": ([_P, _P, _I, _P, _P, _P], _I),
    "ernie_decoder_layers_work": ([_P, _P, _I, _I], ctypes.c_int64),
}
_SOURCES = sorted(Path(__file__).parent.glob("*.c"))
_HEADERS = sorted(Path(__file__).parent.glob("*.h"))
_lib: ctypes.CDLL | None = None
_failed: str | None = None
_libs: dict[tuple[str, ...], ctypes.CDLL] = {}  # by compiler switches: every tier's library loaded so far
_threads: int | None = None  # set_threads' count, given to each library as it is loaded


def _paddle_libs() -> Path:
    return Path(paddle.__file__).parent / "libs"


def compiler() -> str | None:
    """The C compiler the kernels are built with: $CC, else cc or gcc on PATH; None without one."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def compile_library(out: Path, sources: list[Path] | None = None, flags: tuple[str, ...] = ()) -> None:
    """Compile `sources` (default: this package's .c files; their headers beside them) into the library `out`, with
    `flags` after -march=native (isa.compile_flags: a capped tier). scripts/bench_kernels_ab.py builds another
    revision's sources with it, to compare the two in one process."""
    cc = compiler()
    if cc is None:
        raise RuntimeError("no C compiler (cc / gcc) on PATH")
    libs = _paddle_libs()
    omp = ["-fopenmp"] if (libs / "libiomp5.so").exists() else ["-fopenmp-simd"]
    link = [f"-L{libs}", f"-Wl,-rpath,{libs}", "-liomp5"] if "-fopenmp" in omp else []
    objs = [str(out.with_name(f"{out.stem}-{src.stem}.o")) for src in sources or _SOURCES]

    def compile_one(src: Path, obj: str) -> None:
        subprocess.run([cc, "-O3", "-march=native", *flags, "-fPIC", *omp, "-c", str(src), "-o", obj],
                       check=True, capture_output=True, text=True)

    # the sources one per core at a time: a first test run builds a library per tier (isa.py)
    with ThreadPoolExecutor(max_workers=len(os.sched_getaffinity(0))) as pool:
        for done in [pool.submit(compile_one, src, obj) for src, obj in zip(sources or _SOURCES, objs)]:
            done.result()  # a compiler error raises here, its stderr on the CalledProcessError
    tmp = out.with_suffix(".tmp")
    subprocess.run([cc, "-shared", *objs, "-o", str(tmp), *link, "-lm"], check=True, capture_output=True, text=True)
    tmp.rename(out)


def library() -> ctypes.CDLL | None:
    """The loaded library, built first if the host has none for these sources; None without a compiler."""
    global _lib, _failed
    if _lib is not None or _failed is not None:
        return _lib
    switch = os.environ.get("ERNIE_CPU_KERNELS", "1")
    if switch not in ("0", "1"):  # refused (the engine loads the library at start-up), never read as "on"
        raise ValueError(f"ERNIE_CPU_KERNELS={switch!r}: expected 1 (the C kernels, default) or 0 (Paddle ops only)")
    cap = _isa.cap_from_env(os.environ, cpu_isas())  # a bad ERNIE_CPU_ISA / ERNIE_CPU_AMX is refused, not skipped
    if switch == "0":  # the Paddle-only path, for A/B runs and bisecting
        _failed = "ERNIE_CPU_KERNELS=0"
        return None
    try:
        lib = _tier_library(cap)
    except (OSError, AttributeError, RuntimeError, subprocess.CalledProcessError) as e:
        detail = getattr(e, "stderr", "") or str(e)
        _failed = detail.strip().splitlines()[-1] if detail.strip() else repr(e)
        log.warning("CPU kernels not built (%s): the CPU path runs on Paddle ops only (slower)", _failed)
        return None
    if os.environ.get("ERNIE_CPU_ISA"):  # asked for by name: it runs that tier or not at all
        _check_tier(lib, cap)
    _lib = lib
    return _lib


def _tier_library(tier: str) -> ctypes.CDLL:
    """The library for `tier`, built if the host has none for these sources and switches, loaded once a process,
    with AMX allowed exactly when the tier is amx and the process's thread count."""
    flags = _isa.compile_flags(tier, cpu_isas(), cpu_flags())
    lib = _libs.get(flags)
    if lib is None:
        key = hashlib.sha256(b"".join(s.read_bytes() for s in _SOURCES + _HEADERS) + str(_paddle_libs()).encode()
                             + os.uname().machine.encode() + cpu_flags_line().encode() + " ".join(flags).encode())
        out = build_dir() / f"cpu_kernels-{key.hexdigest()[:16]}.so"
        if not out.exists():
            out.parent.mkdir(parents=True, exist_ok=True)
            with open(out.parent / ".cpu_kernels.lock", "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                if not out.exists():
                    log.info("building the CPU kernels for %s (%s)", tier, out.name)
                    compile_library(out, flags=flags)
        lib = _libs[flags] = load(out)
        if _threads is not None:
            lib.ernie_set_num_threads(_threads)
    lib.ernie_set_amx(int(tier == "amx"))
    return lib


def _check_tier(lib: ctypes.CDLL, tier: str) -> None:
    got = _isa.ISAS[lib.ernie_isa()]
    if got != tier:
        raise RuntimeError(f"instruction-set tier {tier} (ERNIE_CPU_ISA): the library built for it runs {got} (the "
                           "compiler's -march=native target or Linux's AMX permission differs from /proc/cpuinfo); "
                           "ask for a tier it reaches")


def cpu_isas() -> list[str]:
    """The instruction-set tiers this CPU runs, lowest first (isa.ISAS: scalar, avx2, avx512, avx512_vnni, amx)."""
    return _isa.cpu_isas(cpu_flags())


def isas() -> list[str]:
    """The tiers this process may run, lowest first: the CPU's, up to ERNIE_CPU_ISA / ERNIE_CPU_AMX's cap."""
    cpu = cpu_isas()
    return cpu[:cpu.index(_isa.cap_from_env(os.environ, cpu)) + 1]


def isa() -> str | None:
    """The tier the loaded kernels run now (as the library reports it); None without them."""
    lib = library()
    return None if lib is None else _isa.ISAS[lib.ernie_isa()]


def use_isa(tier: str) -> None:
    """From now on this process's kernels run `tier` (one of isas()), its library built if needed: the kernel tests
    run each tier the CPU has in one process. Raises RuntimeError without the kernels, or where the built library
    does not run that tier."""
    global _lib
    if tier not in isas():
        raise ValueError(f"instruction-set tier {tier!r}: this process may run {', '.join(isas())} (the CPU's tiers, "
                         "capped by ERNIE_CPU_ISA / ERNIE_CPU_AMX)")
    if library() is None:
        raise RuntimeError(f"the CPU kernels are not built ({_failed})")
    lib = _tier_library(tier)
    _check_tier(lib, tier)
    _lib = lib


def load(path: Path, partial: bool = False) -> ctypes.CDLL:
    """A built library with every function's types declared; `partial`: an older build may lack some (those are
    skipped instead of raising AttributeError)."""
    lib = ctypes.CDLL(str(path))
    for name, (args, restype) in _SIGNATURES.items():
        if partial and not hasattr(lib, name):
            continue
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, restype
    return lib


def available() -> bool:
    return library() is not None


def set_threads(n: int) -> None:
    """The thread count of every kernel's parallel loops, whichever thread calls them (cpu_kernels/threads.h:
    OpenMP's own setting is per calling thread, and the served engine steps from a thread of its own)."""
    global _threads
    if library() is not None:
        _threads = n
        for lib in _libs.values():
            lib.ernie_set_num_threads(n)


def park_threads() -> None:
    """The kernels' (and Paddle's) OpenMP workers sleep now rather than spin out KMP_BLOCKTIME: the end of a step,
    so the host work between steps has the cores (_env.py)."""
    lib = library()
    if lib is not None:
        lib.ernie_park_threads()


def threads() -> int:
    """What the kernels' parallel loops use now (1 without the library)."""
    lib = library()
    return int(lib.ernie_threads()) if lib is not None else 1
