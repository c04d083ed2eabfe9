"""ChatOutputParser: one per request; combines the reasoning and tool parsers."""
from __future__ import annotations

import pytest

from ernie_serve.parsers import ChatOutputParser, ParsedOutput, parse_complete
from parser_helpers import Streamed, token_deltas

TOOLS = [{"type": "function", "function": {"name": "f"}}]


def run(tok, rp, tp, prompt, text, tools=TOOLS, **kw):
    p = ChatOutputParser(tok, rp, tp, prompt, tools, **kw)
    s = Streamed()
    for delta, ids in token_deltas(tok, text, list(range(len(text) + 1))):
        s.add(p.feed(delta, ids))
    s.add(p.feed("", (), final=True))
    return p, s, p.finish()


def test_reasoning_then_tool_call_right_after_think_end(tok):
    text = 'why</think><tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>'
    p, s, final = run(tok, "ernie-x1", "ernie-x1", [], text)
    assert final == ParsedOutput("why", "", final.tool_calls, True)
    assert final.tool_calls[0].function.arguments == '{"a": 1}' and s.ids[0] == final.tool_calls[0].id
    assert p.num_reasoning_tokens == 3  # "w", "h", "y"


def test_reasoning_and_response(tok):
    text = "想一想\n</think>\n\n<response>答案\n</response>"
    _, s, final = run(tok, "ernie-x1", "ernie-x1", [], text)
    assert (final.reasoning_content, final.content, final.tools_called) == ("想一想\n", "答案\n", False)
    assert parse_complete(tok, "ernie-x1", "ernie-x1", [], text, TOOLS) == final


def test_no_end_tag_is_all_reasoning(tok):
    p, s, final = run(tok, "ernie-x1", "ernie-x1", [], "thinking and thinking")
    assert final.reasoning_content == "thinking and thinking" and final.content == ""
    assert p.num_reasoning_tokens == len("thinking and thinking")


def test_tools_none_passes_tool_text_through_as_content(tok):
    text = '<tool_call>{"name": "f", "arguments": {}}</tool_call>'
    _, s, final = run(tok, None, "ernie-x1", [], text, tools=None)
    assert final.content == text and not final.tools_called and not s.ids


def test_no_parsers_is_plain_text(tok):
    _, s, final = run(tok, None, None, [], "hello\n\n world")
    assert final == ParsedOutput(None, "hello\n\n world", [], False)


def test_whitespace_only_deltas_are_never_dropped(tok):
    p = ChatOutputParser(tok, "qwen3", "qwen3", [], TOOLS)
    got = [p.feed(d, []) for d in ["Hi", " ", "\n\n", "there"]]
    assert [m.content for m in got] == ["Hi", " ", "\n\n", "there"]


def test_enable_thinking_overrides_for_think_tag_parsers(tok):
    text = "plan</think>answer"
    assert run(tok, "qwen3", None, [], text, enable_thinking=True)[2].reasoning_content == "plan"
    off = run(tok, "qwen3", None, [], text, enable_thinking=False)[2]
    assert off.reasoning_content is None and off.content == text


def test_x1_status_comes_from_the_prompt(tok):
    p = ChatOutputParser(tok, "ernie-x1", None, [tok.vocab["<think>"], tok.vocab["</think>"]])
    assert p.model_status == "think_end" and not p.enable_thinking
    assert ChatOutputParser(tok, "ernie-x1", None, [1001]).enable_thinking


def test_final_delta_emits_a_held_marker_prefix(tok):
    p = ChatOutputParser(tok, "ernie-x1", None, [])
    assert p.feed("a <", [1]).reasoning_content == "a "
    assert p.feed("", (), final=True).reasoning_content == "<"
    assert p.finish().reasoning_content == "a <"
    with pytest.raises(RuntimeError):
        p.feed("x", [])


def test_unknown_parser_name(tok):
    with pytest.raises(ValueError, match="known"):
        ChatOutputParser(tok, "nope", None, [])


def test_to_dict_shapes(tok):
    final = parse_complete(tok, "ernie-x1", "ernie-x1", [],
                           'r</think><tool_call>{"name": "f", "arguments": {}}</tool_call>', TOOLS)
    d = final.to_dict()
    assert d["reasoning_content"] == "r" and d["tool_calls"][0]["function"] == {"name": "f", "arguments": "{}"}
