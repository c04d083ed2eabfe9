"""ernie_moe's logic: one AsyncEngine per model instance, driven from Triton's decoupled execute.

execute() submits and returns; the engine thread produces one RequestOutput per step; a response thread turns a
stream's buffered steps into responses, so a slow send never stalls the step loop, and holds a paced stream's
next response while its detokenizer lags (PACE_WINDOW, at most PACE_MAX_HOLD_SECONDS). Every accepted request
gets exactly one FINAL; inside the ensemble its errors travel in band (errors.in_band_error). Why each of these,
and what tritonserver 2.51 forces: docs/serving.md.
"""
from __future__ import annotations

import json
import logging
import math
import os
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from ..config import EngineConfig
from ..engine.async_engine import AsyncEngine, EngineDeadError, EngineOverloadedError, RequestFailedError
from ..outputs import RequestOutput, RequestOutputKind
from ..sampling_params import SamplingParams
from .control import ControlListener
from .errors import InvalidInput, ServingError, Unavailable, error_code, in_band_error

log = logging.getLogger(__name__)
CANCEL_POLL_SECONDS = 0.05
# is_cancelled() is a round trip to tritonserver's process (the Python backend's IPC), so the poller asks at most this
# many a second over all live requests: at 256 streams every 50 ms was 5120 round trips a second, CPU in both
# processes that grew with the streams, not the tokens. Each request is still asked at least every
# max(CANCEL_POLL_SECONDS, live / CANCEL_POLLS_PER_SECOND) seconds (0.64 s at 256 live).
CANCEL_POLLS_PER_SECOND = 400
# Pacing (module docstring): a stream's response waits while PACE_WINDOW of its earlier ones are not yet processed
# by the detokenizer, at most PACE_MAX_HOLD_SECONDS (a lost report, or a detokenizer that far behind).
PACE_WINDOW = 2
PACE_MAX_HOLD_SECONDS = 0.5
PACE_CHECK_SECONDS = 0.05  # how often the response thread looks for holds past PACE_MAX_HOLD_SECONDS


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


CANCELLED = Ending("CANCELLED", "request cancelled")
QUIET = Ending(None)  # cancelled by the ensemble's own detokenizer, see the module docstring
SHUT_DOWN = Ending("UNAVAILABLE", "unavailable: the server shut down before the request completed")
DRAINING_MESSAGE = "unavailable: the server is shutting down and accepts no new requests"


@dataclass
class _Live:
    key: str
    sink: ResponseSink
    stream: bool
    meta: str
    prompt_ids: list[int]
    num_logprobs: int | None = None  # SamplingParams.logprobs: None = no logprobs output
    num_prompt_logprobs: int | None = None  # SamplingParams.prompt_logprobs: None = no prompt_logprobs output
    prompt_logprobs: list[dict] | None = None  # their entries, once the engine has computed them
    errors_in_band: bool = False  # end with a FINAL response carrying the error (module docstring)
    index: int = 0
    num_output_tokens: int = 0  # generated so far, as of the steps taken into token_ids
    ending: Ending | None = None  # set when the request is aborted
    done: bool = False
    token_ids: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    logprobs: list[dict] = field(default_factory=list)
    # a stream's steps not sent yet (the engine thread appends, the response thread takes them), the last
    # step's output, and whether a send of them is queued (in the outbox, or held)
    last_output: RequestOutput | None = None
    queued: bool = False
    closed: bool = False  # its FINAL has been sent
    # pacing by the detokenizer's progress reports (module docstring)
    paced: bool = False
    processed: int = 0  # responses the detokenizer has reported processed
    held: bool = False
    held_since: float = 0.0


@dataclass(frozen=True)
class _Close:
    """A request's end, for the response thread: `code` None is a bare FINAL, else the error it ends with."""

    out: RequestOutput
    code: str | None
    message: str


def _str_tensor(value: str) -> np.ndarray:
    return np.array([[value.encode("utf-8")]], dtype=np.object_)


def _int_tensor(values: list[int]) -> np.ndarray:
    return np.array([values], dtype=np.int32).reshape(1, len(values))


