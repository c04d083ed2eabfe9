"""One request's response stream on ernie_moe's response side: the tokens it holds and how they become responses.

Owned by the response loop's thread (response_loop.py), except `ending`, which an abort sets from any thread
before it tells the engine. The engine's outputs are deltas (RequestOutputKind.DELTA); a stream accumulates them
until its pacing policy lets a response go, and every response carries every token held since the previous one.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from ..outputs import RequestOutput
from .engine_response import EngineResponse, Failure, RequestMeta
from .stream_pacing import StreamClock


class ResponseSink(Protocol):
    """What a model.py wraps a Triton response sender in."""

    def send(self, outputs: dict[str, np.ndarray], final: bool) -> None: ...
    def send_error(self, code: str, message: str) -> None: ...  # always the FINAL response
    def send_final(self) -> None: ...  # a FINAL with no response
    def is_cancelled(self) -> bool: ...


@dataclass(frozen=True)
class Ending:
    """How a request the engine aborted is answered: an error FINAL, or a bare FINAL (code None)."""

    code: str | None
    message: str = ""


@dataclass
class ResponseStream:
    key: str
    stream_id: int
    sink: ResponseSink
    stream: bool  # a streaming request (else one response, at its end)
    meta: RequestMeta
    prompt_ids: list[int]
    num_logprobs: int | None = None  # SamplingParams.logprobs: None = no logprobs
    num_prompt_logprobs: int | None = None  # SamplingParams.prompt_logprobs: None = none
    ending: Ending | None = None  # set (once) when the request is aborted, from any thread
    clock: StreamClock = field(default_factory=StreamClock)
    closed: bool = False  # its FINAL has been handed to a sender
    in_flight: bool = False  # a response of it is with its sender: new tokens wait, and coalesce, behind it
    timer_due: float | None = None  # when the response loop's timer for it fires (one at most)
    hold_counted: bool = False  # this wait for the detokenizer is counted in the held-responses metric
    num_output_tokens: int = 0
    token_ids: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    logprobs: list[dict] = field(default_factory=list)
    prompt_logprobs: list[dict] | None = None
    last_output: RequestOutput | None = None

    def take(self, out: RequestOutput, now: float) -> None:
        """Hold one engine output's new tokens (and its logprobs) until a response carries them."""
        comp = out.outputs[0]
        delta = comp.token_ids_delta
        if delta:
            if not self.clock.pending_tokens:
                self.clock.pending_since = now
            self.clock.pending_tokens += len(delta)
            self.token_ids.extend(delta)
            self.num_output_tokens += len(delta)
        if comp.text_delta:
            self.text.append(comp.text_delta)
        if self.num_logprobs is not None and comp.logprobs:
            self.logprobs += [logprob_entry(t, c, self.num_logprobs) for t, c in zip(comp.token_ids, comp.logprobs)]
        if out.prompt_logprobs is not None and self.num_prompt_logprobs is not None:
            self.prompt_logprobs = prompt_logprob_entries(out, self.num_prompt_logprobs)
        if out.finished:
            self.clock.final = True
            if not self.clock.pending_tokens:
                self.clock.pending_since = now
        self.last_output = out

    def response(self, now: float, failure: Failure | None = None, final: bool | None = None) -> EngineResponse:
        """The held tokens as the stream's next response (they are no longer held)."""
        out = self.last_output
        first = self.clock.sent == 0
        final = self.clock.final if final is None else final
        comp = out.outputs[0] if out is not None else None
        resp = EngineResponse(
            self.stream_id, self.clock.sent, self.token_ids,
            num_input_tokens=len(self.prompt_ids), num_output_tokens=self.num_output_tokens,
            num_cached_tokens=out.num_cached_tokens if out is not None else 0, final=final,
            finish_reason=(comp.finish_reason or "") if final and failure is None and comp is not None else None,
            failure=failure, text="".join(self.text),
            meta=self.meta if first else None, prompt_ids=self.prompt_ids if first else None,
            logprobs=self.logprobs if self.num_logprobs is not None else None,
            prompt_logprobs=self.prompt_logprobs if first else None)
        self.token_ids, self.text, self.logprobs = [], [], []
        self.clock.sent += 1
        self.clock.pending_tokens = 0
        self.clock.last_sent_at = now
        self.hold_counted = False
        self.closed = final
        return resp


def _finite(x: float) -> float:
    return x if math.isfinite(x) else -9999.0  # JSON has no -inf


def logprob_entry(tid: int, cands: dict, k: int) -> dict:
    """One token's logprobs entry: its logprob and rank, and its k most likely alternatives (ids only; the
    detokenizer adds the token texts)."""
    sampled = cands.get(tid)
    top = sorted(cands.items(), key=lambda kv: -kv[1].logprob)[:k]
    return {"token_id": int(tid), "logprob": _finite(sampled.logprob) if sampled else -9999.0,
            "rank": sampled.rank if sampled else None,
            "top_logprobs": [{"token_id": int(t), "logprob": _finite(lp.logprob)} for t, lp in top]}


def prompt_logprob_entries(out: RequestOutput, k: int) -> list[dict]:
    """RequestOutput.prompt_logprobs as entries: one per prompt token, the first with a null logprob (nothing
    predicts it)."""
    first = {"token_id": int(out.prompt_token_ids[0]), "logprob": None, "rank": None, "top_logprobs": []}
    return [first] + [logprob_entry(tid, cands, k)
                      for tid, cands in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:])]
