"""A Server-Sent-Events response that notices a client going away while it waits for Triton.

Starlette's StreamingResponse only learns of a disconnect when a write fails (ASGI >= 2.4) and never
closes the body generator, so a stalled or abandoned stream would keep its Triton request (and its KV
blocks) alive. Here the pump and a disconnect watcher race, and the generator is always closed.
"""
from __future__ import annotations

import asyncio
from typing import AsyncIterator, Awaitable, Callable

from starlette.responses import Response
from starlette.types import Receive, Scope, Send


class SSEResponse(Response):
    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[str], on_close: Callable[[bool], Awaitable[None]]):
        # Not Response.__init__: it would declare Content-Length: 0 for the empty body.
        self.status_code = 200
        self.background = None
        self.raw_headers = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                            (b"x-accel-buffering", b"no")]
        self.events = events
        self.on_close = on_close  # called once with disconnected=True/False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        disconnected = False

        async def pump() -> None:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            async for event in self.events:
                await send({"type": "http.response.body", "body": event.encode("utf-8"), "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass

        pumping, watching = asyncio.create_task(pump()), asyncio.create_task(watch())
        try:
            await asyncio.wait({pumping, watching}, return_when=asyncio.FIRST_COMPLETED)
            if pumping.done():
                try:
                    pumping.result()
                except OSError:  # the write failed: the client is gone
                    disconnected = True
            else:
                disconnected = True
        finally:
            for t in (pumping, watching):
                t.cancel()
            await asyncio.gather(pumping, watching, return_exceptions=True)
            try:
                await self.events.aclose()
            finally:
                await self.on_close(disconnected)
