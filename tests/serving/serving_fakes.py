"""Fakes for ernie_moe's logic without tritonserver: an engine the test steps by hand, a response sink."""
from __future__ import annotations

import json
import threading
import time

import numpy as np

from ernie_serve.outputs import CompletionOutput, RequestMetrics, RequestOutput, RequestOutputKind


def s(value: str) -> np.ndarray:
    return np.array([[value.encode()]], dtype=np.object_)


def i32(value: int) -> np.ndarray:
    return np.array([[value]], dtype=np.int32)


def moe_response(key: str, index: int, text: str, finish: str = "", meta: dict | None = None) -> dict:
    return {"request_key": s(key), "response_index": i32(index), "token_ids": np.array([[1, 2]], np.int32),
            "text_delta": s(text), "engine_finish_reason": s(finish), "num_input_tokens": i32(3),
            "num_output_tokens": i32(2 * (index + 1)), "num_cached_tokens": i32(0),
            "request_meta": s(json.dumps(meta or {"max_tokens": 100}) if index == 0 else ""),
            "prompt_ids": np.array([[5, 6, 7]] if index == 0 else [[]], np.int32).reshape(1, -1)}


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
