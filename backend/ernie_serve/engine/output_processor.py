"""Outputs: a step's RequestUpdates in, RequestOutputs out (vLLM v1's output processor). OutputProcessor owns the
requests callers know by id (a request's n sequences as one group) and each sequence's TextState, and assembles each
output as the request's output_kind asks; a stop string it finds in the text ends the request through the scheduler,
which owns every request's state.

TextState is one sequence's text: incremental detokenization and stop strings.

Stop strings are matched on text, so the engine must detokenize to stop on time. Text that could
still become the start of a stop string is held back from the stream until it is decided, so a
client never receives half of a stop string (and with include_stop_str_in_output, receives it whole).
A request whose outputs are final-only and that has no stop string needs no text before it ends: it is
decoded once, when it finishes (`deferred`).
"""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from ..outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput, RequestOutputKind
from ..tokenizer import IncrementalDetokenizer
from .request import Request, RequestStatus
from .step_plan import RequestUpdate

if TYPE_CHECKING:
    from .input_processor import RequestGroup
    from .scheduler import Scheduler

log = logging.getLogger(__name__)
_NO_DELTA: tuple[list[int], str] = ([], "")


class TextState:
    def __init__(self, tokenizer, req: Request):
        p = req.sampling_params
        self.stops = p.stop
        self.include_stop = p.include_stop_str_in_output
        self.detok = None if tokenizer is None or not p.detokenize else IncrementalDetokenizer(
            tokenizer, prompt_ids=req.prompt_token_ids[-8:], skip_special_tokens=p.skip_special_tokens)
        self._text: list[str] = []  # decided text, as returned to the user, in pieces (joined when read)
        self._pending = ""  # decoded but possibly the start of a stop string
        self._hold = max((len(s) for s in self.stops), default=1) - 1
        self._logprobs: list[dict[int, Logprob]] = []  # the request's logprobs as outputs carry them
        self._cumulative = 0.0
        self._prompt_logprobs: list[dict[int, Logprob] | None] | None = None  # converted once, when complete
        self.deferred = self.detok is not None and not self.stops and p.output_kind is RequestOutputKind.FINAL_ONLY

    @property
    def text(self) -> str:
        """The decided text so far (a streamed request's state would otherwise copy it whole every step)."""
        if len(self._text) > 1:
            self._text = ["".join(self._text)]
        return self._text[0] if self._text else ""

    def new_logprobs(self, req: Request) -> list[dict[int, Logprob]]:
        """The logprobs added since the last call, converted (a streamed request would otherwise convert its
        whole history every step); logprobs_so_far() has them all and their sum."""
        start = len(self._logprobs)
        for k in range(start, len(req.logprobs)):
            d = req.logprobs[k]
            self._logprobs.append({t: Logprob(v, r) for t, (v, r) in d.items()})
            tok = req.output_token_ids[k]
            if tok in d:
                self._cumulative += d[tok][0]
        return self._logprobs[start:]

    def prompt_logprobs(self, req: Request, delta: bool) -> list[dict[int, Logprob] | None] | None:
        """RequestOutput.prompt_logprobs once all are computed (None before; a delta stream gets them once)."""
        if self._prompt_logprobs is None:
            if req.prompt_logprobs is None or req.needs_prompt_logprobs:
                return None
            self._prompt_logprobs = [None] + [{t: Logprob(v, r) for t, (v, r) in d.items()}
                                              for d in req.prompt_logprobs]
            return self._prompt_logprobs
        return None if delta else self._prompt_logprobs

    def logprobs_so_far(self, req: Request) -> tuple[list[dict[int, Logprob]], float]:
        """Every output token's logprobs and their sum."""
        self.new_logprobs(req)
        return list(self._logprobs), self._cumulative

    @property
    def cumulative_logprob(self) -> float:
        return self._cumulative

    def finish_deferred(self, req: Request) -> str:
        """A deferred request's whole text, decoded once now that it has finished ("" if not deferred)."""
        if not self.deferred:
            return ""
        self.deferred = False
        return self.append(req.output_token_ids, final=True)[0]

    def append(self, token_ids: list[int], final: bool, check_stops: bool = True) -> tuple[str, str | None]:
        """Feed new tokens; returns (new decided text, matched stop string or None)."""
        if self.detok is None:  # skip_tokenizer_init: ids only
            return "", None
        if not self.stops:  # nothing is ever held back
            delta = self.detok.step(token_ids)
            if final:
                delta += self.detok.flush()
            if delta:
                self._text.append(delta)
            return delta, None
        self._pending += self.detok.step(token_ids)
        if final:
            self._pending += self.detok.flush()
        if self.stops and check_stops:
            hit = self._find_stop()
            if hit is not None:
                stop, at = hit
                end = at + (len(stop) if self.include_stop else 0)
                delta = self._pending[:end]
                self._text.append(delta)
                self._pending = ""
                return delta, stop
        cut = len(self._pending) if final or not self.stops else self._safe_cut()
        delta, self._pending = self._pending[:cut], self._pending[cut:]
        if delta:
            self._text.append(delta)
        return delta, None

    def _find_stop(self) -> tuple[str, int] | None:
        # Search the held tail plus new text; the earliest stop wins.
        best = None
        for s in self.stops:
            at = self._pending.find(s)
            if at >= 0 and (best is None or at < best[1]):
                best = (s, at)
        return best

    def _safe_cut(self) -> int:
        """Emit everything except a suffix that is a prefix of some stop string."""
        text = self._pending
        for k in range(min(self._hold, len(text)), 0, -1):
            tail = text[-k:]
            if any(s.startswith(tail) for s in self.stops):
                return len(text) - k
        return len(text)


