"""Abandoned streams ended through the local engines (`--engine-control auto`), not a gRPC cancellation.

tritonserver 2.51 can deadlock when a stream's gRPC cancellation meets an ensemble response on it
(docs/reliability.md). With the engines on this host, TritonBackend.generate sends `abort-id <request id>` to each
engine instance's control socket (ernie_serve.serving.control) and reads the stream to its end; call.cancel() is the
last resort, after ABANDON_TIMEOUT. Here a grpc.aio server plays Triton and a ControlListener in this process plays
the engine: an abort-id of a stream it knows ends that stream with a final response, as ernie_moe's abort does.
"""
from __future__ import annotations

import asyncio
import time

import pytest
from tritonclient.grpc import service_pb2

from ernie_client.openai import ServerConfig, create_app
from ernie_client.openai import triton as triton_mod
from ernie_client.openai.triton import LocalEngines, TritonBackend, _is_local_host, local_engines
from ernie_serve.serving import control
from fake_grpc_triton import (FakeTritonServer, FakeTritonServicer, assert_disconnects_counted, drop_http_streams,
                              drop_many_mid_read, drop_mid_read, stream_response, wait_until)

STREAMS = 300


class _EngineServicer(FakeTritonServicer):
    """An ensemble that streams a word every few ms until its engine aborts the request (by the id the client set),
    then sends the final response and ends the stream once the client half-closes. `known_after`: how long a request
    takes to reach the engine (an abort-id before that reaches nothing, as in ernie_moe)."""

    def __init__(self, known_after: float = 0.0, platform: str = "ensemble"):
        self.known_after = known_after
        self.platform = platform
        self.active = self.cancelled = self.finished = 0
        self.loop: asyncio.AbstractEventLoop | None = None
        self._aborts: dict[str, asyncio.Event] = {}  # request id -> its engine abort
        self.aborted_ids: list[str] = []
        self.ignore_aborts = False

    def abort_id(self, request_id: str) -> None:  # the engine's listener thread
        self.loop.call_soon_threadsafe(self._abort, request_id)

    def _abort(self, request_id: str) -> None:
        event = self._aborts.get(request_id)
        if event is not None and not event.is_set() and not self.ignore_aborts:
            self.aborted_ids.append(request_id)
            event.set()

    async def ModelStreamInfer(self, request_iterator, context):
        self.active += 1
        ended = False
        rid = None
        try:
            request = await request_iterator.__anext__()
            rid = request.id
            aborted = asyncio.Event()
            started = time.monotonic()
            for i in range(1_000_000):
                if time.monotonic() - started >= self.known_after:
                    self._aborts.setdefault(rid, aborted)
                if aborted.is_set():
                    break
                await asyncio.sleep(0.002)
                await context.write(stream_response(f" w{i}", ""))
            await context.write(_error("CANCELLED: request cancelled"))  # ernie_moe's abort, in band, as the ensemble
            async for _ in request_iterator:  # like Triton, end the stream once the client half-closes
                pass
            ended = True
            self.finished += 1
        finally:
            self._aborts.pop(rid, None)
            self.active -= 1
            if not ended:
                self.cancelled += 1


def _error(message: str) -> service_pb2.ModelStreamInferResponse:
    return service_pb2.ModelStreamInferResponse(error_message=message)


@pytest.fixture
def make_triton():
    """Starts a servicer on a fake Triton over gRPC, and its engine's control listener; returns (url, servicer,
    listener address)."""
    started: list[tuple[control.ControlListener, FakeTritonServer]] = []

    def start(**kw):
        servicer = _EngineServicer(**kw)
        server = FakeTritonServer(servicer)
        servicer.loop = server.loop
        listener = control.ControlListener(lambda key: None, tag="test-shim-engine", on_abort_id=servicer.abort_id)
        started.append((listener, server))
        return server.url, servicer, listener.public_address

    yield start
    for listener, server in started:
        listener.close()
        server.stop()


def _engines(address: str) -> LocalEngines:
    return LocalEngines(lambda: [address], control.send_abort_id)


