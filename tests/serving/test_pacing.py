"""ernie_moe paces a stream by the detokenizer's progress reports (engine_model.py's module docstring).

While PACE_WINDOW of a stream's responses are not yet processed downstream, its next response is held and the
following steps' tokens join it: fewer, larger responses, never fewer tokens or another order, exactly one
FINAL, which is never held.
"""
from __future__ import annotations

import json
import random
import time
from dataclasses import replace

import numpy as np
import pytest

from ernie_serve.serving.control import ControlListener, ProgressReporter
from ernie_serve.serving.engine_model import PACE_WINDOW, SHUT_DOWN, EngineModel
from ernie_serve.serving.engine_response import EngineResponse
from ernie_serve.serving.errors import InBandError
from ernie_serve.serving.postprocess import Postprocessor
from ernie_serve.serving.preprocess import Preprocessor
from ernie_serve.serving.request import parse_request
from serving_fakes import (FakeEngine, Sink, engine_inputs, fake_engine_model, moe_response, s, sent_responses,
                           submit_stream, wait_until)

PACED = {"progress_reports": True}


def _ids(sink: Sink) -> list[list[int]]:
    return [[int(t) for t in o["token_ids"][0]] for o, _ in sink.sent if o is not None]


def _max_hold(model, seconds: float) -> None:
    """The longest a held response waits for a report, for this model."""
    model.responses.policy = replace(model.responses.policy, max_hold_seconds=seconds)


@pytest.fixture
def model():
    m = fake_engine_model()
    yield m
    m.shutdown()


def _submit(model, meta=PACED) -> tuple[str, Sink]:
    return submit_stream(model, engine_inputs(True, meta=meta), "paced")


def test_a_stream_the_detokenizer_has_not_caught_up_with_is_held_then_sent_as_one_response(model, monkeypatch):
    _max_hold(model, 30.0)  # only the report can release it
    key, sink = _submit(model)
    for step in range(PACE_WINDOW):  # as many responses as the window lets out unprocessed
        model.fake.emit(key, "x", token_ids=(step,))
        sink.wait_sent(step + 1)
    for step in range(PACE_WINDOW, PACE_WINDOW + 3):
        model.fake.emit(key, "x", token_ids=(step,))
    time.sleep(0.2)
    assert len(sink.sent) == PACE_WINDOW and model.stats()["stream_responses_held"] == 1  # held
    reporter = ProgressReporter()
    reporter.note(model.control.public_address, key, 1)  # through the control socket, as the detokenizer does
    sink.wait_sent(PACE_WINDOW + 1)
    assert _ids(sink)[-1] == [2, 3, 4]  # the held steps, in one response, in order
    model.fake.emit(key, "x", token_ids=(5,))  # index 3, processed 1: held again
    time.sleep(0.1)
    assert len(sink.sent) == PACE_WINDOW + 1
    model.fake.emit(key, "x", finished=True, reason="length", token_ids=(6,))  # a FINAL is never held
    assert sink.done.wait(5)
    assert _ids(sink) == [[0], [1], [2, 3, 4], [5, 6]] and [f for _, f in sink.sent] == [False] * 3 + [True]
    assert [r.index for r in sent_responses(sink)] == [0, 1, 2, 3]


def test_a_hold_ends_after_the_longest_hold_when_no_report_comes(model, monkeypatch):
    _max_hold(model, 0.2)
    key, sink = _submit(model)
    for step in range(PACE_WINDOW + 2):
        model.fake.emit(key, "x", token_ids=(step,))
        if step < PACE_WINDOW:
            sink.wait_sent(step + 1)
    started = time.monotonic()
    sink.wait_sent(PACE_WINDOW + 1)
    assert time.monotonic() - started >= 0.1
    assert sum(_ids(sink), []) == list(range(PACE_WINDOW + 2))


def test_streams_that_ask_for_no_reports_and_non_streaming_requests_are_never_held(model):
    key, sink = _submit(model, meta={})
    for step in range(6):
        model.fake.emit(key, "x", token_ids=(step,))
        sink.wait_sent(step + 1)  # one response a step, nothing ever reported
    sink2 = Sink()
    model.submit(engine_inputs(False, meta=PACED), sink2, "whole")
    key2 = next(k for k in model.fake.callbacks if k.startswith("whole"))
    for step in range(4):
        model.fake.emit(key2, "x", finished=step == 3, reason="length" if step == 3 else None, token_ids=(step,))
    assert sink2.done.wait(5) and _ids(sink2) == [[0, 1, 2, 3]]


def test_an_error_ends_a_held_stream_after_its_held_tokens_in_band(model, tokenizer, monkeypatch):
    """The tokenizer's meta asks for reports and in-band errors; the detokenizer sees every response in order, the
    held tokens, then the error."""
    _max_hold(model, 30.0)
    ids, payload = Preprocessor(tokenizer, 512).encode(parse_request({"text_input": s("hi"),
                                                                      "stream": np.array([[True]])}))
    assert payload["meta"]["progress_reports"] is True
    sink = Sink()
    model.submit({"input_ids": np.array([ids], np.int32), "request_json": s(json.dumps(payload))}, sink, "e")
    (key,) = model.fake.callbacks
    x = tokenizer.encode("x", add_special_tokens=False)
    for n in range(PACE_WINDOW + 2):
        model.fake.emit(key, "x", token_ids=x)
        if n < PACE_WINDOW:
            sink.wait_sent(n + 1)
    model.drain(0.01)
    assert sink.done.wait(5) and not sink.errors
    assert [len(t) for t in _ids(sink)] == [len(x)] * PACE_WINDOW + [2 * len(x), 0]
    post = Postprocessor(tokenizer)
    texts = [post.process(o)["text_output"][0, 0].decode() for o, _ in sink.sent[:-1]]
    assert "".join(texts) == "x" * (PACE_WINDOW + 2)
    with pytest.raises(InBandError) as raised:
        post.process(sink.sent[-1][0])
    assert raised.value.code == SHUT_DOWN.code


