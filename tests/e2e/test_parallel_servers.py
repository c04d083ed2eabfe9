"""End-to-end: a tensor-parallel (TP=2) tritonserver, and a 1P1D pair of TP=2 tritonservers (prefill and
decode roles), each streaming through the `ernie` ensemble and agreeing with the one-rank offline engine."""
from __future__ import annotations

import queue
import threading
import time

import pytest
import tritonclient.grpc as grpcclient

from ernie_client.triton_client import build_inputs, stream_generate
from e2e_helpers import wait_for_health
from ernie_serve import SamplingParams
from ernie_serve.serving.launcher import TritonServer

from conftest import SERVER_SETTINGS
from e2e_helpers import scrape, scrape_once_blocks_are_held

pytestmark = pytest.mark.e2e
PROMPTS = ["The quick brown fox jumps over the lazy dog", "Tell me about paged attention",
           " ".join(["many words make a long prompt"] * 6), "Hi"]


def _start(settings: dict) -> TritonServer:
    server = TritonServer({**SERVER_SETTINGS, **settings}, http_port=0, grpc_port=0, metrics_port=0)  # its own
    try:
        server.start(timeout=300)
    except Exception:
        server.cleanup()
        raise
    return server


def _stop(*servers: TritonServer) -> None:
    for server in servers:
        server.stop()
        server.cleanup()


def _offline(llm, prompt: str, max_tokens: int) -> tuple[str, list[int]]:
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False)[0]
    return out.outputs[0].text, list(out.outputs[0].token_ids)


