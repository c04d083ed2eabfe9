"""End-to-end: a real tritonserver serving the embedded tiny model through the `ernie` ensemble."""
from __future__ import annotations

import json
import queue
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from ernie_client.triton_client import build_inputs, generate, parse_result, stream_generate
from ernie_serve import SamplingParams

from e2e_helpers import scrape, scrape_once_blocks_are_held

pytestmark = pytest.mark.e2e
PROMPT = "The quick brown fox jumps over the lazy dog"


def offline_text(llm, prompt: str, max_tokens: int) -> tuple[str, list[int]]:
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False)[0]
    return out.outputs[0].text, list(out.outputs[0].token_ids)


def http_post(server, path: str, body: dict) -> tuple[int, str]:
    req = urllib.request.Request(f"http://{server.http_url}{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def sse_events(body: str) -> list[dict]:
    return [json.loads(line[5:]) for line in body.splitlines() if line.startswith("data:")]


def test_grpc_stream_matches_offline_llm(triton_server, offline_llm):
    want_text, want_ids = offline_text(offline_llm, PROMPT, 24)
    deltas = list(stream_generate(triton_server.grpc_url, text=PROMPT, max_tokens=24, temperature=0))
    assert "".join(d.text for d in deltas) == want_text
    assert [t for d in deltas for t in d.output_ids] == want_ids
    assert len(deltas) > 1  # streamed, not one lump
    assert deltas[-1].finish_reason == "length" and all(d.finish_reason is None for d in deltas[:-1])
    assert deltas[-1].num_output_tokens == 24


def test_http_generate_stream_matches_offline_llm(triton_server, offline_llm):
    want_text, _ = offline_text(offline_llm, PROMPT, 16)
    status, body = http_post(triton_server, "/v2/models/ernie/generate_stream",
                             {"text_input": PROMPT, "max_tokens": 16, "temperature": 0, "stream": True})
    assert status == 200, body
    events = sse_events(body)
    assert len(events) > 1
    assert "".join(e["text_output"] for e in events) == want_text
    assert events[-1]["finish_reason"] == "length"


def test_a_tokenized_prompt_gives_what_its_text_gives(triton_server):
    by_text = generate(triton_server.grpc_url, text=PROMPT, max_tokens=12, temperature=0)
    ids = by_text.prompt_token_ids
    by_ids = generate(triton_server.grpc_url, input_token_ids=ids, max_tokens=12, temperature=0)
    assert by_ids.output_ids == by_text.output_ids and by_ids.text == by_text.text
    assert by_ids.prompt_token_ids == ids and by_ids.num_input_tokens == len(ids)
    status, body = http_post(triton_server, "/v2/models/ernie/generate",  # the JSON list for a [-1] INT32 input
                             {"input_token_ids": ids, "max_tokens": 12, "temperature": 0})
    assert status == 200 and json.loads(body)["output_ids"] == by_text.output_ids, body
    status, body = http_post(triton_server, "/v2/models/ernie/generate",
                             {"input_token_ids": [5, 10**6 % 2**31], "max_tokens": 2})
    assert status == 400 and "input_token_ids: token ids must be in [0, " in body, body


def test_non_streaming_returns_whole_text_once(triton_server, offline_llm):
    want_text, _ = offline_text(offline_llm, PROMPT, 16)
    deltas = list(stream_generate(triton_server.grpc_url, text=PROMPT, max_tokens=16, temperature=0, stream=False))
    assert len(deltas) == 1 and deltas[0].text == want_text and deltas[0].finish_reason == "length"
    status, body = http_post(triton_server, "/v2/models/ernie/generate",
                             {"text_input": PROMPT, "max_tokens": 16, "temperature": 0, "exclude_input_in_output": True})
    assert status == 200, body
    assert json.loads(body)["text_output"] == want_text
    # vLLM-backend semantics: without exclude_input_in_output a non-streaming text request echoes its prompt
    status, body = http_post(triton_server, "/v2/models/ernie/generate", {"text_input": PROMPT, "max_tokens": 16,
                                                                          "temperature": 0})
    assert json.loads(body)["text_output"] == PROMPT + want_text


def test_logprobs_stream_one_entry_per_new_token_and_match_the_offline_engine(triton_server, offline_llm):
    want = offline_llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8, logprobs=2),
                                use_tqdm=False)[0].outputs[0]
    deltas = list(stream_generate(triton_server.grpc_url, text=PROMPT, max_tokens=8, temperature=0,
                                  sampling_parameters={"logprobs": 2}))
    assert all(len(d.logprobs) == len(d.output_ids) for d in deltas)
    entries = [e for d in deltas for e in d.logprobs]
    assert [e["token_id"] for e in entries] == list(want.token_ids)
    for e, offline in zip(entries, want.logprobs):
        assert e["logprob"] == pytest.approx(offline[e["token_id"]].logprob, abs=1e-4)
        assert len(e["top_logprobs"]) == 2 and e["top_logprobs"][0]["logprob"] >= e["top_logprobs"][1]["logprob"]
        assert e["token"] and e["bytes"] == list(e["token"].encode()) or e["bytes"]
    # greedy: the sampled token is the best alternative
    assert all(e["top_logprobs"][0]["token_id"] == e["token_id"] for e in entries)
    # non-streaming gets every token's entry in its one response; BLS gives the same
    for model in ("ernie", "ernie_bls"):
        whole = list(stream_generate(triton_server.grpc_url, model=model, text=PROMPT, max_tokens=8, temperature=0,
                                     sampling_parameters={"logprobs": 2}, stream=False))
        assert len(whole) == 1 and whole[0].logprobs == entries
    # TensorRT-LLM's switch: the sampled token's logprob only
    r = generate(triton_server.grpc_url, text=PROMPT, max_tokens=4, temperature=0, return_log_probs=True)
    assert len(r.logprobs) == 4 and all(e["top_logprobs"] == [] for e in r.logprobs)
    assert generate(triton_server.grpc_url, text=PROMPT, max_tokens=4, temperature=0).logprobs == []


