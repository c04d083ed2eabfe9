"""The executing half of the model runner: one rank's model shard and KV cache, running StepInputs.

Every tensor-parallel rank holds one (rank 0 in the engine's own process, the others in worker
processes, tensor_parallel/workers.py), and all of them run the same StepInput at the same time: the model's
collectives keep them in step. A single-rank engine calls its one ModelShard directly.
"""
from __future__ import annotations

import numpy as np
import paddle

from ..cpu_kernels.build import park_threads
from ..host_tensor import to_paddle
from ..kv_blocks import CODE_DTYPES, KVBlocks
from ..model.ernie import ErnieForCausalLM
from ..model.kv_cache import PagedKVCache
from ..model.mtp import ErnieMTP
from ..step_contract import ArgmaxLogits, KVOp, StepInput, apply_kv_ops
from .support import kv_dtype


class ModelShard:
    def __init__(self, model: ErnieForCausalLM, num_blocks: int, block_size: int, num_host_blocks: int = 0,
                 mtp: ErnieMTP | None = None, weight_bits: int = 32):
        """`mtp`: an MTP head drafting over this shard's cache, in one more cache layer (one-rank engines).
        `weight_bits`: 32, or 16 to hold the float weights and a float KV cache in bfloat16 (support.weight_bits)."""
        cfg = model.config
        model.process_weights_after_loading(weight_bits)
        self.model = model
        self.block_size = block_size
        layers = cfg.num_hidden_layers + (mtp is not None)
        kv_heads = len(model.layout.kv_heads(cfg))
        self.cache = PagedKVCache(layers, num_blocks, block_size, kv_heads, cfg.head_dim,
                                  quant=getattr(model, "kv_cache_quant", None), dtype=kv_dtype(weight_bits))
        shape = (num_host_blocks, layers, 2, block_size, kv_heads, cfg.head_dim)
        host_dtype = PagedKVCache.host_dtype(kv_dtype(weight_bits), self.cache.quant is not None)
        self.host_cache = np.zeros(shape, CODE_DTYPES[host_dtype]) if num_host_blocks else None
        self.draft_head = None if mtp is None else ReferenceDraftHead(model, mtp, self.cache, block_size)

    # Whole blocks with every KV head of the model, whatever this rank holds: the prefill/decode transfer's format,
    # so a prefill and a decode server may run different tensor-parallel sizes.
    def export_kv(self, block_ids: list[int]) -> KVBlocks:
        """Whole blocks with every KV head, as the cache stores them. Under tensor parallelism a collective: every
        rank calls it with the same ids, and each gets the ranks' heads gathered."""
        layout = self.model.layout
        return layout.gather_kv_blocks(self.cache.export_blocks(block_ids), self._all_gather_host, self.model.config)

    def _all_gather_host(self, a: np.ndarray) -> list[np.ndarray]:
        parts: list[paddle.Tensor] = []
        paddle.distributed.all_gather(parts, to_paddle(a), group=self.model.layout.group)
        return [p.numpy() for p in parts]

    def import_kv(self, block_ids: list[int], blocks: KVBlocks) -> None:
        """The inverse of export_kv: each rank keeps the heads it holds (no collective)."""
        self.cache.import_blocks(block_ids, self.model.layout.own_kv_blocks(blocks, self.model.config))

    def apply_kv_ops(self, ops: list[KVOp]) -> None:
        """Swaps and copies, in the order the block pool recorded them."""
        apply_kv_ops(ops, self.cache, self.host_cache)

    def execute(self, step: StepInput) -> tuple[paddle.Tensor | None, paddle.Tensor | ArgmaxLogits | None]:
        """KV ops, then the forward: (final hidden states [T, H], logits [R, vocab] of step.sample_rows, or on an
        argmax-only step their ArgmaxLogits where the model computes those); None for what the step has not got
        (no tokens: a KV-ops-only step; no rows to sample). The OpenMP workers then sleep until the next step
        (cpu_kernels.build.park_threads)."""
        try:
            return self._forward(step)
        finally:
            park_threads()

    @paddle.no_grad()
    def _forward(self, step: StepInput) -> tuple[paddle.Tensor | None, paddle.Tensor | ArgmaxLogits | None]:
        self.apply_kv_ops(step.kv_ops)
        if not step.num_tokens:
            return None, None
        meta = step.attention_metadata(self.block_size)
        hidden = self.model(step.token_ids, step.positions, meta, self.cache)
        if not step.sample_rows.size:
            return hidden, None
        rows = step.sample_rows
        # every row, in order (a step of plain decodes): no gather, one Paddle op fewer where each costs ~0.3 ms
        # with the caches cold from the weights' stream
        every = rows.size == step.num_tokens and bool((rows == np.arange(rows.size)).all())
        picked = hidden if every else paddle.index_select(hidden, to_paddle(rows))
        if step.argmax_only:
            reduced = self.model.compute_argmax(picked)
            if reduced is not None:
                return hidden, ArgmaxLogits(*reduced)
        return hidden, self.model.compute_logits(picked)


class ReferenceDraftHead:
    """The MTP head on the reference backend (engine/mtp_drafter.DraftHead)."""

    def __init__(self, model: ErnieForCausalLM, head: ErnieMTP, cache: PagedKVCache, block_size: int):
        self.model, self.head, self.cache, self.block_size = model, head, cache, block_size

    def take(self, hidden: paddle.Tensor, rows: np.ndarray) -> paddle.Tensor:
        return paddle.index_select(hidden, to_paddle(rows))

    @paddle.no_grad()
    def run(self, step: StepInput, hidden: paddle.Tensor) -> paddle.Tensor:
        return self.head(self.model, to_paddle(step.token_ids), hidden, to_paddle(step.positions),
                         step.attention_metadata(self.block_size), self.cache)

    @paddle.no_grad()
    def logits(self, hidden: paddle.Tensor) -> np.ndarray:
        return self.model.compute_logits(hidden).numpy()
