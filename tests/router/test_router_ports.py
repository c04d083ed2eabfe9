"""The router's ports are its own: sglang-router takes only port numbers (no port 0, no handed-over socket), so a
port is picked, the router binds it, and a taken one sends the pick round again (start_on_free_ports) instead of
letting a stranger answer the tests. No replicas needed: the router starts with no workers."""
from __future__ import annotations

import errno
import os
import re

import pytest

from ernie_serve.ports import listeners_owned_by, listening_socket, session_pids
from router_helpers import RouterProcess, launch_router, router_owns


@pytest.fixture(autouse=True)
def _router_installed():
    pytest.importorskip("sglang_router", reason="sglang-router is installed by scripts/setup.sh (the router extra)")


@pytest.mark.parametrize("taken", ["port", "metrics"])
def test_a_router_on_a_taken_port_is_refused_as_address_in_use(tmp_path, taken):
    """A stranger listens on the router's port (or its metrics port): the router exits, and router_owns says
    EADDRINUSE, the error start_on_free_ports picks new ports on."""
    with listening_socket() as stranger:
        with listening_socket() as spare:  # a second port, free again once closed: either may be the taken one
            other = spare.getsockname()[1]
        theirs = stranger.getsockname()[1]
        port, metrics = (theirs, other) if taken == "port" else (other, theirs)
        log = tmp_path / "router.log"
        proc = launch_router([], port, metrics, log)
        try:
            with pytest.raises(OSError) as refused:
                router_owns(proc, (port, metrics), lambda: log.read_text(errors="replace"), 60)
            assert refused.value.errno == errno.EADDRINUSE
            assert proc.wait(10) != 0
            assert listeners_owned_by(theirs, [os.getpid()])  # the stranger (this process) still answers there
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)


def test_a_started_router_alone_listens_on_its_ports(tmp_path):
    """RouterProcess returns only once every listener on its port and metrics port is the router's own."""
    r = RouterProcess([], tmp_path / "router.log")
    try:
        mine = session_pids(r.proc.pid)
        assert listeners_owned_by(r.port, mine) and listeners_owned_by(r.metrics_port, mine)
        assert re.search(rf"Starting server on 127\.0\.0\.1:{r.port}\b", r.log())
    finally:
        r.stop()
    assert r.proc.returncode is not None
