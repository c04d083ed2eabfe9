"""The typed contract between ernie_moe and the stage after it (ernie_detokenizer, or ernie_bls's own postprocessor).

One engine response is three tensors, none of them TYPE_STRING (a string tensor is serialized by a Python loop on
each side of the stub's IPC and copied once more by tritonserver; a numeric tensor is one memcpy):

    engine_header  INT64 [HEADER_SIZE]  the stream id, the response index, the token counts, the flags
    token_ids      INT32 [n]            this response's new tokens
    engine_extras  UINT8 [m]            a JSON object, and empty (m = 0) on most responses: the request's meta and
                                        prompt on the first one, the finish or the error on the last, logprobs and the
                                        engine's text where the request asked for them

The stage after keys its per-request state by the stream id, which is unique over engine instances (63 random
bits), and takes everything else it needs once, from the first response's RequestMeta.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from typing import Any

import numpy as np

from .errors import InvalidInput

HEADER = ("stream_id", "response_index", "num_input_tokens", "num_output_tokens", "num_cached_tokens", "flags")
HEADER_SIZE = len(HEADER)
FINAL = 1  # flags: the request's last response
OUTPUT_NAMES = ("engine_header", "token_ids", "engine_extras")
_NO_EXTRAS = np.zeros((1, 0), dtype=np.uint8)


@dataclass
class RequestMeta:
    """What the stage after ernie_moe needs to know about a request, written by ernie_tokenizer (or a direct
    caller's request_json "meta") and completed by ernie_moe."""

    stream: bool = False
    is_chat: bool = False
    echo: str | None = None  # a non-streaming text request's prompt, put before its output
    reasoning_parser: str | None = None
    tool_call_parser: str | None = None
    tools: list | None = None
    enable_thinking: bool | None = None
    max_tokens: int | None = None
    skip_special_tokens: bool = True
    logprobs: int | None = None
    errors_in_band: bool = False  # end with a final response carrying the error (engine_model.py says why)
    progress_reports: bool = False  # report this stream's progress to ernie_moe, which paces it by them
    # The stage after ernie_moe (ernie_detokenizer, ernie_bls) relays a streaming client's cancellation over the
    # abort channel, so ernie_moe stops asking is_cancelled() once the stream's first token is out
    cancel_relayed: bool = False
    # set by ernie_moe:
    key: str = ""  # the engine's request key: aborts and progress reports name it
    abort_address: str = ""  # ernie_moe's control socket
    decode_ids: bool = False  # decode token_ids here (else the engine's text comes in the extras)

    @classmethod
    def from_dict(cls, raw: Any) -> RequestMeta:
        """A request_json "meta" object; a field it does not know is refused, naming it."""
        if raw is None:
            return cls()
        if not isinstance(raw, dict):
            raise InvalidInput("request_json", "meta must be an object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise InvalidInput("request_json", f"meta has unknown field(s) {unknown}; known: {sorted(known)}")
        return cls(**raw)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Failure:
    """How a request ended in error: a Triton error code name (errors.error_code) and the message."""

    code: str
    message: str


@dataclass
class EngineResponse:
    stream_id: int
    index: int
    token_ids: list[int]
    num_input_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    final: bool = False
    finish_reason: str | None = None  # the engine's, on a final response that is not a failure
    failure: Failure | None = None  # on a final response
    text: str = ""  # the engine's own text (requests with stop strings); else decode token_ids
    meta: RequestMeta | None = None  # first response only
    prompt_ids: list[int] | None = None  # first response only
    logprobs: list[dict] | None = None  # one entry per token, where the request asked for them
    prompt_logprobs: list[dict] | None = None  # first response only, where the request asked for them

    def to_tensors(self) -> dict[str, np.ndarray]:
        header = np.array([[self.stream_id, self.index, self.num_input_tokens, self.num_output_tokens,
                            self.num_cached_tokens, FINAL if self.final else 0]], dtype=np.int64)
        return {"engine_header": header,
                "token_ids": np.array(self.token_ids, dtype=np.int32).reshape(1, -1),
                "engine_extras": self._extras()}

    def _extras(self) -> np.ndarray:
        extras: dict[str, Any] = {}
        if self.meta is not None:
            extras["meta"] = self.meta.to_dict()
        if self.prompt_ids is not None:
            extras["prompt_ids"] = self.prompt_ids
        if self.text:
            extras["text"] = self.text
        if self.logprobs is not None:
            extras["logprobs"] = self.logprobs
        if self.prompt_logprobs is not None:
            extras["prompt_logprobs"] = self.prompt_logprobs
        if self.finish_reason is not None:
            extras["finish_reason"] = self.finish_reason
        if self.failure is not None:
            extras["error"] = {"code": self.failure.code, "message": self.failure.message}
        if not extras:
            return _NO_EXTRAS
        blob = json.dumps(extras, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
        return np.frombuffer(blob, dtype=np.uint8).reshape(1, -1)

    @classmethod
    def from_tensors(cls, inputs: dict[str, np.ndarray]) -> EngineResponse:
        """An ernie_moe response as the stage after it receives it; a malformed one is refused, naming the tensor."""
        if "engine_header" not in inputs:
            raise InvalidInput("engine_header", "missing: this stage consumes ernie_moe's outputs")
        header = np.asarray(inputs["engine_header"]).reshape(-1)
        if header.size != HEADER_SIZE:
            raise InvalidInput("engine_header", f"has {header.size} values, expected {HEADER_SIZE} {HEADER}")
        stream_id, index, n_in, n_out, n_cached, flags = (int(v) for v in header)
        ids = inputs.get("token_ids")
        token_ids = [] if ids is None else np.asarray(ids).reshape(-1).tolist()
        resp = cls(stream_id, index, token_ids, n_in, n_out, n_cached, final=bool(flags & FINAL))
        raw = inputs.get("engine_extras")
        if raw is not None and np.asarray(raw).size:
            try:
                extras = json.loads(np.asarray(raw, dtype=np.uint8).tobytes())
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise InvalidInput("engine_extras", f"is not a JSON object ({e})") from None
            if not isinstance(extras, dict):
                raise InvalidInput("engine_extras", "is not a JSON object")
            resp._take_extras(extras)
        return resp

    def _take_extras(self, extras: dict[str, Any]) -> None:
        if "meta" in extras:
            self.meta = RequestMeta.from_dict(extras["meta"])
        self.prompt_ids = extras.get("prompt_ids")
        self.text = extras.get("text") or ""
        self.logprobs = extras.get("logprobs")
        self.prompt_logprobs = extras.get("prompt_logprobs")
        self.finish_reason = extras.get("finish_reason")
        error = extras.get("error")
        if isinstance(error, dict):
            self.failure = Failure(str(error.get("code") or "INTERNAL"), str(error.get("message") or ""))
