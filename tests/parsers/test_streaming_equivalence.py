"""THE GUARANTEE: streaming (any cut into deltas, token- or character-level) == non-streaming.

Concatenated reasoning_content, content and per-call argument fragments equal parse_complete's
strings, names are equal, and each call has one stable id. Two differences are allowed, both
because a call's header cannot be taken back once it is out: a tool call whose header was already
streamed and whose block then turns out malformed (non-streaming falls back to "no tool calls"),
and a last call the output ends inside whose header went out before the final delta (finish()
and non-streaming leave it out). Well-formed outputs never hit the first.
"""
from __future__ import annotations

import json
import os

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ernie_serve.parsers import (ChatOutputParser, get_tool_parser, list_reasoning_parsers, list_tool_parsers,
                                 parse_complete)
from parser_helpers import FakeTokenizer, Streamed, char_deltas, token_deltas
from strategies import call_object, cut_off_block, soup, tool_output, ws

TOK = FakeTokenizer()
V = TOK.vocab
TOOLS = [{"type": "function", "function": {"name": "get_weather"}}]
# (reasoning parser, tool parser, prompt ids): every status each parser distinguishes
SETUPS = [
    ("ernie-x1", "ernie-x1", []), ("ernie-x1", "ernie-x1", [V["</think>"]]),
    ("ernie-x1", "ernie-x1", [V["<response>"]]), ("ernie-x1", None, [V["<think>"]]),
    ("ernie-x1", None, [V["</response>"]]),
    ("qwen3", "qwen3", []), ("qwen3", "qwen3", [V["<think>"]]), ("qwen3", None, [V["</think>"]]),
    ("ernie-45-vl", None, []), ("ernie-45-vl-thinking", "ernie-x1", []), (None, "qwen3", []),
    ("ernie-45-vl-thinking", "ernie-45-vl-thinking", []), ("ernie-45-vl-thinking", None, []),
    (None, "ernie-45-vl-thinking", []), (None, None, []),
]
# every registered tool parser, alone and after the reasoning parser of the same name
TOOL_SETUPS = [(rp, tp, []) for tp in list_tool_parsers()
               for rp in [None] + [tp] * (tp in list_reasoning_parsers())]
