"""Unified paged attention: one kernel for a whole mixed step (decodes, draft verification, prefill chunks
over cached blocks), the approach of vLLM's triton_unified_attention written afresh for our cache layout.

Every sequence's new tokens are already in the cache (kv_write runs first), so K/V always come from the
paged cache and a prefill chunk is just a sequence with a long query. One program serves BLOCK_Q query
tokens of one sequence for one KV head: its rows are (query token, query head of that KV head's group)
pairs, so GQA reads each K/V tile once for the whole group, and a decode (one query) still fills the M
dim of the dot with its group's heads. Programs loop over KV tiles of TILE positions up to the last key
their queries see, with an online softmax in fp32; the causal rule is the engine's: query i of a
sequence with `seq_len` visible tokens and `q_len` new ones sees keys j <= seq_len - q_len + i.

Which program serves which queries is index data built on the host once per step (`attention_programs`),
so the grid is exact and a padded CUDA-graph batch only changes the arrays. A TILE is independent of the
cache block size: each position finds its block through the block table, so any block_size works, and
head_dim need not be a power of two (it is padded and masked). int8 (C8) caches are dequantized as tiles
are loaded: static channel-wise scales [kv_heads*head_dim] (x = q*s/127) or dynamic per-(block, kv head)
scales [num_blocks, kv_heads].

Split KV: a step with few programs and long contexts (a small decode batch) would run one program per
(sequence, KV head) over the whole context and leave most of a large GPU idle. With num_splits > 1 a third
grid dimension cuts each program's keys into that many equal runs of whole tiles; each writes its unnormalized
output with its running max and sum to fp32 scratch, and a second kernel combines them per (token, head)
(flash-decoding; vLLM's 3D unified attention). `kv_splits` is the policy: only when the step's programs fall
short of the GPU's, and never below a few tiles a split.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ernie_kernels._runtime import (contiguous, dot_dtype, dtype_name, new_tensor, next_pow2, target_arch, tl,
                                    triton)

KV_FLOAT, KV_INT8_CHANNEL, KV_INT8_BLOCK = 0, 1, 2
MIN_ROWS = 16  # tl.dot needs M >= 16 on the GPU
MAX_SPLITS = 16
MIN_TILES_PER_SPLIT = 4  # a split shorter than this costs more in its launch share and combine than it saves


@triton.jit
def _dequant_kv(x, scale_ptr, blk, kvh, offs_d, d_mask, KV_HEADS, HEAD_DIM: tl.constexpr, KV_QUANT: tl.constexpr):
    """A [TILE, HEAD_PAD] tile as float32; blk [TILE] is each position's cache block."""
    if KV_QUANT == 1:
        s = tl.load(scale_ptr + kvh * HEAD_DIM + offs_d, mask=d_mask, other=0.0).to(tl.float32)
        return x.to(tl.float32) * s[None, :] / 127.0
    elif KV_QUANT == 2:
        s = tl.load(scale_ptr + blk * KV_HEADS + kvh).to(tl.float32)
        return x.to(tl.float32) * s[:, None] / 127.0
    else:
        return x.to(tl.float32)


