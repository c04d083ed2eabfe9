"""Sampling where the kernels backend computed the logits: only token ids (and each row's largest logit, and the
asked-for logprobs) cross to the host, instead of R x vocab floats a step.

KernelLogits is the sampler's DeviceLogits for this backend (engine/sampler.py samples every batch through it). The
logit bias, penalties and bad-words / min_tokens masks come as the host's LogitEdits, a few (row, token) entries
applied here by one gather and one scatter; a guided row's grammar mask comes as its bias row; logprobs leave as
TopLogprobs (each asking row's sampled logprob and rank, and its top n), not as the log-softmax. The draws are the
host's methods, written once over TensorOps' row-wise ops so that torch and Paddle run the same code: "base" is
softmax at the row's temperature, a descending sort, the top-k / top-p / min-p rule of the sampler's module doc
(membership by probability values, ties alike) and the inverse CDF over the kept tokens in that order at a uniform
the host drew from the row's generator; "rejection" its sort-free rounds. MTP drafts are drawn here from q and q
stays here, one [1, V] row per draft, until the next step verifies the draft against p by the speculative-sampling
rule. So a seed draws the same tokens here as on the host except where float rounding moves a boundary.
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

from .. import step_contract
from ..step_contract import DeviceLogits, LogitEdits, TopLogprobs
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

    def take(self, rows: np.ndarray) -> "KernelLogits":
        rows = np.asarray(rows, dtype=np.int64)
        if rows.size and (np.diff(rows) == 1).all():  # a run (a step's sampled or prompt rows): a view, not a copy
            return KernelLogits(self.raw[int(rows[0]):int(rows[-1]) + 1], self.ops)  # every op here returns new tensors
        return KernelLogits(self.ops.rows(self.raw, self.ops.tensor(rows)), self.ops)

    def edit(self, edits: LogitEdits) -> None:
        ops = self.ops
        x = ops.cast(self.logits, "float32")
        rows, vocab = int(x.shape[0]), int(x.shape[1])
        flat = x.reshape([-1])
        keys = ops.tensor(edits.rows * vocab + edits.tokens)
        v = ops.rows(flat, keys) + ops.tensor(edits.bias)
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
        """A few rows at a time (step_contract.LOGPROB_ROWS_AT_ONCE): a long prompt's logprobs would otherwise take
        several [rows, vocab] float32 and int64 temporaries at once, memory the KV sizing never counted."""
        rows, token_ids = np.asarray(rows, dtype=np.int64), np.asarray(token_ids, dtype=np.int64).reshape(-1)
        step = step_contract.LOGPROB_ROWS_AT_ONCE
        parts = [self._top_logprobs(rows[lo:lo + step], token_ids[lo:lo + step], n)
                 for lo in range(0, max(len(rows), 1), step)]
        return TopLogprobs(*(np.concatenate([getattr(p, f) for p in parts])
                             for f in ("sampled", "sampled_rank", "top_ids", "top")))

    def _top_logprobs(self, rows: np.ndarray, token_ids: np.ndarray, n: int) -> TopLogprobs:
        ops = self.ops
        lp = ops.log_softmax_rows(ops.cast(ops.rows(self.raw, ops.tensor(rows)), "float32"))
        sampled = ops.take_rows(lp, ops.tensor(token_ids.reshape(-1, 1)))
        rank = ops.sum_rows(ops.cast(lp > sampled, "int64")) + 1
        if n > 0 and len(rows):
            top, top_ids = (ops.to_host(a) for a in ops.topk_rows(lp, n))
        else:
            top, top_ids = np.zeros((len(rows), 0), np.float32), np.zeros((len(rows), 0), np.int64)
        return TopLogprobs(self._host(sampled), self._host(rank).astype(np.int64), top_ids.astype(np.int64),
                           top.astype(np.float32))

    def argmax(self) -> tuple[np.ndarray, np.ndarray]:
        x = self.ops.cast(self.logits, "float32")
        return self._host(self.ops.argmax_rows(x)).astype(np.int64), self._host(self.ops.max_rows(x))

    def sample(self, greedy: np.ndarray, temperature: np.ndarray, top_k: np.ndarray, top_p: np.ndarray,
               min_p: np.ndarray, u: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        ops = self.ops
        x = ops.cast(self.logits, "float32")
        columns = ops.arange(x.shape[1])
        probs = ops.softmax_rows(x / _column(ops, temperature, "float32"))
        u_ = _column(ops, u, "float64")
        tokens = ops.argmax_rows(x)  # greedy rows keep it
        needs_sort = (top_k > 0) | (top_p < 1.0)
        if (~greedy & ~needs_sort).any():  # neither top-k nor top-p: drawn in token order, unsorted, as the host does
            p = ops.cast(probs, "float64")
            plain = self._draw(ops.where(p >= _column(ops, min_p, "float64") * ops.max_rows(p), p, p * 0.0), u_,
                               columns)
            tokens = ops.where(_column(ops, ~greedy & ~needs_sort, "bool"), plain, tokens)
        if (~greedy & needs_sort).any():  # the others on a descending sort (a batch without them sorts nothing)
            q, order, kept = self._kept_sorted(probs, top_k, top_p, min_p)
            drawn = ops.take_rows(order, self._draw(ops.where(kept, q, q * 0.0), u_, order * 0 + columns))
            tokens = ops.where(_column(ops, ~greedy & needs_sort, "bool"), drawn, tokens)
        return self._host(tokens).astype(np.int64), self._host(ops.max_rows(x))

    def sample_rejection(self, greedy: np.ndarray, temperature: np.ndarray, top_k: np.ndarray, top_p: np.ndarray,
                         min_p: np.ndarray, uniforms: Callable[[np.ndarray], np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        ops = self.ops
        x = ops.cast(self.logits, "float32")
        tokens = self._host(ops.argmax_rows(x)).astype(np.int64)
        row_max = self._host(ops.max_rows(x))
        rows = np.flatnonzero(~greedy & np.isfinite(row_max))  # a dead row is reported, not sampled
        if not rows.size:
            return tokens, row_max
        # comparisons in float64 of the float32 probabilities, as the host compares them
        p = ops.cast(ops.softmax_rows(ops.rows(x, ops.tensor(rows)) / _column(ops, temperature[rows], "float32")),
                     "float64")
        zero, columns = p * 0.0, ops.arange(p.shape[1])
        k = _column(ops, top_k[rows], "int64")
        z_k = ops.sum_rows(p)
        if (top_k[rows] > 0).any():  # top-p is measured on the top-k mass: every token at least as probable as the k-th
            kth = ops.take_rows(ops.sort_rows_desc(p)[0], ops.where(k > 0, k - 1, k))
            z_k = ops.where(k > 0, ops.sum_rows(ops.where(p >= kth, p, zero)), z_k)
        top_p_ = _column(ops, top_p[rows], "float64")
        limit = top_p_ * z_k
        weights = ops.where(p >= _column(ops, min_p[rows], "float64") * ops.max_rows(p), p, zero)  # the candidates
        live = np.ones(rows.size, dtype=bool)
        for _ in range(p.shape[1] + 1):
            if not live.any():
                return tokens, row_max
            u = np.zeros(rows.size)
            u[live] = uniforms(rows[live])
            pick = self._draw(weights, _column(ops, u, "float64"), columns)
            greater = p > ops.take_rows(p, pick)
            ok = (k == 0) | (ops.sum_rows(ops.cast(greater, "int64")) < k)
            ok = ok & ((top_p_ >= 1.0) | (ops.sum_rows(ops.where(greater, p, zero)) < limit))
            accepted = live & self._host(ok).astype(bool)
            tokens[rows[accepted]] = self._host(pick)[accepted]
            live &= ~accepted
            weights = ops.where(greater, weights, zero)  # a rejected row keeps only the tokens above its pick
        raise RuntimeError(f"rejection sampling did not converge for rows {rows[live].tolist()}")

    def draft(self, rows: np.ndarray, temperature: np.ndarray, top_k: np.ndarray, top_p: np.ndarray,
              min_p: np.ndarray, u: np.ndarray) -> tuple[np.ndarray, list[Any]]:
        ops = self.ops
        q = self._filtered(rows, temperature, top_k, top_p, min_p)
        tokens = self._draw(q, _column(ops, u, "float64"), ops.arange(q.shape[1]))
        q = ops.cast(q, "float32")  # as the host keeps it
        return self._host(tokens).astype(np.int64), [q[i:i + 1] for i in range(len(rows))]

    def verify(self, rows: np.ndarray, temperature: np.ndarray, top_k: np.ndarray, top_p: np.ndarray,
               min_p: np.ndarray, draft_tokens: np.ndarray, draft_probs: list[Any], u_accept: np.ndarray,
               u_residual: np.ndarray) -> np.ndarray:
        ops = self.ops
        p = self._filtered(rows, temperature, top_k, top_p, min_p)
        q = ops.cast(ops.concat_rows([ops.tensor(np.asarray(d, np.float32).reshape(1, -1))
                                      if isinstance(d, np.ndarray) else d for d in draft_probs]), "float64")
        d = _column(ops, draft_tokens, "int64")
        accept = _column(ops, u_accept, "float64") * ops.take_rows(q, d) < ops.take_rows(p, d)
        residual = p - q
        residual = ops.where(residual > 0, residual, residual * 0.0)
        # p == q up to rounding: a rejection has probability ~0; draw from p to stay exact
        residual = ops.where(ops.sum_rows(residual) > 0, residual, p)
        drawn = self._draw(residual, _column(ops, u_residual, "float64"), ops.arange(p.shape[1]))
        return self._host(ops.where(accept, d, drawn)).astype(np.int64)

    def _kept_sorted(self, probs: Any, top_k: np.ndarray, top_p: np.ndarray, min_p: np.ndarray) -> tuple[Any, Any, Any]:
        """(probs sorted descending as float64, their token ids, which survive top-k / top-p / min-p): the rule of
        the sampler's module doc, membership by probability values (ties alike), so `kept` is a prefix."""
        ops = self.ops
        q32, order = ops.sort_rows_desc(probs)
        q = ops.cast(q32, "float64")
        idx = order * 0 + ops.arange(probs.shape[1])  # [R, V] column numbers
        # tokens strictly more probable than each (the first index of its tie group), and their mass
        prev = ops.take_rows(q, ops.where(idx > 0, idx - 1, idx))
        n_greater = ops.cummax_rows(ops.where((q != prev) | (idx == 0), idx, idx * 0))
        mass_greater = ops.take_rows(ops.cumsum_rows(q) - q, n_greater)
        k, zero = _column(ops, top_k, "int64"), q * 0.0
        in_k = (k == 0) | (n_greater < k)
        z_k = ops.where(k > 0, ops.sum_rows(ops.where(in_k, q, zero)), ops.sum_rows(q))
        top_p_ = _column(ops, top_p, "float64")
        in_p = (top_p_ >= 1.0) | (mass_greater < top_p_ * z_k)
        in_min = q >= _column(ops, min_p, "float64") * q[:, :1]
        return q, order, in_k & in_p & in_min

    def _filtered(self, rows: np.ndarray, temperature: np.ndarray, top_k: np.ndarray, top_p: np.ndarray,
                  min_p: np.ndarray) -> Any:
        """float64 [len(rows), V]: the rows' distributions restricted to their kept sets and renormalized, in token
        order (the host's filtered_distribution). The kept set is every token at least as probable as its least
        probable member, so no scatter back from the sorted order is needed."""
        ops = self.ops
        x = ops.rows(ops.cast(self.logits, "float32"), ops.tensor(np.asarray(rows, dtype=np.int64)))
        probs = ops.softmax_rows(x / _column(ops, temperature, "float32"))
        q, _, kept = self._kept_sorted(probs, top_k, top_p, min_p)
        n = ops.sum_rows(ops.cast(kept, "int64"))
        least = ops.take_rows(q, ops.where(n > 0, n - 1, n * 0))
        p = ops.cast(probs, "float64")
        p = ops.where(p >= least, p, p * 0.0)
        return p / ops.sum_rows(p)

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


def _column(ops: TensorOps, a: Any, dtype: str) -> Any:
    """A host vector as an [R, 1] device column, to broadcast against [R, V] rows."""
    return ops.tensor(np.asarray(a).reshape(-1, 1), dtype)
