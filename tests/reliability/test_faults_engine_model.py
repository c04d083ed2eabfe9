"""ernie_moe's answers to faults, without a server: the real engine on the tiny model behind EngineModel,
a recording sink where Triton's response sender would be (issue 16 items 1 and 6).

- a request that fails alone ends INTERNAL naming why; the engine stays healthy and serves on;
- a dead engine ends every request UNAVAILABLE and drops the ernie:engine_healthy gauge;
- a drain (what the launcher sends before it stops tritonserver) refuses new requests and ends the
  ones still running after the grace period, each with one FINAL, freeing their KV blocks.
"""
from __future__ import annotations

import json
import os
import threading
import time

import numpy as np
import pytest

from ernie_serve.config import EngineConfig
from ernie_serve.engine.async_engine import AsyncEngine
from ernie_serve.serving.control import ControlListener, send_drain
from ernie_serve.serving.engine_model import DRAINING_MESSAGE, SHUT_DOWN, EngineModel

WAIT = 60  # seconds: a bound for "never answered", not a speed expectation


class Sink:
    """Records what ernie_moe sends one request; `done` is set by its FINAL."""

    def __init__(self):
        self.responses: list[dict] = []
        self.error: tuple[str, str] | None = None
        self.finals = 0
        self.done = threading.Event()

    def send(self, outputs, final):
        self.responses.append(outputs)
        self._final(final)

    def send_error(self, code, message):
        self.error = (code, message)
        self._final(True)

    def send_final(self):
        self._final(True)

    def _final(self, final: bool) -> None:
        if final:
            self.finals += 1
            self.done.set()

    def is_cancelled(self):
        return False


class HealthGauge:
    """What EngineModel reports to EngineMetrics, reduced to the gauge and the finish counter."""

    def __init__(self):
        self.healthy = True
        self.finished: list[str] = []

    def set_healthy(self, healthy: bool) -> None:
        self.healthy = healthy

    def update(self, stats, force=False) -> None:
        pass

    def request_finished(self, reason, num_output_tokens, metrics) -> None:
        self.finished.append(reason)


def request(sampling: dict, ids=(40, 41, 42)) -> dict:
    return {"input_ids": np.array([list(ids)], np.int32),
            "request_json": np.array([[json.dumps({"sampling": sampling, "stream": True, "meta": {}}).encode()]],
                                     dtype=np.object_)}


# Longer than the 0.3 s drain grace even on a fast CPU (400 tokens once finished inside it, ending without the error)
LONG = {"temperature": 0, "max_tokens": 4000, "ignore_eos": True}
SHORT = {"temperature": 0, "max_tokens": 4, "ignore_eos": True}


@pytest.fixture
def served(tiny_model_dir):
    engine = AsyncEngine(EngineConfig(model=str(tiny_model_dir), max_model_len=4096, block_size=16,
                                      disable_progress_bar=True))
    gauge = HealthGauge()
    model = EngineModel(engine.config, gauge, engine=engine)
    yield model, gauge
    model.shutdown()


def unsampleable(tokenizer) -> dict:
    """min_tokens=2 with every token a stop token (banned below min_tokens) or a bad word: nothing can be
    sampled, which only the engine finds out (the request fails alone)."""
    words = []
    for t in range(len(tokenizer) - 1, 0, -1):
        text = tokenizer.decode([t])
        if text.strip() and tokenizer.encode(text) == [t]:
            words.append((t, text))
        if len(words) == 3:
            break
    kept = {t for t, _ in words}
    return {"max_tokens": 8, "min_tokens": 2, "stop_token_ids": [t for t in range(len(tokenizer)) if t not in kept],
            "bad_words": [w for _, w in words]}


def test_a_request_that_fails_alone_ends_internal_and_the_engine_stays_healthy(served):
    model, gauge = served
    bad, good = Sink(), Sink()
    model.submit(request(unsampleable(model.engine.tokenizer)), bad, "bad")
    model.submit(request(SHORT), good, "good")
    assert bad.done.wait(WAIT) and good.done.wait(WAIT)
    code, message = bad.error
    assert code == "INTERNAL" and "no token left" in message
    assert good.error is None and good.finals == 1
    assert gauge.healthy and model.engine.is_healthy
    after = Sink()
    model.submit(request(SHORT), after, "after")
    assert after.done.wait(WAIT) and after.error is None


def test_a_dead_engine_ends_every_request_unavailable_and_drops_the_health_gauge(served):
    model, gauge = served
    running = Sink()
    model.submit(request(LONG), running, "running")
    deadline = time.monotonic() + WAIT
    while not running.responses and time.monotonic() < deadline:
        time.sleep(0.01)

    def broken_step():
        raise RuntimeError("device lost")

    model.engine.engine.step = broken_step
    assert running.done.wait(WAIT)
    assert running.error[0] == "UNAVAILABLE" and "device lost" in running.error[1] and running.finals == 1
    assert not gauge.healthy
    late = Sink()
    model.submit(request(SHORT), late, "late")
    assert late.done.wait(WAIT) and late.error[0] == "UNAVAILABLE"


def test_drain_refuses_new_requests_and_ends_the_running_ones_after_the_grace_period(served):
    model, gauge = served
    running = [Sink() for _ in range(3)]
    for i, sink in enumerate(running):
        model.submit(request(LONG, ids=(40, 41 + i)), sink, f"r{i}")
    assert send_drain(model.control.public_address, 0.3)  # the launcher's way in
    deadline = time.monotonic() + WAIT
    while not model._draining and time.monotonic() < deadline:
        time.sleep(0.01)
    refused = Sink()
    model.submit(request(SHORT), refused, "new")
    assert refused.done.wait(WAIT) and refused.error == ("UNAVAILABLE", DRAINING_MESSAGE)
    for sink in running:
        assert sink.done.wait(WAIT)
        assert sink.error == (SHUT_DOWN.code, SHUT_DOWN.message) and sink.finals == 1
    deadline = time.monotonic() + WAIT
    while model.engine.stats()["num_free_blocks"] != model.engine.stats()["num_total_blocks"]:
        assert time.monotonic() < deadline, "the ended requests kept their KV blocks"
        time.sleep(0.01)
    assert gauge.healthy  # a drain is not a fault


def test_drain_lets_requests_that_finish_within_the_grace_period_complete(served):
    model, _ = served
    sink = Sink()
    model.submit(request(SHORT), sink, "short")
    model.drain(WAIT)
    assert sink.done.wait(WAIT) and sink.error is None and sink.finals == 1


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to send as another user")
def test_control_messages_from_another_user_are_ignored():
    got = []
    listener = ControlListener(got.append, tag="ernie-test-uid")
    try:
        pid = os.fork()
        if pid == 0:  # the child: become nobody, then try to abort
            try:
                os.setuid(65534)
                from ernie_serve.serving.control import send_abort

                send_abort(listener.public_address, "victim")
            finally:
                os._exit(0)
        os.waitpid(pid, 0)
        from ernie_serve.serving.control import send_abort

        assert send_abort(listener.public_address, "mine")
        deadline = time.monotonic() + WAIT
        while "mine" not in got and time.monotonic() < deadline:
            time.sleep(0.01)
        assert got == ["mine"]
    finally:
        listener.close()
