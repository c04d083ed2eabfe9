"""sglang-router in front of two replicas, each a tritonserver + OpenAI shim as scripts/serve.sh starts them.

The router discovers the replicas (model name, tokenizer) without a 404 and tokenizes as they do; `cache_aware` keeps
a multi-turn conversation on one replica, which the replicas' own prefix-cache counters show against `round_robin`;
answers through the router equal a replica's own (greedy: streaming, reasoning, tool calls); a draining or full
replica says so on /health; and a SIGKILLed replica's requests end while new ones go to the other. One pair of
replicas serves the module; the kill comes last.
"""
from __future__ import annotations

import concurrent.futures
import json
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest

from ernie_client.openai import ServerConfig, create_app
from e2e_helpers import wait_for_health
from ernie_serve.serving.launcher import TritonServer
from openai_shim_helpers import RunningShim, listening_socket
from router_helpers import FAST_HEALTH, RouterProcess, shim_counters
from polling import wait_for as _wait

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]
DEMO = {row["name"]: row for row in map(json.loads, (ROOT / "backend/ernie_serve/demo/data/chat_demo.jsonl")
                                        .read_text().splitlines()) if row}
# The e2e servers' engine, with the ERNIE parsers: small, with room for the kill test's concurrent requests and for
# a request long enough (LONG) to stay in flight while a test looks at the replica.
SETTINGS = {"max_model_len": "8192", "max_num_seqs": "16", "block_size": "16", "num_gpu_blocks_override": "1024",
            "reasoning_parser": "ernie-x1", "tool_call_parser": "ernie-x1"}
TIMEOUT = httpx.Timeout(120.0, connect=5.0)


def _start_replica() -> TritonServer:
    server = TritonServer(SETTINGS, http_port=0, grpc_port=0, metrics_port=0, openai_port=0)  # 0: ports of its own
    try:
        server.start(timeout=300)
    except BaseException:
        server.cleanup()
        raise
    return server


@pytest.fixture(scope="module")
def replicas():
    """Two replicas started side by side, each with its shim's URL as `.url`."""
    pytest.importorskip("sglang_router", reason="sglang-router is installed by scripts/setup.sh (the router extra)")
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(_start_replica) for _ in range(2)]
        started = [f.result() for f in futures]
    for server in started:
        server.url = f"http://127.0.0.1:{server.openai_port}"
        wait_for_health(server.url, 60, server.openai_proc)
    yield started
    with concurrent.futures.ThreadPoolExecutor(2) as pool:  # each stop waits for its tritonserver to unload
        list(pool.map(lambda server: (server.stop(), server.cleanup()), started))


@pytest.fixture(scope="module")
def router(replicas, tmp_path_factory):
    r = RouterProcess(["--worker-urls", *[s.url for s in replicas], "--policy", "cache_aware", *FAST_HEALTH],
                      tmp_path_factory.mktemp("router") / "router.log")
    yield r
    r.stop()


def _get(url: str) -> int:
    try:
        return httpx.get(url, timeout=2).status_code
    except httpx.HTTPError:
        return 0


def _chat(url: str, **body) -> httpx.Response:
    body = {"model": "ernie", "temperature": 0, "max_tokens": 4, **body}
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=TIMEOUT)


# ---------------------------------------------------------------------------- discovery
def test_router_discovers_name_and_tokenizer_without_a_404(router, replicas):
    workers = httpx.get(router.url + "/workers", timeout=5).json()["workers"]
    assert {w["model_id"] for w in workers} == {"ernie"}
    log = router.log()
    assert "returned 404" not in log and "get_server_info" not in log, log[-3000:]
    assert "No tokenizer_path or model_path" not in log and "Failed to load tokenizer" not in log, log[-3000:]
    assert "Successfully registered tokenizer 'ernie'" in log, log[-3000:]
    # the router's own tokenizer gives the replicas' ids: added tokens, whitespace runs, digits, byte fallback
    for text in ["<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n\n<|im_start|>assistant\n<think>\n",
                 "  two  spaces\tand a tab 12345", "héllo wörld 😀 日本語"]:
        ours = httpx.post(replicas[0].url + "/tokenize", json={"prompt": text, "add_special_tokens": False},
                          timeout=5).json()["tokens"]
        theirs = httpx.post(router.url + "/v1/tokenize", json={"model": "ernie", "prompt": text},
                            timeout=5).json()["tokens"]
        assert theirs == ours, text


