"""ernie-x1, qwen3/hermes and ernie-45-vl-thinking tool parsers: parsers.md's example, cut-off calls,
the ernie-45-vl-thinking rules and the FastDeploy bugs to avoid."""
from __future__ import annotations

import json

import pytest

from ernie_serve.parsers import ChatOutputParser, get_tool_parser, list_tool_parsers, parse_complete
from parser_helpers import FakeTokenizer, Streamed, char_deltas, token_deltas

EXAMPLE = ('\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": {"location": "San Francisco, CA", '
           '"unit": "fahrenheit"}}\n</tool_call>\n')
TOOLS = [{"type": "function", "function": {"name": "get_weather"}}]


@pytest.fixture(params=["ernie-x1", "qwen3"])
def tp(request, tok):
    return get_tool_parser(request.param)(tok)


@pytest.fixture(params=list_tool_parsers())
def any_tp(request, tok):
    return get_tool_parser(request.param)(tok)


def stream_output_parser(tok, tp_name, text, cuts=None, rp_name=None):
    """Through ChatOutputParser, per-token deltas (or cut at `cuts`), the final flag on an empty last delta."""
    out = ChatOutputParser(tok, rp_name, tp_name, [], TOOLS)
    s = Streamed()
    for delta, ids in token_deltas(tok, text, list(range(len(text) + 1)) if cuts is None else cuts):
        s.add(out.feed(delta, ids))
    s.add(out.feed("", (), final=True))
    return s, out.finish()


def stream_tool_parser(tp, tok, text, by_chars=False, cuts=None):
    """Drive extract_tool_calls_streaming; per-token deltas unless cuts are given."""
    tok_list = tok.tokenize(text)
    cuts = list(range(len(text) if by_chars else len(tok_list))) if cuts is None else cuts
    s = Streamed()
    prev_text, prev_ids = "", []
    for delta, ids in (char_deltas if by_chars else token_deltas)(tok, text, cuts):
        cur_text, cur_ids = prev_text + delta, prev_ids + ids
        s.add(tp.extract_tool_calls_streaming(prev_text, cur_text, delta, prev_ids, cur_ids, ids, None))
        prev_text, prev_ids = cur_text, cur_ids
    return s


def test_parsers_md_example(tp):
    info = tp.extract_tool_calls(EXAMPLE, None)
    assert info.tools_called and len(info.tool_calls) == 1
    call = info.tool_calls[0]
    assert call.type == "function" and call.id.startswith("chatcmpl-tool-") and len(call.id) == 14 + 32
    assert call.function.name == "get_weather"
    assert call.function.arguments == '{"location": "San Francisco, CA", "unit": "fahrenheit"}'
    assert info.to_dict()["tool_calls"][0]["function"]["name"] == "get_weather"


def test_example_through_the_output_parser(tok):
    out = parse_complete(tok, "ernie-x1", "ernie-x1", [], EXAMPLE, TOOLS)
    assert out.reasoning_content == "\n" and out.content == "" and out.tools_called
    assert json.loads(out.tool_calls[0].function.arguments) == {"location": "San Francisco, CA", "unit": "fahrenheit"}


@pytest.mark.parametrize("by_chars", [False, True])
def test_streaming_example_delta_shapes(tp, tok, by_chars):
    s = stream_tool_parser(tp, tok, EXAMPLE.split("</think>")[1], by_chars)
    first = next(m for m in s.messages if m.tool_calls).tool_calls[0].to_dict()
    assert set(first) == {"index", "id", "type", "function"} and first["function"] == {"name": "get_weather"}
    assert s.args[0] == '{"location": "San Francisco, CA", "unit": "fahrenheit"}'
    assert s.content == "\n\n\n"  # whitespace outside the block is content, never dropped


def test_name_is_sent_only_when_complete(tp, tok):
    text = '<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>'
    prev = ""
    for i in range(1, len(text) + 1):
        msg = tp.extract_tool_calls_streaming(prev, text[:i], text[i - 1], [], [], [], None)
        prev = text[:i]
        if msg and msg.tool_calls and msg.tool_calls[0].function.name is not None:
            assert text[:i].endswith('"get_weather"')
            break
    else:
        pytest.fail("no header")


