"""The CPU serving path's decoder layers in one C call a step (cpu_kernels/cpu_layer.c).

Why: the per-layer Python around the C kernels (about 60 small-op calls a decode step, each a ctypes call and a
new Paddle tensor, the layers' dispatch, residual adds, the KV write and the experts' dispatch in NumPy) cost
about a quarter of a decode step at 16 running on the benchmark checkpoint (`.venv/bin/python
scripts/bench_decode_step.py` splits a step with and without this stack); the kernels' own arithmetic outside
the matmuls is a small fraction of that. cpu_layer.c calls the same kernels in the same order, so its hidden
states equal the Python layers' bit for bit (tests/cpu_kernels/test_cpu_layers.py holds it to that).

CpuDecoderStack.build describes the layers once, after the serving layouts exist
(ErnieForCausalLM.process_weights_after_loading), and only when every layer is covered: one rank (no collectives
between sublayers), float32 / bfloat16 serving-layout or wint8 / wint4 / w4a8 linears and experts. `serves` then
says per step whether this step is one it covers too: inference on a float32 / bfloat16 CPU cache whose every sequence
cpu_attention.c takes (decodes and short prefill chunks). Everything else runs the Python layers, unchanged.
"""
from __future__ import annotations

import ctypes
import logging

import numpy as np
import paddle

from ..cpu_kernels import build, cpu_attention, cpu_gemm, cpu_layer
from ..host_tensor import empty_host, to_paddle
from .attention import native_seq_count
from .attention_metadata import AttentionMetadata
from .kv_cache import PagedKVCache
from .layers import MLP, BlockedLinear, RMSNorm, TiedEmbedding
from .moe import MoE, BlockedExperts

log = logging.getLogger(__name__)
_INT_FORMATS = {"wint8": 8, "wint4": 4, "w4a8": 4}  # quantized formats cpu_layer.c runs (cpu_qgemm.c's codes)


