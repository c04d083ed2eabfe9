"""Fakes for ernie_moe's logic without tritonserver: an engine the test steps by hand, a response sink."""
from __future__ import annotations

import json
import threading
import time
import zlib

import numpy as np

from ernie_serve.outputs import CompletionOutput, RequestMetrics, RequestOutput, RequestOutputKind
from ernie_serve.serving.engine_model import EngineModel
from ernie_serve.serving.engine_response import EngineResponse, Failure, RequestMeta


def s(value: str) -> np.ndarray:
    return np.array([[value.encode()]], dtype=np.object_)


def i32(value: int) -> np.ndarray:
    return np.array([[value]], dtype=np.int32)


def stream_id_of(key: str) -> int:
    """The stream id a test's named stream travels under."""
    return zlib.crc32(key.encode())


def moe_response(key: str, index: int, text: str, finish: str = "", meta: dict | None = None,
                 failure: Failure | None = None, logprobs: list | None = None) -> dict:
    """ernie_moe's tensors for response `index` of the stream named `key` (also its RequestMeta.key): two tokens
    whose engine text is `text`; final with `finish` (a finish reason) or `failure`."""
    final = bool(finish) or failure is not None
    return EngineResponse(stream_id_of(key), index, [1, 2], 3, 2 * (index + 1), 0, final=final,
                          finish_reason=finish or None if failure is None else None, failure=failure, text=text,
                          meta=RequestMeta(**{"max_tokens": 100, "key": key, **(meta or {})}) if index == 0 else None,
                          prompt_ids=[5, 6, 7] if index == 0 else None, logprobs=logprobs).to_tensors()


def sent_responses(sink) -> list[EngineResponse]:
    """What a sink was sent, as the stage after ernie_moe reads it."""
    return [EngineResponse.from_tensors(outputs) for outputs, _ in sink.sent]


class FakeEngine:
    def __init__(self, error=None):
        self.error = error
        self.step_listeners = []
        self.callbacks = {}
        self.params = {}
        self.is_healthy = True

    def add_request(self, rid, ids, params, callback):
        if self.error:
            raise self.error
        assert params.output_kind is RequestOutputKind.DELTA  # what the outputs below are shaped as
        self.callbacks[rid] = (ids, callback)
        self.params[rid] = params

    def emit(self, rid, text, finished=False, reason=None, token_ids=(9,)):
        """One step of `token_ids` whose text is `text`; as the engine does, the text is left out when the request
        asked for none (the detokenizer stage then decodes the ids)."""
        ids, cb = self.callbacks[rid]
        text = text if self.params[rid].detokenize else ""
        comp = CompletionOutput(0, text, list(token_ids), finish_reason=reason, text_delta=text,
                                token_ids_delta=list(token_ids))
        cb(RequestOutput(rid, None, ids, [comp], finished, 0, RequestMetrics(0.0, 0.0, 0.1, 0.2)), None)

    def abort(self, rid):
        if rid not in self.callbacks:
            return False
        self.emit(rid, "", finished=True, reason="abort")
        return True

    def stats(self):
        return {"num_running": 0, "num_waiting": 0}

    def shutdown(self, drain=True, timeout=1):
        pass


class Sink:
    def __init__(self):
        self.sent, self.errors, self.cancel = [], [], False
        self.done = threading.Event()
        self.gate = threading.Event()  # a consumer that lags: send blocks until the gate opens
        self.gate.set()
        self.entered = threading.Event()  # a send has started

    def send(self, outputs, final):
        self.entered.set()
        self.gate.wait(5)
        self.sent.append((outputs, final))
        if final:
            self.done.set()

    def wait_sent(self, n: int) -> None:
        """Until n responses went out: a test that wants one response a step lets each go before the next."""
        deadline = time.monotonic() + 5
        while len(self.sent) < n and time.monotonic() < deadline:
            time.sleep(0.001)
        assert len(self.sent) >= n

    def send_error(self, code, message):
        self.errors.append((code, message))
        self.done.set()

    def send_final(self):
        self.sent.append((None, True))
        self.done.set()

    def is_cancelled(self):
        return self.cancel


def engine_inputs(stream=True, stop=("<END>",), meta=None):
    """A request for ernie_moe. With stop strings (the default here) the engine detokenizes it and ernie_moe's
    responses carry its text; without, they carry token ids for the detokenizer stage to decode."""
    sampling = {"max_tokens": 4, "stop": list(stop)}
    return {"input_ids": np.array([[1, 2, 3]], np.int32),
            "request_json": s(json.dumps({"sampling": sampling, "stream": stream, "meta": meta or {}}))}


def fake_engine_model() -> EngineModel:
    """ernie_moe's EngineModel on a FakeEngine, which the test steps through `model.fake`; shut it down after."""
    engine = FakeEngine()
    model = EngineModel(None, engine=engine)
    model.fake = engine
    return model


def submit_stream(model: EngineModel, inputs: dict, request_id: str) -> tuple[str, Sink]:
    """Submits `inputs` to a fake_engine_model under `request_id`; returns the engine's key for it and its sink."""
    sink = Sink()
    before = set(model.fake.callbacks)
    model.submit(inputs, sink, request_id)
    (key,) = set(model.fake.callbacks) - before
    return key, sink


def wait_until(cond, seconds: float = 5.0) -> bool:
    """Whether cond() holds within `seconds` (what the model's threads, or a listener's, do meanwhile)."""
    deadline = time.monotonic() + seconds
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.002)
    return bool(cond())
