"""Who may call what (issue 16 item 7): Triton's admin APIs are closed by default, and `--api-key` closes
the shim and Triton's inference, metadata, config and statistics APIs alike; health stays open for probes.

Before: any client could register the python backend's own shared-memory region (its name is in `ps`)
with POST /v2/systemsharedmemory/region/x/register.
"""
from __future__ import annotations

import json
import queue
import urllib.error
import urllib.request

import httpx
import numpy as np
import pytest

from conftest import start_served, stop_served

WAIT = 60
KEY = "s3cret-key"


def http(server, method: str, path: str, body: dict | None = None, headers: dict | None = None) -> tuple[int, str]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(f"http://{server.http_url}{path}", data=data, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=WAIT) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


@pytest.fixture(scope="module")
def open_server():
    server = start_served()
    yield server
    stop_served(server)


@pytest.fixture(scope="module")
def keyed_server():
    server = start_served(openai_port=True, api_key=KEY)
    yield server
    stop_served(server)


ADMIN_CALLS = [("POST", "/v2/systemsharedmemory/region/x/register", {"key": "x", "offset": 0, "byte_size": 8}),
               ("POST", "/v2/repository/index", {}), ("GET", "/v2/logging", None), ("GET", "/v2/trace/setting", None)]


@pytest.mark.parametrize("method,path,body", ADMIN_CALLS)
def test_admin_apis_are_refused_without_the_admin_key(open_server, method, path, body):
    status, text = http(open_server, method, path, body)
    assert status == 403 and "restricted" in text
    status, _ = http(open_server, method, path, body, {"admin-key": open_server.admin_api_key})
    assert status != 403


def test_grpc_shared_memory_registration_is_refused(open_server):
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    client = grpcclient.InferenceServerClient(open_server.grpc_url)
    with pytest.raises(InferenceServerException, match="restricted") as refused:
        client.register_system_shared_memory("x", "/x", 8)
    # tritonserver 2.51 answers a restricted gRPC API with UNAVAILABLE: not a code to retry on
    assert refused.value.status() == "StatusCode.UNAVAILABLE"


def test_without_an_api_key_inference_and_health_are_open(open_server):
    assert http(open_server, "GET", "/v2/health/ready")[0] == 200
    status, text = http(open_server, "POST", "/v2/models/ernie/generate", {"text_input": "hi", "max_tokens": 2})
    assert status == 200 and "text_output" in text


def test_api_key_is_required_on_triton_http_but_not_for_health(keyed_server):
    body = {"text_input": "hi", "max_tokens": 2}
    status, text = http(keyed_server, "POST", "/v2/models/ernie/generate", body)
    assert status == 403 and "authorization" in text
    assert http(keyed_server, "POST", "/v2/models/ernie/generate", body, {"Authorization": "Bearer wrong"})[0] == 403
    assert http(keyed_server, "POST", "/v2/models/ernie/generate", body, {"Authorization": f"Bearer {KEY}"})[0] == 200
    assert http(keyed_server, "GET", "/v2/models/ernie/config")[0] == 403
    assert http(keyed_server, "GET", "/v2/health/ready")[0] == 200


def _grpc_stream(server, headers: dict | None) -> str:
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(server.grpc_url)
    answers: queue.Queue = queue.Queue()
    client.start_stream(lambda result, error: answers.put((result, error)), headers=headers)
    text = grpcclient.InferInput("text_input", [1, 1], "BYTES")
    text.set_data_from_numpy(np.array([[b"hi"]], dtype=np.object_))
    try:
        client.async_stream_infer("ernie", [text], request_id="1", enable_empty_final_response=True)
    except Exception:  # noqa: BLE001 - a refused stream is already closed; its error is in the callback
        pass
    result, error = answers.get(timeout=WAIT)
    try:
        client.stop_stream()
    except Exception:  # noqa: BLE001
        pass
    client.close()
    return f"{error.status()}: {error.message()}" if error is not None else "served"


def test_api_key_is_required_on_triton_grpc(keyed_server):
    refused = _grpc_stream(keyed_server, None)
    assert "restricted" in refused and "triton-grpc-protocol-authorization" in refused
    assert _grpc_stream(keyed_server, {"triton-grpc-protocol-authorization": f"Bearer {KEY}"}) == "served"


def test_api_key_is_required_on_the_shim_which_reaches_triton_with_it(keyed_server):
    url = f"http://{keyed_server.host}:{keyed_server.openai_port}"
    body = {"model": "ernie", "prompt": "hello", "max_tokens": 2}
    assert httpx.post(f"{url}/v1/completions", json=body, timeout=WAIT).status_code == 401
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=WAIT, headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200, r.text
    assert httpx.get(f"{url}/health", timeout=WAIT).status_code == 200
