"""ernie_moe's logic: one AsyncEngine per model instance, driven from Triton's decoupled execute.

execute() submits and returns; the engine hands each step's outputs to the response loop in one piece
(response_loop.py), which turns them into responses on the contract of engine_response.py, paced by
stream_pacing.py, and sends them on sender threads, so a slow send never stalls the step loop. Every accepted
request gets exactly one FINAL; inside the ensemble its errors travel in band. Why each of these, and what
tritonserver 2.51 forces: docs/serving.md.
"""
from __future__ import annotations

import json
import logging
import os
import threading
import uuid
from typing import Any

import numpy as np

from ..config import EngineConfig
from ..engine.async_engine import AsyncEngine, EngineDeadError, EngineOverloadedError, RequestFailedError
from ..outputs import RequestOutput, RequestOutputKind
from ..sampling_params import SamplingParams
from .control import ControlListener
from .engine_response import Failure, RequestMeta
from .errors import InvalidInput, ServingError, Unavailable, error_code
from .response_loop import CANCELLED, ResponseLoop, StreamCallback
from .response_stream import Ending, ResponseSink, ResponseStream
from .stream_pacing import PacingPolicy

__all__ = ["EngineModel", "ResponseSink", "Ending", "CANCELLED", "QUIET", "SHUT_DOWN", "decode_engine_inputs"]
log = logging.getLogger(__name__)
CANCEL_POLL_SECONDS = 0.05
# is_cancelled() is a round trip to tritonserver's process (the Python backend's IPC), so the poller asks at most this
# many a second over all live requests: at 256 streams every 50 ms was 5120 round trips a second, CPU in both
# processes that grew with the streams, not the tokens. Each request is still asked at least every
# max(CANCEL_POLL_SECONDS, live / CANCEL_POLLS_PER_SECOND) seconds (0.64 s at 256 live).
CANCEL_POLLS_PER_SECOND = 400
# Pacing by the detokenizer (stream_pacing.py): a stream's response waits while PACE_WINDOW of its earlier ones are
# not yet processed by the detokenizer, at most PACE_MAX_HOLD_SECONDS (a lost report, or a detokenizer that far
# behind).
PACE_WINDOW = 2
PACE_MAX_HOLD_SECONDS = 0.5
QUIET = Ending(None)  # cancelled by the ensemble's own detokenizer, see docs/serving.md
SHUT_DOWN = Ending("UNAVAILABLE", "unavailable: the server shut down before the request completed")
DRAINING_MESSAGE = "unavailable: the server is shutting down and accepts no new requests"


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


def _cancel_relayed(live: ResponseStream) -> bool:
    """Whether the stage after this one tells of this stream's cancellation (over the control socket): a streaming
    request through ernie_detokenizer or ernie_bls once its first token is out. Inside an ensemble
    (tritonserver 2.51) is_cancelled() never turns true here anyway; asking it for every other stream still
    catches a direct caller's cancellation, and a queued request's in a server whose ensemble does pass it on."""
    return live.meta.cancel_relayed and live.stream and live.num_output_tokens > 0


def pacing_policy(config: EngineConfig | None) -> PacingPolicy:
    """The response pacing the config asks for (--stream-interval, --stream-coalesce-ms)."""
    if config is None:
        return PacingPolicy(window=PACE_WINDOW, max_hold_seconds=PACE_MAX_HOLD_SECONDS)
    return PacingPolicy(interval_tokens=config.stream_interval, coalesce_seconds=config.stream_coalesce_ms / 1e3,
                        window=PACE_WINDOW, max_hold_seconds=PACE_MAX_HOLD_SECONDS)


