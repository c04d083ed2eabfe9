"""ernie-45-vl, ernie-45-vl-thinking and qwen3: `<think>...</think>` then plain content."""
from __future__ import annotations

import pytest

from ernie_serve.parsers import get_reasoning_parser
from parser_helpers import FakeTokenizer


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
