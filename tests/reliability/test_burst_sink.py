"""DecoupledSink never touches a Triton request after its FINAL (the burst segfault, issue 16 item 2).

The python backend frees a request's response factory when it forwards the FINAL; an is_cancelled()
after that makes tritonserver read freed memory (Signal 11 in TRITONBACKEND_ResponseFactoryIsCancelled).
These tests stand a recording fake in for pb_utils, so they run without a server.
"""
from __future__ import annotations

import threading
import types

from ernie_serve.serving.pb import DecoupledSink

FINAL = 1


class _Request:
    """A Triton request that records every call made on it after a FINAL send began."""

    def __init__(self, hold_final: threading.Event | None = None):
        self.final_started = threading.Event()
        self.hold_final = hold_final
        self.calls_after_final: list[str] = []
        self.sent: list[int] = []

    def get_response_sender(self):
        return self

    def send(self, response=None, flags: int = 0) -> None:
        if self.final_started.is_set():
            self.calls_after_final.append("send")
        if flags == FINAL:
            self.final_started.set()
            if self.hold_final is not None:
                self.hold_final.wait(10)
        self.sent.append(flags)

    def is_cancelled(self) -> bool:
        if self.final_started.is_set():
            self.calls_after_final.append("is_cancelled")
        return False


class _TritonError:
    INVALID_ARG, UNAVAILABLE, CANCELLED, INTERNAL = range(4)

    def __init__(self, message: str, code: int = INTERNAL):
        self.message, self.code = message, code


_pb = types.SimpleNamespace(
    TRITONSERVER_RESPONSE_COMPLETE_FINAL=FINAL,
    InferenceResponse=lambda output_tensors=None, error=None: (output_tensors, error),
    Tensor=lambda name, value: (name, value),
    TritonError=_TritonError,
)


def test_is_cancelled_after_the_final_does_not_reach_triton():
    request = _Request()
    sink = DecoupledSink(_pb, request)
    assert sink.is_cancelled() is False
    sink.send_final()
    assert sink.is_cancelled() is False
    assert request.calls_after_final == []


def test_is_cancelled_while_the_final_is_being_sent_does_not_reach_triton():
    release = threading.Event()
    request = _Request(hold_final=release)
    sink = DecoupledSink(_pb, request)
    sender = threading.Thread(target=sink.send_error, args=("INTERNAL", "boom"))
    sender.start()
    assert request.final_started.wait(10)
    try:
        assert sink.is_cancelled() is False  # answers at once, without waiting for the send
    finally:
        release.set()
        sender.join(10)
    assert request.calls_after_final == []
    assert request.sent == [FINAL]


def test_a_response_after_the_final_is_refused_before_it_reaches_triton():
    request = _Request()
    sink = DecoupledSink(_pb, request)
    sink.send({}, final=True)
    try:
        sink.send_final()
    except RuntimeError as e:
        assert "after the request's FINAL" in str(e)
    else:
        raise AssertionError("a second FINAL was sent")
    assert request.calls_after_final == []
