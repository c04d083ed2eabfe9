"""A server's engine with its core in a process of its own (core_process.py): the same front as AsyncEngine
(add_request, abort, stats, output_sink, step_listeners, shutdown) for serving/engine_model.py.

Requests are checked here, against the same InputProcessor the core builds them with, so bad input and overload
are answered at once on the caller's thread; only then are they sent. One receiver thread takes the core's
messages: a step's outputs arrive in one piece and go to output_sink in one call, as AsyncEngine hands them over.
Every accepted request gets exactly one final output: its own, or a failed one when the core dies (EngineDeadError,
the front then refuses new work).
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from typing import Callable, Iterator

import zmq

from .._env import child_environment
from ..child_process import python_executable
from ..config import EngineConfig
from ..model.config import ErnieModelConfig
from ..outputs import RequestOutput
from ..sampling_params import SamplingParams
from ..tokenizer import ErnieTokenizer
from .async_engine import (EngineDeadError, EngineOverloadedError, OutputCallback, RequestFailedError,
                           failed_output, safe_call, stream_outputs)
from .core_wire import decode, encode
from .llm_engine import make_input_processor, resolve_model_dir

log = logging.getLogger(__name__)
POLL_MS = 1000  # the receiver checks that the core is alive this often while it is silent
SHUTDOWN_GRACE_SECONDS = 10.0  # beyond the drain's own timeout, before the core is killed


@dataclass
class _Pending:
    callback: OutputCallback
    prompt_token_ids: list[int]


class EngineCoreClient:
    def __init__(self, config: EngineConfig):
        self.config = config
        model_dir = resolve_model_dir(config)
        self.tokenizer = None if config.skip_tokenizer_init else \
            ErnieTokenizer.from_pretrained(config.tokenizer or model_dir)
        self.inputs = make_input_processor(config, model_dir, self.tokenizer, ErnieModelConfig.from_pretrained(model_dir))
        self.error: Exception | None = None
        self.step_listeners: list[Callable[[dict], None]] = []
        self.output_sink: Callable[[list], None] | None = None  # as AsyncEngine's: a step's outputs in one call
        self._lock = threading.Lock()  # the pending map, the stats and the input socket
        self._pending: dict[str, _Pending] = {}
        self._stats: dict = {}
        self._stopping = False
        self._dir = tempfile.mkdtemp(prefix="ernie-core-")  # private (0700): the sockets' only way in
        self._zmq = zmq.Context()
        self._to_core = self._zmq.socket(zmq.PUSH)
        self._to_core.setsockopt(zmq.LINGER, 0)
        self._to_core.bind(f"ipc://{self._dir}/inputs")
        self._from_core = self._zmq.socket(zmq.PULL)
        self._from_core.bind(f"ipc://{self._dir}/outputs")
        fields = {**config.to_dict(), "model": str(model_dir)}
        self.proc = subprocess.Popen([python_executable(), "-m", "ernie_serve.engine.core_process",
                                      "--config", json.dumps(fields), "--inputs", f"ipc://{self._dir}/inputs",
                                      "--outputs", f"ipc://{self._dir}/outputs", "--front-pid", str(os.getpid())],
                                     env=child_environment())
        try:
            self._stats = self._await_ready()
        except BaseException:
            self._close(kill=True)
            raise
        log.info("engine core: process %d", self.proc.pid)
        self._receiver = threading.Thread(target=self._receive, name="ernie-core-outputs", daemon=True)
        self._receiver.start()

    def _await_ready(self) -> dict:
        """The core's first message; no limit on the whole wait, which grows with the checkpoint."""
        while not self._from_core.poll(POLL_MS):
            if self.proc.poll() is not None:
                raise RuntimeError(f"the engine core process {_exit_status(self.proc.returncode)} while starting "
                                   "(its log is above)")
        message = decode(self._from_core.recv())
        if message[0] == "failed":  # a config the engine refuses is a ValueError here too, with its own words
            _, kind, why = message
            raise ValueError(why) if kind == "ValueError" else RuntimeError(f"{kind}: {why}")
        if message[0] != "ready":
            raise RuntimeError(f"the engine core process sent {message[0]!r} before it was ready")
        return message[1]

    # ------------------------------------------------------------ the AsyncEngine front
    @property
    def is_healthy(self) -> bool:
        return self.error is None and self.proc.poll() is None

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    callback: OutputCallback) -> None:
        """Queue a request; raises ValueError for bad input, EngineOverloadedError, EngineDeadError."""
        self._check_running()
        ids = self.inputs.check(prompt_token_ids, params)
        frame = encode(("add", request_id, ids, params))
        with self._lock:
            self._check_running()
            if request_id in self._pending:
                raise ValueError(f"request_id {request_id!r} is already in use")
            # Requests the core has not started: those accepted here less the sequences it last said were running
            # (n > 1 counts each sequence, so this errs toward accepting).
            waiting = len(self._pending) - self._stats.get("num_running", 0)
            if waiting >= self.config.max_waiting_requests:
                raise EngineOverloadedError(f"overloaded: {waiting} requests already waiting "
                                            f"(max_waiting_requests={self.config.max_waiting_requests})")
            self._pending[request_id] = _Pending(callback, ids)
            self._to_core.send(frame)

    def abort(self, request_id: str) -> bool:
        """As AsyncEngine.abort: the request's final (aborted) output follows, its KV blocks already freed."""
        with self._lock:
            if request_id not in self._pending or self.error is not None:
                return False
            self._to_core.send(encode(("abort", request_id)))
        return True

    def stream(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> Iterator[RequestOutput]:
        return stream_outputs(self, request_id, prompt_token_ids, params)

    def stats(self) -> dict:
        """The core's counters as of its last step."""
        with self._lock:
            return dict(self._stats)

    def shutdown(self, drain: bool = True, timeout: float = 30.0) -> None:
        """Stop accepting work; the core drains or aborts what is in flight (each request gets its final output
        through the receiver), then exits."""
        with self._lock:
            if self._stopping:
                return
            self._stopping = True
            if self.proc.poll() is None:
                self._to_core.send(encode(("shutdown", drain, timeout)))
        self._receiver.join(timeout + SHUTDOWN_GRACE_SECONDS)
        if self._receiver.is_alive():  # the core did not finish in time: killed, which the receiver notices
            self.proc.kill()
            self._receiver.join(POLL_MS / 1000 + 5)
        self._close(kill=True)

    def _check_running(self) -> None:
        if self.error is not None or self._stopping:
            raise EngineDeadError(f"engine is not running: {self.error or 'shutting down'}")

    # ------------------------------------------------------------ the receiver thread
    def _receive(self) -> None:
        try:
            self._receive_until_the_end()
        except Exception as e:  # noqa: BLE001 - a message this front cannot read: no request may be left waiting
            log.exception("reading the engine core's messages failed")
            self.proc.kill()
            self._die(f"the engine core's messages could not be read: {type(e).__name__}: {e}")

    def _receive_until_the_end(self) -> None:
        while True:
            if not self._from_core.poll(POLL_MS):
                if self.proc.poll() is not None:
                    self._die(f"the engine core process {_exit_status(self.proc.returncode)}")
                    return
                continue
            message = decode(self._from_core.recv())
            kind = message[0]
            if kind == "step":
                self._deliver(message[1], message[2])
            elif kind == "refused":
                _, request_id, why = message
                self._deliver([failed_output(request_id, [], why)], None)
            elif kind == "dead":
                self._die(message[1])
                return
            elif kind == "bye":
                self._fail_pending(EngineDeadError("engine is not running: shut down"))
                return

    def _deliver(self, outputs: list[RequestOutput], stats: dict | None) -> None:
        deliver = []
        with self._lock:
            if stats is not None:
                self._stats = stats
            for out in outputs:
                p = self._pending.get(out.request_id)
                if p is None:
                    continue
                out.prompt_token_ids = p.prompt_token_ids
                if out.finished:
                    del self._pending[out.request_id]
                deliver.append((p.callback, out, RequestFailedError(out.error) if out.error is not None else None))
        if self.output_sink is not None:
            safe_call(self.output_sink, deliver)
        else:
            for cb, out, err in deliver:
                safe_call(cb, out, err)
        if stats is not None:
            for listener in self.step_listeners:
                safe_call(listener, dict(stats))

    def _die(self, why: str) -> None:
        log.error("engine core failed: %s; failing all requests", why)
        with self._lock:
            self.error = RuntimeError(why)
        self._fail_pending(EngineDeadError(f"engine step failed: {why}"))
        for listener in self.step_listeners:
            safe_call(listener, self.stats())

    def _fail_pending(self, err: EngineDeadError) -> None:
        """Requests the core will never answer get their final output here (AsyncEngine._die's contract)."""
        with self._lock:
            dead = list(self._pending.items())
            self._pending.clear()
        for request_id, p in dead:
            safe_call(p.callback, failed_output(request_id, p.prompt_token_ids, str(err)), err)

    def _close(self, kill: bool) -> None:
        if kill and self.proc.poll() is None:
            self.proc.kill()
        try:
            self.proc.wait(SHUTDOWN_GRACE_SECONDS)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._to_core.close(0)
        self._from_core.close(0)
        self._zmq.term()
        shutil.rmtree(self._dir, ignore_errors=True)


def _exit_status(code: int | None) -> str:
    if code is None:
        return "is still running"
    return f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"

