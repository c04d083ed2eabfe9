"""ERNIE-4.5's multi-token-prediction (MTP) head, the draft model of `speculative_config` method "mtp".

From the target's final-normed hidden state h_t and the next token x_{t+1} it predicts x_{t+2}:

    z = linear_proj(concat([emb_norm(embed(x_{t+1})), hidden_norm(h_t)]))     (embedding first, 2H -> H)
    h'_t = norm(block(z))            one dense decoder layer, then the target's final norm
    logits = lm_head(h'_t)           the target's head

The embedding, final norm, RoPE and head are the target's own (shared, as in FastDeploy). The block
attends over its own KV cache layer, `num_hidden_layers` (one past the target's), in the same blocks as
the target's cache, so MTP KV moves with swaps, copies and KV transfers like the rest. Drafting k > 1
tokens feeds h'_t back as the hidden state of the next position, as FastDeploy does.
"""
from __future__ import annotations

import paddle
from paddle import nn

from .attention import AttentionMetadata
from .config import ErnieModelConfig
from .ernie import DecoderLayer, ErnieForCausalLM
from .kv_cache import PagedKVCache
from .layers import Linear, RMSNorm
from .parallel import SINGLE_RANK, ParallelLayout


class ErnieMTP(nn.Layer):
    def __init__(self, cfg: ErnieModelConfig, layout: ParallelLayout = SINGLE_RANK):
        """`layout`: under tensor parallelism the block is split as the target's layers are (its K/V in the rank's
        own cache layer); the norms and linear_proj are replicated, the embedding and head are the target's."""
        super().__init__()
        self.cache_layer = cfg.num_hidden_layers
        self.emb_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.linear_proj = Linear(2 * cfg.hidden_size, cfg.hidden_size)
        self.block = DecoderLayer(cfg, self.cache_layer, moe=False, layout=layout)

    def forward(self, target: ErnieForCausalLM, next_ids: paddle.Tensor, hidden: paddle.Tensor,
                positions: paddle.Tensor, meta: AttentionMetadata, cache: PagedKVCache | None) -> paddle.Tensor:
        """next_ids [T] (x_{t+1}), hidden [T, H] (h_t), positions [T] (t) -> the head's hidden states [T, H]."""
        e = self.emb_norm(target.embed_tokens(next_ids))
        z = self.linear_proj(paddle.concat([e, self.hidden_norm(hidden)], axis=-1))
        return target.norm(self.block(z, positions, target.rope, meta, cache))
