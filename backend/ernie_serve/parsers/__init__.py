"""Reasoning and tool-call parsers (names use `-`: ernie-x1, ernie-45-vl, ernie-45-vl-thinking, qwen3).

Importing the package registers the built-in parsers.
"""
from .base import ReasoningParser, ToolParser
from .protocol import (DeltaFunctionCall, DeltaMessage, DeltaToolCall, ExtractedToolCallInformation,
                       FunctionCall, ToolCall)
from .registry import (get_reasoning_parser, get_tool_parser, list_reasoning_parsers, list_tool_parsers,
                       load_parser_plugin, register_reasoning_parser, register_tool_parser)
from . import ernie_x1_reasoning, think_reasoning, tool_parsers  # noqa: F401  (registers built-ins)
from .output_parser import ChatOutputParser, ParsedOutput, parse_complete

__all__ = [
    "ReasoningParser", "ToolParser", "DeltaFunctionCall", "DeltaMessage", "DeltaToolCall",
    "ExtractedToolCallInformation", "FunctionCall", "ToolCall", "get_reasoning_parser", "get_tool_parser",
    "list_reasoning_parsers", "list_tool_parsers", "load_parser_plugin", "register_reasoning_parser",
    "register_tool_parser", "ChatOutputParser", "ParsedOutput", "parse_complete",
]
