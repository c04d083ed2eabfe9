"""OpenAI-shaped messages the parsers produce.

Plain dataclasses so the Triton models, the offline LLM and the OpenAI shim share one shape;
`to_dict()` gives the OpenAI JSON (None fields omitted), which is what goes on the wire.
"""
from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any


def _without_none(d: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in d.items() if v is not None}


def new_tool_call_id() -> str:
    """`chatcmpl-tool-<32 hex>`, the id format FastDeploy and vLLM clients expect."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass
class DeltaFunctionCall:
    name: str | None = None
    arguments: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return _without_none({"name": self.name, "arguments": self.arguments})


@dataclass
class DeltaToolCall:
    index: int
    id: str | None = None
    type: str | None = None
    function: DeltaFunctionCall | None = None

    def to_dict(self) -> dict[str, Any]:
        return _without_none({"index": self.index, "id": self.id, "type": self.type,
                              "function": self.function.to_dict() if self.function else None})


@dataclass
class DeltaMessage:
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] = field(default_factory=list)

    def is_empty(self) -> bool:
        return not self.content and not self.reasoning_content and not self.tool_calls

    def to_dict(self) -> dict[str, Any]:
        d = _without_none({"content": self.content, "reasoning_content": self.reasoning_content})
        if self.tool_calls:
            d["tool_calls"] = [t.to_dict() for t in self.tool_calls]
        return d


@dataclass
class FunctionCall:
    name: str
    arguments: str  # JSON text of the arguments object

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "arguments": self.arguments}


@dataclass
class ToolCall:
    id: str
    type: str = "function"
    function: FunctionCall = field(default_factory=lambda: FunctionCall("", "{}"))

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "type": self.type, "function": self.function.to_dict()}


@dataclass
class ExtractedToolCallInformation:
    tools_called: bool
    tool_calls: list[ToolCall] = field(default_factory=list)
    content: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return _without_none({"tools_called": self.tools_called,
                              "tool_calls": [t.to_dict() for t in self.tool_calls],
                              "content": self.content})


def merge_tool_deltas(deltas: list[DeltaToolCall]) -> list[DeltaToolCall]:
    """Fold consecutive entries for the same call into one, so a chunk has one entry per index."""
    merged: list[DeltaToolCall] = []
    for d in deltas:
        last = merged[-1] if merged else None
        if last is None or last.index != d.index:
            merged.append(DeltaToolCall(d.index, d.id, d.type,
                                        DeltaFunctionCall(d.function.name, d.function.arguments)
                                        if d.function else None))
            continue
        last.id = last.id or d.id
        last.type = last.type or d.type
        if d.function:
            f = last.function = last.function or DeltaFunctionCall()
            f.name = f.name if f.name is not None else d.function.name
            if d.function.arguments is not None:
                f.arguments = (f.arguments or "") + d.function.arguments
    return merged
