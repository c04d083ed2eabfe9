"""Helpers shared by the shim tests: the shim under a real uvicorn in a thread, on a socket bound before it starts
(ports.py: nothing else can take the port in between); for the e2e tests, a real tritonserver and its engines'
metrics."""
from __future__ import annotations

import contextlib
import re
import threading
import time
from typing import TYPE_CHECKING, Iterator

import httpx
import pytest

from ernie_serve.ports import listening_socket, refusing_socket  # noqa: F401  (the shim tests take them from here)
from server_stop import stop_checked

if TYPE_CHECKING:
    from ernie_serve.serving.launcher import TritonServer


class RunningShim:
    """uvicorn serving `app` on 127.0.0.1:<a port of its own> until stop()."""

    def __init__(self, app, shim_flags: list[str] | None = None):
        """`shim_flags`: serve with uvicorn configured as `ernie-openai` with these flags configures it
        (openai_server.uvicorn_config), instead of uvicorn's own defaults."""
        import uvicorn

        from ernie_client.openai_server import parse_args, uvicorn_config

        sock = listening_socket()
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        if shim_flags is None:
            config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="on")
        else:
            config = uvicorn_config(parse_args([*shim_flags, "--port", str(self.port), "--log-level", "warning"]), app)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                sock.close()
                raise RuntimeError("the shim did not start")
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


@contextlib.contextmanager
def tritonserver(params: dict, **kwargs) -> Iterator[TritonServer]:
    """A real tritonserver (the tiny demo model) with model parameters `params`, on ports of its own, for an e2e
    module: skipped without the launcher, failed when it does not start. kwargs go to TritonServer (openai_port=0:
    with the launcher's shim)."""
    launcher = pytest.importorskip("ernie_serve.serving.launcher", reason="the Triton launcher is not available")
    server = launcher.TritonServer(params, http_port=0, grpc_port=0, metrics_port=0, **kwargs)  # 0: ports of its own
    try:
        server.start(timeout=300)
    except (FileNotFoundError, RuntimeError, TimeoutError) as e:
        server.cleanup()
        pytest.fail(f"tritonserver did not start: {e}")
    yield server
    stop_checked(server)


def engine_metric(triton: TritonServer, name: str) -> float:
    """The sum of a metric's series on Triton's metrics port (the engines')."""
    text = httpx.get(triton.metrics_url, timeout=5).text
    values = [float(m.group(1)) for m in re.finditer(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)]
    assert values, f"{name} not on the Triton metrics port"
    return sum(values)


def engines_idle(triton: TritonServer) -> bool:
    """No request running or waiting in the engines, and their KV pool whole."""
    return (engine_metric(triton, "ernie:num_requests_running") == 0
            and engine_metric(triton, "ernie:num_requests_waiting") == 0
            and engine_metric(triton, "ernie:kv_cache_usage_perc") == 0)