class EngineModel:
    def __init__(self, config: EngineConfig, metrics=None, engine: AsyncEngine | None = None,
                 parent_pid: int | None = None):
        """`parent_pid`: the tritonserver this runs under; the process exits once it is gone (a stub
        whose server was killed otherwise keeps its engine running: measured, under load)."""
        self.config = config
        self.engine = engine or AsyncEngine(config)
        self.metrics = metrics
        self.parent_pid = parent_pid
        self._live: dict[str, ResponseStream] = {}
        # the Triton request id each live stream was submitted with, and its inverse, for `abort-id` (control.py)
        self._request_id: dict[str, str] = {}
        self._by_request_id: dict[str, set[str]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._draining = False
        self.responses = ResponseLoop(pacing_policy(config), self._failure, self._finished)
        core = getattr(self.engine, "engine", self.engine)  # a P/D front wraps the AsyncEngine
        if hasattr(core, "output_sink"):  # AsyncEngine, EngineCoreClient
            core.output_sink = self.responses.step_sink
        self._poller = threading.Thread(target=self._poll_cancelled, name="ernie-cancel-poll", daemon=True)
        self._poller.start()
        self.control = ControlListener(lambda key: self.abort(key, QUIET), on_drain=self.drain,
                                       on_progress=self.responses.put_progress, on_abort_id=self.abort_request_id)
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
            meta = RequestMeta.from_dict(req.get("meta"))
            params.output_kind = RequestOutputKind.DELTA  # each step's tokens once: no per-step copy of them all
            # The detokenizer stage decodes the ids (its own process, off the engine's step thread) unless stop
            # strings need the text in the engine, where a stop is matched and held back.
            params.detokenize = bool(params.stop)
            stream_id = uuid.uuid4().int >> 65  # 63 bits: unique over instances without coordination
            # no whitespace: keys travel space-separated in the detokenizer's progress reports
            key = f"{'_'.join(request_id.split())[:64] or 'req'}-{stream_id:016x}"
            meta.key, meta.abort_address = key, self.control.public_address
            meta.decode_ids, meta.skip_special_tokens = not params.detokenize, params.skip_special_tokens
            stream = bool(req.get("stream", meta.stream))
            live = ResponseStream(key, stream_id, sink, stream, meta, ids, params.logprobs, params.prompt_logprobs)
            live.clock.paced = stream and meta.progress_reports
            with self._lock:
                if self._draining:
                    raise Unavailable(DRAINING_MESSAGE)
                self._live[key] = live
                if request_id:
                    self._request_id[key] = request_id
                    self._by_request_id.setdefault(request_id, set()).add(key)
            try:
                self.engine.add_request(key, ids, params, StreamCallback(live, self.responses))
            except BaseException:
                with self._lock:
                    self._forget(key)
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

    def abort_request_id(self, request_id: str, ending: Ending = CANCELLED) -> int:
        """Abort every live stream submitted with Triton request id `request_id` (exactly equal; an empty id matches
        none): a client's way to end a stream it abandons without a gRPC cancellation (control.py). Each ends as a
        cancelled request does: in the ensemble a final response carrying CANCELLED, which the detokenizer raises
        after dropping the stream's state. Returns how many were aborted (0: unknown id, a no-op)."""
        if not request_id:
            return 0
        with self._lock:
            keys = list(self._by_request_id.get(request_id, ()))
        return sum(self.abort(key, ending) for key in keys)

    def _forget(self, key: str) -> None:  # under self._lock
        self._live.pop(key, None)
        request_id = self._request_id.pop(key, None)
        keys = self._by_request_id.get(request_id) if request_id is not None else None
        if keys is not None:
            keys.discard(key)
            if not keys:
                del self._by_request_id[request_id]

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
        s["stream_responses_held"] = self.responses.num_held
        return s

    # ------------------------------------------------------------------ engine thread
    def _finished(self, live: ResponseStream, out: RequestOutput) -> None:
        """A request's last engine output is in (response loop thread)."""
        with self._lock:
            self._forget(live.key)
        if self.metrics is not None:
            self.metrics.request_finished(out.outputs[0].finish_reason, live.num_output_tokens
                                          + len(out.outputs[0].token_ids_delta), out.metrics)

    def _failure(self, err: Exception) -> Failure:
        """The error a failed request ends with: this request alone (INTERNAL), or the engine (UNAVAILABLE)."""
        if isinstance(err, RequestFailedError):
            return Failure("INTERNAL", f"request failed: {err}")
        if self.metrics is not None:
            self.metrics.set_healthy(False)
        return Failure("UNAVAILABLE", f"unavailable: engine failed, request not completed: {err}")

    def _on_step(self, stats: dict) -> None:  # stats: this listener's own copy
        stats["stream_responses_held"] = self.responses.num_held
        self.metrics.update(stats)
        if not self.engine.is_healthy:
            self.metrics.set_healthy(False)

    # ------------------------------------------------------------------ helper threads
    def _poll_cancelled(self) -> None:
        pause = CANCEL_POLL_SECONDS
        while not self._stop.wait(pause):
            if self.parent_pid is not None and os.getppid() != self.parent_pid:
                log.error("tritonserver (pid %d) is gone; exiting", self.parent_pid)
                os._exit(1)
            with self._lock:
                live = [lv for lv in self._live.values() if lv.ending is None and not _cancel_relayed(lv)]
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
        self.responses.stop(timeout)
