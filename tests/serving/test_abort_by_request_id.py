"""`abort-id <request id>` (control.py): a client on this host ends the streams of a Triton request it abandons
without a gRPC cancellation (tritonserver 2.51 can deadlock on one, docs/reliability.md).

The matching rule: the id after the first space, verbatim, equal to the id a stream was submitted with; an empty
id matches nothing, an unknown one is a no-op. Each aborted stream frees its KV (the engine's abort) and ends as a
cancelled one: CANCELLED for a direct caller, in band through the ensemble (the detokenizer drops its state).
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from ernie_serve.serving.control import ControlListener, engine_addresses, send_abort_id
from ernie_serve.serving.engine_model import EngineModel
from ernie_serve.serving.errors import InBandError
from ernie_serve.serving.postprocess import Postprocessor
from ernie_serve.serving.preprocess import Preprocessor
from ernie_serve.serving.request import parse_request
from serving_fakes import FakeEngine, Sink, engine_inputs, fake_engine_model, s, submit_stream, wait_until

CANCELLED = ("CANCELLED", "request cancelled")


@pytest.fixture
def model():
    m = fake_engine_model()
    yield m
    m.shutdown()


def _submit(model, request_id: str, **kw) -> tuple[str, Sink]:
    return submit_stream(model, engine_inputs(**kw), request_id)


def test_the_listener_hands_the_id_over_verbatim():
    got: list[str] = []
    listener = ControlListener(lambda key: None, tag="test-abort-id", on_abort_id=got.append)
    try:
        for rid in ("plain", "with spaces\tand tab", " leading and trailing ", "ünïcode-id"):
            assert send_abort_id(listener.public_address, rid)
        assert wait_until(lambda: len(got) == 4)
        assert got == ["plain", "with spaces\tand tab", " leading and trailing ", "ünïcode-id"]
    finally:
        listener.close()


def test_send_abort_id_refuses_what_cannot_travel_and_never_raises():
    assert send_abort_id("@ernie-test-nobody-listens", "r") is False
    listener = ControlListener(lambda key: None, tag="test-abort-id", on_abort_id=lambda rid: None)
    try:
        assert send_abort_id(listener.public_address, "") is False  # an empty id would match nothing anyway
        assert send_abort_id(listener.public_address, "x" * 5000) is False  # over one datagram
    finally:
        listener.close()


def test_a_full_queue_is_none_not_gone():
    """A listener that does not keep up (its queue full) is still there: None, so the client sends again later."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as busy:
        busy.bind(f"\0test-abort-id-busy-{os.getpid()}")
        address = f"@test-abort-id-busy-{os.getpid()}"
        results = [send_abort_id(address, "r") for _ in range(10_000)]
    assert results[0] is True and None in results and False not in results


def test_abort_id_aborts_every_live_stream_with_exactly_that_id(model):
    aborted: list[str] = []
    real = model.fake.abort
    model.fake.abort = lambda key: aborted.append(key) or real(key)
    both = [_submit(model, "a b") for _ in range(2)]  # two streams under one id
    others = {rid: _submit(model, rid) for rid in ("a_b", "a b ", "a", "other")}  # the same key prefix, or near it
    assert send_abort_id(model.control.public_address, "a b")
    for key, sink in both:
        assert sink.done.wait(2) and sink.errors == [CANCELLED]
    assert sorted(aborted) == sorted(key for key, _ in both)  # the engine freed exactly those
    assert wait_until(lambda: model.stats()["num_live_requests"] == len(others))
    for rid, (key, sink) in others.items():
        assert not sink.done.is_set(), rid
        model.fake.emit(key, "z", finished=True, reason="length")
        assert sink.done.wait(2) and not sink.errors
    assert wait_until(lambda: model.stats()["num_live_requests"] == 0)
    assert model._by_request_id == {} and model._request_id == {}


