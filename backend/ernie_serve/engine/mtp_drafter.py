"""MTP drafting: after a step's tokens are appended, the MTP head proposes the next k tokens of each
decoding request from the target's hidden states of that step (model/mtp.py has the head's math).

Two phases, both batched over the step's requests:
1. Catch up: every position p the step made valid (its KV computed, x_{p+1} now known) runs through the
   head with (x_{p+1}, h_p), which writes the head's KV for p. Positions with rejected drafts are not
   valid and are rewritten by a later step, as the target's own are.
2. Draft: from the head's output at the newest valid position (p = N-2, predicting x_N), draw draft 1;
   each further draft runs the head one more position on (previous draft, previous head output). Those
   positions' head KV is provisional; the scheduler's lookahead slots hold it, and the next catch-up
   overwrites it with the real values.

Greedy requests draft the argmax. Sampling requests draw from q, the head's distribution under the
request's own temperature / top-k / top-p / min-p, and keep q: the sampler's verification then applies
the speculative-sampling rule, so the output is distributed exactly as without drafts.

Both execution backends draft the same way: the executor provides the head as a DraftHead (its tensors stay
on its device; a device's logits stay there too, and only the draft tokens come to the host).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ..model.attention_metadata import AttentionMetadata
from ..sampling_params import GREEDY_EPSILON
from .request import Request
from .sampler import draw, row_filters, sampling_distribution
from .spec_decode import Drafts, StepRow, draft_limit
from ..step_contract import DeviceLogits, DraftHead, StepInput


class MTPDrafter:
    def __init__(self, head: DraftHead, num_speculative_tokens: int, max_model_len: int, max_decode_query_len: int):
        self.head = head
        self.k, self.max_model_len, self.max_decode_query_len = num_speculative_tokens, max_model_len, max_decode_query_len

    def propose(self, hidden: Any, rows: list[StepRow]) -> Drafts:
        drafts = Drafts({}, {})
        spans = []  # (request, first valid position, end, offset)
        for row in rows:
            req = row.request
            end = min(row.start + row.num_tokens, req.num_tokens - 1)
            if not req.is_finished and end > row.start:
                spans.append((req, row.start, end, row.offset))
        if not spans:
            return drafts
        spans.sort(key=lambda sp: sp[2] - sp[1] > self.max_decode_query_len)  # short queries first
        out = self._catch_up(hidden, spans)
        last_rows, reqs, limits, offset = [], [], [], 0
        for req, start, end, _ in spans:
            offset += end - start
            limit = min(self.k, draft_limit(req, self.max_model_len))
            if end == req.num_tokens - 1 and limit > 0:  # the head reached the newest token: it can draft
                last_rows.append(offset - 1)
                reqs.append(req)
                limits.append(limit)
        if not reqs:
            return drafts
        h = self.head.take(out, np.asarray(last_rows, dtype=np.int64))
        positions = np.asarray([req.num_tokens - 2 for req in reqs], dtype=np.int64)
        for j in range(max(limits)):
            tokens = self._pick(self.head.logits(h), reqs, drafts)
            live = [i for i, lim in enumerate(limits) if lim > j + 1]
            if not live:
                break
            reqs = [reqs[i] for i in live]
            limits = [limits[i] for i in live]
            positions = positions[live] + 1
            h = self._one_position(self.head.take(h, np.asarray(live, dtype=np.int64)), [tokens[i] for i in live],
                                   reqs, positions)
        return drafts

    def _catch_up(self, hidden: Any, spans) -> Any:
        ids, rows, positions, q_lens, seq_lens, tables = [], [], [], [], [], []
        for req, start, end, offset in spans:
            ids.extend(req.all_token_ids[start + 1 : end + 1])
            rows.extend(range(offset, offset + end - start))
            positions.append(np.arange(start, end))
            q_lens.append(end - start)
            seq_lens.append(end)
            tables.append(req.block_ids)
        h = self.head.take(hidden, np.asarray(rows, dtype=np.int64))
        return self._run(ids, h, np.concatenate(positions), q_lens, seq_lens, tables)

    def _one_position(self, h: Any, tokens: list[int], reqs: list[Request], positions: np.ndarray) -> Any:
        return self._run(tokens, h, positions, [1] * len(reqs), (positions + 1).tolist(), [r.block_ids for r in reqs])

    def _run(self, ids, h, positions: np.ndarray, q_lens, seq_lens, tables) -> Any:
        bs = self.head.block_size
        slots = np.concatenate([np.asarray(t, dtype=np.int64)[p // bs] * bs + p % bs for t, p in
                                zip(tables, np.split(positions, np.cumsum(q_lens)[:-1]))])
        meta = AttentionMetadata.build(q_lens, seq_lens, tables, bs, slots, int(positions.max()),
                                       self.max_decode_query_len)
        step = StepInput.for_tokens(np.asarray(ids, dtype=np.int64), positions, meta, np.zeros(0, np.int64), [])
        return self.head.run(step, h)

    @staticmethod
    def _pick(lg: "np.ndarray | DeviceLogits", reqs: list[Request], drafts: Drafts) -> list[int]:
        """One draft per request: the argmax for greedy ones, a draw from q (kept) for sampling ones, where the
        logits are (a device keeps q there too, for the verification a step later)."""
        sampling = np.array([i for i, r in enumerate(reqs) if r.sampling_params.temperature >= GREEDY_EPSILON],
                            dtype=np.int64)
        on_device = isinstance(lg, DeviceLogits)
        tokens = np.zeros(len(reqs), dtype=np.int64)
        if sampling.size < len(reqs):
            tokens = lg.argmax()[0] if on_device else lg.argmax(axis=1)
        if sampling.size:
            params = [reqs[i].sampling_params for i in sampling]
            u = np.array([reqs[i].generator.random() for i in sampling])  # one each, as draw() takes it
            if on_device:
                temperature = np.array([p.temperature for p in params], dtype=np.float32)
                tokens[sampling], qs = lg.draft(sampling, temperature, *row_filters(params, np.arange(len(params)),
                                                                                    lg.vocab_size), u)
            else:
                qs = sampling_distribution(lg[sampling], params)
                tokens[sampling] = [draw(q, ui) for q, ui in zip(qs, u)]
            for i, q in zip(sampling, qs):
                drafts.probs.setdefault(reqs[i], []).append(q)
        tokens = tokens.tolist()
        for req, tok in zip(reqs, tokens):
            drafts.token_ids.setdefault(req, []).append(tok)
        return tokens
