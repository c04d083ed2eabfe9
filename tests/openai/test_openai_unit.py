"""Unit tests of the shim's own logic (mapping, streaming, accumulation, errors) against a fake of
tritonclient's asyncio gRPC client. The same behaviours against a real tritonserver: test_openai_e2e.py."""
from __future__ import annotations

import concurrent.futures
import json
import logging
import socket
import time

import httpx
import numpy as np
import openai
import pytest

from ernie_client.openai import ServerConfig, create_app
from ernie_client.openai.triton import TritonBackend, parse_logprobs

from openai_fake_triton import FakeTritonClient, ensemble_config

CHAT = [{"role": "user", "content": "hello there"}]


@pytest.fixture
def shim(start_shim):
    """shim(**ServerConfig fields, fake=FakeTritonClient(...)) -> (openai client, RunningShim, fake)."""
    def make(fake: FakeTritonClient | None = None, **cfg):
        fake = fake or FakeTritonClient()
        config = ServerConfig(triton_url="fake:8001", **cfg)
        app = create_app(config, TritonBackend(config.triton_url, config.model_name, client_factory=lambda _: fake))
        running = start_shim(app)
        client = openai.OpenAI(base_url=running.url + "/v1", api_key=cfg.get("api_key") or "none", max_retries=0,
                               timeout=20)
        return client, running, fake
    return make


def _sent(fake: FakeTritonClient, i: int = -1) -> dict:
    """The i-th request the fake received, as plain Python values."""
    out = {}
    for name, arr in fake.requests[i].items():
        vals = [v.decode() if isinstance(v, bytes) else v.item() for v in arr.reshape(-1)]
        out[name] = vals if name in ("stop_words", "bad_words") else vals[0]
    for name in ("sampling_parameters", "messages", "tools", "chat_template_kwargs"):
        if name in out:
            out[name] = json.loads(out[name])
    return out


# ---------------------------------------------------------------------------- chat
def test_chat_non_streaming_returns_text_finish_reason_and_usage(shim):
    client, _, fake = shim()
    r = client.chat.completions.create(model="ernie", messages=CHAT, max_tokens=3, temperature=0)
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == " w0 w7 w14"
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == 2 and r.usage.completion_tokens == 3 and r.usage.total_tokens == 5
    assert r.usage.prompt_tokens_details.cached_tokens == 0
    assert r.usage.completion_tokens_details.reasoning_tokens == 0
    sent = _sent(fake)
    assert sent["messages"] == [{"role": "user", "content": "hello there"}]
    assert sent["max_tokens"] == 3 and sent["temperature"] == 0.0 and sent["stream"] is True
    assert "text_input" not in sent


def test_chat_without_max_tokens_asks_for_no_limit(shim):
    client, _, fake = shim()
    client.chat.completions.create(model="ernie", messages=CHAT)
    sent = _sent(fake)
    assert "max_tokens" not in sent and sent["sampling_parameters"]["max_tokens"] is None


def test_max_completion_tokens_wins_over_max_tokens(shim):
    client, _, fake = shim()
    r = client.chat.completions.create(model="ernie", messages=CHAT, max_tokens=9, max_completion_tokens=2)
    assert _sent(fake)["max_tokens"] == 2 and r.usage.completion_tokens == 2