def test_prompt_token_ids_come_once_on_the_first_response(triton_server, offline_llm):
    want = offline_llm.tokenizer.encode(PROMPT, add_special_tokens=True)
    deltas = list(stream_generate(triton_server.grpc_url, text=PROMPT, max_tokens=4, temperature=0))
    assert deltas[0].prompt_token_ids == want and all(d.prompt_token_ids == [] for d in deltas[1:])
    whole = list(stream_generate(triton_server.grpc_url, text=PROMPT, max_tokens=4, temperature=0, stream=False))
    assert whole[0].prompt_token_ids == want
    assert deltas[-1].num_reasoning_tokens == 0  # no reasoning parser on this server


def test_skip_parsers_returns_the_raw_text_of_a_parsed_request(triton_server, offline_llm):
    want_text, _ = offline_text(offline_llm, PROMPT, 16)
    # a per-request reasoning parser sends a text request's output to reasoning_content ...
    status, body = http_post(triton_server, "/v2/models/ernie/generate", {
        "text_input": PROMPT, "max_tokens": 16, "temperature": 0, "exclude_input_in_output": True,
        "reasoning_parser": "ernie-x1"})
    parsed = json.loads(body)
    assert status == 200 and parsed["reasoning_content"] == want_text.split("</think>")[0]
    assert parsed["num_reasoning_tokens"] > 0
    # ... and skip_parsers (an input, or a request parameter) turns it off for the request
    status, body = http_post(triton_server, "/v2/models/ernie/generate", {
        "text_input": PROMPT, "max_tokens": 16, "temperature": 0, "exclude_input_in_output": True,
        "reasoning_parser": "ernie-x1", "skip_parsers": True})
    raw = json.loads(body)
    assert (raw["text_output"], raw["reasoning_content"], raw["num_reasoning_tokens"]) == (want_text, "", 0)
    r = generate(triton_server.grpc_url, text=PROMPT, max_tokens=16, temperature=0, skip_parsers=True)
    assert r.text == want_text


def test_n_above_1_is_refused_with_what_to_do_instead(triton_server):
    status, body = http_post(triton_server, "/v2/models/ernie/generate",
                             {"text_input": "hi", "sampling_parameters": json.dumps({"n": 2})})
    assert status == 400 and "n=1" in body and "OpenAI shim" in body


def test_bls_model_gives_the_same_stream(triton_server, offline_llm):
    want_text, _ = offline_text(offline_llm, PROMPT, 16)
    r = generate(triton_server.grpc_url, model="ernie_bls", text=PROMPT, max_tokens=16, temperature=0)
    assert r.text == want_text and r.finish_reason == "length"


