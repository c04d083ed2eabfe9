"""A fake Triton over real gRPC (a grpc.aio server in a thread) and the stream-dropping clients the shim's
disconnect tests run against it: the parts of tritonserver's protocol the shim touches, and nothing else."""
from __future__ import annotations

import asyncio
import concurrent.futures
import json
import random
import socket
import threading
import time
from typing import Callable

import grpc
import httpx
from tritonclient.grpc import model_config_pb2, service_pb2, service_pb2_grpc

from ernie_client.openai.triton import TritonBackend


class FakeTritonServicer(service_pb2_grpc.GRPCInferenceServiceServicer):
    """Always ready; model `ernie` takes text_input, max_tokens and stream and answers text_output and
    finish_reason. Subclasses stream in ModelStreamInfer; `platform` is what ModelConfig reports."""

    platform = ""

    async def ServerReady(self, request, context):
        return service_pb2.ServerReadyResponse(ready=True)

    async def ModelReady(self, request, context):
        return service_pb2.ModelReadyResponse(ready=True)

    async def ModelConfig(self, request, context):
        cfg = model_config_pb2.ModelConfig(name="ernie", max_batch_size=0, platform=self.platform)
        for name, dtype in (("text_input", model_config_pb2.TYPE_STRING), ("max_tokens", model_config_pb2.TYPE_INT32),
                            ("stream", model_config_pb2.TYPE_BOOL)):
            cfg.input.add(name=name, data_type=dtype, dims=[1])
        for name in ("text_output", "finish_reason"):
            cfg.output.add(name=name, data_type=model_config_pb2.TYPE_STRING, dims=[1])
        return service_pb2.ModelConfigResponse(config=cfg)


def stream_response(text: str, finish_reason: str) -> service_pb2.ModelStreamInferResponse:
    """One streamed response of the fake model: its text_output and finish_reason ("" while it goes on)."""
    r = service_pb2.ModelStreamInferResponse()
    for name, value in (("text_output", text), ("finish_reason", finish_reason)):
        r.infer_response.outputs.add(name=name, datatype="BYTES", shape=[1])
        raw = value.encode()
        r.infer_response.raw_output_contents.append(len(raw).to_bytes(4, "little") + raw)
    return r


class FakeTritonServer:
    """`servicer` on a grpc.aio server at `url` (127.0.0.1, a port the server binds itself), on an event loop of
    its own (`loop`) in a thread, until stop() or the end of a `with` block."""

    def __init__(self, servicer: service_pb2_grpc.GRPCInferenceServiceServicer):
        self.loop = asyncio.new_event_loop()
        started = threading.Event()
        state: dict = {}

        async def serve() -> None:
            server = grpc.aio.server()
            service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(servicer, server)
            state["port"] = server.add_insecure_port("127.0.0.1:0")
            await server.start()
            state["stop"] = asyncio.Event()
            started.set()
            await state["stop"].wait()
            await server.stop(0)

        self._state = state
        self._thread = threading.Thread(target=self.loop.run_until_complete, args=(serve(),), daemon=True)
        self._thread.start()
        assert started.wait(20), "the gRPC server did not start"
        self.url = f"127.0.0.1:{state['port']}"

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self._state["stop"].set)
        self._thread.join(10)

    def __enter__(self) -> FakeTritonServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def wait_until(cond: Callable[[], object], timeout: float) -> bool:
    """Whether cond() holds within `timeout` seconds (what the server's loop or the shim does meanwhile)."""
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.02)
    return bool(cond())


async def drop_mid_read(backend: TritonBackend, request_id: str, k: int) -> float:
    """A consumer that reads k responses, then is cancelled while its next read is pending (the HTTP client left);
    returns how long it took to end once cancelled."""
    got = asyncio.Event()

    async def consume() -> None:
        n = 0
        async for _ in backend.generate({"text_input": "go", "max_tokens": 100}, request_id):
            n += 1
            if n == k:
                got.set()
    task = asyncio.ensure_future(consume())
    await asyncio.wait_for(got.wait(), 10)
    await asyncio.sleep(0)  # the next read is pending
    task.cancel()
    t0 = time.monotonic()
    await asyncio.wait((task,), timeout=5)
    assert task.cancelled(), "an abandoned stream's consumer did not end"
    return time.monotonic() - t0


async def drop_many_mid_read(backend: TritonBackend, request_ids: list[str], concurrency: int = 16) -> float:
    """drop_mid_read for each id after 1-3 responses (seeded), `concurrency` at a time; returns the slowest end."""
    rng = random.Random(0)
    sem = asyncio.Semaphore(concurrency)
    slowest = 0.0

    async def bounded(request_id: str) -> None:
        nonlocal slowest
        async with sem:
            slowest = max(slowest, await drop_mid_read(backend, request_id, rng.randint(1, 3)))
    await asyncio.wait_for(asyncio.gather(*(bounded(r) for r in request_ids)), 60)
    return slowest


def drop_http_streams(port: int, count: int, concurrency: int = 16) -> None:
    """`count` HTTP clients of the shim on `port` that start a streamed completion and leave after its first
    event, `concurrency` at a time."""
    body = json.dumps({"model": "ernie", "prompt": "go", "max_tokens": 100, "stream": True}).encode()

    def drop(_: int) -> None:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
            got = b""
            while b"data:" not in got:
                chunk = s.recv(200)
                assert chunk, "the shim closed the stream"
                got += chunk

    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(drop, range(count)))


def assert_disconnects_counted(shim_url: str, count: int) -> None:
    """The shim's /metrics: nothing in flight and `count` client disconnects."""
    metrics = httpx.get(shim_url + "/metrics", timeout=10).text
    assert "ernie_openai:requests_in_flight 0.0" in metrics
    assert f"ernie_openai:client_disconnects_total {count}.0" in metrics
