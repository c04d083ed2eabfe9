"""CPU reference layers for quantized weights, in Paddle (tiles are dequantized partly in NumPy through
zero-copy DLPack views, where that was measured faster; the matmuls are Paddle's).

Weights stay resident in their quantized form; forward dequantizes one column tile at a time (so a
[K, N] fp32 copy of a big matrix never exists) and runs an fp32 matmul, the only matmul Paddle CPU has.
The same interface is what the GPU path (ernie_kernels) implements. QuantLinear stands in for the
model's `Linear` and QuantMoEExperts for its fp32 `FusedExperts` (both experts run the model's
grouped_expert_forward), so the model has one code path and quantization is a drop-in. Both are
nn.Layers whose quantized tensors are buffers; built empty, the loader fills them as weights stream in.
"""

from __future__ import annotations

from typing import Iterable

import numpy as np
import paddle
import paddle.nn.functional as F
from paddle import nn

from ernie_serve.host_tensor import to_paddle
from ernie_serve.model.layer_builder import FLOAT_LAYERS
from ernie_serve.model.layers import BlockedLinear, silu_and_mul
from ernie_serve.model.moe import BlockedExperts, grouped_expert_forward
from ernie_serve.cpu_kernels import cpu_gemm
from ernie_serve.quantization import formats as fmt
from ernie_serve.quantization.plan import QuantPlan
from ernie_serve.quantization.formats import (METHODS, QUANT_TENSOR_SUFFIXES, REQUIRED_TENSORS,  # noqa: F401
                                           quantize_float)

_WEIGHT_ONLY_BITS = {"wint8": 8, "wint4": 4, "w4a8": 4}  # formats cpu_gemm multiplies directly
_TILE_BYTES = 16 << 20  # fp32 bytes of one dequantized weight tile


def _nbytes(t: paddle.Tensor) -> int:
    return int(np.prod(t.shape)) * t.element_size()


_FP8_VALUES = fmt.fp8_e4m3_decode(np.arange(256, dtype=np.uint8))  # e4m3fn byte -> float32


