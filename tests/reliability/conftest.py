"""Fixtures for the reliability tests: a real tritonserver with the OpenAI shim beside it, one per module."""
from __future__ import annotations

import time
import urllib.request

import pytest
from server_stop import stop_checked

# Small enough to start quickly on 2 cores; the tiny demo model.
SERVER_SETTINGS = {"max_model_len": "512", "max_num_seqs": "8", "block_size": "16", "num_gpu_blocks_override": "256"}


def _openai_url(server) -> str:
    return f"http://{server.host}:{server.openai_port}"


def _shim_healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


@pytest.fixture(scope="module")
def served():
    """A TritonServer (ernie_serve.serving.launcher) on ports of its own with `ernie-openai` on its openai_port.

    Stopped at the end of the module, which must not wait out the exit timeout: a bad request that left
    something in flight would show there.
    """
    from ernie_serve.serving.launcher import TritonServer

    server = TritonServer(SERVER_SETTINGS, http_port=0, grpc_port=0, metrics_port=0, openai_port=0)
    try:
        server.start(timeout=300)
        deadline = time.monotonic() + 60
        while not _shim_healthy(_openai_url(server)):
            if time.monotonic() > deadline or server.openai_proc is None or server.openai_proc.poll() is not None:
                raise RuntimeError("ernie-openai did not become healthy")
            time.sleep(0.2)
    except Exception:
        server.stop()
        server.cleanup()
        raise
    yield server
    stop_checked(server)


@pytest.fixture(scope="module")
def openai_url(served) -> str:
    """Base URL of the shim started with `served` (append /v1/...)."""
    return _openai_url(served)


def start_served(settings: dict[str, str] | None = None, **kwargs):
    """A started TritonServer (with its shim when openai_port=True) on ports of its own; stop with `stop_served`."""
    from ernie_serve.serving.launcher import TritonServer

    if kwargs.get("openai_port") is True:
        kwargs["openai_port"] = 0
    server = TritonServer({**SERVER_SETTINGS, **(settings or {})}, http_port=0, grpc_port=0, metrics_port=0,
                          **kwargs)
    try:
        server.start(timeout=300)
        deadline = time.monotonic() + 60
        while server.openai_port is not None and not _shim_healthy(_openai_url(server)):
            if time.monotonic() > deadline or server.openai_proc is None or server.openai_proc.poll() is not None:
                raise RuntimeError("ernie-openai did not become healthy")
            time.sleep(0.2)
    except Exception:
        server.stop()
        server.cleanup()
        raise
    return server


def stop_served(server) -> None:
    """Stop; a request left in flight shows as tritonserver waiting out its exit timeout."""
    server.stop()
    full_log = server.log_tail(400)
    server.cleanup()
    assert "Exit timeout expired" not in full_log, "tritonserver waited out its exit timeout: a request stayed in flight"
