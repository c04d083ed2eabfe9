"""Thread-safe engine front for servers: the step loop runs on its own thread; callers submit,
stream and abort from any thread (Triton's execute, its cancellation watcher, the offline tests).

Callers never wait for a step. A request is validated on the caller's thread (bad input raises
there, at once) and handed over through an input queue that the loop drains between steps, as vLLM's
EngineCore does; aborts travel the same queue; stats are a snapshot the loop publishes after each
step. The engine itself is only ever touched by the loop thread, so no lock is held across a forward.

Every accepted request gets exactly one final output: finished, aborted, failed alone (its callback
gets a RequestFailedError; the engine goes on), or failed because the engine died (EngineDeadError;
the front then refuses new work).

Prefill/decode disaggregation (serving/disagg.py) adds two kinds of request: `add_prefill` (prefill
role: compute a prompt's KV, hand it over as a KVTransfer, free the blocks) and `add_prefilled` (decode
role: continue from a KVTransfer). Both go through the same inbox and loop.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterator

from ..config import EngineConfig
from ..outputs import CompletionOutput, RequestOutput
from ..sampling_params import SamplingParams
from .input_processor import RequestGroup
from .kv_transfer import EngineCapacityError, KVTransfer
from .llm_engine import LLMEngine

log = logging.getLogger(__name__)
OutputCallback = Callable[[RequestOutput, "Exception | None"], None]
KVCallback = Callable[["KVTransfer | None", "str | None"], None]  # the prompt's KV, or why there is none
# A prefill-role request computes the prompt and stops: the decode side recomputes the last prompt token and
# samples every token itself, with the request's own parameters (so the two roles agree with a mixed server).
PREFILL_ONLY = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
ABORT_WAIT_SECONDS = 30.0  # how long a closed stream waits for its abort to be acknowledged


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
    prompt_token_ids: list[int]


class AsyncEngine:
    def __init__(self, config: EngineConfig, engine: LLMEngine | None = None):
        self.config = config
        self.engine = engine or LLMEngine(config)
        # Guards the hand-over state below; never held while the engine runs.
        self._cond = threading.Condition()
        self._inbox: deque[tuple[str, RequestGroup | str]] = deque()
        self._pending: dict[str, _Pending] = {}
        self._num_queued = 0  # adds in the inbox, not yet in the scheduler's waiting queue
        self._stop = False
        self._abort_all = False
        self.error: Exception | None = None
        self._stats = self.engine.stats()
        self._transfers: dict[str, KVTransfer] = {}  # exported KV of finished prefill requests, for their callback
        self.step_listeners: list[Callable[[dict], None]] = []  # metrics hooks, called after each step
        # Set by a consumer that wants a step's outputs in one call, [(callback, output, error)], instead of one
        # callback each (ernie_moe's response loop: one hand-off per step, per-request work off this thread).
        self.output_sink: Callable[[list], None] | None = None
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
        self._check_running()
        self._submit_group(self.engine.make_request_group(request_id, prompt_token_ids, params), callback)

    def add_prefill(self, request_id: str, prompt_token_ids: list[int], on_kv: KVCallback) -> None:
        """Prefill role: compute the prompt's KV and call on_kv(KVTransfer, None) with it (its blocks are freed
        by then), or on_kv(None, why) if the request ended otherwise (aborted, failed, the engine died)."""
        self._check_running()
        group = self.engine.make_request_group(request_id, prompt_token_ids, PREFILL_ONLY, hold_kv=True)

        def on_output(out: RequestOutput, err: Exception | None) -> None:
            if out.finished:
                transfer = self._transfers.pop(request_id, None)
                on_kv(transfer, None if transfer is not None else str(err or out.error or "aborted"))

        self._submit_group(group, on_output)

    def _submit_group(self, group: RequestGroup, callback: OutputCallback) -> None:
        request_id = group.request_id
        with self._cond:
            self._check_running()
            if request_id in self._pending:
                raise ValueError(f"request_id {request_id!r} is already in use")
            # The scheduler's queue length is read live (one atomic len() of a deque the loop thread owns):
            # a snapshot would miss what the loop took from the inbox during the step that is running.
            waiting = len(self.engine.scheduler.waiting) + self._num_queued
            if waiting >= self.config.max_waiting_requests:
                raise EngineOverloadedError(f"overloaded: {waiting} requests already waiting "
                                            f"(max_waiting_requests={self.config.max_waiting_requests})")
            self._pending[request_id] = _Pending(callback, time.monotonic(), group.requests[0].prompt_token_ids)
            self._inbox.append(("add", group))
            self._num_queued += 1
            self._cond.notify()

    def add_prefilled(self, transfer: KVTransfer, params: SamplingParams, callback: OutputCallback) -> None:
        """Decode role: continue a request from the prompt KV a prefill server computed (a request like any
        other from then on: streamed to callback, aborted with abort)."""
        self._check_running()
        with self._cond:
            self._check_running()
            if transfer.request_id in self._pending:
                raise ValueError(f"request_id {transfer.request_id!r} is already in use")
            self._pending[transfer.request_id] = _Pending(callback, time.monotonic(), transfer.prompt_token_ids)
            self._inbox.append(("prefilled", (transfer, params)))
            self._cond.notify()

    def _check_running(self) -> None:
        if self.error is not None or self._stop:
            raise EngineDeadError(f"engine is not running: {self.error or 'shutting down'}")

    def abort(self, request_id: str) -> bool:
        """Ask the loop to abort; the request's callback then gets its final (aborted) output, with its
        KV blocks already freed. False if the request is unknown or already finished."""
        with self._cond:
            if request_id not in self._pending:
                return False
            self._inbox.append(("abort", request_id))
            self._cond.notify()
        return True

    def stream(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> Iterator[RequestOutput]:
        """Blocking iterator of outputs; closing it early aborts the request and waits for the abort."""
        return stream_outputs(self, request_id, prompt_token_ids, params)

    def stats(self) -> dict:
        """The engine's counters as of the last step (never waits for a running one)."""
        with self._cond:
            return dict(self._stats)

    # ------------------------------------------------------------ the loop
    def _loop(self) -> None:
        while True:
            with self._cond:
                while not (self._stop or self._inbox or self.engine.has_unfinished_requests()):
                    self._cond.wait()
                inbox, self._inbox = self._inbox, deque()
                abort_all = self._abort_all
            try:
                outputs = self._drain(inbox, abort_all)
                if self._stop and not self.engine.has_unfinished_requests():
                    self._publish(outputs)
                    return
                outputs += self.engine.step()
            except Exception as e:  # noqa: BLE001 - a fault no single request explains: the engine dies
                log.exception("engine step failed; failing all requests")
                self._die(e)
                return
            self._publish(outputs)
            self._maybe_log()

    def _drain(self, inbox: deque, abort_all: bool) -> list[RequestOutput]:
        """Apply queued adds and aborts (loop thread). An add the engine refuses fails alone."""
        outputs = []
        for kind, item in inbox:
            if kind == "add":
                try:
                    self.engine.add_request_group(item)
                except ValueError as e:
                    outputs.append(failed_output(item.request_id, item.requests[0].prompt_token_ids, str(e)))
                with self._cond:
                    self._num_queued -= 1  # in the scheduler's waiting queue now (or failed)
            elif kind == "prefilled":
                transfer, params = item
                try:
                    out = self.engine.add_prefilled_request(transfer, params)
                except (ValueError, EngineCapacityError) as e:
                    out = failed_output(transfer.request_id, transfer.prompt_token_ids, str(e))
                if out is not None:
                    outputs.append(out)
            else:
                out = self.engine.abort_request(item)
                if out is not None:
                    outputs.append(out)
        if abort_all:
            outputs += [self.engine.abort_request(rid) for rid in list(self.engine.requests)]
        return outputs

    def _publish(self, outputs: list[RequestOutput]) -> None:
        """Stats snapshot first (a caller woken by its final output sees the state after it), then outputs.
        A finished prefill request's KV is exported before the snapshot, so the blocks it frees are counted."""
        for out in outputs:
            if out.finished and out.request_id in self.engine.scheduler.held:
                self._transfers[out.request_id] = self.engine.export_kv(out.request_id)
        stats = self.engine.stats()
        deliver = []
        with self._cond:
            self._stats = stats
            for out in outputs:
                p = self._pending.get(out.request_id)
                if p is None:
                    continue
                if out.finished:
                    del self._pending[out.request_id]
                deliver.append((p.callback, out))
        if self.output_sink is not None:
            safe_call(self.output_sink, [(cb, out, RequestFailedError(out.error) if out.error is not None else None)
                                          for cb, out in deliver])
        else:
            for cb, out in deliver:
                safe_call(cb, out, RequestFailedError(out.error) if out.error is not None else None)
        for listener in self.step_listeners:
            safe_call(listener, dict(stats))

    def _die(self, e: Exception) -> None:
        with self._cond:
            self.error = e
            dead = list(self._pending.items())
            self._pending.clear()
            self._inbox.clear()
        err = EngineDeadError(f"engine step failed: {e!r}")
        for rid, p in dead:
            try:
                out = self.engine.abort_request(rid) or failed_output(rid, p.prompt_token_ids, str(err))
            except Exception:  # noqa: BLE001 - the engine's state may be what broke
                out = failed_output(rid, p.prompt_token_ids, str(err))
            safe_call(p.callback, out, err)
        for listener in self.step_listeners:
            safe_call(listener, dict(self._stats))

    def _maybe_log(self) -> None:
        """A vLLM-style status line every log_interval_s while there is work (loop thread)."""
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
        with self._cond:
            self._stop = True
            self._abort_all = not drain
            self._cond.notify()
        self._thread.join(timeout)
        if self._thread.is_alive():
            with self._cond:
                self._abort_all = True
                self._cond.notify()
            self._thread.join(5)
        if not self._thread.is_alive():
            self.engine.close()  # tensor-parallel workers, if any


