"""GQA attention over the paged KV cache.

A step's tokens arrive flattened ([T, ...], sequence after sequence). The model runner orders them
so that sequences computing few tokens (decodes, speculative verification) come first: those run
as one padded batch against their gathered cache blocks. Longer chunks (prefills) follow and run
one sequence at a time, attending to their fresh K/V directly when nothing of them is cached yet.
Every causal rule is the same: query i of a sequence with `context_len` visible tokens and `q_len`
new ones sees keys j <= context_len - q_len + i.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import paddle
import paddle.nn.functional as F

from .kv_cache import PagedKVCache, transpose

_MASKED = -1e30  # finite, so a fully padded row gives a (discarded) uniform row instead of NaN


@dataclass
class BatchedAttention:
    """Sequences with short queries, padded to q_len each; they occupy the first num_tokens tokens."""

    num_tokens: int
    q_len: int
    q_index: paddle.Tensor  # [B*q_len] rows of the step's tokens (padding repeats a valid row)
    out_index: paddle.Tensor | None  # [num_tokens] rows of the padded output; None when no padding
    block_ids: np.ndarray  # [B, nb]
    mask: paddle.Tensor  # [B, 1, 1, q_len, nb*block_size] additive


@dataclass
class PrefillAttention:
    start: int
    q_len: int
    context_len: int
    block_ids: np.ndarray | None  # None: no cached context, attend to the chunk's own K/V
    mask: paddle.Tensor | None = None  # [1, 1, 1, q_len, L] additive, built once per step


@dataclass
class AttentionMetadata:
    slot_mapping: np.ndarray | None  # [T] cache slot of every new token; None when not caching
    batched: BatchedAttention | None = None
    prefills: list[PrefillAttention] = field(default_factory=list)
    max_position: int = 0

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        context_lens: list[int],
        block_tables: list[list[int]] | None,
        block_size: int,
        slot_mapping: np.ndarray | None,
        max_position: int,
        max_batched_q: int = 8,
    ) -> "AttentionMetadata":
        """Describe one step. Sequences must be ordered short queries first (see module docstring)."""
        meta = cls(slot_mapping=slot_mapping, max_position=max_position)
        n_short = 0
        while n_short < len(query_lens) and query_lens[n_short] <= max_batched_q and block_tables is not None:
            n_short += 1
        if n_short:
            meta.batched = _build_batched(query_lens[:n_short], context_lens[:n_short],
                                          block_tables[:n_short], block_size)
        start = sum(query_lens[:n_short])
        for i in range(n_short, len(query_lens)):
            q, c = query_lens[i], context_lens[i]
            ids = None
            if c > q:  # part of the context is cached: read it (with the new tokens) from the cache
                nb = -(-c // block_size)
                ids = np.asarray(block_tables[i][:nb], dtype=np.int64)[None, :]
            length = c if ids is None else ids.shape[1] * block_size
            meta.prefills.append(PrefillAttention(start, q, c, ids, _causal_mask([q], [c], q, length)))
            start += q
        return meta


def _build_batched(q_lens: list[int], ctx_lens: list[int], tables: list[list[int]], block_size: int):
    b, q = len(q_lens), max(q_lens)
    nb = max(-(-c // block_size) for c in ctx_lens)
    block_ids = np.zeros((b, nb), dtype=np.int64)
    for i, c in enumerate(ctx_lens):
        n = -(-c // block_size)
        block_ids[i, :n] = tables[i][:n]
    starts = np.concatenate([[0], np.cumsum(q_lens)[:-1]]).astype(np.int64)
    q_index = np.zeros((b, q), dtype=np.int64)
    for i, (s, n) in enumerate(zip(starts, q_lens)):
        q_index[i, :n] = np.arange(s, s + n)
        q_index[i, n:] = s  # padding repeats the sequence's first token
    padded = any(n != q for n in q_lens)
    out_index = None
    if padded:
        out_index = paddle.to_tensor(np.concatenate([i * q + np.arange(n) for i, n in enumerate(q_lens)]))
    mask = _causal_mask(q_lens, ctx_lens, q, nb * block_size)
    return BatchedAttention(sum(q_lens), q, paddle.to_tensor(q_index.reshape(-1)), out_index, block_ids, mask)


def _causal_mask(q_lens: list[int], ctx_lens: list[int], q: int, length: int) -> paddle.Tensor:
    i = np.arange(q)[None, :, None]
    j = np.arange(length)[None, None, :]
    qn = np.asarray(q_lens)[:, None, None]
    cn = np.asarray(ctx_lens)[:, None, None]
    visible = (j <= cn - qn + i) & (i < qn)
    visible |= (i >= qn) & (j == 0)  # padded query rows: keep one key so the row stays finite
    mask = np.where(visible, 0.0, _MASKED).astype(np.float32)
    return paddle.to_tensor(mask[:, None, None, :, :])


def _sdpa(q: paddle.Tensor, k: paddle.Tensor, v: paddle.Tensor, mask: paddle.Tensor, scale: float) -> paddle.Tensor:
    """q [B, Q, nh, hd], k/v [B, nkv, L, hd] (contiguous), mask [B, 1, 1, Q, L] -> [B, Q, nh*hd].

    Query head h reads KV head h // g (g = nh / nkv), so [nh] splits as [nkv, g] without a copy;
    the single-token decode case needs no transpose at all.
    """
    b, qn, nh, hd = q.shape
    nkv = k.shape[1]
    g = nh // nkv
    if qn == 1:
        qh = q.reshape([b, nkv, g, hd])
    else:
        qh = transpose(q.reshape([b, qn, nkv, g, hd]), [0, 2, 3, 1, 4]).reshape([b, nkv, g * qn, hd])
    scores = paddle.matmul(qh, k, transpose_y=True) * scale  # [B, nkv, g*Q, L]
    scores = scores.reshape([b, nkv, g, qn, -1]) + mask
    probs = F.softmax(scores, axis=-1).reshape([b, nkv, g * qn, -1])
    out = paddle.matmul(probs, v)  # [B, nkv, g*Q, hd]
    if qn == 1:
        return out.reshape([b, 1, nh * hd])
    return transpose(out.reshape([b, nkv, g, qn, hd]), [0, 3, 1, 2, 4]).reshape([b, qn, nh * hd])


def paged_attention(
    q: paddle.Tensor,
    k: paddle.Tensor,
    v: paddle.Tensor,
    layer: int,
    meta: AttentionMetadata,
    cache: PagedKVCache | None,
    scale: float,
) -> paddle.Tensor:
    """q [T, nh, hd], k/v [T, nkv, hd] for the step's new tokens -> [T, nh*hd]."""
    if cache is not None and meta.slot_mapping is not None:
        cache.write(layer, meta.slot_mapping, k, v)
    outs = []
    if meta.batched is not None:
        bt = meta.batched
        kc, vc = cache.gather(layer, bt.block_ids)
        qb = paddle.index_select(q, bt.q_index).reshape([-1, bt.q_len, q.shape[1], q.shape[2]])
        ob = _sdpa(qb, kc, vc, bt.mask, scale).reshape([-1, q.shape[1] * q.shape[2]])
        outs.append(ob if bt.out_index is None else paddle.index_select(ob, bt.out_index))
    for p in meta.prefills:
        qp = q[p.start : p.start + p.q_len].unsqueeze(0)
        if p.block_ids is None:
            kp = transpose(k[p.start : p.start + p.q_len], [1, 0, 2]).unsqueeze(0)
            vp = transpose(v[p.start : p.start + p.q_len], [1, 0, 2]).unsqueeze(0)
        else:
            kp, vp = cache.gather(layer, p.block_ids)
        outs.append(_sdpa(qp, kp, vp, p.mask, scale)[0])
    return outs[0] if len(outs) == 1 else paddle.concat(outs, axis=0)
