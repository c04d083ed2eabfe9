"""Prefill/decode disaggregation between two servers, started as FastDeploy's are:

    ernie-serve --splitwise-role prefill --engine-worker-queue-port 8182 --cache-queue-port 8183 ...  # P
    ernie-serve --splitwise-role decode --engine-worker-queue-port 8186 --cache-queue-port 8187 \
                --innode-prefill-ports 8182 --port 8184 ...                                       # D

    client -> D's ernie_moe: DecodeFront.add_request --[prefill: id, prompt]--> P's PrefillService
                                                                                 AsyncEngine.add_prefill
              AsyncEngine.add_prefilled(KVTransfer) <--[kv: KVTransfer frames]-- (prompt KV, blocks freed)
              decodes, streams as usual

Messages go over pyzmq (DEALER on D, one per prefill port, round robin; ROUTER on P); the KV travels as
KVTransfer's frames (a JSON header and the raw blocks). A prefill server started with --cache-queue-port sends
the KV on a connection of its own, bound there: D says hello on each prefill port, P answers with its KV port,
D connects a second DEALER under the same identity and says hello on it, and from then on P routes that D's
blocks there, so pings, failures and aborts never wait behind megabytes of KV. Until the hello is through
(or without the flag) the KV shares the prompt connection.

A decode server's own ports (in FastDeploy each instance has its own queues): it binds a ROUTER on each it is
given and names them in its hello; each prefill server then opens a connection to them, signed with its queue
port, and sends this decode server's results there: the KV to its --cache-queue-port, failures (and the KV when
it has no KV port) to its --engine-worker-queue-port. A decode server with ports of its own does not connect to
the prefill servers' KV ports. FastDeploy's P samples the first token and D
appends it; here P computes the prompt's KV only and D recomputes the last prompt token and samples every
token itself with the request's own parameters and generator, so a 1P1D pair gives what one mixed server
gives for every kind of request (seeded sampling, guided decoding, penalties), at the cost of one token
of prefill on D.

Cancellation: an abort on D while the prompt is at P is sent on to P (which aborts it there and frees its
blocks) and ends the request on D at once; after the KV arrived it is a plain abort on D (P freed the
blocks when it exported them). A prefill server that dies (or stops answering its pings) fails every
request waiting on it with an error naming it, after at most PREFILL_TIMEOUT_SECONDS.
A prefill server takes requests only from decode servers: sent to it directly, a request is refused.
"""
from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field, replace
from itertools import cycle

import zmq

from ..config import EngineConfig
from ..engine.async_engine import (AsyncEngine, EngineDeadError, EngineOverloadedError, OutputCallback,
                                   RequestFailedError)
from ..engine.kv_transfer import KVTransfer
from ..outputs import CompletionOutput, RequestOutput
from ..sampling_params import SamplingParams

log = logging.getLogger(__name__)
PING_SECONDS = 1.0  # while requests wait on a prefill server, it is pinged this often
PREFILL_TIMEOUT_SECONDS = 5.0  # silence (no pong, no KV) after which a prefill server counts as dead
POLL_MS = 200


def engine_front(config: EngineConfig):
    """The engine a server's ernie_moe drives: as it is for the mixed role, wrapped for prefill / decode."""
    engine = AsyncEngine(config)
    if config.splitwise_role == "prefill":
        return PrefillFront(engine, config.engine_worker_queue_port, config.cache_queue_port)
    if config.splitwise_role == "decode":
        return DecodeFront(engine, config.prefill_ports, queue_port=config.engine_worker_queue_port,
                           kv_port=config.cache_queue_port)
    return engine


class _Wakeup:
    """A pipe a zmq.Poller watches, so other threads can hand the socket's owner thread work to send."""

    def __init__(self):
        self.read_fd, self.write_fd = os.pipe()
        os.set_blocking(self.read_fd, False)
        self.outbox: queue.SimpleQueue = queue.SimpleQueue()

    def put(self, item) -> None:
        self.outbox.put(item)
        os.write(self.write_fd, b"x")

    def drain(self) -> list:
        try:
            os.read(self.read_fd, 4096)
        except BlockingIOError:
            pass
        items = []
        while not self.outbox.empty():
            items.append(self.outbox.get())
        return items

    def close(self) -> None:
        os.close(self.read_fd)
        os.close(self.write_fd)


