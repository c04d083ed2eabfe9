"""Builds the step executor an engine drives (step_contract.StepExecutor), for the backend and layout the config
names, and says what the engine needs from it: the executor, its CPU tier's block count and the CPU threads the
model runs on. One function a backend, each returning everything it decided (nothing is handed back through
attributes set on the engine): the kernels backend on one device (kernels_backend/), the reference backend on one
rank (engine/model_shard.py), or either backend on several ranks (engine/workers.py: rank 0 here, the others in
worker processes)."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from ..config import DEFAULT_CPU_KV_BYTES, EngineConfig
from ..model.config import ErnieModelConfig
from ..step_contract import StepExecutor

log = logging.getLogger(__name__)


@dataclass
class LoadedExecutor:
    executor: StepExecutor  # .model is the rank-0 model, .cache the engine's view of the KV pool
    num_host_blocks: int  # the CPU tier of the prefix cache (swap_space), in blocks
    cpu_threads: int  # the model's CPU threads in this process (0: the model runs on a device)


def load_executor(config: EngineConfig, model_dir: Path, model_cfg: ErnieModelConfig,
                  num_output_ids: int | None) -> LoadedExecutor:
    """num_output_ids: the tokenizer's size (None: the checkpoint's vocabulary, skip_tokenizer_init)."""
    if config.tensor_parallel_size > 1:
        return _tensor_parallel(config, model_dir, model_cfg, num_output_ids)
    if config.execution_backend == "kernels":
        return _kernels(config, model_dir, model_cfg, num_output_ids)
    return _single_rank(config, model_dir, model_cfg, num_output_ids)


def _kernels(config: EngineConfig, model_dir: Path, model_cfg: ErnieModelConfig,
             num_output_ids: int | None) -> LoadedExecutor:
    """The triton-lang kernels backend (kernels_backend/): one device, weights in their serving formats."""
    from ..kernels_backend.loading import load_kernels_shard

    shard = load_kernels_shard(config, model_dir, model_cfg, num_output_ids or model_cfg.vocab_size)
    threads = 0
    if shard.ops.name == "paddle" and not shard.ops.on_gpu:
        from .._env import setup_model_process

        threads = setup_model_process()
    return LoadedExecutor(shard, 0 if shard.host_cache is None else shard.host_cache.shape[0], threads)


def _single_rank(config: EngineConfig, model_dir: Path, model_cfg: ErnieModelConfig,
                 num_output_ids: int | None) -> LoadedExecutor:
    from .._env import setup_model_process
    from ..model.loader import load_model, load_mtp_head
    from .model_shard import ModelShard

    threads = setup_model_process()
    layout = _checked_layout(config, model_cfg)
    model = load_model(model_dir, num_output_ids=num_output_ids, show_progress=not config.disable_progress_bar,
                       quantization=config.quantization)
    _log_weight_memory(model, "")
    spec = config.speculative_config or {}
    mtp = None
    if spec.get("method") == "mtp":  # from the checkpoint's own mtp_* tensors, or from speculative_config.model
        mtp = load_mtp_head(model, model_dir, spec.get("model"))
        log.info("MTP speculative decoding: %d draft token(s) per step from %s", spec.get("num_speculative_tokens", 1),
                 spec.get("model") or "the checkpoint's MTP head")
    layers = model_cfg.num_hidden_layers + (mtp is not None)  # the MTP head has its own cache layer
    num_blocks, num_host_blocks = _kv_pool_blocks(config, model_cfg, layout, layers, model.kv_cache_quant is not None)
    return LoadedExecutor(ModelShard(model, num_blocks, config.block_size, num_host_blocks, mtp), num_host_blocks,
                          threads)


def _tensor_parallel(config: EngineConfig, model_dir: Path, model_cfg: ErnieModelConfig,
                     num_output_ids: int | None) -> LoadedExecutor:
    """Rank 0 here, ranks 1..N-1 in worker processes (engine/workers.py), each with its shard and KV pool."""
    from dataclasses import asdict

    from .._env import setup_model_process
    from ..model.checkpoint_map import tensor_directory
    from ..quantization.plan import QuantPlan
    from .workers import TensorParallelExecutor, paddle_on_cpu, threads_per_rank

    c = config
    layout = _checked_layout(c, model_cfg)
    tensor_directory(model_dir, layout)  # a pre-sharded checkpoint's rank count: before workers start
    spec = c.speculative_config or {}
    mtp = spec.get("method") == "mtp"
    kernels = c.execution_backend == "kernels"
    framework, on_gpu = "paddle", False
    fields = dict(model_dir=str(model_dir), num_output_ids=num_output_ids, quantization=c.quantization,
                  block_size=c.block_size, world_size=c.tensor_parallel_size, expert_parallel=c.enable_expert_parallel,
                  mtp_source=(spec.get("model") or "") if mtp else None)
    if kernels:
        from ..devices import default_framework, gpu_visible

        framework, on_gpu = default_framework(), gpu_visible()
        # each rank sizes its own pool (kernels_backend/loading.py) and the ranks agree on the smallest
        fields.update(num_blocks=0, num_host_blocks=0, backend="kernels", framework=framework, on_gpu=on_gpu,
                      engine_config=asdict(c))
    else:
        plan = QuantPlan.resolve(c.quantization, model_cfg.quantization_config)
        c8 = plan is not None and plan.kv_cache == "int8"
        layers = model_cfg.num_hidden_layers + mtp  # the MTP head's cache layer, on every rank
        fields["num_blocks"], fields["num_host_blocks"] = _kv_pool_blocks(c, model_cfg, layout, layers, c8)
    threads = 0
    if paddle_on_cpu(c.execution_backend, framework, on_gpu):
        threads = setup_model_process(threads_per_rank(c.tensor_parallel_size))
    executor = TensorParallelExecutor(fields)
    if mtp:
        log.info("MTP speculative decoding: %d draft token(s) per step from %s, the head split across %d ranks",
                 spec.get("num_speculative_tokens", 1), spec.get("model") or "the checkpoint's MTP head",
                 c.tensor_parallel_size)
    if kernels:
        host_cache = executor.shard.host_cache
        num_host_blocks = 0 if host_cache is None else host_cache.shape[0]
    else:
        num_host_blocks = fields["num_host_blocks"]
        _log_weight_memory(executor.model, " on rank 0")
    return LoadedExecutor(executor, num_host_blocks, threads)


def _checked_layout(config: EngineConfig, model_cfg: ErnieModelConfig):
    """Rank 0's ParallelLayout, checked against the model before any worker starts."""
    from ..model.parallel import ParallelLayout

    layout = ParallelLayout(0, config.tensor_parallel_size, config.enable_expert_parallel)
    layout.check(model_cfg)
    return layout


