"""ERNIE-4.5 (dense and MoE) forward through the triton-lang kernels: the kernels execution backend's model.

The same math as model/ernie.py (the reference backend, which is this path's oracle), laid out for a GPU:
RMSNorm fused with the residual add, one qkv GEMM whose query and key heads RoPE rotates in place, the
step's new K/V written into the paged cache from the slot mapping, one unified paged-attention launch for
the whole mixed step, the router's top-k with the correction bias on the device, and the routed experts as
one fused grouped GEMM pair (any weight format). Dense layers are the framework's matmul for float weights
and the quantized GEMM kernel otherwise. Nothing here syncs with the host, so a decode step can be a CUDA
graph (kernels_backend/cuda_graphs.py).

On a tensor-parallel rank (model/parallel.py's layout) the model holds its query heads and the KV heads they read,
its slice of every intermediate dimension (or, with expert parallelism, its whole experts) and its rows of the
vocabulary; three collectives (collectives.py) restore the whole: an all-reduce after the embedding, after
attention and after the MLP / MoE block, and an all-gather of the logits' vocabulary columns.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..model.config import ErnieModelConfig
from ..model.parallel import SINGLE_RANK, ParallelLayout
from .collectives import Collectives
from .framework import TensorOps
from .kv_cache import DeviceKVCache
from .weights import DeviceLayer, DeviceLinear, DeviceWeights


@dataclass
class StepTensors:
    """One step's index data on the device (views of persistent buffers, so a graph can replay on them)."""

    token_ids: Any  # [T] int64
    positions: Any  # [T] int64
    slot_mapping: Any  # [T] int64; negative: not written (padding)
    query_start_loc: Any  # [B+1] int32
    seq_lens: Any  # [B] int32
    block_tables: Any  # [B, max_blocks] int32
    prog_seq: Any  # [P] int32: ernie_kernels.unified_attention.attention_programs
    prog_q: Any  # [P] int32
    block_q: int
    logit_rows: Any  # [R] int64: rows whose logits are computed
    kv_runs: Any = None  # [R, 4] int32 block runs: only for a C8 cache with dynamic scales
    kv_splits: int = 1  # split-KV attention: runs each program's keys are cut into