def _scalar(value: int) -> np.ndarray:
    return np.array([[value]], dtype=np.int32)


def _finite(x: float) -> float:
    return x if math.isfinite(x) else -9999.0  # JSON has no -inf


def new_logprob_entries(live: _Live, comp) -> list[dict]:
    """The logprobs of a step's new tokens, best `num_logprobs` alternatives each.

    The engine's outputs are deltas here (RequestOutputKind.DELTA): CompletionOutput.logprobs holds the step's
    tokens' ({token_id: Logprob}, the sampled token always in it, ranked or not); the token strings are added
    by the detokenizer, which has the tokenizer.
    """
    if live.num_logprobs is None or not comp.logprobs:
        return []
    return [_logprob_entry(tid, cands, live.num_logprobs) for tid, cands in zip(comp.token_ids, comp.logprobs)]


def prompt_logprob_entries(live: _Live, out: RequestOutput) -> list[dict]:
    """RequestOutput.prompt_logprobs as the `prompt_logprobs` output's entries: one per prompt token, the first
    with a null logprob (nothing predicts it), each as the `logprobs` output's."""
    first = {"token_id": int(out.prompt_token_ids[0]), "logprob": None, "rank": None, "top_logprobs": []}
    return [first] + [_logprob_entry(tid, cands, live.num_prompt_logprobs)
                      for tid, cands in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:])]


def _logprob_entry(tid: int, cands: dict, k: int) -> dict:
    """One token's entry: its logprob and rank, and its k most likely alternatives."""
    sampled = cands.get(tid)
    top = sorted(cands.items(), key=lambda kv: -kv[1].logprob)[:k]
    return {"token_id": int(tid), "logprob": _finite(sampled.logprob) if sampled else -9999.0,
            "rank": sampled.rank if sampled else None,
            "top_logprobs": [{"token_id": int(t), "logprob": _finite(lp.logprob)} for t, lp in top]}


def decode_engine_inputs(inputs: dict[str, np.ndarray]) -> tuple[list[int], dict[str, Any]]:
    """input_ids and request_json from ernie_tokenizer (or a direct / BLS caller)."""
    if "input_ids" not in inputs:
        raise InvalidInput("input_ids", "missing")
    ids = np.asarray(inputs["input_ids"]).reshape(-1).astype(np.int64).tolist()
    raw = inputs.get("request_json")
    if raw is None:
        return ids, {"sampling": {}, "stream": False, "meta": {}}
    text = np.asarray(raw).reshape(-1)[0]
    text = text.decode("utf-8") if isinstance(text, bytes) else str(text)
    try:
        req = json.loads(text) if text else {}
    except json.JSONDecodeError as e:
        raise InvalidInput("request_json", f"is not valid JSON ({e.msg})") from None
    if not isinstance(req, dict) or not isinstance(req.get("sampling", {}), dict):
        raise InvalidInput("request_json", "must be an object with a 'sampling' object")
    return ids, req


