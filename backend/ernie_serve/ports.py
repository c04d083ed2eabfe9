"""Ports for the servers this package starts (tritonserver, the shim, tensor-parallel workers, KV transfer).

A port is only safe once the server that answers on it owns it: between a pick and the server's bind anything else
on the machine may take it (a stranger's server on a picked port once answered a CI run's shim tests with 405s).
So every server here gets its port in one of three ways, safest first:
- handed over: `listening_socket` binds (port 0: the kernel's pick) and the server serves on that socket (uvicorn's
  `sockets=`, or the fd inherited by a child such as `ernie-openai --fd`); nothing can come between;
- reported: the server binds port 0 itself and says which port it got (a ZMQ `bind_to_random_port`, torch's TCPStore);
- verified: a server that takes only a number (tritonserver, Paddle's TCPStore, a ZMQ bind) gets one from
  `free_port` and fails at once when the port is taken ("already in use"), and the caller starts it again on another
  (the launcher, process_groups, `start_on_free_ports`); once it is up, `listeners_owned_by` can confirm from /proc
  that every socket listening on the port is one of the server's own.

`free_port` also reserves what it hands out across processes, for as long as the taker lives: an exclusive flock on
RESERVATIONS/<port>.lock (released by the kernel when the process exits, however it exits), so two of this package's
processes never pick the same port. The lock files are never removed: an unlocked file is a free port.
"""
from __future__ import annotations

import errno
import fcntl
import os
import secrets
import socket
import tempfile
from pathlib import Path
from typing import Callable, TypeVar

T = TypeVar("T")
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


def listening_socket(host: str = "127.0.0.1", port: int = 0) -> socket.socket:
    """A TCP socket bound to host:port (0: a port the kernel picks) and listening, for a server to serve on: the
    port is the server's from this call on. Its fd is not inheritable; a child that takes it over names it in
    `subprocess.Popen(pass_fds=...)`."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        # as every server sets it: a restart may bind over its predecessor's TIME_WAIT connections. It never lets
        # two sockets listen on one port (only SO_REUSEPORT on both would).
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except BaseException:
        sock.close()
        raise
    return sock


def refusing_socket(host: str = "127.0.0.1") -> socket.socket:
    """A socket bound to a port the kernel picks that never listens: while it is open a connection to the port is
    refused, and nothing else can listen there (its bind without SO_REUSEADDR conflicts with every other). For a
    test that needs an address where no server answers."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind((host, 0))
    except BaseException:
        sock.close()
        raise
    return sock


def address_in_use(text: str) -> bool:
    """Whether a server's output says it could not bind a port something else holds (tritonserver's "Socket
    '127.0.0.1:N' already in use", the OS's "Address already in use" as ZMQ, gRPC and Paddle report it)."""
    return "already in use" in text.lower()


def start_on_free_ports(start: Callable[..., T], count: int = 1, host: str = "127.0.0.1",
                        attempts: int = 8) -> T:
    """`start(*ports)` on `count` ports from free_port, and again on fresh ones while it fails because one was
    taken in between (an error with errno EADDRINUSE, or one saying "already in use"): for a server that takes port
    numbers and binds them before it returns (a ZMQ socket's bind), whose ports are then its own. What `start`
    returns; an error of another kind, or the last try's, is raised."""
    for attempt in range(1, attempts + 1):
        try:
            return start(*(free_port(host) for _ in range(count)))
        except Exception as e:  # noqa: BLE001 - OSError, zmq.ZMQError (not an OSError) and the like: by errno
            if attempt == attempts or not (getattr(e, "errno", None) == errno.EADDRINUSE or address_in_use(str(e))):
                raise
    raise AssertionError("unreachable")


def _listening_inodes(port: int) -> set[int] | None:
    """The socket inodes listening on `port`, on any address, IPv4 or IPv6 (state 0A in /proc/net/tcp*); None where
    the kernel's tables cannot be read."""
    inodes, read = set(), False
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
            read = True
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            if len(cols) > 9 and cols[3] == "0A" and int(cols[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(int(cols[9]))
    return inodes if read else None


def socket_inodes(pids: list[int]) -> set[int]:
    """The inodes of the sockets these processes hold open (their /proc/<pid>/fd links 'socket:[N]')."""
    inodes = set()
    for pid in pids:
        try:
            fds = list(Path(f"/proc/{pid}/fd").iterdir())
        except OSError:
            continue  # gone, or not ours to read
        for fd in fds:
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(int(target[8:-1]))
    return inodes


def session_pids(session: int) -> list[int]:
    """The live processes of a session (a server started with start_new_session and everything it forked)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if os.getsid(int(entry.name)) == session:
                    pids.append(int(entry.name))
            except OSError:
                continue
    return pids


def listeners_owned_by(port: int, pids: list[int]) -> bool:
    """True when something listens on `port` and every socket listening there belongs to one of `pids`: the
    server answering on the port is the one these processes run, not a stranger's (nor one sharing it by
    SO_REUSEPORT). Also True where /proc/net cannot be read: then the server's own failure to bind a taken port is
    the only check there is."""
    listening = _listening_inodes(port)
    if listening is None:
        return True
    return bool(listening) and listening <= socket_inodes(pids)