@pytest.mark.parametrize("args", [
    {}, {"n": 5}, {"n": -1.5e-3}, {"ok": True, "no": False, "x": None}, {"deep": {"a": [1, {"b": {}}], "c": "}"}},
    {"城市": "北京", "text": "引号\"和\\反斜杠"}, {"list": [1, 2, 3], "last": 10},
])
def test_argument_endings(tp, tok, args):
    """FastDeploy bugs: `{}}}` endings, brace counting that fails after numbers/booleans."""
    expected = json.dumps(args, ensure_ascii=False)
    for body in (json.dumps({"name": "f", "arguments": args}), json.dumps({"name": "f", "arguments": args},
                                                                           separators=(",", ":"))):
        text = f"<tool_call>\n{body}\n</tool_call>"
        assert tp.extract_tool_calls(text).tool_calls[0].function.arguments == expected
        for by_chars in (False, True):
            assert stream_tool_parser(tp, tok, text, by_chars).args == {0: expected}


def test_missing_arguments_are_empty_object(tp, tok):
    text = '<tool_call>{"name": "ping"}</tool_call>'
    assert tp.extract_tool_calls(text).tool_calls[0].function.arguments == "{}"
    assert stream_tool_parser(tp, tok, text).args == {0: "{}"}


def test_arguments_before_name_wait_for_the_name(tp, tok):
    text = '<tool_call>{"arguments": {"q": 1}, "name": "search"}</tool_call>'
    s = stream_tool_parser(tp, tok, text, by_chars=True)
    assert s.names == {0: "search"} and s.args == {0: '{"q": 1}'}


def test_two_parallel_calls_and_text_after(tp, tok):
    text = ('<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n'
            '<tool_call>\n{"name": "b", "arguments": {"y": [true]}}\n</tool_call>\nDone.')
    info = tp.extract_tool_calls(text)
    assert [c.function.name for c in info.tool_calls] == ["a", "b"]
    assert len({c.id for c in info.tool_calls}) == 2
    assert info.content == "\n\nDone."
    s = stream_tool_parser(tp, tok, text)
    assert s.names == {0: "a", 1: "b"} and s.args == {0: '{"x": 1}', 1: '{"y": [true]}'}
    assert s.content == "\n\nDone." and len(set(s.ids.values())) == 2


def test_content_before_calls_streams_as_content(tp, tok):
    s = stream_tool_parser(tp, tok, 'Let me check.\n<tool_call>{"name": "f", "arguments": {}}</tool_call>')
    assert s.content == "Let me check.\n" and s.names == {0: "f"}


def test_no_block_is_plain_content(tp):
    info = tp.extract_tool_calls("just text, no tools")
    assert not info.tools_called and info.tool_calls == [] and info.content == "just text, no tools"


@pytest.mark.parametrize("text", [
    "<tool_call>not json</tool_call>",
    '<tool_call>{"name": "f", "arguments": {"a": tru}}</tool_call>',
    '<tool_call>{"name": 3, "arguments": {}}</tool_call>',
    '<tool_call>{"name": "f", "arguments": "a string"}</tool_call>',
    '<tool_call>{"arguments": {}}</tool_call>',
    '<tool_call>{"name": "f", "arguments": {}} junk</tool_call>',
    '<tool_call>{"name": "f", "arguments": {"a": 1}',
    "<tool_call>",
])
def test_malformed_json_falls_back_to_content(tp, tok, text):
    info = tp.extract_tool_calls("before " + text + " after")
    assert not info.tools_called and info.tool_calls == [] and info.content == "before " + text + " after"


