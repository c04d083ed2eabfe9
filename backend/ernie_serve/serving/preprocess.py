"""ernie_tokenizer's logic: a GenerateRequest -> prompt ids plus the JSON that travels with them.

Everything that can be wrong with a request is found here, before the engine sees it, so a bad
request costs no engine work and always gets INVALID_ARG naming the field.
"""
from __future__ import annotations

import json
from dataclasses import asdict, replace
from typing import Any

from ..chat import render_chat_prompt
from ..engine.guided import GrammarCompiler
from ..engine.guided_grammar import GrammarError, answer_constraint, tool_call_constraint
from ..engine.reasoning_budget import resolve_reasoning_budget
from ..parsers import ChatOutputParser, get_reasoning_parser, get_tool_parser
from ..sampling_params import SamplingParams
from .engine_response import RequestMeta
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
        self._grammars: GrammarCompiler | None = None  # built on the first guided request
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
        elif req.prompt_token_ids is not None:
            field = "input_token_ids"
            ids = req.prompt_token_ids
            vocab, largest = len(self.tokenizer), max(ids)
            if largest >= vocab:
                raise InvalidInput(field, f"token ids must be in [0, {vocab}) (the tokenizer's vocabulary), got "
                                          f"{largest}")
        else:
            field = "text_input"
            ids = self.tokenizer.encode(req.prompt, add_special_tokens=True)
        if not ids:
            raise InvalidInput(field, "encodes to no tokens")
        if len(ids) >= self.max_model_len:
            raise InvalidInput(field, f"the prompt has {len(ids)} tokens but max_model_len is {self.max_model_len}; "
                                      "it must leave room for at least one generated token")
        wanted = req.params.max_tokens
        if req.max_tokens_given and wanted is not None and len(ids) + wanted > self.max_model_len:
            raise InvalidInput("max_tokens", f"{wanted} tokens after the prompt's {len(ids)} need "
                                             f"{len(ids) + wanted} positions, but max_model_len is "
                                             f"{self.max_model_len}: ask for at most "
                                             f"{self.max_model_len - len(ids)} tokens")
        enable_thinking = req.chat_template_kwargs.get("enable_thinking") if req.is_chat else None
        enable_thinking = enable_thinking if isinstance(enable_thinking, bool) else None
        params = self._budgeted(self._constrained(req, ids, reasoning, tool, enable_thinking), req, ids, reasoning,
                                tool, enable_thinking)
        meta = RequestMeta(
            stream=req.stream, is_chat=req.is_chat,
            # vLLM backend semantics: a non-streaming text request echoes its prompt unless excluded
            echo=None if (req.stream or req.is_chat or req.exclude_input_in_output) else self._prompt_text(req),
            reasoning_parser=reasoning, tool_call_parser=tool if req.tools else None, tools=req.tools,
            enable_thinking=enable_thinking, max_tokens=params.max_tokens,
            skip_special_tokens=params.skip_special_tokens, logprobs=params.logprobs,
            # ernie_moe ends this request's errors inside its final response (engine_response.Failure)
            errors_in_band=True,
            # the Postprocessor after ernie_moe reports this stream's progress, and ernie_moe paces it by them
            progress_reports=True,
            # ... and relays a streaming client's cancellation to ernie_moe (its is_cancelled() poller then skips it)
            cancel_relayed=True)
        return ids, {"sampling": asdict(params), "stream": req.stream, "meta": meta.to_dict()}

    def _prompt_text(self, req: GenerateRequest) -> str:
        if req.prompt_token_ids is None:
            return req.prompt
        return self.tokenizer.decode(req.prompt_token_ids, skip_special_tokens=req.params.skip_special_tokens)

    def _constrained(self, req: GenerateRequest, ids: list[int], reasoning: str | None, tool: str | None,
                     enable_thinking: bool | None) -> SamplingParams:
        """The request's sampling params with its guided decoding as the engine runs it: tool_choice
        "required" / a named function as the tool parser's call format, or the client's constraint where the
        reasoning parser reads the answer; starting after `</think>` when the output begins inside reasoning
        (the model status the detokenizer will use). The grammar is compiled here, so an error names the
        client's field."""
        params = req.params
        if params.guided_decoding is None and req.tool_choice in (None, "auto", "none"):
            return params
        tools = req.tools if tool else None
        status = ChatOutputParser(self.tokenizer, reasoning, tool, ids, tools, enable_thinking).model_status
        rp = get_reasoning_parser(reasoning)(self.tokenizer) if reasoning else None
        try:
            calls = tool_call_constraint(req.tools, req.tool_choice, req.parallel_tool_calls,
                                         get_tool_parser(tool)(self.tokenizer) if tool else None, rp, status)
        except GrammarError as e:
            raise InvalidInput(e.field.split(".", 1)[0].split("[", 1)[0], str(e)) from None
        except ValueError as e:  # the message starts with the field: tool_choice ... / tools[2] ...
            raise InvalidInput("tools" if str(e).startswith("tools") else "tool_choice", str(e)) from None
        if calls is not None and params.guided_decoding is not None:
            raise InvalidInput("tool_choice", f"tool_choice {req.tool_choice!r} constrains the output to tool calls; "
                                              f"it cannot be combined with {req.guided_field}")
        field = "tool_choice" if calls is not None else req.guided_field or "guided_decoding"
        try:
            guided = calls or answer_constraint(params.guided_decoding, rp, status)
            self._grammar_compiler().check(guided)
        except GrammarError as e:
            raise InvalidInput(field, f"{field}: {e.reason}") from None
        return replace(params, guided_decoding=guided)

    def _budgeted(self, params: SamplingParams, req: GenerateRequest, ids: list[int], reasoning: str | None,
                  tool: str | None, enable_thinking: bool | None) -> SamplingParams:
        """reasoning_max_tokens placed for this prompt (engine/reasoning_budget.py): the engine gets the reasoning
        parser's end token when the output starts inside the reasoning (the status the detokenizer will use)."""
        if params.reasoning_max_tokens is None or params.reasoning_end_token_id is not None:
            return params
        end, starts = None, False
        if reasoning:
            end = getattr(get_reasoning_parser(reasoning)(self.tokenizer), "think_end_token_id", None)
            tools = req.tools if tool else None
            status = ChatOutputParser(self.tokenizer, reasoning, tool, ids, tools, enable_thinking).model_status
            starts = status == "think_start"
        try:
            return resolve_reasoning_budget(params, end, starts)
        except ValueError as e:
            raise InvalidInput("reasoning_max_tokens", str(e)) from None

    def _grammar_compiler(self) -> GrammarCompiler:
        if self._grammars is None:
            eos = self.tokenizer.eos_token_id
            if eos is None:
                raise InvalidInput("guided_decoding", "guided decoding needs an eos token; this tokenizer has none")
            self._grammars = GrammarCompiler(self.tokenizer, len(self.tokenizer), [eos])
        return self._grammars


def dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
