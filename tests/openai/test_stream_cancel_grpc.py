"""Disconnects against a real grpc.aio server: every cancelled stream is cancelled in the server and ends, none
hangs, and no read is left behind; a finished stream is closed, not cancelled.

TritonBackend.generate never lets a cancellation land inside grpc.aio's pending read (that leaked a response's
worth of native memory per disconnect, scripts/probe_shim_cancel_leak.py); these tests hold the other half of the
bargain: the read it leaves running always ends, through call.cancel()."""
from __future__ import annotations

import asyncio
import concurrent.futures
import json
import random
import socket
import threading
import time

import grpc
import httpx
import pytest
from tritonclient.grpc import model_config_pb2, service_pb2, service_pb2_grpc

from ernie_client.openai import ServerConfig, create_app
from ernie_client.openai.triton import TritonBackend

STREAMS = 300


class _Servicer(service_pb2_grpc.GRPCInferenceServiceServicer):
    """A model that streams a word every few milliseconds, forever unless the prompt says `finish`."""

    def __init__(self):
        self.active = self.cancelled = self.finished = 0

    async def ServerReady(self, request, context):
        return service_pb2.ServerReadyResponse(ready=True)

    async def ModelReady(self, request, context):
        return service_pb2.ModelReadyResponse(ready=True)

    async def ModelConfig(self, request, context):
        cfg = model_config_pb2.ModelConfig(name="ernie", max_batch_size=0)
        for name, dtype in (("text_input", model_config_pb2.TYPE_STRING), ("max_tokens", model_config_pb2.TYPE_INT32),
                            ("stream", model_config_pb2.TYPE_BOOL)):
            cfg.input.add(name=name, data_type=dtype, dims=[1])
        for name in ("text_output", "finish_reason"):
            cfg.output.add(name=name, data_type=model_config_pb2.TYPE_STRING, dims=[1])
        return service_pb2.ModelConfigResponse(config=cfg)

    async def ModelStreamInfer(self, request_iterator, context):
        self.active += 1
        ended = False
        try:
            request = await request_iterator.__anext__()
            finish = b"finish" in request.raw_input_contents[0]
            for i in range(3 if finish else 1_000_000):
                await asyncio.sleep(0.002)
                await context.write(_response(f" w{i}", "length" if finish and i == 2 else ""))
            async for _ in request_iterator:  # like Triton, end the stream once the client half-closes
                pass
            ended = True
            self.finished += 1
        finally:
            self.active -= 1
            if not ended:
                self.cancelled += 1


def _response(text: str, finish_reason: str) -> service_pb2.ModelStreamInferResponse:
    r = service_pb2.ModelStreamInferResponse()
    for name, value in (("text_output", text), ("finish_reason", finish_reason)):
        out = r.infer_response.outputs.add(name=name, datatype="BYTES", shape=[1])
        raw = value.encode()
        r.infer_response.raw_output_contents.append(len(raw).to_bytes(4, "little") + raw)
    return r


@pytest.fixture
def triton():
    """The servicer on a grpc.aio server with its own loop in a thread; yields (url, servicer)."""
    servicer = _Servicer()
    loop = asyncio.new_event_loop()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    started = threading.Event()
    stop: list[asyncio.Event] = []

    async def serve():
        server = grpc.aio.server()
        service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(servicer, server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        stop.append(asyncio.Event())
        started.set()
        await stop[0].wait()
        await server.stop(0)

    thread = threading.Thread(target=loop.run_until_complete, args=(serve(),), daemon=True)
    thread.start()
    assert started.wait(20), "the gRPC server did not start"
    yield f"127.0.0.1:{port}", servicer
    loop.call_soon_threadsafe(stop[0].set)
    thread.join(10)


def _wait(cond, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.02)
    return cond()


def test_cancelled_reads_end_in_the_server_and_leave_nothing_pending(triton):
    """300 consumers cancelled while awaiting a response (the shim's disconnect), 16 at a time: each ends at once,
    the server sees every stream cancelled, and every read left running ends."""
    url, servicer = triton

    async def run() -> tuple[TritonBackend, float]:
        backend = TritonBackend(url, "ernie")
        rng = random.Random(0)
        slowest = 0.0

        async def one():
            nonlocal slowest
            k = rng.randint(1, 3)
            got = asyncio.Event()

            async def consume():
                n = 0
                async for _ in backend.generate({"text_input": "go", "max_tokens": 100}, "r"):
                    n += 1
                    if n == k:
                        got.set()
            task = asyncio.ensure_future(consume())
            await asyncio.wait_for(got.wait(), 10)
            await asyncio.sleep(0)  # the next read is pending
            task.cancel()
            t0 = time.monotonic()
            await asyncio.wait((task,), timeout=5)
            assert task.cancelled(), "a cancelled stream did not end"
            slowest = max(slowest, time.monotonic() - t0)

        sem = asyncio.Semaphore(16)

        async def bounded():
            async with sem:
                await one()
        await asyncio.wait_for(asyncio.gather(*(bounded() for _ in range(STREAMS))), 60)
        deadline = time.monotonic() + 5
        while backend._readers and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert not backend._readers, f"{len(backend._readers)} reads never ended"
        await backend.close()
        return backend, slowest

    _, slowest = asyncio.run(run())
    assert slowest < 1.0
    assert _wait(lambda: servicer.active == 0, 5), f"{servicer.active} server streams still open"
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
    assert _wait(lambda: servicer.finished == 1, 5)
    assert servicer.cancelled == 0 and servicer.active == 0


def test_http_disconnects_mid_stream_cancel_in_the_server(triton, start_shim):
    """300 HTTP clients that leave after the first event, 16 at a time, through the whole shim."""
    url, servicer = triton
    config = ServerConfig(triton_url=url, model_name="ernie")
    running = start_shim(create_app(config, TritonBackend(config.triton_url, config.model_name)))
    body = json.dumps({"model": "ernie", "prompt": "go", "max_tokens": 100, "stream": True}).encode()

    def drop() -> None:
        with socket.create_connection(("127.0.0.1", running.port), timeout=10) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
            got = b""
            while b"data:" not in got:
                chunk = s.recv(200)
                assert chunk, "the shim closed the stream"
                got += chunk

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda _: drop(), range(STREAMS)))
    assert _wait(lambda: servicer.active == 0, 10), f"{servicer.active} server streams still open"
    assert servicer.cancelled == STREAMS
    metrics = httpx.get(running.url + "/metrics", timeout=10).text
    assert "ernie_openai:requests_in_flight 0.0" in metrics
    assert f"ernie_openai:client_disconnects_total {STREAMS}.0" in metrics


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