def test_the_engine_abort_frees_the_request(model):
    aborted: list[str] = []
    real = model.fake.abort
    model.fake.abort = lambda key: aborted.append(key) or real(key)
    key, sink = _submit(model, "chatcmpl-1-0")
    assert model.abort_request_id("chatcmpl-1-0") == 1
    assert aborted == [key] and sink.done.wait(2) and sink.errors == [CANCELLED]
    assert model.abort_request_id("chatcmpl-1-0") == 0  # once: the stream is gone (or already ending)


def test_unknown_and_empty_ids_are_no_ops(model):
    key, sink = _submit(model, "")  # a caller that set no id
    named, named_sink = _submit(model, "known")
    assert model.abort_request_id("") == 0
    assert model.abort_request_id("unknown") == 0
    assert send_abort_id(model.control.public_address, "unknown")
    time.sleep(0.1)
    assert not sink.done.is_set() and not named_sink.done.is_set()
    for k, sk in ((key, sink), (named, named_sink)):
        model.fake.emit(k, "z", finished=True, reason="stop")
        assert sk.done.wait(2) and not sk.errors


def test_a_finished_stream_forgets_its_id(model):
    key, sink = _submit(model, "done-id")
    model.fake.emit(key, "z", finished=True, reason="length")
    assert sink.done.wait(2)
    assert wait_until(lambda: model._by_request_id == {})
    assert model.abort_request_id("done-id") == 0


def test_a_refused_submit_leaves_no_id_behind():
    engine = FakeEngine(error=ValueError("no"))
    model = EngineModel(None, engine=engine)
    try:
        sink = Sink()
        model.submit(engine_inputs(), sink, "refused")
        assert sink.errors and model._by_request_id == {} and model._request_id == {}
    finally:
        model.shutdown()


def test_through_the_ensemble_the_detokenizer_raises_cancelled_and_drops_the_state(model, tokenizer):
    ids, payload = Preprocessor(tokenizer, 512).encode(parse_request({"text_input": s("hi"),
                                                                      "stream": np.array([[True]])}))
    sink = Sink()
    model.submit({"input_ids": np.array([ids], np.int32), "request_json": s(json.dumps(payload))}, sink, "ens-1")
    (key,) = model.fake.callbacks
    model.fake.emit(key, "x", token_ids=tokenizer.encode("x", add_special_tokens=False))
    sink.wait_sent(1)
    assert model.abort_request_id("ens-1") == 1
    assert sink.done.wait(2) and not sink.errors and [f for _, f in sink.sent] == [False, True]
    post = Postprocessor(tokenizer)
    post.process(sink.sent[0][0])
    assert post.num_states == 1
    with pytest.raises(InBandError) as raised:
        post.process(sink.sent[1][0])
    assert (raised.value.code, str(raised.value)) == CANCELLED
    assert post.num_states == 0


_CHILD = """
import sys, time
from ernie_serve.serving.control import ControlListener
listener = ControlListener(lambda key: None, tag=sys.argv[1])
print(listener.public_address, flush=True)
time.sleep(30)
"""


def test_engine_addresses_finds_the_instances_of_the_server_on_a_port():
    """An instance is found by tag; with a port, only if its parent process (its tritonserver) listens there."""
    tag = f"test-find-{os.getpid()}"
    with socket.socket() as server, socket.socket() as elsewhere:
        server.bind(("127.0.0.1", 0))
        server.listen()
        elsewhere.bind(("127.0.0.1", 0))  # bound, not listening: a port nobody serves
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
        child = subprocess.Popen([sys.executable, "-c", _CHILD, tag], stdout=subprocess.PIPE, env=env, text=True)
        try:
            address = child.stdout.readline().strip()
            assert address.startswith(f"@{tag}-{child.pid}-")
            assert engine_addresses(tag=tag) == [address]
            assert engine_addresses(server.getsockname()[1], tag=tag) == [address]
            assert engine_addresses(elsewhere.getsockname()[1], tag=tag) == []
        finally:
            child.kill()
            child.wait(5)
        assert wait_until(lambda: engine_addresses(tag=tag) == [])
