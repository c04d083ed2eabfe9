"""Acceptance: a full engine queue (--max-waiting-requests) reaches an OpenAI client as 429 with Retry-After,
through a real tritonserver, and clears once the queue drains. Its own server: one running sequence and a
waiting queue of one, so the third concurrent request is the one refused."""
from __future__ import annotations

import re
import threading
import time
import urllib.request

import httpx
import pytest
from openai_shim_helpers import tritonserver


pytestmark = pytest.mark.e2e
# Seconds of decoding even for the tiny model on a fast CPU: with 1500 tokens the first request could end during the
# ten refusals below, and the queue emptied under them
LONG = {"prompt": "hi", "max_tokens": 8000, "temperature": 0, "ignore_eos": True, "stream": True}


def _wait(pred, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def _gauge(server, name: str) -> float:
    with urllib.request.urlopen(server.metrics_url, timeout=5) as r:
        text = r.read().decode()
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)}(?:\{{[^}}]*\}})?\s+(\S+)$", text, re.M))


@pytest.fixture(scope="module")
def small_queue():
    """One running sequence and a waiting queue of one; the module's end checks that the refused and the cancelled
    requests both ended (tritonserver did not wait out its exit timeout, openai_shim_helpers.tritonserver)."""
    with tritonserver({"max_num_seqs": "1", "max_waiting_requests": "1", "max_model_len": "8192"},
                      openai_port=0) as server:
        url = f"http://{server.host}:{server.openai_port}"

        def healthy():
            try:
                return httpx.get(url + "/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        _wait(healthy, 60, "ernie-openai /health")
        yield server, url


def test_a_full_engine_queue_is_429_with_retry_after_and_clears(small_queue):
    """Also over gRPC (ernie_client.triton_client); every refusal ends its stream without a cancel, which
    the module's stop checks: measured before, repeated refusals held tritonserver's shutdown 15 s."""
    from ernie_client.triton_client import generate

    server, url = small_queue
    waiting_result: list[int] = []
    with httpx.Client(timeout=120) as client:
        with client.stream("POST", url + "/v1/completions", json=LONG) as running:
            lines = running.iter_lines()  # keep a reference: a collected iterator closes the connection
            next(lines)  # the first request holds the one running slot
            # the second waits in the engine's queue (its answer starts only once the first ends)
            waiter = threading.Thread(target=lambda: waiting_result.append(client.post(
                url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code), daemon=True)
            waiter.start()
            _wait(lambda: _gauge(server, "ernie:num_requests_waiting") == 1, 60, "one request waiting")
            for _ in range(10):  # bounded; one refusal alone only sometimes showed the shutdown hold
                refused = client.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2})
                assert refused.status_code == 429, refused.text
                assert refused.headers["retry-after"] == "1"
                assert refused.json()["error"]["code"] == "overloaded", refused.text
                with pytest.raises(Exception, match="overloaded"):
                    generate(server.grpc_url, text="hi", max_tokens=2)
        # closing the first stream cancels it; the waiting request then runs
        waiter.join(120)
        assert waiting_result == [200]
        assert client.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200
