"""The kernels backend's StepExecutor: runs the engine's StepInputs on KernelModel over a DeviceKVCache.

It is what reference_backend/shard.ModelShard is for the reference backend, with the same contract to the model
runner: apply the step's KV block moves, run the forward, return the sampled rows' logits, here left on the
device (device_sampling.KernelLogits: the sampler draws there when the batch allows, else copies them). A
decode-only step replays a CUDA graph when graphs are on.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from .device_sampling import KernelLogits
from ..kv_blocks import KVBlocks
from ..step_contract import KVOp, StepInput
from .cuda_graphs import CudaGraphRunner, graph_batch_sizes
from .framework import TensorOps
from .host_tier import HostKVTier
from .kv_cache import DeviceKVCache
from .model import KernelModel, StepTensors
from .step_buffers import StepBuffers


class KernelShard:
    def __init__(self, model: KernelModel, cache: DeviceKVCache, ops: TensorOps, max_tokens: int, max_seqs: int,
                 max_model_len: int, num_host_blocks: int = 0, use_cudagraph: bool = False):
        self.model, self.cache, self.ops = model, cache, ops
        self.block_size = cache.block_size
        self.buffers = StepBuffers(ops, max(max_tokens, max_seqs), max_seqs, -(-max_model_len // cache.block_size),
                                   model.num_heads // model.num_kv_heads, cache.dynamic is not None,
                                   model.num_kv_heads, split_kv_target=2 * ops.multiprocessor_count())
        self.host_cache = HostKVTier(cache, num_host_blocks)  # the CPU tier, in the cache's own format
        self.draft_head = None if model.weights.mtp is None else KernelDraftHead(self)
        self.graphs = None
        if use_cudagraph:
            self.graphs = CudaGraphRunner(graph_batch_sizes(max_seqs), ops.cuda_graph, ops.graph_pool)
            self.graphs.capture_all(self._fill_padding, self._graph_forward)

    def apply_kv_ops(self, kv_ops: list[KVOp]) -> None:
        """Swaps to / from the CPU tier and block copies, in the order the block pool recorded them."""
        if kv_ops:
            self.host_cache.apply(kv_ops)

    def export_kv(self, block_ids: list[int]) -> KVBlocks:
        """Whole blocks with every KV head, in the cache's format; under tensor parallelism a collective every rank
        joins with the same ids (each exports its heads, the all-gather joins them)."""
        m = self.model
        return m.layout.gather_kv_blocks(self.cache.export_blocks(block_ids), m.comm.all_gather_host, m.config)

    def import_kv(self, block_ids: list[int], blocks: KVBlocks) -> None:
        """The inverse of export_kv: each rank stores the heads it holds (no collective)."""
        self.cache.import_blocks(block_ids, self.model.layout.own_kv_blocks(blocks, self.model.config))

    def execute(self, step: StepInput) -> tuple[Any, KernelLogits | None]:
        """(final hidden states [T, H] on the device, the logits [R, vocab] of step.sample_rows on the device);
        None for what the step has not got. After a graph replay both are the graph's output buffers (the hidden
        states padded to the bucket): read before the next replay, as the sampler and the MTP drafter do."""
        self.apply_kv_ops(step.kv_ops)
        if not step.num_tokens:
            return None, None
        bucket = self.graphs.bucket(step) if self.graphs is not None else None
        if bucket is not None:
            self.buffers.fill(step, self.block_size, pad_seqs_to=bucket)
            hidden, logits = self.graphs.replay(bucket)
            return hidden, KernelLogits(logits[: len(step.sample_rows)], self.ops)
        st = self.buffers.fill(step, self.block_size)
        hidden = self.model.forward(st, self.cache)
        if not step.sample_rows.size:
            return hidden, None
        logits = self.model.compute_logits(self.ops.rows(hidden, st.logit_rows))
        return hidden, KernelLogits(logits, self.ops)

    # ---------------------------------------------------------------- graph capture
    def _fill_padding(self, size: int) -> StepTensors:
        """A decode step of `size` padding sequences: every buffer a graph reads is sized for `size`."""
        return self.buffers.fill(StepInput(
            token_ids=np.zeros(0, np.int64), positions=np.zeros(0, np.int64), query_start_loc=np.zeros(1, np.int64),
            seq_lens=np.zeros(0, np.int64), block_tables=np.zeros((0, 1), np.int64),
            slot_mapping=np.zeros(0, np.int64), sample_rows=np.zeros(0, np.int64)), self.block_size, pad_seqs_to=size)

    def _graph_forward(self, st: StepTensors) -> tuple[Any, Any]:
        hidden = self.model.forward(st, self.cache)
        return hidden, self.model.compute_logits(self.ops.rows(hidden, st.logit_rows))


class KernelDraftHead:
    """The MTP head on the kernels backend (engine/mtp_drafter.DraftHead): runs eagerly over the shard's step
    buffers and cache; its logits stay on the device (greedy drafts are their argmax there)."""

    def __init__(self, shard: KernelShard):
        self.shard = shard
        self.block_size = shard.block_size

    def take(self, hidden: Any, rows: np.ndarray) -> Any:
        ops = self.shard.ops
        return ops.rows(hidden, ops.tensor(rows))

    def run(self, step: StepInput, hidden: Any) -> Any:
        s = self.shard
        return s.model.mtp_forward(s.buffers.fill(step, s.block_size), hidden, s.cache)

    def logits(self, hidden: Any) -> KernelLogits:
        return KernelLogits(self.shard.model.compute_logits(hidden), self.shard.ops)