class _Front:
    """What EngineModel drives, over an AsyncEngine: the role decides add_request and abort."""

    def __init__(self, engine: AsyncEngine):
        self.engine = engine
        self.config = engine.config

    @property
    def step_listeners(self) -> list:
        return self.engine.step_listeners

    @property
    def is_healthy(self) -> bool:
        return self.engine.is_healthy

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def stats(self) -> dict:
        return self.engine.stats()

    def abort(self, request_id: str) -> bool:
        return self.engine.abort(request_id)

    def shutdown(self, drain: bool = True, timeout: float = 30.0) -> None:
        self.engine.shutdown(drain=drain, timeout=timeout)


# ---------------------------------------------------------------- prefill role
class PrefillFront(_Front):
    """A prefill server's engine: prefills for decode servers on `port`, refuses direct requests."""

    def __init__(self, engine: AsyncEngine, port: int, kv_port: int | None = None):
        super().__init__(engine)
        self.service = PrefillService(engine, port, kv_port)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    callback: OutputCallback) -> None:
        raise ValueError("this is a prefill server (splitwise_role=prefill): it only prefills for decode servers; "
                         "send requests to a decode server (--splitwise-role decode --innode-prefill-ports "
                         f"{self.service.port})")

    def shutdown(self, drain: bool = True, timeout: float = 30.0) -> None:
        self.service.close()
        super().shutdown(drain, timeout)


class PrefillService:
    """The prefill side of the protocol: a ROUTER socket on 127.0.0.1:port (and one on kv_port for the KV, when
    given), owned by one thread."""

    def __init__(self, engine: AsyncEngine, port: int, kv_port: int | None = None, host: str = "127.0.0.1"):
        self.engine, self.port, self.kv_port, self.host = engine, port, kv_port, host
        self._ctx = zmq.Context()
        self._sock = self._router(host, port)
        self._kv_sock = self._router(host, kv_port) if kv_port is not None else None
        self._kv_routes: set[bytes] = set()  # decode servers that said hello on the KV socket
        self._push: dict[bytes, _Push] = {}  # decode servers with ports of their own: connections to them
        self.transfers = {"prompt_socket": 0, "kv_socket": 0}  # where each KVTransfer went (for tests and logs)
        self._wake = _Wakeup()
        self._stop = threading.Event()
        self._owners: dict[str, bytes] = {}  # request id -> the decode server's socket identity
        self._thread = threading.Thread(target=self._loop, name="ernie-prefill-service", daemon=True)
        self._thread.start()
        log.info("prefill server: taking prompts from decode servers on tcp://%s:%d%s", host, port,
                 f", sending their KV on tcp://{host}:{kv_port}" if kv_port is not None else "")

    def _router(self, host: str, port: int) -> zmq.Socket:
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(f"tcp://{host}:{port}")
        return sock

    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        if self._kv_sock is not None:
            poller.register(self._kv_sock, zmq.POLLIN)
        poller.register(self._wake.read_fd, zmq.POLLIN)
        while not self._stop.is_set():
            for sock, _ in poller.poll(POLL_MS):
                if sock is self._sock:
                    self._on_message(self._sock.recv_multipart(copy=False))
                elif sock is self._kv_sock:
                    owner, kind = self._kv_sock.recv_multipart()[:2]
                    if kind == b"hello":
                        self._kv_routes.add(owner)
            for frames in self._wake.drain():
                self._send(frames)
        for sock in (self._sock, self._kv_sock, *(s for push in self._push.values() for s in push.sockets())):
            if sock is not None:
                sock.close(0)
        self._ctx.term()
        self._wake.close()

    def _send(self, frames: list) -> None:
        """Results go to the decode server's own ports where it has them; else replies go back on the prompt
        socket, and KV on the KV socket once its owner said hello there."""
        push = self._push.get(frames[0])
        sock = push.route(frames[1]) if push is not None else None
        if sock is not None:
            if frames[1] == b"kv":
                where = "decode_kv_socket" if sock is push.kv else "decode_queue_socket"
                self.transfers[where] = self.transfers.get(where, 0) + 1
            sock.send_multipart(frames[1:], copy=False)
            return
        if frames[1] == b"kv":
            on_kv = frames[0] in self._kv_routes
            self.transfers["kv_socket" if on_kv else "prompt_socket"] += 1
            if on_kv:
                self._kv_sock.send_multipart(frames, copy=False)
                return
        self._sock.send_multipart(frames, copy=False)

    def _on_message(self, frames) -> None:
        owner, kind, body = frames[0].bytes, frames[1].bytes, [f.bytes for f in frames[2:]]
        if kind == b"ping":
            self._sock.send_multipart([owner, b"pong"])
        elif kind == b"hello":
            self._connect_back(owner, json.loads(body[0]) if body else {})
            self._sock.send_multipart([owner, b"hello", json.dumps({"kv_port": self.kv_port}).encode()])
        elif kind == b"prefill":
            msg = json.loads(body[0])
            rid = msg["request_id"]
            self._owners[rid] = owner
            try:
                self.engine.add_prefill(rid, msg["prompt_token_ids"], lambda t, why, rid=rid: self._done(rid, t, why))
            except Exception as e:  # noqa: BLE001 - bad prompt, overload, dead engine: the decode side is told
                self._owners.pop(rid, None)
                self._send([owner, b"failed", _failure(rid, f"{type(e).__name__}: {e}")])
        elif kind == b"cancel":
            self.engine.abort(body[0].decode())

    def _connect_back(self, owner: bytes, ports: dict) -> None:
        """A decode server named its own ports in its hello: its results go there, from this server's identity."""
        if not (ports.get("queue_port") or ports.get("kv_port")) or owner in self._push:
            return
        self._push[owner] = _Push(*(self._dealer(ports.get(k)) for k in ("queue_port", "kv_port")))
        log.info("prefill server: results for decode server %s go to its ports %s", owner.decode(errors="replace"),
                 {k: v for k, v in ports.items() if v})

    def _dealer(self, port: int | None) -> zmq.Socket | None:
        if port is None:
            return None
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IDENTITY, prefill_identity(self.port))
        sock.connect(f"tcp://{self.host}:{int(port)}")
        return sock

    def _done(self, rid: str, transfer: KVTransfer | None, why: str | None) -> None:
        """On the engine's loop thread: hand the result to the socket's thread."""
        owner = self._owners.pop(rid, None)
        if owner is None or self._stop.is_set():
            return
        if transfer is not None:
            self._wake.put([owner, b"kv", *transfer.to_frames()])
        else:
            self._wake.put([owner, b"failed", _failure(rid, why or "the prefill server ended it")])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)