def test_sampling_parameters_json_and_stop_words(triton_server, offline_llm):
    want_text, _ = offline_text(offline_llm, PROMPT, 16)
    r = generate(triton_server.grpc_url, text=PROMPT, sampling_parameters={"temperature": 0, "max_tokens": 16})
    assert r.text == want_text
    stop = want_text[len(want_text) // 2: len(want_text) // 2 + 3]
    if stop.strip():
        r = generate(triton_server.grpc_url, text=PROMPT, max_tokens=16, temperature=0, stop=[stop])
        assert r.text == want_text[: want_text.index(stop)] and r.finish_reason == "stop"


def test_16_concurrent_streams_complete_with_distinct_outputs(triton_server, offline_llm):
    prompts = [f"Request number {i} asks about {w}" for i, w in
               enumerate("apples boats cities dragons engines forests gardens harbors islands jungles "
                         "kites lakes mountains nests oceans planets".split())]
    want = {p: offline_text(offline_llm, p, 12)[0] for p in prompts}
    client = grpcclient.InferenceServerClient(triton_server.grpc_url)
    results: dict[str, list] = {p: [] for p in prompts}
    finals: dict[str, int] = {p: 0 for p in prompts}
    done = threading.Event()
    lock = threading.Lock()

    def callback(result, error):
        assert error is None, error.message() if error is not None else ""
        rid = result.get_response().id
        final = result.get_response().parameters["triton_final_response"].bool_param
        with lock:
            if result.get_response().outputs:
                results[prompts[int(rid)]].append(parse_result(result).text)
            if final:
                finals[prompts[int(rid)]] += 1
                if sum(finals.values()) == len(prompts):
                    done.set()

    client.start_stream(callback=callback)
    try:
        for i, p in enumerate(prompts):
            client.async_stream_infer("ernie", build_inputs(text=p, max_tokens=12, temperature=0), request_id=str(i),
                                      enable_empty_final_response=True)
        assert done.wait(120), f"finals: {finals}"
    finally:
        client.stop_stream()
        client.close()
    assert all(n == 1 for n in finals.values()), finals
    got = {p: "".join(results[p]) for p in prompts}
    assert len(set(got.values())) == len(prompts)
    mismatched = [p for p in prompts if got[p] != want[p]]
    assert not mismatched, {p: (got[p], want[p]) for p in mismatched}


def ensemble_requests_done(server) -> int:
    """Requests the `ernie` ensemble finished (successfully or not), from Triton's statistics."""
    with urllib.request.urlopen(f"http://{server.http_url}/v2/models/ernie/stats", timeout=5) as r:
        stats = json.loads(r.read())["model_stats"][0]["inference_stats"]
    return int(stats["success"]["count"]) + int(stats["fail"]["count"])


def test_cancel_mid_stream_frees_every_kv_block(triton_server):
    before = scrape(triton_server)
    done_before = ensemble_requests_done(triton_server)
    total = before["ernie:kv_cache_total_blocks"]
    client = grpcclient.InferenceServerClient(triton_server.grpc_url)
    seen: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: seen.put((result, error)))
    long_prompt = " ".join(["many words make a long prompt"] * 20)  # 201 tokens: 311 are left of max_model_len
    client.async_stream_infer("ernie", build_inputs(text=long_prompt, max_tokens=300, temperature=0,
                                                    sampling_parameters={"ignore_eos": True}),
                              request_id="to-cancel")
    for _ in range(5):
        result, error = seen.get(timeout=60)
        assert error is None, error.message() if error is not None else ""
    assert scrape_once_blocks_are_held(triton_server)["ernie:kv_cache_free_blocks"] < total
    client.stop_stream(cancel_requests=True)
    client.close()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        now = scrape(triton_server)
        if now["ernie:kv_cache_free_blocks"] == total and now["ernie:num_requests_running"] == 0:
            break
        time.sleep(0.2)
    assert now["ernie:kv_cache_free_blocks"] == total, now
    assert now["ernie:request_success_total"] > before.get("ernie:request_success_total", 0)
    # and the ensemble request itself ends: tritonserver 2.51 leaks it (it stays "in flight" and holds
    # shutdown for --exit-timeout-secs) if a step fails while ernie_moe still streams
    while time.monotonic() < deadline and ensemble_requests_done(triton_server) == done_before:
        time.sleep(0.2)
    assert ensemble_requests_done(triton_server) == done_before + 1
    # far fewer than the 300 tokens asked for were generated: the engine really stopped
    assert now["ernie:generation_tokens_total"] - before["ernie:generation_tokens_total"] < 200


