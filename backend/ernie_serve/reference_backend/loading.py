"""Builds the reference backend's executor from an EngineConfig: the model (quantized as the config asks), its MTP
head, and a KV pool of the size the config gives it. One-rank engines load here; a tensor-parallel engine's ranks
load in tensor_parallel/workers.py and size their pools with kv_pool_blocks, per rank."""
from __future__ import annotations

import logging
from pathlib import Path

from ..config import DEFAULT_CPU_KV_BYTES, EngineConfig
from ..model.config import ErnieModelConfig
from ..model.kv_cache import PagedKVCache
from ..model.loader import load_model, load_mtp_head
from ..model.parallel import ParallelLayout
from ..model.quantized_layers import weight_memory_report
from .shard import ModelShard
from .support import kv_dtype, weight_bits

log = logging.getLogger(__name__)


def load_reference_shard(config: EngineConfig, model_dir: Path, model_cfg: ErnieModelConfig,
                         num_output_ids: int | None, layout: ParallelLayout) -> ModelShard:
    """One rank's ModelShard (the model, its MTP head when speculative_config asks for one, its KV pool)."""
    model = load_model(model_dir, num_output_ids=num_output_ids, show_progress=not config.disable_progress_bar,
                       quantization=config.quantization)
    spec = config.speculative_config or {}
    mtp = None
    if spec.get("method") == "mtp":  # from the checkpoint's own mtp_* tensors, or from speculative_config.model
        mtp = load_mtp_head(model, model_dir, spec.get("model"))
        log.info("MTP speculative decoding: %d draft token(s) per step from %s", spec.get("num_speculative_tokens", 1),
                 spec.get("model") or "the checkpoint's MTP head")
    layers = model_cfg.num_hidden_layers + (mtp is not None)  # the MTP head has its own cache layer
    num_blocks, num_host_blocks = kv_pool_blocks(config, model_cfg, layout, layers, model.kv_cache_quant is not None)
    shard = ModelShard(model, num_blocks, config.block_size, num_host_blocks, mtp, weight_bits(config))
    log_weight_memory(model, "")  # in the serving layouts (bfloat16 ones are half the float32 size)
    return shard


def kv_pool_blocks(config: EngineConfig, model_cfg: ErnieModelConfig, layout, layers: int,
                    c8: bool) -> tuple[int, int]:
    """Device and CPU-tier blocks of one rank's pool (kv_cache_memory is per rank: a tensor-parallel
    rank's blocks hold only its KV heads)."""
    c, m = config, model_cfg
    shape = (layers, c.block_size, len(layout.kv_heads(m)), m.head_dim)
    dtype = kv_dtype(weight_bits(c))
    per_block = PagedKVCache.bytes_per_block(*shape, int8=c8, dtype=dtype)
    if c.num_gpu_blocks_override:
        num = c.num_gpu_blocks_override
    else:
        num = int((c.kv_cache_memory or DEFAULT_CPU_KV_BYTES) // per_block)
    c.check_kv_pool(num, "raise num_gpu_blocks_override" if c.num_gpu_blocks_override else "raise kv_cache_memory")
    host_block = PagedKVCache.bytes_per_block(*shape, dtype=PagedKVCache.host_dtype(dtype, c8))
    host = int((c.swap_space or 0) * (1 << 30) // host_block)
    return num, host


def log_weight_memory(model, where: str) -> None:
    mem = weight_memory_report(model)
    log.info("model weights resident%s: %.1f MiB (%.1f MiB in quantized layers, which would be %.1f MiB in fp32; all in "
             "fp32 would be %.1f MiB)", where, mem["total_bytes"] / 2**20, mem["quantized_bytes"] / 2**20,
             mem["quantized_fp32_bytes"] / 2**20, mem["fp32_model_bytes"] / 2**20)