class KernelModel:
    def __init__(self, cfg: ErnieModelConfig, weights: DeviceWeights, ops: TensorOps, num_output_ids: int,
                 max_positions: int, layout: ParallelLayout = SINGLE_RANK, collectives: Collectives | None = None):
        from ernie_kernels.rope import rope_tables

        self.config = cfg
        self.weights = weights
        self.ops = ops
        self.num_output_ids = num_output_ids
        self.layout = layout
        self.comm = collectives or Collectives(ops)
        self.num_heads, self.num_kv_heads = len(layout.query_heads(cfg)), len(layout.kv_heads(cfg))
        self.head_dim = cfg.head_dim
        self.expert_start = layout.experts(cfg).start if cfg.is_moe else 0
        self.scale = cfg.head_dim ** -0.5
        cos, sin = rope_tables(cfg.head_dim, cfg.rope_theta, max_positions, cfg.compression_ratio)
        self.cos, self.sin = ops.tensor(cos), ops.tensor(sin)

    def forward(self, step: StepTensors, cache: DeviceKVCache) -> Any:
        """Final-normed hidden states [T, H] of the step's tokens; their K/V land in the cache."""
        from ernie_kernels import rms_norm

        x, residual = self.embed(step.token_ids), None
        for i, layer in enumerate(self.weights.layers):
            x, residual = self._layer(i, layer, x, residual, step, cache)
        out, _ = rms_norm(x, self.weights.norm, self.config.rms_norm_eps, residual=residual)
        return out

    def embed(self, token_ids: Any) -> Any:
        """[T, H] embeddings (a rank's vocabulary rows, then the all-reduce, under tensor parallelism)."""
        w = self.weights
        if not self.layout.is_parallel:
            return self.ops.rows(w.embed, token_ids)
        return self.comm.all_reduce_(self.ops.vocab_rows(w.embed, token_ids, w.vocab_start))

    def mtp_forward(self, step: StepTensors, hidden: Any, cache: DeviceKVCache) -> Any:
        """The MTP head (model/mtp.py): step.token_ids are x_{t+1}, hidden [T, H] the target's h_t at step.positions
        t; returns the head's final-normed hidden states [T, H]. Its K/V go to the cache layer after the target's."""
        from ernie_kernels import rms_norm

        m, eps = self.weights.mtp, self.config.rms_norm_eps
        e = rms_norm(self.embed(step.token_ids), m.emb_norm, eps)
        z = self.ops.add_(self.linear(e, m.embed_proj), self.linear(rms_norm(hidden, m.hidden_norm, eps), m.hidden_proj))
        x, residual = self._layer(self.config.num_hidden_layers, m.block, z, None, step, cache)
        out, _ = rms_norm(x, self.weights.norm, eps, residual=residual)
        return out

    def _layer(self, i: int, layer: DeviceLayer, x: Any, residual: Any, step: StepTensors,
               cache: DeviceKVCache) -> tuple[Any, Any]:
        """One decoder layer over cache layer i: (its output, the residual stream before that output is added:
        rms_norm adds it inside the next norm, returning (norm(x + residual), x + residual))."""
        from ernie_kernels import rms_norm

        eps = self.config.rms_norm_eps
        if residual is None:
            h, residual = rms_norm(x, layer.input_norm, eps), x
        else:
            h, residual = rms_norm(x, layer.input_norm, eps, residual=residual)
        x = self.comm.all_reduce_(self._attention(i, layer, h, step, cache))
        h, residual = rms_norm(x, layer.post_norm, eps, residual=residual)
        return self.comm.all_reduce_(self._mlp(layer, h)), residual

    def compute_logits(self, hidden_rows: Any) -> Any:
        """fp32 logits [R, vocab] of the given hidden rows; ids beyond the tokenizer are -inf. Under tensor
        parallelism a collective: each rank's vocabulary columns, gathered (every rank gets the whole)."""
        w = self.weights
        if w.lm_head is None:
            logits = self.ops.matmul_nt(hidden_rows, w.embed)
        else:
            logits = self.ops.matmul(hidden_rows, w.lm_head)
        logits = self.ops.cast(self.comm.all_gather_columns(logits), "float32")
        if self.num_output_ids < logits.shape[-1]:
            logits[:, self.num_output_ids:] = float("-inf")
        return logits

    # ---------------------------------------------------------------- blocks
    def linear(self, x: Any, lin: DeviceLinear) -> Any:
        if lin.method is None:
            return self.ops.matmul(x, lin.weight)
        from ernie_kernels import weight_only_linear

        return weight_only_linear(x, lin.weight, lin.scale, lin.method)

    def _attention(self, i: int, layer: DeviceLayer, h: Any, step: StepTensors, cache: DeviceKVCache) -> Any:
        # by module: the package's lazy names kv_write / unified_attention are shadowed once those submodules load
        from ernie_kernels.kv_write import kv_write
        from ernie_kernels.rope import rope_inplace
        from ernie_kernels.unified_attention import unified_attention

        ops, nh, nkv, hd = self.ops, self.num_heads, self.num_kv_heads, self.head_dim
        t = int(h.shape[0])
        qkv = self.linear(h, layer.qkv)  # [T, (nh + 2 nkv) hd]: [Q | K | V]
        rope_inplace(qkv, step.positions, self.cos, self.sin, nh + nkv, hd)
        q = ops.heads(qkv, 0, nh, hd)
        k = ops.heads(qkv, nh * hd, nkv, hd)
        v = ops.heads(qkv, (nh + nkv) * hd, nkv, hd)
        ks, vs = cache.scales(i)
        kv_write(k, v, cache.k[i], cache.v[i], step.slot_mapping, ks, vs, runs=step.kv_runs)
        out = ops.empty([t, nh, hd], ops.act_dtype)
        unified_attention(q, cache.k[i], cache.v[i], out, step.block_tables, step.seq_lens, step.query_start_loc,
                          step.prog_seq, step.prog_q, step.block_q, self.scale, ks, vs, num_splits=step.kv_splits)
        return self.linear(out.reshape([t, nh * hd]), layer.o)

    def _mlp(self, layer: DeviceLayer, h: Any) -> Any:
        from ernie_kernels import fused_moe, router_logits, router_topk, silu_and_mul

        shared = None
        if layer.mlp_up_gate is not None:
            shared = self.linear(silu_and_mul(self.linear(h, layer.mlp_up_gate)), layer.mlp_down)
        if not layer.is_moe:
            return shared
        cfg, e = self.config, layer.experts
        logits = router_logits(h, layer.gate)  # IEEE fp32 on both frameworks: never TF32
        ids, weights = router_topk(logits, layer.gate_bias, cfg.moe_k, cfg.moe_norm_min)
        out = fused_moe(h, e.up_gate, e.down, ids, weights, e.method, e.up_gate_scale, e.down_scale,
                        e.up_gate_act_scale, e.down_act_scale, expert_start=self.expert_start)
        return out if shared is None else self.ops.add_(out, shared)

