"""Thread-safe engine front for servers: the step loop runs on its own thread; callers submit,
stream and abort from any thread (Triton's execute, its cancellation watcher, the offline tests).

Every accepted request gets exactly one final output: finished, aborted, or failed because the
engine died (then the callback gets that output with an EngineDeadError, and the front refuses
new work).
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterator

from ..config import EngineConfig
from ..outputs import RequestOutput
from ..sampling_params import SamplingParams
from .llm_engine import LLMEngine

log = logging.getLogger(__name__)
OutputCallback = Callable[[RequestOutput, "Exception | None"], None]


class EngineOverloadedError(RuntimeError):
    """The waiting queue is full (max_waiting_requests); servers answer UNAVAILABLE / 429."""


class EngineDeadError(RuntimeError):
    """The step loop failed; servers mark the model not ready and answer UNAVAILABLE."""


class RequestFailedError(RuntimeError):
    """This request alone could not continue (e.g. its constraints left no token to sample); the engine
    is healthy and keeps serving the others. Servers answer INTERNAL naming the cause, readiness unchanged."""


@dataclass
class _Pending:
    callback: OutputCallback
    submitted: float


class AsyncEngine:
    def __init__(self, config: EngineConfig, engine: LLMEngine | None = None):
        self.config = config
        self.engine = engine or LLMEngine(config)
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._pending: dict[str, _Pending] = {}
        self._stop = False
        self.error: Exception | None = None
        self.step_listeners: list[Callable[[dict], None]] = []  # metrics hooks, called after each step
        self.log_interval_s = 10.0
        self._last_log = (time.monotonic(), 0, 0)  # time, prompt tokens, generation tokens
        self._thread = threading.Thread(target=self._loop, name="ernie-engine", daemon=True)
        self._thread.start()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def is_healthy(self) -> bool:
        return self.error is None and self._thread.is_alive()

    # ------------------------------------------------------------ submission
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    callback: OutputCallback) -> None:
        """Queue a request; raises ValueError for bad input, EngineOverloadedError, EngineDeadError."""
        with self._lock:
            if self.error is not None or self._stop:
                raise EngineDeadError(f"engine is not running: {self.error or 'shutting down'}")
            if len(self.engine.scheduler.waiting) >= self.config.max_waiting_requests:
                raise EngineOverloadedError(
                    f"overloaded: {len(self.engine.scheduler.waiting)} requests already waiting "
                    f"(max_waiting_requests={self.config.max_waiting_requests})")
            self.engine.add_request(request_id, prompt_token_ids, params)
            self._pending[request_id] = _Pending(callback, time.monotonic())
            self._wake.notify()

    def abort(self, request_id: str) -> bool:
        """Abort and deliver the final (aborted) output to the request's callback; False if unknown."""
        with self._lock:
            pending = self._pending.pop(request_id, None)
            if pending is None:
                return False
            out = self.engine.abort_request(request_id)
        if out is not None:
            _safe_call(pending.callback, out, None)
        return True

    def stream(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> Iterator[RequestOutput]:
        """Blocking iterator of outputs; closing it early aborts the request."""
        q: queue.Queue = queue.Queue()
        self.add_request(request_id, prompt_token_ids, params, lambda out, err: q.put((out, err)))
        finished = False
        try:
            while not finished:
                out, err = q.get()
                if err is not None:
                    raise err
                finished = out.finished
                yield out
        finally:
            if not finished:
                self.abort(request_id)

    def stats(self) -> dict:
        with self._lock:
            return self.engine.stats()

    # ------------------------------------------------------------ the loop
    def _loop(self) -> None:
        while True:
            with self._lock:
                while not self._stop and not self.engine.has_unfinished_requests():
                    self._wake.wait()
                if self._stop and not self.engine.has_unfinished_requests():
                    return
                try:
                    outputs = self.engine.step()
                except Exception as e:  # noqa: BLE001 - any failure kills the engine, never hangs requests
                    log.exception("engine step failed; failing all requests")
                    self.error = e
                    dead = list(self._pending.items())
                    self._pending.clear()
                    failed = [(p, self.engine.abort_request(rid)) for rid, p in dead]
                    break
                deliver = []
                for out in outputs:
                    p = self._pending.get(out.request_id)
                    if p is not None:
                        deliver.append((p.callback, out))
                        if out.finished:
                            del self._pending[out.request_id]
                stats = self.engine.stats() if self.step_listeners else None
                self._maybe_log()
            for cb, out in deliver:
                _safe_call(cb, out, None)
            for listener in self.step_listeners:
                _safe_call(listener, stats)
        err = EngineDeadError(f"engine step failed: {self.error!r}")
        for p, out in failed:
            _safe_call(p.callback, out, err)

    def _maybe_log(self) -> None:
        """A vLLM-style status line every log_interval_s while there is work (lock held)."""
        now = time.monotonic()
        t0, p0, g0 = self._last_log
        if now - t0 < self.log_interval_s:
            return
        e = self.engine
        dt = now - t0
        log.info("throughput: prompt %.1f tok/s, generation %.1f tok/s | running %d, waiting %d, "
                 "preempted %d | KV usage %.1f%% | prefix-cache hit rate %.1f%%",
                 (e.num_prompt_tokens - p0) / dt, (e.num_generation_tokens - g0) / dt,
                 len(e.scheduler.running), len(e.scheduler.waiting), e.scheduler.num_preemptions,
                 100 * e.kv.usage, 100 * e.kv.stats.hit_rate)
        self._last_log = (now, e.num_prompt_tokens, e.num_generation_tokens)

    def shutdown(self, drain: bool = True, timeout: float = 30.0) -> None:
        """Stop accepting work; let in-flight requests finish (drain) or abort them, then join."""
        with self._lock:
            self._stop = True
            ids = [] if drain else list(self._pending)
            self._wake.notify()
        for rid in ids:
            self.abort(rid)
        self._thread.join(timeout)
        if self._thread.is_alive():
            for rid in list(self._pending):
                self.abort(rid)
            self._thread.join(5)


def _safe_call(fn, *args) -> None:
    try:
        fn(*args)
    except Exception:  # noqa: BLE001 - a broken consumer must not kill the engine thread
        log.exception("output callback failed")