def test_server_info_and_load_say_what_the_replica_serves(replicas):
    info = httpx.get(replicas[0].url + "/server_info", timeout=5).json()
    assert info["served_model_name"] == "ernie" and info["tp_size"] == 1 and info["disaggregation_mode"] == "null"
    assert info["max_running_requests"] == 16 and (Path(info["model_path"]) / "tokenizer.json").is_file()
    assert httpx.get(replicas[0].url + "/get_server_info", timeout=5).json() == info
    model = httpx.get(replicas[0].url + "/model_info", timeout=5).json()
    assert model["tokenizer_path"] == info["model_path"] and model["architectures"] == ["Ernie4_5_MoeForCausalLM"]
    (load,) = httpx.get(replicas[0].url + "/get_load", timeout=5).json()
    assert load["num_reqs"] == 0 and load["num_waiting_reqs"] == 0 and load["num_tokens"] >= 0


# ---------------------------------------------------------------------------- cache affinity
# An odd number of conversations taken turn by turn: round_robin then sends each conversation's turns to the replicas
# in alternation (with an even number it would keep each on one replica too).
TOPICS = ["the lighthouse keeper's logbook", "a recipe for rye bread", "the orbit of a small comet",
          "a chess opening for beginners", "the history of paper money"]
TURNS = 4


def _conversations(tag: str) -> list[list[str]]:
    """Per conversation, the user turns: long enough that every turn adds whole KV blocks."""
    return [[f"[{tag}] Tell me, in turn {k}, more about {topic}; keep the details of the earlier turns in mind "
             f"and add one new fact about {topic} each time." for k in range(TURNS)] for topic in TOPICS]


def _run_conversations(url: str, replicas: list, tag: str) -> tuple[float, list[list[int]]]:
    """Turn by turn, conversations interleaved; returns the prefix-cache hit rate the replicas counted and, per
    conversation, which replica answered each turn (one request at a time, so its counter is the one that moved)."""
    before = [shim_counters(r.url) for r in replicas]
    history: list[list[dict]] = [[] for _ in TOPICS]
    placed: list[list[int]] = [[] for _ in TOPICS]
    for k in range(TURNS):
        for c, turns in enumerate(_conversations(tag)):
            history[c].append({"role": "user", "content": turns[k]})
            counts = [shim_counters(r.url)["chat"] for r in replicas]
            r = _chat(url, messages=history[c], chat_template_kwargs={"enable_thinking": False})
            assert r.status_code == 200, r.text
            moved = [i for i, rep in enumerate(replicas) if shim_counters(rep.url)["chat"] > counts[i]]
            assert len(moved) == 1, moved
            placed[c].append(moved[0])
            history[c].append({"role": "assistant", "content": f"Noted, part {k} about {TOPICS[c]}."})
    after = [shim_counters(r.url) for r in replicas]
    prompt = sum(a["prompt"] - b["prompt"] for a, b in zip(after, before))
    cached = sum(a["cached"] - b["cached"] for a, b in zip(after, before))
    return cached / prompt, placed


def test_cache_aware_keeps_each_conversation_on_one_replica(router, replicas, tmp_path):
    rr = RouterProcess(["--worker-urls", *[s.url for s in replicas], "--policy", "round_robin", *FAST_HEALTH],
                       tmp_path / "round_robin.log")
    try:
        rr_rate, rr_placed = _run_conversations(rr.url, replicas, "rr")
    finally:
        rr.stop()
    ca_rate, ca_placed = _run_conversations(router.url, replicas, "ca")
    print(f"prefix-cache hit rate: cache_aware {ca_rate:.2f}, round_robin {rr_rate:.2f}")
    assert all(len(set(p)) == 1 for p in ca_placed), ca_placed
    assert all(len(set(p)) == 2 for p in rr_placed), rr_placed
    assert ca_rate > rr_rate + 0.2, (ca_rate, rr_rate)