def test_random_steps_reports_and_ends_keep_every_token_in_order_with_one_final():
    """Random interleavings of steps, detokenizer progress, finishes, aborts and a drain over many streams: each
    stream's responses carry exactly its tokens in order (a prefix for an aborted one), indexed 0, 1, ..., with
    one FINAL, last; a paced stream never has more than PACE_WINDOW non-final responses unprocessed."""
    for seed in range(6):
        rng = random.Random(seed)
        engine = FakeEngine()
        model = EngineModel(None, engine=engine)
        _max_hold(model, 30.0)
        reported: dict[str, int] = {}
        overruns: list[str] = []

        class WatchedSink(Sink):
            key = ""

            def send(self, outputs, final):
                index = EngineResponse.from_tensors(outputs).index
                if self.key in reported and not final and index - reported[self.key] >= PACE_WINDOW:
                    overruns.append(f"{self.key}: response {index} with {reported[self.key]} processed")
                super().send(outputs, final)

        streams: dict[str, tuple[WatchedSink, list[int], bool]] = {}
        for n in range(8):
            sink = WatchedSink()
            paced = rng.random() < 0.75
            before = set(engine.callbacks)
            model.submit(engine_inputs(True, meta=PACED if paced else {}), sink, f"r{n}")
            (key,) = set(engine.callbacks) - before
            sink.key = key
            if paced:
                reported[key] = 0
            streams[key] = (sink, [], paced)
        live = list(streams)
        aborted = set()
        token = 0
        for _ in range(400):
            if not live:
                break
            key = rng.choice(live)
            sink, emitted, paced = streams[key]
            roll = rng.random()
            if roll < 0.6:
                engine.emit(key, "t", token_ids=(token,))
                emitted.append(token)
                token += 1
            elif roll < 0.85 and paced:  # the detokenizer processes what it has received
                sent = len(sink.sent)
                if sent > reported[key]:
                    reported[key] = rng.randint(reported[key], sent)
                    model.responses.put_progress([(key, reported[key])])
            elif roll < 0.95:
                engine.emit(key, "t", finished=True, reason="length", token_ids=(token,))
                emitted.append(token)
                token += 1
                live.remove(key)
            else:
                model.abort(key)
                aborted.add(key)
                live.remove(key)
            if rng.random() < 0.3:
                time.sleep(0.001)  # let the response thread run between some steps
        for key in live:
            engine.emit(key, "t", finished=True, reason="length", token_ids=(token,))
            streams[key][1].append(token)
        for key, (sink, emitted, _) in streams.items():
            assert sink.done.wait(5), key
        time.sleep(0.05)
        model.shutdown()
        assert not overruns, overruns
        for key, (sink, emitted, _) in streams.items():
            finals = [f for _, f in sink.sent]
            got = sum(_ids(sink), [])
            if key in aborted:  # a direct caller's cancelled request ends with the CANCELLED error
                assert not any(finals) and [c for c, _ in sink.errors] == ["CANCELLED"], (seed, key)
                assert got == emitted[:len(got)], (seed, key)
            else:
                assert finals.count(True) == 1 and finals[-1] is True and not sink.errors, (seed, key, finals)
                assert got == emitted, (seed, key, got, emitted)
                indices = [r.index for r in sent_responses(sink)]
                assert indices == list(range(len(indices))), (seed, key, indices)


def test_progress_reports_are_batched_split_into_datagrams_and_the_latest_count_wins():
    got: list[tuple[str, int]] = []
    listener = ControlListener(lambda key: None, tag="ernie-test-progress", on_progress=got.extend)
    try:
        reporter = ProgressReporter()
        for n in range(300):  # ~6 KB of pairs: more than one datagram
            reporter.note(listener.public_address, f"k=with=equals-{n}", 1)
        reporter.note(listener.public_address, "k=with=equals-299", 7)
        reporter.note("@ernie-test-nobody-listens", "lost", 1)  # a gone engine: dropped, nothing raised
        assert wait_until(lambda: len(dict(got)) == 300 and dict(got)["k=with=equals-299"] == 7)
        assert dict(got)["k=with=equals-0"] == 1
    finally:
        listener.close()


def test_the_postprocessor_reports_each_processed_response_of_a_stream_that_asks(tokenizer):
    got: list[tuple[str, int]] = []
    listener = ControlListener(lambda key: None, tag="ernie-test-progress", on_progress=got.extend)
    try:
        post = Postprocessor(tokenizer)
        meta = {"max_tokens": 10, "abort_address": listener.public_address, "progress_reports": True}
        post.process(moe_response("k", 0, "a", meta=meta))
        post.process(moe_response("k", 1, "b"))
        post.process(moe_response("plain", 0, "a", meta={"abort_address": listener.public_address}))
        assert wait_until(lambda: ("k", 2) in got)
        time.sleep(0.05)
        assert all(key == "k" for key, _ in got)
    finally:
        listener.close()


def test_request_ids_with_whitespace_make_keys_the_reports_can_carry(model):
    sink = Sink()
    model.submit(engine_inputs(True, meta=PACED), sink, "a b\tc")
    (key,) = model.fake.callbacks
    assert key.startswith("a_b_c-") and not any(c.isspace() for c in key)