class EngineModel:
    def __init__(self, config: EngineConfig, metrics=None, engine: AsyncEngine | None = None,
                 parent_pid: int | None = None):
        """`parent_pid`: the tritonserver this runs under; the process exits once it is gone (a stub
        whose server was killed otherwise keeps its engine running: measured, under load)."""
        self.config = config
        self.engine = engine or AsyncEngine(config)
        self.metrics = metrics
        self.parent_pid = parent_pid
        self._live: dict[str, _Live] = {}
        self._lock = threading.Lock()
        self._outbox: queue.Queue = queue.Queue()
        self._held: dict[str, _Live] = {}  # streams whose next response waits for the detokenizer
        self._num_held = 0  # responses held since start (a metric)
        self._interval = config.stream_interval if config is not None else 1
        self._stop = threading.Event()
        self._draining = False
        self._sender = threading.Thread(target=self._send_loop, name="ernie-responses", daemon=True)
        self._sender.start()
        self._poller = threading.Thread(target=self._poll_cancelled, name="ernie-cancel-poll", daemon=True)
        self._poller.start()
        self.control = ControlListener(lambda key: self.abort(key, QUIET), on_drain=self.drain,
                                       on_progress=self._on_progress)
        if metrics is not None:
            self.engine.step_listeners.append(self._on_step)
            metrics.update(self.engine.stats(), force=True)

    # ------------------------------------------------------------------ requests
    def submit(self, inputs: dict[str, np.ndarray], sink: ResponseSink, request_id: str = "") -> None:
        """Start one request; every outcome (tokens, errors, cancellation) ends in one FINAL on sink."""
        try:
            ids, req = decode_engine_inputs(inputs)
            try:
                params = SamplingParams.from_dict(req.get("sampling") or {})
            except (ValueError, TypeError) as e:
                raise InvalidInput("sampling_parameters", str(e)) from None
            params.output_kind = RequestOutputKind.DELTA  # each step's tokens once: no per-step copy of them all
            # The detokenizer stage decodes the ids (its own process, off the engine's step thread) unless stop
            # strings need the text in the engine, where a stop is matched and held back.
            params.detokenize = bool(params.stop)
            # no whitespace: keys travel space-separated in the detokenizer's progress reports
            key = f"{'_'.join(request_id.split())[:64] or 'req'}-{uuid.uuid4().hex[:12]}"
            meta = dict(req.get("meta") or {})
            meta["abort_address"] = self.control.public_address
            if not params.detokenize:
                meta["decode_ids"] = {"skip_special_tokens": params.skip_special_tokens}
            live = _Live(key, sink, bool(req.get("stream", meta.get("stream", False))),
                         json.dumps(meta, ensure_ascii=False), ids, params.logprobs, params.prompt_logprobs,
                         errors_in_band=meta.get("errors_in_band") is True)
            live.paced = live.stream and meta.get("progress_reports") is True
            with self._lock:
                if self._draining:
                    raise Unavailable(DRAINING_MESSAGE)
                self._live[key] = live
            try:
                self.engine.add_request(key, ids, params, lambda out, err: self._on_output(live, out, err))
            except BaseException:
                with self._lock:
                    self._live.pop(key, None)
                raise
        except (ServingError, ValueError, EngineOverloadedError, EngineDeadError) as e:
            if isinstance(e, EngineDeadError) and not self.engine.is_healthy and self.metrics is not None:
                self.metrics.set_healthy(False)
            sink.send_error(error_code(e), str(e))
        except Exception as e:  # noqa: BLE001 - never leave a request without its FINAL
            log.exception("submit failed")
            sink.send_error("INTERNAL", f"{type(e).__name__}: {e}")

    def abort(self, key: str, ending: Ending = CANCELLED) -> bool:
        """Abort by request key; once the engine has freed it, the request is answered as `ending` says."""
        with self._lock:
            live = self._live.get(key)
            if live is None or live.ending is not None:
                return False
            live.ending = ending
        return self.engine.abort(key)

    def drain(self, grace_seconds: float) -> None:
        """Refuse new requests from now on; end those still running after `grace_seconds` UNAVAILABLE."""
        with self._lock:
            self._draining = True
        log.info("draining: no new requests; %d in flight get %.0f s to finish", len(self._live), grace_seconds)
        timer = threading.Timer(grace_seconds, self._end_all, args=(SHUT_DOWN,))
        timer.daemon = True
        timer.start()

    def _end_all(self, ending: Ending) -> None:
        with self._lock:
            keys = list(self._live)
        for key in keys:
            self.abort(key, ending)

    def stats(self) -> dict:
        s = self.engine.stats()
        s["healthy"] = self.engine.is_healthy
        with self._lock:
            s["num_live_requests"] = len(self._live)
            s["stream_responses_held"] = self._num_held
        return s

    # ------------------------------------------------------------------ engine thread
    def _on_output(self, live: _Live, out: RequestOutput, err: Exception | None) -> None:
        comp = out.outputs[0]
        num_output_tokens = live.num_output_tokens + len(comp.token_ids_delta)
        if out.finished:
            self._finish(live)
            if self.metrics is not None:
                self.metrics.request_finished(comp.finish_reason, num_output_tokens, out.metrics)
        if err is not None:
            self._outbox.put((live, _Close(out, *self._failure(err))))
            return
        if live.ending is not None or (out.finished and comp.finish_reason == "abort"):
            if out.finished:
                ending = live.ending or CANCELLED
                self._outbox.put((live, _Close(out, ending.code, ending.message)))
            return
        logprobs = new_logprob_entries(live, comp)
        prompt_logprobs = prompt_logprob_entries(live, out) if out.prompt_logprobs is not None else None
        with self._lock:
            if prompt_logprobs is not None:
                live.prompt_logprobs = prompt_logprobs
            live.num_output_tokens = num_output_tokens
            live.token_ids.extend(comp.token_ids_delta)
            live.text.append(comp.text_delta)
            live.logprobs.extend(logprobs)
            live.last_output = out
            due = out.finished or (live.stream and (live.index == 0 or len(live.token_ids) >= self._interval))
            if not due or (live.queued and not (out.finished and live.held)):
                return
            live.queued = True
            self._unhold(live)  # a FINAL never waits for the detokenizer
        self._outbox.put((live, None))

    def _on_progress(self, counts: list[tuple[str, int]]) -> None:
        """The detokenizer's report of how many responses of each stream it has processed (control thread)."""
        released = []
        with self._lock:
            for key, processed in counts:
                live = self._live.get(key)
                if live is None:
                    continue
                live.processed = max(live.processed, processed)
                if live.held and live.index - live.processed < PACE_WINDOW:
                    self._unhold(live)
                    released.append(live)
        for live in released:
            self._outbox.put((live, None))

    def _unhold(self, live: _Live) -> None:  # under self._lock
        if live.held:
            live.held = False
            self._held.pop(live.key, None)

    def _holds(self, live: _Live) -> bool:
        """Whether a stream's next response waits for the detokenizer to catch up (the module docstring)."""
        if not live.paced:
            return False
        with self._lock:
            if live.last_output.finished or live.index - live.processed < PACE_WINDOW:
                return False
            if not live.held:
                live.held, live.held_since = True, time.monotonic()
                self._held[live.key] = live
                self._num_held += 1
            return True

    def _take_pending(self, live: _Live, force: bool = False) -> tuple[dict, bool] | None:
        """What a request accumulated since its last response, as one response (response thread); None if a
        response already took it (or, unless `force`, none is due)."""
        with self._lock:
            if live.closed or not (live.queued or force):
                return None
            ids, text, logprobs, out = live.token_ids, "".join(live.text), live.logprobs, live.last_output
            live.token_ids, live.text, live.logprobs, live.queued = [], [], [], False
            num_output_tokens = live.num_output_tokens
            live.closed = out.finished
        return self._tensors(live, out, ids, text, logprobs, num_output_tokens)

    def _tensors(self, live: _Live, out: RequestOutput, token_ids: list[int], text: str, logprobs: list[dict],
                 num_output_tokens: int, finish_reason: str | None = None) -> tuple[dict, bool]:
        first = live.index == 0
        comp = out.outputs[0]
        outputs = {
            "request_key": _str_tensor(live.key),
            "response_index": _scalar(live.index),
            "token_ids": _int_tensor(token_ids),
            "text_delta": _str_tensor(text),
            "engine_finish_reason": _str_tensor(finish_reason or (comp.finish_reason or "" if out.finished else "")),
            "num_input_tokens": _scalar(len(out.prompt_token_ids)),
            "num_output_tokens": _scalar(num_output_tokens),
            "num_cached_tokens": _scalar(out.num_cached_tokens),
            # The detokenizer builds its per-request state from the first response only.
            "request_meta": _str_tensor(live.meta if first else ""),
            "prompt_ids": _int_tensor(live.prompt_ids if first else []),
            # JSON list, one entry per token in token_ids; "" when the request asked for no logprobs
            "logprobs": _str_tensor("" if live.num_logprobs is None
                                    else json.dumps(logprobs, separators=(",", ":"))),
            # JSON list, one entry per prompt token, on the first response of a request that asked; "" otherwise
            "prompt_logprobs": _str_tensor(json.dumps(live.prompt_logprobs, separators=(",", ":"))
                                           if first and live.prompt_logprobs is not None else ""),
        }
        live.index += 1
        return outputs, out.finished

    def _failure(self, err: Exception) -> tuple[str, str]:
        """The error a failed request ends with: this request alone (INTERNAL), or the engine (UNAVAILABLE)."""
        if isinstance(err, RequestFailedError):
            return "INTERNAL", f"request failed: {err}"
        if self.metrics is not None:
            self.metrics.set_healthy(False)
        return "UNAVAILABLE", f"unavailable: engine failed, request not completed: {err}"

    def _finish(self, live: _Live) -> None:
        with self._lock:
            live.done = True
            self._live.pop(live.key, None)

    def _on_step(self, stats: dict) -> None:  # stats: this listener's own copy
        stats["stream_responses_held"] = self._num_held
        self.metrics.update(stats)
        if not self.engine.is_healthy:
            self.metrics.set_healthy(False)

    # ------------------------------------------------------------------ helper threads
    def _send_loop(self) -> None:
        last_check = time.monotonic()
        while True:
            try:
                item = self._outbox.get(timeout=PACE_CHECK_SECONDS if self._held else None)
            except queue.Empty:
                item = ()
            if item is None:
                return
            if self._held and time.monotonic() - last_check >= PACE_CHECK_SECONDS:
                last_check = time.monotonic()
                for live in self._overdue(last_check):
                    self._send(live, None, may_hold=False)
            if item:
                self._send(*item)

    def _overdue(self, now: float) -> list[_Live]:
        """Held streams whose detokenizer has not reported for PACE_MAX_HOLD_SECONDS: sent anyway."""
        with self._lock:
            late = [lv for lv in self._held.values() if now - lv.held_since >= PACE_MAX_HOLD_SECONDS]
            for live in late:
                self._unhold(live)
        return late

    def _send(self, live: _Live, close: _Close | None, may_hold: bool = True) -> None:
        """One outbox item: a stream's pending tokens (unless they wait for the detokenizer), or its end."""
        try:
            if close is None:
                if not (may_hold and self._holds(live)) and (response := self._take_pending(live)) is not None:
                    live.sink.send(*response)
                return
            with self._lock:
                self._unhold(live)
                if live.closed:
                    return
            if close.code not in (None, CANCELLED.code) and live.stream and live.token_ids:
                # what the stream had accumulated goes out before its error (a cancelled one's client reads none)
                if (response := self._take_pending(live, force=True)) is not None:
                    live.sink.send(*response)
            live.closed = True
            if close.code is None:
                live.sink.send_final()
            elif live.errors_in_band:
                outputs, _ = self._tensors(live, close.out, [], "", [], live.num_output_tokens,
                                           finish_reason=in_band_error(close.code, close.message))
                live.sink.send(outputs, True)
            else:
                live.sink.send_error(close.code, close.message)
        except Exception:  # noqa: BLE001 - a client that went away must not stop the others
            log.exception("sending a response failed")

    def _poll_cancelled(self) -> None:
        pause = CANCEL_POLL_SECONDS
        while not self._stop.wait(pause):
            if self.parent_pid is not None and os.getppid() != self.parent_pid:
                log.error("tritonserver (pid %d) is gone; exiting", self.parent_pid)
                os._exit(1)
            with self._lock:
                live = [lv for lv in self._live.values() if lv.ending is None]
            for lv in live:
                try:
                    cancelled = lv.sink.is_cancelled()
                except Exception:  # noqa: BLE001
                    cancelled = False
                if cancelled:
                    self.abort(lv.key)
            pause = max(CANCEL_POLL_SECONDS, len(live) / CANCEL_POLLS_PER_SECOND)

    def shutdown(self, drain: bool = False, timeout: float = 10.0) -> None:
        """Finalize: abort (or drain) in-flight requests so each gets its FINAL, then stop threads."""
        self.engine.shutdown(drain=drain, timeout=timeout)
        self._stop.set()
        self._poller.join(2)
        self.control.close()
        self._outbox.put(None)
        self._sender.join(timeout)
