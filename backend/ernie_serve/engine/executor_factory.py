"""Builds the step executor an engine drives (step_contract.StepExecutor), for the backend and layout the config
names, and says what the engine needs from it: the executor, its CPU tier's block count and the CPU threads the
model runs on. One function a backend, each returning everything it decided (nothing is handed back through
attributes set on the engine): the kernels backend on one device (kernels_backend/), the reference backend on one
rank (reference_backend/), or either backend on several ranks (tensor_parallel/: rank 0 here, the others in worker
processes). A backend is imported only once chosen, so the engine core imports no framework."""
from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from importlib import import_module
from pathlib import Path

from ..config import EngineConfig
from ..model.config import ErnieModelConfig
from ..step_contract import StepExecutor

log = logging.getLogger(__name__)


@dataclass
class LoadedExecutor:
    executor: StepExecutor  # .model is the rank-0 model, .cache the engine's view of the KV pool
    num_host_blocks: int  # the CPU tier of the prefix cache (swap_space), in blocks
    cpu_threads: int  # the model's CPU threads in this process (0: the model runs on a device)
    backend: str = "reference"  # the execution backend it runs ("auto" resolved)


def resolve_backend(config: EngineConfig) -> str:
    """The execution backend the config's names: "auto" is the kernels backend where a GPU is visible, else the
    reference backend. Decided here, when an engine is built, not when a config is made. "auto" refuses (ValueError)
    a machine that shows NVIDIA GPUs its tensor framework cannot use (a CPU build of Paddle, torch without CUDA)
    instead of serving on the CPU without a word; "reference" runs on the CPU whatever the machine has."""
    if config.execution_backend != "auto":
        return config.execution_backend
    from ..devices import gpu_visible, unusable_gpu_reason

    if gpu_visible():
        return "kernels"
    reason = unusable_gpu_reason()
    if reason:
        raise ValueError(reason)
    return "reference"


def check_supported(config: EngineConfig) -> None:
    """Refuse what the config's execution backend cannot run, every reason at once, each naming its flag (vLLM's
    validate_configuration): each backend's support.py decides from the config alone, importing no framework, so
    the server's command line is checked before anything starts."""
    support = import_module(f"..{resolve_backend(config)}_backend.support", __package__)
    reasons = support.unsupported(config)
    if reasons:
        raise ValueError("; ".join(reasons))


def load_executor(config: EngineConfig, model_dir: Path, model_cfg: ErnieModelConfig,
                  num_output_ids: int | None) -> LoadedExecutor:
    """num_output_ids: the tokenizer's size (None: the checkpoint's vocabulary, skip_tokenizer_init)."""
    backend = resolve_backend(config)
    config = replace(config, execution_backend=backend)  # what the backend and tensor-parallel workers read
    if backend == "reference" and config.dtype == "auto":
        from ..reference_backend.support import resolve_auto_dtype

        config = replace(config, dtype=resolve_auto_dtype(model_cfg.checkpoint_dtype))
        log.info("dtype auto: %s (the checkpoint declares %s)", config.dtype, model_cfg.checkpoint_dtype)
    check_supported(config)
    if backend == "simulated":  # its tensor_parallel_size is the target's GPU count: no worker ranks
        loaded = _simulated(config, model_dir, model_cfg, num_output_ids)
    elif config.tensor_parallel_size > 1:
        loaded = _tensor_parallel(config, model_dir, model_cfg, num_output_ids)
    elif backend == "kernels":
        loaded = _kernels(config, model_dir, model_cfg, num_output_ids)
    else:
        loaded = _single_rank(config, model_dir, model_cfg, num_output_ids)
    loaded.backend = backend
    return loaded


def _kernels(config: EngineConfig, model_dir: Path, model_cfg: ErnieModelConfig,
             num_output_ids: int | None) -> LoadedExecutor:
    """The triton-lang kernels backend (kernels_backend/): one device, weights in their serving formats."""
    from ..kernels_backend.loading import load_kernels_shard

    shard = load_kernels_shard(config, model_dir, model_cfg, num_output_ids or model_cfg.vocab_size)
    threads = 0
    if shard.ops.name == "paddle" and not shard.ops.on_gpu:
        from .._env import setup_model_process

        threads = setup_model_process()
    return LoadedExecutor(shard, _host_blocks(shard.host_cache), threads)


def _simulated(config: EngineConfig, model_dir: Path, model_cfg: ErnieModelConfig,
               num_output_ids: int | None) -> LoadedExecutor:
    """The simulated device (simulated_backend/): a benchmark instrument that sleeps for a target GPU's modeled step
    time and replays fixed text; it runs no model and holds no KV bytes."""
    from ..simulated_backend.loading import load_simulated

    executor, num_host_blocks = load_simulated(config, model_dir, model_cfg, num_output_ids)
    return LoadedExecutor(executor, num_host_blocks, 0)


def _single_rank(config: EngineConfig, model_dir: Path, model_cfg: ErnieModelConfig,
                 num_output_ids: int | None) -> LoadedExecutor:
    """The reference backend on one rank (reference_backend/)."""
    from .._env import setup_model_process
    from ..reference_backend.loading import load_reference_shard

    threads = setup_model_process()
    shard = load_reference_shard(config, model_dir, model_cfg, num_output_ids, _checked_layout(config, model_cfg))
    return LoadedExecutor(shard, _host_blocks(shard.host_cache), threads)


def _tensor_parallel(config: EngineConfig, model_dir: Path, model_cfg: ErnieModelConfig,
                     num_output_ids: int | None) -> LoadedExecutor:
    """Rank 0 here, ranks 1..N-1 in worker processes (tensor_parallel/workers.py), each with its shard and KV pool."""
    from dataclasses import asdict

    from .._env import setup_model_process
    from ..model.checkpoint_map import tensor_directory
    from ..quantization.plan import QuantPlan
    from ..reference_backend.loading import kv_pool_blocks, log_weight_memory
    from ..reference_backend.support import weight_bits
    from ..tensor_parallel.workers import TensorParallelExecutor, paddle_on_cpu, threads_per_rank

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
        fields["num_blocks"], fields["num_host_blocks"] = kv_pool_blocks(c, model_cfg, layout, layers, c8)
        fields["weight_bits"] = weight_bits(c)
    threads = 0
    if paddle_on_cpu(c.execution_backend, framework, on_gpu):
        threads = setup_model_process(threads_per_rank(c.tensor_parallel_size))
    executor = TensorParallelExecutor(fields)
    if mtp:
        log.info("MTP speculative decoding: %d draft token(s) per step from %s, the head split across %d ranks",
                 spec.get("num_speculative_tokens", 1), spec.get("model") or "the checkpoint's MTP head",
                 c.tensor_parallel_size)
    if kernels:
        num_host_blocks = _host_blocks(executor.shard.host_cache)
    else:
        num_host_blocks = fields["num_host_blocks"]
        log_weight_memory(executor.model, " on rank 0")
    return LoadedExecutor(executor, num_host_blocks, threads)


def _host_blocks(host_cache) -> int:
    """The CPU tier's size in blocks, from the executor's host array (None: no tier)."""
    return 0 if host_cache is None else len(host_cache)


def _checked_layout(config: EngineConfig, model_cfg: ErnieModelConfig):
    """Rank 0's ParallelLayout, checked against the model before any worker starts."""
    from ..model.parallel import ParallelLayout

    layout = ParallelLayout(0, config.tensor_parallel_size, config.enable_expert_parallel)
    layout.check(model_cfg)
    return layout
