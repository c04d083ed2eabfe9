"""KV-cache writes from the slot mapping: each new token's K and V into its cache slot, quantized for C8.

Float and static-scale int8 caches: one program per token (slot < 0 means "do not write": padding rows
of a CUDA-graph batch). Dynamic-scale int8 caches keep one scale per (block, kv head) that grows as the
block fills, so a write may have to rescale the codes already in the block: one program per (block
touched this step, kv head) handles all the step's tokens in that block (they are contiguous: a
sequence's new positions are consecutive and only its last block is partly filled). The arithmetic is
that of ernie_serve.model.kv_cache's C8 storage (formats.quantize_kv_*), op for op.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ernie_kernels._dequant import round_half_away
from ernie_kernels._runtime import dtype_name, next_pow2, tl, triton

KV_FLOAT, KV_INT8_STATIC = 0, 1


@triton.jit
def _kv_write_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slots_ptr, ks_ptr, vs_ptr, block_size,
                     stride_kt, stride_kh, stride_vt, stride_vh, stride_cb, stride_ct, stride_ch,
                     KV_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                     HEAD_PAD: tl.constexpr, KV_QUANT: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    if slot >= 0:
        offs_h = tl.arange(0, HEADS_PAD)
        offs_d = tl.arange(0, HEAD_PAD)
        mask = (offs_h < KV_HEADS)[:, None] & (offs_d < HEAD_DIM)[None, :]
        dst = (slot // block_size) * stride_cb + (slot % block_size) * stride_ct + offs_h[:, None] * stride_ch \
            + offs_d[None, :]
        k = tl.load(k_ptr + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask, other=0.0)
        v = tl.load(v_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask, other=0.0)
        if KV_QUANT == 1:
            chan = offs_h[:, None] * HEAD_DIM + offs_d[None, :]
            ks = tl.load(ks_ptr + chan, mask=mask, other=1.0)
            vs = tl.load(vs_ptr + chan, mask=mask, other=1.0)
            k = tl.minimum(tl.maximum(round_half_away(k.to(tl.float32) * 127.0 / ks), -127.0), 127.0).to(tl.int8)
            v = tl.minimum(tl.maximum(round_half_away(v.to(tl.float32) * 127.0 / vs), -127.0), 127.0).to(tl.int8)
        tl.store(kc_ptr + dst, k.to(kc_ptr.dtype.element_ty), mask=mask)
        tl.store(vc_ptr + dst, v.to(vc_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _write_block_dynamic(x_ptr, stride_xt, stride_xh, c_ptr, s_ptr, blk, t0, n, o0, h, KV_HEADS, stride_cb,
                         stride_ct, stride_ch, BLOCK_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                         HEAD_PAD: tl.constexpr):
    rows = tl.arange(0, BLOCK_PAD)
    offs_d = tl.arange(0, HEAD_PAD)
    d_mask = offs_d < HEAD_DIM
    new_mask = (rows < n)[:, None] & d_mask[None, :]
    x = tl.load(x_ptr + (t0 + rows)[:, None] * stride_xt + h * stride_xh + offs_d[None, :], mask=new_mask,
                other=0.0).to(tl.float32)
    amax = tl.max(tl.max(tl.abs(x), axis=1), axis=0)
    old = tl.load(s_ptr + blk * KV_HEADS + h)
    old = tl.where(o0 == 0, 0.0, old)  # a write at offset 0 starts the block afresh
    new = tl.maximum(old, amax)
    block = c_ptr + blk * stride_cb + h * stride_ch
    if (old > 0) & (new > old):  # rescale the codes already here to the grown scale (one extra rounding)
        old_mask = (rows < o0)[:, None] & d_mask[None, :]
        codes = tl.load(block + rows[:, None] * stride_ct + offs_d[None, :], mask=old_mask, other=0)
        tl.store(block + rows[:, None] * stride_ct + offs_d[None, :],
                 round_half_away(codes.to(tl.float32) * (old / new)).to(tl.int8), mask=old_mask)
    s = tl.where(new > 0, new, 1.0)
    q = tl.minimum(tl.maximum(round_half_away(x * 127.0 / s), -127.0), 127.0).to(tl.int8)
    tl.store(block + (o0 + rows)[:, None] * stride_ct + offs_d[None, :], q, mask=new_mask)
    tl.store(s_ptr + blk * KV_HEADS + h, new)


@triton.jit
def _kv_write_dynamic_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, runs_ptr, KV_HEADS,
                             stride_kt, stride_kh, stride_vt, stride_vh, stride_cb, stride_ct, stride_ch,
                             BLOCK_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr):
    r = tl.program_id(0)
    h = tl.program_id(1)
    blk = tl.load(runs_ptr + r * 4).to(tl.int64)
    t0 = tl.load(runs_ptr + r * 4 + 1)
    n = tl.load(runs_ptr + r * 4 + 2)
    o0 = tl.load(runs_ptr + r * 4 + 3)
    _write_block_dynamic(k_ptr, stride_kt, stride_kh, kc_ptr, ks_ptr, blk, t0, n, o0, h, KV_HEADS, stride_cb,
                         stride_ct, stride_ch, BLOCK_PAD, HEAD_DIM, HEAD_PAD)
    _write_block_dynamic(v_ptr, stride_vt, stride_vh, vc_ptr, vs_ptr, blk, t0, n, o0, h, KV_HEADS, stride_cb,
                         stride_ct, stride_ch, BLOCK_PAD, HEAD_DIM, HEAD_PAD)


def block_runs(slot_mapping: np.ndarray, block_size: int) -> np.ndarray:
    """[R, 4] int32 (block, first step token, token count, first offset in the block) for each run of the
    step's tokens that lands in one block: the dynamic-scale write's programs. Negative slots are skipped."""
    slots = np.asarray(slot_mapping, np.int64)
    tokens = np.flatnonzero(slots >= 0)
    if not tokens.size:
        return np.zeros((0, 4), np.int32)
    blocks = slots[tokens] // block_size
    starts = np.flatnonzero(np.concatenate([[True], (blocks[1:] != blocks[:-1]) | (np.diff(tokens) != 1)]))
    counts = np.diff(np.concatenate([starts, [tokens.size]]))
    first = tokens[starts]
    if len(np.unique(blocks[starts])) != len(starts):
        raise ValueError("slot_mapping writes one block from two separate runs of tokens; a block is filled by "
                         "one sequence's consecutive positions")
    return np.stack([blocks[starts], first, counts, slots[first] % block_size], axis=1).astype(np.int32)


def kv_write(k: Any, v: Any, k_cache: Any, v_cache: Any, slot_mapping: Any, k_scale: Any = None,
             v_scale: Any = None, runs: Any = None) -> None:
    """Store k/v [T, kv_heads, D] (any token/head strides, e.g. the k/v columns of a fused qkv) at their
    slots of caches [num_blocks, block_size, kv_heads, D].

    int8 caches: k_scale / v_scale [kv_heads*D] static channel-wise scales, or [num_blocks, kv_heads]
    dynamic ones (updated in place), which also need `runs` (block_runs of the slot mapping, int32 tensor).
    """
    t, kvh, d = k.shape
    nb, page, kvh2, d2 = k_cache.shape
    if (kvh2, d2) != (kvh, d) or tuple(v.shape) != tuple(k.shape):
        raise ValueError(f"k/v [T, {kvh}, {d}] do not fit a cache with {kvh2} kv heads of dim {d2}")
    if k.stride(2) != 1 or v.stride(2) != 1 or not k_cache.is_contiguous() or not v_cache.is_contiguous():
        raise ValueError("kv_write needs a contiguous head_dim in k/v and contiguous caches")
    quantized = dtype_name(k_cache) == "int8"
    if quantized and (k_scale is None or v_scale is None):
        raise ValueError("an int8 KV cache needs k_scale and v_scale")
    head_pad = max(16, next_pow2(d))
    strides = (k.stride(0), k.stride(1), v.stride(0), v.stride(1), k_cache.stride(0), k_cache.stride(1),
               k_cache.stride(2))
    if quantized and len(k_scale.shape) == 2:
        if runs is None:
            raise ValueError("a dynamic-scale int8 KV cache needs runs=block_runs(slot_mapping, block_size)")
        if runs.shape[0]:
            _kv_write_dynamic_kernel[(int(runs.shape[0]), kvh)](
                k, v, k_cache, v_cache, k_scale, v_scale, runs, kvh, *strides,
                BLOCK_PAD=max(16, next_pow2(page)), HEAD_DIM=d, HEAD_PAD=head_pad)
        return
    if t:
        ks = k_scale if quantized else k_cache
        vs = v_scale if quantized else v_cache
        _kv_write_kernel[(t,)](k, v, k_cache, v_cache, slot_mapping, ks, vs, page, *strides, KV_HEADS=kvh,
                               HEADS_PAD=next_pow2(kvh), HEAD_DIM=d, HEAD_PAD=head_pad,
                               KV_QUANT=KV_INT8_STATIC if quantized else KV_FLOAT)
