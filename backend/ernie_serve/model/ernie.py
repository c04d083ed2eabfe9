"""ERNIE-4.5 causal LM (dense and MoE) over a paged KV cache.

`forward` takes the step's tokens flattened across sequences plus an AttentionMetadata that says
which token belongs where; `compute_logits` runs the head only for the rows that get sampled.
The dense linears and routed experts come from the LayerBuilder the loader hands in (model/layer_builder.py):
float ones, or empty quantized ones for the loader to fill; embeddings, norms, the router and lm_head stay fp32.
A ParallelLayout (model/parallel.py) builds one tensor-parallel rank's shard of the model: fewer heads,
a slice of each intermediate dimension (or of the experts), a slice of the vocabulary.
"""
from __future__ import annotations

import numpy as np
import paddle
import paddle.nn.functional as F
from paddle import nn

from ..cpu_kernels import cpu_gemm
from ..host_tensor import to_paddle
from .attention import AttentionMetadata, paged_attention
from .config import ErnieModelConfig
from .cpu_layers import CpuDecoderStack
from .kv_cache import KVCacheQuant, PagedKVCache
from .layer_builder import FLOAT_LAYERS, LayerBuilder
from .layers import MLP, BlockedLinear, Linear, RMSNorm, RotaryEmbedding, TiedEmbedding
from .moe import FusedExperts, MoE
from .parallel import SINGLE_RANK, ParallelLayout


class VocabParallelEmbedding(nn.Layer):
    """Rows [start, start + V/N) of the embedding; ids outside embed to zero, the all-reduce fills them in."""

    def __init__(self, vocab_size: int, hidden_size: int, layout: ParallelLayout):
        super().__init__()
        rows = layout.split(vocab_size)
        self.layout, self.start, self.num_rows = layout, rows.start, len(rows)
        self.weight = self.create_parameter([self.num_rows, hidden_size])

    def forward(self, ids: paddle.Tensor) -> paddle.Tensor:
        local = ids - self.start
        inside = (local >= 0) & (local < self.num_rows)
        out = F.embedding(paddle.where(inside, local, paddle.zeros_like(local)), self.weight)
        return self.layout.all_reduce(out * inside.unsqueeze(-1).astype(out.dtype))


class Attention(nn.Layer):
    """GQA over the paged cache. On a tensor-parallel rank: its query heads and the KV heads they read;
    o_proj's output is then this rank's partial sum."""

    def __init__(self, cfg: ErnieModelConfig, layer_idx: int, layers: LayerBuilder = FLOAT_LAYERS,
                 layout: ParallelLayout = SINGLE_RANK):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads = len(layout.query_heads(cfg)), len(layout.kv_heads(cfg))
        self.head_dim = cfg.head_dim
        self.scale = cfg.head_dim ** -0.5
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = layers.linear(cfg.hidden_size, q_size + 2 * kv_size, layer_idx)  # [Q | K | V] out
        self.o_proj = layers.linear(q_size, cfg.hidden_size, layer_idx)

    def forward(self, x, positions, rope: RotaryEmbedding, meta: AttentionMetadata, cache):
        q, k, v = rope.split_rotate(self.qkv_proj(x), positions, meta.max_position, self.num_heads, self.num_kv_heads)
        out = paged_attention(q, k, v, self.layer_idx, meta, cache, self.scale)
        return self.o_proj(out)


class DecoderLayer(nn.Layer):
    def __init__(self, cfg: ErnieModelConfig, layer_idx: int, layers: LayerBuilder = FLOAT_LAYERS,
                 moe: bool | None = None, layout: ParallelLayout = SINGLE_RANK):
        """`layer_idx` is also the layer's KV cache layer; `moe` None: as the config's MoE layer rule says."""
        super().__init__()
        self.layout = layout
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_idx, layers, layout)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.is_moe_layer(layer_idx) if moe is None else moe:
            self.mlp = MoE(cfg, layers, layer_idx, layout)
        else:
            self.mlp = MLP(cfg.hidden_size, len(layout.split(cfg.intermediate_size)), layers, layer_idx)

    def forward(self, x, positions, rope, meta, cache):
        # Under tensor parallelism both sublayers end in a row-parallel projection: their outputs are
        # partial sums, added up across ranks here (the identity on one rank).
        h = x + self.layout.all_reduce(self.self_attn(self.input_layernorm(x), positions, rope, meta, cache))
        return h + self.layout.all_reduce(self.mlp(self.post_attention_layernorm(h)))