def test_chat_stream_starts_with_role_and_ends_with_done(shim):
    _, running, _ = shim()
    with httpx.stream("POST", running.url + "/v1/chat/completions", timeout=20,
                      json={"model": "ernie", "messages": CHAT, "max_tokens": 2, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[len("data: "):]) for line in lines[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["object"] == "chat.completion.chunk" and "usage" not in c for c in chunks)
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == " w0 w7"
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_stream_include_usage_sends_a_final_usage_chunk(shim):
    client, _, _ = shim()
    chunks = list(client.chat.completions.create(model="ernie", messages=CHAT, max_tokens=4, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 4
    assert chunks[-1].usage.prompt_tokens == 2
    assert all(c.usage is None for c in chunks[:-1])


def test_continuous_usage_stats_puts_the_usage_so_far_on_every_chunk(shim):
    client, _, _ = shim()
    for create in (lambda **kw: client.chat.completions.create(messages=CHAT, **kw),
                   lambda **kw: client.completions.create(prompt="a b", **kw)):
        chunks = list(create(model="ernie", max_tokens=4, stream=True,
                             stream_options={"include_usage": True, "continuous_usage_stats": True}))
        counts = [c.usage.completion_tokens for c in chunks]
        assert all(c.usage is not None and c.usage.prompt_tokens == 2 for c in chunks)
        assert counts == sorted(counts) and counts[-1] == 4 and chunks[-1].choices == []


def test_reasoning_content_is_separate_in_message_and_delta(shim):
    client, _, _ = shim()
    msgs = [{"role": "user", "content": "think first"}]
    r = client.chat.completions.create(model="ernie", messages=msgs, max_tokens=4)
    assert r.choices[0].message.reasoning_content == "let me think"
    assert r.choices[0].message.content == " w0 w7"
    assert r.usage.completion_tokens_details.reasoning_tokens == 2
    chunks = list(client.chat.completions.create(model="ernie", messages=msgs, max_tokens=4, stream=True))
    reasoning = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks)
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert (reasoning, content) == ("let me think", " w0 w7")


def test_reasoning_tokens_come_from_the_ensembles_count_when_it_sends_one(shim):
    client, _, _ = shim(FakeTritonClient(num_reasoning_tokens=5))
    r = client.chat.completions.create(model="ernie", messages=[{"role": "user", "content": "think first"}],
                                       max_tokens=4)
    assert r.usage.completion_tokens_details.reasoning_tokens == 5  # not the shim's estimate (2)


def test_completions_ask_for_raw_text_and_keep_the_markers(shim):
    client, _, fake = shim()
    c = client.completions.create(model="ernie", prompt="think first", max_tokens=4)
    assert _sent(fake)["skip_parsers"] is True
    assert c.choices[0].text == "let me think</think> w0 w7"
    client.chat.completions.create(model="ernie", messages=CHAT, max_tokens=1)
    assert "skip_parsers" not in _sent(fake)  # chat keeps the parsers


def test_skip_parsers_is_left_out_for_an_ensemble_without_it(shim):
    client, _, fake = shim(FakeTritonClient(ensemble_config(drop=("skip_parsers",))))
    c = client.completions.create(model="ernie", prompt="think first", max_tokens=4)
    assert "skip_parsers" not in _sent(fake)
    assert c.choices[0].text == "let me think w0 w7"  # the split parts joined back


WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "weather in a city",
                                                 "parameters": {"type": "object",
                                                                "properties": {"city": {"type": "string"}}}}}


def test_tool_call_is_merged_and_finishes_with_tool_calls(shim):
    client, _, fake = shim()
    msgs = [{"role": "user", "content": "weather in Paris?"}]
    r = client.chat.completions.create(model="ernie", messages=msgs, tools=[WEATHER_TOOL])
    call = r.choices[0].message.tool_calls[0]
    assert (call.id, call.type, call.function.name) == ("chatcmpl-tool-1", "function", "get_weather")
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None
    assert _sent(fake)["tools"][0]["function"]["name"] == "get_weather"
    chunks = list(client.chat.completions.create(model="ernie", messages=msgs, tools=[WEATHER_TOOL], stream=True))
    args = "".join(tc.function.arguments or "" for c in chunks for tc in (c.choices[0].delta.tool_calls or []))
    assert json.loads(args) == {"city": "Paris"}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_tool_choice_none_does_not_send_tools(shim):
    client, _, fake = shim()
    client.chat.completions.create(model="ernie", messages=CHAT, tools=[WEATHER_TOOL], tool_choice="none",
                                   max_tokens=1)
    assert "tools" not in _sent(fake)