# ---------------------------------------------------------------------------- same answers as a replica
def _stream(url: str, body: dict) -> dict:
    """A stream's text, reasoning, tool calls, finish reason and usage (how the text is cut into chunks depends on
    timing, not on the answer)."""
    out: dict = {"content": "", "reasoning_content": "", "tool_calls": {}, "finish_reason": None, "usage": None}
    with httpx.stream("POST", url + "/v1/chat/completions", json={**body, "stream": True}, timeout=TIMEOUT) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            if chunk.get("usage"):
                out["usage"] = {k: v for k, v in chunk["usage"].items() if k != "prompt_tokens_details"}
            for choice in chunk["choices"]:
                delta = choice.get("delta") or {}
                for key in ("content", "reasoning_content"):
                    out[key] += delta.get(key) or ""
                for call in delta.get("tool_calls") or []:
                    fn = out["tool_calls"].setdefault(call["index"], {"name": "", "arguments": ""})
                    for key in ("name", "arguments"):
                        fn[key] += (call.get("function") or {}).get(key) or ""
                out["finish_reason"] = choice.get("finish_reason") or out["finish_reason"]
    return out


def _answer(url: str, body: dict) -> dict:
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    out = r.json()
    for call in out["choices"][0]["message"].get("tool_calls") or []:
        call.pop("id", None)
    out["usage"].pop("prompt_tokens_details", None)  # cached tokens depend on what ran before on that replica
    return {"choices": out["choices"], "usage": out["usage"]}


@pytest.mark.parametrize("name", ["capital", "weather_call", "parallel_calls", "weather_result"])
def test_answers_through_the_router_equal_a_replicas_own(router, replicas, name):
    row = json.loads(json.dumps(DEMO[name]))
    for m in row["messages"]:  # the router parses OpenAI's schema strictly: a tool call and its result carry an id
        for i, call in enumerate(m.get("tool_calls") or []):
            call.setdefault("id", f"call-{i}")
        if m["role"] == "tool":
            m.setdefault("tool_call_id", "call-0")
    body = {"model": "ernie", "messages": row["messages"], "temperature": 0, "max_tokens": 120}
    if "tools" in row:
        body["tools"] = row["tools"]
    direct = _answer(replicas[0].url, body)
    assert direct["choices"][0]["message"].get("reasoning_content")
    assert bool(direct["choices"][0]["message"].get("tool_calls")) == ("tool_calls" in row)
    assert _answer(router.url, body) == direct
    streamed = _stream(router.url, {**body, "stream_options": {"include_usage": True}})
    assert streamed == _stream(replicas[1].url, {**body, "stream_options": {"include_usage": True}})


# ---------------------------------------------------------------------------- draining and overload
# Seconds of decoding even for the tiny model on a fast CPU (1500 tokens once ended before /get_load showed its KV)
LONG = {"model": "ernie", "prompt": "Tell me a long story", "max_tokens": 6000, "temperature": 0, "ignore_eos": True}


class LongStream:
    """A long streamed completion read on a thread: `started` is set at its first chunk (it is in flight, its KV
    held); `close()` leaves early (the shim cancels it); at its end `text` is its last events."""

    def __init__(self, url: str):
        self.started, self.tail, self.error = threading.Event(), [], None
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._read, args=(url,), daemon=True)
        self.thread.start()

    def _read(self, url: str) -> None:
        try:
            with httpx.stream("POST", url + "/v1/completions", json={**LONG, "stream": True}, timeout=TIMEOUT) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        self.started.set()
                        self.tail = (self.tail + [line[len("data: "):]])[-2:]
                    if self._stop.is_set():
                        return
        except httpx.HTTPError as e:
            self.error = e
        finally:
            self.started.set()

    def close(self) -> None:
        self._stop.set()
        self.thread.join(30)

    def finish_reason(self) -> str | None:
        self.thread.join(120)
        assert not self.thread.is_alive() and self.error is None and self.tail[-1] == "[DONE]", (self.error, self.tail)
        return json.loads(self.tail[-2])["choices"][0]["finish_reason"]


def test_a_full_replica_says_so_on_health_and_in_its_load(replicas):
    """--max-concurrency 1 and one long request: /health 503 while it runs, /get_load counts it and the KV the
    engine holds for it; /health 200 once it is gone."""
    rep = replicas[0]
    shim = RunningShim(create_app(ServerConfig(triton_url=rep.grpc_url, max_concurrency=1,
                                               triton_metrics_url=rep.metrics_url)))
    try:
        stream = LongStream(shim.url)
        assert stream.started.wait(60) and stream.error is None
        health = httpx.get(shim.url + "/health", timeout=5)
        assert health.status_code == 503 and health.json()["error"]["code"] == "overloaded"
        (load,) = _wait(lambda: (lambda l: l if l[0]["num_tokens"] > 0 else None)(
            httpx.get(shim.url + "/get_load", timeout=5).json()), 30, "the engine's KV in /get_load")
        assert load["num_reqs"] == 1 and load["engine_running"] == 1 and load["num_tokens"] % 16 == 0
        stream.close()
        _wait(lambda: _get(shim.url + "/health") == 200, 30, "/health 200 once the slot is free")
    finally:
        shim.stop()