async def _settle(backend: TritonBackend, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while (backend._readers or backend._closing) and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    assert not backend._readers and not backend._closing, "abandoned streams never ended"


def _drop_one(url: str, engines: LocalEngines, request_id: str) -> TritonBackend:
    """One stream dropped after its first response, left to end; returns its backend, closed."""
    async def run() -> TritonBackend:
        backend = TritonBackend(url, "ernie", engines=engines)
        await drop_mid_read(backend, request_id, 1)
        await _settle(backend, 5)
        await backend.close()
        return backend

    return asyncio.run(run())


def test_abandoned_streams_end_in_the_engine_without_a_grpc_cancellation(make_triton):
    url, servicer, address = make_triton()

    async def run() -> TritonBackend:
        backend = TritonBackend(url, "ernie", engines=_engines(address))
        await drop_many_mid_read(backend, [f"chatcmpl-{n}-0" for n in range(STREAMS)])
        await _settle(backend)
        await backend.close()
        return backend

    backend = asyncio.run(run())
    assert wait_until(lambda: servicer.active == 0, 5), f"{servicer.active} server streams still open"
    assert servicer.cancelled == 0 and servicer.finished == STREAMS
    assert sorted(servicer.aborted_ids) == sorted(f"chatcmpl-{n}-0" for n in range(STREAMS))
    assert backend.abandoned == {"aborted": STREAMS, "cancelled": 0, "cancelled_after_abort": 0}


def test_the_abort_is_sent_again_until_the_request_reaches_the_engine(make_triton):
    """Dropped before the engine knows the request (in the tokenizer, in Triton's queue): the first abort-id
    reaches nothing; a later one ends it."""
    url, servicer, address = make_triton(known_after=0.3)

    async def run() -> tuple[TritonBackend, float]:
        backend = TritonBackend(url, "ernie", engines=_engines(address))
        t0 = time.monotonic()
        await drop_mid_read(backend, "early", 1)
        await _settle(backend)
        took = time.monotonic() - t0
        await backend.close()
        return backend, took

    backend, took = asyncio.run(run())
    assert servicer.cancelled == 0 and servicer.finished == 1 and servicer.aborted_ids == ["early"]
    assert backend.abandoned["aborted"] == 1 and took < 2


def test_a_stream_the_abort_does_not_end_is_cancelled_after_the_timeout(make_triton, monkeypatch):
    url, servicer, address = make_triton()
    servicer.ignore_aborts = True
    monkeypatch.setattr(triton_mod, "ABANDON_TIMEOUT", 0.5)

    backend = _drop_one(url, _engines(address), "stuck")
    assert wait_until(lambda: servicer.active == 0, 5)
    assert servicer.cancelled == 1
    assert backend.abandoned == {"aborted": 1, "cancelled": 0, "cancelled_after_abort": 1}


def test_no_engine_listening_cancels_over_grpc_at_once(make_triton):
    url, servicer, _ = make_triton()
    found = []

    def find():
        found.append(1)
        return ["@test-shim-engine-nobody-listens"]

    backend = _drop_one(url, LocalEngines(find, control.send_abort_id), "r")
    assert wait_until(lambda: servicer.cancelled == 1, 5) and servicer.finished == 0
    assert backend.abandoned == {"aborted": 0, "cancelled": 1, "cancelled_after_abort": 0}
    assert len(found) == 1  # found once: a second look only when the cached addresses are older than 0.2 s


def test_a_model_that_is_not_an_ensemble_is_cancelled_over_grpc(make_triton):
    url, servicer, address = make_triton(platform="")

    backend = _drop_one(url, _engines(address), "r")
    assert wait_until(lambda: servicer.cancelled == 1, 5) and not servicer.aborted_ids
    assert backend.abandoned["cancelled"] == 1


def test_http_disconnects_end_in_the_engine_and_still_count(make_triton, start_shim):
    """300 HTTP clients that leave after the first event, 16 at a time, through the whole shim: the disconnect
    counter counts each, nothing stays in flight, and Triton saw no cancellation."""
    url, servicer, address = make_triton()
    config = ServerConfig(triton_url=url, model_name="ernie")
    backend = TritonBackend(config.triton_url, config.model_name, engines=_engines(address))
    running = start_shim(create_app(config, backend))
    drop_http_streams(running.port, STREAMS)
    assert wait_until(lambda: servicer.active == 0, 15), f"{servicer.active} server streams still open"
    assert servicer.cancelled == 0 and servicer.finished == STREAMS
    assert_disconnects_counted(running.url, STREAMS)
    assert backend.abandoned == {"aborted": STREAMS, "cancelled": 0, "cancelled_after_abort": 0}


def test_local_engines_only_for_this_hosts_triton(monkeypatch):
    assert local_engines("127.0.0.1:8001", "off") is None
    assert local_engines("triton.example:8001", "auto") is None
    assert local_engines("10.1.2.3:8001", "auto") is None
    found: list[int] = []
    monkeypatch.setattr(control, "engine_addresses", lambda port=None, tag=control.TAG: found.append(port) or [])
    engines = local_engines("localhost:8123", "auto")
    assert isinstance(engines, LocalEngines) and engines.addresses() == [] and found == [8123]
    with pytest.raises(ValueError):
        local_engines("127.0.0.1:8001", "on")
    for host in ("127.0.0.1", "127.0.1.1", "localhost", "[::1]", "::1", "0.0.0.0", "::"):
        assert _is_local_host(host), host
    for host in ("10.0.0.1", "example.com", "", "192.168.1.1"):
        assert not _is_local_host(host), host


def test_an_instance_whose_queue_is_full_still_takes_the_abort_path():
    engines = LocalEngines(lambda: ["@busy", "@gone"], lambda a, rid: None if a == "@busy" else False)
    assert engines.abort("r")  # sent again by the stream's close until it ends
    assert not LocalEngines(lambda: ["@gone"], lambda a, rid: False).abort("r")


def test_local_engines_look_again_when_no_instance_took_the_abort():
    results = iter([["@gone"], ["@new"]])
    sent: list[str] = []
    engines = LocalEngines(lambda: next(results), lambda a, rid: sent.append(a) or a == "@new", refresh=60)
    engines.addresses()
    engines._found_at -= 1  # the cached list is older than 0.2 s: a restarted tritonserver may have new instances
    assert engines.abort("r") and sent == ["@gone", "@new"]
