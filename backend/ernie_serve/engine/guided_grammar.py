"""Which grammar a guided request runs, as llguidance grammar text; no tokenizer is needed here.

- `llguidance_grammar`: a GuidedDecodingParams as llguidance's grammar (JSON text).
- `answer_constraint`: a constraint placed where the request's reasoning parser reads the answer from
  (ernie-x1: inside `<response>\\n...\\n</response>`), starting after `</think>` when the output begins
  inside reasoning (the prompt's model status is think_start).
- `tool_call_constraint`: `tool_choice` "required" / a named function as the tool parser's call blocks
  (`<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>`), each tool's JSON schema inside.

JSON is held to json.dumps's separators with no other whitespace: where a grammar allows free
whitespace, a sampling model can pad forever (measured: the demo model at temperature 1 does).
"""
from __future__ import annotations

import json
from typing import Any

import llguidance
from llguidance import LLMatcher

from ..parsers.base import ReasoningParser, ToolParser
from ..parsers.ernie_x1_reasoning import ErnieX1ReasoningParser
from ..parsers.tool_parsers import TaggedJsonToolParser
from ..sampling_params import GuidedDecodingParams

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
ANSWER = "answer"  # the name a wrapping Lark grammar refers to the wrapped constraint by
MAX_ERROR_CHARS = 400
# Newlines the model may put between `</think>` (or the prompt) and the constrained part, and between
# parallel tool calls; the ERNIE chat template writes two and one to three.
LEAD = '"\\n"{0,2}'
CALL_SEPARATOR = '"\\n"{1,3}'


class GrammarError(ValueError):
    """A constraint that does not compile; `field` is where it came from (guided_decoding.json, tools[0]...)."""

    def __init__(self, field: str, reason: str):
        reason = " ".join(reason.split())
        if len(reason) > MAX_ERROR_CHARS:
            reason = reason[: MAX_ERROR_CHARS - 3] + "..."
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


def llguidance_grammar(params: GuidedDecodingParams) -> str:
    """The llguidance grammar object (JSON text with a "grammars" list) for one constraint; deterministic,
    so it keys the compile cache."""
    kind = params.kind
    if kind == "json":
        return LLMatcher.grammar_from_json_schema(params.json, defaults=JSON_OPTIONS)
    if kind == "json_object":
        return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
    if kind == "regex":
        return LLMatcher.grammar_from_regex(params.regex)
    if kind == "choice":
        return _lark_grammar("start: " + " | ".join(_lark_string(c) for c in params.choice))
    if _is_llguidance_json(params.grammar):
        return params.grammar
    try:
        lark = llguidance.grammar_from("grammar", params.grammar)  # Lark as is, GBNF converted to Lark
    except ValueError as e:
        raise GrammarError("guided_decoding.grammar", str(e)) from None
    return _lark_grammar(lark)


def check_without_tokenizer(grammar: str, field: str) -> None:
    """Syntax and schema errors (special token names need the tokenizer: GrammarCompiler.check)."""
    error = LLMatcher.validate_grammar(grammar)
    if error:
        raise GrammarError(field, error)


def answer_constraint(params: GuidedDecodingParams, reasoning_parser: ReasoningParser | None,
                      model_status: str | None) -> GuidedDecodingParams:
    """`params` placed where `reasoning_parser` reads the answer of an output that starts in `model_status`.

    Without a reasoning parser (raw completions) the constraint covers the whole output. A "think" family
    parser in status "auto" (a closed think block in the prompt) is treated as not reasoning.
    """
    if reasoning_parser is None:
        return params
    start_after = reasoning_parser.think_end_token_id if model_status == "think_start" else None
    if isinstance(reasoning_parser, ErnieX1ReasoningParser):
        if model_status == "response_start":
            lark = f'start: @{ANSWER} "\\n" </response>'
        else:  # ernie-x1 content is only what `<response>` holds
            lark = f'start: {LEAD} <response> "\\n" @{ANSWER} "\\n" </response>'
    elif start_after is not None:
        lark = f"start: {LEAD} @{ANSWER}"
    else:
        return params
    entries = json.loads(llguidance_grammar(params))["grammars"]
    if len(entries) != 1:
        raise GrammarError(f"guided_decoding.{params.kind}", "an llguidance grammar of several grammars cannot be "
                           "placed inside the reasoning parser's answer format; send a single grammar")
    wrapped = {"grammars": [{"lark_grammar": lark}, dict(entries[0], name=ANSWER)]}
    return GuidedDecodingParams(grammar=json.dumps(wrapped, ensure_ascii=False), start_after_token_id=start_after)