@dataclass
class _Push:
    """A prefill server's connections to one decode server's own ports: results (failures, and the KV when it
    has no KV port) to its queue port, KV to its KV port."""
    results: zmq.Socket | None
    kv: zmq.Socket | None

    def route(self, kind: bytes) -> zmq.Socket | None:
        return (self.kv or self.results) if kind == b"kv" else self.results

    def sockets(self) -> tuple:
        return self.results, self.kv


def prefill_identity(port: int) -> bytes:
    """How a prefill server signs what it sends to a decode server's own ports: by its queue port, which the
    decode server knows from --innode-prefill-ports."""
    return f"prefill-{port}".encode()


def _failure(rid: str, why: str) -> bytes:
    return json.dumps({"request_id": rid, "error": why}).encode()


# ---------------------------------------------------------------- decode role
@dataclass
class _Waiting:
    """A request whose prompt is at a prefill server."""
    params: SamplingParams
    prompt_token_ids: list[int]
    callback: OutputCallback
    server: "_PrefillServer"


@dataclass
class _PrefillServer:
    address: str
    sock: zmq.Socket
    identity: bytes
    kv_sock: zmq.Socket | None = None  # its --cache-queue-port connection, once it said where that is
    waiting: set[str] = field(default_factory=set)
    last_heard: float = 0.0
    last_ping: float = 0.0