# PARSER_EXAMPLES=2000 for a deeper run
settings.register_profile("parsers", max_examples=int(os.environ.get("PARSER_EXAMPLES", "150")), deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
PROFILE = settings.get_profile("parsers")


def requires_arguments(setup) -> bool:
    return setup[1] is not None and get_tool_parser(setup[1]).arguments_required


def stream(setup, text, cuts, by_chars, final_with_last=False, tools=TOOLS):
    """Feed the deltas; the final flag rides on the last one (one-response requests) or on an empty one."""
    rp, tp, prompt = setup
    p = ChatOutputParser(TOK, rp, tp, prompt, tools=tools)
    deltas = (char_deltas if by_chars else token_deltas)(TOK, text, cuts)
    if not (final_with_last and deltas):
        deltas.append(("", []))
    s = Streamed()
    for n, (delta, ids) in enumerate(deltas):
        s.add(p.feed(delta, ids, final=n == len(deltas) - 1))
    return s, p.finish()


def assert_equal(s, final, expected, allow_sent_then_malformed=False):
    streamed = [(s.ids[i], s.names[i], s.args.get(i, "")) for i in sorted(s.ids)]
    finished = [(c.id, c.function.name, c.function.arguments) for c in final.tool_calls]
    assert sorted(s.ids) == list(range(len(s.ids)))
    # finish() is what was streamed, less at most one last call the output ended inside
    assert streamed[:len(finished)] == finished and len(streamed) - len(finished) in (0, 1)
    assert (final.reasoning_content or "") == s.reasoning
    assert final.content == s.content
    if allow_sent_then_malformed and s.ids and not expected.tools_called:
        return
    assert s.reasoning == (expected.reasoning_content or "")
    assert s.content == expected.content
    assert [(name, args) for _, name, args in finished] == \
        [(c.function.name, c.function.arguments) for c in expected.tool_calls]
    assert final.tools_called == expected.tools_called


@PROFILE
@given(setup=st.sampled_from(SETUPS), data=st.data(), cuts=st.lists(st.integers(0, 10**6), max_size=40),
       by_chars=st.booleans(), final_with_last=st.booleans())
def test_well_formed_tool_outputs_stream_exactly(setup, data, cuts, by_chars, final_with_last):
    text = data.draw(tool_output(requires_arguments(setup)), label="text")
    expected = parse_complete(TOK, setup[0], setup[1], setup[2], text, TOOLS)
    s, final = stream(setup, text, cuts, by_chars, final_with_last)
    if setup[0] is None and setup[1] in ("ernie-x1", "qwen3") and "</tool_call>" in text:
        assert expected.tools_called, text  # the strategy only writes valid blocks
    assert_equal(s, final, expected)


@PROFILE
@given(setup=st.sampled_from(TOOL_SETUPS), data=st.data(), cuts=st.lists(st.integers(0, 10**6), max_size=40),
       by_chars=st.booleans(), final_with_last=st.booleans())
def test_complete_calls_before_a_cut_off_one_are_kept(setup, data, cuts, by_chars, final_with_last):
    """Issue 10: a complete call followed by one cut off (max_tokens) keeps the complete call."""
    required = requires_arguments(setup)
    objs = data.draw(st.lists(call_object(required), min_size=1, max_size=2), label="complete calls")
    lead = "<think>why</think>\n" if setup[0] else data.draw(st.sampled_from(["", "\n", "\n\n"]), label="lead")
    text = lead + "".join(f"<tool_call>{data.draw(ws)}{o}{data.draw(ws)}</tool_call>" + data.draw(ws) for o in objs) \
        + data.draw(cut_off_block(required), label="cut-off block")
    expected = parse_complete(TOK, setup[0], setup[1], setup[2], text, TOOLS)
    assert expected.tools_called, text
    assert [c.function.name for c in expected.tool_calls] == [json.loads(o)["name"] for o in objs]
    s, final = stream(setup, text, cuts, by_chars, final_with_last)
    assert_equal(s, final, expected)
    if final_with_last and len(cuts) == 0:  # the whole text in one final delta: nothing to take back
        assert len(s.ids) == len(objs)


@PROFILE
@given(setup=st.sampled_from(SETUPS), text=soup, cuts=st.lists(st.integers(0, 10**6), max_size=40),
       by_chars=st.booleans(), final_with_last=st.booleans())
def test_any_text_streams_like_non_streaming(setup, text, cuts, by_chars, final_with_last):
    expected = parse_complete(TOK, setup[0], setup[1], setup[2], text, TOOLS)
    s, final = stream(setup, text, cuts, by_chars, final_with_last)
    assert_equal(s, final, expected, allow_sent_then_malformed=True)


@PROFILE
@given(setup=st.sampled_from(SETUPS), text=soup | tool_output(), cuts=st.lists(st.integers(0, 10**6), max_size=20))
def test_without_tools_the_tool_parser_is_off(setup, text, cuts):
    expected = parse_complete(TOK, setup[0], setup[1], setup[2], text, None)
    assert not expected.tools_called
    s, final = stream(setup, text, cuts, True, tools=None)
    assert not s.ids
    assert_equal(s, final, expected)


@PROFILE
@given(text=soup | tool_output(), cuts=st.lists(st.integers(0, 10**6), max_size=20),
       status=st.sampled_from(["think_start", "think_end", "response_start"]))
def test_standalone_reasoning_streaming_is_a_prefix_of_non_streaming(text, cuts, status):
    """The per-parser API has no flush, so only a possible marker prefix at the very end may be missing."""
    from ernie_serve.parsers import get_reasoning_parser
    rp = get_reasoning_parser("ernie-x1")(TOK)
    reasoning, content = rp.extract_reasoning_content(text, status)
    prev_text, prev_ids, got_r, got_c = "", [], "", ""
    for delta, ids in char_deltas(TOK, text, cuts):
        msg = rp.extract_reasoning_content_streaming(prev_text, prev_text + delta, delta, prev_ids,
                                                     prev_ids + ids, ids, status)
        prev_text, prev_ids = prev_text + delta, prev_ids + ids
        if msg is not None:
            got_r += msg.reasoning_content or ""
            got_c += msg.content or ""
    assert reasoning.startswith(got_r) and len(reasoning) - len(got_r) < len("</response>")
    assert content.startswith(got_c) and len(content) - len(got_c) < len("</response>")
