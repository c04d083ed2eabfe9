"""`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` tool parsers: ernie-x1 and qwen3/hermes.

Non-streaming: every block must hold one JSON object with a string "name" and an object
"arguments" (missing -> {}); arguments are re-serialized with json.dumps(ensure_ascii=False).
A last block left open at the end of the output (max_tokens) still counts if its JSON is complete.
Any malformed block -> no tool calls and the output unchanged as content. Text outside the blocks
is content.

Streaming (ToolCallStream): content outside blocks; per call a header delta once the name string
is complete, then argument fragments re-serialized by JsonStream, so they concatenate to the
non-streaming arguments. A malformed block found before anything of it was sent turns the rest
of the output into plain content, exactly as non-streaming does. Once a call's header is out,
it cannot be taken back: a block found malformed after that is the one place the two differ.
"""
from __future__ import annotations

import json
from typing import Any

from .base import TokenizerLike, ToolParser, held_len, marker_ids
from .json_stream import WS, JsonStream, JsonStreamError
from .protocol import (DeltaFunctionCall, DeltaToolCall, ExtractedToolCallInformation, FunctionCall,
                       ToolCall, merge_tool_deltas, new_tool_call_id)
from .registry import register_tool_parser

_DECODER = json.JSONDecoder()


class _Malformed(Exception):
    pass


def _skip_ws(s: str, i: int) -> int:
    while i < len(s) and s[i] in WS:
        i += 1
    return i


class TaggedJsonToolParser(ToolParser):
    name = "tagged-json"
    start_token = "<tool_call>"
    end_token = "</tool_call>"

    def __init__(self, tokenizer: TokenizerLike):
        super().__init__(tokenizer)
        marker_ids(tokenizer, [self.start_token, self.end_token], self.name)

    def extract_tool_calls(self, model_output: str, request: Any = None) -> ExtractedToolCallInformation:
        try:
            calls, content = self._parse_blocks(model_output)
        except _Malformed:
            return ExtractedToolCallInformation(False, [], model_output)
        if not calls:
            return ExtractedToolCallInformation(False, [], model_output)
        return ExtractedToolCallInformation(True, calls, content)

    def _parse_blocks(self, s: str) -> tuple[list[ToolCall], str]:
        start, end = self.start_token, self.end_token
        calls: list[ToolCall] = []
        outside: list[str] = []
        pos = 0
        while True:
            a = s.find(start, pos)
            if a < 0:
                break
            outside.append(s[pos:a])
            j = _skip_ws(s, a + len(start))
            if j >= len(s) or s[j] != "{":
                raise _Malformed
            try:
                obj, e = _DECODER.raw_decode(s, j)
            except (ValueError, RecursionError) as exc:
                raise _Malformed from exc
            k = _skip_ws(s, e)
            if s.startswith(end, k):
                pos = k + len(end)
            elif end.startswith(s[k:]):  # left open (or cut inside the end tag) at the end
                pos = len(s)
            else:
                raise _Malformed
            name, args = obj.get("name"), obj.get("arguments", {})
            if not isinstance(name, str) or not isinstance(args, dict):
                raise _Malformed
            calls.append(ToolCall(new_tool_call_id(), "function",
                                  FunctionCall(name, json.dumps(args, ensure_ascii=False))))
        outside.append(s[pos:])
        return calls, "".join(outside)

    def new_stream(self) -> "ToolCallStream":
        return ToolCallStream(self.start_token, self.end_token)


class _Call:
    def __init__(self) -> None:
        self.index: int | None = None      # set when the header goes out
        self.name: str | None = None
        self.name_member = -1
        self.args_member = -1
        self.args_from = 0                 # next JsonStream.out piece not yet taken as arguments
        self.held_args: list[str] = []     # arguments seen before the name


