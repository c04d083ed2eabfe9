"""Build the kernels backend for an engine: check the runtime, load the weights, size the KV pool, capture
the decode graphs. Everything that can be refused is refused here, at start-up, naming what is supported."""
from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np

from ..config import DEFAULT_CPU_KV_BYTES, EngineConfig
from ..step_contract import LOGPROB_ROWS_AT_ONCE, StepInput
from ..model.config import ErnieModelConfig
from ..model.parallel import SINGLE_RANK, ParallelLayout
from ..quantization.plan import QuantPlan
from .collectives import Collectives, make_collectives
from .framework import TensorOps, make_tensor_ops
from .host_tier import HostKVTier
from .kv_cache import DeviceKVCache
from .model import KernelModel
from .shard import KernelShard
from .step_buffers import StepBuffers
from .weights import load_device_weights

log = logging.getLogger(__name__)


def check_runtime(ops: TensorOps, config: EngineConfig) -> None:
    """The kernels need a GPU, or triton's CPU interpreter (tests); CPU-only flags and GPU-only flags are refused
    where they cannot take effect."""
    if config.dtype != "auto" and config.dtype != ops.act_dtype:
        where = "on a GPU" if ops.on_gpu else "in triton's CPU interpreter"
        raise ValueError(f"dtype={config.dtype!r} is not supported: the kernels backend computes in {ops.act_dtype} "
                         f"{where} (dtype 'auto' or {ops.act_dtype!r})")
    if not ops.on_gpu:
        if os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(f"execution_backend='kernels' needs a CUDA GPU and {ops.name} sees none; on a CPU the "
                             "kernels run only in triton's interpreter (set TRITON_INTERPRET=1 before start-up: slow, "
                             "for tests), or serve with execution_backend='reference'")
        if config.use_cudagraph:
            raise ValueError("use_cudagraph=True is not supported here: CUDA graphs need a GPU (this kernels backend "
                             "runs in triton's CPU interpreter)")
        if config.gpu_memory_utilization != 0.9:
            raise ValueError("gpu_memory_utilization is not supported here: it sizes the KV pool on a GPU (this "
                             "kernels backend runs on the CPU); size the pool with kv_cache_memory or "
                             "num_gpu_blocks_override")
    else:
        if config.kv_cache_memory is not None:
            raise ValueError("kv_cache_memory sizes the KV pool on the CPU; on a GPU use gpu_memory_utilization "
                             "(or num_gpu_blocks_override)")
        tp = config.tensor_parallel_size
        if tp > ops.device_count():
            raise ValueError(f"tensor_parallel_size={tp} needs {tp} GPUs (one a rank) and {ops.name} sees "
                             f"{ops.device_count()}; lower --tensor-parallel-size or make more GPUs visible "
                             "(CUDA_VISIBLE_DEVICES)")


FP8_MIN_CAPABILITY = (8, 9)  # fp8 tensor cores: Ada and Hopper


def check_gpu_runs(ops: TensorOps, plan: QuantPlan | None) -> None:
    """Refuse a weight format this GPU has no instructions for, naming the GPU (FastDeploy: fp8 "needs Hopper")."""
    cap = ops.device_capability()
    if cap is None or plan is None:
        return
    methods = {plan.dense, plan.moe, *(m for _, _, m in plan.moe_ranges)}
    if "block_wise_fp8" in methods and cap < FP8_MIN_CAPABILITY:
        raise ValueError(f"block_wise_fp8 needs fp8 tensor cores (compute capability 8.9+: L20, H800, H20, H200); "
                         f"{ops.device_name()} is {cap[0]}.{cap[1]}: serve this model with --quantization wint8 "
                         "or wint4 on it")


