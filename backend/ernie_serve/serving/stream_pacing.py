"""When a stream's next response goes out: coalescing by tokens and time, and pacing by the detokenizer's progress.

A policy over plain numbers, so it is tested without threads (tests/serving/test_stream_pacing.py); the response
loop (response_loop.py) asks it after every engine step and when a deadline it gave passes.

The rules, in order:
1. A final response goes at once, and so does a stream's first response (time to first token is never held).
2. Pacing: a paced stream (the ensemble's detokenizer reports its progress) whose detokenizer has `window`
   responses or more still to process waits for a report, at most `max_hold_seconds` from when its tokens were
   ready (a lost report, or a detokenizer that far behind). While it waits its tokens coalesce, so a lagging
   detokenizer gets fewer, larger responses instead of a queue that grows.
3. Coalescing: otherwise the response goes once the stream holds `interval_tokens` tokens (FastDeploy's
   --stream-interval) and `coalesce_seconds` have passed since its previous response.

Tokens are never dropped or reordered: a response carries every token held since the previous one.
The bound on the gap between two responses of a running stream: coalesce_seconds plus one engine step, or
max_hold_seconds while its detokenizer lags (and a stream_interval above 1 waits for that many tokens).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StreamClock:
    """What the policy reads of one stream."""

    sent: int = 0  # responses sent
    processed: int = 0  # responses its detokenizer reported processed
    paced: bool = False
    pending_tokens: int = 0  # held, not sent yet
    pending_since: float = 0.0  # when the oldest held token arrived
    last_sent_at: float = float("-inf")
    final: bool = False  # the request has ended: the held tokens go with its final response


@dataclass(frozen=True)
class PacingPolicy:
    interval_tokens: int = 1
    coalesce_seconds: float = 0.0
    window: int = 2
    max_hold_seconds: float = 0.5

    def due_at(self, s: StreamClock) -> float | None:
        """When the held tokens may go: a time (at or before now: at once), or None (wait for more tokens)."""
        if s.final or s.sent == 0:
            return s.pending_since if (s.final or s.pending_tokens) else None
        if s.pending_tokens == 0:
            return None
        if self.lagging(s):
            return s.pending_since + self.max_hold_seconds
        if s.pending_tokens < self.interval_tokens:
            return None
        return max(s.pending_since, s.last_sent_at + self.coalesce_seconds)

    def lagging(self, s: StreamClock) -> bool:
        """Whether a paced stream's detokenizer is `window` responses or more behind what was sent."""
        return s.paced and s.sent - s.processed >= self.window