class ErnieForCausalLM(nn.Layer):
    def __init__(self, cfg: ErnieModelConfig, num_output_ids: int | None = None,
                 layers: LayerBuilder = FLOAT_LAYERS, layout: ParallelLayout = SINGLE_RANK):
        """`num_output_ids`: the tokenizer's length; logits of ids beyond it are masked to -inf.
        `layers`: what makes the dense linears and routed experts (model/layer_builder.py: float, or the loader's
        QuantizedLayers for a quant plan). `layout`: which tensor-parallel shard to build."""
        super().__init__()
        layout.check(cfg)
        self.config = cfg
        self.layout = layout
        self.kv_cache_quant: KVCacheQuant | None = None  # set by the loader when the C8 cache is configured
        self.num_output_ids = num_output_ids if num_output_ids is not None else cfg.vocab_size
        self.embed_tokens = (VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, layout) if layout.is_parallel
                             else nn.Embedding(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.LayerList([DecoderLayer(cfg, i, layers, layout=layout) for i in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        vocab_part = len(layout.split(cfg.vocab_size))
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, vocab_part)
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.max_position_embeddings, cfg.compression_ratio)
        self.cpu_layers: CpuDecoderStack | None = None  # set by process_weights_after_loading where it applies

    def forward(self, input_ids: paddle.Tensor | np.ndarray, positions: paddle.Tensor | np.ndarray,
                meta: AttentionMetadata, cache: PagedKVCache | None) -> paddle.Tensor:
        """Final-normed hidden states [T, H] of the step's tokens (MTP drafts from these too). Ids and positions as
        Paddle tensors, or as the step's NumPy arrays, turned into tensors only where a Paddle op reads them."""
        if self.cpu_layers is not None and self.cpu_layers.serves(meta, cache):
            # the embedding, the same layers and the final norm in one C call (model/cpu_layers.py)
            return self.cpu_layers(self.embed_tokens, input_ids, positions, meta, cache, final_norm=self.norm)
        input_ids, positions = (a if isinstance(a, paddle.Tensor) else to_paddle(a) for a in (input_ids, positions))
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x, positions, self.rope, meta, cache)
        return self.norm(x)

    def process_weights_after_loading(self, weight_bits: int = 32) -> None:
        """Serving layouts for weights a kernel reads faster in another layout (vLLM's hook of this name): on CPU,
        every float Linear (lm_head included) and the float routed experts column-blocked for cpu_gemm.c
        (layers.BlockedLinear, moe.BlockedExperts) in float32, or in bfloat16 with weight_bits 16 (--dtype
        bfloat16: half the bytes a step streams), and a tied embedding as a blocked head whose columns the
        lookups read (layers.TiedEmbedding). The router, norms and an untied embedding stay float32. Called once
        by the engine's ModelShard; a model loaded to be trained, calibrated or exported keeps the loaded layout."""
        if (self.lm_head is None and type(self.embed_tokens) is nn.Embedding
                and cpu_gemm.serves(self.embed_tokens.weight)):
            self.lm_head = BlockedLinear.from_weight(np.from_dlpack(self.embed_tokens.weight.detach()).T, weight_bits)
            self.embed_tokens = TiedEmbedding(self.lm_head)  # the [V, H] parameter is freed with the old layer
        elif weight_bits != 32 and not cpu_gemm.available():
            raise RuntimeError("bfloat16 weights on the CPU need the C kernels (cpu_kernels/), which are not built "
                               "here (see the warning above for why); use dtype 'float32'")
        for parent in self.sublayers(include_self=True):
            for name, child in list(parent.named_children()):
                if type(child) in (Linear, FusedExperts):  # exactly: quantized layers have their own
                    served = child.serving_layout(weight_bits)
                    if served is not None:
                        setattr(parent, name, served)  # the loaded parameters are freed with the old layer
        self.cpu_layers = CpuDecoderStack.build(self)

    def compute_argmax(self, hidden: paddle.Tensor) -> tuple[np.ndarray, np.ndarray] | None:
        """Each row's argmax and largest logit without the logits (cpu_gemm.gemm_argmax), where the head is a float32
        BlockedLinear (float32 or bfloat16) this process holds whole; None elsewhere (the caller takes
        compute_logits)."""
        head = self.lm_head
        if type(head) is not BlockedLinear or self.layout.is_parallel:
            return None
        return head.argmax(hidden, min(self.num_output_ids, head.out_features))

    def compute_logits(self, hidden: paddle.Tensor) -> paddle.Tensor:
        """Logits over the whole vocabulary (a tensor-parallel rank computes its columns, then all-gathers)."""
        if self.lm_head is None:
            logits = paddle.matmul(hidden.astype("float32"), self.embed_tokens.weight.astype("float32"),
                                   transpose_y=True)
        else:
            logits = self.lm_head(hidden).astype("float32")
        logits = self.layout.all_gather_columns(logits)
        if self.num_output_ids < logits.shape[-1]:
            logits[:, self.num_output_ids:] = float("-inf")
        return logits
