"""ernie-45-vl, ernie-45-vl-thinking and qwen3: `<think>...</think>` then plain content."""
from __future__ import annotations

import pytest

from ernie_serve.parsers import ChatOutputParser, get_reasoning_parser
from parser_helpers import FakeTokenizer, Streamed, char_deltas


@pytest.fixture(params=["ernie-45-vl", "qwen3"])
def rp(request, tok):
    return get_reasoning_parser(request.param)(tok)


def test_think_block_then_content(rp):
    assert rp.extract_reasoning_content("<think>plan\n</think>\n\nanswer", "auto") == ("plan\n", "\n\nanswer")


def test_no_think_at_start_is_all_content(rp):
    assert rp.extract_reasoning_content("answer</think>x", "auto") == ("", "answer</think>x")


def test_opened_in_prompt_reads_reasoning_until_end_tag(rp):
    assert rp.extract_reasoning_content("plan</think>answer", "think_start") == ("plan", "answer")
    assert rp.extract_reasoning_content("<think>plan</think>answer", "think_start") == ("plan", "answer")
    assert rp.extract_reasoning_content("still thinking", "think_start") == ("still thinking", "")


def test_think_end_status_is_all_content(rp):
    assert rp.extract_reasoning_content("<think>a</think>b", "think_end") == ("", "<think>a</think>b")


def test_status_from_prompt(rp, tok):
    assert rp.get_model_status([5, tok.vocab["<think>"], 1001]) == "think_start"
    assert rp.get_model_status([tok.vocab["<think>"], tok.vocab["</think>"]]) == "auto"
    assert rp.get_model_status([]) == "auto"


def test_vl_thinking_defaults_to_an_open_think(tok):
    rp = get_reasoning_parser("ernie-45-vl-thinking")(tok)
    assert rp.get_model_status([]) == "think_start"
    assert rp.extract_reasoning_content("why\n</think>\n\nbecause", "think_start") == ("why\n", "\n\nbecause")


@pytest.mark.parametrize("text, content", [
    ('why</think>\n\n<tool_call>{"name": "f"}</tool_call>', ""),
    ("why</think><tool_call>", ""),
    ('why</think>\nSure. <tool_call>{"name": "f"}</tool_call>', '\nSure. <tool_call>{"name": "f"}</tool_call>'),
    ("why</think>\n\n<tool_", "\n\n<tool_"),
    ("why</think>\n\n", "\n\n"),
])
def test_vl_thinking_content_is_empty_when_a_tool_call_follows_the_reasoning(tok, text, content):
    """FastDeploy's ernie-45-vl-thinking: the model answers or calls tools; a call region is not content."""
    assert get_reasoning_parser("ernie-45-vl-thinking")(tok).extract_reasoning_content(text, "think_start") == \
        ("why", content)
    out = ChatOutputParser(tok, "ernie-45-vl-thinking", None, [])
    s = Streamed()
    for delta, ids in char_deltas(tok, text, list(range(len(text)))):
        s.add(out.feed(delta, ids))
    s.add(out.feed("", (), final=True))
    assert (s.reasoning, s.content) == ("why", content)


def test_streaming(rp, tok):
    prev, out = "", []
    for delta in ["<thi", "nk>", "pl", "an</th", "ink>", "\n\nans"]:
        msg = rp.extract_reasoning_content_streaming(prev, prev + delta, delta, [], [], [], "auto")
        prev += delta
        out.append(None if msg is None else (msg.reasoning_content, msg.content))
    assert out == [None, None, ("pl", None), ("an", None), None, (None, "\n\nans")]


def test_missing_markers():
    with pytest.raises(ValueError, match="</think>"):
        get_reasoning_parser("qwen3")(FakeTokenizer(["<think>"]))
