"""scripts/serve_replicas.sh as the docs run it: a replica behind sglang-router, a chat through the router, and a
SIGTERM that stops everything it started."""
from __future__ import annotations

import errno
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from ernie_serve.ports import address_in_use, listeners_owned_by, session_pids, start_on_free_ports

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]


def _router_pids(session: int) -> list[int]:
    """The processes of the script's session that run sglang-router (once started, it names itself sglang::router
    in its command line)."""
    pids = []
    for pid in session_pids(session):
        try:
            if re.search(rb"sglang_router|sglang::router", Path(f"/proc/{pid}/cmdline").read_bytes()):
                pids.append(pid)
        except OSError:
            continue
    return pids


def _stop(proc: subprocess.Popen) -> None:
    """The script's own stop, for its whole session (the replica's launcher, the router); SIGKILL if it hangs."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def _serve_replicas(log: Path, port: int, metrics: int) -> subprocess.Popen:
    """The script with its router on `port` / `metrics`, once ready and both ports are the router's own; OSError
    EADDRINUSE when the router could not bind them (start_on_free_ports then picks others). The router takes only
    port numbers, so its ports are picked and verified rather than handed over."""
    with open(log, "wb") as out:
        proc = subprocess.Popen(["bash", str(ROOT / "scripts/serve_replicas.sh"), "--replicas", "1", "--base-port", "0",
                                 "--port", str(port), "--router-args", f"--prometheus-port {metrics}"],
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while "] ready:" not in log.read_text(errors="replace"):
            if proc.poll() is not None:
                text = log.read_text(errors="replace")
                if address_in_use(text):
                    raise OSError(errno.EADDRINUSE, f"the router could not bind {port}/{metrics}: {text[-500:]}")
                raise AssertionError(f"serve_replicas.sh exited {proc.returncode}:\n{text[-3000:]}")
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        routers = _router_pids(proc.pid)
        if not all(listeners_owned_by(p, routers) for p in (port, metrics)):
            raise OSError(errno.EADDRINUSE, f"another process listens on {port}/{metrics} beside the router")
    except BaseException:
        _stop(proc)
        raise
    return proc


def test_serve_replicas_serves_through_the_router_and_stops_on_sigterm(tmp_path):
    pytest.importorskip("sglang_router", reason="sglang-router is installed by scripts/setup.sh (the router extra)")
    log = tmp_path / "serve_replicas.log"
    proc, port = start_on_free_ports(lambda port, metrics: (_serve_replicas(log, port, metrics), port), count=2)
    try:
        (replica,) = re.search(r"^  replicas (.+)$", log.read_text(), re.M).group(1).split()
        r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=120,
                       json={"model": "ernie", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8})
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("stop", "length"), r.text
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(120) == 0, log.read_text()[-3000:]
        for url in (replica, f"http://127.0.0.1:{port}"):
            with pytest.raises(httpx.ConnectError):
                httpx.get(url + "/health", timeout=2)
    finally:
        _stop(proc)
