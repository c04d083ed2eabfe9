"""Through a real tritonserver (the tiny demo model): HTTP clients that leave mid-stream end their requests in the
engines by `abort-id` (`--engine-control auto`), with no gRPC cancellation, which tritonserver 2.51 can deadlock on
(docs/reliability.md).

The shim runs in-thread on a TritonBackend whose gRPC calls are wrapped to count call.cancel(); its local engines
are found the way `ernie-openai --engine-control auto` finds them (control.engine_addresses by tritonserver's gRPC
port), which also shows that the ensemble passes the client's request id down to ernie_moe: an abort-id that
matched nothing would leave the stream running until the shim's fallback cancelled it.
"""
from __future__ import annotations

import concurrent.futures
import json
import socket
import time

import httpx
import pytest

from ernie_client.openai import ServerConfig, create_app
from ernie_client.openai.triton import TritonBackend, local_engines
from openai_shim_helpers import engine_metric, engines_idle, tritonserver
from polling import wait_for as _wait

pytestmark = pytest.mark.e2e
DROPS = 100
MAX_TOKENS = 1500


@pytest.fixture(scope="module")
def triton():
    with tritonserver({}) as server:
        yield server


class _CountingCall:
    def __init__(self, call, counts: dict):
        self._call = call
        self._counts = counts

    def __aiter__(self):
        return self

    async def __anext__(self):
        return await self._call.__anext__()

    def cancel(self):
        self._counts["cancel"] += 1
        return self._call.cancel()


class _CountingClient:
    """tritonclient's grpc.aio client, its streams' call.cancel() counted."""

    def __init__(self, url: str, counts: dict):
        import tritonclient.grpc.aio as grpcclient

        self._client = grpcclient.InferenceServerClient(url)
        self._counts = counts

    def stream_infer(self, *args, **kwargs):
        self._counts["streams"] += 1
        return _CountingCall(self._client.stream_infer(*args, **kwargs), self._counts)

    def __getattr__(self, name):
        return getattr(self._client, name)


def test_disconnects_end_in_the_engines_without_a_grpc_cancellation(triton, start_shim):
    counts = {"cancel": 0, "streams": 0}
    engines = local_engines(triton.grpc_url, "auto")
    assert engines is not None and engines.addresses(), "the local engines' control sockets were not found"
    config = ServerConfig(triton_url=triton.grpc_url, model_name="ernie", engine_control="auto")
    backend = TritonBackend(config.triton_url, config.model_name,
                            client_factory=lambda url: _CountingClient(url, counts), engines=engines)
    running = start_shim(create_app(config, backend))
    model = httpx.get(running.url + "/v1/models", timeout=10).json()["data"][0]["id"]
    body = json.dumps({"model": model, "prompt": "hello there", "stream": True, "max_tokens": MAX_TOKENS,
                       "temperature": 0, "ignore_eos": True}).encode()
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode())
    generated_before = engine_metric(triton, "ernie:generation_tokens_total")

    def drop(n: int) -> None:
        """Read 1-3 events, then leave (a socket timeout here is a hung stream)."""
        with socket.create_connection(("127.0.0.1", running.port), timeout=30) as s:
            s.sendall(head + body)
            got = b""
            while got.count(b"data:") < 1 + n % 3:
                chunk = s.recv(4096)
                assert chunk, "the shim closed the stream"
                got += chunk

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        list(pool.map(drop, range(DROPS)))
    left = time.monotonic()
    _wait(lambda: engines_idle(triton), 30, "the abandoned requests to leave the engines (KV pool whole)")
    freed_in = time.monotonic() - left
    _wait(lambda: not backend._closing and not backend._readers, 30, "the abandoned streams to end")
    # promptly: each stream was aborted, not run to its max_tokens (nor held until the shim's fallback timeout)
    assert freed_in < 10, f"the engines were idle only {freed_in:.1f}s after the last disconnect"
    generated = engine_metric(triton, "ernie:generation_tokens_total") - generated_before
    assert generated < DROPS * MAX_TOKENS / 4, f"{generated:.0f} tokens generated for {DROPS} dropped streams"
    assert counts == {"cancel": 0, "streams": DROPS}, counts
    assert backend.abandoned == {"aborted": DROPS, "cancelled": 0, "cancelled_after_abort": 0}
    metrics = httpx.get(running.url + "/metrics", timeout=10).text
    assert "ernie_openai:requests_in_flight 0.0" in metrics
    assert f"ernie_openai:client_disconnects_total {DROPS}.0" in metrics
    # the server still serves
    r = httpx.post(running.url + "/v1/completions", timeout=60,
                   json={"model": model, "prompt": "hello", "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] is not None
    assert counts["cancel"] == 0
