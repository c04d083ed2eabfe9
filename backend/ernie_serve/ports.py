"""Ports for the servers this package starts (tritonserver, the shim, tensor-parallel workers, KV transfer).

A port handed out stays reserved, across processes, for as long as the process that took it lives: it holds an
exclusive flock on RESERVATIONS/<port>.lock (released by the kernel when the process exits, however it exits), and
every free_port skips ports another process holds. Two test runs, benchmarks or servers started side by side on one
machine therefore never pick the same port between one's pick and its server's bind (a stranger's server on the
port answered one CI run's shim tests with 405s). The lock files are never removed: an unlocked file is a free port.
"""
from __future__ import annotations

import fcntl
import os
import secrets
import socket
import tempfile
from pathlib import Path

_HANDED_OUT: set[int] = set()
RESERVATIONS = Path(os.environ.get("ERNIE_PORT_RESERVATIONS") or Path(tempfile.gettempdir()) / "ernie-serve-ports")
_HELD: dict[int, int] = {}  # port -> the descriptor holding its lock, for the life of this process


def _reserve(port: int) -> bool:
    """Take this process's lock on `port`; False when another process holds it."""
    try:
        RESERVATIONS.mkdir(mode=0o777, parents=True, exist_ok=True)
        fd = os.open(RESERVATIONS / f"{port}.lock", os.O_RDWR | os.O_CREAT, 0o666)
    except OSError:
        return True  # no shared folder to reserve in: the bind check alone decides, as before
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return False
    _HELD[port] = fd
    return True


def _unreserve(port: int) -> None:
    fd = _HELD.pop(port, None)
    if fd is not None:
        os.close(fd)


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on, for a server to listen on, never the same one twice in a process, and never one
    another live process of this package has taken (see the module doc).

    Not the kernel's pick for port 0: that comes from the ephemeral range, where every outgoing connection's local
    port comes from too, so between the pick and the server's bind a client socket (a test's gRPC channel, the
    shim's connection to Triton) could take it, and the server would fail to bind or, worse, a request would reach
    another server. Ports below the ephemeral range are only ever taken by listeners, which the bind check sees."""
    low, high = _ephemeral_range()
    lo, hi = (20000, low - 1) if low > 21000 else (high + 1, 65535)
    rng = secrets.SystemRandom()
    for _ in range(200):
        port = rng.randint(lo, hi)
        if port in _HANDED_OUT or not _reserve(port):
            continue
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                _unreserve(port)
                continue
        _HANDED_OUT.add(port)
        return port
    raise RuntimeError(f"no free port in {lo}-{hi} on {host} after 200 tries")


def port_in_use(host: str, port: int) -> bool:
    """True while something listens on host:port (TIME_WAIT leftovers do not count)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False