@pytest.mark.parametrize("text", [
    "<tool_call>not json</tool_call> after",
    '<tool_call>{"arguments": {}}</tool_call>',
    '<tool_call>{"name": 3, "arguments": {}}</tool_call>',
])
def test_malformed_before_the_name_streams_as_content_too(tok, text):
    out = ChatOutputParser(tok, None, "ernie-x1", [], TOOLS)
    s = Streamed()
    for delta, ids in token_deltas(tok, text, list(range(100))):
        s.add(out.feed(delta, ids))
    s.add(out.feed("", (), final=True))
    assert s.content == text and not s.ids and not out.finish().tools_called


def test_unclosed_last_block_with_complete_json_counts(tp):
    info = tp.extract_tool_calls('<tool_call>{"name": "f", "arguments": {"a": 1}}\n')
    assert info.tools_called and info.tool_calls[0].function.arguments == '{"a": 1}'


def test_end_tag_inside_a_json_string(tp, tok):
    text = '<tool_call>{"name": "f", "arguments": {"s": "</tool_call>"}}</tool_call>'
    assert tp.extract_tool_calls(text).tool_calls[0].function.arguments == '{"s": "</tool_call>"}'
    assert stream_tool_parser(tp, tok, text, by_chars=True).args == {0: '{"s": "</tool_call>"}'}


def test_missing_markers_in_vocab():
    with pytest.raises(ValueError, match="</tool_call>"):
        get_tool_parser("qwen3")(FakeTokenizer(["<tool_call>"]))


def test_one_tool_parser_can_follow_interleaved_requests(tp):
    a = '<tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call>'
    b = 'text then <tool_call>{"name": "b"}</tool_call>'
    got = {"a": [], "b": []}
    for i in range(1, max(len(a), len(b)) + 1):
        for key, text in (("a", a), ("b", b)):
            if i <= len(text):
                msg = tp.extract_tool_calls_streaming(text[:i - 1], text[:i], text[i - 1], [], [], [], None)
                if msg:
                    got[key].append(msg)
    args = {k: "".join(d.function.arguments or "" for m in v for d in m.tool_calls) for k, v in got.items()}
    assert args == {"a": '{"x": 1}', "b": "{}"}
    assert "".join(m.content or "" for m in got["b"]) == "text then "


def test_delta_message_to_dict_omits_none():
    from ernie_serve.parsers import DeltaFunctionCall, DeltaMessage, DeltaToolCall
    msg = DeltaMessage(tool_calls=[DeltaToolCall(0, function=DeltaFunctionCall(arguments='{"a'))])
    assert msg.to_dict() == {"tool_calls": [{"index": 0, "function": {"arguments": '{"a'}}]}
    assert DeltaMessage(content="\n").to_dict() == {"content": "\n"}


COMPLETE_CALL = '<tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call>\n'


def name_args(calls):
    return [(c.function.name, c.function.arguments) for c in calls]


@pytest.mark.parametrize("cut_off", ["<tool_call>", "<tool_call>\n{", '<tool_call>{"name": "b',
                                     '<tool_call>{"name": "b", "argu',
                                     '<tool_call>{"name": "b", "arguments": {"y": [1, '])
def test_complete_call_before_a_cut_off_one_is_kept(any_tp, tok, cut_off):
    """Issue 10: the cut-off second call (max_tokens) used to drop the complete first one too."""
    info = any_tp.extract_tool_calls(COMPLETE_CALL + cut_off)
    assert info.tools_called and name_args(info.tool_calls) == [("a", '{"x": 1}')]
    assert info.content == ("" if any_tp.calls_or_content else "\n")  # the cut-off block is not content
    s, final = stream_output_parser(tok, any_tp.name, COMPLETE_CALL + cut_off)
    assert final.tools_called and name_args(final.tool_calls) == [("a", '{"x": 1}')]
    assert s.content == final.content == info.content
    assert s.names[0] == "a" and s.args[0] == '{"x": 1}'


def test_a_header_already_streamed_for_the_cut_off_call_is_left_out_of_the_result(tok):
    s, final = stream_output_parser(tok, "ernie-x1", COMPLETE_CALL + '<tool_call>{"name": "b", "arguments": {"y"')
    assert s.names == {0: "a", 1: "b"}  # the header of "b" went out before the output ended
    assert [c.function.name for c in final.tool_calls] == ["a"] and final.tools_called