@triton.jit
def _unified_attention_kernel(q_ptr, k_ptr, v_ptr, out_ptr, tables_ptr, seq_lens_ptr, qsl_ptr, prog_seq_ptr,
                              prog_q_ptr, ks_ptr, vs_ptr, part_ptr, ml_ptr, sm_scale, KV_HEADS, block_size,
                              stride_qt, stride_qh, stride_ot, stride_oh, stride_cb, stride_ct, stride_ch,
                              stride_tb,
                              GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_Q: tl.constexpr,
                              HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr, TILE: tl.constexpr,
                              KV_QUANT: tl.constexpr, DOT: tl.constexpr, NUM_SPLITS: tl.constexpr):
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq = tl.load(prog_seq_ptr + pid)
    q0 = tl.load(prog_q_ptr + pid)
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    context = seq_len - q_len

    offs_m = tl.arange(0, BLOCK_Q * BLOCK_G)
    q_local = q0 + offs_m // BLOCK_G
    head_in_group = offs_m % BLOCK_G
    row_mask = (q_local < q_len) & (head_in_group < GROUP)
    heads = kvh * GROUP + head_in_group
    offs_d = tl.arange(0, HEAD_PAD)
    d_mask = offs_d < HEAD_DIM
    q = tl.load(q_ptr + (q_start + q_local)[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=row_mask[:, None] & d_mask[None, :], other=0.0)
    q = (q.to(tl.float32) * sm_scale).to(DOT)
    q_pos = context + q_local  # each row's absolute position: it sees keys 0..q_pos

    m_i = tl.zeros([BLOCK_Q * BLOCK_G], dtype=tl.float32) - float("inf")
    l_i = tl.zeros([BLOCK_Q * BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_Q * BLOCK_G, HEAD_PAD], dtype=tl.float32)
    kv_end = context + tl.minimum(q0 + BLOCK_Q, q_len)  # one past the last key any row here sees
    lo = 0
    hi = kv_end
    if NUM_SPLITS > 1:  # this split's run of whole tiles; the last ones may be empty
        per_split = tl.cdiv(tl.cdiv(kv_end, NUM_SPLITS), TILE) * TILE
        lo = tl.minimum(split * per_split, kv_end)
        hi = tl.minimum(lo + per_split, kv_end)
    offs_t = tl.arange(0, TILE)
    for start in range(lo, hi, TILE):
        pos = start + offs_t
        t_mask = pos < hi
        blk = tl.load(tables_ptr + seq * stride_tb + pos // block_size, mask=t_mask, other=0).to(tl.int64)
        base = blk * stride_cb + (pos % block_size) * stride_ct + kvh * stride_ch
        kv_mask = t_mask[:, None] & d_mask[None, :]
        k = _dequant_kv(tl.load(k_ptr + base[:, None] + offs_d[None, :], mask=kv_mask, other=0), ks_ptr, blk, kvh,
                        offs_d, d_mask, KV_HEADS, HEAD_DIM, KV_QUANT)
        s = tl.dot(q, tl.trans(k.to(DOT)))
        s = tl.where((pos[None, :] <= q_pos[:, None]) & t_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # a row that sees none of these keys yet (a split past its position) keeps max -inf: subtract 0 there
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        v = _dequant_kv(tl.load(v_ptr + base[:, None] + offs_d[None, :], mask=kv_mask, other=0), vs_ptr, blk, kvh,
                        offs_d, d_mask, KV_HEADS, HEAD_DIM, KV_QUANT)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT), v.to(DOT))
        m_i = m_new
    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + (q_start + q_local)[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & d_mask[None, :])
    else:  # scratch [T, Hq, NUM_SPLITS, HEAD_DIM] and [T, Hq, NUM_SPLITS, 2] (max, sum), combined afterwards
        slot = ((q_start + q_local) * (KV_HEADS * GROUP) + heads) * NUM_SPLITS + split
        tl.store(part_ptr + slot[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=row_mask[:, None] & d_mask[None, :])
        tl.store(ml_ptr + slot * 2, m_i, mask=row_mask)
        tl.store(ml_ptr + slot * 2 + 1, l_i, mask=row_mask)


@triton.jit
def _combine_splits_kernel(part_ptr, ml_ptr, out_ptr, num_heads, stride_ot, stride_oh,
                           NUM_SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr):
    """One (token, head): the splits' partial softmax sums rescaled to their common max."""
    tok = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, NUM_SPLITS)
    offs_d = tl.arange(0, HEAD_PAD)
    d_mask = offs_d < HEAD_DIM
    slot = (tok * num_heads + head) * NUM_SPLITS + offs_s
    m = tl.load(ml_ptr + slot * 2)
    l = tl.load(ml_ptr + slot * 2 + 1)
    m_max = tl.max(m, axis=0)
    w = tl.exp(m - tl.where(m_max == float("-inf"), 0.0, m_max))  # an empty split (max -inf) weighs 0
    acc = tl.load(part_ptr + slot[:, None] * HEAD_DIM + offs_d[None, :], mask=d_mask[None, :], other=0.0)
    num = tl.sum(acc * w[:, None], axis=0)
    den = tl.sum(l * w, axis=0)
    out = num / tl.where(den > 0, den, 1.0)
    tl.store(out_ptr + tok * stride_ot + head * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty), mask=d_mask)


