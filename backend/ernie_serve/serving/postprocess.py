"""ernie_detokenizer's logic: ernie_moe's per-step responses -> client-facing output tensors.

Requests with stop strings are detokenized by the engine (its text deltas hold back and cut a stop string);
the others arrive as token ids only (request_meta's "decode_ids") and are detokenized here, incrementally, in
this process rather than on the engine's step thread. Then the chat parser state: reasoning / content /
tool-call splitting. Both must see one request's responses in order. Triton delivers them in order to a model
with one instance and no dynamic batching; response_index checks it.

State lives in this process, keyed by the request key that ernie_moe puts on every response. It is
dropped on the final response, on cancellation, and after `ttl` seconds without a response (a
request whose producer died must not leak).

An error ernie_moe ends a request with arrives in band (engine_finish_reason "error:<CODE>:<message>")
and is raised here, after the request's earlier responses; see engine_model.py.

A cancelled request is answered with empty outputs, not an error: ernie_moe is still streaming it
(until the abort sent here reaches the engine), and in tritonserver 2.51 a failed ensemble step
while another is in flight leaks the ensemble request (see engine_model.py). Nobody reads the answer.
"""
from __future__ import annotations

import json
import logging
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..chat import finish_reason_for
from ..parsers import ChatOutputParser, DeltaMessage
from ..tokenizer.detokenizer import CONTEXT_IDS, IncrementalDetokenizer
from .control import ProgressReporter, send_abort
from .errors import InvalidInput, ServingError, raise_in_band_error

log = logging.getLogger(__name__)
OUTPUT_NAMES = ("text_output", "reasoning_content", "tool_calls", "finish_reason", "num_input_tokens",
                "num_output_tokens", "num_cached_tokens", "output_ids", "logprobs", "num_reasoning_tokens",
                "prompt_token_ids", "prompt_logprobs")
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_SP_SPACE = "\u2581"


class OrderError(ServingError):
    code = "INTERNAL"


@dataclass
class _State:
    meta: dict[str, Any]
    parser: ChatOutputParser | None
    detok: IncrementalDetokenizer | None = None  # the request's text is decoded here (meta "decode_ids")
    next_index: int = 1
    last_seen: float = field(default_factory=time.monotonic)


def _str(inputs: dict[str, np.ndarray], name: str, default: str = "") -> str:
    arr = inputs.get(name)
    if arr is None:
        return default
    v = np.asarray(arr).reshape(-1)
    if v.size == 0:
        return default
    v = v[0]
    return v.decode("utf-8") if isinstance(v, bytes) else str(v)


def _int(inputs: dict[str, np.ndarray], name: str, default: int = 0) -> int:
    arr = inputs.get(name)
    if arr is None or np.asarray(arr).size == 0:
        return default
    return int(np.asarray(arr).reshape(-1)[0])


def _ids(inputs: dict[str, np.ndarray], name: str) -> list[int]:
    arr = inputs.get(name)
    return [] if arr is None else np.asarray(arr).reshape(-1).astype(np.int64).tolist()


def _out_str(value: str) -> np.ndarray:
    return np.array([[value.encode("utf-8")]], dtype=np.object_)


def _out_int(value: int) -> np.ndarray:
    return np.array([[value]], dtype=np.int32)


def _ids_out(ids: list[int]) -> np.ndarray:
    return np.array([ids], dtype=np.int32).reshape(1, len(ids))


class TokenTexts:
    """Token id -> (text, UTF-8 bytes) for logprobs, cached.

    From the piece, not from decode([id]): SentencePiece drops a lone token's leading space, but in the
    middle of a text "▁the" is " the", which is what the streamed text has. A byte-fallback piece is its
    one byte (a fragment of a UTF-8 character, shown backslash-escaped; `bytes` is exact).
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        hit = self._cache.get(token_id)
        if hit is None:
            try:
                piece = self.tokenizer.id_to_token(token_id)
            except (ValueError, IndexError):
                piece = None
            if piece is None:
                hit = (f"token_id:{token_id}", [])
            elif (m := _BYTE_PIECE.fullmatch(piece)) is not None:
                raw = bytes([int(m.group(1), 16)])
                hit = (raw.decode("utf-8", "backslashreplace"), list(raw))
            else:
                text = piece.replace(_SP_SPACE, " ")
                hit = (text, list(text.encode("utf-8")))
            if len(self._cache) < 200_000:
                self._cache[token_id] = hit
        return hit

    def fill(self, entries: list[dict]) -> list[dict]:
        """ernie_moe's logprob entries (ids only) with "token" and "bytes" added, alternatives too."""
        for e in entries:
            e["token"], e["bytes"] = self(int(e["token_id"]))
            for t in e.get("top_logprobs") or []:
                t["token"], t["bytes"] = self(int(t["token_id"]))
        return entries


