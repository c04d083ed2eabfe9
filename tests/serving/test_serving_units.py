"""Unit tests of the Triton-side logic, without a tritonserver."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from ernie_serve.config import EngineConfig
from ernie_serve.engine.async_engine import EngineDeadError, EngineOverloadedError
from ernie_serve.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from ernie_serve.serving.control import ControlListener, send_abort
from ernie_serve.serving.engine_model import SHUT_DOWN, EngineModel
from ernie_serve.serving.engine_response import Failure
from ernie_serve.serving.errors import InBandError, InvalidInput
from ernie_serve.serving.postprocess import OUTPUT_NAMES, OrderError, Postprocessor, TokenTexts
from ernie_serve.serving.preprocess import Preprocessor
from ernie_serve.serving.repository import get_parameter, render_repository
from ernie_serve.serving.request import parse_request
from serving_fakes import FakeEngine, Sink, engine_inputs, i32, moe_response, s, sent_responses


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
    ({"text_input": s("a"), "sampling_parameters": s('{"detokenize": false}')}, "sampling_parameters.detokenize"),
    ({"text_input": s("a"), "sampling_parameters": s('{"output_kind": "final_only"}')},
     "sampling_parameters.output_kind"),
    ({"text_input": s("a"), "tools": s("[]"), "chat_template_kwargs": s('{"x": 1}')}, "chat_template_kwargs"),
    ({"text_input": np.array([[b"a"], [b"b"]], dtype=np.object_)}, "text_input"),
    ({"text_input": s("a"), "input_token_ids": np.array([[5, 6]], np.int32)}, "input_token_ids"),
    ({"input_token_ids": np.zeros((1, 0), np.int32)}, "input_token_ids"),
    ({"input_token_ids": np.array([[5, -2]], np.int32)}, "input_token_ids"),
    ({"input_token_ids": np.array([[5.0]], np.float32)}, "input_token_ids"),
    ({"input_token_ids": np.array([[5]], np.int32), "tools": s('[{"type": "function"}]')}, "tools"),
])
def test_bad_requests_raise_invalid_input_naming_the_field(inputs, field):
    with pytest.raises(InvalidInput) as info:
        parse_request(inputs)
    assert field in str(info.value)


def test_parser_overrides_come_from_request_parameters():
    req = parse_request({"text_input": s("a")}, {"reasoning_parser": "ernie-x1"})
    assert req.reasoning_parser == "ernie-x1"


def test_logprobs_come_from_sampling_parameters_or_trtllm_return_log_probs():
    assert parse_request({"text_input": s("a")}).params.logprobs is None
    req = parse_request({"text_input": s("a"), "sampling_parameters": s('{"logprobs": 3}')})
    assert req.params.logprobs == 3
    req = parse_request({"text_input": s("a"), "return_log_probs": np.array([[True]])})
    assert req.params.logprobs == 0  # the sampled token only
    req = parse_request({"text_input": s("a"), "return_log_probs": np.array([[True]]),
                         "sampling_parameters": s('{"logprobs": 2}')})
    assert req.params.logprobs == 2


def test_skip_parsers_comes_from_an_input_or_a_request_parameter():
    assert not parse_request({"text_input": s("a")}).skip_parsers
    assert parse_request({"text_input": s("a"), "skip_parsers": np.array([[True]])}).skip_parsers
    assert parse_request({"text_input": s("a")}, {"skip_parsers": True}).skip_parsers
    with pytest.raises(InvalidInput, match="skip_parsers"):
        parse_request({"text_input": s("a")}, {"skip_parsers": "yes"})


# ------------------------------------------------------------------ preprocessing

def test_a_tokenized_prompt_is_used_as_sent_and_checked_against_the_vocabulary(tokenizer):
    pre = Preprocessor(tokenizer, max_model_len=16)
    sent = tokenizer.encode("hello world")  # no BOS: exactly these ids reach the engine
    ids, payload = pre.encode(parse_request({"input_token_ids": np.array([sent], np.int32)}))
    assert ids == sent and payload["meta"]["echo"] == tokenizer.decode(sent, skip_special_tokens=True)
    assert not payload["meta"]["is_chat"]
    with pytest.raises(InvalidInput, match=rf"input_token_ids: token ids must be in \[0, {len(tokenizer)}\)"):
        pre.encode(parse_request({"input_token_ids": np.array([[5, len(tokenizer)]], np.int32)}))
    with pytest.raises(InvalidInput, match="input_token_ids: the prompt has 16 tokens but max_model_len is 16"):
        pre.encode(parse_request({"input_token_ids": np.full((1, 16), 7, np.int32)}))


def test_preprocessor_rejects_long_prompts_and_unknown_parsers(tokenizer):

    pre = Preprocessor(tokenizer, max_model_len=16)
    with pytest.raises(InvalidInput, match="max_model_len"):
        pre.encode(parse_request({"text_input": s("word " * 40)}))
    with pytest.raises(InvalidInput, match="reasoning_parser"):
        pre.encode(parse_request({"text_input": s("a")}, {"reasoning_parser": "nope"}))
    ids, payload = pre.encode(parse_request({"text_input": s("hello"), "max_tokens": i32(4)}))
    assert ids == tokenizer.encode("hello", add_special_tokens=True)
    assert payload["sampling"]["max_tokens"] == 4 and payload["meta"]["echo"] == "hello"



def test_max_tokens_beyond_what_the_context_leaves_is_refused_naming_both_numbers(tokenizer):
    pre = Preprocessor(tokenizer, max_model_len=16)
    n = len(tokenizer.encode("hello", add_special_tokens=True))
    pre.encode(parse_request({"text_input": s("hello"), "max_tokens": i32(16 - n)}))  # exactly fits
    for fields in ({"max_tokens": i32(16 - n + 1)}, {"sampling_parameters": s('{"max_completion_tokens": 1000000}')}):
        with pytest.raises(InvalidInput, match=rf"max_tokens: \d+ tokens after the prompt's {n} need \d+ "
                                               rf"positions, but max_model_len is 16: ask for at most {16 - n}"):
            pre.encode(parse_request({"text_input": s("hello"), **fields}))
    _, payload = pre.encode(parse_request({"text_input": s("hello there my friend")}))  # the default 16: no error
    assert payload["sampling"]["max_tokens"] == 16


def test_skip_parsers_turns_the_configured_parsers_off_for_one_request(tokenizer):

    pre = Preprocessor(tokenizer, 512, reasoning_parser="ernie-x1", tool_call_parser="ernie-x1")
    _, payload = pre.encode(parse_request({"text_input": s("hello")}))
    assert payload["meta"]["reasoning_parser"] == "ernie-x1"
    _, payload = pre.encode(parse_request({"text_input": s("hello"), "skip_parsers": np.array([[True]])}))
    assert payload["meta"]["reasoning_parser"] is None and payload["meta"]["tool_call_parser"] is None


def test_n_above_1_is_refused_with_what_to_do_instead(tokenizer):

    with pytest.raises(InvalidInput) as info:
        Preprocessor(tokenizer, 512).encode(parse_request({"text_input": s("a"),
                                                           "sampling_parameters": s('{"n": 2}')}))
    assert "n=1" in str(info.value) and "OpenAI shim" in str(info.value)


def test_chat_request_renders_the_template(tokenizer):
    from ernie_serve.chat import render_chat_prompt

    messages = [{"role": "user", "content": "hi"}]
    ids, payload = Preprocessor(tokenizer, 512).encode(parse_request({"messages": s(json.dumps(messages))}))
    assert ids == render_chat_prompt(tokenizer, messages)[1]
    assert payload["meta"]["is_chat"] and payload["meta"]["echo"] is None


# ------------------------------------------------------------------ postprocessing
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
    listener = ControlListener(got.append, tag="test")
    try:
        post = Postprocessor(tokenizer)
        meta = {"max_tokens": 10, "abort_address": listener.public_address}
        post.process(moe_response("k", 0, "a", meta=meta))
        # answered with empty outputs, not an error: a failed ensemble step while ernie_moe still streams
        # would leak the ensemble request in tritonserver 2.51
        out = post.process(moe_response("k", 1, "b"), is_cancelled=True)
        assert text_of(out) == "" and out["output_ids"].shape == (1, 0)
        out = post.process(moe_response("k", 2, "c"))  # a later response of the aborted request: no OrderError
        assert text_of(out) == "" and out["finish_reason"][0, 0] == b"" and set(out) == set(OUTPUT_NAMES)
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


def test_prompt_token_ids_on_the_first_response_only(tokenizer):
    post = Postprocessor(tokenizer)
    first = post.process(moe_response("k", 0, "a"))
    later = post.process(moe_response("k", 1, "b", finish="stop"))
    assert first["prompt_token_ids"].tolist() == [[5, 6, 7]] and later["prompt_token_ids"].shape == (1, 0)


def test_logprobs_get_token_strings_and_bytes(tokenizer):
    ids = tokenizer.encode("hello world")
    entries = [{"token_id": t, "logprob": -0.5, "rank": 1,
                "top_logprobs": [{"token_id": t, "logprob": -0.5}, {"token_id": ids[0], "logprob": -1.5}]}
               for t in ids]
    post = Postprocessor(tokenizer)
    out = post.process(moe_response("k", 0, " world", finish="stop", logprobs=entries))
    got = json.loads(out["logprobs"][0, 0])
    # the pieces' spaces are kept, so the tokens add up to the text
    assert "".join(e["token"] for e in got).lstrip() == tokenizer.decode(ids) == "hello world"
    assert all(e["bytes"] == list(e["token"].encode()) and e["logprob"] == -0.5 for e in got)
    assert [t["token_id"] for t in got[0]["top_logprobs"]] == [ids[0], ids[0]]
    assert all(isinstance(t["token"], str) for e in got for t in e["top_logprobs"])
    # no logprobs asked for: an empty string, not an empty list
    assert post.process(moe_response("j", 0, "x", finish="stop"))["logprobs"][0, 0] == b""


def test_byte_fallback_token_text_is_its_byte(tokenizer):
    from ernie_serve.serving.postprocess import TokenTexts

    texts = TokenTexts(tokenizer)
    byte_ids = [i for i in range(tokenizer.vocab_size) if tokenizer.id_to_token(i) == "<0xE4>"]
    if not byte_ids:
        pytest.skip("this tokenizer has no byte-fallback pieces")
    assert texts(byte_ids[0]) == ("\\xe4", [0xE4])


def test_num_reasoning_tokens_is_cumulative_from_the_parser(tokenizer):
    think_end = tokenizer.token_to_id("</think>")
    meta = {"max_tokens": 100, "reasoning_parser": "ernie-x1", "is_chat": True}
    post = Postprocessor(tokenizer)

    def step(index, text, ids, finish=""):
        r = moe_response("r", index, text, finish=finish, meta=meta)
        r["token_ids"] = np.array([ids], np.int32)
        return post.process(r)

    a = step(0, "I think", [11, 12])
    b = step(1, " more", [13])
    c = step(2, "</think>\n<response>Hi", [think_end, 14, 15], finish="stop")
    counts = [int(o["num_reasoning_tokens"][0, 0]) for o in (a, b, c)]
    assert counts == [2, 3, 3], counts
    assert post.process(moe_response("plain", 0, "x", finish="stop"))["num_reasoning_tokens"][0, 0] == 0


# ------------------------------------------------------------------ engine model with a fake engine
def test_without_stop_strings_the_engine_sends_ids_and_the_detokenizer_decodes_them(tokenizer):
    """The engine's step thread does no detokenizing for such a request: ernie_moe asks for no text and tells the
    detokenizer stage (request_meta's decode_ids) to decode the ids, which gives the engine's own text."""
    engine = FakeEngine()
    model = EngineModel(None, engine=engine)
    plain, stopping = Sink(), Sink()
    model.submit(engine_inputs(True, stop=()), plain, "p")
    model.submit(engine_inputs(True), stopping, "s")
    p, q = list(engine.callbacks)
    assert not engine.params[p].detokenize and engine.params[q].detokenize
    words = tokenizer.encode("Hello there, a café ☕ and 你好.", add_special_tokens=False)
    for k, tok in enumerate(words):
        last = k == len(words) - 1
        engine.emit(p, "ignored", finished=last, reason="length" if last else None, token_ids=[tok])
        plain.wait_sent(k + 1)
    assert plain.done.wait(2)
    first = sent_responses(plain)[0]
    assert first.meta.decode_ids and first.meta.skip_special_tokens
    assert all(r.text == "" for r in sent_responses(plain))
    post = Postprocessor(tokenizer)
    text = "".join(text_of(post.process(o)) for o, _ in plain.sent)
    assert text == tokenizer.decode(words)
    assert post.num_states == 0
    model.shutdown()


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
    a, b = list(engine.callbacks)
    engine.emit(a, "x")
    streaming.wait_sent(1)
    engine.emit(a, "y", finished=True, reason="length")
    engine.emit(b, "x")
    engine.emit(b, "y", finished=True, reason="length")
    assert streaming.done.wait(2) and whole.done.wait(2)
    assert [f for _, f in streaming.sent] == [False, True]
    assert len(whole.sent) == 1 and sent_responses(whole)[0].text == "xy"
    first, second = sent_responses(streaming)
    assert first.meta.abort_address.startswith("@")
    assert second.meta is None and second.index == 1
    model.shutdown()


def logprob_inputs(stream: bool, k: int):
    return {"input_ids": np.array([[1, 2, 3]], np.int32),
            "request_json": s(json.dumps({"sampling": {"max_tokens": 4, "logprobs": k}, "stream": stream, "meta": {}}))}


def emit_with_logprobs(engine, rid, steps, sink=None):
    """steps: one list of (sampled id, {id: logprob}) per engine step; outputs are deltas (RequestOutputKind.DELTA:
    token_ids and logprobs are the step's). With a sink, each step's response goes out before the next step (a
    consumer that keeps up)."""
    ids, cb = engine.callbacks[rid]
    for n, step in enumerate(steps):
        tokens = [tid for tid, _ in step]
        logprobs = [{t: Logprob(v, r + 1) for r, (t, v) in enumerate(sorted(cands.items(), key=lambda kv: -kv[1]))}
                    for _, cands in step]
        last = n == len(steps) - 1
        comp = CompletionOutput(0, "t", tokens, finish_reason="length" if last else None,
                                logprobs=logprobs, text_delta="t", token_ids_delta=list(tokens))
        cb(RequestOutput(rid, None, ids, [comp], last, 0, RequestMetrics(0.0, 0.0, 0.1, 0.2)), None)
        if sink is not None:
            sink.wait_sent(n + 1)


STEPS = [[(7, {7: -0.1, 8: -2.0, 9: -3.0})], [(8, {8: -0.7, 7: -0.9, 5: -4.0}), (9, {9: -5.0, 1: -0.2, 2: -0.3})]]


def test_engine_sends_the_new_tokens_logprobs_each_step_best_k_alternatives():
    engine = FakeEngine()
    model = EngineModel(None, engine=engine)
    sink = Sink()
    model.submit(logprob_inputs(True, 2), sink, "lp")
    emit_with_logprobs(engine, next(iter(engine.callbacks)), STEPS, sink)
    assert sink.done.wait(2)
    per_step = [r.logprobs for r in sent_responses(sink)]
    assert [[e["token_id"] for e in step] for step in per_step] == [[7], [8, 9]]
    assert [t["token_id"] for t in per_step[0][0]["top_logprobs"]] == [7, 8]
    last = per_step[1][1]  # the sampled token is not among the best 2: its logprob and rank still come
    assert last["logprob"] == -5.0 and last["rank"] == 3 and [t["token_id"] for t in last["top_logprobs"]] == [1, 2]
    model.shutdown()


def test_non_streaming_gets_every_tokens_logprobs_once():
    engine = FakeEngine()
    model = EngineModel(None, engine=engine)
    sink = Sink()
    model.submit(logprob_inputs(False, 0), sink, "lp")
    emit_with_logprobs(engine, next(iter(engine.callbacks)), STEPS)
    assert sink.done.wait(2) and len(sink.sent) == 1
    entries = sent_responses(sink)[0].logprobs
    assert [e["token_id"] for e in entries] == [7, 8, 9] and all(e["top_logprobs"] == [] for e in entries)
    model.shutdown()


def _tokens_and_text(sink: Sink) -> tuple[list[int], str]:
    return ([t for r in sent_responses(sink) for t in r.token_ids], "".join(r.text for r in sent_responses(sink)))


def test_a_lagging_consumer_gets_several_steps_in_one_response_same_tokens_same_order():
    engine = FakeEngine()
    model = EngineModel(None, engine=engine)
    sink = Sink()
    model.submit(engine_inputs(True), sink, "lag")
    sink.gate.clear()  # the first response blocks in send; the steps after it accumulate
    rid = next(iter(engine.callbacks))
    ids, cb = engine.callbacks[rid]
    for k in range(6):
        comp = CompletionOutput(0, "", [], finish_reason="length" if k == 5 else None, text_delta=f"<{k}>",
                                token_ids_delta=[10 + k])
        cb(RequestOutput(rid, None, ids, [comp], k == 5, 0, RequestMetrics(0.0, 0.0, 0.1, 0.2)), None)
        if k == 0:
            assert sink.entered.wait(2)  # the first response is in send, held by the consumer
    sink.gate.set()
    assert sink.done.wait(2)
    assert _tokens_and_text(sink) == ([10, 11, 12, 13, 14, 15], "<0><1><2><3><4><5>")
    assert len(sink.sent) == 2 and [f for _, f in sink.sent] == [False, True]  # the first, then the rest at once
    assert [r.index for r in sent_responses(sink)] == [0, 1]
    model.shutdown()


def test_stream_interval_sends_the_first_token_then_chunks_of_at_least_that_many():
    engine = FakeEngine()
    model = EngineModel(EngineConfig(stream_interval=3), engine=engine)
    sink = Sink()
    model.submit(engine_inputs(True), sink, "iv")
    rid = next(iter(engine.callbacks))
    ids, cb = engine.callbacks[rid]
    for k in range(8):
        comp = CompletionOutput(0, "", [], finish_reason="length" if k == 7 else None, text_delta=str(k),
                                token_ids_delta=[k])
        cb(RequestOutput(rid, None, ids, [comp], k == 7, 0, RequestMetrics(0.0, 0.0, 0.1, 0.2)), None)
        time.sleep(0.01)  # the consumer keeps up: only the interval groups tokens
    assert sink.done.wait(2)
    assert _tokens_and_text(sink) == (list(range(8)), "01234567")
    sizes = [len(r.token_ids) for r in sent_responses(sink)]
    assert sizes[0] == 1 and all(n >= 3 for n in sizes[1:-1]) and sum(sizes) == 8, sizes
    model.shutdown()


def test_stream_interval_below_one_is_refused_naming_the_flag():
    with pytest.raises(ValueError, match="stream_interval must be an integer >= 1"):
        EngineConfig(stream_interval=0)


def test_no_logprobs_asked_for_sends_none():
    engine = FakeEngine()
    model = EngineModel(None, engine=engine)
    sink = Sink()
    model.submit(engine_inputs(True), sink, "x")
    engine.emit(next(iter(engine.callbacks)), "y", finished=True, reason="length")
    assert sink.done.wait(2) and sent_responses(sink)[0].logprobs is None
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
    assert send_abort(model.control.public_address, key)
    # the detokenizer's abort: a bare FINAL, no CANCELLED error (see engine_model's docstring)
    assert sink.done.wait(2) and sink.sent == [(None, True)] and not sink.errors
    model.shutdown()


def test_ensemble_requests_end_with_their_error_in_band_and_the_detokenizer_raises_it(tokenizer):
    """A drain ends a running stream: inside the ensemble as a FINAL response the detokenizer turns into
    the error, after the stream's earlier responses (an error step while the detokenizer holds one of
    them leaks the ensemble request in tritonserver 2.51); a direct caller gets the error response."""
    engine = FakeEngine()
    model = EngineModel(None, engine=engine)
    ids, payload = Preprocessor(tokenizer, 512).encode(parse_request({"text_input": s("hi"), "stream": np.array([[True]])}))
    via_ensemble, direct = Sink(), Sink()
    model.submit({"input_ids": np.array([ids], np.int32), "request_json": s(json.dumps(payload))}, via_ensemble, "e")
    model.submit(engine_inputs(True), direct, "d")
    for rid in list(engine.callbacks):
        engine.emit(rid, "x", token_ids=tokenizer.encode("x", add_special_tokens=False))
    model.drain(0.01)
    assert via_ensemble.done.wait(2) and direct.done.wait(2)
    assert direct.errors == [(SHUT_DOWN.code, SHUT_DOWN.message)]
    assert not via_ensemble.errors and [f for _, f in via_ensemble.sent] == [False, True]
    post = Postprocessor(tokenizer)
    assert text_of(post.process(via_ensemble.sent[0][0])) == "x"
    with pytest.raises(InBandError) as raised:
        post.process(via_ensemble.sent[1][0])
    assert (raised.value.code, str(raised.value)) == (SHUT_DOWN.code, SHUT_DOWN.message)
    assert post.num_states == 0
    model.shutdown()


def test_an_in_band_error_follows_the_responses_queued_before_it_in_index_order(tokenizer):
    """The response thread lags (its first send blocks) while a step is queued and a drain ends the stream: the
    detokenizer must get the queued step, then the error, indexed in that order. (Before, the error's response was
    built on the engine thread and took the index ahead of the queued step, which went out first: an OrderError in
    the detokenizer, a failed ensemble step, and tritonserver 2.51 then kept the request in flight.)"""
    engine = FakeEngine()
    model = EngineModel(None, engine=engine)
    sink = Sink()
    meta = {"errors_in_band": True}  # as the tokenizer's, without pacing
    model.submit(engine_inputs(True, stop=(), meta=meta), sink, "e")
    (key,) = engine.callbacks
    x = tokenizer.encode("x", add_special_tokens=False)
    sink.gate.clear()
    engine.emit(key, "", token_ids=x)
    assert sink.entered.wait(2)  # response 0 is in send, blocked
    engine.emit(key, "", token_ids=x)  # queued behind it
    model.drain(0.0)
    time.sleep(0.1)
    sink.gate.set()
    assert sink.done.wait(2) and not sink.errors
    assert [r.index for r in sent_responses(sink)] == [0, 1, 2]
    post = Postprocessor(tokenizer)
    texts = [post.process(o)["text_output"][0, 0].decode() for o, _ in sink.sent[:2]]
    assert "".join(texts) == "xx"
    with pytest.raises(InBandError) as raised:
        post.process(sink.sent[2][0])
    assert raised.value.code == SHUT_DOWN.code
    model.shutdown()


def test_an_engine_failure_reaches_the_ensemble_client_with_its_code(tokenizer):
    post = Postprocessor(tokenizer)
    post.process(moe_response("k", 0, "a"))
    with pytest.raises(InBandError) as raised:
        post.process(moe_response("k", 1, "", failure=Failure("INTERNAL", "request failed: no token: left")))
    assert raised.value.code == "INTERNAL" and str(raised.value) == "request failed: no token: left"
    assert post.num_states == 0


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


def test_load_failures_reads_the_cause_from_tritonservers_status_table():
    from ernie_serve.serving.launcher import load_failures

    log = """E1204 model_repository_manager.cc:703] "Invalid argument: ensemble 'ernie' depends on 'ernie_moe'"
