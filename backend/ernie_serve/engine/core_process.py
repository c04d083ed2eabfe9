"""The engine core's own process: vLLM v1's EngineCore split, for servers (started by core_client.EngineCoreClient).

An AsyncEngine runs here: its step loop thread owns the scheduler, the model runner and the output processor, and
this process's main thread only takes the front's messages off a socket. The front's response side (tensors,
pacing, sends to tritonserver) then runs in another interpreter, so it never holds the GIL the step loop needs
between device steps: with both in one process that wait is GPU idle time (docs/serving-path.md, step stretch).

The wire, over two zmq PUSH / PULL pairs on ipc:// paths in a private directory (core_wire.py encodes it):
  front -> core: ("add", request_id, prompt_token_ids, SamplingParams) | ("abort", request_id)
                 | ("shutdown", drain, timeout)
  core -> front: ("ready", stats) | ("step", [RequestOutput], stats): one message a step, its outputs with their
                 prompt ids left out (the front holds them) | ("failed", error type, message): start-up failed
                 | ("dead", why): the step loop failed | ("bye",): shut down, every request answered
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import threading
from typing import Any

import zmq

from ..child_process import die_with_parent
from .core_wire import decode, encode, encode_step

log = logging.getLogger(__name__)
# The front enforces max_waiting_requests when it accepts a request (it answers the caller at once); the core then
# takes every request it is sent rather than refusing one the front has already answered as accepted.
UNBOUNDED_WAITING = 1 << 30


class _Outbox:
    """The core's one PUSH socket, shared by the step loop thread (steps) and the main thread (ready, bye)."""

    def __init__(self, sock: zmq.Socket):
        self._sock = sock
        self._lock = threading.Lock()

    def send(self, message: tuple) -> None:
        self.send_frame(encode(message))

    def send_frame(self, frame: bytes) -> None:
        # copied into zmq's own buffer: a step's frame is a few KB, where zero-copy's tracking costs more than the
        # copy (it was 8% of the core's samples at 64 streams under py-spy)
        with self._lock:
            self._sock.send(frame)


class StepPublisher:
    """The AsyncEngine's output sink and step listener in one: a step's outputs, then its stats, leave as one
    message (AsyncEngine._publish calls the sink and then the listeners, on the loop thread)."""

    def __init__(self, outbox: _Outbox, engine):
        self._outbox = outbox
        self._engine = engine
        self._outputs: list = []

    def sink(self, items: list) -> None:
        self._outputs = [out for _callback, out, _err in items]

    def on_step(self, stats: dict) -> None:
        if self._engine.error is not None:
            self._outbox.send(("dead", f"{type(self._engine.error).__name__}: {self._engine.error}"))
            return
        outputs, self._outputs = self._outputs, []
        self._outbox.send_frame(encode_step(outputs, stats))


def _ignore(_out, _err) -> None:
    """Requests' callbacks in the core: their outputs leave through StepPublisher, a step at a time."""


def serve(config_fields: dict[str, Any], inputs: zmq.Socket, outbox: _Outbox) -> int:
    from ..config import EngineConfig
    from .async_engine import AsyncEngine

    try:
        config = EngineConfig(**{**config_fields, "max_waiting_requests": UNBOUNDED_WAITING,
                                 "engine_core_process": None})
        engine = AsyncEngine(config)
    except Exception as e:  # noqa: BLE001 - the front raises it as the engine's start-up failure
        log.exception("engine core failed to start")
        outbox.send(("failed", type(e).__name__, str(e)))
        return 1
    publisher = StepPublisher(outbox, engine)
    engine.output_sink = publisher.sink
    engine.step_listeners.append(publisher.on_step)
    outbox.send(("ready", engine.stats()))
    while True:
        if not inputs.poll(1000):
            if not engine.is_healthy:
                return 1  # the loop died; its "dead" message is out
            continue
        message = decode(inputs.recv())
        kind = message[0]
        if kind == "add":
            _, request_id, prompt_token_ids, params = message
            try:
                engine.add_request(request_id, prompt_token_ids, params, _ignore)
            except Exception as e:  # noqa: BLE001 - the front checked it; a refusal here fails that request alone
                log.warning("engine core refused %s: %s", request_id, e)
                outbox.send(("refused", request_id, f"{type(e).__name__}: {e}"))
        elif kind == "abort":
            engine.abort(message[1])
        elif kind == "shutdown":
            _, drain, timeout = message
            engine.shutdown(drain=drain, timeout=timeout)
            outbox.send(("bye",))
            return 0
        else:
            log.error("engine core: unknown message %r", kind)


def core_main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="an ernie_serve server's engine core (started by its ernie_moe)")
    p.add_argument("--config", required=True, help="EngineConfig's fields, JSON")
    p.add_argument("--inputs", required=True, help="zmq address the front pushes requests to")
    p.add_argument("--outputs", required=True, help="zmq address this process pushes step outputs to")
    p.add_argument("--front-pid", type=int, required=True)
    args = p.parse_args(argv)
    die_with_parent(args.front_pid)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s [engine core] %(name)s: %(message)s")
    ctx = zmq.Context()
    inputs = ctx.socket(zmq.PULL)
    inputs.connect(args.inputs)
    outputs = ctx.socket(zmq.PUSH)
    outputs.setsockopt(zmq.LINGER, 5000)  # "bye" and the last step leave before the process does
    outputs.connect(args.outputs)
    try:
        return serve(json.loads(args.config), inputs, _Outbox(outputs))
    finally:
        inputs.close(0)
        outputs.close()
        ctx.term()


if __name__ == "__main__":
    sys.exit(core_main())
