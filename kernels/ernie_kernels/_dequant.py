"""In-register dequantization of a weight tile, shared by the dense and the MoE GEMMs.

QUANT codes (constexpr): 0 float weights, 1 int8 (wint8), 2 int4 packed two per byte along K
(wint4 / w4a8, formats.pack_int4: low nibble = even k), 3 e4m3 (block_wise_fp8).
"""

from ernie_kernels._runtime import tl, triton

Q_FLOAT, Q_INT8, Q_INT4, Q_FP8 = 0, 1, 2, 3
QUANT_CODES = {None: Q_FLOAT, "wint8": Q_INT8, "wint4": Q_INT4, "w4a8": Q_INT4, "block_wise_fp8": Q_FP8}


@triton.jit
def load_weight_tile(b_ptr, offs_k, offs_n, mask, stride_bk, stride_bn, QUANT: tl.constexpr):
    """Tile W[offs_k, offs_n] as stored: float/fp8 values, or integer values (as int32) for int8/int4."""
    if QUANT == 2:
        # two k rows share a byte; the second load of a byte hits cache
        packed = tl.load(b_ptr + (offs_k[:, None] // 2) * stride_bk + offs_n[None, :] * stride_bn, mask=mask, other=0)
        shift = (offs_k[:, None] % 2) * 4
        return ((((packed.to(tl.int32) >> shift) & 15) ^ 8) - 8)
    elif QUANT == 3:
        # no `other`: the interpreter cannot cast a fill constant to fp8. Callers keep K a multiple of
        # BLOCK_K so only out-of-range columns (never stored) see the undefined lanes.
        return tl.load(b_ptr + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn, mask=mask)
    else:
        w = tl.load(b_ptr + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn, mask=mask, other=0)
        if QUANT == 1:
            return w.to(tl.int32)
        return w


@triton.jit
def round_half_away(x):
    """Round half away from zero without libdevice (matches paddle.round and formats.round_half_away)."""
    return tl.where(x >= 0, tl.floor(x + 0.5), -tl.floor(-x + 0.5))
