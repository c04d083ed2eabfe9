"""Unit tests of the Triton-side logic, without a tritonserver."""
from __future__ import annotations

import json
import socket
import threading
import time

import numpy as np
import pytest

from ernie_serve.engine.async_engine import EngineDeadError, EngineOverloadedError
from ernie_serve.outputs import CompletionOutput, RequestMetrics, RequestOutput
from ernie_serve.serving.control import AbortListener, send_abort
from ernie_serve.serving.engine_model import EngineModel
from ernie_serve.serving.errors import Cancelled, InvalidInput
from ernie_serve.serving.postprocess import OrderError, Postprocessor
from ernie_serve.serving.repository import get_parameter, render_repository
from ernie_serve.serving.request import parse_request


def s(value: str) -> np.ndarray:
    return np.array([[value.encode()]], dtype=np.object_)


def i32(value: int) -> np.ndarray:
    return np.array([[value]], dtype=np.int32)


# ------------------------------------------------------------------ request parsing
def test_text_request_maps_trtllm_tensors_to_sampling_params():
    req = parse_request({"text_input": s("hi"), "max_tokens": i32(7), "temperature": np.array([[0.0]], np.float32),
                         "stop_words": np.array([[b"x", b""]], dtype=np.object_), "stream": np.array([[True]]),
                         "random_seed": np.array([[5]], np.uint64), "min_length": i32(2)})
    assert req.prompt == "hi" and req.stream and req.params.max_tokens == 7 and req.params.temperature == 0
    assert req.params.stop == ["x"] and req.params.seed == 5 and req.params.min_tokens == 2


def test_tensor_values_override_sampling_parameters_json():
    req = parse_request({"text_input": s("hi"), "max_tokens": i32(3),
                         "sampling_parameters": s(json.dumps({"max_tokens": 9, "top_k": 4}))})
    assert req.params.max_tokens == 3 and req.params.top_k == 4


@pytest.mark.parametrize("inputs,field", [
    ({}, "text_input"),
    ({"text_input": s("")}, "text_input"),
    ({"text_input": s("a"), "messages": s('[{"role":"user","content":"x"}]')}, "text_input"),
    ({"messages": s("[]")}, "messages"),
    ({"messages": s("{bad")}, "messages"),
    ({"text_input": s("a"), "max_tokens": i32(0)}, "max_tokens"),
    ({"text_input": s("a"), "sampling_parameters": s('{"nope": 1}')}, "nope"),
    ({"text_input": s("a"), "tools": s("[]"), "chat_template_kwargs": s('{"x": 1}')}, "chat_template_kwargs"),
    ({"text_input": np.array([[b"a"], [b"b"]], dtype=np.object_)}, "text_input"),
])
def test_bad_requests_raise_invalid_input_naming_the_field(inputs, field):
    with pytest.raises(InvalidInput) as info:
        parse_request(inputs)
    assert field in str(info.value)


def test_parser_overrides_come_from_request_parameters():
    req = parse_request({"text_input": s("a")}, {"reasoning_parser": "ernie-x1"})
    assert req.reasoning_parser == "ernie-x1"


# ------------------------------------------------------------------ preprocessing
@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from ernie_serve.tokenizer import ErnieTokenizer

    return ErnieTokenizer.from_pretrained(tiny_model_dir)


def test_preprocessor_rejects_long_prompts_and_unknown_parsers(tokenizer):
    from ernie_serve.serving.preprocess import Preprocessor

    pre = Preprocessor(tokenizer, max_model_len=16)
    with pytest.raises(InvalidInput, match="max_model_len"):
        pre.encode(parse_request({"text_input": s("word " * 40)}))
    with pytest.raises(InvalidInput, match="reasoning_parser"):
        pre.encode(parse_request({"text_input": s("a")}, {"reasoning_parser": "nope"}))
    ids, payload = pre.encode(parse_request({"text_input": s("hello"), "max_tokens": i32(4)}))
    assert ids == tokenizer.encode("hello", add_special_tokens=True)
    assert payload["sampling"]["max_tokens"] == 4 and payload["meta"]["echo"] == "hello"