def _concurrent_streams(server: TritonServer, prompts: list[str], max_tokens: int) -> dict[str, tuple[str, list]]:
    results: dict[str, tuple[str, list]] = {}

    def one(prompt: str) -> None:
        deltas = list(stream_generate(server.grpc_url, text=prompt, max_tokens=max_tokens, temperature=0))
        results[prompt] = ("".join(d.text for d in deltas), [t for d in deltas for t in d.output_ids])

    threads = [threading.Thread(target=one, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    return results


def _wait_all_free(server: TritonServer, rounds: int = 100) -> dict:
    for _ in range(rounds):
        now = scrape(server)
        if now["ernie:kv_cache_free_blocks"] == now["ernie:kv_cache_total_blocks"] and \
                now.get("ernie:num_requests_running", 0) == 0:
            return now
        time.sleep(0.2)
    return now


# ---------------------------------------------------------------- tensor parallel
@pytest.fixture(scope="module")
def tp2_server():
    server = _start({"tensor_parallel_size": "2"})
    yield server
    _stop(server)


def test_a_tensor_parallel_server_streams_the_tokens_of_one_rank(tp2_server, offline_llm):
    got = _concurrent_streams(tp2_server, PROMPTS, 20)
    for prompt in PROMPTS:
        assert got[prompt] == _offline(offline_llm, prompt, 20), prompt
    assert _wait_all_free(tp2_server)["ernie:engine_healthy"] == 1


# ---------------------------------------------------------------- prefill / decode disaggregation
def _from_seed_flags(flags: list[str]) -> TritonServer:
    """A server from an ernie-serve command line, as the seed's 1P1D commands write it (ports of 0, which the
    launcher chooses, in place of 8180-8183 / 8184-8187; two ranks a side in place of four on a 2-core host), with
    FastDeploy's --cache-transfer-protocol "rdma,ipc" (the KV crosses through NIXL); Triton's own ports are the CLI's
    choice, as they are for a FastDeploy user."""
    from ernie_serve.cli.serve import server_from_args

    engine = [a for k, v in SERVER_SETTINGS.items() for a in (f"--{k.replace('_', '-')}", v)]
    server, _ = server_from_args(flags + engine)
    try:
        server.start(timeout=300)
    except Exception:
        server.cleanup()
        raise
    return server


@pytest.fixture(scope="module")
def pd_servers():
    prefill = _from_seed_flags(["--port", "0", "--metrics-port", "0", "--engine-worker-queue-port", "0",
                                "--cache-queue-port", "0",
                                "--tensor-parallel-size", "2", "--splitwise-role", "prefill",
                                "--cache-transfer-protocol", "rdma,ipc"])
    try:
        decode = _from_seed_flags(["--port", "0", "--metrics-port", "0", "--engine-worker-queue-port", "0",
                                   "--cache-queue-port", "0", "--tensor-parallel-size", "2",
                                   "--innode-prefill-ports", prefill.settings["engine_worker_queue_port"],
                                   "--splitwise-role", "decode", "--cache-transfer-protocol", "rdma,ipc"])
    except Exception:
        _stop(prefill)
        raise
    yield prefill, decode
    _stop(decode, prefill)


def test_the_seeds_1p1d_pair_serves_a_chat_through_the_decode_servers_port(pd_servers, offline_llm):
    import httpx

    prefill, decode = pd_servers
    url = f"http://{decode.host}:{decode.openai_port}"
    wait_for_health(url, 20)
    r = httpx.post(f"{url}/v1/completions", json={"model": "ernie", "prompt": PROMPTS[1], "max_tokens": 12,
                                                  "temperature": 0}, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == _offline(offline_llm, PROMPTS[1], 12)[0]
    chat = httpx.post(f"{url}/v1/chat/completions", json={"model": "ernie", "max_tokens": 8,
                                                          "messages": [{"role": "user", "content": "Hi"}]}, timeout=120)
    assert chat.status_code == 200 and chat.json()["choices"][0]["message"]["content"], chat.text
    assert {prefill.http_port, prefill.grpc_port} .isdisjoint({decode.http_port, decode.grpc_port})
    for server in pd_servers:  # the flag reached both engines (tests/serving/test_disagg.py checks NIXL moves the KV)
        rendered = (server.run_dir / "model_repository" / "ernie_moe" / "config.pbtxt").read_text()
        assert '{ key: "cache_transfer_protocol" value: { string_value: "rdma,ipc" } }' in rendered


def test_one_prefill_one_decode_server_stream_the_tokens_of_one_mixed_server(pd_servers, offline_llm):
    prefill, decode = pd_servers
    before = scrape(prefill)["ernie:prompt_tokens_total"] if "ernie:prompt_tokens_total" in scrape(prefill) else 0
    got = _concurrent_streams(decode, PROMPTS, 20)
    for prompt in PROMPTS:
        assert got[prompt] == _offline(offline_llm, prompt, 20), prompt
    assert scrape(prefill)["ernie:prompt_tokens_total"] > before  # the prompts really were prefilled there
    for server in pd_servers:
        assert _wait_all_free(server)["ernie:kv_cache_free_blocks"] == scrape(server)["ernie:kv_cache_total_blocks"]


def test_cancel_mid_stream_on_the_decode_server_frees_blocks_on_both(pd_servers):
    prefill, decode = pd_servers
    client = grpcclient.InferenceServerClient(decode.grpc_url)
    seen: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: seen.put((result, error)))
    client.async_stream_infer("ernie", build_inputs(text=PROMPTS[2], max_tokens=400, temperature=0,
                                                    sampling_parameters={"ignore_eos": True}),
                              request_id="to-cancel")
    for _ in range(5):
        result, error = seen.get(timeout=60)
        assert error is None, error
    during = scrape_once_blocks_are_held(decode)
    assert during["ernie:kv_cache_free_blocks"] < during["ernie:kv_cache_total_blocks"]
    client.stop_stream(cancel_requests=True)
    client.close()
    for server in (decode, prefill):
        now = _wait_all_free(server)
        assert now["ernie:kv_cache_free_blocks"] == now["ernie:kv_cache_total_blocks"], now
    assert scrape(decode)["ernie:generation_tokens_total"] < 300 + 4 * 20  # it really stopped


def test_a_dead_prefill_server_fails_the_decode_servers_requests_with_an_error(pd_servers):
    prefill, decode = pd_servers
    prefill.kill()  # last test of the module: the pair is not used again
    with pytest.raises(Exception) as e:
        list(stream_generate(decode.grpc_url, text=PROMPTS[0], max_tokens=8, temperature=0))
    assert "prefill server" in str(e.value) and "has not answered" in str(e.value), e.value
    assert scrape(decode)["ernie:engine_healthy"] == 1  # the decode server itself serves on