def tool_call_constraint(tools: list[dict] | None, tool_choice: Any, parallel_tool_calls: bool | None,
                         tool_parser: ToolParser | None, reasoning_parser: ReasoningParser | None,
                         model_status: str | None) -> GuidedDecodingParams | None:
    """The constraint for tool_choice "required" (one or more calls of any tool; one when parallel_tool_calls
    is false) or a named function (one call of it); None for "auto" / "none" / absent.

    Raises ValueError whose message starts with the field: `tool_choice: ...` or `tools[i]...: ...`.
    """
    chosen = _chosen_function(tool_choice)
    if chosen is None:
        return None
    what = "tool_choice: 'required'" if chosen == "" else f"tool_choice: naming function {chosen!r}"
    functions = [_function_of(t, i) for i, t in enumerate(tools or [])]
    if not functions:
        raise ValueError(f"{what} needs tools: give at least one function in tools")
    if tool_parser is None:
        raise ValueError(f"{what} needs a tool-call parser to read the calls: start the server with "
                         "--tool-call-parser (ernie-x1 for ERNIE-4.5)")
    if not isinstance(tool_parser, TaggedJsonToolParser):
        raise ValueError(f"{what} is supported with the tool parsers that read "
                         f"<tool_call>{{json}}</tool_call> blocks (ernie-x1, ernie-45-vl-thinking, qwen3), not "
                         f"{tool_parser.name!r}")
    if chosen:
        named = [(i, f) for i, f in enumerate(functions) if f["name"] == chosen]
        if not named:
            raise ValueError(f"tool_choice: names function {chosen!r}, which is not in tools "
                             f"({', '.join(repr(f['name']) for f in functions)})")
        functions, indexes = [named[0][1]], [named[0][0]]
    else:
        indexes = list(range(len(functions)))
    calls = [_call_schema(f, i) for f, i in zip(functions, indexes)]
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    schema = dict(schema, **{"x-guidance": JSON_OPTIONS})
    repeat = f" ({CALL_SEPARATOR} call)*" if (not chosen and parallel_tool_calls is not False) else ""
    lark = (f"start: {LEAD} call{repeat}\n"
            f'call: {tool_parser.start_token} "\\n" %json {json.dumps(schema, ensure_ascii=False)} "\\n" '
            f"{tool_parser.end_token}\n")
    start_after = (reasoning_parser.think_end_token_id
                   if reasoning_parser is not None and model_status == "think_start" else None)
    grammar = _lark_grammar(lark)
    check_without_tokenizer(grammar, "tools")
    return GuidedDecodingParams(grammar=grammar, start_after_token_id=start_after)


def _chosen_function(tool_choice: Any) -> str | None:
    """"" for "required", the function's name for a named choice, None for no constraint."""
    if tool_choice in (None, "auto", "none"):
        return None
    if tool_choice == "required":
        return ""
    if isinstance(tool_choice, dict):
        fn = tool_choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if tool_choice.get("type", "function") == "function" and isinstance(name, str) and name:
            return name
    raise ValueError(f"tool_choice: must be 'none', 'auto', 'required' or "
                     f'{{"type": "function", "function": {{"name": ...}}}}, got {json.dumps(tool_choice)[:80]}')


def _function_of(tool: Any, i: int) -> dict:
    fn = tool.get("function", tool) if isinstance(tool, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise ValueError(f"tools[{i}]: must be a function with a name ({{\"type\": \"function\", \"function\": "
                         "{\"name\": ..., \"parameters\": {...}}})")
    return fn


def _call_schema(fn: dict, i: int) -> dict:
    """The JSON of one call, as the ERNIE template writes it: "name" first, then "arguments"."""
    params = fn.get("parameters")
    if params is None:  # OpenAI: a function without parameters takes none
        params = {"type": "object", "properties": {}, "additionalProperties": False}
    if not isinstance(params, dict):
        raise ValueError(f"tools[{i}].function.parameters: must be a JSON schema object")
    check_without_tokenizer(LLMatcher.grammar_from_json_schema(params, defaults=JSON_OPTIONS),
                            f"tools[{i}].function.parameters")
    return {"type": "object", "properties": {"name": {"const": fn["name"]}, "arguments": params},
            "required": ["name", "arguments"], "additionalProperties": False}


def _lark_grammar(lark: str) -> str:
    """Lark text as llguidance's grammar object, the one form the other constructors also return."""
    return json.dumps({"grammars": [{"lark_grammar": lark}]}, ensure_ascii=False)


def _lark_string(text: str) -> str:
    """A Lark string literal (JSON's escaping is Lark's)."""
    return json.dumps(text, ensure_ascii=False)


def _is_llguidance_json(text: str) -> bool:
    if not text.lstrip().startswith("{"):
        return False
    try:
        value = json.loads(text)
    except ValueError:
        return False
    return isinstance(value, dict) and isinstance(value.get("grammars"), list)
