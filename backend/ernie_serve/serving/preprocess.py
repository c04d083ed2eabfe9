"""ernie_tokenizer's logic: a GenerateRequest -> prompt ids plus the JSON that travels with them.

Everything that can be wrong with a request is found here, before the engine sees it, so a bad
request costs no engine work and always gets INVALID_ARG naming the field.
"""
from __future__ import annotations

import json
from dataclasses import asdict
from typing import Any

from ..chat import render_chat_prompt
from ..parsers import get_reasoning_parser, get_tool_parser
from .errors import InvalidInput
from .request import GenerateRequest


class Preprocessor:
    def __init__(self, tokenizer, max_model_len: int, reasoning_parser: str | None = None,
                 tool_call_parser: str | None = None, chat_template: str | None = None):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.chat_template = chat_template
        self.reasoning_parser = reasoning_parser or None
        self.tool_call_parser = tool_call_parser or None
        self._checked: set[tuple[str, str]] = set()
        # A configured parser that does not fit the tokenizer is a start-up error, not a per-request one.
        for kind, name in (("reasoning_parser", self.reasoning_parser), ("tool_call_parser", self.tool_call_parser)):
            if name:
                self._check_parser(kind, name)

    def _check_parser(self, kind: str, name: str) -> None:
        if (kind, name) in self._checked:
            return
        lookup = get_reasoning_parser if kind == "reasoning_parser" else get_tool_parser
        try:
            lookup(name)(self.tokenizer)
        except ValueError as e:  # unknown name (lists the known ones) or markers missing from the vocab
            raise InvalidInput(kind, str(e)) from None
        self._checked.add((kind, name))

    def encode(self, req: GenerateRequest) -> tuple[list[int], dict[str, Any]]:
        """Prompt ids and the request JSON for ernie_moe (sampling params + what the detokenizer needs)."""
        if req.params.n != 1:
            raise InvalidInput("n", f"the Triton ensemble returns one sequence per request, got n={req.params.n}: "
                                    "send n requests with n=1 (prefix caching shares the prompt between them), "
                                    "or use the OpenAI shim (ernie-openai), which does that for n > 1")
        if req.skip_parsers:
            reasoning = tool = None
        else:
            reasoning = req.reasoning_parser or self.reasoning_parser
            tool = req.tool_call_parser or self.tool_call_parser
        for kind, name in (("reasoning_parser", reasoning), ("tool_call_parser", tool)):
            if name:
                self._check_parser(kind, name)
        if req.is_chat:
            field = "messages"
            try:
                _, ids = render_chat_prompt(self.tokenizer, req.messages, req.tools, req.chat_template_kwargs,
                                            self.chat_template)
            except InvalidInput:
                raise
            except Exception as e:  # noqa: BLE001 - template errors (jinja, bad kwargs) are the request's fault
                raise InvalidInput("messages", f"the chat template could not render them: {e}") from None
        else:
            field = "text_input"
            ids = self.tokenizer.encode(req.prompt, add_special_tokens=True)
        if not ids:
            raise InvalidInput(field, "encodes to no tokens")
        if len(ids) >= self.max_model_len:
            raise InvalidInput(field, f"the prompt has {len(ids)} tokens but max_model_len is {self.max_model_len}; "
                                      "it must leave room for at least one generated token")
        enable_thinking = req.chat_template_kwargs.get("enable_thinking") if req.is_chat else None
        meta = {
            "stream": req.stream,
            "is_chat": req.is_chat,
            # vLLM backend semantics: a non-streaming text request echoes its prompt unless excluded
            "echo": None if (req.stream or req.is_chat or req.exclude_input_in_output) else req.prompt,
            "reasoning_parser": reasoning,
            "tool_call_parser": tool if req.tools else None,
            "tools": req.tools,
            "enable_thinking": enable_thinking if isinstance(enable_thinking, bool) else None,
            "max_tokens": req.params.max_tokens,
            "skip_special_tokens": req.params.skip_special_tokens,
            "logprobs": req.params.logprobs,
        }
        return ids, {"sampling": asdict(req.params), "stream": req.stream, "meta": meta}


def dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
