"""How many generation requests the shim serves at once (--max-concurrency), and what happens to the next one."""
from __future__ import annotations

import asyncio
import collections

from .errors import OpenAIError
from .metrics import Metrics


class ConcurrencySlots:
    """At most `limit` generation requests at once. The next one is refused at once (429), or, with
    `max_wait` (FastDeploy's --max-waiting-time), waits its turn for a slot that many seconds (-1: without
    limit) and is refused with 408 if none comes. Waiters are served first come, first served."""

    def __init__(self, limit: int, metrics: Metrics, max_wait: float | None = None, bound: str | None = None):
        """`bound`: how the refusals name the limit (default `--max-concurrency <limit>`; with --workers, the
        total and each worker's share)."""
        self.limit, self.max_wait, self.metrics = limit, max_wait, metrics
        self.bound = bound or f"--max-concurrency {limit}"
        self.active = 0
        self._queue: collections.deque[asyncio.Future] = collections.deque()

    @property
    def waiting(self) -> int:
        """Requests waiting for a slot (--max-waiting-time)."""
        return len(self._queue)

    async def acquire(self) -> None:
        """A slot for this request, or the 429 / 408 OpenAIError."""
        await self._acquire()
        self.metrics.admitted()

    async def _acquire(self) -> None:
        if self.active < self.limit and not self._queue:
            self.active += 1
            return
        if self.max_wait is None:
            self.metrics.rejected.labels("429").inc()
            raise OpenAIError(429, f"too many concurrent requests: {self.active} in flight "
                              f"({self.bound}); retry later", code="rate_limit_exceeded")
        turn = asyncio.get_running_loop().create_future()
        self._queue.append(turn)
        self.metrics.waiting.inc()
        try:
            await asyncio.wait_for(asyncio.shield(turn), None if self.max_wait < 0 else self.max_wait)
        except asyncio.TimeoutError:
            if not turn.done():  # (done: a slot came in the same instant, and is kept)
                self._queue.remove(turn)
                self.metrics.rejected.labels("408").inc()
                raise OpenAIError(408, f"no slot came free within --max-waiting-time {self.max_wait:g} s "
                                  f"({self.active} requests in flight, {self.bound}); retry later",
                                  code="request_timeout") from None
        except asyncio.CancelledError:
            if turn.done():
                self.release()  # handed a slot as it was cancelled: pass it on
            else:
                self._queue.remove(turn)
            raise
        finally:
            self.metrics.waiting.dec()

    def release(self) -> None:
        """Hand the slot to the longest waiter (every future in the queue is still waiting), else free it."""
        if self._queue:
            self._queue.popleft().set_result(None)  # the slot passes on: `active` stays
        else:
            self.active -= 1
