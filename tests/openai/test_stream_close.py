"""A finished gRPC stream is read to its end, not cancelled; one that does not end in time, or breaks, is cancelled.
(tritonserver 2.51 keeps the ensemble referenced when a cancel reaches a finished request.)"""
from __future__ import annotations

import asyncio

from ernie_client.openai.triton import _close_when_done


class FakeCall:
    def __init__(self, items: int, then: BaseException | None = None, hang: bool = False):
        self.items, self.then, self.hang, self.cancelled = items, then, hang, False

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.items:
            self.items -= 1
            return object()
        if self.hang:
            await asyncio.sleep(3600)
        raise self.then or StopAsyncIteration

    def cancel(self):
        self.cancelled = True


def test_a_stream_that_ends_is_drained_and_not_cancelled():
    call = FakeCall(3)
    asyncio.run(_close_when_done(call, timeout=5))
    assert call.items == 0 and not call.cancelled


def test_a_stream_that_does_not_end_in_time_or_breaks_is_cancelled():
    hanging = FakeCall(1, hang=True)
    asyncio.run(_close_when_done(hanging, timeout=0.05))
    assert hanging.cancelled
    broken = FakeCall(1, then=ConnectionError("stream broke"))
    asyncio.run(_close_when_done(broken, timeout=5))
    assert broken.cancelled
