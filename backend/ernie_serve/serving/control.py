"""The control channel of an engine instance: aborts and progress from the detokenizer, drain from the launcher.

Why it exists: Triton (2.51) does not pass an ensemble's cancellation to a step that is already
running; it marks only the step requests it creates afterwards (measured: the decoupled ernie_moe
request never sees is_cancelled(), every later ernie_detokenizer request does). So the detokenizer,
on its first cancelled request, sends the request key to the engine instance named in the request's
metadata, and that instance aborts it, freeing its KV blocks. Triton has no way either to tell a
python model that the server is stopping, so the launcher sends `drain` here before it stops
tritonserver (see launcher.TritonServer.stop).

One Linux abstract-namespace datagram socket per engine instance: no files to clean up, no port.
Abstract sockets have no permissions, so each datagram's sender is checked by the kernel-supplied
credentials (SO_PASSCRED): only processes of this user are obeyed. The launcher finds an instance's
socket in /proc/net/unix by the stub's pid, which is part of the address.

Progress: the detokenizer reports, for each stream, how many of ernie_moe's responses it has processed, so
that ernie_moe can pace the stream (engine_model.py): a response waiting in tritonserver's queue in front of a
lagging detokenizer costs a hop at each of tritonserver, the stub IPC and the detokenizer, while tokens held in
ernie_moe join the stream's next response for free. Reports are batched (ProgressReporter): one datagram per
PROGRESS_PERIOD at most, however many streams moved.

Abort by Triton request id: a client on this host that streams through Triton (the OpenAI shim) ends a stream
it abandons with `abort-id <request id>` instead of a gRPC cancellation: tritonserver 2.51 can deadlock when a
stream's cancellation meets an ensemble response on the same stream (docs/reliability.md). The id is the one the client
set on its Triton request; the ensemble passes it to each step, so ernie_moe sees it as `request.request_id()`. It
is everything after the first space, taken verbatim (spaces included, no trimming) and compared exactly with the
id each live stream was submitted with; an empty id matches nothing, an id no live stream has is a no-op. Every
live stream of the instance with that id is aborted and ends as a cancelled one does. A client finds the instances
with `engine_addresses` (only this user's, only those of the tritonserver on a given port).

Messages: `abort <request key>`, `abort-id <request id>`, `drain <seconds>`,
`progress <key>=<responses processed> ...`.
"""
from __future__ import annotations

import logging
import os
import socket
import struct
import threading
import time
import uuid
from pathlib import Path
from typing import Callable

from .health import process_state

log = logging.getLogger(__name__)
_MAX_DATAGRAM = 4096
PROGRESS_PERIOD = 0.002  # seconds a progress report waits to gather more streams' progress
_CREDENTIALS = struct.Struct("3i")  # struct ucred: pid, uid, gid
TAG = "ernie-moe"
ABORT_ID = "abort-id"


class ControlListener:
    """Receives control messages and hands them to `on_abort(key)` / `on_abort_id(request id)` /
    `on_drain(seconds)` / `on_progress([(key, responses processed), ...])` on its own thread."""

    def __init__(self, on_abort: Callable[[str], None], tag: str = TAG,
                 on_drain: Callable[[float], None] | None = None,
                 on_progress: Callable[[list[tuple[str, int]]], None] | None = None,
                 on_abort_id: Callable[[str], None] | None = None):
        self.address = f"\0{tag}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        self._sock.bind(self.address)
        self._sock.settimeout(0.5)
        self._on_abort = on_abort
        self._on_drain = on_drain
        self._on_progress = on_progress
        self._on_abort_id = on_abort_id
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ernie-control-listener", daemon=True)
        self._thread.start()

    @property
    def public_address(self) -> str:
        """The address as it can travel in JSON (the leading NUL marks the abstract namespace)."""
        return "@" + self.address[1:]

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                data, ancillary, _, _ = self._sock.recvmsg(_MAX_DATAGRAM, socket.CMSG_SPACE(_CREDENTIALS.size))
            except socket.timeout:
                continue
            except OSError:
                return
            if _sender_uid(ancillary) != os.getuid():
                log.warning("control message from another user ignored")
                continue
            try:
                self._handle(data.decode("utf-8", "replace"))
            except Exception:  # noqa: BLE001 - one bad message must not stop the listener
                log.exception("control message %r failed", data[:100])

    def _handle(self, message: str) -> None:
        verb, _, arg = message.partition(" ")
        if verb == "abort":
            self._on_abort(arg)
        elif verb == ABORT_ID and self._on_abort_id is not None:
            self._on_abort_id(arg)
        elif verb == "progress" and self._on_progress is not None:
            self._on_progress([(key, int(n)) for key, _, n in (pair.rpartition("=") for pair in arg.split())])
        elif verb == "drain" and self._on_drain is not None:
            self._on_drain(float(arg))
        else:
            log.warning("unknown control message %r", message[:100])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self._sock.close()


def _sender_uid(ancillary: list) -> int | None:
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS and len(data) >= _CREDENTIALS.size:
            return _CREDENTIALS.unpack(data[:_CREDENTIALS.size])[1]
    return None


