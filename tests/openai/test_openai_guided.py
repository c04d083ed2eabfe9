"""The shim's structured-output fields against a fake Triton: response_format, guided_* and tool_choice travel
in sampling_parameters under the names the ensemble takes, and the ensemble's INVALID_ARG comes back as a
400 naming the client's field. The same against a real tritonserver: test_openai_guided_e2e.py."""
from __future__ import annotations

import json

import openai
import pytest
from tritonclient.utils import InferenceServerException

from ernie_client.openai import ServerConfig, create_app
from ernie_client.openai.triton import TritonBackend

from openai_fake_triton import FakeTritonClient, _str

CHAT = [{"role": "user", "content": "hello there"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


class RefusingTriton(FakeTritonClient):
    """Answers a request whose sampling_parameters hold `refuse` with the ensemble's INVALID_ARG text."""

    def __init__(self, refuse: str, message: str):
        super().__init__()
        self.refuse, self.message = refuse, message

    def script(self, t):
        if self.refuse in json.loads(_str(t["sampling_parameters"])):
            yield InferenceServerException(f"in ensemble 'ernie', {self.message}")
            return
        yield from super().script(t)


@pytest.fixture
def shim(start_shim):
    def make(fake: FakeTritonClient | None = None):
        fake = fake or FakeTritonClient()
        config = ServerConfig(triton_url="fake:8001")
        running = start_shim(create_app(config, TritonBackend(config.triton_url, config.model_name,
                                                              client_factory=lambda _: fake)))
        return openai.OpenAI(base_url=running.url + "/v1", api_key="none", max_retries=0, timeout=20), fake
    return make


def sampling_sent(fake: FakeTritonClient) -> dict:
    return json.loads(_str(fake.requests[-1]["sampling_parameters"]))


@pytest.mark.parametrize("extra", [
    {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}},
    {"response_format": {"type": "json_object"}},
    {"extra_body": {"guided_json": SCHEMA}},
    {"extra_body": {"guided_regex": "[0-9]+"}},
    {"extra_body": {"guided_choice": ["yes", "no"]}},
    {"extra_body": {"guided_grammar": 'root ::= "a"'}},
])
def test_chat_structured_output_fields_reach_the_ensemble_as_sent(shim, extra):
    client, fake = shim()
    client.chat.completions.create(model="ernie", messages=CHAT, max_tokens=3, **extra)
    sent = sampling_sent(fake)
    for key, value in (extra.get("extra_body") or extra).items():
        assert sent[key] == value


def test_completions_take_guided_fields_too(shim):
    client, fake = shim()
    client.completions.create(model="ernie", prompt="Count:", max_tokens=3, extra_body={"guided_regex": "[0-9]+"})
    assert sampling_sent(fake)["guided_regex"] == "[0-9]+"


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_tool_choice_required_or_named_is_sent_with_the_tools(shim, tool_choice):
    client, fake = shim()
    r = client.chat.completions.create(model="ernie", messages=[{"role": "user", "content": "weather?"}],
                                       tools=[WEATHER], tool_choice=tool_choice, parallel_tool_calls=False)
    sent = sampling_sent(fake)
    assert sent["tool_choice"] == tool_choice and sent["parallel_tool_calls"] is False
    assert json.loads(_str(fake.requests[-1]["tools"]))[0]["function"]["name"] == "get_weather"
    assert r.choices[0].message.tool_calls[0].function.name == "get_weather"


@pytest.mark.parametrize("body, message, param", [
    ({"response_format": {"type": "json_object"}}, "response_format: does not compile: Invalid type: strin",
     "response_format"),
    ({"extra_body": {"guided_regex": "(a"}}, "guided_regex: does not compile: invalid regex", "guided_regex"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice: names function 'nope', which is not in tools ('get_weather')", "tool_choice"),
])
def test_the_ensembles_invalid_arg_is_a_400_naming_the_field(shim, body, message, param):
    client, _ = shim(RefusingTriton(param, message))
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="ernie", messages=CHAT, max_tokens=3, **body)
    err = e.value.response.json()["error"]
    assert err["param"] == param and message in err["message"]
