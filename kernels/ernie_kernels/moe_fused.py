"""Fused MoE: sorted-slot grouped GEMMs with in-loop weight dequantization.

out[t] = sum_j w[t,j] * down_e(silu(gate_e(x_t)) * up_e(x_t)), e = topk_ids[t,j].
Two launches of one kernel over moe_align's expert-grouped slots: GEMM1 computes the gate and up
columns of a tile side by side and writes only silu(gate)*up (the [slots, 2I] intermediate never hits
memory); GEMM2 multiplies by the routed weight; a small kernel sums the k slots of each token.
Weights are [E, K, N] (Paddle layout), quantized per formats.py: wint8 / wint4 (per-channel scale after
the K loop), w4a8 (int8 x int4 -> int32 dot with a static per-expert activation scale, quantized as the
tile is loaded), block_wise_fp8 (activations quantized per token per 128 group as the tile is loaded,
fp8 dot, block scales applied per K step), wint2 (CCQ codes decoded in registers, 64-row group scales
applied per K step).
"""

from __future__ import annotations

from typing import Any

from ernie_kernels._dequant import (A_NONE, A_QUANT_CODES, Q_WINT2, QUANT_CODES, block_k_for, load_weight_tile,
                                    quantize_a_tile, tile_dot, wint2_group_scale)
from ernie_kernels._runtime import (INTERPRET, contiguous, dot_dtype, dtype_name, new_tensor, next_pow2, target_arch,
                                    tl, triton)
from ernie_kernels.moe_align import moe_align_block_size


