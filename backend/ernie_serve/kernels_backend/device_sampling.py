"""Sampling where the kernels backend computed the logits: only token ids (and each row's largest logit) cross to
the host, instead of R x vocab floats a step.

KernelLogits is the sampler's DeviceLogits for this backend (engine/sampler.py decides per batch whether it may
sample here: no sampled draft to verify). The penalties and the bad-words / min_tokens masks come as the host's
LogitEdits, a few (row, token) entries applied here by one gather and one scatter; a guided row's grammar mask
comes as its bias row; logprobs leave as TopLogprobs (each asking row's sampled logprob and rank, and its top n),
not as the log-softmax. The draw is the host's "base" method, written
once over TensorOps' row-wise ops so that torch and Paddle run the same code: softmax at the row's temperature, a
descending sort, the top-k / top-p / min-p rule of the sampler's module doc (membership by probability values, ties
alike), and the inverse CDF over the kept tokens in that order at a uniform the host drew from the row's generator.
So a seed draws the same token here as on the host except where float rounding moves a boundary.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ..engine.sampler import DeviceLogits, LogitEdits, TopLogprobs
from .framework import TensorOps


class KernelLogits(DeviceLogits):
    def __init__(self, logits: Any, ops: TensorOps):
        self.logits, self.ops = logits, ops
        self.raw = logits  # logprobs are of the logits before the penalties and masks (edit replaces self.logits)

    @property
    def vocab_size(self) -> int:
        return int(self.logits.shape[1])

    def numpy(self) -> np.ndarray:
        return self.ops.to_host(self.logits)

    def edit(self, edits: LogitEdits) -> None:
        ops = self.ops
        x = ops.cast(self.logits, "float32")
        rows, vocab = int(x.shape[0]), int(x.shape[1])
        flat = x.reshape([-1])
        keys = ops.tensor(edits.rows * vocab + edits.tokens)
        v = ops.rows(flat, keys)
        rep, sub = ops.tensor(edits.repetition), ops.tensor(edits.subtract)
        v = ops.where(v > 0, v / rep, v * rep) - sub
        v = ops.where(ops.tensor(edits.masked), ops.tensor(np.full(edits.masked.shape, -np.inf, np.float32)), v)
        self.logits = ops.put_rows(flat, keys, v).reshape([rows, vocab])

    def add_rows(self, rows: np.ndarray, bias: np.ndarray) -> None:
        ops = self.ops
        x = ops.cast(self.logits, "float32")
        index = ops.tensor(rows)
        self.logits = ops.put_rows(x, index, ops.rows(x, index) + ops.tensor(bias))

    def top_logprobs(self, rows: np.ndarray, token_ids: np.ndarray, n: int) -> TopLogprobs:
        ops = self.ops
        lp = ops.log_softmax_rows(ops.cast(ops.rows(self.raw, ops.tensor(rows)), "float32"))
        sampled = ops.take_rows(lp, ops.tensor(token_ids.reshape(-1, 1)))
        rank = ops.sum_rows(ops.cast(lp > sampled, "int64")) + 1
        top, top_ids = ops.sort_rows_desc(lp)
        return TopLogprobs(self._host(sampled), self._host(rank).astype(np.int64),
                           ops.to_host(top_ids[:, :n]).astype(np.int64), ops.to_host(top[:, :n]))

    def argmax(self) -> tuple[np.ndarray, np.ndarray]:
        x = self.ops.cast(self.logits, "float32")
        return self._host(self.ops.argmax_rows(x)).astype(np.int64), self._host(self.ops.max_rows(x))

    def sample(self, greedy: np.ndarray, temperature: np.ndarray, top_k: np.ndarray, top_p: np.ndarray,
               min_p: np.ndarray, u: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        ops = self.ops
        x = ops.cast(self.logits, "float32")
        columns = ops.arange(x.shape[1])
        col = lambda a, dtype: ops.tensor(np.asarray(a).reshape(-1, 1), dtype)  # noqa: E731 (a [R, 1] column)
        probs = ops.softmax_rows(x / col(temperature, "float32"))
        u_, min_p_ = col(u, "float64"), col(min_p, "float64")
        # rows with neither top-k nor top-p draw in token order, unsorted, as the host's do
        p = ops.cast(probs, "float64")
        plain = self._draw(ops.where(p >= min_p_ * ops.max_rows(p), p, p * 0.0), u_, columns)
        # the others on a descending sort
        q32, order = ops.sort_rows_desc(probs)
        q = ops.cast(q32, "float64")
        idx = order * 0 + columns  # [R, V] column numbers
        # tokens strictly more probable than each (the first index of its tie group), and their mass
        prev = ops.take_rows(q, ops.where(idx > 0, idx - 1, idx))
        n_greater = ops.cummax_rows(ops.where((q != prev) | (idx == 0), idx, idx * 0))
        mass_greater = ops.take_rows(ops.cumsum_rows(q) - q, n_greater)
        k, zero = col(top_k, "int64"), q * 0.0
        in_k = (k == 0) | (n_greater < k)
        z_k = ops.where(k > 0, ops.sum_rows(ops.where(in_k, q, zero)), ops.sum_rows(q))
        top_p_ = col(top_p, "float64")
        in_p = (top_p_ >= 1.0) | (mass_greater < top_p_ * z_k)
        in_min = q >= min_p_ * q[:, :1]
        kept = in_k & in_p & in_min
        drawn = ops.take_rows(order, self._draw(ops.where(kept, q, zero), u_, idx))
        tokens = ops.where(col((top_k > 0) | (top_p < 1.0), "bool"), drawn, plain)
        tokens = ops.where(col(greedy, "bool"), ops.argmax_rows(x), tokens)
        return self._host(tokens).astype(np.int64), self._host(ops.max_rows(x))

    def _draw(self, weights: Any, u: Any, idx: Any) -> Any:
        """[R, 1] column of each row's index i with cdf[i-1] <= u * total < cdf[i] (the host's _inverse_cdf): never
        a zero-weight entry; a row with no weight at all (no finite logit) gets 0, and is reported dead."""
        ops = self.ops
        cdf = ops.cumsum_rows(weights)
        pos = ops.sum_rows(ops.cast(cdf <= u * cdf[:, -1:], "int64"))
        last = ops.max_rows(ops.where(weights > 0, idx, idx * 0 - 1))
        pos = ops.where(pos > last, last, pos)
        return ops.where(pos < 0, pos * 0, pos)

    def _host(self, t: Any) -> np.ndarray:
        return self.ops.to_host(t).reshape(-1)
