"""What the reference backend can run, decided from the EngineConfig alone (no Paddle imported), so a server
refuses an unsupported flag at start-up, naming it and what to use instead (engine/executor_factory.check_supported).
"""
from __future__ import annotations

from ..config import EngineConfig
from ..devices import cpu_flag_note


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
    if config.dtype not in ("auto", "float32"):
        bf16 = (f" (a bfloat16 path for CPUs with AVX512-BF16 is not built yet; {cpu_flag_note('avx512_bf16')})"
                if config.dtype == "bfloat16" else "")
        reasons.append(f"dtype={config.dtype!r} is not supported: the reference (CPU) backend computes in float32 "
                       f"only{bf16}; use dtype 'auto' or 'float32' (on a GPU, execution_backend='kernels' computes "
                       "in bfloat16)")
    return reasons
