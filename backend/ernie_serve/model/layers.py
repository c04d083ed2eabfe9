"""Building blocks of ERNIE-4.5: RMSNorm, interleaved RoPE, linear layers, the SwiGLU MLP.

Linear layers keep Paddle's [in, out] layout so `x @ W` needs no transpose. Every linear is a
`Linear` object with one `forward(x)`: quantized variants (model/quantized_layers.py, made by the LayerBuilder
the loader hands the model) and tensor-parallel shards replace the object, not the call sites.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import paddle
import paddle.nn.functional as F
from paddle import nn

from ..cpu_kernels import cpu_gemm, cpu_ops
from ..host_tensor import empty_host, to_paddle

if TYPE_CHECKING:
    from .layer_builder import LayerBuilder


class RMSNorm(nn.Layer):
    """w * x / sqrt(mean(x^2) + eps), in fp32 whatever the activation dtype."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = self.create_parameter([hidden_size], default_initializer=nn.initializer.Constant(1.0))

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        if cpu_ops.serves(x):
            return cpu_ops.rms_norm(x, self.weight, self.eps)
        x32 = x.astype("float32")
        var = (x32 * x32).mean(axis=-1, keepdim=True)
        return (x32 * paddle.rsqrt(var + self.eps) * self.weight).astype(x.dtype)


