"""A server started on the simulated device says so on its metrics port, and its replayed text goes through the whole
ensemble (tokenizer -> ernie_moe -> detokenizer with the reasoning and tool-call parsers). An instrument's check, not the serving
path's correctness: that is tests/e2e's, on the reference backend."""
from __future__ import annotations

import time

import pytest


@pytest.fixture(scope="module")
def simulated_server():
    from ernie_serve.serving.launcher import TritonServer

    settings = {"execution_backend": "simulated", "simulated_gpu": "h200", "simulated_model": "ernie-4.5-21b-a3b",
                "simulated_time_scale": "0.1", "quantization": "wint8", "max_model_len": "1024",
                "max_num_seqs": "4", "reasoning_parser": "ernie-x1", "tool_call_parser": "ernie-x1"}
    with TritonServer(settings, http_port=0, grpc_port=0, metrics_port=0) as server:
        yield server


def test_a_simulated_server_exports_that_it_is_a_simulation_and_streams_replayed_text(simulated_server):
    from ernie_client.triton_client import generate
    from ernie_serve.serving.health import ernie_samples

    result = generate(simulated_server.grpc_url, text="Hello there", max_tokens=800, temperature=0)
    assert result.finish_reason == "stop" and 0 < result.num_reasoning_tokens < result.num_output_tokens
    assert result.reasoning and "</think>" not in result.reasoning  # parsed at the replay's </think>
    deadline = time.monotonic() + 10
    while True:  # the engine flushes its metrics once idle
        samples = {(name, labels): v for name, labels, v in ernie_samples(simulated_server.metrics_url)}
        steps = sum(v for (name, _), v in samples.items() if name == "ernie:simulated_steps_total")
        if steps >= result.num_output_tokens or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    device = [(labels, v) for (name, labels), v in samples.items() if name == "ernie:simulated_device"]
    assert len(device) == 1 and device[0][1] == 1 and "(wint8) on h200, time scale 0.1" in device[0][0]
    assert steps >= result.num_output_tokens
