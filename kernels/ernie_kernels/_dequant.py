"""In-register dequantization shared by the dense and the MoE GEMMs: weight tiles, activation tiles, dots.

QUANT codes (constexpr): 0 float weights, 1 int8 (wint8), 2 int4 packed two per byte along K (wint4 /
w4a8, formats.pack_int4: low nibble = even k), 3 e4m3 (block_wise_fp8), 4 wint2 (CCQ codes, four k per
byte, formats.wint2_fields). A_QUANT codes: 0 none, 1 fp8 per token per 128-channel group (block_wise_fp8,
BLOCK_K == 128 so a tile is one group), 2 int8 with a static scale (w4a8).

Scales that vary along K are applied to each K step's partial dot: fp8's 128x128 block scales, and wint2's
64-row group scales (BLOCK_K == 64). Per-output-channel scales (wint8 / wint4 / w4a8) commute with the
whole K sum and are applied once after the loop.
"""

from ernie_kernels._runtime import tl, triton

Q_FLOAT, Q_INT8, Q_INT4, Q_FP8, Q_WINT2 = 0, 1, 2, 3, 4
QUANT_CODES = {None: Q_FLOAT, "wint8": Q_INT8, "wint4": Q_INT4, "w4a8": Q_INT4, "block_wise_fp8": Q_FP8,
               "wint2": Q_WINT2}
A_NONE, A_FP8_GROUP, A_INT8_STATIC = 0, 1, 2
A_QUANT_CODES = {"block_wise_fp8": A_FP8_GROUP, "w4a8": A_INT8_STATIC}


def block_k_for(method: str | None) -> int:
    """The K step a method's scales need (fp8 blocks of 128, wint2 groups of 64)."""
    return 128 if method == "block_wise_fp8" else 64


@triton.jit
def load_weight_tile(b_ptr, offs_k, offs_n, mask, stride_bk, stride_bn, cs_ptr, zp_ptr, QUANT: tl.constexpr):
    """Tile W[offs_k, offs_n] as stored: float/fp8 values, or integer values (as int32) for int8/int4/wint2.
    cs_ptr / zp_ptr: wint2's per-channel code scale and zero point (unused otherwise)."""
    if QUANT == 2:
        # two k rows share a byte; the second load of a byte hits cache
        packed = tl.load(b_ptr + (offs_k[:, None] // 2) * stride_bk + offs_n[None, :] * stride_bn, mask=mask, other=0)
        shift = (offs_k[:, None] % 2) * 4
        return ((((packed.to(tl.int32) >> shift) & 15) ^ 8) - 8)
    elif QUANT == 3:
        # no `other`: the interpreter cannot cast a fill constant to fp8. Callers keep K a multiple of
        # BLOCK_K so only out-of-range columns (never stored) see the undefined lanes.
        return tl.load(b_ptr + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn, mask=mask)
    elif QUANT == 4:
        n_mask = tl.max(mask.to(tl.int32), axis=0) > 0
        code = tl.load(b_ptr + (offs_k[:, None] // 4) * stride_bk + offs_n[None, :] * stride_bn, mask=mask,
                       other=0).to(tl.uint8).to(tl.float32)
        cs = tl.load(cs_ptr + offs_n, mask=n_mask, other=0.0)
        zp = tl.load(zp_ptr + offs_n, mask=n_mask, other=0.0)
        v = tl.floor(code * cs[None, :] + zp[None, :] + 0.5).to(tl.int32)
        shift = 9 - 3 * (offs_k[:, None] % 4)
        return ((v >> shift) & 63) - 32
    else:
        # one return: the compiler types every return of a branch, dead ones after a constexpr if included
        # (int8 codes returned beside their int32 cast did not compile for any GPU; the interpreter never minds)
        w = tl.load(b_ptr + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn, mask=mask, other=0)
        if QUANT == 1:
            w = w.to(tl.int32)
        return w


@triton.jit
def wint2_group_scale(ls_ptr, ss_ptr, k0, offs_n, n_mask, stride_lsk, stride_lsn):
    """Scale of the 64-row group starting at k0 for columns offs_n: its 4-bit local scale (group 2j in the
    high nibble of byte j, 2j+1 in the low one) times the channel's super scale."""
    g = k0 // 64
    byte = tl.load(ls_ptr + (g // 2) * stride_lsk + offs_n * stride_lsn, mask=n_mask, other=0).to(tl.int32)
    nibble = tl.where(g % 2 == 0, (byte >> 4) & 15, byte & 15)
    return nibble.to(tl.float32) * tl.load(ss_ptr + offs_n, mask=n_mask, other=0.0)


@triton.jit
def round_half_away(x):
    """Round half away from zero without libdevice (matches paddle.round and formats.round_half_away)."""
    return tl.where(x >= 0, tl.floor(x + 0.5), -tl.floor(-x + 0.5))


@triton.jit
def quantize_a_tile(a, a_scale, A_QUANT: tl.constexpr, FP8_DOT: tl.constexpr):
    """(the activation tile as the dot takes it, its per-row scale) for a float32 tile a [BM, BK]."""
    row_scale = tl.zeros([a.shape[0]], dtype=tl.float32) + 1.0
    if A_QUANT == 1:
        amax = tl.max(tl.abs(a), axis=1)
        row_scale = tl.where(amax > 0, amax / 448.0, 1.0)
        a = tl.minimum(tl.maximum(a / row_scale[:, None], -448.0), 448.0)
        if FP8_DOT:
            a = a.to(tl.float8e4nv)
        else:
            # the 3.2 interpreter drops the carry when rounding up into the next binade
            # (126.1 -> 64, not 128; measured); such results are exactly half the right one
            q = a.to(tl.float8e4nv).to(tl.float32)
            a = tl.where(tl.abs(a) > 1.5 * tl.abs(q), 2.0 * q, q)
    elif A_QUANT == 2:
        a = tl.minimum(tl.maximum(round_half_away(a / a_scale), -127.0), 127.0).to(tl.int8)
    return a, row_scale


@triton.jit
def tile_dot(a, w, A_QUANT: tl.constexpr, DOT: tl.constexpr, FP8_DOT: tl.constexpr):
    """One K step's partial product: a as quantize_a_tile returns it, w as load_weight_tile returns it."""
    if A_QUANT == 2:
        return tl.dot(a, w.to(tl.int8), out_dtype=tl.int32)
    elif A_QUANT == 1:
        if FP8_DOT:
            return tl.dot(a, w)
        else:  # interpreter: a holds e4m3 values in fp32; products of e4m3 values are exact in fp32
            return tl.dot(a, w.to(tl.float32))
    else:
        return tl.dot(a.to(DOT), w.to(tl.float32).to(DOT))