class CpuDecoderStack:
    def __init__(self, dims: cpu_layer.Dims, layers: ctypes.Array, keep: list, rope):
        self._dims, self._layers, self._keep, self._rope = dims, layers, keep, rope
        self._work = np.empty(0, np.float32)  # grown to the largest step's need, kept: see cpu_layer.c

    @classmethod
    def build(cls, model) -> "CpuDecoderStack | None":
        """The model's layers described for cpu_layer.c, or None (with the reason logged) if one is not covered."""
        if not build.available() or model.layout.is_parallel:
            return None
        cfg, keep, descs = model.config, [], []
        first = model.layers[0].self_attn
        dims = cpu_layer.Dims(cfg.hidden_size, first.num_heads, first.num_kv_heads, first.head_dim,
                              model.layers[0].input_layernorm.eps, first.scale)
        for i, layer in enumerate(model.layers):
            try:
                if layer.self_attn.layer_idx != i:
                    raise _NotCovered(f"reads KV cache layer {layer.self_attn.layer_idx}")
                descs.append(_layer(layer, dims, keep))
            except _NotCovered as e:
                log.info("decoder layers run one op at a time: layer %d %s", i, e)
                return None
        return cls(dims, (cpu_layer.Layer * len(descs))(*descs), keep, model.rope)

    def serves(self, meta: AttentionMetadata, cache: PagedKVCache | None) -> bool:
        """Whether this step's layers can run here (else the Python layers run it): inference on a float cache whose
        every sequence cpu_attention.c takes."""
        n = native_seq_count(meta, cache)
        return (meta.slot_mapping is not None and meta.block_tables is not None
                and 0 < n == len(meta.seq_lens) and len(cache.k) >= len(self._layers))

    def __call__(self, embedding: paddle.nn.Layer, input_ids: np.ndarray | paddle.Tensor,
                 positions: np.ndarray | paddle.Tensor, meta: AttentionMetadata, cache: PagedKVCache,
                 final_norm: RMSNorm | None = None) -> paddle.Tensor:
        """The hidden states after every layer, [T, H] (a new tensor), of `embedding`'s rows for input_ids, then
        `final_norm`'s (layers.RMSNorm: the same C kernel its forward calls) applied in place. Ids and positions as
        the step holds them (NumPy) or as Paddle tensors. Why the embedding and the norm are done here: each Paddle
        op around the C call (a tensor from the ids, the embedding's output, the norm's call) cost 0.2-0.8 ms of a
        ~25-40 ms decode step, run right after the step's weights have streamed through the caches."""
        d = self._dims
        ids = _host_int64(input_ids)
        pos = _host_int64(positions)
        t = ids.shape[0]
        y, out = empty_host((t, d.hidden), np.float32)
        _embed(embedding, ids, out)
        cos, sin = self._rope.tables(meta.max_position)
        slots = np.ascontiguousarray(meta.slot_mapping, dtype=np.int64)
        tables = np.ascontiguousarray(meta.block_tables, dtype=np.int64)
        qsl = np.ascontiguousarray(meta.query_start_loc, dtype=np.int64)
        lens = np.ascontiguousarray(meta.seq_lens, dtype=np.int64)
        # the shapes here; every index's range in C (cpu_layer.c's step_in_range), before it reads through one
        if (ids.shape != (t,) or pos.shape != (t,) or slots.shape != (t,) or qsl.shape != (lens.shape[0] + 1,)
                or tables.ndim != 2 or tables.shape[0] < lens.shape[0] or cache.block_size != meta.block_size
                or cache.num_kv_heads != d.num_kv_heads or cache.head_dim != d.head_dim or cache.quant is not None
                or cache.k[0].dtype not in cpu_attention.FLOAT_CACHES):
            raise ValueError(f"cpu_layers: a step of {t} tokens (positions {pos.shape}, slots {slots.shape}, tables "
                             f"{list(tables.shape)}, {lens.shape[0]} sequences) does not fit this model or its cache")
        for desc, k, v in zip(self._layers, cache.k, cache.v):
            desc.k_cache, desc.v_cache = k.ctypes.data, v.ctypes.data
        d.kv_bf16 = int(cache.code_dtype.name == "bfloat16")
        step = cpu_layer.Step(t, lens.shape[0], cache.block_size, tables.shape[1], pos.ctypes.data, slots.ctypes.data,
                              tables.ctypes.data, qsl.ctypes.data, lens.ctypes.data, cos.data_ptr(), sin.data_ptr(),
                              cos.shape[0], cache.num_blocks)
        self._work = cpu_layer.decoder_layers(d, self._layers, step, out, self._work)
        if final_norm is not None:
            build.library().ernie_rms_norm(out.ctypes.data, final_norm.weight.data_ptr(), t, d.hidden,
                                           final_norm.eps, out.ctypes.data)
        return y


def _host_int64(a: np.ndarray | paddle.Tensor) -> np.ndarray:
    return np.ascontiguousarray(a.numpy() if isinstance(a, paddle.Tensor) else a, dtype=np.int64)


def _embed(embedding: paddle.nn.Layer, ids: np.ndarray, out: np.ndarray) -> None:
    """out[i] = embedding row ids[i]: a tied embedding's rows straight from the head's NumPy view, else (an untied
    nn.Embedding) through its forward."""
    if type(embedding) is TiedEmbedding:
        embedding.lookup(ids, out)
    else:
        out[...] = np.from_dlpack(embedding(to_paddle(ids)))


class _NotCovered(Exception):
    """A layer cpu_layer.c does not run; the message says which part."""


def _ptr(t: paddle.Tensor, keep: list, shape: tuple[int, ...] | None = None) -> int:
    """A float32 / uint8 tensor's address, checked contiguous and (if given) of `shape`; kept alive in `keep`."""
    a = np.from_dlpack(t.detach() if hasattr(t, "detach") else t)
    if not a.flags.c_contiguous or (shape is not None and a.size != int(np.prod(shape))):
        raise _NotCovered(f"has a tensor of shape {list(a.shape)} where {shape} was expected")
    keep.append(t)
    return a.ctypes.data


def _linear(lin, k: int, n: int, keep: list) -> cpu_layer.Linear:
    if type(lin) is BlockedLinear and (lin.in_features, lin.out_features) == (k, n):
        return cpu_layer.Linear(_ptr(lin.weight_blocked, keep), None, k, n, lin.bits)
    method = getattr(lin, "method", None)
    bits = _INT_FORMATS.get(method)
    if bits and (lin.in_features, lin.out_features) == (k, n) and "quant_weight" in lin.tensors:
        w, s = lin.tensors["quant_weight"], lin.tensors["weight_scale"]
        if cpu_gemm.fits_layout(w.shape, k, n, bits) and s.dtype == paddle.float32:
            act = lin.act_scale if method == "w4a8" else 0.0  # w4a8: int8 activations at a static scale
            return cpu_layer.Linear(_ptr(w, keep), _ptr(s, keep, (n,)), k, n, bits, act)
    raise _NotCovered(f"has a {type(lin).__name__} ({getattr(lin, 'method', 'float')}) of [{k}, {n}]")


