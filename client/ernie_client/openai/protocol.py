"""Request bodies of /v1/chat/completions and /v1/completions, as OpenAI (plus vLLM/FastDeploy extras) define them.

Range checks live here so a bad field is a 400 naming it before anything reaches Triton. The limits
mirror ernie_serve.SamplingParams (not imported: the shim must run without Paddle installed), and every
integer is checked before it is narrowed to the ensemble's INT32 / UINT64 tensors.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from .errors import bad_request

MAX_LOGPROBS = 20          # ernie_serve.sampling_params.MAX_LOGPROBS
MAX_STOP_SEQUENCES = 5     # FD_MAX_STOP_SEQS_NUM
MAX_N = 16                 # choices per request; each is its own Triton request
INT32_MAX = 2**31 - 1      # max_tokens, min_tokens, top_k and token ids travel as INT32
# The seed tensor is UINT64; choice i sends seed + i, so seeds stay in int64 (vLLM's range) with room.
SEED_LIMIT = 2**63
REPETITION_PENALTY_RANGE = (1e-6, 1e6)  # ernie_serve.sampling_params.REPETITION_PENALTY_RANGE
TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]
LogitBias = Annotated[float, Field(ge=-100, le=100)]  # ernie_serve.sampling_params.LOGIT_BIAS_RANGE, OpenAI's


class _Model(BaseModel):
    # Unknown fields are ignored, as OpenAI, vLLM and FastDeploy do. NaN and infinities (Python's json
    # reads the NaN / Infinity literals) are never a valid setting.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class StreamOptions(_Model):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, every chunk carries the usage so far


class FunctionDefinition(_Model):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Model):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class ToolCallFunction(_Model):
    name: str
    arguments: str | dict[str, Any] = "{}"


class MessageToolCall(_Model):
    id: str | None = None
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ContentPart(_Model):
    type: str
    text: str | None = None


class ChatMessage(_Model):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


class _GenerationFields(_Model):
    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, le=INT32_MAX)
    min_p: float | None = Field(None, ge=0, le=1)
    max_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    min_tokens: int | None = Field(None, ge=0, le=INT32_MAX)
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    include_stop_str_in_output: bool | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    bad_words: list[str] | None = None
    logit_bias: dict[TokenId, LogitBias] | None = None  # JSON's "123" keys are read as token ids
    seed: int | None = Field(None, ge=0, lt=SEED_LIMIT)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, ge=REPETITION_PENALTY_RANGE[0], le=REPETITION_PENALTY_RANGE[1])
    # FastDeploy's: at most this many reasoning tokens, then the model is made to close its thinking and answer
    reasoning_max_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool = False
    user: str | None = None
    # Structured outputs: OpenAI's response_format and vLLM's / FastDeploy's guided_* fields; the ensemble
    # checks and compiles them (a bad one comes back as a 400 naming the field).
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    # vLLM's: each prompt token's logprob and its k most likely alternatives (the response's prompt_logprobs)
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    @model_validator(mode="after")
    def _check_common(self):
        if self.prompt_logprobs is not None and self.stream:  # vLLM's rule
            raise bad_request("prompt_logprobs are not available when stream is true", "prompt_logprobs")
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed when stream is true", "stream_options")
        stops = self.stop_list()
        if len(stops) > MAX_STOP_SEQUENCES:
            raise bad_request(f"stop may hold at most {MAX_STOP_SEQUENCES} sequences, got {len(stops)}", "stop")
        if any(not s for s in stops):
            raise bad_request("stop sequences must be non-empty strings", "stop")
        return self

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.include_usage and self.stream_options.continuous_usage_stats)


class ChatCompletionRequest(_GenerationFields):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[Tool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_completion_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    chat_template_kwargs: dict[str, Any] | None = None
    # Declared only to be refused: ignoring them would answer a different request than the one sent.
    functions: Any = None
    function_call: Any = None
    modalities: list[str] | None = None
    audio: Any = None

    @model_validator(mode="after")
    def _check_chat(self):
        for name in ("functions", "function_call"):
            if getattr(self, name) is not None:
                raise bad_request(f"{name} (OpenAI's legacy function calling) is not supported; send tools and "
                                  "tool_choice", name)
        if self.audio is not None or any(m != "text" for m in self.modalities or ()):
            raise bad_request("only text output is supported: modalities must be [\"text\"] and audio unset",
                              "audio" if self.audio is not None else "modalities")
        if self.top_logprobs and not self.logprobs:
            raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
        for i, m in enumerate(self.messages):
            for part in m.content if isinstance(m.content, list) else []:
                if part.type != "text":
                    raise bad_request(f"content part type {part.type!r} is not supported; only 'text' parts",
                                      f"messages[{i}].content")
                if part.text is None:
                    raise bad_request("a 'text' content part needs a 'text' string", f"messages[{i}].content")
            if m.role == "tool" and m.content is None:
                raise bad_request("a tool message needs content (the tool's result)", f"messages[{i}].content")
        return self

    @property
    def generation_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        """vLLM's meaning: None = no logprobs, 0 = only the sampled token's, k = plus the top k."""
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def num_prompt_logprobs(self) -> int | None:
        """The prompt logprobs to ask the ensemble for (None: none)."""
        return self.prompt_logprobs

    def active_tools(self) -> list[Tool] | None:
        return None if self.tool_choice == "none" else (self.tools or None)


class CompletionRequest(_GenerationFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    suffix: str | None = None
    best_of: int | None = None

    @model_validator(mode="after")
    def _check_completion(self):
        if self.suffix:
            raise bad_request("suffix (insertion) is not supported", "suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise bad_request(f"best_of must equal n ({self.n}) when given, got {self.best_of}", "best_of")
        prompts = self.prompt_list()
        if not prompts:
            raise bad_request("prompt must be a non-empty string, list of strings, list of token ids or list of "
                              "lists of token ids", "prompt")
        if len(prompts) * self.n > MAX_N:
            raise bad_request(f"at most {MAX_N} choices per request (prompts x n), got {len(prompts) * self.n}",
                              "prompt")
        return self

    def prompt_list(self) -> list[str | list[int]]:
        """Each prompt: text, or token ids used as they are (the ensemble's input_token_ids)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            return []
        if all(isinstance(x, str) for x in p):
            return list(p)
        prompts = [p] if all(isinstance(x, int) for x in p) else list(p)
        for i, ids in enumerate(prompts):
            where = "prompt" if prompts[0] is p else f"prompt[{i}]"
            if not isinstance(ids, list) or not ids:
                raise bad_request(f"{where} must be a non-empty list of token ids", where)
            bad = next((t for t in ids if not 0 <= t <= INT32_MAX), None)
            if bad is not None:
                raise bad_request(f"{where}: token ids must be in [0, {INT32_MAX}], got {bad}", where)
        return prompts

    @property
    def generation_limit(self) -> int | None:
        return self.max_tokens if self.max_tokens is not None else 16  # OpenAI's completions default

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs

    @property
    def echo_logprobs(self) -> bool:
        """OpenAI's legacy echo + logprobs: the logprobs cover the prompt's tokens too (the first one's null)."""
        return self.echo and self.logprobs is not None

    @property
    def num_prompt_logprobs(self) -> int | None:
        """The prompt logprobs to ask the ensemble for: vLLM's prompt_logprobs, and what echo + logprobs shows."""
        asked = [k for k in (self.prompt_logprobs, self.logprobs if self.echo else None) if k is not None]
        return max(asked) if asked else None


def lone_surrogate_path(body: Any) -> str | None:
    """Where the first string holding a lone UTF-16 surrogate is (`messages[0].content`), or None.

    Python's json turns a "\\ud800" escape without its pair into such a string; nothing downstream
    (UTF-8, gRPC, the tokenizer) can carry it, so the request is refused at the door. Iterative: a
    deeply nested body must not exhaust the stack.
    """
    stack: list[tuple[str, Any]] = [("", body)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            if not _is_unicode(value):
                return path or "request"
        elif isinstance(value, dict):
            if not all(_is_unicode(k) for k in value):
                return path or "request"
            stack.extend((f"{path}.{k}" if path else k, v) for k, v in reversed(value.items()))
        elif isinstance(value, list):
            stack.extend((f"{path}[{i}]", v) for i, v in reversed(list(enumerate(value))))
    return None


def _is_unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