class Linear(nn.Layer):
    """Bias-free dense projection stored as [in, out]."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = self.create_parameter([in_features, out_features])

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        return paddle.matmul(x, self.weight)

    def swiglu(self, x: paddle.Tensor) -> paddle.Tensor:
        """silu(gate) * up of this gate-up projection (gate half first); serving layouts fuse it."""
        return silu_and_mul(self(x))

    def serving_layout(self, bits: int = 32) -> "BlockedLinear | None":
        """The same weight column-blocked for cpu_gemm.c in float32 (bits 32) or bfloat16 (16), or None where that
        kernel is not built / not on CPU."""
        if not cpu_gemm.serves(self.weight):
            return None
        return BlockedLinear.from_weight(np.from_dlpack(self.weight.detach()), bits)


class BlockedLinear(nn.Layer):
    """A Linear's weight in the serving layout ([out/32, in, 32], cpu_gemm.pack_columns), built by
    ErnieForCausalLM.process_weights_after_loading, multiplied by cpu_gemm.c at every row count, which streams
    the column blocks faster than Paddle's (MKL) matmul reads [in, out] at decode and still beats it at prefill
    sizes. Float32, or bfloat16 with --dtype bfloat16 (`scripts/bench_cpu_dtypes.py` times both). Inference
    only."""

    def __init__(self, blocked: paddle.Tensor, in_features: int, out_features: int):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.bits = cpu_gemm.held_bits(blocked)  # 32 float32, or 16 bfloat16 held as its bits
        self.register_buffer("weight_blocked", blocked)

    @classmethod
    def from_weight(cls, w: np.ndarray, bits: int = 32) -> "BlockedLinear":
        """From a float32 weight [in, out] (any strides: a transposed view is packed as it is read), held in float32
        (bits 32) or rounded to bfloat16 (16)."""
        return cls(cpu_gemm.packed(w, bits), w.shape[0], w.shape[1])

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        return self._gemm(x, False)

    def swiglu(self, x: paddle.Tensor) -> paddle.Tensor:
        """silu(gate) * up with the activation fused into the matmul (cpu_gemm.c), where the width allows."""
        return self._gemm(x, True) if cpu_gemm.swiglu_fits(self.out_features) else silu_and_mul(self(x))

    def argmax(self, x: paddle.Tensor, n_valid: int) -> tuple[np.ndarray, np.ndarray]:
        """Each row's argmax and largest value over the first n_valid outputs, the outputs never stored
        (cpu_gemm.gemm_argmax): what a greedy step needs of the lm_head."""
        return cpu_gemm.gemm_argmax(self._rows(x), self.weight_blocked, self.out_features, n_valid, self.bits)

    def _gemm(self, x: paddle.Tensor, swiglu: bool) -> paddle.Tensor:
        y = cpu_gemm.gemm(self._rows(x), self.weight_blocked, self.out_features, None, self.bits, swiglu)
        return y.reshape(list(x.shape[:-1]) + [y.shape[-1]])

    def _rows(self, x: paddle.Tensor) -> np.ndarray:
        """x as float32 rows [*, in_features], viewed through DLPack (no copy); Paddle's cast and reshape only where
        needed (each op costs ~0.3 ms of a decode step, run with the caches cold from the weights' stream)."""
        if x.dtype != paddle.float32:
            x = x.astype("float32")
        a = np.from_dlpack(x)
        return a if a.ndim == 2 and a.shape[1] == self.in_features else a.reshape(-1, self.in_features)


class TiedEmbedding(nn.Layer):
    """The input embedding of a model whose lm_head is tied to it, read from the head's serving layout (built by
    ErnieForCausalLM.process_weights_after_loading): embedding row v is head column v, so one column-blocked
    copy serves both and the logits stream it through cpu_gemm.c instead of a transposed matmul."""

    def __init__(self, head: BlockedLinear):
        super().__init__()
        self.table = head.weight_blocked  # the head owns (and registers) it; this is a second name for it
        self._view = (None, None)  # (tensor, its NumPy view): taken once, not a DLPack round trip a step

    def forward(self, ids: paddle.Tensor) -> paddle.Tensor:
        v = ids.numpy()
        t, out = empty_host((v.size, self.table.shape[1]), np.float32)
        self.lookup(v.reshape(-1), out)
        return t if v.ndim == 1 else t.reshape(list(v.shape) + [self.table.shape[1]])

    def lookup(self, ids: np.ndarray, out: np.ndarray) -> None:
        """out [len(ids), hidden] float32 = the rows of ids (model/cpu_layers.py writes them into its own buffer)."""
        if self._view[0] is not self.table:
            self._view = (self.table, np.from_dlpack(self.table))
        cpu_gemm.widen(self._view[1][ids // cpu_gemm.COLS, :, ids % cpu_gemm.COLS], out=out)


class RotaryEmbedding:
    """Interleaved (GPT-J style) rotary embedding over the full head_dim.

    ERNIE rotates pairs (2i, 2i+1), not the two halves of the head (neox style), and the checkpoint
    weights are not permuted for either, so using rotate_half here would silently break the model.
    The pair swap is a matmul with a fixed signed permutation R (x @ R = [-x1, x0, -x3, x2, ...]):
    unlike strided slicing it stays on contiguous tensors, which Paddle's CPU kernels need to be fast.
    """

    def __init__(self, head_dim: int, theta: float, max_positions: int, compression_ratio: float = 1.0):
        self.head_dim = head_dim
        self.theta = theta
        self.compression_ratio = compression_ratio
        rot = np.zeros((head_dim, head_dim), np.float32)
        rot[np.arange(1, head_dim, 2), np.arange(0, head_dim, 2)] = -1.0
        rot[np.arange(0, head_dim, 2), np.arange(1, head_dim, 2)] = 1.0
        self._rot = paddle.to_tensor(rot)
        self._cos = self._sin = None
        self._ensure(max(256, min(max_positions, 8192)))

    def _ensure(self, n: int) -> None:
        if self._cos is not None and self._cos.shape[0] >= n:
            return
        inv_freq = 1.0 / (self.theta ** (np.arange(0, self.head_dim, 2, dtype=np.float32) / self.head_dim))
        pos = np.arange(n, dtype=np.float32) / self.compression_ratio
        freqs = np.repeat(np.outer(pos, inv_freq).astype(np.float32), 2, axis=1)  # [n, head_dim], pairs equal
        self._cos = paddle.to_tensor(np.cos(freqs))
        self._sin = paddle.to_tensor(np.sin(freqs))

    def tables(self, max_position: int) -> tuple[paddle.Tensor, paddle.Tensor]:
        """The cos / sin tables [positions, head_dim] (both entries of a pair equal), covering max_position."""
        self._ensure(max_position + 1)
        return self._cos, self._sin

    def split_rotate(self, qkv: paddle.Tensor, positions: paddle.Tensor, max_position: int, num_heads: int,
                     num_kv_heads: int) -> tuple[paddle.Tensor, paddle.Tensor, paddle.Tensor]:
        """A fused [Q | K | V] projection [T, (nh + 2 nkv) hd] -> q [T, nh, hd], k, v [T, nkv, hd], q and k rotated."""
        t, hd = qkv.shape[0], self.head_dim
        cos, sin = self.tables(max_position)
        if cpu_ops.serves(qkv):
            return cpu_ops.split_rope(qkv, positions.numpy(), cos, sin, num_heads, num_kv_heads, hd)
        q, k, v = paddle.split(qkv, [num_heads * hd, num_kv_heads * hd, num_kv_heads * hd], axis=-1)
        q, k = self(positions, max_position, q.reshape([t, num_heads, hd]), k.reshape([t, num_kv_heads, hd]))
        return q, k, v.reshape([t, num_kv_heads, hd])

    def __call__(self, positions: paddle.Tensor, max_position: int, *xs: paddle.Tensor) -> list[paddle.Tensor]:
        """Rotate each x of shape [T, heads, head_dim] at its token's position."""
        self._ensure(max_position + 1)
        cos = paddle.index_select(self._cos, positions).unsqueeze(1)  # [T, 1, hd]
        sin = paddle.index_select(self._sin, positions).unsqueeze(1)
        out = []
        for x in xs:
            x32 = x.astype("float32")
            out.append((x32 * cos + paddle.matmul(x32, self._rot) * sin).astype(x.dtype))
        return out


class MLP(nn.Layer):
    """down(silu(gate(x)) * up(x)) with gate and up fused in one [H, 2I] projection (gate first)."""

    def __init__(self, hidden_size: int, intermediate_size: int, layers: "LayerBuilder | None" = None,
                 layer_idx: int = 0):
        """`layers` makes the two projections (model/layer_builder.py; None: float ones)."""
        super().__init__()
        self.intermediate_size = intermediate_size
        if layers is None:
            self.up_gate_proj = Linear(hidden_size, 2 * intermediate_size)
            self.down_proj = Linear(intermediate_size, hidden_size)
        else:
            self.up_gate_proj = layers.linear(hidden_size, 2 * intermediate_size, layer_idx)
            self.down_proj = layers.linear(intermediate_size, hidden_size, layer_idx)

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        return self.down_proj(self.up_gate_proj.swiglu(x))


def silu_and_mul(gate_up: paddle.Tensor) -> paddle.Tensor:
    if cpu_ops.serves(gate_up):
        return cpu_ops.silu_and_mul(gate_up)
    gate, up = paddle.chunk(gate_up, 2, axis=-1)
    return F.silu(gate) * up
