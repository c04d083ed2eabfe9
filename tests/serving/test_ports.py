"""Ports (ernie_serve/ports.py): a server's port is its own before anyone is told it. Handed over (a bound socket the
server serves on), reported (the server binds port 0), or picked and verified (the server fails on a taken port and
is started again elsewhere; /proc says whose listener answers). free_port: listening ports outside the kernel's
ephemeral range, never the same twice in a process, reserved across processes."""
from __future__ import annotations

import errno
import itertools
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ernie_serve import ports

ROOT = Path(__file__).resolve().parents[2]
# A process of its own that listens on the port it is given (SO_REUSEPORT when asked), prints its pid, and waits.
STRANGER = """
import socket, sys, os
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
if sys.argv[2] == "reuseport":
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
try:
    s.bind(("127.0.0.1", int(sys.argv[1])))
    s.listen()
    print(os.getpid(), flush=True)
except OSError as e:
    print("bind", e.errno, flush=True)
sys.stdin.read()
"""


def _a_free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ports._HANDED_OUT.discard(port)
    return port


def _draw_from(monkeypatch, ports_in_order) -> None:
    """free_port's random draws replaced by these ports, in order."""
    monkeypatch.setattr(ports.secrets, "SystemRandom",
                        lambda: type("R", (), {"randint": lambda s, a, b: next(ports_in_order)})())


class _Stranger:
    """Another process trying to listen on `port`: `.pid` once it does, `.bind_errno` when its bind failed."""

    def __init__(self, port: int, reuseport: bool = False):
        self.proc = subprocess.Popen([sys.executable, "-c", STRANGER, str(port), "reuseport" if reuseport else "-"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        words = self.proc.stdout.readline().split()
        self.pid = int(words[0]) if words and words[0] != "bind" else None
        self.bind_errno = int(words[1]) if words and words[0] == "bind" else None

    def __enter__(self) -> "_Stranger":
        return self

    def __exit__(self, *exc) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


def test_ports_are_distinct_bindable_and_not_ephemeral():
    low, high = ports._ephemeral_range()
    picked = [ports.free_port() for _ in range(64)]
    assert len(set(picked)) == len(picked)
    assert all(not low <= p <= high for p in picked)
    for p in picked[:8]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))


def test_a_port_something_listens_on_is_never_picked(monkeypatch):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        held.listen()
        # The RNG draws the listened port twice, then ports the kernel just found free (taken + 1 was once drawn
        # instead, and was sometimes in use or handed out already, which left the draws exhausted).
        tries = itertools.chain([taken, taken], iter(_a_free_port, None))
        monkeypatch.setattr(ports, "_ephemeral_range", lambda: (40000, 40001))  # any range: the RNG is replaced
        _draw_from(monkeypatch, tries)
        ports._HANDED_OUT.discard(taken)
        assert ports.free_port() != taken


def test_a_port_another_process_reserved_is_never_picked(monkeypatch, tmp_path):
    """Two processes pick ports side by side: what one holds the other skips, though nothing listens on it yet (the
    window between a test's pick and its server's bind)."""
    monkeypatch.setattr(ports, "RESERVATIONS", tmp_path)
    child = subprocess.Popen([sys.executable, "-c", (
        "import sys\nfrom pathlib import Path\nfrom ernie_serve import ports\n"
        f"ports.RESERVATIONS = Path({str(tmp_path)!r})\n"
        "print(*[ports.free_port() for _ in range(5)], flush=True)\nsys.stdin.read()")],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        held = [int(p) for p in child.stdout.readline().split()]
        assert len(held) == 5
        tries = itertools.chain(held, held, iter(_a_free_port, None))
        _draw_from(monkeypatch, tries)
        picked = ports.free_port()
        assert picked not in held
    finally:
        child.stdin.close()
        child.wait(timeout=30)
    # once the holder is gone its ports are free again
    again = iter(held)
    _draw_from(monkeypatch, again)
    ports._HANDED_OUT.difference_update(held)
    assert ports.free_port() == held[0]


def test_a_handed_over_port_cannot_be_taken_by_a_stranger():
    with ports.listening_socket() as sock:
        port = sock.getsockname()[1]
        with _Stranger(port) as stranger, _Stranger(port, reuseport=True) as sharer:
            assert stranger.bind_errno == errno.EADDRINUSE and sharer.bind_errno == errno.EADDRINUSE
        assert ports.listeners_owned_by(port, [os.getpid()])


def test_a_refusing_socket_refuses_connections_and_keeps_strangers_off_its_port():
    with ports.refusing_socket() as held:
        port = held.getsockname()[1]
        with pytest.raises(ConnectionRefusedError), socket.create_connection(("127.0.0.1", port), timeout=5):
            pass
        with _Stranger(port) as stranger:
            assert stranger.bind_errno == errno.EADDRINUSE


def test_a_listener_is_owned_only_by_the_process_holding_it():
    port = _a_free_port()
    with _Stranger(port, reuseport=True) as stranger:
        assert stranger.pid is not None
        assert ports.listeners_owned_by(port, [stranger.pid]) and not ports.listeners_owned_by(port, [os.getpid()])
        # a server of ours sharing the port with it by SO_REUSEPORT is not the port's owner either
        with socket.socket() as ours:
            ours.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            ours.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            ours.bind(("127.0.0.1", port))
            ours.listen()
            assert not ports.listeners_owned_by(port, [os.getpid()])
            assert ports.listeners_owned_by(port, [os.getpid(), stranger.pid])
    assert not ports.listeners_owned_by(port, [os.getpid()])  # nothing listens: nobody's


def test_session_pids_are_a_server_and_what_it_forked():
    proc = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time\n"
                             "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
                             "print(child.pid, flush=True)\ntime.sleep(60)"],
                            stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        child = int(proc.stdout.readline())
        assert set(ports.session_pids(proc.pid)) == {proc.pid, child}
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@pytest.mark.parametrize("text,taken", [
    ("E1207 main.cc:257] \"failed to start HTTP service: Unavailable - Socket '127.0.0.1:39701' already in use \"",
     True),
    ("zmq.error.ZMQError: Address already in use (addr='tcp://127.0.0.1:20411')", True),
    ("model 'ernie_moe': engine failed to start: tensor_parallel_size=8 does not divide", False),
])
def test_a_bind_failure_is_told_from_other_start_up_failures(text, taken):
    assert ports.address_in_use(text) is taken


