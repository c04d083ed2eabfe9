"""The executing half of the model runner: one rank's model shard and KV cache, running StepInputs.

Every tensor-parallel rank holds one (rank 0 in the engine's own process, the others in worker
processes, engine/workers.py), and all of them run the same StepInput at the same time: the model's
collectives keep them in step. A single-rank engine calls its one ModelShard directly.
"""
from __future__ import annotations

import numpy as np
import paddle

from ..model.ernie import ErnieForCausalLM
from ..model.host_tensor import to_paddle
from ..model.kv_cache import PagedKVCache
from .kv_cache_manager import KVOp, apply_kv_ops
from .step_input import StepInput


class ModelShard:
    def __init__(self, model: ErnieForCausalLM, num_blocks: int, block_size: int, num_host_blocks: int = 0,
                 num_cache_layers: int | None = None):
        """`num_cache_layers`: KV cache layers (the model's, plus one for an MTP head)."""
        cfg = model.config
        model.process_weights_after_loading()
        self.model = model
        self.block_size = block_size
        layers = num_cache_layers or cfg.num_hidden_layers
        kv_heads = len(model.layout.kv_heads(cfg))
        self.cache = PagedKVCache(layers, num_blocks, block_size, kv_heads, cfg.head_dim,
                                  quant=getattr(model, "kv_cache_quant", None))
        shape = (num_host_blocks, layers, 2, block_size, kv_heads, cfg.head_dim)
        self.host_cache = np.zeros(shape, np.float32) if num_host_blocks else None

    def apply_kv_ops(self, ops: list[KVOp]) -> None:
        """Swaps and copies, in the order the block pool recorded them."""
        apply_kv_ops(ops, self.cache, self.host_cache)

    @paddle.no_grad()
    def execute(self, step: StepInput) -> tuple[paddle.Tensor | None, paddle.Tensor | None]:
        """KV ops, then the forward: (final hidden states [T, H], logits [R, vocab] of step.sample_rows);
        None for what the step has not got (no tokens: a KV-ops-only step; no rows to sample)."""
        self.apply_kv_ops(step.kv_ops)
        if not step.num_tokens:
            return None, None
        meta = step.attention_metadata(self.block_size)
        hidden = self.model(to_paddle(step.token_ids), to_paddle(step.positions), meta, self.cache)
        if not step.sample_rows.size:
            return hidden, None
        picked = paddle.index_select(hidden, to_paddle(step.sample_rows))
        return hidden, self.model.compute_logits(picked)