class OutputProcessor:
    def __init__(self, scheduler: "Scheduler"):
        self.scheduler = scheduler
        self.requests: dict[str, list[Request]] = {}  # external id -> its n sequences, until its final output
        self.texts: dict[str, TextState] = {}  # sequence id -> its text
        self.num_generation_tokens = 0

    def add(self, group: "RequestGroup") -> None:
        if group.request_id in self.requests:
            raise ValueError(f"request_id {group.request_id!r} is already in use")
        self.requests[group.request_id] = group.requests
        for req, text in zip(group.requests, group.texts):
            self.texts[req.request_id] = text

    def aborted(self, request_id: str) -> RequestOutput | None:
        """The final output of a request the scheduler has just ended (None: unknown id)."""
        group = self.requests.get(request_id)
        if group is None:
            return None
        deltas = {r.request_id: ([], self.texts[r.request_id].finish_deferred(r)) for r in group}
        return self.group_output(request_id, group, deltas)

    def process(self, updates: list[RequestUpdate]) -> list[RequestOutput]:
        """New text (stop strings are matched here, on text) and one RequestOutput per changed request (for a
        final-only request, only once it has finished).

        A failure while handling one request's output (its detokenizer, say) fails that request alone.
        """
        outputs: list[RequestOutput] = []
        groups: dict[str, dict[str, tuple[list[int], str]]] = {}  # n > 1: their sequences' deltas, by parent
        for u in updates:
            req, new_ids = u.request, u.new_token_ids
            self.num_generation_tokens += len(new_ids)
            state = self.texts[req.request_id]
            text = ""
            try:
                if state.detok is None:  # token ids only (skip_tokenizer_init, detokenize=False)
                    pass
                elif not state.deferred:
                    text, stop = state.append(new_ids, final=req.is_finished,
                                              check_stops=req.num_output_tokens >= req.sampling_params.min_tokens)
                    if stop is not None:
                        self.scheduler.finish(req, RequestStatus.FINISHED_STOPPED, stop)
                elif req.is_finished:
                    text = state.finish_deferred(req)
            except Exception as e:  # noqa: BLE001 - pinned on this request: it fails, the engine goes on
                log.exception("output processing failed for request %s", req.request_id)
                self.scheduler.fail(req, f"output processing failed: {type(e).__name__}: {e}")
            if req.parent_id is None:
                out = self._single_output(req, state, new_ids, text)
                if out is not None:
                    outputs.append(out)
            else:
                groups.setdefault(req.parent_id, {})[req.request_id] = (new_ids, text)
        for ext_id, deltas in groups.items():
            group = self.requests[ext_id]
            if any(r.status is RequestStatus.FINISHED_ERROR for r in group):  # n > 1: one failed, all end
                for r in group:
                    if not r.is_finished:
                        self.scheduler.finish(r, RequestStatus.FINISHED_ABORTED)
            out = self.group_output(ext_id, group, deltas)
            if out is not None:
                outputs.append(out)
        return outputs

    def group_output(self, ext_id: str, group: list[Request], deltas: dict) -> RequestOutput | None:
        """An n > 1 group's output as its output_kind asks (None: a final-only request still running)."""
        leader = group[0]
        finished = all(r.is_finished for r in group)
        kind = leader.sampling_params.output_kind
        if kind is RequestOutputKind.FINAL_ONLY and not finished:
            return None
        comps = [self._completion(r, self.texts[r.request_id], *deltas.get(r.request_id, _NO_DELTA),
                                  kind is RequestOutputKind.DELTA) for r in group]
        error = next((r.error for r in group if r.error is not None), None)
        return self._request_output(ext_id, group, comps, finished, kind, error)

    def _single_output(self, req: Request, state: TextState, new_ids: list[int], text: str) -> RequestOutput | None:
        """group_output for the usual request, which is alone in its group (the per-step path: no group dict)."""
        finished = req.is_finished
        kind = req.sampling_params.output_kind
        if kind is RequestOutputKind.FINAL_ONLY and not finished:
            return None
        comps = [self._completion(req, state, new_ids, text, kind is RequestOutputKind.DELTA)]
        return self._request_output(req.request_id, [req], comps, finished, kind, req.error)

    @staticmethod
    def _completion(req: Request, state: TextState, new_ids: list[int], new_text: str,
                    delta: bool) -> CompletionOutput:
        logprobs = cumulative = None
        if req.sampling_params.logprobs is not None:
            if delta:
                logprobs, cumulative = state.new_logprobs(req), state.cumulative_logprob
            else:
                logprobs, cumulative = state.logprobs_so_far(req)
        if delta:  # the step's own new-id list (built fresh each step), not a copy of every id so far
            text, ids = new_text, new_ids or []
            new_ids = ids
        else:
            text, ids, new_ids = state.text, list(req.output_token_ids), list(new_ids)
        return CompletionOutput(req.index, text, ids, req.finish_reason, req.stop_reason, logprobs, cumulative,
                                new_text, new_ids)

    def _request_output(self, ext_id: str, group: list[Request], comps: list[CompletionOutput], finished: bool,
                        kind: RequestOutputKind, error: str | None) -> RequestOutput:
        leader = group[0]
        metrics = None
        if finished or kind is not RequestOutputKind.DELTA:  # a delta stream's consumers read them at the end
            metrics = RequestMetrics(leader.arrival_time, leader.first_scheduled_time, leader.first_token_time,
                                     time.monotonic() if finished else None, sum(r.num_preemptions for r in group))
        prompt_logprobs = None
        if leader.prompt_logprobs is not None:
            prompt_logprobs = self.texts[leader.request_id].prompt_logprobs(leader, kind is RequestOutputKind.DELTA)
        out = RequestOutput(ext_id, None, leader.prompt_token_ids, comps, finished,
                            max(leader.num_cached_tokens, 0), metrics, error=error, prompt_logprobs=prompt_logprobs)
        if finished:
            del self.requests[ext_id]
            for r in group:
                self.texts.pop(r.request_id, None)
        return out
