"""Prefill/decode disaggregation between two servers, started as FastDeploy's are:

    ernie-serve --splitwise-role prefill --engine-worker-queue-port 8182 --cache-queue-port 8183 ...  # P
    ernie-serve --splitwise-role decode --engine-worker-queue-port 8186 --cache-queue-port 8187 \
                --innode-prefill-ports 8182 --port 8184 ...                                       # D

    client -> D's ernie_moe: DecodeFront.add_request --[prefill: id, prompt]--> P's PrefillService
                                                                                 AsyncEngine.add_prefill
              AsyncEngine.add_prefilled(KVTransfer) <--[kv: KVTransfer frames]-- (prompt KV, blocks freed)
              decodes, streams as usual

Messages go over pyzmq (DEALER on D, one per prefill port, round robin; ROUTER on P). The KV message is
KVTransfer's header, and its blocks' bytes take the transport the pair negotiated in the hello
(--cache-transfer-protocol; engine/kv_transport.py): "tcp", KVTransfer's frames on these sockets, or "nixl", where
the message carries only where P's registered blocks are, D reads them with NIXL and answers kv_done on its prompt
connection so P lets them go. D's hello lists the transports it takes; P answers with the first of its own list
that D takes, or refuses D's requests naming the flag when they share none (docs/kv-transfer.md).

A prefill server started with --cache-queue-port sends the KV message on a connection of its own, bound there: D
says hello on each prefill port, P answers with its KV port, D connects a second DEALER under the same identity
and says hello on it, and from then on P routes that D's blocks there, so pings, failures and aborts never wait
behind megabytes of KV. Until the hello is through (or without the flag) the KV shares the prompt connection.

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
from ..engine.kv_transport import KVReceiver, KVSender, make_receiver, make_sender, negotiate
from ..kv_protocols import transports
from ..outputs import CompletionOutput, RequestOutput
from ..sampling_params import SamplingParams

log = logging.getLogger(__name__)
PING_SECONDS = 1.0  # while requests wait on a prefill server, it is pinged this often
PREFILL_TIMEOUT_SECONDS = 5.0  # silence (no pong, no KV) after which a prefill server counts as dead
POLL_MS = 200
BUSY_POLL_MS = 1  # while a transport's transfers are in flight, the socket thread moves them along this often
KV_KINDS = (b"kv", b"kv_nixl")  # the KV message, by transport: the bytes themselves, or where to read them


def engine_front(config: EngineConfig):
    """The engine a server's ernie_moe drives: for the mixed role its core in a process of its own unless
    engine_core_process is false (config.py says why), wrapped for prefill / decode."""
    if config.splitwise_role == "mixed" and config.engine_core_process is not False:
        from ..engine.core_client import EngineCoreClient

        return EngineCoreClient(config)
    engine = AsyncEngine(config)
    protocols = transports(config.cache_transfer_protocol)
    if config.splitwise_role == "prefill":
        return PrefillFront(engine, config.engine_worker_queue_port, config.cache_queue_port, protocols)
    if config.splitwise_role == "decode":
        return DecodeFront(engine, config.prefill_ports, queue_port=config.engine_worker_queue_port,
                           kv_port=config.cache_queue_port, protocols=protocols)
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

    def __init__(self, engine: AsyncEngine, port: int, kv_port: int | None = None,
                 protocols: list[str] | None = None):
        super().__init__(engine)
        self.service = PrefillService(engine, port, kv_port, protocols=protocols)

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

    def __init__(self, engine: AsyncEngine, port: int, kv_port: int | None = None, host: str = "127.0.0.1",
                 protocols: list[str] | None = None):
        self.engine, self.port, self.kv_port, self.host = engine, port, kv_port, host
        self.protocols = list(protocols or ["tcp"])
        # tcp is also what a decode server gets before (or without) a hello, as before transports were negotiated
        self._senders: dict[str, KVSender] = {name: make_sender(name, str(port)) for name in {*self.protocols, "tcp"}}
        self._transport: dict[bytes, str] = {}  # decode server -> the transport negotiated in its hello
        self._refused: dict[bytes, str] = {}  # decode servers sharing no transport with this one -> why
        self.by_transport = {name: 0 for name in self._senders}  # KV messages sent per transport (tests, logs)
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
            busy = any(sender.busy for sender in self._senders.values())
            for sock, _ in poller.poll(BUSY_POLL_MS if busy else POLL_MS):
                if sock is self._sock:
                    self._on_message(self._sock.recv_multipart(copy=False))
                elif sock is self._kv_sock:
                    owner, kind = self._kv_sock.recv_multipart()[:2]
                    if kind == b"hello":
                        self._kv_routes.add(owner)
            for frames in self._wake.drain():
                self._send(frames)
            now = time.monotonic()
            for sender in self._senders.values():
                sender.progress()
                sender.expire(now)
        for sock in (self._sock, self._kv_sock, *(s for push in self._push.values() for s in push.sockets())):
            if sock is not None:
                sock.close(0)
        for sender in self._senders.values():
            sender.close()
        self._ctx.term()
        self._wake.close()

    def _send(self, frames: list) -> None:
        """Results go to the decode server's own ports where it has them; else replies go back on the prompt
        socket, and KV on the KV socket once its owner said hello there."""
        if frames[1] == b"kv" and isinstance(frames[2], KVTransfer):
            frames = self._kv_message(frames[0], frames[2])
        push = self._push.get(frames[0])
        sock = push.route(frames[1]) if push is not None else None
        if sock is not None:
            if frames[1] in KV_KINDS:
                where = "decode_kv_socket" if sock is push.kv else "decode_queue_socket"
                self.transfers[where] = self.transfers.get(where, 0) + 1
            sock.send_multipart(frames[1:], copy=False)
            return
        if frames[1] in KV_KINDS:
            on_kv = frames[0] in self._kv_routes
            self.transfers["kv_socket" if on_kv else "prompt_socket"] += 1
            if on_kv:
                self._kv_sock.send_multipart(frames, copy=False)
                return
        self._sock.send_multipart(frames, copy=False)

    def _kv_message(self, owner: bytes, transfer: KVTransfer) -> list:
        """The KV message for `owner` on its transport (on this thread: a sender is not shared)."""
        name = self._transport.get(owner, "tcp")
        try:
            body = self._senders[name].offer(transfer)
        except Exception as e:  # noqa: BLE001 - the decode side is told; the server serves on
            log.exception("prefill server: the %s transport could not offer request %s's KV", name, transfer.request_id)
            return [owner, b"failed", _failure(transfer.request_id, f"the {name} KV transport failed: "
                                                                   f"{type(e).__name__}: {e}")]
        self.by_transport[name] += 1
        return [owner, b"kv" if name == "tcp" else b"kv_" + name.encode(), *body]

    def _hello(self, owner: bytes, msg: dict) -> dict:
        """The answer to a decode server's hello: this server's KV port and the transport the pair uses."""
        accepted = msg.get("kv_transports") or ["tcp"]
        name = negotiate(self.protocols, accepted)
        answer = {"kv_port": self.kv_port, "kv_transport": name}
        if name is None:
            why = (f"prefill server on port {self.port} sends KV over {', '.join(self.protocols)} and this decode "
                   f"server takes {', '.join(accepted)}: give both the same --cache-transfer-protocol")
            self._refused[owner] = answer["error"] = why
            log.error("%s", why)
            return answer
        self._refused.pop(owner, None)
        self._transport[owner] = name
        answer[name] = self._senders[name].hello()
        return answer

    def _on_message(self, frames) -> None:
        owner, kind, body = frames[0].bytes, frames[1].bytes, [f.bytes for f in frames[2:]]
        if kind == b"ping":
            self._sock.send_multipart([owner, b"pong"])
        elif kind == b"hello":
            msg = json.loads(body[0]) if body else {}
            self._connect_back(owner, msg)
            self._sock.send_multipart([owner, b"hello", json.dumps(self._hello(owner, msg)).encode()])
        elif kind == b"kv_done":
            self._senders[self._transport.get(owner, "tcp")].release(body[0].decode())
        elif kind == b"prefill":
            msg = json.loads(body[0])
            rid = msg["request_id"]
            if owner in self._refused:
                self._send([owner, b"failed", _failure(rid, self._refused[owner])])
                return
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
            self._wake.put([owner, b"kv", transfer])  # the socket thread makes the message (_kv_message)
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
        return (self.kv or self.results) if kind in KV_KINDS else self.results

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
    refusal: str | None = None  # it shares no KV transport with this server: why (its answer to the hello)


class DecodeFront(_Front):
    """A decode server's engine: prompts go to the prefill servers, their KV comes back and is decoded here."""

    def __init__(self, engine: AsyncEngine, prefill_ports: list[int], host: str = "127.0.0.1",
                 queue_port: int | None = None, kv_port: int | None = None, protocols: list[str] | None = None):
        super().__init__(engine)
        self._lock = threading.Lock()
        self._waiting: dict[str, _Waiting] = {}
        self._ctx = zmq.Context()
        self._host = host
        self.queue_port, self.kv_port = queue_port, kv_port
        self.protocols = list(protocols or ["tcp"])
        me = uuid.uuid4().hex[:12]
        # tcp frames are read whatever was negotiated: a prefill server that missed the hello sends them
        self._receivers: dict[str, KVReceiver] = {name: make_receiver(name, me) for name in {*self.protocols, "tcp"}}
        self._reading: dict[str, _PrefillServer] = {}  # request id -> the server its KV is being read from
        self.received = {name: 0 for name in self._receivers}  # KV received per transport (tests, logs)
        # this server's own ports (bound before any hello names them): prefill servers send results there
        self._own = [self._bind(port) for port in (queue_port, kv_port) if port is not None]
        hello = json.dumps({"queue_port": queue_port, "kv_port": kv_port, "kv_transports": self.protocols}).encode()
        self._servers = []
        self._by_identity: dict[bytes, _PrefillServer] = {}
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
            busy = any(receiver.busy for receiver in self._receivers.values())
            for sock, _ in poller.poll(BUSY_POLL_MS if busy else POLL_MS):
                if sock in self._own:
                    self._on_own_port(sock.recv_multipart(copy=False))
                elif sock in by_sock:
                    server = by_sock[sock]
                    server.last_heard = time.monotonic()
                    frames = sock.recv_multipart(copy=False)
                    if frames[0].bytes == b"hello":
                        self._on_hello(server, json.loads(frames[1].bytes), poller, by_sock)
                    else:
                        self._on_message(server, frames)
            for server, frames, rid in self._wake.drain():
                if rid is not None:
                    if server.refusal is not None:
                        self._refuse(rid, server)
                        continue
                    if not server.waiting:
                        server.last_heard = time.monotonic()  # the silence clock starts with the first request
                    server.waiting.add(rid)
                server.sock.send_multipart(frames)
            self._take_received()
            self._watch_servers()
        for sock in (*self._own, *(s for server in self._servers for s in (server.sock, server.kv_sock))):
            if sock is not None:
                sock.close(0)
        for receiver in self._receivers.values():
            receiver.close()
        self._ctx.term()
        self._wake.close()

    def _on_hello(self, server: _PrefillServer, answer: dict, poller: zmq.Poller, by_sock: dict) -> None:
        """A prefill server's answer to the hello: the KV transport the pair uses (or why none), its KV port."""
        name = answer.get("kv_transport", "tcp")
        if answer.get("error") or name not in self._receivers:
            server.refusal = (answer.get("error") or f"prefill server {server.address} sends KV over {name!r}, which "
                              f"this decode server does not take ({', '.join(self.protocols)}): give both the same "
                              f"--cache-transfer-protocol")
            log.error("decode server: %s", server.refusal)
            for rid in list(server.waiting):
                self._refuse(rid, server)
            return
        try:
            self._receivers[name].connect(answer.get(name) or {})
        except Exception as e:  # noqa: BLE001 - that server's requests fail with why; the others are served
            server.refusal = f"prefill server {server.address}: could not connect its {name} KV transport: {e}"
            log.exception("decode server: %s", server.refusal)
            return
        log.info("decode server: KV from prefill server %s comes over %s", server.address, name)
        self._connect_kv(server, answer.get("kv_port"), poller, by_sock)

    def _refuse(self, rid: str, server: _PrefillServer) -> None:
        server.waiting.discard(rid)
        with self._lock:
            waiting = self._waiting.pop(rid, None)
        if waiting is not None:
            self._fail(rid, waiting, server.refusal)

    def _on_own_port(self, frames: list) -> None:
        """A prefill server's result on one of this server's own ports, signed with its identity."""
        server = self._by_identity.get(frames[0].bytes)
        if server is None:
            log.warning("decode server: a message from %r, which is not one of its prefill servers", frames[0].bytes)
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

    def _on_message(self, server: _PrefillServer, frames: list) -> None:
        """frames: zmq Frames (the KV's bytes are read from them without a copy)."""
        kind = frames[0].bytes
        if kind in KV_KINDS:
            name = "tcp" if kind == b"kv" else kind[3:].decode()
            receiver = self._receivers.get(name)
            if receiver is None:
                log.error("decode server: prefill server %s sent KV over %r, which it does not take", server.address,
                          name)
                return
            self._reading[receiver.receive(frames[1:])] = server
            self.received[name] += 1
        elif kind == b"failed":
            msg = json.loads(frames[1].bytes)
            server.waiting.discard(msg["request_id"])
            with self._lock:
                waiting = self._waiting.pop(msg["request_id"], None)
            if waiting is not None:
                self._fail(msg["request_id"], waiting, f"prefill server {server.address}: {msg['error']}")

    def _take_received(self) -> None:
        """Receives that ended: the prefill server may let the bytes go (kv_done), the request decodes or fails."""
        for receiver in self._receivers.values():
            for got in receiver.poll():
                server = self._reading.pop(got.request_id, None)
                if server is None:
                    continue
                server.waiting.discard(got.request_id)
                if receiver.acknowledges:
                    server.sock.send_multipart([b"kv_done", got.request_id.encode()])
                log.debug("decode server: request %s's KV, %d bytes over %s in %.1f ms", got.request_id, got.nbytes,
                          receiver.name, got.seconds * 1e3)
                if got.transfer is not None:
                    self._continue(got.transfer)
                    continue
                with self._lock:
                    waiting = self._waiting.pop(got.request_id, None)
                if waiting is not None:
                    self._fail(got.request_id, waiting, f"prefill server {server.address}: {got.error}")

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