@triton.jit
def _fused_moe_kernel(a_ptr, b_ptr, c_ptr, bs_ptr, as_ptr, ls_ptr, cs_ptr, zp_ptr, topk_w_ptr, sorted_ptr,
                      expert_ids_ptr, num_post_ptr, N, K, num_slots, a_row_div, up_offset,
                      stride_am, stride_ak, stride_be, stride_bk, stride_bn, stride_cm, stride_cn,
                      stride_bse, stride_bsk, stride_bsn, stride_lse, stride_lsk, stride_lsn, stride_cse,
                      QUANT: tl.constexpr, A_QUANT: tl.constexpr, SWIGLU: tl.constexpr, MUL_ROUTED: tl.constexpr,
                      DOT: tl.constexpr, FP8_DOT: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    pid_m = pid // num_n
    pid_n = pid % num_n
    if pid_m * BLOCK_M >= tl.load(num_post_ptr):
        return
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    slots = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    m_mask = slots < num_slots
    # row offsets in int64: slots x hidden reaches 2^31 at 32768 tokens x top-8 x 8192 (300B), where int32 wraps
    slot_rows = slots.to(tl.int64)
    rows = slot_rows // a_row_div
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    b_base = b_ptr + expert * stride_be
    # wint2 only: the expert's 4-bit local scales, and its per-channel code scale / zero point
    ls_base = ls_ptr + expert * stride_lse
    cs_base = cs_ptr + expert * stride_cse
    zp_base = zp_ptr + expert * stride_cse
    if A_QUANT == 2:
        acc_dtype = tl.int32
        a_scale = tl.load(as_ptr + expert).to(tl.float32)
    else:
        acc_dtype = tl.float32
        a_scale = 1.0
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=acc_dtype)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=acc_dtype)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        a = tl.load(a_ptr + rows[:, None] * stride_am + offs_k[None, :] * stride_ak,
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
        a, row_scale = quantize_a_tile(a, a_scale, A_QUANT, FP8_DOT)
        w_mask = k_mask[:, None] & n_mask[None, :]
        w = load_weight_tile(b_base, offs_k, offs_n, w_mask, stride_bk, stride_bn, cs_base, zp_base, QUANT)
        part = tile_dot(a, w, A_QUANT, DOT, FP8_DOT)
        if SWIGLU:
            w_up = load_weight_tile(b_base, offs_k, offs_n + up_offset, w_mask, stride_bk, stride_bn, cs_base,
                                    zp_base, QUANT)
            part_up = tile_dot(a, w_up, A_QUANT, DOT, FP8_DOT)
        if QUANT == 3:
            bs = bs_ptr + expert * stride_bse + (k0 // 128) * stride_bsk
            s = tl.load(bs + (offs_n // 128) * stride_bsn, mask=n_mask, other=0.0)
            acc += part * row_scale[:, None] * s[None, :]
            if SWIGLU:
                s_up = tl.load(bs + ((offs_n + up_offset) // 128) * stride_bsn, mask=n_mask, other=0.0)
                acc_up += part_up * row_scale[:, None] * s_up[None, :]
        elif QUANT == 4:  # BLOCK_K == 64: this step is exactly one scale group
            ss = bs_ptr + expert * stride_bse
            g = wint2_group_scale(ls_base, ss, k0, offs_n, n_mask, stride_lsk, stride_lsn)
            acc += part * g[None, :]
            if SWIGLU:
                g_up = wint2_group_scale(ls_base, ss, k0, offs_n + up_offset, n_mask, stride_lsk, stride_lsn)
                acc_up += part_up * g_up[None, :]
        else:
            acc += part
            if SWIGLU:
                acc_up += part_up
    out = acc.to(tl.float32)
    out_up = acc_up.to(tl.float32)
    if QUANT == 1 or QUANT == 2:
        s = tl.load(bs_ptr + expert * stride_bse + offs_n * stride_bsn, mask=n_mask, other=0.0)
        out = out * (s * a_scale)[None, :]
        if SWIGLU:
            s_up = tl.load(bs_ptr + expert * stride_bse + (offs_n + up_offset) * stride_bsn, mask=n_mask, other=0.0)
            out_up = out_up * (s_up * a_scale)[None, :]
    if SWIGLU:
        out = out / (1.0 + tl.exp(-out)) * out_up
    if MUL_ROUTED:
        out = out * tl.load(topk_w_ptr + slots, mask=m_mask, other=0.0).to(tl.float32)[:, None]
    tl.store(c_ptr + slot_rows[:, None] * stride_cm + offs_n[None, :] * stride_cn, out.to(c_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _sum_slots_kernel(c_ptr, ids_ptr, out_ptr, H, num_experts, stride_c, stride_out, TOPK: tl.constexpr,
                      BLOCK_H: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)  # (t * TOPK + j) * stride_c passes 2^31 as the GEMMs' rows do
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = offs < H
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for j in range(TOPK):
        eid = tl.load(ids_ptr + t * TOPK + j)
        here = (eid >= 0) & (eid < num_experts)  # a slot routed to another rank's expert was never computed
        acc += tl.load(c_ptr + (t * TOPK + j) * stride_c + offs, mask=mask & here, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * stride_out + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


WINT2_KEYS = ("weight_scale", "super_scales", "code_scale", "code_zp")


def _scale_args(scale: Any, quant: int, dummy: Any) -> tuple[list, list]:
    """The kernel's (bs, ls, cs, zp) pointers and (bse, bsk, bsn, lse, lsk, lsn, cse) strides.

    bs: per-channel scales [E, N], fp8's block scales [E, K/128, N/128], or wint2's super scales [E, N];
    ls / cs / zp: wint2's packed local scales [E, ceil(K/128), N] and per-channel code scale / zero point.
    """
    if scale is None:
        return [dummy] * 4, [0] * 7
    if quant == Q_WINT2:
        ls, ss, cs, zp = (contiguous(scale[k]) for k in WINT2_KEYS)
        return [ss, ls, cs, zp], [ss.stride(0), 0, ss.stride(1), ls.stride(0), ls.stride(1), ls.stride(2),
                                  cs.stride(0)]
    scale = contiguous(scale)
    if quant == QUANT_CODES["block_wise_fp8"]:
        return [scale, dummy, dummy, dummy], [scale.stride(0), scale.stride(1), scale.stride(2), 0, 0, 0, 0]
    return [scale, dummy, dummy, dummy], [scale.stride(0), 0, scale.stride(1), 0, 0, 0, 0]


# fp8's 128-deep K steps and wint2's in-register decode spill at 4 warps on every GPU (ptxas: 255 registers,
# 16-640 bytes; scripts/gpu_aot_check.py)
_HEAVY_TILES = ("block_wise_fp8", "wint2")


def _gemm(a, w, w_scale, a_scale, out, topk_w, sorted_ids, expert_ids, num_post, n, k, num_slots, a_row_div,
          method, swiglu, act_dtype, block_m):
    quant = QUANT_CODES[method]
    heavy = method in _HEAVY_TILES
    arch = target_arch()
    # ... and their 64-row tiles still spill on Ampere / Ada at 8 warps (255 registers, 280-528 bytes): half as wide
    block_n = 32 if heavy and block_m >= 64 and arch is not None and arch < 90 else 64
    grid = (expert_ids.shape[0] * triton.cdiv(n, block_n),)
    (bs, ls, cs, zp), strides = _scale_args(w_scale, quant, w)
    _fused_moe_kernel[grid](
        a, w, out, bs, a_scale if a_scale is not None else bs, ls, cs, zp, topk_w, sorted_ids, expert_ids,
        num_post, n, k, num_slots, a_row_div, n if swiglu else 0,
        a.stride(0), a.stride(1), w.stride(0), w.stride(1), w.stride(2), out.stride(0), out.stride(1), *strides,
        QUANT=quant, A_QUANT=A_QUANT_CODES.get(method, A_NONE), SWIGLU=swiglu, MUL_ROUTED=not swiglu,
        DOT=dot_dtype(act_dtype), FP8_DOT=not INTERPRET, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_K=block_k_for(method), num_warps=8 if heavy else 4)


def fused_moe(x: Any, up_gate: Any, down: Any, topk_ids: Any, topk_weights: Any, method: str | None = None,
              up_gate_scale: Any = None, down_scale: Any = None, up_gate_act_scale: Any = None,
              down_act_scale: Any = None, block_m: int | None = None, expert_start: int = 0) -> Any:
    """Routed experts for x [T, H] -> [T, H] in x's dtype; torch or Paddle tensors.

    up_gate [E, H, 2I] ([gate | up] on the last dim), down [E, I, H]: float (method None) or quantized
    per formats.py for method in wint8 / wint4 / w4a8 / block_wise_fp8 / wint2 (int4 packed [E, K//2, N],
    fp8 as float8_e4m3fn, wint2 codes uint8 [E, K//4, N]). *_scale: [E, N] per-channel, [E, ceil(K/128),
    ceil(N/128)] for fp8, or for wint2 a dict of formats.quantize_wint2's weight_scale / super_scales /
    code_scale / code_zp. *_act_scale: [E] static activation scales (w4a8). topk_ids [T, k], topk_weights [T, k].
    expert_start: expert parallelism, where up_gate / down hold the experts [expert_start, expert_start + E) and
    topk_ids are global: slots routed to any other expert add nothing here (their rank adds them; an all-reduce
    sums the ranks).
    """
    if method not in QUANT_CODES:
        raise ValueError(f"fused_moe method must be one of {[m for m in QUANT_CODES if m]} or None, got {method!r}")
    if method is not None and (up_gate_scale is None or down_scale is None):
        raise ValueError(f"fused_moe method {method!r} needs up_gate_scale and down_scale")
    if method == "w4a8" and (up_gate_act_scale is None or down_act_scale is None):
        raise ValueError("fused_moe w4a8 needs up_gate_act_scale and down_act_scale")
    if method == "wint2" and not all(isinstance(sc, dict) and set(WINT2_KEYS) <= set(sc)
                                     for sc in (up_gate_scale, down_scale)):
        raise ValueError(f"fused_moe wint2 scales must be dicts with {list(WINT2_KEYS)}")
    t, h = x.shape
    topk = topk_ids.shape[1]
    e = up_gate.shape[0]
    inter = up_gate.shape[2] // 2
    if method == "block_wise_fp8" and (h % 128 or inter % 128):
        raise ValueError(f"block_wise_fp8 fused_moe needs hidden ({h}) and moe_intermediate ({inter}) "
                         "to be multiples of 128")
    if method == "wint2" and (h % 64 or inter % 64):
        raise ValueError(f"wint2 fused_moe needs hidden ({h}) and moe_intermediate ({inter}) to be multiples of 64")
    act = dtype_name(x)
    x = contiguous(x)
    if t == 0:
        return new_tensor(x, [0, h], act)
    block_m = block_m or min(64, max(16, next_pow2(t * topk // e)))
    local_ids = contiguous(topk_ids - expert_start if expert_start else topk_ids)
    sorted_ids, expert_ids, num_post = moe_align_block_size(local_ids, e, block_m)
    num_slots = t * topk
    topk_w = contiguous(topk_weights).reshape([-1])
    mid = new_tensor(x, [num_slots, inter], act)
    _gemm(x, up_gate, up_gate_scale, up_gate_act_scale, mid, topk_w, sorted_ids, expert_ids, num_post,
          inter, h, num_slots, topk, method, True, act, block_m)
    slot_out = new_tensor(x, [num_slots, h], act)
    _gemm(mid, down, down_scale, down_act_scale, slot_out, topk_w, sorted_ids, expert_ids, num_post,
          h, inter, num_slots, 1, method, False, act, block_m)
    out = new_tensor(x, [t, h], act)
    bh = min(1024, next_pow2(h))
    _sum_slots_kernel[(t, triton.cdiv(h, bh))](slot_out, local_ids, out, h, e, slot_out.stride(0), out.stride(0),
                                              TOPK=topk, BLOCK_H=bh)
    return out