def stream_outputs(front, request_id: str, prompt_token_ids: list[int],
                   params: SamplingParams) -> Iterator[RequestOutput]:
    """A front's (AsyncEngine's, EngineCoreClient's) outputs for one request as a blocking iterator; closing it
    early aborts the request and waits for the abort."""
    q: queue.Queue = queue.Queue()
    front.add_request(request_id, prompt_token_ids, params, lambda out, err: q.put((out, err)))
    finished = False
    try:
        while not finished:
            out, err = q.get()
            if err is not None:
                raise err
            finished = out.finished
            yield out
    finally:
        if not finished and front.abort(request_id):
            deadline = time.monotonic() + ABORT_WAIT_SECONDS
            while time.monotonic() < deadline:
                try:
                    out, err = q.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    break
                if err is not None or out.finished:
                    break


def failed_output(request_id: str, prompt_token_ids: list[int], error: str) -> RequestOutput:
    return RequestOutput(request_id, None, list(prompt_token_ids),
                         [CompletionOutput(index=0, text="", token_ids=[], finish_reason="error")],
                         finished=True, error=error)


def safe_call(fn, *args) -> None:
    try:
        fn(*args)
    except Exception:  # noqa: BLE001 - a broken consumer must not kill the engine thread
        log.exception("output callback failed")
