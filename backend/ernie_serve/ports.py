"""Ports for the servers this package starts (tritonserver, the shim, tensor-parallel workers, KV transfer)."""
from __future__ import annotations

import secrets
import socket
from pathlib import Path

_HANDED_OUT: set[int] = set()


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on, for a server to listen on, never the same one twice in a process.

    Not the kernel's pick for port 0: that comes from the ephemeral range, where every outgoing connection's local
    port comes from too, so between the pick and the server's bind a client socket (a test's gRPC channel, the
    shim's connection to Triton) could take it, and the server would fail to bind or, worse, a request would reach
    another server. Ports below the ephemeral range are only ever taken by listeners, which the bind check sees."""
    low, high = _ephemeral_range()
    lo, hi = (20000, low - 1) if low > 21000 else (high + 1, 65535)
    rng = secrets.SystemRandom()
    for _ in range(200):
        port = rng.randint(lo, hi)
        if port in _HANDED_OUT:
            continue
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
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