| Model             | Version | Status                                                              |
+-------------------+---------+---------------------------------------------------------------------+
| ernie             | 1       | READY                                                               |
| ernie_moe         | 1       | UNAVAILABLE: Internal: TritonModelException: ernie_moe: bad | flag |
| ernie_tokenizer   | 1       | UNAVAILABLE: Invalid argument: no such file                         |
error: creating server: Internal - failed to load all models"""
    assert load_failures(log) == [("ernie_moe", "bad | flag"), ("ernie_tokenizer", "Invalid argument: no such file")]
    assert load_failures("| ernie | 1 | READY |\nno table here") == []


def test_cli_passes_the_shims_flags_on_and_refuses_them_without_the_shim(capsys):
    from ernie_serve.cli.serve import build_parser, main, openai_flags

    parser = build_parser()
    args = parser.parse_args(["--openai-port", "9000", "--max-concurrency", "8", "--max-waiting-time", "2.5"])
    assert openai_flags(parser, args) == ("--max-concurrency", "8", "--max-waiting-time", "2.5")
    assert openai_flags(parser, parser.parse_args(["--openai-port", "9000"])) == ()
    for argv, words in [(["--max-waiting-time", "3"], "give --openai-port too"),
                        (["--openai-port", "9000", "--max-concurrency", "0"], "--max-concurrency must be >= 1"),
                        (["--openai-port", "9000", "--max-waiting-time", "0"], "--max-waiting-time must be > 0")]:
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2 and words in capsys.readouterr().err


def test_the_health_watch_names_a_dead_stub_even_when_tritonserver_exited_first():
    # a stub's SIGKILL can take tritonserver down before the launcher's watch looks: the message must still name it
    import subprocess

    from ernie_serve.serving.health import HealthWatch, Stub

    server, stub, other = (subprocess.Popen(["sleep", "60"]) for _ in range(3))
    try:
        watch = HealthWatch(server.pid, "http://127.0.0.1:9/metrics")
        watch.stubs = [Stub("ernie_moe_0_0", "ernie_moe", stub.pid), Stub("ernie_tokenizer_0_0", "ernie_tokenizer",
                                                                             other.pid)]
        for p in (stub, server):
            p.kill()
            p.wait()
        why = watch.problem()
        assert why.startswith(f"tritonserver (pid {server.pid}) exited")
        assert f"ernie_moe_0_0 (pid {stub.pid}) died" in why and "ernie_tokenizer" not in why
    finally:
        for p in (server, stub, other):
            p.kill()
            p.wait()


def test_port_is_the_openai_port_and_frees_tritons_own_ports_for_a_second_server(tmp_path):
    from ernie_serve.cli.serve import server_from_args

    seed = ["--port", "8180", "--metrics-port", "8181", "--run-dir", str(tmp_path / "p")]
    first, args = server_from_args(seed)
    second, _ = server_from_args(["--port", "8190", "--metrics-port", "8191", "--run-dir", str(tmp_path / "d")])
    assert first.openai_port == 8180 and first.metrics_port == 8181 and second.openai_port == 8190
    # 0: each server chooses free ones of its own at start-up (launcher.TritonServer), not 8000/8001
    assert (first.http_port, first.grpc_port, second.http_port, second.grpc_port) == (0, 0, 0, 0)
    plain, _ = server_from_args(["--run-dir", str(tmp_path / "x")])
    assert (plain.http_port, plain.grpc_port, plain.metrics_port, plain.openai_port) == (8000, 8001, 8002, None)
    same, _ = server_from_args(["--port", "9000", "--openai-port", "9000", "--run-dir", str(tmp_path / "y")])
    assert same.openai_port == 9000


@pytest.mark.parametrize("argv,words", [
    (["--port", "9000", "--openai-port", "9001"], "both are the OpenAI API's port; give one"),
    (["--port", "8002", "--metrics-port", "8002"], "--metrics-port 8002, --port 8002 are the same port"),
    (["--http-port", "-1"], "--http-port -1 is not a TCP port"),
    (["--openai-port", "70000"], "--openai-port 70000 is not a TCP port"),
])
def test_conflicting_ports_are_refused_naming_them(argv, words, capsys):
    from ernie_serve.cli.serve import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and words in capsys.readouterr().err


def test_fd_log_dir_holds_the_servers_and_the_shims_logs(tmp_path, monkeypatch, capsys):
    from ernie_serve.cli.serve import main, server_from_args

    monkeypatch.setenv("FD_LOG_DIR", str(tmp_path / "log"))
    server, _ = server_from_args(["--port", "9000", "--run-dir", str(tmp_path / "run")])
    assert server.log_path == tmp_path / "log" / "tritonserver.log"
    assert server.openai_log_path == tmp_path / "log" / "api_server.log" and (tmp_path / "log").is_dir()
    monkeypatch.delenv("FD_LOG_DIR")
    server, _ = server_from_args(["--run-dir", str(tmp_path / "run2")])
    assert server.log_path == tmp_path / "run2" / "tritonserver.log" and server.openai_log_path is None
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("FD_LOG_DIR", str(tmp_path / "file" / "log"))
    assert main(["--run-dir", str(tmp_path / "run3")]) == 2
    assert "FD_LOG_DIR=" in capsys.readouterr().err


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
COALESCE_CASES = [  # (reasoning parser, tool parser, what the model writes)
    (None, None, "Hello there, the weather is fine today."),
    ("ernie-x1", None, "Let me think about it.\n</think>\n\n<response>\nIt is sunny in Paris.\n</response>"),
    ("ernie-x1", "ernie-x1", 'I should call the tool.\n</think>\n\n<tool_call>\n{"name": "get_weather", '
                             '"arguments": {"city": "Paris", "days": 2}}\n</tool_call>'),
]


@pytest.mark.parametrize("reasoning, tool, text", COALESCE_CASES)
def test_coalesced_responses_give_the_same_result_as_one_token_each_and_as_non_streamed(tokenizer, reasoning, tool,
                                                                                         text):
    """When the consumer lags, ernie_moe sends several steps' tokens in one response (stream_interval too): the
    detokenizer stage (ids decoded here, then the chat parsers) must give the same reasoning, content and tool calls
    whatever the grouping, as the non-streamed request's one response."""
    import random

    from ernie_serve.sampling_params import SamplingParams

    pre = Preprocessor(tokenizer, 512, reasoning, tool)
    fields = {"messages": s(json.dumps([{"role": "user", "content": "weather?"}])), "stream": np.array([[True]])}
    if tool:
        fields["tools"] = s(json.dumps(TOOLS))
    prompt, payload = pre.encode(parse_request(fields))
    meta = dict(payload["meta"], decode_ids={
        "skip_special_tokens": SamplingParams.from_dict(payload["sampling"]).skip_special_tokens})
    ids = tokenizer.encode(text)

    def run(groups: list[list[int]], key: str) -> tuple[str, str, list]:
        post, done, reasoning_out, content, calls = Postprocessor(tokenizer), 0, [], [], []
        for index, group in enumerate(groups):
            done += len(group)
            r = moe_response(key, index, "", finish="stop" if index == len(groups) - 1 else "", meta=meta)
            r["token_ids"] = np.array([group], np.int32).reshape(1, -1)
            r["num_output_tokens"] = i32(done)
            r["prompt_ids"] = np.array([prompt if index == 0 else []], np.int32).reshape(1, -1)
            out = post.process(r)
            reasoning_out.append(out["reasoning_content"][0, 0].decode())
            content.append(text_of(out))
            raw = out["tool_calls"][0, 0].decode()
            calls.extend(json.loads(raw) if raw else [])
        assert post.num_states == 0
        merged: dict[int, dict] = {}  # OpenAI's streamed tool-call deltas, assembled by index
        for c in calls:
            m = merged.setdefault(c.get("index", 0), {"name": "", "arguments": ""})
            fn = c.get("function") or {}
            m["name"] += fn.get("name") or ""
            m["arguments"] += fn.get("arguments") or ""
        return "".join(reasoning_out), "".join(content), [merged[k] for k in sorted(merged)]

    whole = run([ids], "whole")
    one_each = run([[t] for t in ids], "each")
    rng = random.Random(0)
    for trial in range(5):
        groups, i = [], 0
        while i < len(ids):
            n = rng.randint(1, 6)
            groups.append(ids[i:i + n])
            i += n
        assert run(groups, f"c{trial}") == one_each == whole, groups
    if reasoning:
        assert whole[0].strip() and (whole[1].strip() or whole[2])
    if tool:
        assert [c["name"] for c in whole[2]] == ["get_weather"]
        assert json.loads(whole[2][0]["arguments"]) == {"city": "Paris", "days": 2}


