"""Rank 0's TCPStore (process_groups.host_store) listens on a port of its own before any other rank is told the port:
torch's binds port 0 and reports it; Paddle's gets a picked port, and when a stranger took that port before the bind,
the bind fails (Paddle's plain server; its libuv one aborts the process) and the next port is tried."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from ernie_serve import ports, process_groups


@pytest.fixture
def stranger():
    """Another process listening on a port, as a stranger's server would be on a port picked for the store."""
    proc = subprocess.Popen([sys.executable, "-c", "import socket, sys\ns = socket.socket()\n"
                             "s.bind(('127.0.0.1', 0))\ns.listen()\nprint(s.getsockname()[1], flush=True)\n"
                             "sys.stdin.read()"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    yield int(proc.stdout.readline())
    proc.stdin.close()
    proc.wait(30)


def _joined(framework: str, rendezvous) -> None:
    """A second rank joins the store on the port it was told, and the two see each other's keys."""
    other = process_groups.join_store(framework, rendezvous.port, 2)
    store = rendezvous.store()
    other.set("from-rank-1", b"1")
    assert bytes(store.get("from-rank-1")) == b"1"


def test_paddle_rank0_store_moves_off_a_port_a_stranger_took_and_the_process_lives(monkeypatch, stranger):
    import paddle

    picks = iter([stranger])  # the stranger's port is the first pick, then free_port's own
    real = process_groups.free_port
    monkeypatch.setattr(process_groups, "free_port", lambda: next(picks, None) or real())
    rendezvous = process_groups.host_store("paddle", 2)
    assert rendezvous.port != stranger and ports.listeners_owned_by(rendezvous.port, [os.getpid()])
    assert not ports.listeners_owned_by(stranger, [os.getpid()])
    _joined("paddle", rendezvous)
    flag = "FLAGS_tcp_store_using_libuv"
    assert paddle.get_flags([flag])[flag] is True  # the process's own setting is back


def test_torch_rank0_store_listens_on_the_port_it_reports():
    pytest.importorskip("torch")
    rendezvous = process_groups.host_store("torch", 2)
    assert ports.listeners_owned_by(rendezvous.port, [os.getpid()])
    _joined("torch", rendezvous)
