"""ernie_moe's response side: one hand-off per engine step in, responses out on sender threads.

The engine thread hands each step's outputs over in one queue put and goes back to the GPU; everything per
request (logprob entries, accumulation, pacing, building the tensors) happens on this loop's thread, while the
next step runs. Sends (a blocking round trip to tritonserver each) are spread over `num_senders` threads; a stream
always goes to the same one, so its responses keep their order.

Every stream ends with exactly one FINAL: its last tokens, a bare FINAL (a quiet cancellation), its error in band
(inside the ensemble) or a Triton error.
"""
from __future__ import annotations

import heapq
import itertools
import logging
import queue
import threading
import time
from typing import Callable

from ..outputs import RequestOutput
from .engine_response import Failure
from .response_stream import Ending, ResponseStream
from .stream_pacing import PacingPolicy

log = logging.getLogger(__name__)
NUM_SENDERS = 4
CANCELLED = Ending("CANCELLED", "request cancelled")

StepOutputs = list[tuple[ResponseStream, RequestOutput, Exception | None]]


class ResponseLoop:
    def __init__(self, policy: PacingPolicy, failure_of: Callable[[Exception], Failure],
                 on_finished: Callable[[ResponseStream, RequestOutput], None], num_senders: int = NUM_SENDERS):
        """`failure_of(err)`: the error a failed request ends with; `on_finished(stream, out)`: called once a
        request's last engine output is in (the engine has freed it)."""
        self.policy = policy
        self._failure_of = failure_of
        self._on_finished = on_finished
        self._events: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, ResponseStream] = {}  # by key, from a stream's first output to its FINAL
        self._timers: list[tuple[float, int, ResponseStream]] = []
        self._seq = itertools.count()
        self.num_held = 0  # waits for a lagging detokenizer since start (a metric)
        self._senders = [_Sender(f"ernie-responses-{i}", self._on_sent) for i in range(max(1, num_senders))]
        self._thread = threading.Thread(target=self._run, name="ernie-responses", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ from other threads
    def put_outputs(self, outputs: StepOutputs) -> None:
        """One engine step's outputs (the engine thread)."""
        self._events.put((self._outputs, outputs))

    def step_sink(self, deliveries: list[tuple[Callable, RequestOutput, Exception | None]]) -> None:
        """AsyncEngine.output_sink: one step's outputs, ours in one hand-off (a P/D front's own callbacks are
        called as they were)."""
        ours = []
        for callback, out, err in deliveries:
            if isinstance(callback, StreamCallback) and callback.loop is self:
                ours.append((callback.stream, out, err))
            else:
                try:
                    callback(out, err)
                except Exception:  # noqa: BLE001 - a broken consumer must not kill the engine thread
                    log.exception("output callback failed")
        if ours:
            self.put_outputs(ours)

    def put_progress(self, counts: list[tuple[str, int]]) -> None:
        """The detokenizer's report of how many responses of each stream it has processed (control thread)."""
        self._events.put((self._progress, counts))

    def _on_sent(self, stream: ResponseStream) -> None:
        """A stream's response has gone out (a sender thread): what it held meanwhile may go now."""
        self._events.put((self._sent, stream))

    def stop(self, timeout: float) -> None:
        """Process what is queued, hand the senders their last responses, and stop."""
        self._events.put(None)
        self._thread.join(timeout)
        for sender in self._senders:
            sender.stop(timeout)

    # ------------------------------------------------------------ the loop's thread
    def _run(self) -> None:
        while True:
            timeout = None
            if self._timers:
                timeout = max(0.0, self._timers[0][0] - time.monotonic())
            try:
                event = self._events.get(timeout=timeout)
            except queue.Empty:
                event = ()
            if event is None:
                self._flush()
                return
            try:
                if event:
                    handler, arg = event
                    handler(arg)
                self._fire_timers()
            except Exception:  # noqa: BLE001 - one bad stream must not stop the others' responses
                log.exception("response loop")

    def _flush(self) -> None:
        """At stop: the ended streams' last responses go now, behind any still in flight (their senders keep
        the order)."""
        now = time.monotonic()
        for stream in list(self._streams.values()):
            if stream.clock.final and not stream.closed:
                self._send(stream, stream.response(now))

    def _outputs(self, outputs: StepOutputs) -> None:
        now = time.monotonic()
        for stream, out, err in outputs:
            if stream.closed:
                continue
            self._streams.setdefault(stream.key, stream)
            if out.finished:
                self._on_finished(stream, out)
            comp = out.outputs[0]
            if err is not None:
                self._close(stream, out, self._failure_of(err), now)
            elif out.finished and comp.finish_reason == "abort":
                # how an aborted request is answered; a request that finished before the abort reached the
                # engine ends as it finished (its key is live until this loop takes its last output)
                ending = stream.ending or CANCELLED
                self._close(stream, out, Failure(ending.code, ending.message) if ending.code else None, now,
                            bare=ending.code is None)
            else:
                # A step the engine made before an abort reached it still counts: its tokens go ahead of the
                # stream's error (a drain's UNAVAILABLE), or are dropped with it (a cancellation).
                stream.take(out, now)
                if stream.ending is None or out.finished:
                    self._consider(stream, now)

    def _sent(self, stream: ResponseStream) -> None:
        stream.in_flight = False
        self._consider(stream, time.monotonic())

    def _progress(self, counts: list[tuple[str, int]]) -> None:
        now = time.monotonic()
        for key, processed in counts:
            stream = self._streams.get(key)
            if stream is not None and processed > stream.clock.processed:
                stream.clock.processed = processed
                self._consider(stream, now)

    def _consider(self, stream: ResponseStream, now: float) -> None:
        """Send the stream's held tokens if the policy says they are due, else set a timer for when they are."""
        if stream.closed or stream.in_flight or not (stream.stream or stream.clock.final):
            return  # a stream with a response in flight holds its tokens until that one is out
        due = self.policy.due_at(stream.clock)
        if due is None:
            return
        if due <= now:
            self._send(stream, stream.response(now))
            return
        if self.policy.lagging(stream.clock) and not stream.hold_counted:
            stream.hold_counted = True
            self.num_held += 1
        if stream.timer_due is None or due < stream.timer_due:  # one live timer a stream, the earliest
            stream.timer_due = due
            heapq.heappush(self._timers, (due, next(self._seq), stream))

    def _fire_timers(self) -> None:
        now = time.monotonic()
        while self._timers and self._timers[0][0] <= now:
            due, _, stream = heapq.heappop(self._timers)
            if due != stream.timer_due:
                continue  # superseded by an earlier timer of the same stream
            stream.timer_due = None
            self._consider(stream, now)  # the stream may have sent since: the policy decides again

    def _close(self, stream: ResponseStream, out: RequestOutput, failure: Failure | None, now: float,
               bare: bool = False) -> None:
        """End a stream that failed or was aborted: what it held goes first (unless it was cancelled: its client
        reads none), then its FINAL."""
        if failure is not None and failure.code != CANCELLED.code and stream.stream and stream.clock.pending_tokens:
            self._send(stream, stream.response(now, final=False))
        stream.last_output = out
        if bare or failure is None:
            stream.closed = True
            self._sender(stream).put(None, stream.sink.send_final)
        elif stream.meta.errors_in_band:
            stream.token_ids, stream.text, stream.logprobs = [], [], []
            self._send(stream, stream.response(now, failure=failure, final=True))
        else:
            stream.closed = True
            self._sender(stream).put(None, stream.sink.send_error, failure.code, failure.message)
        self._streams.pop(stream.key, None)

    def _send(self, stream: ResponseStream, response) -> None:
        if response.final:
            self._streams.pop(stream.key, None)
        stream.in_flight = True
        self._sender(stream).put(stream, stream.sink.send, response.to_tensors(), response.final)

    def _sender(self, stream: ResponseStream) -> _Sender:
        return self._senders[stream.stream_id % len(self._senders)]


class StreamCallback:
    """A stream's output callback for the engine: called alone (a P/D front, a dying engine) it hands one output
    over; ResponseLoop.step_sink recognizes it and hands a whole step over at once."""

    __slots__ = ("stream", "loop")

    def __init__(self, stream: ResponseStream, loop: ResponseLoop):
        self.stream = stream
        self.loop = loop

    def __call__(self, out: RequestOutput, err: Exception | None) -> None:
        self.loop.put_outputs([(self.stream, out, err)])


class _Sender:
    """A thread that makes the (blocking) sends of the streams assigned to it, in order."""

    def __init__(self, name: str, on_sent: Callable[[ResponseStream], None]):
        self._on_sent = on_sent
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def put(self, stream: ResponseStream | None, fn: Callable, *args) -> None:
        """Call fn(*args) in turn; then, for a `stream`, tell the loop its response is out."""
        self._queue.put((stream, fn, args))

    def _on_sent(self, stream: ResponseStream) -> None:
        """A stream's response has gone out (a sender thread): what it held meanwhile may go now."""
        self._events.put((self._sent, stream))

    def stop(self, timeout: float) -> None:
        self._queue.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            stream, fn, args = item
            try:
                fn(*args)
            except Exception:  # noqa: BLE001 - a client that went away must not stop the others
                log.exception("sending a response failed")
            if stream is not None:
                self._on_sent(stream)
