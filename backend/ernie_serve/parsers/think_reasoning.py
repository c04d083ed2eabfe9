"""`<think>reasoning</think>content` parsers: ernie-45-vl, ernie-45-vl-thinking, qwen3.

Status "think_start": the prompt opened `<think>` (an optional `<think>` at the start of the output
is swallowed too); "auto": reasoning only if the output itself starts with `<think>`;
"think_end": no reasoning. Deciding from the output's first characters (not from whether a
`</think>` shows up later) is what lets streaming and non-streaming agree.
No `</think>` at all after reasoning started -> everything is reasoning, content "".
ernie-45-vl-thinking, as FastDeploy's parser of that name: when the text after the reasoning is a
tool-call region (`<tool_call>` with only newlines before it), the content is "".
"""
from __future__ import annotations

from typing import Sequence

from .base import ReasoningParser, TokenizerLike, held_len, marker_ids
from .registry import register_reasoning_parser

THINK_START, THINK_END = "<think>", "</think>"
TOOL_CALL_START = "<tool_call>"


class ThinkTagReasoningParser(ReasoningParser):
    name = "think"
    default_status = "auto"  # when the prompt has no think marker

    def __init__(self, tokenizer: TokenizerLike):
        super().__init__(tokenizer)
        ids = marker_ids(tokenizer, [THINK_START, THINK_END], self.name)
        self.think_start_token_id, self.think_end_token_id = ids[THINK_START], ids[THINK_END]

    def get_model_status(self, prompt_token_ids: Sequence[int]) -> str:
        for tid in reversed(prompt_token_ids):
            if tid == self.think_start_token_id:
                return "think_start"
            if tid == self.think_end_token_id:
                # a closed think block (history, or enable_thinking=False): the output decides
                return "auto"
        return self.default_status

    def split(self, model_output: str, model_status: str) -> tuple[str, str]:
        if model_status == "think_end":
            return "", model_output
        starts = model_output.startswith(THINK_START)
        if model_status != "think_start" and not starts:
            return "", model_output
        body = model_output[len(THINK_START):] if starts else model_output
        i = body.find(THINK_END)
        if i < 0:
            return body, ""
        return body[:i], body[i + len(THINK_END):]

    def new_splitter(self, model_status: str) -> "_ThinkSplitter":
        return _ThinkSplitter(model_status)


class _ThinkSplitter:
    def __init__(self, status: str):
        self.mode = {"think_start": "open", "think_end": "content"}.get(status, "detect")
        self.buf = ""

    @property
    def in_reasoning(self) -> bool | None:
        if self.mode == "detect":
            return None
        return self.mode in ("open", "reason")

    def push(self, text: str) -> tuple[str, str]:
        if self.mode in ("open", "detect"):
            buf = self.buf + text
            if len(buf) < len(THINK_START) and THINK_START.startswith(buf):
                self.buf = buf
                return "", ""
            self.buf = ""
            if buf.startswith(THINK_START):
                buf, self.mode = buf[len(THINK_START):], "reason"
            else:
                self.mode = "reason" if self.mode == "open" else "content"
            text = buf
        reasoning = ""
        if self.mode == "reason":
            buf = self.buf + text
            i = buf.find(THINK_END)
            if i < 0:
                keep = held_len(buf, THINK_END)
                self.buf = buf[len(buf) - keep:]
                return buf[:len(buf) - keep], ""
            reasoning, text, self.buf, self.mode = buf[:i], buf[i + len(THINK_END):], "", "content"
        return reasoning, text

    def flush(self) -> tuple[str, str]:
        held, self.buf = self.buf, ""
        if self.mode in ("open", "reason"):
            return held, ""
        return "", held  # "detect": a short output that merely looked like the start of <think>


@register_reasoning_parser("ernie-45-vl")
class Ernie45VLReasoningParser(ThinkTagReasoningParser):
    name = "ernie-45-vl"


@register_reasoning_parser("ernie-45-vl-thinking")
class Ernie45VLThinkingReasoningParser(ThinkTagReasoningParser):
    """The thinking model's template opens `<think>` in the prompt; it answers or calls tools, not both."""
    name = "ernie-45-vl-thinking"
    default_status = "think_start"

    def content_from_rest(self, rest: str, model_status: str) -> str:
        return "" if rest.lstrip("\n").startswith(TOOL_CALL_START) else rest

    def new_content_filter(self, model_status: str) -> "_ToolRegionFilter":
        return _ToolRegionFilter()


class _ToolRegionFilter:
    """Streaming content_from_rest: leading newlines are held until the text shows whether a
    `<tool_call>` comes first (then nothing is content) or not (then everything is)."""

    def __init__(self) -> None:
        self.state = "undecided"  # -> "content" | "tool_calls"
        self.buf = ""

    def push(self, text: str) -> str:
        if self.state != "undecided":
            return text if self.state == "content" else ""
        buf = self.buf + text
        body = buf.lstrip("\n")
        if body.startswith(TOOL_CALL_START):
            self.state, self.buf = "tool_calls", ""
            return ""
        if TOOL_CALL_START.startswith(body):
            self.buf = buf
            return ""
        self.state, self.buf = "content", ""
        return buf

    def flush(self) -> str:
        held, self.buf = self.buf, ""
        return held


@register_reasoning_parser("qwen3")
class Qwen3ReasoningParser(ThinkTagReasoningParser):
    name = "qwen3"
