"""Paged decode attention: one query token per sequence, GQA, KV cache in fixed-size blocks.

Cache layout [num_blocks, block_size, kv_heads, head_dim] with a per-sequence block table, as the
engine's block manager allocates it. One program per (sequence, kv head) streams that head's pages
once and serves all query heads of its group (GQA: the group is the M dim of the dot, so K/V are read
once per kv head, not per query head), with an online softmax in fp32. Optional int8 (C8) cache:
static channel-wise scales [kv_heads*head_dim] (x = q*s/127) or dynamic per-(block, kv head) scales
[num_blocks, kv_heads]. No split over the sequence: long contexts at small batch under-fill the GPU.
"""

from __future__ import annotations

from typing import Any

from ernie_kernels._runtime import contiguous, dot_dtype, dtype_name, new_tensor, next_pow2, tl, triton

KV_FLOAT, KV_INT8_CHANNEL, KV_INT8_BLOCK = 0, 1, 2


@triton.jit
def _dequant_kv(x, scale_ptr, blk, kvh, offs_d, KV_HEADS, HEAD_DIM: tl.constexpr, KV_QUANT: tl.constexpr):
    if KV_QUANT == 1:
        s = tl.load(scale_ptr + kvh * HEAD_DIM + offs_d).to(tl.float32)
        return x.to(tl.float32) * (s / 127.0)[None, :]
    elif KV_QUANT == 2:
        s = tl.load(scale_ptr + blk * KV_HEADS + kvh).to(tl.float32)
        return x.to(tl.float32) * (s / 127.0)
    else:
        return x.to(tl.float32)


@triton.jit
def _paged_decode_kernel(q_ptr, k_ptr, v_ptr, out_ptr, tables_ptr, lens_ptr, ks_ptr, vs_ptr, sm_scale, KV_HEADS,
                         stride_qb, stride_qh, stride_cb, stride_ct, stride_ch, stride_tb, stride_ob, stride_oh,
                         GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
                         KV_QUANT: tl.constexpr, DOT: tl.constexpr):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    seq_len = tl.load(lens_ptr + b)
    offs_g = tl.arange(0, BLOCK_G)
    g_mask = offs_g < GROUP
    heads = kvh * GROUP + offs_g
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :], mask=g_mask[:, None], other=0.0)
    q = (q.to(tl.float32) * sm_scale).to(DOT)
    m_i = tl.zeros([BLOCK_G], dtype=tl.float32) - float("inf")
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], dtype=tl.float32)
    offs_t = tl.arange(0, PAGE)
    for p in range(0, tl.cdiv(seq_len, PAGE)):
        blk = tl.load(tables_ptr + b * stride_tb + p).to(tl.int64)
        t_mask = p * PAGE + offs_t < seq_len
        kv_off = blk * stride_cb + offs_t[:, None] * stride_ct + kvh * stride_ch + offs_d[None, :]
        k = _dequant_kv(tl.load(k_ptr + kv_off, mask=t_mask[:, None], other=0), ks_ptr, blk, kvh, offs_d,
                        KV_HEADS, HEAD_DIM, KV_QUANT)
        s = tl.dot(q, tl.trans(k.to(DOT)))
        s = tl.where(t_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        prob = tl.exp(s - m_new[:, None])
        v = _dequant_kv(tl.load(v_ptr + kv_off, mask=t_mask[:, None], other=0), vs_ptr, blk, kvh, offs_d,
                        KV_HEADS, HEAD_DIM, KV_QUANT)
        l_i = l_i * alpha + tl.sum(prob, axis=1)
        acc = acc * alpha[:, None] + tl.dot(prob.to(DOT), v.to(DOT))
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=g_mask[:, None])


def paged_decode_attention(q: Any, k_cache: Any, v_cache: Any, block_tables: Any, seq_lens: Any,
                           sm_scale: float | None = None, k_scale: Any = None, v_scale: Any = None) -> Any:
    """q [B, Hq, D] -> out [B, Hq, D] (q's dtype) attending to each sequence's first seq_lens[b] tokens.

    k_cache / v_cache [num_blocks, block_size, kv_heads, D] float or int8; block_tables int32 [B, max_blocks];
    seq_lens int32 [B]. For int8 caches pass k_scale / v_scale: [kv_heads*D] (static channel-wise) or
    [num_blocks, kv_heads] (dynamic per block). block_size and D must be powers of two >= 16.
    """
    bsz, hq, d = q.shape
    _, page, kvh, d2 = k_cache.shape
    if d2 != d or hq % kvh:
        raise ValueError(f"q [B, {hq}, {d}] does not fit a cache with {kvh} kv heads of dim {d2}")
    if page < 16 or page & (page - 1) or d < 16 or d & (d - 1):
        raise ValueError(f"block_size ({page}) and head_dim ({d}) must be powers of two >= 16")
    quantized = dtype_name(k_cache) == "int8"
    if quantized and (k_scale is None or v_scale is None):
        raise ValueError("an int8 KV cache needs k_scale and v_scale")
    kv_quant = KV_FLOAT
    if quantized:
        kv_quant = KV_INT8_BLOCK if len(k_scale.shape) == 2 else KV_INT8_CHANNEL
    q, k_cache, v_cache = contiguous(q), contiguous(k_cache), contiguous(v_cache)
    block_tables, seq_lens = contiguous(block_tables), contiguous(seq_lens)
    out = new_tensor(q, [bsz, hq, d], dtype_name(q))
    group = hq // kvh
    ks = contiguous(k_scale) if quantized else q
    vs = contiguous(v_scale) if quantized else q
    if bsz > 0:
        _paged_decode_kernel[(bsz, kvh)](
            q, k_cache, v_cache, out, block_tables, seq_lens, ks, vs, float(sm_scale or d ** -0.5), kvh,
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
            out.stride(0), out.stride(1), GROUP=group, BLOCK_G=max(16, next_pow2(group)), HEAD_DIM=d, PAGE=page,
            KV_QUANT=kv_quant, DOT=dot_dtype(dtype_name(q)), num_warps=4)
    return out
