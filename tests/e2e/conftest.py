"""One tritonserver for every e2e test, started through the launcher's Python API on ports of its own (0: the
launcher chooses them so that nothing else can answer there)."""
from __future__ import annotations

import time

import pytest

# Small enough to keep the suite fast on 2 cores, large enough for 16 concurrent streams.
SERVER_SETTINGS = {"max_model_len": "512", "max_num_seqs": "16", "block_size": "16",
                   "num_gpu_blocks_override": "512"}


@pytest.fixture(scope="session")
def triton_server():
    from ernie_serve.serving.launcher import TritonServer

    server = TritonServer(SERVER_SETTINGS, http_port=0, grpc_port=0, metrics_port=0)
    try:
        server.start(timeout=300)
    except Exception:
        server.cleanup()
        raise
    yield server
    t0 = time.monotonic()
    code = server.stop()
    seconds = time.monotonic() - t0
    full_log = server.log_tail(400)
    log = "\n".join(line for line in full_log.splitlines() if "Timeout" in line or "unloaded" in line)
    server.cleanup()
    # Idle by now (every test closed its streams, cancelled ones included), so the server must not sit
    # out its exit timeout waiting for a leaked in-flight request: tritonserver logs when it does. The
    # stop's duration is reported, not bounded (an idle stop takes ~4 s, longer on a loaded box).
    assert "Exit timeout expired" not in full_log and code == 0, \
        f"tritonserver exited {code} after {seconds:.1f}s; a request stayed in flight, or it hung\n{log}"


@pytest.fixture(scope="session")
def offline_llm():
    """The offline engine the server must agree with (same engine settings)."""
    from ernie_serve import LLM

    return LLM(model=None, max_model_len=512, max_num_seqs=16, block_size=16, num_gpu_blocks_override=512,
               disable_progress_bar=True)