class DecodeFront(_Front):
    """A decode server's engine: prompts go to the prefill servers, their KV comes back and is decoded here."""

    def __init__(self, engine: AsyncEngine, prefill_ports: list[int], host: str = "127.0.0.1",
                 queue_port: int | None = None, kv_port: int | None = None):
        super().__init__(engine)
        self._lock = threading.Lock()
        self._waiting: dict[str, _Waiting] = {}
        self._ctx = zmq.Context()
        self._host = host
        self.queue_port, self.kv_port = queue_port, kv_port
        # this server's own ports (bound before any hello names them): prefill servers send results there
        self._own = [self._bind(port) for port in (queue_port, kv_port) if port is not None]
        hello = json.dumps({"queue_port": queue_port, "kv_port": kv_port}).encode()
        self._servers = []
        self._by_identity: dict[bytes, _PrefillServer] = {}
        me = uuid.uuid4().hex[:12]
        for i, port in enumerate(prefill_ports):
            identity = f"decode-{me}-{i}".encode()
            server = _PrefillServer(f"{host}:{port}", self._dealer(identity, port), identity)
            server.sock.send_multipart([b"hello", hello])  # queued until connected; the answer names its KV port
            self._servers.append(server)
            self._by_identity[prefill_identity(port)] = server
        if self._own:
            log.info("decode server: prefill servers send results to %s", ", ".join(
                f"tcp://{host}:{p} ({what})" for p, what in ((queue_port, "queue"), (kv_port, "KV")) if p))
        self._next_server = cycle(self._servers)
        self._wake = _Wakeup()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="ernie-prefill-client", daemon=True)
        self._thread.start()

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    callback: OutputCallback) -> None:
        """Validate here (bad input raises at once, as on a mixed server), then send the prompt to prefill."""
        self.engine.engine.make_request_group(request_id, prompt_token_ids, params)  # touches no engine state
        if not self.engine.is_healthy:
            raise EngineDeadError(f"engine is not running: {self.engine.error}")
        with self._lock:
            if request_id in self._waiting:
                raise ValueError(f"request_id {request_id!r} is already in use")
            waiting = len(self._waiting) + self.engine.stats()["num_waiting"]
            if waiting >= self.config.max_waiting_requests:
                raise EngineOverloadedError(f"overloaded: {waiting} requests already waiting "
                                            f"(max_waiting_requests={self.config.max_waiting_requests})")
            server = next(self._next_server)
            self._waiting[request_id] = _Waiting(params, list(prompt_token_ids), callback, server)
        body = json.dumps({"request_id": request_id, "prompt_token_ids": list(prompt_token_ids)}).encode()
        self._wake.put((server, [b"prefill", body], request_id))

    def abort(self, request_id: str) -> bool:
        with self._lock:
            waiting = self._waiting.pop(request_id, None)
        if waiting is None:
            return self.engine.abort(request_id)
        self._wake.put((waiting.server, [b"cancel", request_id.encode()], None))
        waiting.callback(_ended(request_id, waiting.prompt_token_ids, "abort"), None)
        return True

    def shutdown(self, drain: bool = True, timeout: float = 30.0) -> None:
        self._stop.set()
        self._thread.join(5)
        with self._lock:
            waiting, self._waiting = self._waiting, {}
        for rid, w in waiting.items():
            self._fail(rid, w, "unavailable: the server shut down before the prompt came back from prefill")
        super().shutdown(drain, timeout)

    def _bind(self, port: int) -> zmq.Socket:
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(f"tcp://{self._host}:{port}")
        return sock

    def _dealer(self, identity: bytes, port: int) -> zmq.Socket:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IDENTITY, identity)  # the same on both connections: P routes KV by it
        sock.connect(f"tcp://{self._host}:{port}")
        return sock

    # ------------------------------------------------------------ the socket thread
    def _loop(self) -> None:
        poller = zmq.Poller()
        for server in self._servers:
            poller.register(server.sock, zmq.POLLIN)
        for sock in self._own:
            poller.register(sock, zmq.POLLIN)
        poller.register(self._wake.read_fd, zmq.POLLIN)
        by_sock = {s.sock: s for s in self._servers}
        while not self._stop.is_set():
            for sock, _ in poller.poll(POLL_MS):
                if sock in self._own:
                    self._on_own_port(sock.recv_multipart())
                elif sock in by_sock:
                    server = by_sock[sock]
                    server.last_heard = time.monotonic()
                    frames = sock.recv_multipart()
                    if frames[0] == b"hello":
                        self._connect_kv(server, json.loads(frames[1]).get("kv_port"), poller, by_sock)
                    else:
                        self._on_message(server, frames)
            for server, frames, rid in self._wake.drain():
                if rid is not None:
                    if not server.waiting:
                        server.last_heard = time.monotonic()  # the silence clock starts with the first request
                    server.waiting.add(rid)
                server.sock.send_multipart(frames)
            self._watch_servers()
        for sock in (*self._own, *(s for server in self._servers for s in (server.sock, server.kv_sock))):
            if sock is not None:
                sock.close(0)
        self._ctx.term()
        self._wake.close()

    def _on_own_port(self, frames: list[bytes]) -> None:
        """A prefill server's result on one of this server's own ports, signed with its identity."""
        server = self._by_identity.get(frames[0])
        if server is None:
            log.warning("decode server: a message from %r, which is not one of its prefill servers", frames[0])
            return
        server.last_heard = time.monotonic()
        self._on_message(server, frames[1:])

    def _connect_kv(self, server: _PrefillServer, kv_port: int | None, poller: zmq.Poller, by_sock: dict) -> None:
        """The prefill server has a KV port: connect to it under this server's identity and say hello there
        (not when this server has ports of its own: the prefill server sends the KV there)."""
        if kv_port is None or server.kv_sock is not None or self._own:
            return
        server.kv_sock = self._dealer(server.identity, int(kv_port))
        server.kv_sock.send_multipart([b"hello"])
        poller.register(server.kv_sock, zmq.POLLIN)
        by_sock[server.kv_sock] = server
        log.info("decode server: KV from prefill server %s comes on port %s", server.address, kv_port)

    def _on_message(self, server: _PrefillServer, frames: list[bytes]) -> None:
        kind = frames[0]
        if kind == b"kv":
            transfer = KVTransfer.from_frames(frames[1:])
            server.waiting.discard(transfer.request_id)
            self._continue(transfer)
        elif kind == b"failed":
            msg = json.loads(frames[1])
            server.waiting.discard(msg["request_id"])
            with self._lock:
                waiting = self._waiting.pop(msg["request_id"], None)
            if waiting is not None:
                self._fail(msg["request_id"], waiting, f"prefill server {server.address}: {msg['error']}")

    def _continue(self, transfer: KVTransfer) -> None:
        """The prompt's KV is here: decode it. The last prompt token is left to compute (see the module doc)."""
        failure = None
        with self._lock:  # atomically from waiting to the engine, so an abort finds the request in one of them
            waiting = self._waiting.pop(transfer.request_id, None)
            if waiting is None:
                return  # aborted while at prefill
            n = len(transfer.prompt_token_ids) - 1
            blocks = -(-n // transfer.block_size)
            kv = replace(transfer, output_token_ids=[], num_computed_tokens=n, blocks=transfer.blocks.first(blocks))
            try:
                self.engine.add_prefilled(kv, waiting.params, waiting.callback)
            except Exception as e:  # noqa: BLE001 - the request ends, with why
                failure = f"{type(e).__name__}: {e}"
        if failure is not None:
            self._fail(transfer.request_id, waiting, failure)

    def _watch_servers(self) -> None:
        now = time.monotonic()
        for server in self._servers:
            if not server.waiting:
                continue
            if now - server.last_heard > PREFILL_TIMEOUT_SECONDS:
                self._fail_server(server, now - server.last_heard)
            elif now - server.last_ping > PING_SECONDS:
                server.sock.send_multipart([b"ping"])
                server.last_ping = now

    def _fail_server(self, server: _PrefillServer, silent: float) -> None:
        why = (f"prefill server {server.address} has not answered for {silent:.0f} s (it died or hung); "
               f"the request was not completed")
        log.error("%s: failing %d request(s) waiting on it", why, len(server.waiting))
        rids, server.waiting = server.waiting, set()
        for rid in rids:
            with self._lock:
                waiting = self._waiting.pop(rid, None)
            if waiting is not None:
                self._fail(rid, waiting, why)

    @staticmethod
    def _fail(rid: str, waiting: _Waiting, why: str) -> None:
        waiting.callback(_ended(rid, waiting.prompt_token_ids, "error", why), RequestFailedError(why))


def _ended(rid: str, prompt_token_ids: list[int], finish_reason: str, error: str | None = None) -> RequestOutput:
    """The final output of a request that ended before reaching the decode engine."""
    return RequestOutput(rid, None, list(prompt_token_ids),
                         [CompletionOutput(index=0, text="", token_ids=[], finish_reason=finish_reason)],
                         finished=True, error=error)
