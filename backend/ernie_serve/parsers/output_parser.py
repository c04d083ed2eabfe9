"""ChatOutputParser: the one place that combines a reasoning parser and a tool parser per request.

Pipeline, the same for streaming and non-streaming:
    output --reasoning parser split--> reasoning | rest
    rest   --tool parser (if tools)--> tool calls | outside text
    outside text --reasoning parser content rule--> content
(for ernie-x1 the content rule keeps only `<response>...</response>`; for the others it is identity).
Each streaming stage holds back text only while it is ambiguous, so the concatenated deltas, the
last one fed with final=True, equal `parse_complete` on the whole text. The one exception is a tool
call the output ends inside (max_tokens) whose header went out before the final delta: a header
cannot be taken back, but `finish()` leaves the call out, as non-streaming does.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from .base import PassThrough, TokenizerLike
from .protocol import DeltaMessage, DeltaToolCall, FunctionCall, ToolCall
from .registry import get_reasoning_parser, get_tool_parser


@dataclass
class ParsedOutput:
    reasoning_content: str | None
    content: str
    tool_calls: list[ToolCall] = field(default_factory=list)
    tools_called: bool = False

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"content": self.content}
        if self.reasoning_content is not None:
            d["reasoning_content"] = self.reasoning_content
        if self.tool_calls:
            d["tool_calls"] = [t.to_dict() for t in self.tool_calls]
        return d


def _make_parsers(tokenizer: TokenizerLike, reasoning_parser: str | None, tool_parser: str | None,
                  prompt_token_ids: Sequence[int], tools: list | None, enable_thinking: bool | None):
    rp = get_reasoning_parser(reasoning_parser)(tokenizer) if reasoning_parser else None
    tp = get_tool_parser(tool_parser)(tokenizer) if (tool_parser and tools) else None
    status = None
    if rp is not None:
        if enable_thinking is None or rp.status_from_prompt_only:
            status = rp.get_model_status(prompt_token_ids)
        else:
            status = "think_start" if enable_thinking else "think_end"
    return rp, tp, status


def parse_complete(tokenizer: TokenizerLike, reasoning_parser: str | None, tool_parser: str | None,
                   prompt_token_ids: Sequence[int], text: str, tools: list | None = None,
                   enable_thinking: bool | None = None) -> ParsedOutput:
    """Non-streaming parse of a whole generated text."""
    rp, tp, status = _make_parsers(tokenizer, reasoning_parser, tool_parser, prompt_token_ids, tools,
                                   enable_thinking)
    reasoning, rest = rp.split(text, status) if rp else ("", text)
    calls: list[ToolCall] = []
    called = False
    if tp is not None:
        info = tp.extract_tool_calls(rest, None)
        called, calls = info.tools_called, list(info.tool_calls)
        rest = info.content if info.content is not None else ""
    content = rp.content_from_rest(rest, status) if rp else rest
    return ParsedOutput(reasoning or None, content, calls, called)


class ChatOutputParser:
    """Per-request streaming parser: feed() each detokenized delta (final=True on the last), finish()."""

    parse_complete = staticmethod(parse_complete)

    def __init__(self, tokenizer: TokenizerLike, reasoning_parser: str | None, tool_parser: str | None,
                 prompt_token_ids: Sequence[int], tools: list | None = None,
                 enable_thinking: bool | None = None):
        rp, tp, self.model_status = _make_parsers(tokenizer, reasoning_parser, tool_parser,
                                                  prompt_token_ids, tools, enable_thinking)
        self._splitter = rp.new_splitter(self.model_status) if rp else None
        self._filter = rp.new_content_filter(self.model_status) if rp else PassThrough()
        self._tools = tp.new_stream() if tp else None
        self._think_end_id = getattr(rp, "think_end_token_id", None)
        self.num_reasoning_tokens = 0
        self._undecided_tokens = 0
        self._reasoning: list[str] = []
        self._content: list[str] = []
        self._calls: dict[int, list] = {}  # index -> [id, name, argument fragments]
        self._ended = False

    @property
    def enable_thinking(self) -> bool:
        """Whether this request starts in reasoning (parsers.md: model_status == think_start)."""
        return self.model_status == "think_start"

    def feed(self, delta_text: str, delta_token_ids: Sequence[int] = (), final: bool = False) -> DeltaMessage | None:
        """One delta. final=True marks the end of generation: the message then also carries what was
        held back as possibly-a-marker, and leaves out a tool call the output ended inside."""
        if self._ended:
            raise RuntimeError("ChatOutputParser.feed() after the final delta; use one parser per request")
        reasoning, rest = "", delta_text
        if self._splitter is not None:
            was = self._splitter.in_reasoning
            reasoning, rest = self._splitter.push(delta_text)
            self._count_reasoning_tokens(was, self._splitter.in_reasoning, list(delta_token_ids))
            if final:
                held_reasoning, held_rest = self._splitter.flush()
                reasoning, rest = reasoning + held_reasoning, rest + held_rest
                if self._splitter.in_reasoning is None:
                    self._undecided_tokens = 0
        self._ended = final
        return self._emit(reasoning, rest, final)

    def finish(self) -> ParsedOutput:
        """The whole result, as parse_complete gives it (ends the output first if needed)."""
        if not self._ended:
            self.feed("", (), final=True)
        calls = [ToolCall(cid, "function", FunctionCall(name, "".join(args)))
                 for _, (cid, name, args) in sorted(self._calls.items())]
        return ParsedOutput("".join(self._reasoning) or None, "".join(self._content), calls, bool(calls))

    def _count_reasoning_tokens(self, was: bool | None, now: bool | None, ids: list[int]) -> None:
        if was is None and now is None:
            self._undecided_tokens += len(ids)
            return
        if was is None:  # decided in this delta
            if now:
                self.num_reasoning_tokens += self._undecided_tokens
            self._undecided_tokens = 0
            was = True if now else False
        if was and now:
            self.num_reasoning_tokens += len(ids)
        elif was and not now:
            cut = ids.index(self._think_end_id) if self._think_end_id in ids else len(ids)
            self.num_reasoning_tokens += cut

    def _emit(self, reasoning: str, rest: str, final: bool) -> DeltaMessage | None:
        calls: list[DeltaToolCall] = []
        outside = rest
        if self._tools is not None:
            outside, calls = self._tools.push(rest)
            if final:
                more, more_calls = self._tools.flush()
                outside, calls = outside + more, calls + more_calls
                cut = self._tools.cut_off_index
                if cut is not None:  # a call that never finished: not part of the result
                    calls = [d for d in calls if d.index != cut]
                    self._calls.pop(cut, None)
        content = self._filter.push(outside)
        if final:
            content += self._filter.flush()
        if reasoning:
            self._reasoning.append(reasoning)
        if content:
            self._content.append(content)
        for d in calls:
            entry = self._calls.setdefault(d.index, [d.id, None, []])
            entry[0] = entry[0] or d.id
            if d.function is not None:
                if d.function.name is not None:
                    entry[1] = d.function.name
                if d.function.arguments:
                    entry[2].append(d.function.arguments)
        if not reasoning and not content and not calls:
            return None
        return DeltaMessage(content=content or None, reasoning_content=reasoning or None, tool_calls=calls)