def test_follow_up_turn_passes_tool_calls_reasoning_and_tool_results(shim):
    client, _, fake = shim()
    msgs = [{"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "weather "}, {"type": "text", "text": "in Paris?"}]},
            {"role": "assistant", "content": None, "reasoning_content": "need the tool",
             "tool_calls": [{"id": "call-1", "type": "function",
                             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "call-1", "content": '{"temp": 21}'}]
    client.chat.completions.create(model="ernie", messages=msgs, max_tokens=1,
                                   extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    sent = _sent(fake)
    assert sent["messages"][1] == {"role": "user", "content": "weather in Paris?"}
    asst = sent["messages"][2]
    assert asst["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert asst["reasoning_content"] == asst["thoughts"] == "need the tool"
    assert sent["messages"][3] == {"role": "tool", "tool_call_id": "call-1", "content": '{"temp": 21}'}
    assert sent["chat_template_kwargs"] == {"enable_thinking": False}


# ---------------------------------------------------------------------------- sampling fields
def test_sampling_fields_reach_triton_tensors_and_json(shim):
    client, _, fake = shim()
    client.chat.completions.create(
        model="ernie", messages=CHAT, max_tokens=2, temperature=0.7, top_p=0.9, seed=5, stop=["zz"],
        presence_penalty=0.5, frequency_penalty=-0.5, logprobs=True, top_logprobs=2, logit_bias={"7": 5, "3": -100},
        extra_body={"top_k": 20, "min_p": 0.1, "repetition_penalty": 1.1, "min_tokens": 1, "ignore_eos": True})
    sent = _sent(fake)
    assert sent["top_p"] == pytest.approx(0.9) and sent["top_k"] == 20 and sent["seed"] == 5
    assert sent["stop_words"] == ["zz"]
    assert sent["sampling_parameters"] == {"min_p": 0.1, "presence_penalty": 0.5, "frequency_penalty": -0.5,
                                           "repetition_penalty": 1.1, "min_tokens": 1, "ignore_eos": True,
                                           "logit_bias": {"7": 5.0, "3": -100.0}, "logprobs": 2}
    dtypes = {k: v.dtype for k, v in fake.requests[-1].items()}
    assert dtypes["max_tokens"] == np.int32 and dtypes["seed"] == np.uint64 and dtypes["temperature"] == np.float32
    assert dtypes["stream"] == np.bool_
    assert fake.requests[-1]["stop_words"].shape == (1,)


def test_token_id_prompts_go_to_input_token_ids(shim):
    client, running, fake = shim()
    r = client.completions.create(model="ernie", prompt=[[5, 6, 7], [8]], max_tokens=2)
    assert [c.index for c in r.choices] == [0, 1] and r.usage.prompt_tokens == 4
    sent = [fake.requests[i] for i in (-2, -1)]
    assert sorted(x["input_token_ids"].tolist() for x in sent) == [[5, 6, 7], [8]]
    assert all(x["input_token_ids"].dtype == np.int32 and "text_input" not in x for x in sent)
    client.completions.create(model="ernie", prompt=[9, 10], max_tokens=1)
    assert fake.requests[-1]["input_token_ids"].tolist() == [9, 10]
    for body, param in [({"prompt": [5, -1]}, "prompt"), ({"prompt": [[5], []]}, "prompt[1]"),
                        ({"prompt": [5, 2**31]}, "prompt"), ({"prompt": [5], "echo": True}, "echo")]:
        r = httpx.post(running.url + "/v1/completions", json={"model": "ernie", "max_tokens": 1, **body}, timeout=20)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)


def test_batched_ensemble_gets_a_leading_batch_dimension(shim):
    client, _, fake = shim(FakeTritonClient(ensemble_config(max_batch_size=8)))
    client.completions.create(model="ernie", prompt="a b", max_tokens=1, stop=["x", "y"])
    assert fake.requests[-1]["text_input"].shape == (1, 1)
    assert fake.requests[-1]["stop_words"].shape == (1, 2)


def test_fields_without_a_tensor_fold_into_sampling_parameters(shim):
    client, _, fake = shim(FakeTritonClient(ensemble_config(drop=("top_k", "seed"))))
    client.completions.create(model="ernie", prompt="a b", max_tokens=1, seed=3, extra_body={"top_k": 4})
    sp = _sent(fake)["sampling_parameters"]
    assert sp["seed"] == 3 and sp["top_k"] == 4


def test_stop_ends_with_finish_reason_stop(shim):
    client, _, _ = shim()
    r = client.completions.create(model="ernie", prompt="a b", max_tokens=10, stop=["w14"])
    assert r.choices[0].text == " w0 w7" and r.choices[0].finish_reason == "stop"


def test_n2_gives_two_choices_with_their_own_seeds(shim):
    client, _, fake = shim()
    r = client.chat.completions.create(model="ernie", messages=CHAT, n=2, seed=1, max_tokens=2)
    assert [c.index for c in r.choices] == [0, 1]
    assert r.choices[0].message.content == " w1 w8" and r.choices[1].message.content == " w2 w9"
    assert sorted(_sent(fake, i)["seed"] for i in (-1, -2)) == [1, 2]
    assert r.usage.prompt_tokens == 2 and r.usage.completion_tokens == 4
    chunks = list(client.chat.completions.create(model="ernie", messages=CHAT, n=2, max_tokens=2, stream=True))
    finished = sorted(c.choices[0].index for c in chunks if c.choices[0].finish_reason)
    assert finished == [0, 1]


def test_seed_makes_results_reproducible(shim):
    client, _, _ = shim()
    a = client.completions.create(model="ernie", prompt="a b", max_tokens=3, seed=11, temperature=1.0)
    b = client.completions.create(model="ernie", prompt="a b", max_tokens=3, seed=11, temperature=1.0)
    assert a.choices[0].text == b.choices[0].text


def test_completions_echo_and_multiple_prompts(shim):
    client, _, _ = shim()
    r = client.completions.create(model="ernie", prompt=["one two", "three"], max_tokens=1, echo=True)
    assert [c.text for c in r.choices] == ["one two w0", "three w0"]
    assert r.usage.prompt_tokens == 3
    chunks = list(client.completions.create(model="ernie", prompt="one two", max_tokens=2, echo=True, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == "one two w0 w7"


def test_logprobs_chat_and_completions(shim):
    client, _, fake = shim()
    r = client.chat.completions.create(model="ernie", messages=CHAT, max_tokens=2, logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert [c.token for c in content] == [" w0", " w7"] and content[0].logprob == -0.5
    assert [t.token for t in content[0].top_logprobs] == [" w0", " x"]
    c = client.completions.create(model="ernie", prompt="a", max_tokens=2, logprobs=1)
    lp = c.choices[0].logprobs
    assert lp.tokens == [" w0", " w7"] and lp.token_logprobs == [-0.5, -0.5]
    assert lp.top_logprobs == [{" w0": -0.5}, {" w7": -0.5}] and lp.text_offset == [0, 3]


def test_echo_with_logprobs_starts_with_the_prompts_tokens_streamed_or_not(shim):
    """OpenAI's legacy echo + logprobs (lm-eval's loglikelihood request): the prompt's tokens first, the first
    with null figures, offsets from the start of the echoed text."""
    client, _, fake = shim()
    c = client.completions.create(model="ernie", prompt="a b c", max_tokens=2, logprobs=1, echo=True)
    assert json.loads(fake.requests[-1]["sampling_parameters"].reshape(-1)[0])["prompt_logprobs"] == 1
    lp = c.choices[0].logprobs
    assert c.choices[0].text == "a b c w0 w7"
    assert lp.tokens == [" p1", " p2", " p3", " w0", " w7"]
    assert lp.token_logprobs == [None, -0.25, -0.25, -0.5, -0.5]
    assert lp.top_logprobs == [None, {" y": -0.1}, {" y": -0.1}, {" w0": -0.5}, {" w7": -0.5}]
    assert lp.text_offset == [0, 3, 6, 9, 12]
    chunks = list(client.completions.create(model="ernie", prompt="a b c", max_tokens=2, logprobs=1, echo=True,
                                            stream=True))
    streamed = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert sum((s.tokens for s in streamed), []) == lp.tokens
    assert sum((s.token_logprobs for s in streamed), []) == lp.token_logprobs
    assert sum((s.text_offset for s in streamed), []) == lp.text_offset
    assert "".join(c.choices[0].text for c in chunks if c.choices) == c.choices[0].text


def test_vllm_prompt_logprobs_on_completions_and_chat(shim):
    _, running, fake = shim()
    body = {"model": "ernie", "prompt": "a b", "max_tokens": 1, "prompt_logprobs": 2}
    r = httpx.post(running.url + "/v1/completions", json=body, timeout=20).json()
    assert r["choices"][0]["prompt_logprobs"] == [
        None, {"2": {"logprob": -0.25, "rank": 2, "decoded_token": " p2"},
               "77": {"logprob": -0.1, "rank": 1, "decoded_token": " y"}}]
    assert r["choices"][0]["logprobs"] is None  # echo not asked: the legacy logprobs stay off
    chat = httpx.post(running.url + "/v1/chat/completions", timeout=20,
                      json={"model": "ernie", "messages": CHAT, "max_tokens": 1, "prompt_logprobs": 0}).json()
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]
    assert all(list(e) == [str(i)] for i, e in enumerate(chat["prompt_logprobs"][1:], 2))  # k = 0: its own only
    plain = httpx.post(running.url + "/v1/completions", timeout=20,
                       json={"model": "ernie", "prompt": "a b", "max_tokens": 1}).json()
    assert "prompt_logprobs" not in plain["choices"][0]
    sent = fake.requests[-1].get("sampling_parameters")
    assert sent is None or "prompt_logprobs" not in json.loads(sent.reshape(-1)[0])


def test_logprobs_are_a_clear_400_when_the_ensemble_has_no_logprobs_output(shim):
    client, _, fake = shim(FakeTritonClient(ensemble_config(outputs=("text_output", "finish_reason"))))
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="ernie", messages=CHAT, max_tokens=2, logprobs=True)
    assert _error(e.value)["param"] == "logprobs" and "no 'logprobs' output" in _error(e.value)["message"]
    assert fake.requests == []


def test_triton_error_messages_name_the_openai_field():
    from ernie_client.openai.triton import triton_error
    from tritonclient.utils import InferenceServerException

    e = triton_error(InferenceServerException("text_input: the prompt has 3000 tokens but max_model_len is 2048"),
                     "ernie")
    assert (e.status, e.param) == (400, "prompt")
    e = triton_error(InferenceServerException("in ensemble 'ernie', stop: may hold at most 5 strings"), "ernie")
    assert (e.status, e.param) == (400, "stop")
    e = triton_error(InferenceServerException("in ensemble 'ernie', stop_token_ids[2] must be an integer in "
                                              "[0, 2147483647], got -1"), "ernie")
    assert (e.status, e.param) == (400, "stop_token_ids")
    e = triton_error(InferenceServerException("overloaded: 9 requests already waiting"), "ernie")
    assert e.status == 429
    e = triton_error(InferenceServerException("failed to connect to all addresses",
                                              status="StatusCode.UNAVAILABLE"), "ernie")
    assert e.status == 503


def test_vllm_style_logprob_dicts_are_understood():
    entries = parse_logprobs([{"5": {"logprob": -0.1, "rank": 1, "decoded_token": "a"},
                               "9": {"logprob": -2.0, "rank": 2}}], [5])
    assert entries[0].token == "a" and entries[0].logprob == -0.1
    assert [t[1] for t in entries[0].top] == ["a", "token_id:9"]


def test_cached_tokens_reported_on_a_repeated_prompt(shim):
    client, _, _ = shim()
    client.completions.create(model="ernie", prompt="same prompt", max_tokens=1)
    r = client.completions.create(model="ernie", prompt="same prompt", max_tokens=1)
    assert r.usage.prompt_tokens_details.cached_tokens == 8


def test_return_token_ids(shim):
    client, _, _ = shim()
    r = client.chat.completions.create(model="ernie", messages=CHAT, max_tokens=2,
                                       extra_body={"return_token_ids": True})
    assert r.choices[0].message.completion_token_ids == [0, 7]
    assert r.choices[0].message.prompt_token_ids == [1, 2]
    c = client.completions.create(model="ernie", prompt="one two three", max_tokens=2,
                                  extra_body={"return_token_ids": True})
    assert c.choices[0].prompt_token_ids == [1, 2, 3] and c.choices[0].completion_token_ids == [0, 7]
    chunks = list(client.completions.create(model="ernie", prompt="one two three", max_tokens=2, stream=True,
                                            extra_body={"return_token_ids": True}))
    firsts = [getattr(ch.choices[0], "prompt_token_ids", None) for ch in chunks]
    assert firsts[0] == [1, 2, 3] and all(f is None for f in firsts[1:])
    assert [t for ch in chunks for t in (getattr(ch.choices[0], "completion_token_ids", None) or [])] == [0, 7]
    chunks = list(client.chat.completions.create(model="ernie", messages=CHAT, max_tokens=2, stream=True,
                                                 extra_body={"return_token_ids": True}))
    assert getattr(chunks[0].choices[0].delta, "prompt_token_ids", None) == [1, 2]


def test_logprob_bytes_from_the_server_are_kept():
    from ernie_client.openai.responses import chat_logprobs

    entries = parse_logprobs([{"token_id": 3, "token": "\\xe4", "bytes": [228], "logprob": -0.1,
                               "top_logprobs": [{"token_id": 3, "token": "\\xe4", "bytes": [228], "logprob": -0.1},
                                                {"token_id": 4, "token": "a", "logprob": -3.0}]}], [3])
    out = chat_logprobs(entries, 2)["content"][0]
    assert out["bytes"] == [228] and [t["bytes"] for t in out["top_logprobs"]] == [[228], [97]]


# ---------------------------------------------------------------------------- errors
def _error(exc: openai.APIStatusError) -> dict:
    return exc.response.json()["error"]


@pytest.mark.parametrize("body,param", [
    ({"messages": CHAT, "temperature": 3}, "temperature"),
    ({"messages": CHAT, "max_tokens": 0}, "max_tokens"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({"messages": []}, "messages"),
    ({"messages": CHAT, "stream_options": {"include_usage": True}}, "stream_options"),
    ({"messages": CHAT, "top_logprobs": 2}, "top_logprobs"),
    ({"messages": CHAT, "stop": ["a", "b", "c", "d", "e", "f"]}, "stop"),
    ({"messages": CHAT, "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ({"messages": CHAT, "prompt_logprobs": 21}, "prompt_logprobs"),
    ({"messages": CHAT, "functions": [{"name": "f", "parameters": {}}]}, "functions"),
    ({"messages": CHAT, "function_call": "auto"}, "function_call"),
    ({"messages": CHAT, "modalities": ["text", "audio"]}, "modalities"),
    ({"messages": CHAT, "audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ({"messages": CHAT, "logit_bias": {"abc": 1}}, "logit_bias.abc"),
    ({"messages": CHAT, "logit_bias": {"-4": 1}}, "logit_bias.-4"),
    ({"messages": CHAT, "logit_bias": {"5": 100.5}}, "logit_bias.5"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content"),
])
def test_invalid_chat_fields_are_400_naming_the_field(shim, body, param):
    _, running, fake = shim()
    r = httpx.post(running.url + "/v1/chat/completions", json={"model": "ernie", **body}, timeout=20)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["message"]
    assert fake.requests == []


def test_invalid_json_body_is_400(shim):
    _, running, _ = shim()
    r = httpx.post(running.url + "/v1/completions", content=b"{not json", timeout=20,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]


def test_triton_rejection_is_400_with_its_message(shim):
    client, _, _ = shim()
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="ernie", prompt="invalid please", max_tokens=2)
    assert "max_tokens must be" in _error(e.value)["message"]
    with pytest.raises(openai.BadRequestError):  # streaming too: the status comes before the stream
        client.completions.create(model="ernie", prompt="invalid please", max_tokens=2, stream=True)


def test_bad_api_key_is_401(shim):
    client, running, _ = shim(api_key="sekrit")
    assert client.models.list().data[0].id == "ernie"
    bad = openai.OpenAI(base_url=running.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        bad.chat.completions.create(model="ernie", messages=CHAT)
    assert _error(e.value)["code"] == "invalid_api_key"
    assert httpx.get(running.url + "/health").status_code == 200  # health and metrics stay open


def test_unknown_fields_are_ignored_and_logged(shim, caplog):
    _, running, fake = shim()
    with caplog.at_level(logging.WARNING, logger="ernie_client.openai.app"):
        r = httpx.post(running.url + "/v1/chat/completions", timeout=20, json={
            "model": "ernie", "messages": CHAT, "max_tokens": 1, "store": False, "reasoning_effort": "low"})
    assert r.status_code == 200, r.text
    assert "/v1/chat/completions: ignored request field(s) reasoning_effort, store" in caplog.text


def test_unknown_model_is_404(shim):
    client, _, _ = shim(served_model_name="ernie-4.5-tiny")
    assert [m.id for m in client.models.list().data] == ["ernie-4.5-tiny"]
    client.chat.completions.create(model="ernie-4.5-tiny", messages=CHAT, max_tokens=1)
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4o", messages=CHAT)
    assert _error(e.value)["param"] == "model"


def test_over_max_concurrency_is_429(shim):
    client, running, fake = shim(FakeTritonClient(step_delay=0.1), max_concurrency=1)
    with httpx.stream("POST", running.url + "/v1/completions", timeout=20,
                      json={"model": "ernie", "prompt": "x", "max_tokens": 50, "stream": True}) as r:
        lines = r.iter_lines()  # keep a reference: a collected iterator closes the connection
        next(lines)
        with pytest.raises(openai.RateLimitError) as e:
            client.completions.create(model="ernie", prompt="y", max_tokens=1)
        assert e.value.response.headers["retry-after"] == "1"
    deadline = time.monotonic() + 10
    while fake.running and time.monotonic() < deadline:
        time.sleep(0.05)
    client.completions.create(model="ernie", prompt="y", max_tokens=1)  # the slot came back


def test_over_max_concurrency_waits_for_a_slot_with_max_waiting_time_then_408(shim):
    client, running, fake = shim(FakeTritonClient(step_delay=0.1), max_concurrency=1, max_waiting_time=0.3)
    with httpx.stream("POST", running.url + "/v1/completions", timeout=20,
                      json={"model": "ernie", "prompt": "x", "max_tokens": 50, "stream": True}) as r:
        lines = r.iter_lines()
        next(lines)
        with pytest.raises(openai.APIStatusError) as e:  # the stream holds the slot for ~5 s
            client.completions.create(model="ernie", prompt="y", max_tokens=1)
        assert e.value.status_code == 408 and _error(e.value)["code"] == "request_timeout"
    metrics = httpx.get(running.url + "/metrics").text
    assert 'ernie_openai:requests_rejected_total{status="408"} 1.0' in metrics
    assert "ernie_openai:requests_waiting 0.0" in metrics

    client, running, fake = shim(FakeTritonClient(step_delay=0.05), max_concurrency=1, max_waiting_time=-1)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:  # one at a time, the others wait their turn
        texts = list(pool.map(lambda i: client.completions.create(model="ernie", prompt=f"p{i}", max_tokens=3)
                              .choices[0].text, range(4)))
    assert all(texts) and fake.max_running == 1, fake.max_running


def test_overloaded_engine_is_429_with_retry_after(shim):
    """Past --max-waiting-requests the engine refuses ("overloaded"): the client should back off and retry."""
    _, running, _ = shim()
    for stream in (False, True):
        r = httpx.post(running.url + "/v1/completions", timeout=20,
                       json={"model": "ernie", "prompt": "overloaded now", "max_tokens": 2, "stream": stream})
        assert r.status_code == 429, r.text
        assert r.headers["retry-after"] == "1" and r.json()["error"]["code"] == "overloaded"
        assert "max_waiting_requests" in r.json()["error"]["message"]


@pytest.mark.parametrize("prompt,status", [("invalid please", 400), ("overloaded now", 429)])
def test_a_triton_error_ends_its_stream_without_a_cancel(shim, prompt, status):
    """An error is the request's final response; a cancel after it held tritonserver 2.51's shutdown for its
    whole exit timeout (measured: 20 overloaded requests through the shim, then a 15.8 s stop)."""
    _, running, fake = shim()
    r = httpx.post(running.url + "/v1/completions", json={"model": "ernie", "prompt": prompt, "max_tokens": 2},
                   timeout=20)
    assert r.status_code == status, r.text
    deadline = time.monotonic() + 10
    while fake.running and time.monotonic() < deadline:
        time.sleep(0.05)
    assert fake.cancelled == 0 and fake.cancelled_after_final == 0


OUT_OF_RANGE = [
    ({"max_tokens": 4294967297}, "max_tokens"),  # would wrap to 1 in an INT32 tensor
    ({"max_tokens": 2147483648}, "max_tokens"),  # would wrap to -2147483648
    ({"max_completion_tokens": 2**31}, "max_completion_tokens"),
    ({"top_k": 3000000000}, "top_k"),            # would wrap to -1294967296
    ({"top_k": 10**29}, "top_k"),                # numpy: OverflowError, a 500 before
    ({"min_tokens": 10**29}, "min_tokens"),
    ({"stop_token_ids": [5, 10**29]}, "stop_token_ids[1]"),
    ({"stop_token_ids": [-1]}, "stop_token_ids[0]"),
    ({"seed": 10**29}, "seed"),
    ({"repetition_penalty": 1e29}, "repetition_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
]


@pytest.mark.parametrize("body,param", OUT_OF_RANGE, ids=[p for _, p in OUT_OF_RANGE])
def test_integers_are_range_checked_before_narrowing_to_int32(shim, body, param):
    _, running, fake = shim()
    r = httpx.post(running.url + "/v1/chat/completions", json={"model": "ernie", "messages": CHAT, **body},
                   timeout=20)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    assert fake.requests == []


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity"])
@pytest.mark.parametrize("field", ["temperature", "top_p", "repetition_penalty", "presence_penalty"])
def test_nan_and_infinity_are_400_naming_the_field(shim, field, literal):
    _, running, fake = shim()
    body = '{"model": "ernie", "messages": [{"role": "user", "content": "hi"}], "%s": %s}' % (field, literal)
    r = httpx.post(running.url + "/v1/chat/completions", content=body.encode(), timeout=20,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field
    assert fake.requests == []


LONE_SURROGATES = [
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "a\\ud800b"}]}', "messages[0].content"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], "stop": ["x", "\\udc00"]}',
     "stop[1]"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], '
                             '"chat_template_kwargs": {"\\ud83d": true}}', "chat_template_kwargs"),
    ("/v1/completions", '{"prompt": "tail \\ud800"}', "prompt"),
    ("/v1/completions", '{"prompt": ["ok", "\\udfff"]}', "prompt[1]"),
]


@pytest.mark.parametrize("path,body,param", LONE_SURROGATES, ids=[p for _, _, p in LONE_SURROGATES])
def test_lone_surrogates_are_400_naming_where(shim, path, body, param):
    _, running, fake = shim()
    r = httpx.post(running.url + path, content=body.encode(), timeout=20, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and "surrogate" in err["message"]
    assert fake.requests == []
    # a surrogate *pair* is an ordinary character
    ok = httpx.post(running.url + "/v1/completions", content='{"prompt": "\\ud83d\\ude00", "max_tokens": 1}'.encode(),
                    timeout=20, headers={"content-type": "application/json"})
    assert ok.status_code == 200, ok.text


@pytest.mark.parametrize("body", ['{"prompt": "x", "max_tokens": %s}' % ("9" * 5000),
                                  '{"prompt": "x", "user": %s}' % ("[" * 100_000 + "]" * 100_000)],
                         ids=["5000-digit-number", "nested-100000-deep"])
def test_bodies_python_json_cannot_hold_are_400(shim, body):
    _, running, fake = shim()
    r = httpx.post(running.url + "/v1/completions", content=body.encode(), timeout=20,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert "not valid JSON" in r.json()["error"]["message"]
    assert fake.requests == []


def test_an_integer_the_ensembles_tensor_cannot_hold_is_400_not_wrapped(shim):
    """An ensemble whose seed tensor is INT32: the shim's own seed limit (int64) is not enough."""
    _, running, fake = shim(FakeTritonClient(ensemble_config(dtypes={"seed": "TYPE_INT32"})))
    r = httpx.post(running.url + "/v1/completions", json={"model": "ernie", "prompt": "x", "seed": 2**40},
                   timeout=20)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "seed" and "2147483647" in r.json()["error"]["message"]
    assert fake.requests == []


def test_triton_unavailable_is_503(shim):
    client, running, _ = shim(FakeTritonClient(available=False))
    with pytest.raises(openai.InternalServerError) as e:
        client.chat.completions.create(model="ernie", messages=CHAT)
    assert e.value.status_code == 503
    assert httpx.get(running.url + "/health").status_code == 503


def test_request_timeout_is_504_and_cancels(shim):
    client, _, fake = shim(FakeTritonClient(step_delay=0.2), request_timeout=0.5)
    with pytest.raises(openai.APIStatusError) as e:
        client.completions.create(model="ernie", prompt="x", max_tokens=50)
    assert e.value.status_code == 504
    assert fake.cancelled == 1 and fake.running == 0


# ---------------------------------------------------------------------------- disconnect, metrics
def _raw_request_then_drop(port: int, body: dict, wait_for: bytes | None = b"data:") -> None:
    """Send a request, read until `wait_for` shows up in the answer (None: read nothing), then close."""
    payload = json.dumps(body).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  + f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
        got = b""
        while wait_for is not None and wait_for not in got and len(got) < 10_000:
            got += s.recv(200)
        if wait_for is None:
            time.sleep(0.3)  # let the request reach the fake


def test_client_disconnect_mid_stream_cancels_the_triton_request(shim):
    _, running, fake = shim(FakeTritonClient(step_delay=0.1))
    _raw_request_then_drop(running.port, {"model": "ernie", "messages": CHAT, "max_tokens": 200, "stream": True})
    deadline = time.monotonic() + 10
    while (fake.running or not fake.cancelled) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert fake.cancelled == 1 and fake.running == 0
    metrics = httpx.get(running.url + "/metrics").text
    assert "ernie_openai:client_disconnects_total 1.0" in metrics
    assert "ernie_openai:requests_in_flight 0.0" in metrics


def test_client_disconnect_while_waiting_for_a_whole_answer_cancels_too(shim):
    _, running, fake = shim(FakeTritonClient(step_delay=0.1))
    _raw_request_then_drop(running.port, {"model": "ernie", "messages": CHAT, "max_tokens": 200}, wait_for=None)
    deadline = time.monotonic() + 10
    while (fake.running or not fake.cancelled) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert fake.cancelled == 1 and fake.running == 0
    assert 'status="499"' in httpx.get(running.url + "/metrics").text


def test_metrics_count_requests_and_tokens(shim):
    client, running, _ = shim()
    client.completions.create(model="ernie", prompt="a b c", max_tokens=3)
    text = httpx.get(running.url + "/metrics").text
    assert 'ernie_openai:requests_total{endpoint="/v1/completions",status="200"} 1.0' in text
    assert "ernie_openai:prompt_tokens_total 3.0" in text and "ernie_openai:generation_tokens_total 3.0" in text
    assert "ernie_openai:time_to_first_token_seconds_count" in text
