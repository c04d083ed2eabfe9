"""ernie-x1 reasoning parser: every example of reference/parsers.md, literally, plus edge cases."""
from __future__ import annotations

import pytest

from ernie_serve.parsers import get_reasoning_parser
from parser_helpers import MARKERS, FakeTokenizer


@pytest.fixture
def rp(tok):
    return get_reasoning_parser("ernie-x1")(tok)


@pytest.mark.parametrize("output, expected", [
    ("abc\n</think>\n<response>hello\nworld</response>", ("abc\n", "hello\nworld")),
    ("abc</think><tool_call>call_here", ("abc", "")),
    ("no_thinking_here", ("no_thinking_here", "")),
    ("abc</think><response>partial response", ("abc", "partial response")),
])
def test_non_streaming_examples_think_start(rp, output, expected):
    assert rp.extract_reasoning_content(output, "think_start") == expected


def test_non_streaming_response_start_example(rp):
    assert rp.extract_reasoning_content("hello", "response_start") == ("", "hello")


def test_response_start_stops_at_response_end(rp):
    assert rp.extract_reasoning_content("hi</response>\n<tool_call>x", "response_start") == ("", "hi")


def test_think_end_takes_content_only_inside_response(rp):
    assert rp.extract_reasoning_content("\n\ndropped<response>ans</response>tail", "think_end") == ("", "ans")
    assert rp.extract_reasoning_content("\n<tool_call>{}</tool_call>", "think_end") == ("", "")


def test_text_before_response_is_dropped(rp):
    assert rp.extract_reasoning_content("r</think>\n\nnoise<response>ok</response>", "think_start") == ("r", "ok")


def test_cjk_passes_through(rp):
    assert rp.extract_reasoning_content("思考\n</think>\n<response>你好，世界</response>", "think_start") == \
        ("思考\n", "你好，世界")


@pytest.mark.parametrize("last_marker, status", [
    ("<think>", "think_start"), ("</think>", "think_end"), ("<response>", "response_start"),
    ("</response>", "response_end"), ("<tool_call>", "tool_call_start"), ("</tool_call>", "tool_call_end"),
])
def test_model_status_is_the_last_marker_in_the_prompt(rp, tok, last_marker, status):
    others = [tok.vocab[m] for m in MARKERS if m != last_marker]
    prompt = [1001, *others, 1002, tok.vocab[last_marker], 1003, 1004]
    assert rp.get_model_status(prompt) == status


def test_model_status_without_markers_is_think_start(rp):
    assert rp.get_model_status([]) == "think_start"
    assert rp.get_model_status([1001, 1002]) == "think_start"


def test_missing_marker_in_vocab_is_a_clear_error():
    with pytest.raises(ValueError, match="<response>"):
        get_reasoning_parser("ernie-x1")(FakeTokenizer([m for m in MARKERS if m != "<response>"]))


class Stream:
    """Drives extract_reasoning_content_streaming the way a server does."""

    def __init__(self, rp, tok, status="think_start"):
        self.rp, self.tok, self.status = rp, tok, status
        self.text, self.ids = "", []

    def send(self, delta):
        ids = self.tok.encode(delta)
        prev_text, prev_ids = self.text, self.ids
        self.text, self.ids = prev_text + delta, prev_ids + ids
        return self.rp.extract_reasoning_content_streaming(prev_text, self.text, delta, prev_ids, self.ids,
                                                           ids, self.status)


def test_streaming_examples(rp, tok):
    s = Stream(rp, tok)
    m = s.send("a")
    assert (m.reasoning_content, m.content) == ("a", None)
    m = s.send("\n")
    assert (m.reasoning_content, m.content) == ("\n", None)
    assert s.send("</think>") is None
    assert s.send("<response>") is None
    m = s.send("h")
    assert (m.reasoning_content, m.content) == (None, "h")


def test_streaming_end_tag_inside_a_delta(rp, tok):
    m = Stream(rp, tok).send("hello</think><response>hi")
    assert (m.reasoning_content, m.content) == ("hello", "hi")


def test_streaming_tool_call_after_think_end_is_not_content(rp, tok):
    s = Stream(rp, tok)
    s.send("abc")
    assert s.send("</think>") is None
    assert s.send("<tool_call>") is None
    assert s.send('{"name": "f"}') is None
    assert s.send("</tool_call>") is None
    assert s.send("trailing") is None


@pytest.mark.parametrize("marker", ["</think>", "<response>", "</response>", "<tool_call>", "</tool_call>"])
def test_streaming_delta_that_is_exactly_a_marker_is_none(rp, tok, marker):
    s = Stream(rp, tok)
    s.send("r</think><response>x")
    assert s.send(marker) is None


def test_streaming_response_region_cut_at_response_end(rp, tok):
    s = Stream(rp, tok)
    s.send("r</think>")
    m = s.send("<response>ok</response>more")
    assert (m.reasoning_content, m.content) == (None, "ok")
    assert s.send("more") is None


def test_streaming_think_end_and_response_start_status(rp, tok):
    s = Stream(rp, tok, "think_end")
    assert s.send("\n") is None
    assert s.send("<response>") is None
    assert s.send("yes").content == "yes"
    s = Stream(rp, tok, "response_start")
    assert s.send("hello").content == "hello"
    assert s.send("</response>") is None
    assert s.send("after") is None


def test_streaming_is_stateless_across_requests(rp, tok):
    """One parser instance may serve interleaved requests: state follows previous_text."""
    a, b = Stream(rp, tok), Stream(rp, tok)
    a.send("thinking a")
    b.send("b</think><response>")
    assert a.send(" more").reasoning_content == " more"
    assert b.send("B").content == "B"
