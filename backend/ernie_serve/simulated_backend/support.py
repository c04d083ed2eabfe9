"""What the simulated backend can run, decided from the EngineConfig alone (engine/executor_factory.check_supported,
at a server's start-up). It models one token a step per running request on one target, with no KV bytes behind
its pool: what needs more is refused, naming the flag."""
from __future__ import annotations

from ..config import EngineConfig
from .step_model import total_weight_bytes
from .targets import WEIGHT_BYTES, Target, GPUS, MODELS, unknown_target

FLOAT_DTYPES = ("auto", "bfloat16", "float16")  # the float weights' 2 bytes (targets.WEIGHT_BYTES[None])


def unsupported(config: EngineConfig) -> list[str]:
    """Why this backend cannot serve the config as asked (empty: it can)."""
    reasons = unknown_target(config.simulated_gpu, config.simulated_model)
    if config.dtype not in FLOAT_DTYPES:
        reasons.append(f"dtype={config.dtype!r} is not supported: the simulated target holds its float weights in 2 "
                       f"bytes ({', '.join(map(repr, FLOAT_DTYPES))}); --quantization sets the quantized weights' "
                       "bytes")
    if config.speculative_config:
        reasons.append(f"speculative_config={config.speculative_config!r} is not supported: the simulated backend "
                       "models one token a step per running request and drafts nothing")
    if config.use_cudagraph:
        reasons.append("use_cudagraph=True is not supported: the simulated step's fixed cost already stands for a "
                       "graph-replayed decode; leave it off")
    if config.splitwise_role != "mixed":
        reasons.append(f"splitwise_role={config.splitwise_role!r} is not supported: the simulated pool holds no KV "
                       "bytes to hand between prefill and decode servers; use 'mixed'")
    if config.kv_cache_memory is not None:
        reasons.append(f"kv_cache_memory={config.kv_cache_memory!r} is not supported: the simulated pool is sized "
                       "like the target GPU's (gpu_memory_utilization); or give num_gpu_blocks_override")
    if config.enable_expert_parallel:
        reasons.append("enable_expert_parallel=True is not supported: the simulated step model splits every weight "
                       "evenly across tensor_parallel_size GPUs")
    if not reasons and config.quantization in WEIGHT_BYTES:
        reasons += _weights_fit(config)
    return reasons


def _weights_fit(config: EngineConfig) -> list[str]:
    """The target's weights must leave room for a KV pool in gpu_memory_utilization of each GPU."""
    target = Target(GPUS[config.simulated_gpu], MODELS[config.simulated_model], config.quantization,
                    config.tensor_parallel_size)
    need, have = total_weight_bytes(target), config.gpu_memory_utilization * target.gpu.hbm_bytes
    if need < have:
        return []
    return [f"simulated_model={config.simulated_model!r} does not fit simulated_gpu={config.simulated_gpu!r}: "
            f"{need / 1e9:.1f} GB of weights a GPU ({config.quantization or 'bfloat16'}, tensor_parallel_size="
            f"{config.tensor_parallel_size}) against {have / 1e9:.1f} GB (gpu_memory_utilization x HBM); raise "
            "tensor_parallel_size or quantize the weights (--quantization)"]