def _dequantize_fp8_cols(codes: paddle.Tensor, scale_inv: paddle.Tensor, n0: int, n1: int) -> paddle.Tensor:
    """float32 W[:, n0:n1] (n0 a multiple of 128) from e4m3 codes and 128x128 block scales.

    In NumPy through DLPack: a table lookup decodes, then each 128-row band is scaled in place by its
    row of block scales; measured several times faster on CPU than building the full [K, n] scale
    matrix with Paddle's repeat_interleave."""
    b = fmt.FP8_BLOCK
    u = np.from_dlpack(codes.view(paddle.uint8))[:, n0:n1]
    w = np.take(_FP8_VALUES, u)
    s = np.repeat(scale_inv.numpy()[:, n0 // b: -(-n1 // b)], b, axis=1)[:, : n1 - n0]
    for kb in range(s.shape[0]):
        w[kb * b:(kb + 1) * b] *= s[kb]
    return to_paddle(w)


def _dequantize_wint2_cols(t: dict[str, paddle.Tensor], k: int, n0: int, n1: int) -> paddle.Tensor:
    """float32 W[:, n0:n1] = field * local4[k // 64] * super_scales (formats.dequantize_wint2), in NumPy
    through DLPack: integer shifts and one in-place scale per 64-row group instead of ~20 Paddle passes."""
    codes = np.from_dlpack(t["quant_weight"])[:, n0:n1]
    v = np.floor(codes * t["code_scale"].numpy()[n0:n1] + t["code_zp"].numpy()[n0:n1] + 0.5).astype(np.int32)
    kq, n = codes.shape
    w = np.empty((kq, 4, n), np.float32)
    for i, shift in enumerate((9, 6, 3, 0)):
        w[:, i] = ((v >> shift) & 63) - 32
    ls = np.from_dlpack(t["weight_scale"])[:, n0:n1]
    nib = np.stack([ls >> 4, ls & 0xF], axis=1).reshape(-1, n)[: k // fmt.WINT2_GROUP]
    gs = nib * t["super_scales"].numpy()[n0:n1]  # [K // 64, n]
    w = w.reshape(k // fmt.WINT2_GROUP, fmt.WINT2_GROUP, n)
    w *= gs[:, None, :]
    return to_paddle(w.reshape(k, n))


def _quantize_act_fp8(x: paddle.Tensor) -> paddle.Tensor:
    """Dynamic per-token per-128-group e4m3 fake quantization (formats.quantize_act_fp8) in Paddle."""
    t, k = x.shape
    g = fmt.FP8_BLOCK
    kp = -(-k // g) * g
    xp = F.pad(x, [0, kp - k]) if kp != k else x
    xg = xp.reshape([t, kp // g, g])
    amax = xg.abs().max(axis=-1, keepdim=True)
    scale = paddle.where(amax > 0, amax / fmt.FP8_E4M3_MAX, paddle.ones_like(amax))
    q = paddle.clip(xg / scale, -fmt.FP8_E4M3_MAX, fmt.FP8_E4M3_MAX).astype("float8_e4m3fn")
    return (q.astype("float32") * scale).reshape([t, kp])[:, :k]


def _quantize_act_int8(x: paddle.Tensor, scale: float) -> paddle.Tensor:
    """Static int8 activation fake quantization: integers in [-127, 127] (times scale applied later)."""
    return paddle.clip(paddle.round(x / scale), -127.0, 127.0)  # paddle.round: half away from zero


class QuantLinear(nn.Layer):
    """y = x @ W for a weight W [K, N] held quantized; forward(x [T, K]) -> [T, N] float32.

    Built empty (the model's placeholder) or from tensors; load_float / load_quantized fill it once.
    """

    def __init__(self, method: str, in_features: int, out_features: int,
                 tensors: dict[str, np.ndarray] | None = None):
        super().__init__()
        self.method = fmt.check_method(method)
        self.in_features, self.out_features = in_features, out_features
        self.tensors: dict[str, paddle.Tensor] = {}
        self.tile_n = max(128, (_TILE_BYTES // (4 * max(in_features, 1))) // 128 * 128)
        if tensors is not None:
            self.load_quantized(tensors)

    # ------------------------------------------------------------ construction
    @classmethod
    def from_float(cls, w_KN: np.ndarray, method: str, *, activation_scale: float | None = None,
                   calib_x: np.ndarray | None = None) -> "QuantLinear":
        """Quantize an fp32 weight [K, N]. w4a8 needs activation_scale or calibration inputs calib_x."""
        k, n = np.shape(w_KN)
        layer = cls(method, k, n)
        layer.load_float(w_KN, activation_scale=activation_scale, calib_x=calib_x)
        return layer

    @classmethod
    def from_checkpoint(cls, tensors: dict[str, np.ndarray], method: str, *,
                        transposed: bool = False) -> "QuantLinear":
        """Wrap pre-quantized tensors named as in FastDeploy checkpoints (suffixes after `<layer>.`).

        quant_weight plus: weight_scale (wint8/wint4/w4a8), weight_scale_inv or weight_scale
        (block_wise_fp8), weight_scale (packed 4-bit local scales) + super_scales + code_scale +
        code_zp (wint2), activation_scale (w4a8). Layouts are those of formats.py ([K, N]);
        transposed=True accepts a block_wise_fp8 weight in torch layout [N, K] with scale [N/128, K/128].
        """
        method = fmt.check_method(method)
        k, n = fmt.quantized_shape(method, np.shape(tensors["quant_weight"]), transposed=transposed)
        layer = cls(method, k, n)
        layer.load_quantized(tensors, transposed=transposed)
        return layer

    def load_float(self, w_KN: np.ndarray, **calibration) -> None:
        """Quantize and hold an fp32 weight [K, N]; the caller drops its fp32 copy."""
        if tuple(np.shape(w_KN)) != (self.in_features, self.out_features):
            raise ValueError(f"QuantLinear [{self.in_features}, {self.out_features}] got a weight of shape "
                             f"{list(np.shape(w_KN))}")
        self.load_quantized(quantize_float(w_KN, self.method, **calibration))

    def load_quantized(self, tensors: dict[str, np.ndarray], *, transposed: bool = False) -> None:
        """Hold pre-quantized tensors (names and layouts as from_checkpoint's)."""
        if self.tensors:
            raise ValueError(f"QuantLinear [{self.in_features}, {self.out_features}] is already loaded")
        t = fmt.normalize_quantized(self.method, tensors, self.in_features, self.out_features, transposed=transposed)
        out = {}
        for name, arr in t.items():
            if name == "quant_weight" and self.method == "block_wise_fp8":
                out[name] = paddle.to_tensor(np.ascontiguousarray(arr).view(np.uint8)).view(paddle.float8_e4m3fn)
            elif name == "quant_weight" and self.method in _WEIGHT_ONLY_BITS:
                out[name] = cpu_gemm.packed_codes(arr, _WEIGHT_ONLY_BITS[self.method])  # cpu_qgemm.c's layout
            else:
                out[name] = paddle.to_tensor(np.ascontiguousarray(arr))
        for name, tensor in out.items():
            self.register_buffer(name, tensor)
        self.tensors = out
        if self.method == "w4a8":  # one static scale per matrix; read once, not on every forward
            self.act_scale = float(t["activation_scale"][0])

    def export(self) -> dict[str, np.ndarray]:
        """The held tensors as checkpoint arrays (fp8 codes as ml_dtypes float8_e4m3fn)."""
        out = {}
        for name, t in self.tensors.items():
            if t.dtype == paddle.float8_e4m3fn:
                out[name] = t.view(paddle.uint8).numpy().view(fmt.ml_dtypes.float8_e4m3fn)
            elif name == "quant_weight" and self.method in _WEIGHT_ONLY_BITS:
                out[name] = self._codes(0, self.out_features)
            else:
                out[name] = t.numpy()
        return out

    def _codes(self, n0: int, n1: int) -> np.ndarray:
        """int8 codes of columns [n0, n1) in checkpoint layout [K or K/2, n] (weight-only int formats, which
        hold them in cpu_qgemm.c's layout)."""
        return cpu_gemm.unpack_codes(np.from_dlpack(self.tensors["quant_weight"]), self.in_features,
                                     _WEIGHT_ONLY_BITS[self.method], n0, n1)

    def _float_codes(self, n0: int, n1: int) -> paddle.Tensor:
        """The integer codes of columns [n0, n1) as float32 [K, n] (weight-only int formats)."""
        q = cpu_gemm.code_values(np.from_dlpack(self.tensors["quant_weight"]), self.in_features,
                                 _WEIGHT_ONLY_BITS[self.method], n0, n1)
        return to_paddle(q).astype("float32")

    @property
    def float_nbytes(self) -> int:
        """What the same weight takes in fp32."""
        return 4 * self.in_features * self.out_features

    # ------------------------------------------------------------ use
    @property
    def nbytes(self) -> int:
        """Resident bytes of the quantized weight and its scales."""
        return sum(_nbytes(v) for v in self.tensors.values())

    def dequantize(self, n0: int = 0, n1: int | None = None) -> paddle.Tensor:
        """float32 W[:, n0:n1] (n0 a multiple of 128 for block_wise_fp8)."""
        n1 = self.out_features if n1 is None else n1
        t, m = self.tensors, self.method
        if m == "block_wise_fp8":
            return _dequantize_fp8_cols(t["quant_weight"], t["weight_scale_inv"], n0, n1)
        if m == "wint2":
            return _dequantize_wint2_cols(t, self.in_features, n0, n1)
        return self._float_codes(n0, n1) * t["weight_scale"][n0:n1]

    def _quantize_input(self, x: paddle.Tensor) -> paddle.Tensor:
        if self.method == "block_wise_fp8":
            return _quantize_act_fp8(x)
        if self.method == "w4a8":
            return _quantize_act_int8(x, self.act_scale)
        return x

    def _tile_matmul(self, xq: paddle.Tensor, n0: int, n1: int) -> paddle.Tensor:
        """xq @ W[:, n0:n1]. A per-output-channel scale commutes with the matmul, so weight-only int
        formats multiply it into the [T, n] product instead of the [K, n] tile (one pass fewer)."""
        if self.method not in _WEIGHT_ONLY_BITS:
            return paddle.matmul(xq, self.dequantize(n0, n1))
        s = self.tensors["weight_scale"]
        if (n0, n1) != (0, self.out_features):
            s = s[n0:n1]
        return paddle.matmul(xq, self._float_codes(n0, n1)) * s

    def swiglu(self, x: paddle.Tensor) -> paddle.Tensor:
        """silu(gate) * up of this gate-up projection; fused into cpu_qgemm.c's matmul for the weight-only int
        formats (w4a8 scales its product after the matmul, so it cannot fuse)."""
        bits = _WEIGHT_ONLY_BITS.get(self.method)
        if (bits and self.method != "w4a8" and cpu_gemm.serves(x)
                and cpu_gemm.swiglu_fits(self.out_features) and x.shape[-1] == self.in_features):
            return cpu_gemm.gemm(np.from_dlpack(x.astype("float32")), self.tensors["quant_weight"], self.out_features,
                                 self.tensors["weight_scale"], bits, swiglu=True)
        return silu_and_mul(self(x))

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"QuantLinear expects x [T, {self.in_features}], got {list(x.shape)}")
        xq = self._quantize_input(x.astype("float32"))
        bits = _WEIGHT_ONLY_BITS.get(self.method)
        if bits and cpu_gemm.serves(xq):
            # integer dot products over the codes as stored (cpu_qgemm.c), not an fp32 tile dequantized first, which
            # took about twice as long at prefill sizes
            y = cpu_gemm.gemm(np.from_dlpack(xq), self.tensors["quant_weight"], self.out_features,
                              self.tensors["weight_scale"], bits, int_x=self.method == "w4a8")
        else:
            outs = [self._tile_matmul(xq, n0, min(n0 + self.tile_n, self.out_features))
                    for n0 in range(0, self.out_features, self.tile_n)]
            y = outs[0] if len(outs) == 1 else paddle.concat(outs, axis=-1)
        if self.method == "w4a8":  # integer-valued operands: the fp32 matmul equals the int32 one
            y = y * self.act_scale
        return y


class QuantMoEExperts(nn.Layer):
    """Quantized routed experts with FusedExperts' interface; one QuantLinear per expert matrix."""

    def __init__(self, up_gate_proj: list[QuantLinear], down_proj: list[QuantLinear]):
        super().__init__()
        if len(up_gate_proj) != len(down_proj):
            raise ValueError(f"{len(up_gate_proj)} up_gate experts but {len(down_proj)} down experts")
        self.up_gate_proj = nn.LayerList(up_gate_proj)
        self.down_proj = nn.LayerList(down_proj)
        self.num_experts = len(up_gate_proj)
        self.method = up_gate_proj[0].method

    @classmethod
    def empty(cls, method: str, num_experts: int, hidden_size: int, intermediate_size: int) -> "QuantMoEExperts":
        """Placeholders for the loader to fill expert by expert."""
        return cls([QuantLinear(method, hidden_size, 2 * intermediate_size) for _ in range(num_experts)],
                   [QuantLinear(method, intermediate_size, hidden_size) for _ in range(num_experts)])

    @classmethod
    def from_float(cls, up_gate: np.ndarray, down: np.ndarray, method: str, *,
                   calib_x: np.ndarray | None = None) -> "QuantMoEExperts":
        """Quantize stacked fp32 experts. w4a8 calibrates its static activation scales on calib_x [T, H]
        (every calibration token through every expert: a simple stand-in for routed calibration)."""
        ug, dn = np.asarray(up_gate, np.float32), np.asarray(down, np.float32)
        if method != "w4a8":
            return cls([QuantLinear.from_float(w, method) for w in ug], [QuantLinear.from_float(w, method) for w in dn])
        if calib_x is None:
            raise ValueError("w4a8 experts need calib_x= (calibration activations [T, H])")
        xs = np.asarray(calib_x, np.float32)
        ups, downs = [], []
        for e in range(ug.shape[0]):
            ups.append(QuantLinear.from_float(ug[e], method, calib_x=xs))
            h = silu_and_mul(to_paddle(xs @ ug[e])).numpy()
            downs.append(QuantLinear.from_float(dn[e], method, calib_x=h))
        return cls(ups, downs)

    @classmethod
    def from_checkpoint(cls, up_gate: dict[str, np.ndarray], down: dict[str, np.ndarray], method: str, *,
                        transposed: bool = False) -> "QuantMoEExperts":
        """Stacked pre-quantized tensors (leading axis E), named as QuantLinear.from_checkpoint's."""
        def split(ts: dict[str, np.ndarray]) -> list[QuantLinear]:
            e = np.asarray(ts["quant_weight"]).shape[0]
            return [QuantLinear.from_checkpoint({k: np.asarray(v)[i] for k, v in ts.items()}, method,
                                                transposed=transposed) for i in range(e)]
        return cls(split(up_gate), split(down))

    @property
    def nbytes(self) -> int:
        return sum(m.nbytes for m in self.up_gate_proj) + sum(m.nbytes for m in self.down_proj)

    @property
    def float_nbytes(self) -> int:
        return sum(m.float_nbytes for m in self.up_gate_proj) + sum(m.float_nbytes for m in self.down_proj)

    def expert_forward(self, e: int, x: paddle.Tensor) -> paddle.Tensor:
        return self.down_proj[e](self.up_gate_proj[e].swiglu(x))

    def can_batch(self, counts: np.ndarray) -> bool:
        """The weight-only int formats run every expert in one cpu_qgemm.c call per matrix (batched_forward) at
        every row count: measured, the per-expert Python calls it replaces cost more than the matmuls at 16 running."""
        return self.method in _WEIGHT_ONLY_BITS and cpu_gemm.available()

    def batched_forward(self, xs: paddle.Tensor, counts: np.ndarray) -> paddle.Tensor:
        """Every expert on its own rows: xs padded [E, cap, H] (expert e's tokens in its first counts[e] rows; the
        output's other rows are zeros) or packed [sum(counts), H] (each expert's rows after the previous expert's).
        Two cpu_qgemm.c calls for the whole layer."""
        fused = self.method != "w4a8" and cpu_gemm.swiglu_fits(self.up_gate_proj[0].out_features)
        h = self._all_experts(self.up_gate_proj, np.from_dlpack(xs), counts, swiglu=fused)
        return self._all_experts(self.down_proj, np.from_dlpack(h if fused else silu_and_mul(h)), counts)

    def _all_experts(self, linears: nn.LayerList, x: np.ndarray, counts: np.ndarray,
                     swiglu: bool = False) -> paddle.Tensor:
        bits = _WEIGHT_ONLY_BITS[self.method]
        first = linears[0]
        if self.method == "w4a8":  # each expert's static int8 activation scale (see _quantize_act_int8)
            a = np.asarray([q.act_scale for q in linears], np.float32)
            a = a[:, None, None] if x.ndim == 3 else np.repeat(a, counts)[:, None]
            x = np.clip(fmt.round_half_away(x / a), -127.0, 127.0).astype(np.float32)
        y = cpu_gemm.moe_gemm(x, counts, [q.tensors["quant_weight"] for q in linears], first.out_features,
                              [q.tensors["weight_scale"] for q in linears], bits, swiglu, int_x=self.method == "w4a8")
        return y * to_paddle(a) if self.method == "w4a8" else y

    packed_forward = batched_forward  # no padding rows to gather, zero and combine

    def forward(self, x: paddle.Tensor, topk_ids: paddle.Tensor, topk_weights: paddle.Tensor,
                expert_offset: int | None = None) -> paddle.Tensor:
        """x [T, H], topk_ids [T, k] int64, topk_weights [T, k] -> [T, H] float32; `expert_offset`: these are
        the model's experts [offset, offset + num_experts) (expert parallelism)."""
        return grouped_expert_forward(self, x.astype("float32"), topk_ids, topk_weights, expert_offset)


class QuantizedLayers:
    """The LayerBuilder (model/layer_builder.py) of a QuantPlan: each dense linear in the plan's dense format and
    each MoE layer's routed experts in its format (wint2 / W4A8 plans name layer ranges), empty for the loader to
    fill, so no fp32 copy of a quantized weight is ever allocated; what the plan leaves unquantized is float."""

    def __init__(self, plan: QuantPlan):
        self.plan = plan

    def linear(self, in_features: int, out_features: int, layer_idx: int) -> nn.Layer:
        if self.plan.dense is None:
            return FLOAT_LAYERS.linear(in_features, out_features, layer_idx)
        return QuantLinear(self.plan.dense, in_features, out_features)

    def experts(self, num_experts: int, hidden_size: int, intermediate_size: int, layer_idx: int) -> nn.Layer:
        method = self.plan.moe_method(layer_idx)
        if method is None:
            return FLOAT_LAYERS.experts(num_experts, hidden_size, intermediate_size, layer_idx)
        return QuantMoEExperts.empty(method, num_experts, hidden_size, intermediate_size)


def model_memory_bytes(layers: Iterable[object]) -> int:
    """Resident weight bytes of layers (anything with .nbytes: our layers, numpy arrays), Paddle tensors,
    and any other nn.Layer (its parameters and buffers)."""
    total = 0
    for layer in layers:
        if isinstance(layer, paddle.Tensor):
            total += _nbytes(layer)
        elif hasattr(layer, "nbytes"):
            total += int(layer.nbytes)
        elif isinstance(layer, nn.Layer):
            total += sum(_nbytes(t) for t in list(layer.parameters()) + list(layer.buffers()))
        else:
            raise TypeError(f"model_memory_bytes: cannot size a {type(layer).__name__}")
    return total


def weight_memory_report(model: nn.Layer) -> dict[str, int]:
    """Resident weight bytes of a model: in total, in its quantized layers, and those layers in fp32; fp32_model_bytes
    counts bfloat16 serving layouts (--dtype bfloat16) at float32's size too."""
    quant = [m for m in model.sublayers() if isinstance(m, QuantLinear)]
    total = model_memory_bytes([model])
    q = sum(m.nbytes for m in quant)
    half = sum(model_memory_bytes([m]) for m in model.sublayers()
               if isinstance(m, (BlockedLinear, BlockedExperts)) and m.bits == 16)
    return {"total_bytes": total, "quantized_bytes": q, "quantized_fp32_bytes": sum(m.float_nbytes for m in quant),
            "float_bytes": total - q, "fp32_model_bytes": total - q + half + sum(m.float_nbytes for m in quant)}
