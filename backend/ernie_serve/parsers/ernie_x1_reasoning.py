"""ernie-x1 reasoning: `reasoning</think>` then the answer inside `<response>...</response>`.

Rules from reference/parsers.md. Text after `</think>` that is outside `<response>` (the tool-call
region, trailing text) is not content. The prompt's last marker token says where generation starts.
A stray marker never shows up as text: parsers.md makes a delta that is exactly a marker yield
nothing, so both paths delete the six markers from reasoning and content.
"""
from __future__ import annotations

import re
from typing import Sequence

from .base import ReasoningParser, TokenizerLike, held_len, marker_ids
from .registry import register_reasoning_parser

THINK_START, THINK_END = "<think>", "</think>"
RESPONSE_START, RESPONSE_END = "<response>", "</response>"
TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"
STATUS_OF_MARKER = {
    THINK_START: "think_start", THINK_END: "think_end",
    RESPONSE_START: "response_start", RESPONSE_END: "response_end",
    TOOL_CALL_START: "tool_call_start", TOOL_CALL_END: "tool_call_end",
}
MARKERS = tuple(STATUS_OF_MARKER)
# No marker is a prefix of another and each has "<" only first, so matches never overlap.
_MARKER_RE = re.compile("|".join(map(re.escape, MARKERS)))


def strip_markers(text: str) -> str:
    return _MARKER_RE.sub("", text)


def _scan(buf: str, stop: str) -> tuple[str, str | None, str]:
    """Text of buf before `stop` with markers deleted, and what follows `stop` (None: not found).

    Not found: the third item is the held tail, a suffix that may still grow into a marker.
    """
    out, pos = [], 0
    for m in _MARKER_RE.finditer(buf):
        out.append(buf[pos:m.start()])
        pos = m.end()
        if m.group() == stop:
            return "".join(out), buf[pos:], ""
    keep = held_len(buf[pos:], *MARKERS)
    out.append(buf[pos:len(buf) - keep])
    return "".join(out), None, buf[len(buf) - keep:]


@register_reasoning_parser("ernie-x1")
class ErnieX1ReasoningParser(ReasoningParser):
    name = "ernie-x1"
    status_from_prompt_only = True  # parsers.md: enable_thinking is model_status == think_start

    def __init__(self, tokenizer: TokenizerLike):
        super().__init__(tokenizer)
        ids = marker_ids(tokenizer, list(STATUS_OF_MARKER), self.name)
        self._status_of_id = {ids[m]: s for m, s in STATUS_OF_MARKER.items()}
        self.think_end_token_id = ids[THINK_END]

    def get_model_status(self, prompt_token_ids: Sequence[int]) -> str:
        for tid in reversed(prompt_token_ids):
            status = self._status_of_id.get(tid)
            if status is not None:
                return status
        return "think_start"

    def split(self, model_output: str, model_status: str) -> tuple[str, str]:
        if model_status == "think_start":
            i = model_output.find(THINK_END)
            if i < 0:
                return strip_markers(model_output), ""
            return strip_markers(model_output[:i]), model_output[i + len(THINK_END):].lstrip("\n")
        if model_status == "response_start":
            return "", model_output
        return "", model_output.lstrip("\n")

    def content_from_rest(self, rest: str, model_status: str) -> str:
        if model_status != "response_start":
            j = rest.find(RESPONSE_START)
            if j < 0:
                return ""
            rest = rest[j + len(RESPONSE_START):]
        k = rest.find(RESPONSE_END)
        return strip_markers(rest if k < 0 else rest[:k])

    def new_splitter(self, model_status: str) -> "_X1Splitter":
        return _X1Splitter(model_status)

    def new_content_filter(self, model_status: str) -> "_ResponseFilter":
        return _ResponseFilter(inside=model_status == "response_start")


class _X1Splitter:
    """reason -> (after `</think>`) strip leading newlines -> rest."""

    def __init__(self, status: str):
        self.mode = {"think_start": "reason", "response_start": "rest"}.get(status, "strip")
        self.buf = ""

    @property
    def in_reasoning(self) -> bool:
        return self.mode == "reason"

    def push(self, text: str) -> tuple[str, str]:
        reasoning = ""
        if self.mode == "reason":
            reasoning, after, self.buf = _scan(self.buf + text, THINK_END)
            if after is None:
                return reasoning, ""
            text, self.mode = after, "strip"
        if self.mode == "strip":
            text = text.lstrip("\n")
            if not text:
                return reasoning, ""
            self.mode = "rest"
        return reasoning, text

    def flush(self) -> tuple[str, str]:
        held, self.buf = self.buf, ""  # a marker prefix that never completed is plain text
        return (held, "") if self.mode == "reason" else ("", "")


class _ResponseFilter:
    """before `<response>` (dropped) -> inside (content) -> after `</response>` (dropped)."""

    def __init__(self, inside: bool):
        self.state = "inside" if inside else "before"
        self.buf = ""

    def push(self, text: str) -> str:
        if self.state == "after":
            return ""
        buf = self.buf + text
        if self.state == "before":
            j = buf.find(RESPONSE_START)
            if j < 0:
                keep = held_len(buf, RESPONSE_START)
                self.buf = buf[len(buf) - keep:]
                return ""
            buf, self.state = buf[j + len(RESPONSE_START):], "inside"
        content, after, self.buf = _scan(buf, RESPONSE_END)
        if after is not None:
            self.state = "after"
        return content

    def flush(self) -> str:
        held, self.buf = self.buf, ""
        return held if self.state == "inside" else ""
