"""`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` tool parsers: ernie-x1, ernie-45-vl-thinking, qwen3.

Non-streaming: every block must hold one JSON object with a string "name" and an object
"arguments" (missing -> {}); arguments are re-serialized with json.dumps(ensure_ascii=False).
A last block left open at the end of the output (max_tokens) still counts if its JSON is complete;
one the output ends inside, before its JSON is complete, is a call that never finished: it is
neither a call nor content, and the calls before it are kept (FastDeploy's ernie-x1 keeps them).
Any malformed block -> no tool calls and the output unchanged as content. Text outside the blocks
is content.

ernie-45-vl-thinking (FastDeploy's parser of that name) is stricter: the text is either tool calls
or content. Calls count only when the text starts with them (newlines aside), "arguments" is
required, and once calls are made there is no content.

Streaming (ToolCallStream): content outside blocks; per call a header delta once the name string
is complete (and, where "arguments" is required, once that object has begun), then argument
fragments re-serialized by JsonStream, so they concatenate to the non-streaming arguments. A
malformed block found before anything of it was sent turns the rest of the output into plain
content, exactly as non-streaming does. A call's header cannot be taken back once it is out, so
two cases differ from non-streaming: a block found malformed after its header was sent, and a call
the output ends inside after its header was sent (`cut_off_index` names it, so the final result
can leave it out).
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
    # FastDeploy's ernie-45-vl-thinking rules: calls only at the start of the text and no content
    # beside them; a call without "arguments" is malformed.
    calls_or_content = False
    arguments_required = False

    def __init__(self, tokenizer: TokenizerLike):
        super().__init__(tokenizer)
        marker_ids(tokenizer, [self.start_token, self.end_token], self.name)

    def extract_tool_calls(self, model_output: str, request: Any = None) -> ExtractedToolCallInformation:
        if self.calls_or_content:
            first = model_output.find(self.start_token)
            if first < 0 or model_output[:first].strip("\n"):
                return ExtractedToolCallInformation(False, [], model_output)
        try:
            calls, content = self._parse_blocks(model_output)
        except _Malformed:
            return ExtractedToolCallInformation(False, [], model_output)
        if not calls:
            return ExtractedToolCallInformation(False, [], content)
        return ExtractedToolCallInformation(True, calls, "" if self.calls_or_content else content)

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
            obj = None
            if j < len(s) and s[j] == "{":
                try:
                    obj, e = _DECODER.raw_decode(s, j)
                except (ValueError, RecursionError):
                    pass
            if obj is None:
                if self._ends_inside_a_call(s[a:]):
                    return calls, "".join(outside)
                raise _Malformed
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
            if self.arguments_required and "arguments" not in obj:
                raise _Malformed
            calls.append(ToolCall(new_tool_call_id(), "function",
                                  FunctionCall(name, json.dumps(args, ensure_ascii=False))))
        outside.append(s[pos:])
        return calls, "".join(outside)

    def _ends_inside_a_call(self, block: str) -> bool:
        """Whether the output ends inside this block while what it holds could still become a call.

        Judged by the streaming parser, so that both paths drop the same cut-off blocks: telling
        "cut off" from "malformed" needs an incremental JSON parser, and that is the one we have.
        """
        stream = self.new_stream()
        stream.push(block)
        return stream.mode in ("lead", "json")

    def new_stream(self) -> "ToolCallStream":
        return ToolCallStream(self.start_token, self.end_token, self.calls_or_content, self.arguments_required)


class _Call:
    def __init__(self) -> None:
        self.index: int | None = None      # set when the header goes out
        self.name: str | None = None
        self.name_member = -1
        self.args_member = -1
        self.args_begun = False            # the arguments value was seen to start with "{"
        self.args_from = 0                 # next JsonStream.out piece not yet taken as arguments
        self.held_args: list[str] = []     # arguments seen before the header


class ToolCallStream:
    """text -> lead (whitespace, `{`) -> json -> tail (whitespace, end tag) -> text; or raw."""

    def __init__(self, start_token: str = "<tool_call>", end_token: str = "</tool_call>",
                 calls_or_content: bool = False, arguments_required: bool = False):
        self.start, self.end = start_token, end_token
        self.calls_or_content, self.arguments_required = calls_or_content, arguments_required
        self.mode = "text"
        self.buf = ""                      # held text (text mode) or the partial end tag (tail mode)
        self.raw: list[str] = []           # the current block as written, for the fallback
        self.json: JsonStream | None = None
        self.call: _Call | None = None
        self.num_calls = 0                 # headers sent
        self.num_complete = 0              # calls whose JSON object closed as a valid call
        self.cut_off_index: int | None = None  # set by flush(): a sent call the output ended inside
        self.newlines = ""                 # calls_or_content: newlines before the first call, held

    @property
    def tools_called(self) -> bool:
        return self.num_complete > 0

    def push(self, text: str) -> tuple[str, list[DeltaToolCall]]:
        content: list[str] = []
        deltas: list[DeltaToolCall] = []
        self._run(text, content, deltas)
        return "".join(content), merge_tool_deltas(deltas)

    def flush(self) -> tuple[str, list[DeltaToolCall]]:
        """End of the output. A block it ended inside is a call that never finished: not content."""
        content: list[str] = []
        if self.mode == "text":
            self._outside(self.buf, content)
        elif self.mode in ("lead", "json") and self.call is not None and self.call.index is not None:
            self.cut_off_index = self.call.index
        if self.mode != "raw" and not self.num_complete:
            content.append(self.newlines)  # no call came after them: they were content
        self.buf, self.newlines, self.raw = "", "", []
        return "".join(content), []

    def _outside(self, text: str, content: list[str]) -> None:
        """Text outside the blocks."""
        if not self.calls_or_content:
            content.append(text)
        elif self.num_complete:
            pass  # calls were made: no content beside them
        elif text.strip("\n"):
            content.append(self.newlines + text)  # text before any call: it is all content
            self.newlines, self.mode = "", "raw"
        else:
            self.newlines += text

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
                stop = j if j >= 0 else len(buf) - held_len(buf, self.start)
                self._outside(buf[:stop], content)
                text, i, n = buf, stop, len(buf)
                if self.mode == "raw":
                    continue
                if j < 0:
                    self.buf = buf[stop:]
                    return
                self.mode, self.raw = "lead", [self.start]
                i = j + len(self.start)
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
                content.append(self.newlines + "".join(self.raw))
                self.mode, self.buf, self.newlines = "raw", "", ""

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
        elif key == "arguments" and call.args_member in (-1, idx):
            if call.args_member == -1:
                call.args_member, call.args_from = idx, js.member_start
            stop = js.member_end if js.member_end is not None else len(js.out)
            if stop > call.args_from:
                if js.out[js.member_start] != "{":
                    raise _Malformed
                call.args_begun = True
                pieces = js.out[call.args_from:stop]
                call.args_from = stop
                if call.index is None:
                    call.held_args.extend(pieces)
                else:
                    deltas.append(DeltaToolCall(call.index, function=DeltaFunctionCall(arguments="".join(pieces))))
        if call.index is None and call.name is not None and (call.args_begun or not self.arguments_required):
            self._send_header(deltas)

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
        if call.index is None:
            # no "name" (or no required "arguments"): nothing was sent for this call, so the fallback is exact
            raise _Malformed
        if call.args_member == -1:
            deltas.append(DeltaToolCall(call.index, function=DeltaFunctionCall(arguments="{}")))
        self.num_complete += 1
        self.newlines = ""  # calls_or_content: the newlines before the calls are not content


@register_tool_parser("ernie-x1")
class ErnieX1ToolParser(TaggedJsonToolParser):
    """ERNIE X1 / ERNIE-4.5 thinking models: blocks follow `</think>` (the reasoning parser strips it)."""
    name = "ernie-x1"


@register_tool_parser("ernie-45-vl-thinking")
class Ernie45VLThinkingToolParser(TaggedJsonToolParser):
    """ERNIE-4.5-VL-Thinking: tool calls right after the reasoning, or an answer, never both.

    The tool parser sees the text after `</think>` (pair it with the ernie-45-vl-thinking reasoning
    parser, as FastDeploy's docs do).
    """
    name = "ernie-45-vl-thinking"
    calls_or_content = True
    arguments_required = True


@register_tool_parser(["qwen3", "hermes"])
class HermesToolParser(TaggedJsonToolParser):
    """Qwen3 / Hermes: the same block syntax, no think markers required in the vocabulary."""
    name = "qwen3"