def _kv_pool_blocks(config: EngineConfig, model_cfg: ErnieModelConfig, layout, layers: int,
                    c8: bool) -> tuple[int, int]:
    """Device and CPU-tier blocks of one rank's pool (kv_cache_memory is per rank: a tensor-parallel
    rank's blocks hold only its KV heads)."""
    from ..model.kv_cache import PagedKVCache

    c, m = config, model_cfg
    shape = (layers, c.block_size, len(layout.kv_heads(m)), m.head_dim)
    per_block = PagedKVCache.bytes_per_block(*shape, int8=c8)
    if c.num_gpu_blocks_override:
        num = c.num_gpu_blocks_override
    else:
        num = int((c.kv_cache_memory or DEFAULT_CPU_KV_BYTES) // per_block)
    c.check_kv_pool(num, "raise kv_cache_memory")
    # the CPU tier holds blocks as float32 whatever the device cache's format
    host = int((c.swap_space or 0) * (1 << 30) // PagedKVCache.bytes_per_block(*shape))
    return num, host


def _log_weight_memory(model, where: str) -> None:
    from ..model.quantized_layers import weight_memory_report

    mem = weight_memory_report(model)
    log.info("model weights resident%s: %.1f MiB (%.1f MiB in quantized layers, %.1f MiB in fp32 would be "
             "%.1f MiB)", where, mem["total_bytes"] / 2**20, mem["quantized_bytes"] / 2**20,
             mem["quantized_fp32_bytes"] / 2**20, mem["fp32_model_bytes"] / 2**20)
