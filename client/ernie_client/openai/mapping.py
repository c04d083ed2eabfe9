"""OpenAI request -> the `ernie` ensemble's request fields (DESIGN.md's tensor contract).

The result is a plain dict of field name -> Python value per Triton request; `triton.py` turns it into
tensors with the dtypes and shapes the ensemble's config declares. Fields with their own tensor
(TensorRT-LLM names) go there; every other SamplingParams field goes into `sampling_parameters`.

n > 1 is served as n Triton requests (the ensemble's outputs carry no choice index); with a seed,
choice i uses seed + i so the choices differ but the whole request stays reproducible.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from .errors import bad_request
from .protocol import ChatCompletionRequest, ChatMessage, CompletionRequest

# SamplingParams fields that travel in the sampling_parameters JSON (the rest have tensors).
_JSON_FIELDS = ("min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens",
                "reasoning_max_tokens",
                "stop_token_ids", "include_stop_str_in_output", "ignore_eos", "skip_special_tokens", "logit_bias",
                # structured outputs, under the names the ensemble's sampling_parameters takes
                "response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar")


@dataclass
class Job:
    """One Triton request: choice `index` of the OpenAI response."""
    index: int
    fields: dict[str, Any]
    prompt_text: str | None = None  # completions: what echo prepends


def _text_of(content) -> str | None:
    if content is None or isinstance(content, str):
        return content
    return "".join(part.text or "" for part in content)


def message_to_template(m: ChatMessage) -> dict[str, Any]:
    """A message as the chat template sees it: text parts joined, tool calls as plain dicts."""
    out: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": _text_of(m.content)}
    if m.name is not None:
        out["name"] = m.name
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    if m.tool_calls:
        out["tool_calls"] = [tc.model_dump(exclude_none=True) for tc in m.tool_calls]
    if m.reasoning_content is not None:
        out["reasoning_content"] = m.reasoning_content
        # ERNIE's thinking template reads an earlier turn's reasoning from `thoughts`.
        out["thoughts"] = m.reasoning_content
    return out


def _sampling_fields(req: ChatCompletionRequest | CompletionRequest, max_tokens: int | None) -> dict[str, Any]:
    f: dict[str, Any] = {"stream": True}  # always stream from Triton: one code path, cancellable, timed
    if max_tokens is not None:
        f["max_tokens"] = max_tokens
    for name in ("temperature", "top_p"):
        if getattr(req, name) is not None:
            f[name] = float(getattr(req, name))
    if req.top_k is not None:
        f["top_k"] = 0 if req.top_k == -1 else req.top_k
    if req.stop:
        f["stop_words"] = req.stop_list()
    if req.bad_words:
        f["bad_words"] = list(req.bad_words)
    sp: dict[str, Any] = {}
    if max_tokens is None:
        # No limit asked for: SamplingParams(max_tokens=None) runs to max_model_len - prompt length.
        sp["max_tokens"] = None
    for name in _JSON_FIELDS:
        if getattr(req, name) is not None:
            sp[name] = getattr(req, name)
    if req.num_logprobs is not None:
        sp["logprobs"] = req.num_logprobs
    if req.num_prompt_logprobs is not None:
        sp["prompt_logprobs"] = req.num_prompt_logprobs
    f["sampling_parameters"] = sp
    f["exclude_input_in_output"] = True
    f["return_num_input_tokens"] = True
    f["return_num_output_tokens"] = True
    return f


def _with_seed(fields: dict[str, Any], seed: int | None, offset: int) -> dict[str, Any]:
    out = dict(fields, sampling_parameters=dict(fields["sampling_parameters"]))
    if seed is not None:
        out["seed"] = seed + offset
    return out


def chat_jobs(req: ChatCompletionRequest) -> list[Job]:
    base = _sampling_fields(req, req.generation_limit)
    base["messages"] = [message_to_template(m) for m in req.messages]
    tools = req.active_tools()
    if tools:
        base["tools"] = [t.model_dump(exclude_none=True) for t in tools]
        # "required" / a named function: the ensemble constrains the output to its tool parser's call format
        for name in ("tool_choice", "parallel_tool_calls"):
            if getattr(req, name) is not None:
                base["sampling_parameters"][name] = getattr(req, name)
    elif req.tool_choice not in (None, "auto", "none"):
        base["sampling_parameters"]["tool_choice"] = req.tool_choice  # no tools: the ensemble says what is missing
    if req.chat_template_kwargs:
        base["chat_template_kwargs"] = dict(req.chat_template_kwargs)
    return [Job(i, _with_seed(base, req.seed, i)) for i in range(req.n)]


def completion_jobs(req: CompletionRequest, decode: Callable[[list[int]], str] | None = None) -> list[Job]:
    """`decode`: the served tokenizer's, for echoing a token-id prompt as text (without it, echo needs text)."""
    base = _sampling_fields(req, req.generation_limit)
    jobs = []
    for p, prompt in enumerate(req.prompt_list()):
        echoed = prompt if isinstance(prompt, str) else None
        if req.echo and echoed is None:
            if decode is None:
                raise bad_request("echo with a token-id prompt needs the served tokenizer to show it as text: start "
                                  "the shim with --tokenizer (ernie-serve passes it)", "echo")
            echoed = decode(prompt)
        for j in range(req.n):
            i = p * req.n + j
            # skip_parsers: a completion is the model's raw text (</think> and all), never split into reasoning
            key = "text_input" if isinstance(prompt, str) else "input_token_ids"
            jobs.append(Job(i, dict(_with_seed(base, req.seed, j), skip_parsers=True, **{key: prompt}),
                            prompt_text=echoed))
    return jobs
