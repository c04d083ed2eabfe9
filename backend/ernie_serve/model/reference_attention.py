"""The reference (CPU, Paddle, fp32) attention math, in two shapes.

`batched_attention`: decodes and other short queries as one padded batch against their gathered
blocks. Scores are [B, nh, q, L] with q <= 8, so one matmul pair serves the whole batch.

`tiled_causal_attention`: one prefill chunk in tiles. A query tile meets one KV tile (a few cache
blocks) at a time and the tiles are folded with an online softmax (flash attention's running max and
sum), so memory stays at one [nh, q_tile, kv_tile] score tile: no [q, L] mask or score matrix exists.
Only tiles that straddle the causal diagonal get a mask, built for that tile alone.

Query head h reads KV head h // g (g = nh / nkv); [nh] splits as [nkv, g] without a copy.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import paddle
import paddle.nn.functional as F

from ..host_tensor import to_paddle
from .kv_cache import PagedKVCache, transpose

MASKED = -1e30  # finite, so a fully masked row stays finite (and contributes nothing once a real key arrives)


def batched_attention(q: paddle.Tensor, k: paddle.Tensor, v: paddle.Tensor, mask: paddle.Tensor,
                      scale: float) -> paddle.Tensor:
    """q [B, Q, nh, hd], k/v [B, nkv, L, hd] (contiguous), mask [B, 1, 1, Q, L] additive -> [B, Q, nh*hd].

    The single-token decode case needs no transpose at all."""
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


@dataclass
class FreshKV:
    """A chunk's own K/V ([n, nkv, hd], rows of the step): nothing of its sequence is cached before it."""

    k: paddle.Tensor
    v: paddle.Tensor
    tile_tokens: int

    @property
    def num_heads(self) -> int:
        return self.k.shape[1]

    def tile(self, start: int, stop: int) -> tuple[paddle.Tensor, paddle.Tensor, int]:
        """Keys [start, end) heads-major ([nkv, n, hd]) and end, with end <= stop."""
        end = min(stop, start + self.tile_tokens)
        return transpose(self.k[start:end], [1, 0, 2]), transpose(self.v[start:end], [1, 0, 2]), end


@dataclass
class PagedKV:
    """A sequence's K/V in cache blocks, read (and, for the C8 cache, dequantized) one tile of blocks at a time."""

    cache: PagedKVCache
    layer: int
    block_ids: np.ndarray  # [nb] the blocks holding the sequence's keys, in order
    tile_blocks: int

    @property
    def num_heads(self) -> int:
        return self.cache.num_kv_heads

    @property
    def tile_tokens(self) -> int:
        return self.tile_blocks * self.cache.block_size

    def tile(self, start: int, stop: int) -> tuple[paddle.Tensor, paddle.Tensor, int]:
        """Keys [start, end) of whole blocks (start is block-aligned), so end may pass stop."""
        bs = self.cache.block_size
        first = start // bs
        last = min(first + self.tile_blocks, -(-stop // bs))
        k, v = self.cache.gather(self.layer, self.block_ids[None, first:last])
        shape = [self.cache.num_kv_heads, (last - first) * bs, self.cache.head_dim]
        return k.reshape(shape), v.reshape(shape), last * bs


def tiled_causal_attention(q: paddle.Tensor, kv: FreshKV | PagedKV, first_position: int, scale: float,
                           q_tile: int) -> paddle.Tensor:
    """q [n, nh, hd]: queries at positions first_position .. first_position + n - 1, each seeing keys up to
    its own position; kv serves keys from 0. Returns [n, nh*hd]."""
    n, nh, hd = q.shape
    nkv = kv.num_heads
    g = nh // nkv
    outs = []
    for qa in range(0, n, q_tile):
        nq = min(n, qa + q_tile) - qa
        top = first_position + qa  # the tile's first query sees keys < top + 1; its last sees keys < stop
        stop = top + nq
        qt = transpose((q[qa : qa + nq] * scale).reshape([nq, nkv, g, hd]), [1, 2, 0, 3]).reshape([nkv, g * nq, hd])
        m = l = acc = None
        ka = 0
        while ka < stop:  # key 0 is in the first tile and every query sees it: no row starts fully masked
            kt, vt, kb = kv.tile(ka, stop)
            s = paddle.matmul(qt, kt, transpose_y=True)  # [nkv, g*nq, kb-ka]
            if kb - 1 > top:  # the tile straddles the diagonal (or passes the last key): mask what is unseen
                s = (s.reshape([nkv, g, nq, kb - ka]) + _diagonal_mask(top, nq, ka, kb)).reshape([nkv, g * nq, -1])
            # The result does not depend on the running max (it cancels between numerator and sum), so
            # it needs no gradient; Paddle's CPU backward of max made fitting the demo model many times slower.
            m_tile = paddle.max(s.detach(), axis=-1, keepdim=True)
            if acc is None:
                m = m_tile
                p = paddle.exp(s - m)
                l = paddle.sum(p, axis=-1, keepdim=True)
                acc = paddle.matmul(p, vt)
            else:
                m_new = paddle.maximum(m, m_tile)
                alpha = paddle.exp(m - m_new)
                p = paddle.exp(s - m_new)
                l = l * alpha + paddle.sum(p, axis=-1, keepdim=True)
                acc = acc * alpha + paddle.matmul(p, vt)
                m = m_new
            ka = kb
        o = (acc / l).reshape([nkv, g, nq, hd])
        outs.append(transpose(o, [2, 0, 1, 3]).reshape([nq, nh * hd]))
    return outs[0] if len(outs) == 1 else paddle.concat(outs, axis=0)


def _diagonal_mask(top: int, nq: int, ka: int, kb: int) -> paddle.Tensor:
    """[nq, kb-ka] additive: query i (at position top + i) sees key j iff j <= top + i."""
    visible = np.arange(ka, kb)[None, :] <= top + np.arange(nq)[:, None]
    return to_paddle(np.where(visible, 0.0, MASKED).astype(np.float32))
