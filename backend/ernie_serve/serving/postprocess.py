"""ernie_detokenizer's logic: ernie_moe's responses (engine_response.py) -> client-facing output tensors.

Requests with stop strings are detokenized by the engine (its text holds back and cuts a stop string); the others
arrive as token ids only (RequestMeta.decode_ids) and are detokenized here, incrementally, in this process rather
than on the engine's step thread. Then the chat parser state: reasoning / content / tool-call splitting. Both must
see one request's responses in order. Triton delivers them in order to a model with one instance and no dynamic
batching; the response index checks it.

State lives in this process, keyed by the stream id ernie_moe puts on every response. It is dropped on the final
response, on cancellation, and after `ttl` seconds without a response (a request whose producer died must not
leak).

An error ernie_moe ends a request with arrives in band (the final response's Failure) and is raised here, after the
request's earlier responses; see docs/serving.md.

A cancelled request is answered with empty outputs, not an error: ernie_moe is still streaming it (until the abort
sent here reaches the engine), and in tritonserver 2.51 a failed ensemble step while another is in flight leaks the
ensemble request (docs/serving.md). Nobody reads the answer. Whether a request is cancelled is a round trip to
tritonserver, so it is asked on a stream's first response and then as often as a budget over all streams allows
(CANCEL_CHECKS_PER_SECOND).
"""
from __future__ import annotations

import json
import logging
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from ..chat import finish_reason_for
from ..parsers import ChatOutputParser, DeltaMessage
from ..tokenizer.detokenizer import CONTEXT_IDS, IncrementalDetokenizer
from .control import ProgressReporter, send_abort
from .engine_response import EngineResponse, RequestMeta
from .errors import InBandError, ServingError

log = logging.getLogger(__name__)
OUTPUT_NAMES = ("text_output", "reasoning_content", "tool_calls", "finish_reason", "num_input_tokens",
                "num_output_tokens", "num_cached_tokens", "output_ids", "logprobs", "num_reasoning_tokens",
                "prompt_token_ids", "prompt_logprobs")
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_SP_SPACE = "\u2581"
# is_cancelled() is a round trip to tritonserver: at most CANCEL_CHECKS_PER_SECOND over all streams, each stream at
# least every max(CANCEL_CHECK_SECONDS, streams / CANCEL_CHECKS_PER_SECOND) seconds (one stream: 20 ms, 256: 0.64 s).
CANCEL_CHECK_SECONDS = 0.02
CANCEL_CHECKS_PER_SECOND = 400


class OrderError(ServingError):
    code = "INTERNAL"


