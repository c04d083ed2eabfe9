"""The ensemble's guided-decoding inputs: sampling_parameters keys (guided_* / response_format / tool_choice)
become the constraint the engine runs, placed where the request's parsers read it; every bad one is
INVALID_ARG naming the key the client sent."""
from __future__ import annotations

import json

import pytest

from ernie_serve.serving.errors import InvalidInput
from ernie_serve.serving.preprocess import Preprocessor
from ernie_serve.serving.request import parse_request
from serving_fakes import s

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"location": {"type": "string"}}, "required": ["location"]}}}]
CHAT = [{"role": "user", "content": "What is the weather like in Paris today?"}]


@pytest.fixture(scope="module")
def pre(tokenizer) -> Preprocessor:
    return Preprocessor(tokenizer, 1024, reasoning_parser="ernie-x1", tool_call_parser="ernie-x1")


def encode(pre, sampling: dict, messages=CHAT, tools=None, kwargs=None, text=None, parameters=None):
    inputs = {"sampling_parameters": s(json.dumps(sampling))}
    if text is not None:
        inputs["text_input"] = s(text)
    else:
        inputs["messages"] = s(json.dumps(messages))
    if tools is not None:
        inputs["tools"] = s(json.dumps(tools))
    if kwargs is not None:
        inputs["chat_template_kwargs"] = s(json.dumps(kwargs))
    ids, payload = pre.encode(parse_request(inputs, parameters))
    return ids, payload["sampling"]["guided_decoding"]


def test_a_thinking_chat_is_constrained_inside_the_response_after_think(pre, tokenizer):
    _, guided = encode(pre, {"guided_json": {"type": "object"}})
    assert guided["start_after_token_id"] == tokenizer.token_to_id("</think>")
    assert "<response>" in guided["grammar"] and "@answer" in guided["grammar"]


def test_thinking_off_constrains_from_the_first_token_still_inside_the_response(pre):
    _, guided = encode(pre, {"response_format": {"type": "json_object"}}, kwargs={"enable_thinking": False})
    assert guided["start_after_token_id"] is None and "<response>" in guided["grammar"]


def test_a_raw_completion_without_parsers_is_constrained_as_sent(pre):
    _, guided = encode(pre, {"guided_regex": "[0-9]+"}, text="Count:", parameters={"skip_parsers": True})
    assert guided["regex"] == "[0-9]+" and guided["start_after_token_id"] is None


@pytest.mark.parametrize("sampling, kind", [
    ({"guided_json": '{"type": "object"}'}, "json_schema"),
    ({"guided_choice": ["yes", "no"]}, "lark_grammar"),
    ({"guided_grammar": 'root ::= "a"'}, "lark_grammar"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"},
                                                                 "strict": True}}}, "json_schema"),
])
def test_each_client_spelling_becomes_one_wrapped_constraint(pre, sampling, kind):
    _, guided = encode(pre, sampling)
    answer = json.loads(guided["grammar"])["grammars"][1]
    assert answer["name"] == "answer" and answer.get(kind)


def test_response_format_text_is_no_constraint(pre):
    _, guided = encode(pre, {"response_format": {"type": "text"}})
    assert guided is None


def test_tool_choice_required_constrains_to_the_tool_parsers_call_blocks(pre, tokenizer):
    _, guided = encode(pre, {"tool_choice": "required"}, tools=TOOLS)
    lark = json.loads(guided["grammar"])["grammars"][0]["lark_grammar"]
    assert "call: <tool_call>" in lark and '"const": "get_weather"' in lark
    assert guided["start_after_token_id"] == tokenizer.token_to_id("</think>")


def test_tool_choice_none_hides_the_tools(pre):
    ids_none, _ = encode(pre, {"tool_choice": "none"}, tools=TOOLS)
    ids_plain, _ = encode(pre, {})
    assert ids_none == ids_plain


@pytest.mark.parametrize("sampling, tools, field, message", [
    ({"guided_regex": "(a"}, None, "guided_regex", "guided_regex: does not compile"),
    ({"guided_json": {"type": "strin"}}, None, "guided_json", "guided_json: does not compile"),
    ({"guided_json": "{oops"}, None, "guided_json", "guided_json is not valid JSON"),
    ({"guided_grammar": "start: <no_such_token>"}, None, "guided_grammar", "unknown special token"),
    ({"guided_choice": []}, None, "guided_choice", "guided_choice must be a non-empty list"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, None, "guided_choice", "give one guided-decoding constraint"),
    ({"response_format": {"type": "yaml"}}, None, "response_format", 'type must be "text", "json_object"'),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, None, "response_format",
     'json_schema must be an object with a "schema"'),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 7}}}}, None,
     "response_format", "response_format: does not compile"),
    ({"tool_choice": "required"}, None, "tool_choice", "needs tools"),
    ({"tool_choice": "always"}, TOOLS, "tool_choice", "must be 'none', 'auto', 'required'"),
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, TOOLS, "tool_choice",
     "names function 'nope', which is not in tools ('get_weather')"),
    ({"tool_choice": "required"}, [{"type": "function", "function": {"name": "f", "parameters": {"type": "x"}}}],
     "tools", "tools[0].function.parameters"),
    ({"tool_choice": "required", "guided_regex": "a"}, TOOLS, "tool_choice", "cannot be combined with guided_regex"),
    ({"tool_choice": "required", "parallel_tool_calls": "yes"}, TOOLS, "parallel_tool_calls", "true or false"),
])
def test_bad_guided_input_is_invalid_arg_naming_the_clients_field(pre, sampling, tools, field, message):
    with pytest.raises(InvalidInput) as e:
        encode(pre, sampling, tools=tools)
    assert e.value.field == field and message in str(e.value) and str(e.value).startswith(field)


def test_tool_choice_needs_a_tool_parser_and_a_chat(tokenizer, pre):
    bare = Preprocessor(tokenizer, 1024)
    with pytest.raises(InvalidInput, match="needs a tool-call parser"):
        encode(bare, {"tool_choice": "required"}, tools=TOOLS)
    with pytest.raises(InvalidInput, match="only applies to chat requests"):
        encode(pre, {"tool_choice": "required"}, text="hi")