def load_kernels_shard(config: EngineConfig, model_dir: Path, model_cfg: ErnieModelConfig, num_output_ids: int,
                       layout: ParallelLayout = SINGLE_RANK, ops: TensorOps | None = None) -> KernelShard:
    """The executor the engine's ModelRunner drives (one tensor-parallel rank's, given its layout, whose group the
    rank's collectives run on; `ops` then on the rank's own GPU). Its CPU tier holds config.swap_space GiB."""
    ops = ops or make_tensor_ops()
    check_runtime(ops, config)
    check_gpu_runs(ops, QuantPlan.resolve(config.quantization, model_cfg.quantization_config))
    layout.check(model_cfg)
    comm = make_collectives(ops, layout.rank, layout.world_size, layout.group)
    spec = config.speculative_config or {}
    mtp = spec if spec.get("method") == "mtp" else None
    weights, plan = load_device_weights(model_dir, model_cfg, ops, config.quantization,
                                        show_progress=not config.disable_progress_bar and layout.rank == 0, mtp=mtp,
                                        layout=layout)
    max_positions = config.max_model_len + config.num_lookahead_tokens
    model = KernelModel(model_cfg, weights, ops, num_output_ids, max_positions, layout, comm)
    int8 = plan is not None and plan.kv_cache == "int8"
    if int8 and weights.kv_scales is None and config.use_cudagraph:
        raise ValueError("use_cudagraph=True with a C8 KV cache needs the checkpoint's static KV scales "
                         "(cachek/cachev_matmul.activation_scale): dynamic per-block scales change the KV write's "
                         "launch shape every step; serve without use_cudagraph, or with a calibrated checkpoint")
    if int8 and weights.kv_scales is not None and mtp is not None:
        raise ValueError("speculative_config method 'mtp' with a C8 KV cache of static scales: the checkpoint has no "
                         "scales for the MTP head's cache layer; serve it with dynamic C8 scales (a checkpoint without "
                         "cachek/cachev_matmul.activation_scale) or without the C8 cache")
    itemsize = 1 if int8 else (2 if ops.on_gpu else 4)
    num_layers = model_cfg.num_hidden_layers + (mtp is not None)  # the MTP head has its own cache layer
    shape = (num_layers, config.block_size, model.num_kv_heads, model_cfg.head_dim)  # this rank's KV heads
    per_block = DeviceKVCache.bytes_per_block(*shape, itemsize)
    num_blocks = agreed_blocks(comm, _num_blocks(config, ops, model, per_block))
    config.check_kv_pool(num_blocks, "give the KV pool more memory (num_gpu_blocks_override, gpu_memory_utilization "
                                     "or kv_cache_memory)")
    cache = DeviceKVCache(ops, num_layers, num_blocks, config.block_size,
                          model.num_kv_heads, model_cfg.head_dim, int8, weights.kv_scales)
    host_blocks = int((config.swap_space or 0) * (1 << 30) // HostKVTier.bytes_per_block(cache))
    where = f", tensor-parallel rank {layout.rank} of {layout.world_size}" if layout.is_parallel else ""
    log.info("kernels backend (%s on %s%s): weights %.1f MiB%s, KV pool %d blocks of %d tokens (%s, %.1f MiB)%s",
             ops.name, "GPU" if ops.on_gpu else "CPU, triton interpreter", where, weights.nbytes / 2**20,
             f" ({plan.method_name})" if plan is not None and plan.quantizes_weights else "", num_blocks,
             config.block_size, cache.code_dtype, num_blocks * per_block / 2**20,
             ", CUDA graphs on" if config.use_cudagraph else "")
    if mtp is not None:
        log.info("MTP speculative decoding on the kernels backend: %d draft token(s) per step from %s",
                 mtp.get("num_speculative_tokens", 1), mtp.get("model") or "the checkpoint's MTP head")
    return KernelShard(model, cache, ops, config.max_num_batched_tokens + config.max_num_seqs * config.num_lookahead_tokens,
                       config.max_num_seqs, config.max_model_len, host_blocks, config.use_cudagraph)


def agreed_blocks(comm: Collectives, num_blocks: int) -> int:
    """Every rank's pool must have the same block count (the scheduler hands out one block id for all ranks):
    the smallest any rank can hold."""
    return int(min(a[0] for a in comm.all_gather_host(np.asarray([num_blocks], np.int64))))


def _num_blocks(config: EngineConfig, ops: TensorOps, model: KernelModel, per_block: int) -> int:
    if config.num_gpu_blocks_override:
        return config.num_gpu_blocks_override
    if not ops.on_gpu:
        return int((config.kv_cache_memory or DEFAULT_CPU_KV_BYTES) // per_block)
    return gpu_kv_blocks(config, ops, model, per_block)


def gpu_kv_blocks(config: EngineConfig, ops: TensorOps, model: KernelModel, per_block: int) -> int:
    """FastDeploy's / vLLM's sizing: gpu_memory_utilization * total, less what is in use, less the peaks that come
    back every step, goes to KV blocks.

    The profile runs first, so that memory allocated outside the framework's allocator on first use (NCCL's
    buffers at the first all-reduce, cuBLAS workspaces, triton's compiled kernels) is already in use when free memory
    is read; the allocator's cache is handed back before the read, so that what it merely holds counts as free. The
    peaks are a forward over max_num_batched_tokens with its logits and a sampling pass over them (the device
    sampler's sort and float64 temporaries are [rows, vocab] each), and, with CUDA graphs, a decode forward at
    max_num_seqs: the graphs' shared pool (cuda_graphs.py), which the eager steps' allocator cannot reuse."""
    peak = profile_forward_peak(config, ops, model)
    graphs = profile_decode_peak(config, ops, model) if config.use_cudagraph else 0
    ops.release_cached()
    free, total = ops.memory_info()
    in_use = total - free
    budget = int(total * config.gpu_memory_utilization) - in_use - peak - graphs
    num = max(budget, 0) // per_block
    log.info("GPU memory: %.2f GiB total, %.2f GiB in use after loading (weights %.2f GiB), forward peak %.2f GiB at "
             "%d tokens%s, gpu_memory_utilization %.2f -> %.2f GiB for %d KV blocks", total / 2**30, in_use / 2**30,
             model.weights.nbytes / 2**30, peak / 2**30, config.max_num_batched_tokens,
             f", CUDA graph pool {graphs / 2**30:.2f} GiB" if config.use_cudagraph else "",
             config.gpu_memory_utilization, max(budget, 0) / 2**30, num)
    if num < 1:
        raise ValueError(f"the model does not fit: {total * config.gpu_memory_utilization / 2**30:.1f} GiB "
                         f"(gpu_memory_utilization {config.gpu_memory_utilization}) leaves nothing for the KV cache after "
                         f"{in_use / 2**30:.1f} GiB in use, a {peak / 2**30:.1f} GiB forward peak"
                         f"{f' and a {graphs / 2**30:.1f} GiB CUDA graph pool' if graphs else ''}; quantize "
                         f"(--quantization wint8 / wint4), lower max_num_batched_tokens, or raise gpu_memory_utilization")
    return int(num)


def profile_forward_peak(config: EngineConfig, ops: TensorOps, model: KernelModel) -> int:
    """Peak extra device memory of one forward over max_num_batched_tokens tokens (sequences of at most
    max_model_len) against a one-block cache that nothing writes to (every slot is -1), its logits (every token's
    when prompt logprobs are on: --enable-logprob), a prompt-logprobs chunk and a sampling pass."""
    t, per_seq = config.max_num_batched_tokens, config.max_model_len
    return _profile_peak(config, ops, model, [min(per_seq, t - s) for s in range(0, t, per_seq)], per_seq)


def profile_decode_peak(config: EngineConfig, ops: TensorOps, model: KernelModel) -> int:
    """Peak extra device memory of the largest captured decode step: max_num_seqs sequences of one new token each,
    at max_model_len context (the split-KV attention's partial results grow with it)."""
    return _profile_peak(config, ops, model, [1] * config.max_num_seqs, config.max_model_len)


def _profile_peak(config: EngineConfig, ops: TensorOps, model: KernelModel, q_lens: list[int], context: int) -> int:
    from .device_sampling import KernelLogits

    cfg = model.config
    cache = DeviceKVCache(ops, cfg.num_hidden_layers, 1, config.block_size, model.num_kv_heads, cfg.head_dim)
    t, b = sum(q_lens), len(q_lens)
    decode = max(q_lens) == 1
    seq_lens = np.full(b, context, np.int64) if decode else np.asarray(q_lens, np.int64)
    positions = seq_lens - 1 if decode else np.concatenate([np.arange(n) for n in q_lens])
    rows = min(t, config.max_num_seqs)
    # prompt logprobs take logits for every prompt token a step computes, then go LOGPROB_ROWS_AT_ONCE rows at once
    logit_rows = t if config.enable_logprob and not decode else rows
    step = StepInput(
        token_ids=np.zeros(t, np.int64), positions=positions.astype(np.int64),
        query_start_loc=np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int64), seq_lens=seq_lens,
        block_tables=np.zeros((b, 1), np.int64), slot_mapping=np.full(t, -1, np.int64),
        sample_rows=np.arange(logit_rows, dtype=np.int64))
    buffers = StepBuffers(ops, t, b, -(-context // config.block_size), model.num_heads // model.num_kv_heads, False,
                          model.num_kv_heads, split_kv_target=2 * ops.multiprocessor_count())
    ops.synchronize()
    ops.reset_peak()
    before = ops.allocated()
    st = buffers.fill(step, config.block_size)
    logits = KernelLogits(model.compute_logits(ops.rows(model.forward(st, cache), st.logit_rows)), ops)
    if logit_rows > rows:
        chunk = np.arange(min(logit_rows, LOGPROB_ROWS_AT_ONCE), dtype=np.int64)
        logits.top_logprobs(chunk, np.zeros_like(chunk), config.max_logprobs)
    # the sampler's costliest path: every row drawn under top-p, through the descending sort of its probabilities
    logits = logits.take(np.arange(rows, dtype=np.int64))
    ones, zeros = np.ones(rows, np.float32), np.zeros(rows, np.float32)
    logits.sample(np.zeros(rows, bool), ones, np.zeros(rows, np.int64), ones * 0.9, zeros, np.full(rows, 0.5))
    ops.synchronize()
    return max(ops.peak_allocated() - before, 0)