def test_chat_request_renders_the_template(tokenizer):
    from ernie_serve.chat import render_chat_prompt
    from ernie_serve.serving.preprocess import Preprocessor

    messages = [{"role": "user", "content": "hi"}]
    ids, payload = Preprocessor(tokenizer, 512).encode(parse_request({"messages": s(json.dumps(messages))}))
    assert ids == render_chat_prompt(tokenizer, messages)[1]
    assert payload["meta"]["is_chat"] and payload["meta"]["echo"] is None


# ------------------------------------------------------------------ postprocessing
def moe_response(key: str, index: int, text: str, finish: str = "", meta: dict | None = None) -> dict:
    return {"request_key": s(key), "response_index": i32(index), "token_ids": np.array([[1, 2]], np.int32),
            "text_delta": s(text), "engine_finish_reason": s(finish), "num_input_tokens": i32(3),
            "num_output_tokens": i32(2 * (index + 1)), "num_cached_tokens": i32(0),
            "request_meta": s(json.dumps(meta or {"max_tokens": 100}) if index == 0 else ""),
            "prompt_ids": np.array([[5, 6, 7]] if index == 0 else [[]], np.int32).reshape(1, -1)}


def text_of(out: dict) -> str:
    return out["text_output"].reshape(-1)[0].decode()


def test_postprocessor_streams_in_order_and_frees_state_on_final(tokenizer):
    post = Postprocessor(tokenizer)
    assert text_of(post.process(moe_response("k", 0, "Hel"))) == "Hel"
    out = post.process(moe_response("k", 1, "lo", finish="length"))
    assert text_of(out) == "lo" and out["finish_reason"].reshape(-1)[0] == b"length"
    assert post.num_states == 0


def test_postprocessor_refuses_out_of_order_responses(tokenizer):
    post = Postprocessor(tokenizer)
    post.process(moe_response("k", 0, "a"))
    with pytest.raises(OrderError, match="expected 1"):
        post.process(moe_response("k", 2, "b"))
    assert post.num_states == 0
    with pytest.raises(OrderError):
        post.process(moe_response("unknown", 3, "b"))


def test_postprocessor_drops_idle_state_after_ttl(tokenizer):
    post = Postprocessor(tokenizer, ttl=0.05)
    post.process(moe_response("old", 0, "a"))
    time.sleep(0.1)
    post.process(moe_response("new", 0, "a"))
    assert post.num_states == 1


def test_cancelled_response_sends_one_abort_to_the_engine_instance(tokenizer):
    got = []
    listener = AbortListener(got.append, tag="test")
    try:
        post = Postprocessor(tokenizer)
        meta = {"max_tokens": 10, "abort_address": listener.public_address}
        post.process(moe_response("k", 0, "a", meta=meta))
        for index in (1, 2):
            with pytest.raises(Cancelled):
                post.process(moe_response("k", index, "b"), cancelled=True)
        deadline = time.monotonic() + 2
        while not got and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.05)
        assert got == ["k"] and post.num_states == 0
    finally:
        listener.close()


def test_send_abort_to_a_missing_listener_is_false_not_an_error():
    assert send_abort("@ernie-test-nobody-listens", "k") is False


def test_non_streaming_echo_prepends_the_prompt(tokenizer):
    post = Postprocessor(tokenizer)
    out = post.process(moe_response("k", 0, " world", finish="stop", meta={"echo": "hello", "max_tokens": 5}))
    assert text_of(out) == "hello world"


# ------------------------------------------------------------------ engine model with a fake engine
class FakeEngine:
    def __init__(self, error=None):
        self.error = error
        self.step_listeners = []
        self.callbacks = {}
        self.is_healthy = True

    def add_request(self, rid, ids, params, callback):
        if self.error:
            raise self.error
        self.callbacks[rid] = (ids, callback)

    def emit(self, rid, text, finished=False, reason=None):
        ids, cb = self.callbacks[rid]
        comp = CompletionOutput(0, text, [9], finish_reason=reason, text_delta=text, token_ids_delta=[9])
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

    def send(self, outputs, final):
        self.sent.append((outputs, final))
        if final:
            self.done.set()

    def send_error(self, code, message):
        self.errors.append((code, message))
        self.done.set()

    def is_cancelled(self):
        return self.cancel


