"""scripts/serve_replicas.sh as the docs run it: a replica behind sglang-router, a chat through the router, and a
SIGTERM that stops everything it started."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from ernie_serve.ports import free_port

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]


def test_serve_replicas_serves_through_the_router_and_stops_on_sigterm(tmp_path):
    pytest.importorskip("sglang_router", reason="sglang-router is installed by scripts/setup.sh (the router extra)")
    port, metrics = free_port(), free_port()  # the router binds them; reserved for this process meanwhile
    log = tmp_path / "serve_replicas.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(["bash", str(ROOT / "scripts/serve_replicas.sh"), "--replicas", "1", "--base-port", "0",
                                 "--port", str(port), "--router-args", f"--prometheus-port {metrics}"],
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while "] ready:" not in log.read_text(errors="replace"):
            assert proc.poll() is None, f"serve_replicas.sh exited {proc.returncode}:\n{log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
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
        if proc.poll() is None:  # the script's own stop, for its whole session: the replica's launcher, the router
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
