"""The replayed ids as DeviceLogits: the engine's sampler takes its usual device path (penalties, grammar masks,
the generators' uniforms drawn per row, logprob rows), and every draw answers the replayed id. A logit the host
masks out (a grammar, min_tokens holding EOS back, bad words) is honoured: the row then takes the lowest id still
allowed, as a device argmax over a row of equal logits would. Logprobs are those of a certain replay: 0 for the
replayed id, -9999 for the rest (vLLM's figure for a token that cannot be drawn)."""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

from ..step_contract import DeviceLogits, LogitEdits, TopLogprobs

IMPOSSIBLE_LOGPROB = -9999.0


class ReplayLogits(DeviceLogits):
    def __init__(self, token_ids: np.ndarray, vocab_size: int):
        self.token_ids = np.array(token_ids, dtype=np.int64)
        self.row_max = np.zeros(self.token_ids.size, dtype=np.float32)  # -inf: the row has no token left
        self._vocab = vocab_size

    @property
    def vocab_size(self) -> int:
        return self._vocab

    def numpy(self) -> np.ndarray:
        out = np.full((self.token_ids.size, self._vocab), -np.inf, dtype=np.float32)
        out[np.arange(self.token_ids.size), self.token_ids] = 0.0
        return out

    def take(self, rows: np.ndarray) -> "ReplayLogits":
        return ReplayLogits(self.token_ids[rows], self._vocab)

    def edit(self, edits: LogitEdits) -> None:
        hit = edits.masked & (edits.tokens == self.token_ids[edits.rows])
        for row in np.unique(edits.rows[hit]).tolist():
            masked = set(edits.tokens[(edits.rows == row) & edits.masked].tolist())
            self.token_ids[row] = next(i for i in range(self._vocab + 1) if i not in masked)
            if self.token_ids[row] >= self._vocab:
                self.row_max[row] = -np.inf

    def add_rows(self, rows: np.ndarray, bias: np.ndarray) -> None:
        for i, row in enumerate(rows.tolist()):
            allowed = bias[i] > -np.inf
            if not allowed[self.token_ids[row]]:
                if allowed.any():
                    self.token_ids[row] = int(np.argmax(allowed))
                else:
                    self.row_max[row] = -np.inf

    def argmax(self) -> tuple[np.ndarray, np.ndarray]:
        return self.token_ids.copy(), self.row_max.copy()

    def top_logprobs(self, rows: np.ndarray, token_ids: np.ndarray, n: int) -> TopLogprobs:
        token_ids = np.asarray(token_ids, dtype=np.int64)
        replayed = self.token_ids[rows]
        top_ids = (replayed[:, None] + np.arange(n)) % self._vocab
        top = np.full(top_ids.shape, IMPOSSIBLE_LOGPROB, dtype=np.float32)
        top[:, :1] = 0.0
        chosen = token_ids == replayed
        return TopLogprobs(np.where(chosen, 0.0, IMPOSSIBLE_LOGPROB).astype(np.float32),
                           np.where(chosen, 1, 2).astype(np.int64), top_ids, top)

    def sample(self, greedy: np.ndarray, temperature: np.ndarray, top_k: np.ndarray, top_p: np.ndarray,
               min_p: np.ndarray, u: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return self.argmax()

    def sample_rejection(self, greedy: np.ndarray, temperature: np.ndarray, top_k: np.ndarray, top_p: np.ndarray,
                         min_p: np.ndarray,
                         uniforms: Callable[[np.ndarray], np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        live = np.flatnonzero(~greedy)
        if live.size:
            uniforms(live)  # one round, as a device's first draw takes from each sampling row's generator
        return self.argmax()

    def draft(self, rows: np.ndarray, temperature: np.ndarray, top_k: np.ndarray, top_p: np.ndarray,
              min_p: np.ndarray, u: np.ndarray) -> tuple[np.ndarray, list[Any]]:
        raise NotImplementedError("the simulated backend drafts nothing (speculative decoding is refused)")

    def verify(self, rows: np.ndarray, temperature: np.ndarray, top_k: np.ndarray, top_p: np.ndarray,
               min_p: np.ndarray, draft_tokens: np.ndarray, draft_probs: list[Any], u_accept: np.ndarray,
               u_residual: np.ndarray) -> np.ndarray:
        raise NotImplementedError("the simulated backend verifies no drafts (speculative decoding is refused)")
