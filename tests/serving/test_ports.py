"""free_port: listening ports outside the kernel's ephemeral range, never the same twice in a process."""
from __future__ import annotations

import itertools
import socket

from ernie_serve import ports


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
    import subprocess
    import sys

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
