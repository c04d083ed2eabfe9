"""Chat glue shared by LLM.chat, the Triton tokenizer/detokenizer models and the OpenAI shim:
render the template to prompt ids, and turn generated text into reasoning / content / tool calls."""
from __future__ import annotations

from typing import Any

from .config import EngineConfig
from .outputs import RequestOutput
from .parsers import parse_complete


def render_chat_prompt(tokenizer, messages: list[dict], tools: list[dict] | None = None,
                       chat_template_kwargs: dict[str, Any] | None = None, chat_template: str | None = None,
                       add_generation_prompt: bool = True) -> tuple[str, list[int]]:
    """The prompt text and ids for a conversation, with the model's own template (generation always adds the
    assistant's opening; /tokenize may leave it out)."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {role, content} objects")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m:
            raise ValueError(f"messages[{i}] must be an object with a 'role'")
    text = tokenizer.apply_chat_template(messages, tools=tools or None, add_generation_prompt=add_generation_prompt,
                                         tokenize=False, chat_template=chat_template,
                                         **(chat_template_kwargs or {}))
    return text, tokenizer.encode(text)


def finish_reason_for(generated: int, max_tokens: int | None, engine_reason: str | None, tools_called: bool) -> str | None:
    """parsers.md: "length" when max_tokens was reached (even over tool calls), else "tool_calls" if any."""
    if engine_reason is None:
        return None
    if engine_reason == "length" or (max_tokens is not None and generated >= max_tokens):
        return "length"
    if tools_called and engine_reason == "stop":
        return "tool_calls"
    return engine_reason


def parse_chat_output(tokenizer, config: EngineConfig, out: RequestOutput, tools: list[dict] | None) -> None:
    """Fill reasoning_content / tool_calls / finish_reason on every completion, in place."""
    if not (config.reasoning_parser or (config.tool_call_parser and tools)):
        return
    for comp in out.outputs:
        parsed = parse_complete(tokenizer, config.reasoning_parser, config.tool_call_parser,
                                out.prompt_token_ids, comp.text, tools)
        comp.reasoning_content = parsed.reasoning_content
        comp.text = parsed.content
        comp.tool_calls = [c.to_dict() for c in parsed.tool_calls] or None
        comp.finish_reason = finish_reason_for(len(comp.token_ids), None, comp.finish_reason, parsed.tools_called)
