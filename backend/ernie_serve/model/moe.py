"""ERNIE-4.5 mixture of experts: fp32 router with bias-corrected top-k, grouped expert compute.

The correction bias only chooses experts; the weights are the unbiased softmax probabilities of
the chosen experts renormalized to sum to one. Shared experts are an ungated dense MLP added on top.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import numpy as np
import paddle
import paddle.nn.functional as F
from paddle import nn

from ..cpu_kernels import cpu_gemm, cpu_ops
from ..host_tensor import empty_weight, to_paddle
from .config import ErnieModelConfig
from .layers import MLP, silu_and_mul
from .parallel import SINGLE_RANK, ParallelLayout

if TYPE_CHECKING:
    from .layer_builder import LayerBuilder


class TopKRouter(nn.Layer):
    def __init__(self, hidden_size: int, num_experts: int, top_k: int, norm_min: float):
        super().__init__()
        self.top_k, self.norm_min = top_k, norm_min
        self.weight = self.create_parameter([hidden_size, num_experts], dtype="float32")  # [H, E]
        self.e_score_correction_bias = self.create_parameter(
            [1, num_experts], dtype="float32", default_initializer=nn.initializer.Constant(0.0))

    def forward(self, x: paddle.Tensor) -> tuple[paddle.Tensor, paddle.Tensor]:
        if cpu_ops.serves(x):
            return cpu_ops.route(x, self.weight, self.e_score_correction_bias, self.top_k, self.norm_min)
        probs = F.softmax(paddle.matmul(x.astype("float32"), self.weight), axis=-1)
        _, ids = paddle.topk(probs + self.e_score_correction_bias, self.top_k, axis=-1)
        weights = paddle.take_along_axis(probs, ids, axis=-1)
        weights = weights / paddle.clip(weights.sum(axis=-1, keepdim=True), min=self.norm_min)
        return ids, weights


class FusedExperts(nn.Layer):
    """All routed experts in fp32, stacked: up_gate [E, H, 2I] (gate half first), down [E, I, H].

    Parameters, so autograd trains through it (demo/fit.py); the quantized twin is
    ernie_serve.model.quantized_layers.QuantMoEExperts, and both run grouped_expert_forward.
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.num_experts = num_experts
        self.up_gate_proj = self.create_parameter([num_experts, hidden_size, 2 * intermediate_size])
        self.down_proj = self.create_parameter([num_experts, intermediate_size, hidden_size])

    @classmethod
    def from_weights(cls, up_gate: np.ndarray, down: np.ndarray) -> "FusedExperts":
        e, h, i2 = up_gate.shape
        experts = cls(e, h, i2 // 2)
        experts.up_gate_proj.set_value(np.asarray(up_gate, np.float32))
        experts.down_proj.set_value(np.asarray(down, np.float32))
        return experts

    @property
    def nbytes(self) -> int:
        return 4 * (int(np.prod(self.up_gate_proj.shape)) + int(np.prod(self.down_proj.shape)))

    def expert_forward(self, e: int, x: paddle.Tensor) -> paddle.Tensor:
        return paddle.matmul(silu_and_mul(paddle.matmul(x, self.up_gate_proj[e])), self.down_proj[e])

    def can_batch(self, counts: np.ndarray) -> bool:
        return _use_batched(counts)

    def serving_layout(self, bits: int = 32) -> "BlockedExperts | None":
        """The same experts column-blocked for cpu_gemm.c in float32 (bits 32) or bfloat16 (16), or None where that
        kernel is not built / not on CPU."""
        if not cpu_gemm.serves(self.up_gate_proj):
            return None

        def blocked(param: paddle.Tensor) -> paddle.Tensor:
            e, k, n = param.shape
            t, view = empty_weight((e, *cpu_gemm.blocked_shape((k, n))), cpu_gemm.FLOAT_BITS[bits])
            for i, w in enumerate(np.from_dlpack(param.detach())):  # one expert at a time, written in place
                cpu_gemm.pack_columns(w, out=view[i])
            return t
        return BlockedExperts(blocked(self.up_gate_proj), blocked(self.down_proj), self.up_gate_proj.shape[2],
                              self.down_proj.shape[2])

    def batched_forward(self, xs: paddle.Tensor, counts: np.ndarray) -> paddle.Tensor:
        """Every expert on its own rows: xs [E, n, H] -> [E, n, H] (padding rows are zeros in, garbage out)."""
        return paddle.bmm(silu_and_mul(paddle.bmm(xs, self.up_gate_proj)), self.down_proj)

    def forward(self, x: paddle.Tensor, topk_ids: paddle.Tensor, topk_weights: paddle.Tensor,
                expert_offset: int | None = None) -> paddle.Tensor:
        return grouped_expert_forward(self, x, topk_ids, topk_weights, expert_offset)


class BlockedExperts(nn.Layer):
    """The float routed experts in their serving layout: each matrix column-blocked ([N/32, K, 32], the layout
    cpu_gemm.c streams) in float32, or bfloat16 held as its bits (--dtype bfloat16), built from a loaded FusedExperts
    by ErnieForCausalLM.process_weights_after_loading.

    Why: at decode each expert multiplies a few rows, so the step streams the experts' weights, and Paddle's
    matmul over [K, N] streams them at a fraction of the rate cpu_gemm.c reads column blocks; at prefill sizes
    the C kernel still beats MKL (BlockedLinear).
    Every expert runs in one call per matrix at any row count, its rows packed after the previous expert's
    (packed_forward; a step of 15 decodes and a 180-token chunk ran ~50 rows an expert in 32 small calls a layer
    before). Inference only."""

    def __init__(self, up_gate: paddle.Tensor, down: paddle.Tensor, up_gate_cols: int, down_cols: int):
        """`up_gate` [E, ceil(2I/32), H, 32], `down` [E, ceil(H/32), I, 32] float32 or bfloat16 bits (int16;
        cpu_gemm.pack_columns)."""
        super().__init__()
        self.num_experts = up_gate.shape[0]
        self.bits = cpu_gemm.held_bits(up_gate)
        self.up_gate_cols, self.down_cols = up_gate_cols, down_cols
        self.register_buffer("up_gate_blocked", up_gate)
        self.register_buffer("down_blocked", down)
        # each expert's matrices as views, made once: slicing them per call was a visible share of a decode step
        self._up_gate = [up_gate[e] for e in range(self.num_experts)]
        self._down = [down[e] for e in range(self.num_experts)]

    @property
    def nbytes(self) -> int:
        return self.bits // 8 * (int(np.prod(self.up_gate_blocked.shape)) + int(np.prod(self.down_blocked.shape)))

    def can_batch(self, counts: np.ndarray) -> bool:
        return True

    def batched_forward(self, xs: paddle.Tensor, counts: np.ndarray) -> paddle.Tensor:
        """xs padded [E, cap, H] or packed [sum(counts), H] (each expert's rows after the previous expert's)."""
        x = np.from_dlpack(xs)
        if cpu_gemm.swiglu_fits(self.up_gate_cols):  # SwiGLU fused into the gate-up matmul
            h = cpu_gemm.moe_gemm(x, counts, self._up_gate, self.up_gate_cols, None, self.bits, swiglu=True)
        else:
            h = silu_and_mul(cpu_gemm.moe_gemm(x, counts, self._up_gate, self.up_gate_cols, None, self.bits))
        return cpu_gemm.moe_gemm(np.from_dlpack(h), counts, self._down, self.down_cols, None, self.bits)

    packed_forward = batched_forward  # grouped_expert_forward's packed layout: no padding at any row count

    def forward(self, x: paddle.Tensor, topk_ids: paddle.Tensor, topk_weights: paddle.Tensor,
                expert_offset: int | None = None) -> paddle.Tensor:
        return grouped_expert_forward(self, x, topk_ids, topk_weights, expert_offset)


class Experts(Protocol):
    """What grouped_expert_forward runs: FusedExperts, BlockedExperts, quantized_layers.QuantMoEExperts. An
    implementation may add `packed_forward(xs, counts)` (rows packed, unpadded); `expert_forward` is called only
    when `can_batch` says no."""

    num_experts: int

    def can_batch(self, counts: np.ndarray) -> bool: ...

    def batched_forward(self, xs: paddle.Tensor, counts: np.ndarray) -> paddle.Tensor: ...

    def expert_forward(self, e: int, x: paddle.Tensor) -> paddle.Tensor: ...


def grouped_expert_forward(experts: Experts, x: paddle.Tensor, topk_ids: paddle.Tensor, topk_weights: paddle.Tensor,
                           expert_offset: int | None = None) -> paddle.Tensor:
    """sum_j w[t, j] * Expert_{ids[t, j]}(x[t]) for every expert implementation (float or quantized):
    `experts.expert_forward(e, x_e)` (one expert), `batched_forward` (all, padded) or `packed_forward` (all, packed
    rows, when can_batch: the fp32 serving layout, and quantized experts on the CPU kernels) is all that differs.
    `expert_offset` (expert parallelism): these are experts [offset, offset + num_experts) of the model; choices of
    other ranks' experts are skipped.

    Tokens are sorted by expert once, then each active expert runs once over its tokens; results are
    weighted and scattered back with index_add (in inference on the CPU: one cpu_ops.c gather in and one weighted
    combine out). There is no per-token loop, and gradients flow.
    Experts run all at once instead (`batched_forward` over a padded [E, cap, H] batch) when their
    `can_batch(counts)` says so: float experts when few tokens spread over most experts (`_use_batched`),
    quantized ones at every size (one cpu_qgemm.c call per matrix).
    """
    t, k = topk_ids.shape
    flat_ids = topk_ids.reshape([-1]).numpy()
    if expert_offset is None:
        counts = np.bincount(flat_ids, minlength=experts.num_experts)
        if counts.shape[0] > experts.num_experts:
            raise ValueError(f"topk_ids hold expert id {int(flat_ids.max())} >= num_experts={experts.num_experts}")
        order = np.argsort(flat_ids, kind="stable")
    else:
        flat_ids = flat_ids - expert_offset
        mine = np.flatnonzero((flat_ids >= 0) & (flat_ids < experts.num_experts))
        if not mine.size:
            return paddle.zeros_like(x)
        counts = np.bincount(flat_ids[mine], minlength=experts.num_experts)
        order = mine[np.argsort(flat_ids[mine], kind="stable")]
    if cpu_ops.serves(x):
        return _grouped_on_cpu_kernels(experts, x, flat_ids, order, counts, k, topk_weights)
    token_of = to_paddle(order // k)
    w = paddle.index_select(topk_weights.reshape([-1]), to_paddle(order)).astype(x.dtype)
    if experts.can_batch(counts):
        rows, sources = _padded_layout(flat_ids, order, counts, k)
        ys = paddle.index_select(_batched(experts, x, sources, counts), to_paddle(rows))
    else:
        ys = _per_expert(experts, paddle.index_select(x, token_of), counts)
    return paddle.index_add(paddle.zeros_like(x), token_of, 0, ys * w.unsqueeze(-1))


def _grouped_on_cpu_kernels(experts: Experts, x, flat_ids, order, counts, k, topk_weights) -> paddle.Tensor:
    """grouped_expert_forward's dispatch and mixture in cpu_ops.c: one gather into the experts' input, one
    weighted combine out of their output rows (no sorted copy of the outputs, no index_add)."""
    src = np.full(x.shape[0] * k, -1, dtype=np.int64)  # the expert output row of each (token, choice)
    packed = getattr(experts, "packed_forward", None)  # experts that take their rows packed, unpadded
    batch = experts.can_batch(counts)
    if batch and packed is not None:
        ys = packed(cpu_ops.gather_rows(x, order // k), counts)
        src[order] = np.arange(order.size)
    elif batch:
        rows, sources = _padded_layout(flat_ids, order, counts, k)
        xs = cpu_ops.gather_rows(x, sources).reshape([counts.shape[0], int(counts.max()), -1])
        ys = experts.batched_forward(xs, counts)
        src[order] = rows
    else:
        ys = _per_expert(experts, cpu_ops.gather_rows(x, order // k), counts)
        src[order] = np.arange(order.size)
    return cpu_ops.weighted_combine(ys, src.reshape(-1, k), topk_weights)


def _per_expert(experts: Experts, xs: paddle.Tensor, counts: np.ndarray) -> paddle.Tensor:
    """Each active expert once over its consecutive rows of xs (rows sorted by expert)."""
    outs, start = [], 0
    for e in np.nonzero(counts)[0]:
        n = int(counts[e])
        outs.append(experts.expert_forward(int(e), xs[start : start + n]))
        start += n
    return outs[0] if len(outs) == 1 else paddle.concat(outs, axis=0)


def _padded_layout(flat_ids: np.ndarray, order: np.ndarray, counts: np.ndarray,
                   k: int) -> tuple[np.ndarray, np.ndarray]:
    """The padded [E, cap] expert batch of the (token, choice) pairs in `order`: the batch row of each pair, and
    the token each batch row reads (-1: a padding row)."""
    cap = int(counts.max())
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    expert_of = flat_ids[order]
    rows = expert_of * cap + (np.arange(order.size) - starts[expert_of])
    sources = np.full(counts.shape[0] * cap, -1, dtype=np.int64)
    sources[rows] = order // k
    return rows, sources


def _use_batched(counts: np.ndarray) -> bool:
    """One batched matmul over every expert reads each weight once in a single op, where a loop issues two
    small matmuls per expert (at decode size it nearly halved a layer's expert time on this path). It pays when
    most experts are active (inactive ones are read for nothing) and padding every expert to the busiest one's count
    at most doubles the rows."""
    num_experts, active = counts.shape[0], int(np.count_nonzero(counts))
    return 4 * active >= 3 * num_experts and num_experts * int(counts.max()) <= 2 * int(counts.sum()) + num_experts


def _batched(experts: Experts, x: paddle.Tensor, sources: np.ndarray, counts: np.ndarray) -> paddle.Tensor:
    """The experts' padded output [E * cap, H] from one padded [E, cap, H] batch whose rows read `sources`
    (_padded_layout's; padding rows read an appended zero row)."""
    num_experts, t = counts.shape[0], x.shape[0]
    padded = paddle.concat([x, paddle.zeros([1, x.shape[1]], x.dtype)])
    xs = paddle.index_select(padded, to_paddle(np.where(sources < 0, t, sources)))
    xs = xs.reshape([num_experts, -1, x.shape[1]])
    return experts.batched_forward(xs, counts).reshape([-1, x.shape[1]])


class MoE(nn.Layer):
    """Routed experts and shared ones, made by `layers` (model/layer_builder.py: float, or the quantized formats the
    loader's plan names); the router stays fp32 (and whole on every rank: each rank routes every token, under
    expert parallelism too). On a tensor-parallel rank the experts are its own (expert parallelism) or its slice of
    every expert."""

    def __init__(self, cfg: ErnieModelConfig, layers: "LayerBuilder", layer_idx: int,
                 layout: ParallelLayout = SINGLE_RANK):
        super().__init__()
        self.gate = TopKRouter(cfg.hidden_size, cfg.moe_num_experts, cfg.moe_k, cfg.moe_norm_min)
        self.experts = layers.experts(len(layout.experts(cfg)), cfg.hidden_size, layout.expert_intermediate(cfg),
                                      layer_idx)
        self.expert_offset = layout.experts(cfg).start if layout.expert_parallel and layout.is_parallel else None
        self.shared_experts = None
        if cfg.moe_num_shared_experts > 0:
            shared = len(layout.split(cfg.moe_intermediate_size * cfg.moe_num_shared_experts))
            self.shared_experts = MLP(cfg.hidden_size, shared, layers, layer_idx)

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        ids, weights = self.gate(x)
        out = self.experts(x, ids, weights, self.expert_offset)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out
