"""Disconnects against a real grpc.aio server: every cancelled stream is cancelled in the server and ends, none
hangs, and no read is left behind; a finished stream is closed, not cancelled.

TritonBackend.generate never lets a cancellation land inside grpc.aio's pending read (that leaked a response's
worth of native memory per disconnect, scripts/probe_shim_cancel_leak.py); these tests hold the other half of the
bargain: the read it leaves running always ends, through call.cancel()."""
from __future__ import annotations

import asyncio
import time

import pytest

from ernie_client.openai import ServerConfig, create_app
from ernie_client.openai.triton import TritonBackend
from fake_grpc_triton import (FakeTritonServer, FakeTritonServicer, assert_disconnects_counted, drop_http_streams,
                              drop_many_mid_read, stream_response, wait_until)

STREAMS = 300


class _Servicer(FakeTritonServicer):
    """A model that streams a word every few milliseconds, forever unless the prompt says `finish`."""

    def __init__(self):
        self.active = self.cancelled = self.finished = 0

    async def ModelStreamInfer(self, request_iterator, context):
        self.active += 1
        ended = False
        try:
            request = await request_iterator.__anext__()
            finish = b"finish" in request.raw_input_contents[0]
            for i in range(3 if finish else 1_000_000):
                await asyncio.sleep(0.002)
                await context.write(stream_response(f" w{i}", "length" if finish and i == 2 else ""))
            async for _ in request_iterator:  # like Triton, end the stream once the client half-closes
                pass
            ended = True
            self.finished += 1
        finally:
            self.active -= 1
            if not ended:
                self.cancelled += 1


@pytest.fixture
def triton():
    """The servicer on a fake Triton over gRPC; yields (url, servicer)."""
    servicer = _Servicer()
    with FakeTritonServer(servicer) as server:
        yield server.url, servicer


def test_cancelled_reads_end_in_the_server_and_leave_nothing_pending(triton):
    """300 consumers cancelled while awaiting a response (the shim's disconnect), 16 at a time: each ends at once,
    the server sees every stream cancelled, and every read left running ends."""
    url, servicer = triton

    async def run() -> tuple[TritonBackend, float]:
        backend = TritonBackend(url, "ernie")
        slowest = await drop_many_mid_read(backend, ["r"] * STREAMS)
        deadline = time.monotonic() + 5
        while backend._readers and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert not backend._readers, f"{len(backend._readers)} reads never ended"
        await backend.close()
        return backend, slowest

    _, slowest = asyncio.run(run())
    assert slowest < 1.0
    assert wait_until(lambda: servicer.active == 0, 5), f"{servicer.active} server streams still open"
    assert servicer.cancelled == STREAMS and servicer.finished == 0


def test_a_finished_stream_is_closed_not_cancelled(triton):
    url, servicer = triton

    async def run() -> list:
        backend = TritonBackend(url, "ernie")
        steps = [s async for s in backend.generate({"text_input": "finish", "max_tokens": 3}, "r")]
        deadline = time.monotonic() + 5
        while backend._closing and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        await backend.close()
        return steps

    steps = asyncio.run(run())
    assert [s.text for s in steps] == [" w0", " w1", " w2"] and steps[-1].finish_reason == "length"
    assert wait_until(lambda: servicer.finished == 1, 5)
    assert servicer.cancelled == 0 and servicer.active == 0


def test_http_disconnects_mid_stream_cancel_in_the_server(triton, start_shim):
    """300 HTTP clients that leave after the first event, 16 at a time, through the whole shim."""
    url, servicer = triton
    config = ServerConfig(triton_url=url, model_name="ernie")
    running = start_shim(create_app(config, TritonBackend(config.triton_url, config.model_name)))
    drop_http_streams(running.port, STREAMS)
    assert wait_until(lambda: servicer.active == 0, 10), f"{servicer.active} server streams still open"
    assert servicer.cancelled == STREAMS
    assert_disconnects_counted(running.url, STREAMS)


class _PendingCall:
    """A stream that answers once, then holds its next read until cancel() ends it the way grpc.aio does
    (the read raises CancelledError); it records a cancellation thrown into the read itself."""

    def __init__(self):
        self.cancelled = False
        self.read_interrupted = False
        self._answered = False
        self._end: asyncio.Future | None = None

    async def __anext__(self):
        if not self._answered:
            self._answered = True
            return _FakeResult(), None
        self._end = asyncio.get_running_loop().create_future()
        try:
            await self._end
        except asyncio.CancelledError:
            if not self.cancelled:
                self.read_interrupted = True
            raise

    def cancel(self):
        self.cancelled = True
        if self._end is not None and not self._end.done():
            self._end.cancel()
        return True


class _FakeResult:
    def as_numpy(self, name):
        return None


class _PendingClient:
    def __init__(self):
        self.calls: list[_PendingCall] = []

    async def get_model_config(self, model, as_json=True, client_timeout=None):
        return {"config": {"input": [{"name": "text_input", "data_type": "TYPE_STRING", "dims": ["1"]}]}}

    def stream_infer(self, inputs_iterator):
        self.calls.append(_PendingCall())
        return self.calls[-1]

    async def close(self):
        pass


def test_a_disconnect_cancels_the_call_not_the_pending_read():
    """The consumer is cancelled while a read is pending: the read must not see that cancellation (grpc.aio then
    leaks the response it was receiving); call.cancel() ends it instead."""
    async def run() -> tuple[_PendingCall, TritonBackend]:
        client = _PendingClient()
        backend = TritonBackend("fake:1", "ernie", client_factory=lambda _: client)
        got = asyncio.Event()

        async def consume():
            async for _ in backend.generate({"text_input": "x"}, "r"):
                got.set()
        task = asyncio.ensure_future(consume())
        await got.wait()
        await asyncio.sleep(0)
        task.cancel()
        await asyncio.wait((task,), timeout=2)
        assert task.cancelled()
        await asyncio.sleep(0)
        return client.calls[0], backend

    call, backend = asyncio.run(run())
    assert call.cancelled and not call.read_interrupted
    assert not backend._readers