def test_prompt_logprobs_go_out_on_the_first_response_only_with_their_token_texts(tokenizer):
    """ernie_moe: an entry per prompt token (the first with a null logprob) on the first response, "" afterwards
    and for a request that did not ask; the detokenizer adds each entry's token text."""
    engine = FakeEngine()
    model = EngineModel(None, engine=engine)
    sink = Sink()
    inputs = {"input_ids": np.array([[1, 2, 3]], np.int32),
              "request_json": s(json.dumps({"sampling": {"max_tokens": 4, "prompt_logprobs": 1}, "stream": True,
                                            "meta": {}}))}
    model.submit(inputs, sink, "pl")
    rid = next(iter(engine.callbacks))
    ids, cb = engine.callbacks[rid]
    prompt_lps = [None, {2: Logprob(-1.5, 3), 9: Logprob(-0.2, 1)}, {3: Logprob(-0.4, 1)}]
    for n in range(2):
        comp = CompletionOutput(0, "t", [7], finish_reason="length" if n else None, text_delta="t",
                                token_ids_delta=[7])
        cb(RequestOutput(rid, None, ids, [comp], n == 1, 0, RequestMetrics(0.0, 0.0, 0.1, 0.2),
                         prompt_logprobs=prompt_lps if n == 0 else None), None)
        sink.wait_sent(n + 1)
    assert sink.done.wait(2)
    first = sent_responses(sink)[0].prompt_logprobs
    assert first == [{"token_id": 1, "logprob": None, "rank": None, "top_logprobs": []},
                     {"token_id": 2, "logprob": -1.5, "rank": 3, "top_logprobs": [{"token_id": 9, "logprob": -0.2}]},
                     {"token_id": 3, "logprob": -0.4, "rank": 1, "top_logprobs": [{"token_id": 3, "logprob": -0.4}]}]
    assert sent_responses(sink)[1].prompt_logprobs is None
    model.shutdown()
    post = Postprocessor(tokenizer)
    out = post.process(sink.sent[0][0])
    got = json.loads(out["prompt_logprobs"][0, 0])
    assert [e["token"] for e in got] == [TokenTexts(tokenizer)(i)[0] for i in (1, 2, 3)]
    assert got[1]["top_logprobs"][0]["token"] == TokenTexts(tokenizer)(9)[0]
    assert post.process(moe_response("j", 0, "x", finish="stop"))["prompt_logprobs"][0, 0] == b""


