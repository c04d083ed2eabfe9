"""What the kernels backend can run, decided from the EngineConfig alone (no framework imported), so a server refuses
an unsupported flag at start-up (engine/executor_factory.check_supported). What depends on the device it finds (a GPU,
its memory, its capability) is checked when it loads (loading.check_runtime, check_gpu_runs)."""
from __future__ import annotations

from ..config import EngineConfig


def unsupported(config: EngineConfig) -> list[str]:
    """Why this backend cannot serve the config as asked (empty: it can)."""
    reasons = []
    if config.use_cudagraph and config.tensor_parallel_size > 1:
        reasons.append(f"use_cudagraph=True is not supported: CUDA graphs with tensor_parallel_size="
                       f"{config.tensor_parallel_size} are not supported yet: capturing the ranks' collectives in a "
                       "graph is unverified; serve tensor-parallel engines without use_cudagraph")
    return reasons
