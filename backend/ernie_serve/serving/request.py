"""Ensemble request tensors -> one validated GenerateRequest.

Names follow the TensorRT-LLM ensemble (genai-perf `--backend tensorrtllm`, Triton's OpenAI frontend)
and the vLLM backend (`sampling_parameters` JSON); chat requests add `messages`, `tools` and
`chat_template_kwargs` as JSON strings. Tensors arrive batched ([1, ...]): one request per batch row,
and a batch of more than one row is refused rather than silently truncated.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..sampling_params import GuidedDecodingParams, SamplingParams
from .errors import InvalidInput

# tensor name -> SamplingParams field, for the scalar sampling inputs
SCALAR_SAMPLING_INPUTS = {
    "max_tokens": "max_tokens", "temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
    "seed": "seed", "random_seed": "seed", "min_tokens": "min_tokens", "min_length": "min_tokens",
    "repetition_penalty": "repetition_penalty", "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
}
BOOL_INPUTS = ("stream", "exclude_input_in_output", "return_num_input_tokens", "return_num_output_tokens",
               "return_finish_reason", "return_log_probs", "skip_parsers")
JSON_INPUTS = ("sampling_parameters", "messages", "tools", "chat_template_kwargs")
STRING_LIST_INPUTS = {"stop_words": "stop", "bad_words": "bad_words"}
# request parameters (HTTP JSON keys that are not inputs, gRPC parameters) this layer reads
PARSER_PARAMETERS = ("reasoning_parser", "tool_call_parser")
# SamplingParams fields that ernie_moe sets for how it hands the engine's outputs on (RequestOutputKind.DELTA, and
# detokenize only where stop strings need the text in the engine)
SERVER_SET_SAMPLING_FIELDS = ("output_kind", "detokenize")
# BOOL inputs that may also come as request parameters (HTTP JSON keys of an ensemble without the input)
FLAG_PARAMETERS = ("skip_parsers",)
# sampling_parameters keys that set SamplingParams.guided_decoding, vLLM's / FastDeploy's names -> its field
GUIDED_KEYS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


@dataclass
class GenerateRequest:
    params: SamplingParams
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None  # a pre-tokenized prompt (input_token_ids), used as it is
    messages: list[dict] | None = None
    tools: list[dict] | None = None
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    stream: bool = False
    exclude_input_in_output: bool = False
    reasoning_parser: str | None = None  # per-request override of the configured parser
    tool_call_parser: str | None = None
    # Raw text out: no reasoning / tool-call parsing (OpenAI /v1/completions), markers like </think> kept.
    skip_parsers: bool = False
    # where params.guided_decoding came from (guided_json, response_format, ...), for errors found later
    guided_field: str | None = None
    tool_choice: str | dict | None = None  # OpenAI's; "required" / a named function constrain the output
    parallel_tool_calls: bool | None = None
    # the client asked for max_tokens (or max_completion_tokens): beyond the context it is a 400, where the
    # default (16) just stops at max_model_len
    max_tokens_given: bool = False

    @property
    def is_chat(self) -> bool:
        return self.messages is not None


def _row(inputs: dict[str, np.ndarray], name: str) -> np.ndarray | None:
    arr = inputs.get(name)
    if arr is None:
        return None
    arr = np.asarray(arr)
    if arr.ndim >= 2 or (arr.ndim == 1 and name not in STRING_LIST_INPUTS):
        if arr.shape[0] != 1:
            raise InvalidInput(name, f"send one request per call (batch size 1), got a batch of {arr.shape[0]}")
        arr = arr[0]
    return arr.reshape(-1)


def _text(value: Any, name: str) -> str:
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError as e:
            raise InvalidInput(name, f"must be UTF-8 text ({e})") from None
    if isinstance(value, str):
        return value
    raise InvalidInput(name, f"must be a string, got {type(value).__name__}")


def _one(inputs: dict[str, np.ndarray], name: str) -> Any:
    arr = _row(inputs, name)
    if arr is None:
        return None
    if arr.size != 1:
        raise InvalidInput(name, f"must hold exactly one value, got {arr.size}")
    return arr[0]


def _json(inputs: dict[str, np.ndarray], name: str, kind: type) -> Any:
    raw = _one(inputs, name)
    if raw is None:
        return None
    text = _text(raw, name)
    if not text.strip():
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise InvalidInput(name, f"is not valid JSON ({e.msg} at position {e.pos})") from None
    except ValueError as e:  # e.g. an integer literal past Python's 4300-digit conversion limit
        raise InvalidInput(name, f"is not valid JSON ({e})") from None
    if not isinstance(value, kind):
        want = "a JSON object" if kind is dict else "a JSON array"
        raise InvalidInput(name, f"must be {want}, got {type(value).__name__}")
    try:
        # A JSON "\ud800" escape without its pair decodes to a lone surrogate, which no tokenizer,
        # UTF-8 encoder or Triton error message can carry further.
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidInput(name, "holds a lone UTF-16 surrogate (a \\uD800-\\uDFFF escape without its pair); "
                                 "send valid Unicode text") from None
    return value


def _token_ids(inputs: dict[str, np.ndarray], name: str) -> list[int] | None:
    """A tokenized prompt: a non-empty INT32 row of ids >= 0 (the vocabulary bound is the preprocessor's)."""
    arr = _row(inputs, name)
    if arr is None:
        return None
    if arr.dtype.kind not in "iu":
        raise InvalidInput(name, f"must be integer token ids, got {arr.dtype}")
    if arr.size == 0:
        raise InvalidInput(name, "is empty: give at least one token id")
    if int(arr.min()) < 0:
        raise InvalidInput(name, f"token ids must be >= 0, got {int(arr.min())}")
    return [int(t) for t in arr]


def _string_list(inputs: dict[str, np.ndarray], name: str) -> list[str] | None:
    arr = inputs.get(name)
    if arr is None:
        return None
    arr = np.asarray(arr)
    if arr.ndim >= 2:
        if arr.shape[0] != 1:
            raise InvalidInput(name, f"send one request per call (batch size 1), got a batch of {arr.shape[0]}")
        arr = arr[0]
    words = [_text(v, name) for v in arr.reshape(-1)]
    return [w for w in words if w]  # TRT-LLM clients pad the list with empty strings


def parse_request(inputs: dict[str, np.ndarray], parameters: dict[str, Any] | None = None) -> GenerateRequest:
    """Validate everything a client can send; raises InvalidInput naming the offending field."""
    parameters = parameters or {}
    prompt_raw = _one(inputs, "text_input")
    prompt = _text(prompt_raw, "text_input") if prompt_raw is not None else None
    messages = _json(inputs, "messages", list)
    token_ids = _token_ids(inputs, "input_token_ids")
    given = [name for name, v in (("text_input", prompt), ("input_token_ids", token_ids), ("messages", messages))
             if v is not None]
    if len(given) > 1:
        raise InvalidInput(given[1], f"give one of text_input, input_token_ids or messages, got {' and '.join(given)}")
    if not given:
        raise InvalidInput("text_input", "missing: give text_input (a prompt), input_token_ids (a tokenized prompt) "
                                         "or messages (a chat as JSON)")
    if prompt is not None and not prompt:
        raise InvalidInput("text_input", "is empty")
    if messages is not None:
        if not messages:
            raise InvalidInput("messages", "must be a non-empty JSON array of {role, content} objects")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise InvalidInput("messages", f"item {i} must be an object with a string 'role'")
    tools = _json(inputs, "tools", list)
    if tools is not None and not all(isinstance(t, dict) for t in tools):
        raise InvalidInput("tools", "must be a JSON array of tool objects")
    kwargs = _json(inputs, "chat_template_kwargs", dict) or {}
    if messages is None and (tools or kwargs):
        name = "tools" if tools else "chat_template_kwargs"
        raise InvalidInput(name, f"only applies to chat requests (messages), not to {given[0]}")

    flags = {}
    for name in BOOL_INPUTS:
        v = _one(inputs, name)
        flags[name] = bool(v) if v is not None else False
    for name in FLAG_PARAMETERS:
        v = parameters.get(name)
        if v is not None:
            if not isinstance(v, bool):
                raise InvalidInput(name, f"must be a boolean, got {type(v).__name__}")
            flags[name] = flags[name] or v

    sampling: dict[str, Any] = _json(inputs, "sampling_parameters", dict) or {}
    guided_field = _take_guided(sampling)
    tool_choice = sampling.pop("tool_choice", None)
    parallel_tool_calls = sampling.pop("parallel_tool_calls", None)
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise InvalidInput("parallel_tool_calls", f"parallel_tool_calls: must be true or false, got "
                                                  f"{parallel_tool_calls!r}")
    if tool_choice not in (None, "none", "auto") and messages is None:
        raise InvalidInput("tool_choice", "tool_choice: only applies to chat requests (messages with tools), not to "
                                          f"{given[0]}")
    if tool_choice == "none":  # OpenAI: the model may not call tools, so it is not shown them
        tools = None
    if "max_completion_tokens" in sampling:  # OpenAI spelling; parsers.md: it wins over max_tokens
        value = sampling.pop("max_completion_tokens")
        if value is not None:
            sampling["max_tokens"] = value
    for name, field_name in SCALAR_SAMPLING_INPUTS.items():
        v = _one(inputs, name)
        if v is not None:  # a numpy scalar of the declared dtype; SamplingParams checks its range
            sampling[field_name] = v
    for name, field_name in STRING_LIST_INPUTS.items():
        words = _string_list(inputs, name)
        if words:
            sampling[field_name] = words
    if flags["return_log_probs"] and sampling.get("logprobs") is None:
        # TensorRT-LLM's switch: the sampled token's logprob only (sampling_parameters {"logprobs": k} adds top k).
        sampling["logprobs"] = 0
    for name in SERVER_SET_SAMPLING_FIELDS:
        if name in sampling:  # a request may not set them: refused, never silently overridden
            raise InvalidInput(f"sampling_parameters.{name}", "is set by the server (ernie_moe streams each step's "
                                                              "tokens and the detokenizer decodes them), not by a request")
    try:
        params = SamplingParams.from_dict(sampling)
    except ValueError as e:
        raise InvalidInput(_field_of(str(e), sampling), str(e)) from None

    overrides = {}
    for name in PARSER_PARAMETERS:
        v = parameters.get(name)
        if v is not None and not isinstance(v, str):
            raise InvalidInput(name, f"must be a parser name string, got {type(v).__name__}")
        overrides[name] = v or None
    return GenerateRequest(params=params, prompt=prompt, prompt_token_ids=token_ids, messages=messages,
                           tools=tools or None,
                           chat_template_kwargs=kwargs, stream=flags["stream"],
                           exclude_input_in_output=flags["exclude_input_in_output"],
                           skip_parsers=flags["skip_parsers"], guided_field=guided_field,
                           tool_choice=tool_choice, parallel_tool_calls=parallel_tool_calls,
                           max_tokens_given=sampling.get("max_tokens") is not None, **overrides)


def _take_guided(sampling: dict[str, Any]) -> str | None:
    """Turn the guided-decoding keys of sampling_parameters (guided_json / guided_regex / guided_choice /
    guided_grammar, OpenAI's response_format, or guided_decoding itself) into sampling["guided_decoding"],
    checked here so an error names the key the client sent. Returns that key."""
    keys = (*GUIDED_KEYS, "response_format", "guided_decoding")
    for k in keys:
        if k in sampling and sampling[k] is None:  # JSON null: not given
            del sampling[k]
    given = [k for k in keys if k in sampling]
    if not given:
        return None
    if len(given) > 1:
        raise InvalidInput(given[1], f"{given[1]}: give one guided-decoding constraint, got {' and '.join(given)}")
    key = given[0]
    if key == "guided_decoding":
        return key
    value = sampling.pop(key)
    if key == "response_format":
        constraint, label = _response_format(value)
        if constraint is None:
            return None
    else:
        constraint, label = {GUIDED_KEYS[key]: value}, key
    try:
        sampling["guided_decoding"] = GuidedDecodingParams.from_value(constraint)
    except ValueError as e:  # "guided_decoding.json is not valid JSON" -> "guided_json is not valid JSON"
        raise InvalidInput(key, f"{label} {str(e).split(' ', 1)[1]}") from None
    return key


def _response_format(value: Any) -> tuple[dict | None, str]:
    """OpenAI's response_format as a GuidedDecodingParams object (None for "text") and the label errors use."""
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None, "response_format"
    if kind == "json_object":
        return {"json_object": True}, "response_format"
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or spec.get("schema") is None:
            raise InvalidInput("response_format", 'response_format: json_schema must be an object with a "schema" '
                                                  '(and optionally "name", "strict")')
        return {"json": spec["schema"]}, "response_format: json_schema.schema"
    raise InvalidInput("response_format", f'response_format: type must be "text", "json_object" or "json_schema", '
                                          f"got {kind!r}")


def _field_of(message: str, sampling: dict) -> str:
    """SamplingParams messages start with the field name (`stop_token_ids[3] must ...`); fall back to
    the JSON input's name."""
    head = message.split(" ", 1)[0].split("[", 1)[0].split(".", 1)[0]
    return head if head in sampling or head in SamplingParams.__dataclass_fields__ else "sampling_parameters"