def _norm(norm, dims: cpu_layer.Dims, keep: list) -> int:
    if type(norm) is not RMSNorm or np.float32(norm.eps) != np.float32(dims.eps):
        raise _NotCovered("has a norm other than the first layer's RMSNorm")
    return _ptr(norm.weight, keep, (dims.hidden,))


def _experts(moe: MoE, h: int, keep: list) -> cpu_layer.Experts:
    ex, gate = moe.experts, moe.gate
    if moe.expert_offset is not None:
        raise _NotCovered("holds a slice of the experts (expert parallelism)")
    e = ex.num_experts
    acts = None
    if type(ex) is BlockedExperts and ex.down_cols == h:
        bits, ug_cols = ex.bits, ex.up_gate_cols
        ug, dn, ug_s, dn_s = ex._up_gate, ex._down, None, None
    elif getattr(ex, "method", None) in _INT_FORMATS:
        bits, ug_cols = _INT_FORMATS[ex.method], ex.up_gate_proj[0].out_features
        ugl = [_linear(q, h, ug_cols, keep) for q in ex.up_gate_proj]
        dnl = [_linear(q, ug_cols // 2, h, keep) for q in ex.down_proj]
        ug, dn = [lin.w for lin in ugl], [lin.w for lin in dnl]
        ug_s, dn_s = [lin.scale for lin in ugl], [lin.scale for lin in dnl]
        if ex.method == "w4a8":  # each expert's static activation scales, as QuantMoEExperts applies them
            acts = [np.asarray([lin.act_scale for lin in ls], np.float32) for ls in (ugl, dnl)]
            keep.extend(acts)
    else:
        raise _NotCovered(f"has {type(ex).__name__} experts ({getattr(ex, 'method', 'float')})")

    def ptrs(items):
        if items is None:
            return None
        arr = (ctypes.c_void_p * e)(*[i if isinstance(i, int) else _ptr(i, keep) for i in items])
        keep.append(arr)
        return ctypes.cast(arr, ctypes.c_void_p).value
    ug_act, dn_act = (a.ctypes.data for a in acts) if acts else (None, None)
    desc = cpu_layer.Experts(ptrs(ug), ptrs(dn), ptrs(ug_s), ptrs(dn_s), ug_act, dn_act, _ptr(gate.weight, keep, (h, e)),
                             _ptr(gate.e_score_correction_bias, keep, (e,)), e, gate.top_k, ug_cols, bits,
                             gate.norm_min)
    keep.append(desc)
    return desc


def _layer(layer, dims: cpu_layer.Dims, keep: list) -> cpu_layer.Layer:
    attn, h = layer.self_attn, dims.hidden
    if (attn.num_heads, attn.num_kv_heads, attn.head_dim) != (dims.num_heads, dims.num_kv_heads, dims.head_dim):
        raise _NotCovered("has attention of another shape than the first layer's")
    q, kv = dims.num_heads * dims.head_dim, dims.num_kv_heads * dims.head_dim
    desc = cpu_layer.Layer(_norm(layer.input_layernorm, dims, keep), _norm(layer.post_attention_layernorm, dims, keep),
                           _linear(attn.qkv_proj, h, q + 2 * kv, keep), _linear(attn.o_proj, q, h, keep))
    mlp = layer.mlp
    dense = mlp if type(mlp) is MLP else mlp.shared_experts if type(mlp) is MoE else None
    if type(mlp) is MoE:
        desc.experts = ctypes.pointer(_experts(mlp, h, keep))
    elif dense is None:
        raise _NotCovered(f"has a {type(mlp).__name__} MLP")
    if dense is not None:
        inter = dense.intermediate_size
        desc.mlp_up_gate = _linear(dense.up_gate_proj, h, 2 * inter, keep)
        desc.mlp_down = _linear(dense.down_proj, inter, h, keep)
    return desc