class ToolCallStream:
    """text -> lead (whitespace, `{`) -> json -> tail (whitespace, end tag) -> text; or raw."""

    def __init__(self, start_token: str = "<tool_call>", end_token: str = "</tool_call>"):
        self.start, self.end = start_token, end_token
        self.mode = "text"
        self.buf = ""                      # held text (text mode) or the partial end tag (tail mode)
        self.raw: list[str] = []           # the current block as written, for the fallback
        self.json: JsonStream | None = None
        self.call: _Call | None = None
        self.num_calls = 0

    @property
    def tools_called(self) -> bool:
        return self.num_calls > 0

    def push(self, text: str) -> tuple[str, list[DeltaToolCall]]:
        content: list[str] = []
        deltas: list[DeltaToolCall] = []
        self._run(text, content, deltas)
        return "".join(content), merge_tool_deltas(deltas)

    def flush(self) -> tuple[str, list[DeltaToolCall]]:
        content, self.buf = (self.buf if self.mode == "text" else ""), ""
        if self.mode in ("lead", "json") and (self.call is None or self.call.index is None):
            content = "".join(self.raw)  # an unfinished block that sent nothing: it was text
        if self.mode != "raw":
            self.mode = "text"
        return content, []

    def _run(self, text: str, content: list[str], deltas: list[DeltaToolCall]) -> None:
        i, n = 0, len(text)
        while i < n:
            mode = self.mode
            if mode == "raw":
                content.append(text[i:])
                return
            if mode == "text":
                buf, self.buf = self.buf + text[i:], ""
                j = buf.find(self.start)
                if j < 0:
                    keep = held_len(buf, self.start)
                    content.append(buf[:len(buf) - keep])
                    self.buf = buf[len(buf) - keep:]
                    return
                content.append(buf[:j])
                self.mode, self.raw = "lead", [self.start]
                text, i, n = buf, j + len(self.start), len(buf)
                continue
            ch = text[i]
            i += 1
            self.raw.append(ch)
            try:
                if mode == "lead":
                    if ch in WS:
                        continue
                    if ch != "{":
                        raise _Malformed
                    self.json, self.call, self.mode = JsonStream(), _Call(), "json"
                    self.json.feed(ch)
                elif mode == "json":
                    self.json.feed(ch)
                    self._observe(deltas)
                    if self.json.done:
                        self._object_closed(deltas)
                        self.mode = "tail"
                elif mode == "tail":
                    if not self.buf and ch in WS:
                        continue
                    self.buf += ch
                    if not self.end.startswith(self.buf):
                        raise _Malformed
                    if self.buf == self.end:
                        self.mode, self.buf, self.raw, self.json, self.call = "text", "", [], None, None
            except (_Malformed, JsonStreamError):
                # Fall back to plain text: what this block held so far, and all that follows.
                content.append("".join(self.raw))
                self.mode, self.buf = "raw", ""

    def _observe(self, deltas: list[DeltaToolCall]) -> None:
        js, call = self.json, self.call
        if js.member_start is None:
            return
        key, idx = js.member_key, js.member_index
        if key == "name" and call.name_member in (-1, idx) and call.name is None:
            call.name_member = idx
            if len(js.out) > js.member_start and js.out[js.member_start] != '"':
                raise _Malformed
            if js.member_end is not None:
                call.name = json.loads("".join(js.out[js.member_start:js.member_end]))
                self._send_header(deltas)
        elif key == "arguments" and call.args_member in (-1, idx):
            if call.args_member == -1:
                call.args_member, call.args_from = idx, js.member_start
            stop = js.member_end if js.member_end is not None else len(js.out)
            if stop > call.args_from:
                if js.out[js.member_start] != "{":
                    raise _Malformed
                pieces = js.out[call.args_from:stop]
                call.args_from = stop
                if call.index is None:
                    call.held_args.extend(pieces)
                else:
                    deltas.append(DeltaToolCall(call.index, function=DeltaFunctionCall(arguments="".join(pieces))))

    def _send_header(self, deltas: list[DeltaToolCall]) -> None:
        call = self.call
        call.index = self.num_calls
        self.num_calls += 1
        deltas.append(DeltaToolCall(call.index, new_tool_call_id(), "function", DeltaFunctionCall(name=call.name)))
        if call.held_args:
            deltas.append(DeltaToolCall(call.index, function=DeltaFunctionCall(arguments="".join(call.held_args))))
            call.held_args = []

    def _object_closed(self, deltas: list[DeltaToolCall]) -> None:
        call = self.call
        if call.name is None:
            raise _Malformed  # no "name": nothing was sent for this call, so the fallback is exact
        if call.args_member == -1:
            deltas.append(DeltaToolCall(call.index, function=DeltaFunctionCall(arguments="{}")))


@register_tool_parser("ernie-x1")
class ErnieX1ToolParser(TaggedJsonToolParser):
    """ERNIE X1 / ERNIE-4.5 thinking models: blocks follow `</think>` (the reasoning parser strips it)."""
    name = "ernie-x1"


@register_tool_parser(["qwen3", "hermes"])
class HermesToolParser(TaggedJsonToolParser):
    """Qwen3 / Hermes: the same block syntax, no think markers required in the vocabulary."""
    name = "qwen3"