def queries_per_program(group: int, max_query_len: int) -> int:
    """BLOCK_Q for a step: rows per program = BLOCK_Q * group heads, at least MIN_ROWS; steps with long
    queries (prefill chunks) take 64 rows a program, decode-only steps as few as fill MIN_ROWS."""
    block_g = next_pow2(group)
    rows = MIN_ROWS if max_query_len * block_g <= MIN_ROWS else 64
    return max(1, rows // block_g)


def kv_splits(num_programs: int, kv_heads: int, max_seq_len: int, target_programs: int, tile: int = 32) -> int:
    """How many runs to cut each program's keys into: 1 when the step's num_programs x kv_heads programs reach
    target_programs (about two per SM) or target_programs is 0 (off); else a power of two up to MAX_SPLITS that
    brings them near it, keeping at least MIN_TILES_PER_SPLIT tiles of max_seq_len keys a split."""
    base = max(1, num_programs * kv_heads)
    if target_programs <= 0 or base >= target_programs:
        return 1
    want = min(-(-target_programs // base), max_seq_len // (MIN_TILES_PER_SPLIT * tile), MAX_SPLITS)
    return 1 << (max(int(want), 1).bit_length() - 1)


def attention_programs(query_start_loc: np.ndarray, block_q: int) -> tuple[np.ndarray, np.ndarray]:
    """(sequence, first local query) of every program: each sequence's queries cut into BLOCK_Q runs."""
    q_lens = np.diff(np.asarray(query_start_loc, np.int64))
    per_seq = -(-q_lens // block_q)
    seq = np.repeat(np.arange(len(q_lens), dtype=np.int32), per_seq)
    first = np.concatenate([[0], np.cumsum(per_seq)[:-1]]).astype(np.int64)
    q0 = ((np.arange(int(per_seq.sum())) - np.repeat(first, per_seq)) * block_q).astype(np.int32)
    return seq, q0


def unified_attention(q: Any, k_cache: Any, v_cache: Any, out: Any, block_tables: Any, seq_lens: Any,
                      query_start_loc: Any, prog_seq: Any, prog_q: Any, block_q: int, sm_scale: float,
                      k_scale: Any = None, v_scale: Any = None, tile: int = 32, num_splits: int = 1) -> Any:
    """Attention of every new token over its sequence's cached keys; writes and returns `out`.

    q [T, Hq, D] (any row/head strides, e.g. the q columns of a fused qkv), out [T, Hq, D]; caches
    [num_blocks, block_size, kv_heads, D] float or int8 (then k_scale / v_scale as in the module doc);
    block_tables int32 [B, max_blocks]; seq_lens int32 [B] (tokens each sequence sees after this step);
    query_start_loc int32 [B+1]; prog_seq / prog_q int32 [P] from attention_programs(..., block_q);
    num_splits: a power of two, from kv_splits (split KV, see the module doc).
    """
    t, hq, d = q.shape
    _, page, kvh, d2 = k_cache.shape
    if d2 != d or hq % kvh:
        raise ValueError(f"q [T, {hq}, {d}] does not fit a cache with {kvh} kv heads of dim {d2}")
    if q.stride(2) != 1 or out.stride(2) != 1:
        raise ValueError("q and out need a contiguous head_dim")
    quantized = dtype_name(k_cache) == "int8"
    if quantized and (k_scale is None or v_scale is None):
        raise ValueError("an int8 KV cache needs k_scale and v_scale")
    kv_quant = KV_FLOAT
    if quantized:
        kv_quant = KV_INT8_BLOCK if len(k_scale.shape) == 2 else KV_INT8_CHANNEL
    k_cache, v_cache = contiguous(k_cache), contiguous(v_cache)
    group = hq // kvh
    block_g = next_pow2(group)
    if block_q * block_g < MIN_ROWS:
        raise ValueError(f"block_q={block_q} gives {block_q * block_g} rows a program; use queries_per_program")
    if num_splits < 1 or num_splits & (num_splits - 1) or num_splits > MAX_SPLITS:
        raise ValueError(f"num_splits must be a power of two in [1, {MAX_SPLITS}], got {num_splits}")
    ks = k_scale if quantized else k_cache
    vs = v_scale if quantized else v_cache
    programs = int(prog_seq.shape[0])
    if not (t and programs):
        return out
    part = ml = out  # not read without splits
    if num_splits > 1:
        part = new_tensor(out, [t, hq, num_splits, d], "float32")
        ml = new_tensor(out, [t, hq, num_splits, 2], "float32")
    head_pad = max(16, next_pow2(d))
    # 64-row programs at head_dim 128 hold a [64, 128] fp32 accumulator plus the Q tile: at 4 warps they spill on
    # Ampere / Ada (ptxas: 255 registers, 24-84 bytes; scripts/gpu_aot_check.py), not on Hopper; so do decode
    # programs over a C8 cache with per-block scales under triton 3.6 (128 registers, 8-24 bytes)
    arch = target_arch()
    heavy = (block_q * block_g >= 64 and head_pad >= 128) or kv_quant == KV_INT8_BLOCK
    warps = 8 if heavy and arch is not None and arch < 90 else 4
    _unified_attention_kernel[(programs, kvh, num_splits)](
        q, k_cache, v_cache, out, block_tables, seq_lens, query_start_loc, prog_seq, prog_q, ks, vs, part, ml,
        float(sm_scale), kvh, page, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        GROUP=group, BLOCK_G=block_g, BLOCK_Q=block_q, HEAD_DIM=d, HEAD_PAD=head_pad, TILE=tile,
        KV_QUANT=kv_quant, DOT=dot_dtype(dtype_name(q)), NUM_SPLITS=num_splits, num_warps=warps)
    if num_splits > 1:
        _combine_splits_kernel[(t, hq)](part, ml, out, hq, out.stride(0), out.stride(1),
                                        NUM_SPLITS=num_splits, HEAD_DIM=d, HEAD_PAD=head_pad, num_warps=4)
    return out