@dataclass
class _State:
    meta: RequestMeta
    parser: ChatOutputParser | None
    detok: IncrementalDetokenizer | None = None  # the request's text is decoded here (RequestMeta.decode_ids)
    next_index: int = 1
    last_seen: float = field(default_factory=time.monotonic)
    cancel_checked: float = field(default_factory=time.monotonic)


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
        self._states: dict[int, _State] = {}
        self._aborted: dict[int, float] = {}  # streams already sent an abort, so it is sent once
        self._lock = threading.Lock()
        self._last_sweep = time.monotonic()
        self._progress: ProgressReporter | None = None  # started on the first stream that asks for reports

    @property
    def num_states(self) -> int:
        return len(self._states)

    def process(self, inputs: dict[str, np.ndarray],
                is_cancelled: Callable[[], bool] | bool = False) -> dict[str, np.ndarray]:
        """One ernie_moe response in, one client response out; raises ServingError subclasses.
        `is_cancelled`: whether the client cancelled (a bool, or the round trip that asks, called only when a
        check is due). A cancelled request (or a later response of one) gets empty outputs; see the module
        docstring."""
        resp = EngineResponse.from_tensors(inputs)
        sid = resp.stream_id
        now = time.monotonic()
        with self._lock:
            self._sweep(now)
            if sid in self._aborted and sid not in self._states:
                return self.empty_outputs()
            if resp.index == 0:
                if sid in self._states:
                    raise OrderError(f"stream {sid:016x}: a second first response (index 0)")
                state = self._new_state(resp)
                self._states[sid] = state
            else:
                state = self._states.get(sid)
                if state is None:
                    raise OrderError(f"stream {sid:016x}: response {resp.index} has no state (its first response "
                                     f"was never seen, or it was idle longer than the {self.ttl:.0f}s TTL)")
                if resp.index != state.next_index:
                    self._states.pop(sid, None)
                    raise OrderError(f"stream {sid:016x}: response {resp.index} arrived, expected "
                                     f"{state.next_index}; ernie_detokenizer needs one instance and no dynamic "
                                     "batching")
                state.next_index += 1
            state.last_seen = now
        if self._cancelled(state, is_cancelled, resp.index, now, len(self._states)):
            with self._lock:
                self._cancel(sid, state, now)
            return self.empty_outputs()
        if resp.final:
            with self._lock:
                self._states.pop(sid, None)
            if resp.failure is not None:
                raise InBandError(resp.failure.code, resp.failure.message)
        elif state.meta.progress_reports:
            self._report_progress(state)
        return self._outputs(state, resp)

    @staticmethod
    def _cancelled(state: _State, is_cancelled: Callable[[], bool] | bool, index: int, now: float,
                   n_streams: int) -> bool:
        if not callable(is_cancelled):
            return bool(is_cancelled)
        if index > 0 and now - state.cancel_checked < max(CANCEL_CHECK_SECONDS, n_streams / CANCEL_CHECKS_PER_SECOND):
            return False
        state.cancel_checked = now
        return is_cancelled()

    def _report_progress(self, state: _State) -> None:
        """Tell the engine instance how far this stream got (it paces the stream by it, see stream_pacing.py)."""
        if state.meta.abort_address:
            if self._progress is None:
                self._progress = ProgressReporter()
            self._progress.note(state.meta.abort_address, state.meta.key, state.next_index)

    def _cancel(self, sid: int, state: _State, now: float) -> None:  # under self._lock
        self._states.pop(sid, None)
        if sid not in self._aborted:
            send_abort(state.meta.abort_address, state.meta.key)
            self._aborted[sid] = now

    @staticmethod
    def empty_outputs() -> dict[str, np.ndarray]:
        ints = ("num_input_tokens", "num_output_tokens", "num_cached_tokens", "num_reasoning_tokens")
        lists = ("output_ids", "prompt_token_ids")
        return {name: _out_int(0) if name in ints else _ids_out([]) if name in lists else _out_str("")
                for name in OUTPUT_NAMES}

    def _new_state(self, resp: EngineResponse) -> _State:
        meta = resp.meta or RequestMeta()
        prompt_ids = resp.prompt_ids or []
        parser = None
        if meta.reasoning_parser or (meta.tool_call_parser and meta.tools):
            parser = ChatOutputParser(self.tokenizer, meta.reasoning_parser, meta.tool_call_parser, prompt_ids,
                                      meta.tools, meta.enable_thinking)
        detok = None
        if meta.decode_ids:
            detok = IncrementalDetokenizer(self.tokenizer, prompt_ids=prompt_ids[-CONTEXT_IDS:],
                                           skip_special_tokens=meta.skip_special_tokens)
        return _State(meta, parser, detok)

    def _outputs(self, state: _State, resp: EngineResponse) -> dict:
        token_ids = resp.token_ids
        if state.detok is not None:
            text = state.detok.step(token_ids)
            if resp.final:
                text += state.detok.flush()
        else:
            text = resp.text
        reasoning, content, calls = "", text, []
        if state.parser is not None:
            delta = state.parser.feed(text, token_ids, final=resp.final) or DeltaMessage()
            reasoning, content = delta.reasoning_content or "", delta.content or ""
            calls = [c.to_dict() for c in delta.tool_calls]
        finish = ""
        if resp.final:
            finish = finish_reason_for(resp.num_output_tokens, state.meta.max_tokens, resp.finish_reason or "",
                                       bool(state.parser is not None and state.parser.finish().tools_called)) or ""
        if state.meta.echo and resp.final and resp.index == 0:  # non-streaming: the only response
            content = state.meta.echo + content
        return {
            "text_output": _out_str(content),
            "reasoning_content": _out_str(reasoning),
            "tool_calls": _out_str(json.dumps(calls, ensure_ascii=False) if calls else ""),
            "finish_reason": _out_str(finish),
            "num_input_tokens": _out_int(resp.num_input_tokens),
            "num_output_tokens": _out_int(resp.num_output_tokens),
            "num_cached_tokens": _out_int(resp.num_cached_tokens),
            "output_ids": _ids_out(token_ids),
            "logprobs": _out_str(self._logprobs(resp.logprobs)),
            # cumulative, as num_output_tokens is; 0 without a reasoning parser
            "num_reasoning_tokens": _out_int(state.parser.num_reasoning_tokens if state.parser is not None else 0),
            # ernie_moe sends the prompt on the first response only (so does this output)
            "prompt_token_ids": _ids_out(resp.prompt_ids or []),
            # ernie_moe's, on the first response of a request that asked for them
            "prompt_logprobs": _out_str(self._logprobs(resp.prompt_logprobs)),
        }

    def _logprobs(self, entries: list[dict] | None) -> str:
        """ernie_moe's logprob entries with their token texts ("" where the request asked for none)."""
        if entries is None:
            return ""
        return json.dumps(self.token_texts.fill(entries), ensure_ascii=False, separators=(",", ":"))

    def _sweep(self, now: float) -> None:
        if now - self._last_sweep < min(10.0, self.ttl):
            return
        self._last_sweep = now
        for sid in [k for k, s in self._states.items() if now - s.last_seen > self.ttl]:
            log.warning("dropping detokenizer state of stream %016x: no response for %.0fs", sid, self.ttl)
            del self._states[sid]
        for sid in [k for k, t in self._aborted.items() if now - t > self.ttl]:
            del self._aborted[sid]
