"""GQA attention over the paged KV cache: the step's AttentionMetadata, and the reference backend's plan.

AttentionMetadata is plain index data, built once per step by the model runner (as vLLM's attention
metadata and nano-vllm's context): where each sequence's new tokens sit in the flattened step, how many
tokens each sees, its block table, the cache slot of every new token, and how many leading sequences are
decodes. A backend derives what it needs from it once per step (`derive`) and every layer reuses that.

The reference backend (reference_attention.py holds its math) runs the leading decodes as one padded
batch (or, in inference on a float32 / bfloat16 CPU cache, in one call of cpu_kernels/cpu_attention.c that reads
the blocks in place) and every longer chunk in tiles with an online softmax. The causal rule is one: query i of a
sequence with `seq_len` visible tokens and `q_len` new ones sees keys j <= seq_len - q_len + i.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import paddle

from ..cpu_kernels import build, cpu_attention, cpu_ops
from ..host_tensor import to_paddle
from .attention_metadata import AttentionMetadata
from .kv_cache import PagedKVCache
from .reference_attention import MASKED, FreshKV, PagedKV, batched_attention, tiled_causal_attention


KV_TILE_TOKENS = 512  # keys per tile of a prefill chunk (rounded to whole cache blocks)
SCORE_TILE_ELEMENTS = 1 << 20  # q_tile = this // (heads * kv tile): a 4 MB fp32 score tile
# q_len * seq_len of the longest chunk cpu_attention.c still takes (see native_seqs): per layer (8 / 2 heads of
# 128) it beat the tiled path on 16 chunks of 101 tokens and on 4 of 512, and lost on one chunk of 1024 or more
NATIVE_CHUNK_WORK = 512 * 512


@dataclass
class _DecodeBatch:
    """The leading short-query sequences, padded to q_len each."""

    q_len: int
    q_index: paddle.Tensor  # [B*q_len] rows of the step's tokens (padding repeats a valid row)
    out_index: paddle.Tensor | None  # [num_decode_tokens] rows of the padded output; None when no padding
    block_ids: np.ndarray  # [B, nb]
    mask: paddle.Tensor  # [B, 1, 1, q_len, nb*block_size] additive


@dataclass
class _Chunk:
    """A longer chunk, attended in tiles."""

    start: int
    q_len: int
    seq_len: int
    block_ids: np.ndarray | None  # [nb]; None: nothing cached before the chunk, attend to its own K/V


@dataclass
class _ReferencePlan:
    decodes: _DecodeBatch | None
    chunks: list[_Chunk]


def _plan(meta: AttentionMetadata, read_cache: bool, native_seqs: int) -> _ReferencePlan:
    """read_cache: every chunk attends to what the cache holds, its own new K/V included (a C8 cache: attention
    then sees the same int8-rounded K/V however the prompt was chunked, as the kernels backend does).
    native_seqs: the leading sequences cpu_attention.c runs (no padded batch, mask or tiles for them)."""
    qsl, lens, bs = meta.query_start_loc, meta.seq_lens, meta.block_size
    q_lens = meta.query_lens
    decodes = _decode_batch(meta) if meta.num_decodes and not native_seqs else None
    chunks = []
    for i in range(max(meta.num_decodes, native_seqs), len(lens)):
        q, s = int(q_lens[i]), int(lens[i])
        cached = meta.block_tables is not None and meta.slot_mapping is not None and (s > q or read_cache)
        ids = meta.block_tables[i, : -(-s // bs)] if cached else None
        chunks.append(_Chunk(int(qsl[i]), q, s, ids))
    return _ReferencePlan(decodes, chunks)


def native_seqs(meta: AttentionMetadata) -> int:
    """How many leading sequences cpu_attention.c takes: the decodes, and every chunk too when all are short
    enough that its row-by-row tiles beat the tiled matmul path (q_len * seq_len <= NATIVE_CHUNK_WORK)."""
    if meta.block_tables is None or meta.slot_mapping is None:
        return 0
    if int((meta.query_lens * meta.seq_lens)[meta.num_decodes:].max(initial=0)) <= NATIVE_CHUNK_WORK:
        return len(meta.seq_lens)
    return meta.num_decodes


def native_seq_count(meta: AttentionMetadata, cache: PagedKVCache | None) -> int:
    """native_seqs where cpu_attention.c can read the cache at all (a float cache, inference, the kernels built); else
    0. A caller handing it a Paddle tensor also checks that one is host float32 (cpu_ops.serves)."""
    if cache is None or cache.quant is not None or paddle.is_grad_enabled() or not build.available():
        return 0
    return meta.derive("native_seqs", native_seqs)


def _decode_batch(meta: AttentionMetadata) -> _DecodeBatch:
    n = meta.num_decodes
    q_lens, ctx_lens = meta.query_lens[:n], meta.seq_lens[:n]
    q = int(q_lens.max())
    nb = int((-(-ctx_lens // meta.block_size)).max())
    block_ids = meta.block_tables[:n, :nb]
    starts, r = meta.query_start_loc[:n, None], np.arange(q)[None, :]
    q_index = np.where(r < q_lens[:, None], starts + r, starts)  # padding repeats the sequence's first token
    out_index = None
    if (q_lens != q).any():
        out_index = to_paddle(np.concatenate([i * q + np.arange(m) for i, m in enumerate(q_lens)]))
    i = np.arange(q)[None, :, None]
    j = np.arange(nb * meta.block_size)[None, None, :]
    qn, cn = q_lens[:, None, None], ctx_lens[:, None, None]
    visible = (j <= cn - qn + i) & (i < qn)
    visible |= (i >= qn) & (j == 0)  # padded query rows: keep one key so the row stays finite
    mask = np.where(visible, 0.0, MASKED).astype(np.float32)[:, None, None, :, :]
    return _DecodeBatch(q, to_paddle(q_index.reshape(-1)), out_index, block_ids, to_paddle(mask))


def paged_attention(
    q: paddle.Tensor,
    k: paddle.Tensor,
    v: paddle.Tensor,
    layer: int,
    meta: AttentionMetadata,
    cache: PagedKVCache | None,
    scale: float,
    kv_tile_tokens: int = KV_TILE_TOKENS,
    score_tile_elements: int = SCORE_TILE_ELEMENTS,
) -> paddle.Tensor:
    """q [T, nh, hd], k/v [T, nkv, hd] for the step's new tokens -> [T, nh*hd]."""
    if cache is not None and meta.slot_mapping is not None:
        cache.write(layer, meta.slot_mapping, k, v)
    n = native_seq_count(meta, cache) if cpu_ops.serves(q) else 0
    plan = meta.derive("reference", lambda m: _plan(m, cache is not None and cache.quant is not None, n))
    nh, hd = q.shape[1], q.shape[2]
    outs = []
    if n:
        rows = int(meta.query_start_loc[n])
        outs.append(cpu_attention.paged_attention(np.from_dlpack(q)[:rows], cache.k[layer], cache.v[layer],
                                                   meta.block_tables[:n], meta.query_start_loc[:n + 1],
                                                   meta.seq_lens[:n], scale))
    elif plan.decodes is not None:
        d = plan.decodes
        kc, vc = cache.gather(layer, d.block_ids)
        qb = paddle.index_select(q, d.q_index).reshape([-1, d.q_len, nh, hd])
        ob = batched_attention(qb, kc, vc, d.mask, scale).reshape([-1, nh * hd])
        outs.append(ob if d.out_index is None else paddle.index_select(ob, d.out_index))
    for c in plan.chunks:
        rows = slice(c.start, c.start + c.q_len)
        if c.block_ids is None:
            kv = FreshKV(k[rows], v[rows], kv_tile_tokens)
        else:
            kv = PagedKV(cache, layer, c.block_ids, max(1, kv_tile_tokens // cache.block_size))
        q_tile = max(1, score_tile_elements // (nh * kv.tile_tokens))
        outs.append(tiled_causal_attention(q[rows], kv, c.seq_len - c.q_len, scale, q_tile))
    return outs[0] if len(outs) == 1 else paddle.concat(outs, axis=0)