def test_a_draining_replica_leaves_the_rotation_and_finishes_its_requests(replicas, tmp_path):
    """SIGTERM to a shim with a request in flight: /health 503 and new requests 503 at once, the router marks it
    unhealthy and serves from the other replica, the running request completes, then the shim exits."""
    sock = listening_socket()  # handed over (--fd): nothing else can take the port in between
    port = sock.getsockname()[1]
    with sock:
        shim = subprocess.Popen([sys.executable, "-m", "ernie_client.openai_server", "--triton-url",
                                 replicas[1].grpc_url, "--port", str(port), "--fd", str(sock.fileno()),
                                 "--log-level", "warning", "--graceful-shutdown-seconds", "60"],
                                start_new_session=True, pass_fds=(sock.fileno(),))
    url = f"http://127.0.0.1:{port}"
    r = None
    try:
        wait_for_health(url, 60, shim)
        r = RouterProcess(["--worker-urls", replicas[0].url, url, "--policy", "round_robin", *FAST_HEALTH],
                          tmp_path / "router.log")
        stream = LongStream(url)
        assert stream.started.wait(60) and stream.error is None
        shim.send_signal(signal.SIGTERM)
        health = _wait(lambda: (lambda h: h if h.status_code == 503 else None)(httpx.get(url + "/health", timeout=5)),
                       10, "/health 503 while draining")
        assert health.json()["error"]["code"] == "draining"
        refused = _chat(url, messages=[{"role": "user", "content": "Hi"}])
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "draining"
        _wait(lambda: r.workers().get(url) is False, 20, "the router to mark the draining replica unhealthy")
        for _ in range(4):
            assert _chat(r.url, messages=[{"role": "user", "content": "Hi"}]).status_code == 200
        assert stream.finish_reason() == "length"  # ran to its end, no error event
        assert shim.wait(30) is not None
    finally:
        if r is not None:
            r.stop()
        if shim.poll() is None:
            shim.kill()
            shim.wait(5)


# ---------------------------------------------------------------------------- a replica dies (last: it stays dead)
def test_a_killed_replicas_requests_end_and_new_ones_succeed(router, replicas):
    """24 completions in flight over both replicas, one replica SIGKILLed (shim and tritonserver): every request
    ends (answered, or an error status), none hangs; then new requests all succeed on the survivor."""
    body = {"model": "ernie", "max_tokens": 200, "temperature": 0, "ignore_eos": True}
    # no two share a first character, so cache_aware matches none to a replica and spreads them by load
    prompts = [f"{chr(ord('A') + i)}: once upon a time" for i in range(24)]

    def one(prompt: str) -> int:
        try:
            return httpx.post(router.url + "/v1/completions", json={**body, "prompt": prompt},
                              timeout=TIMEOUT).status_code
        except httpx.HTTPError:
            return -1  # the connection ended: an error, not a hang

    victim = replicas[1]
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(one, p) for p in prompts]
        _wait(lambda: httpx.get(victim.url + "/get_load", timeout=5).json()[0]["num_reqs"] > 0, 30,
              "requests in flight on the victim")
        victim.openai_proc.send_signal(signal.SIGKILL)
        victim.kill()
        statuses = [f.result(timeout=150) for f in futures]
    print(f"after the kill: {statuses.count(200)}/24 answered, the rest ended with {sorted(set(statuses) - {200})}")
    assert all(s == 200 or s >= 400 or s == -1 for s in statuses)
    assert statuses.count(200) >= len(prompts) // 2  # the survivor's share at least; the router retries the rest
    _wait(lambda: router.workers().get(victim.url) is False, 20, "the router to mark the dead replica unhealthy")
    fresh = [_chat(router.url, messages=[{"role": "user", "content": f"Hi {i}"}]).status_code for i in range(8)]
    assert fresh == [200] * 8