def test_a_request_that_finished_before_its_abort_reached_the_engine_ends_as_it_finished():
    """The abort marks the stream while its last output is still on the way to the response loop: the stream still
    ends with its own final response (one FINAL, no error), not the abort's ending."""
    engine = FakeEngine()
    model = EngineModel(None, engine=engine)
    sink = Sink()
    model.submit(engine_inputs(True), sink, "late")
    (key,) = engine.callbacks
    engine.emit(key, "a")
    sink.wait_sent(1)
    busy = threading.Event()
    model.responses._events.put((lambda _: busy.wait(5), None))  # the loop is busy: the next output waits
    engine.emit(key, "b", finished=True, reason="length")
    engine.callbacks.pop(key)  # the engine has finished it: the abort below reaches nothing
    model.abort(key, SHUT_DOWN)  # the key is still live: the loop has not taken the last output
    busy.set()
    assert sink.done.wait(2) and not sink.errors
    last = sent_responses(sink)[-1]
    assert last.final and last.finish_reason == "length" and last.failure is None
    model.shutdown()


class CountingSink(Sink):
    def __init__(self):
        super().__init__()
        self.asked = 0

    def is_cancelled(self):
        self.asked += 1
        return super().is_cancelled()


def test_the_poller_stops_asking_a_stream_whose_cancellation_the_next_stage_relays_once_its_first_token_is_out():
    engine = FakeEngine()
    model = EngineModel(None, engine=engine)
    relayed, direct = CountingSink(), CountingSink()
    try:
        model.submit(engine_inputs(meta={"cancel_relayed": True}), relayed, "relayed")
        model.submit(engine_inputs(), direct, "direct")
        deadline = time.monotonic() + 10
        while relayed.asked == 0 and time.monotonic() < deadline:  # queued, no token yet: still asked
            time.sleep(0.01)
        assert relayed.asked > 0
        for rid in list(engine.callbacks):
            engine.emit(rid, "a")
        relayed.wait_sent(1)
        direct.wait_sent(1)
        before, direct_before = relayed.asked, direct.asked
        while direct.asked < direct_before + 3 and time.monotonic() < deadline:  # three more rounds of the poller
            time.sleep(0.01)
        assert direct.asked >= direct_before + 3
        assert relayed.asked == before
    finally:
        model.shutdown()


def test_ernie_serve_imports_no_paddle_to_start_the_embedded_model_s_shim_on_a_device_backend():
    """Paddle's import installs a failure-signal handler over the process's SIGTERM handler, so an ernie-serve that
    imported it after setting its own would abort on SIGTERM instead of draining (main() sets them again after
    start-up if Paddle came in; "auto" imports it on purpose, before they are set, to look for a GPU). A named
    backend's command line, the embedded model's build stamp and the shim's arguments must not need it (a
    subprocess: this test process has Paddle already)."""
    code = ("import sys\n"
            "from ernie_serve.cli.serve import server_from_args\n"
            "server, _ = server_from_args(['--http-port', '0', '--grpc-port', '0', '--metrics-port', '0',"
            " '--openai-port', '0', '--execution-backend', 'simulated', '--simulated-gpu', 'h200',"
            " '--simulated-model', 'ernie-4.5-21b-a3b'])\n"
            "server._shim_tokenizer_args()\n"
            "assert 'paddle' not in sys.modules, sorted(m for m in sys.modules if m.startswith('paddle'))[:5]\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
