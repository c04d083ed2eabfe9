"""Acceptance: the official `openai` client against the shim in front of a real tritonserver.

The model is the embedded tiny demo model, fitted to speak ERNIE's thinking format on the chats in
ernie_serve/demo/data/chat_demo.jsonl; the server runs the ernie-x1 reasoning and tool-call parsers.
One tritonserver (ernie_serve.serving.launcher.TritonServer, free ports) and one `ernie-openai` process serve
the module; shims with other settings (API key, --max-concurrency, --request-timeout, a dead Triton URL)
run in-thread against the same server.
"""
from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import numpy as np
import pytest

from openai_shim_helpers import engine_metric, engines_idle, listening_socket, refusing_socket, tritonserver
from ernie_client.openai import ServerConfig, create_app
from polling import wait_for as _wait

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]
DEMO = {row["name"]: row for row in map(json.loads, (ROOT / "backend/ernie_serve/demo/data/chat_demo.jsonl")
                                        .read_text().splitlines()) if row}
CHAT = DEMO["capital"]["messages"]
# Seconds of decoding even for the tiny model on a fast CPU (1500 tokens once ended inside a 1 s request timeout)
LONG = dict(max_tokens=8000, temperature=0, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def triton():
    with tritonserver({"reasoning_parser": "ernie-x1", "tool_call_parser": "ernie-x1", "max_model_len": "8192"}) as server:
        yield server


@pytest.fixture(scope="module")
def shim(triton):
    """`ernie-openai` as a process (the console script's module), on a socket bound here and handed over (--fd)."""
    sock = listening_socket()
    port = sock.getsockname()[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "client"), str(ROOT / "backend"),
                                                      os.environ.get("PYTHONPATH", "")]))
    with sock:
        proc = subprocess.Popen([sys.executable, "-m", "ernie_client.openai_server", "--triton-url", triton.grpc_url,
                                 "--port", str(port), "--fd", str(sock.fileno()), "--served-model-name", "ernie-tiny",
                                 "--log-level", "warning"], env=env, start_new_session=True, pass_fds=(sock.fileno(),))
    url = f"http://127.0.0.1:{port}"

    def healthy():
        try:
            return httpx.get(url + "/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return proc.poll() is not None and pytest.fail(f"ernie-openai exited with {proc.returncode}")

    try:
        _wait(healthy, 60, "ernie-openai /health")
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


@pytest.fixture(scope="module")
def client(shim):
    return openai.OpenAI(base_url=shim + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture
def other_shim(start_shim, triton):
    def make(**cfg):
        cfg.setdefault("triton_url", triton.grpc_url)
        running = start_shim(create_app(ServerConfig(**cfg)))
        return running, openai.OpenAI(base_url=running.url + "/v1", api_key=cfg.get("api_key") or "unused",
                                      max_retries=0, timeout=120)
    return make


# ---------------------------------------------------------------------------- chat
def _reasoning(delta) -> str:
    return getattr(delta, "reasoning_content", None) or ""


def test_chat_non_streaming_and_streaming_agree_with_reasoning_separated(client):
    r = client.chat.completions.create(model="ernie-tiny", messages=CHAT, max_tokens=80, temperature=0)
    msg = r.choices[0].message
    assert r.object == "chat.completion" and msg.role == "assistant"
    assert msg.reasoning_content.strip() == DEMO["capital"]["reasoning"]
    assert msg.content.strip() == DEMO["capital"]["response"]
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert 0 < r.usage.completion_tokens_details.reasoning_tokens < r.usage.completion_tokens
    chunks = list(client.chat.completions.create(model="ernie-tiny", messages=CHAT, max_tokens=80, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == msg.content
    assert "".join(_reasoning(c.choices[0].delta) for c in chunks if c.choices) == msg.reasoning_content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == r.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == r.usage.prompt_tokens


def test_sse_stream_ends_with_done(shim):
    with httpx.stream("POST", shim + "/v1/chat/completions", timeout=60,
                      json={"model": "ernie-tiny", "messages": CHAT, "max_tokens": 3, "stream": True}) as r:
        lines = [line for line in r.iter_lines() if line]
    assert r.status_code == 200 and lines[-1] == "data: [DONE]"


def test_usage_equals_the_engine_counts(client, triton):
    prompt = "The sea is wide and"
    r = client.completions.create(model="ernie-tiny", prompt=prompt, max_tokens=10, temperature=0,
                                  extra_body={"return_token_ids": True})
    direct = httpx.post(f"http://{triton.http_url}/v2/models/ernie/generate", timeout=60, json={
        "text_input": prompt, "max_tokens": 10, "temperature": 0.0, "exclude_input_in_output": True,
        "return_num_input_tokens": True, "return_num_output_tokens": True, "skip_parsers": True}).json()
    # a completion is the raw text: the shim asks for skip_parsers
    assert r.choices[0].text == direct["text_output"] and direct["reasoning_content"] == ""
    assert r.usage.prompt_tokens == direct["num_input_tokens"] == len(direct["prompt_token_ids"])
    assert r.usage.completion_tokens == direct["num_output_tokens"]
    assert r.choices[0].prompt_token_ids == direct["prompt_token_ids"]
    assert r.choices[0].completion_token_ids == direct["output_ids"]


def test_reasoning_tokens_are_the_parsers_count(client, triton):
    r = client.chat.completions.create(model="ernie-tiny", messages=CHAT, max_tokens=80, temperature=0,
                                       extra_body={"return_token_ids": True})
    direct = httpx.post(f"http://{triton.http_url}/v2/models/ernie/generate", timeout=60, json={
        "messages": json.dumps(CHAT), "max_tokens": 80, "temperature": 0.0}).json()
    assert r.usage.completion_tokens_details.reasoning_tokens == direct["num_reasoning_tokens"] > 0
    assert r.choices[0].message.prompt_token_ids == direct["prompt_token_ids"]
    assert r.choices[0].message.completion_token_ids == direct["output_ids"]
    assert len(r.choices[0].message.prompt_token_ids) == r.usage.prompt_tokens


def test_reasoning_max_tokens_closes_the_thinking_streamed_or_not(client, triton):
    from ernie_serve.demo.tiny_model import ensure_tiny_model
    from ernie_serve.parsers import get_reasoning_parser
    from ernie_serve.tokenizer import ErnieTokenizer

    end = get_reasoning_parser("ernie-x1")(ErnieTokenizer.from_pretrained(ensure_tiny_model())).think_end_token_id
    body = {"reasoning_max_tokens": 3, "return_token_ids": True}
    r = client.chat.completions.create(model="ernie-tiny", messages=CHAT, max_tokens=40, temperature=0,
                                       extra_body=body)
    ids = r.choices[0].message.completion_token_ids
    assert ids[3] == end and end not in ids[:3]
    assert r.usage.completion_tokens_details.reasoning_tokens <= 4
    chunks = list(client.chat.completions.create(model="ernie-tiny", messages=CHAT, max_tokens=40, temperature=0,
                                                 stream=True, extra_body={"reasoning_max_tokens": 3}))
    message = r.choices[0].message
    assert "".join(_reasoning(c.choices[0].delta) for c in chunks if c.choices) == message.reasoning_content
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == message.content
    direct = httpx.post(f"http://{triton.http_url}/v2/models/ernie/generate", timeout=60, json={
        "messages": json.dumps(CHAT), "max_tokens": 40, "temperature": 0.0,
        "sampling_parameters": json.dumps({"reasoning_max_tokens": 3})}).json()
    assert direct["output_ids"] == ids
    off = client.chat.completions.create(model="ernie-tiny", messages=CHAT, max_tokens=40, temperature=0,
                                         extra_body={"reasoning_max_tokens": 3, "return_token_ids": True,
                                                     "chat_template_kwargs": {"enable_thinking": False}})
    plain = client.chat.completions.create(model="ernie-tiny", messages=CHAT, max_tokens=40, temperature=0,
                                           extra_body={"return_token_ids": True,
                                                       "chat_template_kwargs": {"enable_thinking": False}})
    assert off.choices[0].message.completion_token_ids == plain.choices[0].message.completion_token_ids
    unparsed = httpx.post(f"http://{triton.http_url}/v2/models/ernie/generate", timeout=60, json={
        "text_input": "hi", "max_tokens": 4, "skip_parsers": True,
        "sampling_parameters": json.dumps({"reasoning_max_tokens": 3})})
    assert unparsed.status_code == 400 and "reasoning_max_tokens" in unparsed.text


def test_completions_keep_the_reasoning_markers(client):
    from ernie_serve.chat import render_chat_prompt
    from ernie_serve.demo.tiny_model import ensure_tiny_model
    from ernie_serve.tokenizer import ErnieTokenizer

    prompt, _ = render_chat_prompt(ErnieTokenizer.from_pretrained(ensure_tiny_model()), CHAT)
    chat = client.chat.completions.create(model="ernie-tiny", messages=CHAT, max_tokens=80, temperature=0)
    text = client.completions.create(model="ernie-tiny", prompt=prompt, max_tokens=80, temperature=0).choices[0].text
    assert "</think>" in text and "<response>" in text
    assert text.split("</think>")[0] == chat.choices[0].message.reasoning_content


def test_many_concurrent_streams(shim, client):
    msg = client.chat.completions.create(model="ernie-tiny", messages=CHAT, max_tokens=40,
                                         temperature=0).choices[0].message
    want = (msg.reasoning_content or "") + "|" + (msg.content or "")

    async def one(aclient):
        reasoning = content = ""
        async for c in await aclient.chat.completions.create(model="ernie-tiny", messages=CHAT, max_tokens=40,
                                                             temperature=0, stream=True):
            reasoning += _reasoning(c.choices[0].delta)
            content += c.choices[0].delta.content or ""
        return reasoning + "|" + content

    async def run():
        async with openai.AsyncOpenAI(base_url=shim + "/v1", api_key="x", max_retries=0, timeout=120) as aclient:
            return await asyncio.gather(*[one(aclient) for _ in range(8)])

    assert asyncio.run(run()) == [want] * 8


# ---------------------------------------------------------------------------- completions and sampling
def test_completions_with_echo(client):
    prompt = "Once upon a time"
    plain = client.completions.create(model="ernie-tiny", prompt=prompt, max_tokens=6, temperature=0)
    echoed = client.completions.create(model="ernie-tiny", prompt=prompt, max_tokens=6, temperature=0, echo=True)
    assert echoed.choices[0].text == prompt + plain.choices[0].text
    chunks = list(client.completions.create(model="ernie-tiny", prompt=prompt, max_tokens=6, temperature=0,
                                            echo=True, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == echoed.choices[0].text


def test_n2_returns_two_choices(client):
    r = client.chat.completions.create(model="ernie-tiny", messages=CHAT, n=2, max_tokens=6, temperature=1.0,
                                       seed=1)
    assert [c.index for c in r.choices] == [0, 1]
    assert all((c.message.content or c.message.reasoning_content) and c.finish_reason for c in r.choices)
    assert r.usage.completion_tokens <= 12
    chunks = list(client.chat.completions.create(model="ernie-tiny", messages=CHAT, n=2, max_tokens=4, stream=True))
    assert sorted(c.choices[0].index for c in chunks if c.choices[0].finish_reason) == [0, 1]


def test_stop_string_ends_the_text_before_it(client):
    full = client.completions.create(model="ernie-tiny", prompt="A long story:", max_tokens=16,
                                     temperature=0).choices[0].text
    stop = full[len(full) // 2:len(full) // 2 + 3]
    assert stop.strip(), f"pick a visible stop string from {full!r}"
    r = client.completions.create(model="ernie-tiny", prompt="A long story:", max_tokens=16, temperature=0,
                                  stop=[stop])
    assert r.choices[0].text == full[:full.index(stop)]
    assert r.choices[0].finish_reason == "stop"


def test_logit_bias_forces_a_token_and_an_id_past_the_vocabulary_is_400(client):
    r = client.completions.create(model="ernie-tiny", prompt="A long story:", max_tokens=3, temperature=0.8,
                                  logit_bias={"1234": 100})
    forced = client.completions.create(model="ernie-tiny", prompt="x", max_tokens=1, temperature=0,
                                       logit_bias={"1234": 100}).choices[0].text
    assert r.choices[0].text == forced * 3, (r.choices[0].text, forced)
    with pytest.raises(openai.BadRequestError) as e:  # refused by the engine, which knows the vocabulary
        client.completions.create(model="ernie-tiny", prompt="x", max_tokens=1, logit_bias={"99999999": 1})
    assert _err(e.value)["param"] == "logit_bias" and "token ids in [0, " in _err(e.value)["message"]


def test_a_token_id_prompt_completes_as_its_text_does(client):
    by_text = client.completions.create(model="ernie-tiny", prompt="A long story:", max_tokens=8, temperature=0,
                                        extra_body={"return_token_ids": True}).choices[0]
    ids = by_text.model_extra["prompt_token_ids"]
    by_ids = client.completions.create(model="ernie-tiny", prompt=ids, max_tokens=8, temperature=0)
    assert by_ids.choices[0].text == by_text.text and by_ids.usage.prompt_tokens == len(ids)
    with pytest.raises(openai.BadRequestError) as e:  # refused by Triton's tokenizer model, named as the prompt
        client.completions.create(model="ernie-tiny", prompt=[5, 99999999], max_tokens=1)
    assert _err(e.value)["param"] == "prompt" and "token ids must be in [0, " in _err(e.value)["message"]


def test_seed_makes_sampling_reproducible(client):
    kw = dict(model="ernie-tiny", prompt="Random words:", max_tokens=10, temperature=1.0, top_p=0.95)
    a = client.completions.create(seed=1234, **kw).choices[0].text
    b = client.completions.create(seed=1234, **kw).choices[0].text
    assert a == b


def test_logprobs(client):
    r = client.chat.completions.create(model="ernie-tiny", messages=CHAT, max_tokens=4, temperature=0,
                                       logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 4
    assert all(c.logprob <= 0 and len(c.top_logprobs) == 2 for c in content)
    assert all(c.token == c.top_logprobs[0].token and c.logprob == c.top_logprobs[0].logprob for c in content)  # greedy
    assert all(c.bytes == list(c.token.encode()) for c in content)
    chunks = list(client.chat.completions.create(model="ernie-tiny", messages=CHAT, max_tokens=4, temperature=0,
                                                 logprobs=True, top_logprobs=2, stream=True))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]

    c = client.completions.create(model="ernie-tiny", prompt="The sea is wide and", max_tokens=5, temperature=0,
                                  logprobs=1)
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    # (the tokens add up to the text unless one is a special token or a UTF-8 fragment, as here)
    assert all(lp.tokens)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]
    assert all(len(top) == 1 and list(top.values())[0] == v for top, v in zip(lp.top_logprobs, lp.token_logprobs))


def test_cached_tokens_on_a_repeated_long_prompt(client):
    prompt = " ".join(f"item{i} is number {i} in the list;" for i in range(60))
    first = client.completions.create(model="ernie-tiny", prompt=prompt, max_tokens=2, temperature=0)
    second = client.completions.create(model="ernie-tiny", prompt=prompt, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens > 128  # more than two 64-token blocks
    assert second.usage.prompt_tokens_details.cached_tokens > 0
    assert second.usage.prompt_tokens_details.cached_tokens < second.usage.prompt_tokens


# ---------------------------------------------------------------------------- tools (demo model)
def test_tool_call_parsed_with_name_json_arguments_and_finish_reason(client):
    row = DEMO["weather_call"]
    r = client.chat.completions.create(model="ernie-tiny", messages=row["messages"], tools=row["tools"],
                                       max_tokens=120, temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.reasoning_content
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments)["location"] == "Paris"
    chunks = list(client.chat.completions.create(model="ernie-tiny", messages=row["messages"], tools=row["tools"],
                                                 max_tokens=120, temperature=0, stream=True))
    deltas = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].function.name == "get_weather" and deltas[0].id.startswith("chatcmpl-tool-")
    assert json.loads("".join(d.function.arguments or "" for d in deltas)) == json.loads(call.function.arguments)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_follow_up_turn_with_the_tool_result(client):
    row = DEMO["weather_result"]
    messages = [dict(m) for m in row["messages"]]
    messages[1]["content"] = None  # how the openai client sends an assistant turn that only called tools
    messages[1]["tool_calls"][0]["id"] = "call-0"
    messages[2]["tool_call_id"] = "call-0"
    r = client.chat.completions.create(model="ernie-tiny", messages=messages, tools=row["tools"], max_tokens=120,
                                       temperature=0)
    assert r.choices[0].finish_reason == "stop" and not r.choices[0].message.tool_calls
    assert r.choices[0].message.content.strip() == row["response"]


def test_models_and_health(client, shim):
    assert [m.id for m in client.models.list().data] == ["ernie-tiny"]
    assert httpx.get(shim + "/health").json() == {"status": "ok"}
    assert "ernie_openai:requests_total" in httpx.get(shim + "/metrics").text


# ---------------------------------------------------------------------------- errors
def _err(e: openai.APIStatusError) -> dict:
    return e.response.json()["error"]


def test_invalid_field_is_400(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="ernie-tiny", messages=CHAT, temperature=5)
    assert _err(e.value)["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as e:  # refused by Triton's tokenizer model
        client.completions.create(model="ernie-tiny", prompt="word " * 9000, max_tokens=2)
    assert _err(e.value)["param"] == "prompt" and "max_model_len" in _err(e.value)["message"]
    for field in ("max_tokens", "max_completion_tokens"):  # beyond what the context leaves (vLLM / OpenAI: 400)
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="ernie-tiny", messages=CHAT, **{field: 10**6})
        assert _err(e.value)["param"] == "max_tokens" and "max_model_len is" in _err(e.value)["message"], e.value
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="ernie-tiny", messages=CHAT, max_tokens=2, stream=False,
                                       stream_options={"include_usage": True})
    assert _err(e.value)["param"] == "stream_options"


def test_bad_api_key_is_401(other_shim):
    running, good = other_shim(api_key="k3y")
    assert good.chat.completions.create(model="ernie", messages=CHAT, max_tokens=1).choices
    bad = openai.OpenAI(base_url=running.url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        bad.chat.completions.create(model="ernie", messages=CHAT, max_tokens=1)
    assert _err(e.value)["type"] == "authentication_error"


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-5", messages=CHAT, max_tokens=1)
    assert _err(e.value)["code"] == "model_not_found"


def test_over_max_concurrency_is_429(other_shim, triton):
    running, c = other_shim(max_concurrency=1)
    stream = c.chat.completions.create(model="ernie", messages=CHAT, stream=True, **LONG)
    next(iter(stream))
    try:
        with pytest.raises(openai.RateLimitError):
            c.chat.completions.create(model="ernie", messages=CHAT, max_tokens=1)
    finally:
        stream.close()
    _wait(lambda: engines_idle(triton), 20, "the held stream to be cancelled")
    assert c.chat.completions.create(model="ernie", messages=CHAT, max_tokens=1).choices


def test_triton_unavailable_is_503(other_shim):
    with refusing_socket() as nobody:  # no Triton can answer there while it is held
        running, c = other_shim(triton_url=f"127.0.0.1:{nobody.getsockname()[1]}")
        with pytest.raises(openai.InternalServerError) as e:
            c.chat.completions.create(model="ernie", messages=CHAT, max_tokens=1)
        assert e.value.status_code == 503 and _err(e.value)["type"] == "service_unavailable"
        assert httpx.get(running.url + "/health").status_code == 503


def test_request_timeout_is_504_and_frees_the_request(other_shim, triton):
    _, c = other_shim(request_timeout=1.0)
    t0 = time.monotonic()
    with pytest.raises(openai.APIStatusError) as e:
        c.chat.completions.create(model="ernie", messages=CHAT, **LONG)
    assert e.value.status_code == 504 and time.monotonic() - t0 < 10
    _wait(lambda: engines_idle(triton), 20, "the timed-out request to leave the engine")


def test_client_disconnect_mid_stream_frees_its_kv_blocks(shim, triton):
    generated_before = engine_metric(triton, "ernie:generation_tokens_total")
    body = json.dumps({"model": "ernie-tiny", "messages": CHAT, "stream": True, "max_tokens": 8000,
                       "temperature": 0, "ignore_eos": True}).encode()
    port = int(shim.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        got = b""
        while got.count(b"data:") < 5:
            got += s.recv(4096)
        assert engine_metric(triton, "ernie:kv_cache_usage_perc") > 0
    _wait(lambda: engines_idle(triton), 20, "the abandoned request's KV blocks to be freed")
    assert engine_metric(triton, "ernie:generation_tokens_total") - generated_before < 8000


def test_tokenize_counts_the_prompt_tokens_the_server_counts(other_shim, tiny_model_dir):
    """/tokenize against the real server's usage: the same count for a text prompt and for a chat."""
    running, client = other_shim(tokenizer=str(tiny_model_dir), max_model_len=2048)
    prompt, chat = "Tell me about the weather", [{"role": "user", "content": "Tell me about the weather"}]
    counted = httpx.post(f"{running.url}/tokenize", json={"prompt": prompt}).json()["count"]
    assert client.completions.create(model="ernie", prompt=prompt, max_tokens=1).usage.prompt_tokens == counted
    counted = httpx.post(f"{running.url}/tokenize", json={"messages": chat}).json()["count"]
    assert client.chat.completions.create(model="ernie", messages=chat,
                                          max_tokens=1).usage.prompt_tokens == counted


def test_prompt_logprobs_through_triton_equal_the_offline_engines(other_shim, tiny_model_dir):
    """lm-eval's loglikelihood request (local-completions, tokenizer_backend=remote): token ids from /tokenize, echo,
    logprobs 1, max_tokens 1. Through the shim and the ensemble, each prompt token's logprob is the offline engine's;
    vLLM's prompt_logprobs on a chat covers every prompt token."""
    from ernie_serve import LLM, SamplingParams

    running, client = other_shim(tokenizer=str(tiny_model_dir), max_model_len=2048, served_model_name="ernie-tiny")
    ids = httpx.post(f"{running.url}/tokenize", json={"prompt": "The capital of France is Paris"}).json()["tokens"]
    r = httpx.post(f"{running.url}/v1/completions", timeout=120,
                   json={"model": "ernie-tiny", "prompt": [ids], "max_tokens": 1, "logprobs": 1, "echo": True,
                         "temperature": 0, "seed": 1234}).json()
    assert "choices" in r, r
    lp = r["choices"][0]["logprobs"]
    assert len(lp["token_logprobs"]) == len(ids) + 1 and lp["token_logprobs"][0] is None
    assert lp["top_logprobs"][0] is None and all(len(t) >= 1 for t in lp["top_logprobs"][1:])
    llm = LLM(str(tiny_model_dir), enable_logprob=True, disable_progress_bar=True)
    try:
        (offline,) = llm.generate(prompt_token_ids=[ids], use_tqdm=False,
                                  sampling_params=SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1))
    finally:
        llm.engine.close()
    want = [offline.prompt_logprobs[i][t].logprob for i, t in enumerate(ids) if i]
    assert np.allclose(lp["token_logprobs"][1:len(ids)], want, rtol=1e-4, atol=1e-4)
    # is_greedy as lm-eval decides it: the token's logprob is the best of its top_logprobs
    greedy = [v == max(top.values()) for v, top in zip(lp["token_logprobs"][1:], lp["top_logprobs"][1:])]
    assert greedy == [offline.prompt_logprobs[i][t].rank == 1 for i, t in enumerate(ids) if i] + [True]
    chat = client.chat.completions.create(model="ernie-tiny", messages=CHAT, max_tokens=1, temperature=0,
                                          extra_body={"prompt_logprobs": 1})
    entries = chat.model_extra["prompt_logprobs"]
    assert len(entries) == chat.usage.prompt_tokens and entries[0] is None
    assert all(all(v["logprob"] <= 0 for v in e.values()) for e in entries[1:])