BAD_INPUTS = [
    ({"max_tokens": 8}, "text_input"),  # (a request with no inputs at all is refused by Triton itself)
    ({"text_input": "hi", "messages": json.dumps([{"role": "user", "content": "hi"}])}, "text_input"),
    ({"messages": "{not json"}, "messages"),
    ({"messages": json.dumps({"role": "user"})}, "messages"),
    ({"messages": json.dumps([{"content": "no role"}])}, "messages"),
    ({"text_input": "hi", "max_tokens": 0}, "max_tokens"),
    ({"text_input": "hi", "max_tokens": -3}, "max_tokens"),
    ({"text_input": "hi", "temperature": -1.0}, "temperature"),
    ({"text_input": "hi", "top_p": 0.0}, "top_p"),
    ({"text_input": "word " * 600}, "max_model_len"),
    ({"text_input": "hi", "sampling_parameters": json.dumps({"temprature": 0})}, "temprature"),
    ({"text_input": "hi", "sampling_parameters": "[1, 2]"}, "sampling_parameters"),
    ({"text_input": "hi", "sampling_parameters": json.dumps({"max_tokens": "many"})}, "max_tokens"),
    ({"text_input": "hi", "reasoning_parser": "no-such-parser"}, "reasoning_parser"),
    ({"text_input": "hi", "tool_call_parser": "nope"}, "tool_call_parser"),
    ({"messages": json.dumps([{"role": "user", "content": "x"}]), "tools": "5"}, "tools"),
]


@pytest.mark.parametrize("body,field", BAD_INPUTS, ids=[f for _, f in BAD_INPUTS])
def test_bad_input_gets_invalid_arg_naming_the_field(triton_server, body, field):
    status, text = http_post(triton_server, "/v2/models/ernie/generate", body)
    assert status == 400, text
    assert field in json.loads(text)["error"], text


def test_grpc_bad_input_is_invalid_argument_with_a_final(triton_server):
    with pytest.raises(Exception) as info:
        list(stream_generate(triton_server.grpc_url, text="hi", max_tokens=0))
    # a streamed error carries only its message (the HTTP tests check the code: 400 = INVALID_ARG)
    assert "max_tokens" in str(info.value), info.value
    # and the server keeps serving
    assert generate(triton_server.grpc_url, text="hi", max_tokens=4, temperature=0).num_output_tokens == 4


def test_genai_perf_tensorrtllm_payload(triton_server):
    """genai-perf --backend tensorrtllm: text_input, max_tokens, stream, exclude_input_in_output only."""
    client = grpcclient.InferenceServerClient(triton_server.grpc_url)
    q: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: q.put((result, error)))
    inputs = []
    for name, dtype, value in (("text_input", "BYTES", np.array([[PROMPT.encode()]], dtype=np.object_)),
                               ("max_tokens", "INT32", np.array([[8]], dtype=np.int32)),
                               ("stream", "BOOL", np.array([[True]])),
                               ("exclude_input_in_output", "BOOL", np.array([[True]]))):
        inp = grpcclient.InferInput(name, list(value.shape), dtype)
        inp.set_data_from_numpy(value)
        inputs.append(inp)
    client.async_stream_infer("ernie", inputs, request_id="genai-perf", enable_empty_final_response=True)
    texts = []
    while True:
        result, error = q.get(timeout=60)
        assert error is None, error.message() if error is not None else ""
        if result.get_response().outputs:
            texts.append(parse_result(result).text)
        if result.get_response().parameters["triton_final_response"].bool_param:
            break
    client.stop_stream()
    client.close()
    assert "".join(texts)


def test_chat_request_uses_the_chat_template(triton_server, offline_llm):
    messages = [{"role": "user", "content": "Say something nice."}]
    want = offline_llm.chat(messages, SamplingParams(temperature=0, max_tokens=12))[0].outputs[0].text
    r = generate(triton_server.grpc_url, messages=messages, max_tokens=12, temperature=0)
    assert r.text == want
    assert r.num_input_tokens > 5


def test_metrics_are_scraped_and_counters_move(triton_server):
    before = scrape(triton_server)
    generate(triton_server.grpc_url, text=PROMPT, max_tokens=8, temperature=0)
    time.sleep(0.3)
    after = scrape(triton_server)
    assert after["ernie:generation_tokens_total"] >= before.get("ernie:generation_tokens_total", 0) + 8
    assert after["ernie:prompt_tokens_total"] > before.get("ernie:prompt_tokens_total", 0)
    assert after["ernie:e2e_request_latency_seconds_count"] > before.get("ernie:e2e_request_latency_seconds_count", 0)
    assert after["ernie:time_to_first_token_seconds_count"] > before.get("ernie:time_to_first_token_seconds_count", 0)
    for name in ("ernie:num_requests_running", "ernie:num_requests_waiting", "ernie:kv_cache_usage_perc",
                 "ernie:prefix_cache_hit_rate", "ernie:num_preemptions_total", "ernie:engine_healthy"):
        assert name in after


def test_terminal_chat_client_prints_an_answer(triton_server):
    proc = subprocess.run([sys.executable, "-m", "ernie_client.chat", "--url", triton_server.grpc_url,
                           "--once", "hello", "--max-tokens", "6", "--temperature", "0"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "6 generated tokens" in proc.stdout