def engine_inputs(stream=True):
    return {"input_ids": np.array([[1, 2, 3]], np.int32),
            "request_json": s(json.dumps({"sampling": {"max_tokens": 4}, "stream": stream, "meta": {}}))}


@pytest.mark.parametrize("error,code", [(EngineOverloadedError("overloaded: 3 waiting"), "UNAVAILABLE"),
                                        (EngineDeadError("engine is not running"), "UNAVAILABLE"),
                                        (ValueError("prompt_token_ids must be in [0, 10)"), "INVALID_ARG")])
def test_engine_refusals_become_one_final_error(error, code):
    model = EngineModel(None, engine=FakeEngine(error))
    sink = Sink()
    model.submit(engine_inputs(), sink)
    assert sink.errors and sink.errors[0][0] == code and not sink.sent
    model.shutdown()


def test_stream_sends_per_step_and_non_stream_sends_once():
    engine = FakeEngine()
    model = EngineModel(None, engine=engine)
    streaming, whole = Sink(), Sink()
    model.submit(engine_inputs(True), streaming, "a")
    model.submit(engine_inputs(False), whole, "b")
    for rid in list(engine.callbacks):
        engine.emit(rid, "x")
        engine.emit(rid, "y", finished=True, reason="length")
    assert streaming.done.wait(2) and whole.done.wait(2)
    assert [f for _, f in streaming.sent] == [False, True]
    assert len(whole.sent) == 1 and whole.sent[0][0]["text_delta"][0, 0] == b"xy"
    first = streaming.sent[0][0]
    assert json.loads(first["request_meta"][0, 0])["abort_address"].startswith("@")
    assert streaming.sent[1][0]["request_meta"][0, 0] == b"" and streaming.sent[1][0]["response_index"][0, 0] == 1
    model.shutdown()


def test_cancelled_sender_aborts_the_engine_request_and_ends_cancelled():
    engine = FakeEngine()
    model = EngineModel(None, engine=engine)
    sink = Sink()
    model.submit(engine_inputs(), sink, "c")
    sink.cancel = True
    assert sink.done.wait(2)
    assert sink.errors == [("CANCELLED", "request cancelled")]
    model.shutdown()


def test_abort_by_key_over_the_control_socket():
    engine = FakeEngine()
    model = EngineModel(None, engine=engine)
    sink = Sink()
    model.submit(engine_inputs(), sink, "d")
    key = next(iter(engine.callbacks))
    assert send_abort(model.aborts.public_address, key)
    assert sink.done.wait(2) and sink.errors[0][0] == "CANCELLED"
    model.shutdown()


# ------------------------------------------------------------------ repository rendering
def test_render_writes_flags_into_a_copy_and_leaves_the_source_alone(tmp_path):
    from ernie_serve.paths import repo_root

    src = repo_root() / "model_repository"
    before = (src / "ernie_moe" / "config.pbtxt").read_text()
    dst = render_repository(src, tmp_path / "repo", {"max-model-len": "1024", "reasoning_parser": "ernie-x1",
                                                      "long_prefill_token_threshold": "64"},
                            engine_instances=2, max_inflight_requests=8)
    moe = (dst / "ernie_moe" / "config.pbtxt").read_text()
    assert get_parameter(moe, "max_model_len") == "1024" and get_parameter(moe, "long_prefill_token_threshold") == "64"
    assert "count: 2" in moe
    assert get_parameter((dst / "ernie_tokenizer" / "config.pbtxt").read_text(), "reasoning_parser") == "ernie-x1"
    assert "max_inflight_requests: 8" in (dst / "ernie" / "config.pbtxt").read_text()
    assert (src / "ernie_moe" / "config.pbtxt").read_text() == before
    with pytest.raises(ValueError, match="unknown setting"):
        render_repository(src, tmp_path / "repo2", {"no_such_flag": "1"})


def test_cli_rejects_bad_engine_flags_before_starting_anything(capsys):
    from ernie_serve.cli.serve import main

    assert main(["--max-num-seqs", "0"]) == 2
    assert "max_num_seqs" in capsys.readouterr().err