def _socket_address(address: str) -> str:
    """A public address ('@' for the abstract namespace, as it travels in JSON) as the socket takes it."""
    return "\0" + address[1:] if address.startswith("@") else address


def _send(address: str, message: str) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        try:
            s.sendto(message.encode("utf-8"), _socket_address(address))
            return True
        except OSError as e:
            log.warning("could not send %r to %s: %s", message[:100], address, e)
            return False


def send_abort(address: str, key: str) -> bool:
    """Ask the engine instance at `address` to abort request `key`; False if it is gone."""
    return bool(address) and _send(address, f"abort {key}")


def send_abort_id(address: str, request_id: str) -> bool | None:
    """Ask the engine instance at `address` to abort every live stream of Triton request `request_id`. True: queued
    there; None: the instance is there but its queue is full (a busy listener; send it again later); False: it is
    gone, or the id cannot travel (empty, or longer than a datagram). Never blocks: the shim calls it on its event
    loop."""
    message = f"{ABORT_ID} {request_id}".encode("utf-8")
    if not request_id or len(message) > _MAX_DATAGRAM:
        return False
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.setblocking(False)
        try:
            s.sendto(message, _socket_address(address))
            return True
        except BlockingIOError:
            return None
        except OSError as e:
            log.debug("abort-id not sent to %s: %s", address, e)
            return False


def send_drain(address: str, seconds: float) -> bool:
    """Ask the engine instance at `address` to refuse new requests and to end the ones still running
    after `seconds` with an error; False if it is gone."""
    return _send(address, f"drain {seconds:g}")


class ProgressReporter:
    """Batches progress reports to engine instances: `note` records a stream's count (cheap, any thread); a
    thread sends what was noted, one datagram per engine instance, PROGRESS_PERIOD after the first note."""

    def __init__(self, period: float = PROGRESS_PERIOD):
        self.period = period
        self._pending: dict[str, dict[str, int]] = {}  # address -> key -> responses processed
        self._lock = threading.Lock()
        self._noted = threading.Event()
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.setblocking(False)  # a full or gone engine socket must never stall the detokenizer
        self._thread = threading.Thread(target=self._run, name="ernie-progress-reports", daemon=True)
        self._thread.start()

    def note(self, address: str, key: str, processed: int) -> None:
        with self._lock:
            self._pending.setdefault(address, {})[key] = processed
        self._noted.set()

    def _run(self) -> None:
        while True:
            self._noted.wait()
            time.sleep(self.period)
            self._noted.clear()
            with self._lock:
                pending, self._pending = self._pending, {}
            for address, counts in pending.items():
                self._send(address, counts)

    def _send(self, address: str, counts: dict[str, int]) -> None:
        raw = _socket_address(address)
        pairs = [f"{key}={n}" for key, n in counts.items()]
        while pairs:
            message, size = ["progress"], len("progress")
            while pairs and size + 1 + len(pairs[-1]) <= _MAX_DATAGRAM:
                size += 1 + len(pairs[-1])
                message.append(pairs.pop())
            if len(message) == 1:  # one key longer than a datagram: not ours, drop it
                pairs.pop()
                continue
            try:
                self._sock.sendto(" ".join(message).encode("utf-8"), raw)
            except OSError as e:  # engine gone or its queue full: the engine's hold times out instead
                log.debug("progress report to %s not sent: %s", address, e)
                return


def _bound_names(prefix: str) -> set[str]:
    """The unix socket names on this host that start with `prefix` (from /proc/net/unix; '@' marks abstract names)."""
    try:
        lines = Path("/proc/net/unix").read_text().splitlines()[1:]
    except OSError:
        return set()
    return {name for name in (line.split()[-1] for line in lines) if name.startswith(prefix)}


def listener_addresses(pid: int, tag: str = TAG) -> list[str]:
    """The control addresses bound by process `pid`."""
    return sorted(_bound_names(f"@{tag}-{pid}-"))


def engine_addresses(server_port: int | None = None, tag: str = TAG) -> list[str]:
    """The control addresses of this user's engine instances on this host, from /proc/net/unix. With
    `server_port`: only those whose tritonserver (the instance's parent process) listens on that TCP port, so that
    a client aborts in the server it talks to and in no other. Imports nothing heavy: the shim calls it."""
    from ..ports import listeners_owned_by

    prefix = f"@{tag}-"
    by_pid: dict[int, list[str]] = {}
    for name in _bound_names(prefix):
        pid = name[len(prefix):].split("-", 1)[0]
        if pid.isdigit():
            by_pid.setdefault(int(pid), []).append(name)
    found: list[str] = []
    owns_port: dict[int, bool] = {}
    for pid, names in by_pid.items():
        parent = _own_parent(pid)
        if parent is None:
            continue
        if server_port is not None:
            if parent not in owns_port:
                owns_port[parent] = listeners_owned_by(server_port, [parent])
            if not owns_port[parent]:
                continue
        found.extend(names)
    return sorted(set(found))


def _own_parent(pid: int) -> int | None:
    """The parent of process `pid` if it is alive and this user's, else None."""
    try:
        if os.stat(f"/proc/{pid}").st_uid != os.getuid():
            return None
    except OSError:
        return None
    stat = process_state(pid)
    return None if stat is None else stat[1]