def test_a_server_binding_a_taken_port_is_started_again_on_free_ones(monkeypatch):
    """start_on_free_ports: a stranger took the first port picked; the ZMQ bind fails on it and the server is started
    again on another, which it then owns. Errors of other kinds are not retried."""
    import zmq

    ctx = zmq.Context()
    taken = _a_free_port()
    with _Stranger(taken) as stranger:
        assert stranger.pid is not None
        picks = iter([taken])
        real = ports.free_port
        monkeypatch.setattr(ports, "free_port", lambda host="127.0.0.1": next(picks, None) or real(host))
        tried = []

        def start(port):
            tried.append(port)
            sock = ctx.socket(zmq.ROUTER)
            try:
                sock.bind(f"tcp://127.0.0.1:{port}")
            except zmq.ZMQError:
                sock.close(0)
                raise
            return sock

        sock = ports.start_on_free_ports(start)
        try:
            assert tried[0] == taken and len(tried) == 2
            assert ports.listeners_owned_by(tried[1], [os.getpid()])
        finally:
            sock.close(0)
    with pytest.raises(ValueError):
        ports.start_on_free_ports(lambda port: int("not a port"))
    ctx.term()


def test_the_shim_serves_on_the_socket_it_was_handed(tmp_path):
    """`ernie-openai --fd`: the socket bound before the shim starts is the one it answers on, with no bind of its
    own (the --port it is given is held by a stranger, which it never reaches)."""
    import httpx

    sock = ports.listening_socket()
    port = sock.getsockname()[1]
    with ports.listening_socket() as decoy:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(str(ROOT / d) for d in ("client", "backend")))
        with sock:
            proc = subprocess.Popen([sys.executable, "-m", "ernie_client.openai_server", "--triton-url",
                                     "127.0.0.1:1", "--port", str(decoy.getsockname()[1]), "--fd", str(sock.fileno()),
                                     "--log-level", "warning"], env=env, pass_fds=(sock.fileno(),))
        try:
            deadline = time.monotonic() + 60
            while True:
                assert proc.poll() is None, f"the shim exited {proc.returncode}"
                try:
                    r = httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
                    break
                except httpx.HTTPError:
                    assert time.monotonic() < deadline, "the shim did not answer on its handed-over socket"
                    time.sleep(0.2)
            assert r.status_code == 503  # the shim's own answer: no Triton behind it
            assert ports.listeners_owned_by(port, [proc.pid])
        finally:
            proc.terminate()
            proc.wait(30)


def test_ernie_serve_leaves_ports_given_as_0_to_the_launcher_p_d_ports_included(tmp_path):
    from ernie_serve.cli.serve import server_from_args

    server, _ = server_from_args(["--port", "0", "--metrics-port", "0", "--splitwise-role", "prefill",
                                  "--engine-worker-queue-port", "0", "--cache-queue-port", "0",
                                  "--run-dir", str(tmp_path)])
    assert server.ports() == {"--http-port": 0, "--grpc-port": 0, "--metrics-port": 0, "--openai-port": 0}
    assert server.side_channel_ports() == {"engine_worker_queue_port": 0, "cache_queue_port": 0}


def test_the_ready_banner_gives_back_the_ports_it_shows():
    from types import SimpleNamespace

    from ernie_serve.cli.serve import banner_ports, ready_banner

    server = SimpleNamespace(startup_seconds=1.0, http_url="127.0.0.1:21001", grpc_url="127.0.0.1:21002",
                             metrics_url="http://127.0.0.1:21003/metrics", host="127.0.0.1", openai_port=21004,
                             openai_proc=object(), log_path="/tmp/x.log", openai_log_path=None)
    output = "[ernie-serve] starting tritonserver ...\n" + ready_banner(server)
    assert banner_ports(output) == {"http": 21001, "grpc": 21002, "metrics": 21003, "openai": 21004}
    server.openai_proc = None
    assert banner_ports(ready_banner(server)) == {"http": 21001, "grpc": 21002, "metrics": 21003}
    assert banner_ports("[ernie-serve] failed to start: ...") == {}
