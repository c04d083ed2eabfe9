"""Structured outputs end to end: the official `openai` client against the shim in front of a real tritonserver
serving the demo model with the ernie-x1 parsers, at temperature 1 (the model thinks first, then answers)."""
from __future__ import annotations

import json
import re
import time
import urllib.error
import urllib.request

import httpx
import jsonschema
import openai
import pytest

from ernie_client.triton_client import generate

pytestmark = pytest.mark.e2e
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "city"],
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "city": {"enum": ["Paris", "Rome", "Berlin"]}}}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city.",
                                            "parameters": {"type": "object", "required": ["location"],
                                                           "properties": {"location": {"type": "string"}}}}}
CALCULATOR = {"type": "function", "function": {"name": "calculator", "parameters": {
    "type": "object", "required": ["a", "b"], "properties": {"a": {"type": "number"}, "b": {"type": "number"}}}}}
ASK = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER_ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]


@pytest.fixture(scope="module")
def served():
    from ernie_serve.serving.launcher import TritonServer

    server = TritonServer({"reasoning_parser": "ernie-x1", "tool_call_parser": "ernie-x1", "max_model_len": "1024",
                           "max_num_seqs": "8", "block_size": "16", "num_gpu_blocks_override": "256"},
                          http_port=0, grpc_port=0, metrics_port=0, openai_port=0)  # 0: ports of its own
    try:
        server.start(timeout=300)
        url = f"http://{server.host}:{server.openai_port}"
        deadline = time.monotonic() + 60
        while not _healthy(url):
            if time.monotonic() > deadline:
                raise RuntimeError("ernie-openai did not become healthy")
            time.sleep(0.2)
    except Exception:
        server.stop()
        server.cleanup()
        raise
    yield server
    server.stop()
    server.cleanup()


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=f"http://{served.host}:{served.openai_port}/v1", api_key="unused", max_retries=0,
                         timeout=180)


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_json_schema_answers_validate_at_temperature_one(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    r = client.chat.completions.create(model="ernie", messages=ASK, response_format=fmt, temperature=1.0, n=6,
                                       max_tokens=400, seed=1)
    for choice in r.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), PERSON)
        assert choice.message.reasoning_content  # the reasoning before </think> is free


def test_streamed_json_schema_content_validates(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    stream = client.chat.completions.create(model="ernie", messages=ASK, response_format=fmt, temperature=1.0,
                                            max_tokens=400, seed=3, stream=True)
    content = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    jsonschema.validate(json.loads(content), PERSON)


@pytest.mark.parametrize("tool_choice, name", [("required", None),
                                               ({"type": "function", "function": {"name": "calculator"}},
                                                "calculator")])
def test_tool_choice_required_or_named_always_gives_a_valid_call(client, tool_choice, name):
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, CALCULATOR)}
    for seed in range(3):
        r = client.chat.completions.create(model="ernie", messages=ASK, tools=[WEATHER, CALCULATOR],
                                           tool_choice=tool_choice, temperature=1.0, max_tokens=500, seed=seed)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
        for call in choice.message.tool_calls:
            assert name is None or call.function.name == name
            jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


def test_completions_guided_regex_is_the_whole_text(client):
    r = client.completions.create(model="ernie", prompt="Code:", max_tokens=40, temperature=1.0, seed=2,
                                  extra_body={"guided_regex": "[A-Z]{3}-[0-9]{4}"})
    assert re.fullmatch("[A-Z]{3}-[0-9]{4}", r.choices[0].text) and r.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
     "response_format"),
    ({"extra_body": {"guided_regex": "(unclosed"}}, "guided_regex"),
    ({"extra_body": {"guided_grammar": "start: <no_such_token>"}}, "guided_grammar"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
])
def test_a_grammar_that_does_not_compile_is_a_400_naming_the_field(client, body, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="ernie", messages=WEATHER_ASK, max_tokens=8, **body)
    assert e.value.response.json()["error"]["param"] == param
    ok = client.chat.completions.create(model="ernie", messages=ASK, max_tokens=4, temperature=0)
    assert ok.choices[0].finish_reason == "length"  # the server goes on


def test_through_triton_a_bad_grammar_is_invalid_arg_naming_the_field(served):
    request = urllib.request.Request(f"http://{served.http_url}/v2/models/ernie/generate", headers={
        "Content-Type": "application/json"}, data=json.dumps({"text_input": "hi", "sampling_parameters": json.dumps(
            {"guided_regex": "(unclosed"})}).encode())
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(request, timeout=120)
    assert e.value.code == 400 and "guided_regex: does not compile" in json.loads(e.value.read())["error"]
    with pytest.raises(Exception, match="guided_json is not valid JSON"):
        generate(served.grpc_url, text="hi", max_tokens=4, sampling_parameters={"guided_json": "{oops"})
    good = generate(served.grpc_url, text="hi", max_tokens=8, sampling_parameters={"guided_choice": ["yes", "no"]},
                    skip_parsers=True)
    assert good.text in ("yes", "no")