class Postprocessor:
    def __init__(self, tokenizer, ttl: float = 600.0):
        self.tokenizer = tokenizer
        self.token_texts = TokenTexts(tokenizer)
        self.ttl = ttl
        self._states: dict[str, _State] = {}
        self._aborted: dict[str, float] = {}  # keys already sent an abort, so it is sent once
        self._lock = threading.Lock()
        self._last_sweep = time.monotonic()
        self._progress: ProgressReporter | None = None  # started on the first stream that asks for reports

    @property
    def num_states(self) -> int:
        return len(self._states)

    def process(self, inputs: dict[str, np.ndarray], cancelled: bool = False) -> dict[str, np.ndarray]:
        """One ernie_moe response in, one client response out; raises ServingError subclasses.
        A cancelled request (or a later response of one) gets empty outputs; see the module docstring."""
        key = _str(inputs, "request_key")
        if not key:
            raise InvalidInput("request_key", "missing: ernie_detokenizer consumes ernie_moe's outputs")
        index = _int(inputs, "response_index", -1)
        now = time.monotonic()
        with self._lock:
            self._sweep(now)
            if cancelled or (key in self._aborted and key not in self._states):
                self._cancel(key, inputs, now)
                return self.empty_outputs()
            if index == 0:
                if key in self._states:
                    raise OrderError(f"request {key}: a second first response (response_index 0)")
                state = self._new_state(inputs)
                self._states[key] = state
            else:
                state = self._states.get(key)
                if state is None:
                    raise OrderError(f"request {key}: response {index} has no state (its first response was "
                                     f"never seen, or it was idle longer than the {self.ttl:.0f}s TTL)")
                if index != state.next_index:
                    self._states.pop(key, None)
                    raise OrderError(f"request {key}: response {index} arrived, expected {state.next_index}; "
                                     "ernie_detokenizer needs one instance and no dynamic batching")
                state.next_index += 1
            state.last_seen = now
            engine_reason = _str(inputs, "engine_finish_reason") or None
            if engine_reason is not None:
                self._states.pop(key, None)
                raise_in_band_error(engine_reason)
            elif state.meta.get("progress_reports") is True:
                self._report_progress(state, key)
        return self._outputs(state, inputs, engine_reason)

    def _report_progress(self, state: _State, key: str) -> None:
        """Tell the engine instance how far this stream got (it paces the stream by it, see engine_model.py)."""
        address = state.meta.get("abort_address")
        if isinstance(address, str) and address:
            if self._progress is None:
                self._progress = ProgressReporter()
            self._progress.note(address, key, state.next_index)

    def _cancel(self, key: str, inputs: dict[str, np.ndarray], now: float) -> None:
        state = self._states.pop(key, None)
        if key not in self._aborted:
            meta = state.meta if state is not None else self._meta(inputs)
            send_abort(meta.get("abort_address", ""), key)
            self._aborted[key] = now

    @staticmethod
    def empty_outputs() -> dict[str, np.ndarray]:
        ints = ("num_input_tokens", "num_output_tokens", "num_cached_tokens", "num_reasoning_tokens")
        lists = ("output_ids", "prompt_token_ids")
        return {name: _out_int(0) if name in ints else _ids_out([]) if name in lists else _out_str("")
                for name in OUTPUT_NAMES}

    @staticmethod
    def _meta(inputs: dict[str, np.ndarray]) -> dict[str, Any]:
        raw = _str(inputs, "request_meta")
        try:
            meta = json.loads(raw) if raw else {}
        except json.JSONDecodeError:
            raise InvalidInput("request_meta", "is not valid JSON") from None
        return meta if isinstance(meta, dict) else {}

    def _new_state(self, inputs: dict[str, np.ndarray]) -> _State:
        meta = self._meta(inputs)
        parser = None
        if meta.get("reasoning_parser") or (meta.get("tool_call_parser") and meta.get("tools")):
            parser = ChatOutputParser(self.tokenizer, meta.get("reasoning_parser"), meta.get("tool_call_parser"),
                                      _ids(inputs, "prompt_ids"), meta.get("tools"), meta.get("enable_thinking"))
        decode = meta.get("decode_ids")
        detok = None
        if isinstance(decode, dict):
            detok = IncrementalDetokenizer(self.tokenizer, prompt_ids=_ids(inputs, "prompt_ids")[-CONTEXT_IDS:],
                                           skip_special_tokens=bool(decode.get("skip_special_tokens", True)))
        return _State(meta, parser, detok)

    def _outputs(self, state: _State, inputs: dict[str, np.ndarray], engine_reason: str | None) -> dict:
        token_ids = _ids(inputs, "token_ids")
        if state.detok is not None:
            text = state.detok.step(token_ids)
            if engine_reason is not None:
                text += state.detok.flush()
        else:
            text = _str(inputs, "text_delta")
        reasoning, content, calls = "", text, []
        if state.parser is not None:
            delta = state.parser.feed(text, token_ids, final=engine_reason is not None) or DeltaMessage()
            reasoning, content = delta.reasoning_content or "", delta.content or ""
            calls = [c.to_dict() for c in delta.tool_calls]
        num_output = _int(inputs, "num_output_tokens")
        finish = ""
        if engine_reason is not None:
            finish = finish_reason_for(num_output, state.meta.get("max_tokens"), engine_reason,
                                       bool(state.parser is not None and state.parser.finish().tools_called)) or ""
        echo = state.meta.get("echo")
        if echo and engine_reason is not None and state.next_index == 1:  # non-streaming: the only response
            content = echo + content
        return {
            "text_output": _out_str(content),
            "reasoning_content": _out_str(reasoning),
            "tool_calls": _out_str(json.dumps(calls, ensure_ascii=False) if calls else ""),
            "finish_reason": _out_str(finish),
            "num_input_tokens": _out_int(_int(inputs, "num_input_tokens")),
            "num_output_tokens": _out_int(num_output),
            "num_cached_tokens": _out_int(_int(inputs, "num_cached_tokens")),
            "output_ids": np.array([token_ids], dtype=np.int32).reshape(1, len(token_ids)),
            "logprobs": _out_str(self._logprobs(inputs, "logprobs")),
            # cumulative, as num_output_tokens is; 0 without a reasoning parser
            "num_reasoning_tokens": _out_int(state.parser.num_reasoning_tokens if state.parser is not None else 0),
            # ernie_moe sends the prompt on the first response only (so does this output)
            "prompt_token_ids": _ids_out(_ids(inputs, "prompt_ids")),
            # ernie_moe's, on the first response of a request that asked for them
            "prompt_logprobs": _out_str(self._logprobs(inputs, "prompt_logprobs")),
        }

    def _logprobs(self, inputs: dict[str, np.ndarray], name: str) -> str:
        """ernie_moe's `logprobs` or `prompt_logprobs` entries with their token texts."""
        raw = _str(inputs, name)
        if not raw:
            return ""
        try:
            entries = json.loads(raw)
        except json.JSONDecodeError:
            raise InvalidInput(name, "is not valid JSON") from None
        return json.dumps(self.token_texts.fill(entries), ensure_ascii=False, separators=(",", ":"))

    def _sweep(self, now: float) -> None:
        if now - self._last_sweep < min(10.0, self.ttl):
            return
        self._last_sweep = now
        for key in [k for k, s in self._states.items() if now - s.last_seen > self.ttl]:
            log.warning("dropping detokenizer state of %s: no response for %.0fs", key, self.ttl)
            del self._states[key]
        for key in [k for k, t in self._aborted.items() if now - t > self.ttl]:
            del self._aborted[key]