def test_one_final_delta_gives_exactly_the_non_streaming_result(any_tp, tok):
    """A non-streaming Triton request is one response: the cut-off call never appears in it."""
    text = COMPLETE_CALL + '<tool_call>{"name": "b", "arguments": {"y"'
    out = ChatOutputParser(tok, None, any_tp.name, [], TOOLS)
    msg = out.feed(text, tok.encode(text), final=True)
    assert [(d.index, d.function.name) for d in msg.tool_calls if d.id] == [(0, "a")]
    assert {d.index for d in msg.tool_calls} == {0}
    expected = parse_complete(tok, None, any_tp.name, [], text, TOOLS)
    assert (msg.content or "") == expected.content and out.finish().tools_called == expected.tools_called


def test_a_lone_cut_off_call_is_neither_a_call_nor_content(tok):
    text = 'Sure.\n<tool_call>{"name": "f", "argu'
    info = get_tool_parser("ernie-x1")(tok).extract_tool_calls(text)
    assert not info.tools_called and info.tool_calls == [] and info.content == "Sure.\n"
    s, final = stream_output_parser(tok, "ernie-x1", text)
    assert s.content == final.content == "Sure.\n" and not final.tools_called


def test_malformed_block_after_a_complete_one_still_falls_back_to_content(tp):
    text = COMPLETE_CALL + '<tool_call>{"name": "b", "arguments": {"y": tru}}</tool_call>'
    info = tp.extract_tool_calls(text)
    assert not info.tools_called and info.content == text


@pytest.fixture
def vl(tok):
    return get_tool_parser("ernie-45-vl-thinking")(tok)


def test_vl_thinking_calls_right_after_the_reasoning_leave_no_content(vl, tok):
    text = ('\n\n<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n'
            '<tool_call>{"arguments": {}, "name": "b"}</tool_call>\nDone.')
    info = vl.extract_tool_calls(text)
    assert info.tools_called and [c.function.name for c in info.tool_calls] == ["a", "b"] and info.content == ""
    for cuts in (None, []):
        s, final = stream_output_parser(tok, "ernie-45-vl-thinking", text, cuts)
        assert s.content == "" and s.names == {0: "a", 1: "b"} and s.args == {0: '{"x": 1}', 1: "{}"}


@pytest.mark.parametrize("text", ['Let me check.\n<tool_call>{"name": "a", "arguments": {}}</tool_call>',
                                  ' <tool_call>{"name": "a", "arguments": {}}</tool_call>'])
def test_vl_thinking_text_before_the_first_call_makes_it_all_content(vl, tok, text):
    info = vl.extract_tool_calls(text)
    assert not info.tools_called and info.content == text
    s, final = stream_output_parser(tok, "ernie-45-vl-thinking", text)
    assert s.content == text and not s.ids and not final.tools_called


def test_vl_thinking_call_without_arguments_is_malformed(vl, tok):
    text = '\n<tool_call>{"name": "ping"}</tool_call>'
    info = vl.extract_tool_calls(text)
    assert not info.tools_called and info.content == text
    s, final = stream_output_parser(tok, "ernie-45-vl-thinking", text)
    assert s.content == text and not s.ids  # the header waits for "arguments", so nothing was sent


def test_vl_thinking_pipeline_after_reasoning(tok):
    text = 'why</think>\n\n<tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call>\n'
    out = parse_complete(tok, "ernie-45-vl-thinking", "ernie-45-vl-thinking", [], text, TOOLS)
    assert (out.reasoning_content, out.content, out.tools_called) == ("why", "", True)
    s, final = stream_output_parser(tok, "ernie-45-vl-thinking", text, rp_name="ernie-45-vl-thinking")
    assert (final.reasoning_content, final.content, final.tools_called) == ("why", "", True)
    assert name_args(final.tool_calls) == [("a", '{"x": 1}')]
