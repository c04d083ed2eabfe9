"""Served against offline throughput, and the CPU each serving process spends a token (bench_host_overhead.py's
serving half).

One workload, greedy with ignore_eos so every stream yields exactly `max_tokens` tokens: `streams` requests sent
at once, through Triton's gRPC stream (one bidirectional stream carrying them all), Triton's HTTP
`generate_stream` (SSE) and the OpenAI shim (`/v1/completions`, SSE), against `LLM.generate` on the same prompts.
CPU per token comes from /proc (utime + stime) of tritonserver, each Python-backend stub (named by its model) and
the shim, over each run; the client's own CPU is reported too, since on a small box it competes with the server.
"""
from __future__ import annotations

import asyncio
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

PROMPT = "Tell me about the weather in city number {i} and what people there like to eat"
_TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """utime + stime of one process, from /proc (0 once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / _TICK


def serving_processes(server) -> dict[str, int]:
    """name -> pid: tritonserver, its Python-backend stubs (by model), the engine core process a stub started
    ("<model> core", engine/core_process.py) and the OpenAI shim."""
    from ernie_serve.serving.health import engine_cores, python_stubs

    procs = {"tritonserver": server.proc.pid}
    stubs = python_stubs(server.proc.pid)
    for stub in stubs:
        procs[stub.model if stub.model not in procs else f"{stub.model}#{stub.pid}"] = stub.pid
    models = {stub.instance: stub.model for stub in stubs}
    for instance, pid in engine_cores(stubs).items():
        procs[f"{models[instance]} core" if f"{models[instance]} core" not in procs else f"{instance} core"] = pid
    if server.openai_proc is not None:
        procs["shim"] = server.openai_proc.pid
    return procs


@dataclass
class Run:
    path: str
    streams: int
    tokens: int
    seconds: float
    cpu_ms_per_token: dict[str, float]

    @property
    def tok_per_s(self) -> float:
        return self.tokens / self.seconds


async def _grpc(url: str, streams: int, max_tokens: int, mark=None) -> int:
    from ernie_client.triton_client import build_inputs, parse_result
    from tritonclient.grpc.aio import InferenceServerClient

    async def requests():
        for i in range(streams):
            yield {"model_name": "ernie", "request_id": f"g{i}", "enable_empty_final_response": True,
                   "inputs": build_inputs(text=PROMPT.format(i=i), max_tokens=max_tokens, temperature=0,
                                          sampling_parameters={"ignore_eos": True})}

    tokens, done = 0, 0
    async with InferenceServerClient(url) as client:
        async for result, error in client.stream_infer(requests()):
            if error is not None:
                raise RuntimeError(f"gRPC stream: {error}")
            if result.get_response().outputs:
                n = len(parse_result(result).output_ids)
                tokens += n
                if mark is not None and n:
                    mark(int(result.get_response().id[1:]))
            if result.get_response().parameters["triton_final_response"].bool_param:
                done += 1
                if done == streams:
                    break
    return tokens


async def _sse(session, url: str, body: dict, count, mark=None) -> int:
    """POST body, read the SSE stream to its end; count(event) gives the tokens generated as of an event (0 if
    it does not say), the stream's count is the largest. mark(event): called as each event arrives."""
    tokens = 0
    async with session.post(url, json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"{url}: HTTP {r.status}: {await r.text()}")
        async for line in r.content:
            line = line.strip()
            if line.startswith(b"data:") and line != b"data: [DONE]":
                event = json.loads(line[5:])
                tokens = max(tokens, count(event))
                if mark is not None:
                    mark(event)
    return tokens


async def _http(base: str, streams: int, max_tokens: int, mark=None) -> int:
    body = lambda i: {"text_input": PROMPT.format(i=i), "max_tokens": max_tokens, "temperature": 0,  # noqa: E731
                      "stream": True, "sampling_parameters": json.dumps({"ignore_eos": True})}
    async with _session(streams) as s:
        counts = await asyncio.gather(*[_sse(s, f"http://{base}/v2/models/ernie/generate_stream", body(i),
                                             _http_tokens, _http_marker(mark, i))
                                        for i in range(streams)])
    return sum(counts)


async def _shim(base: str, streams: int, max_tokens: int, mark=None) -> int:
    body = lambda i: {"model": "ernie", "prompt": PROMPT.format(i=i), "max_tokens": max_tokens,  # noqa: E731
                      "temperature": 0, "ignore_eos": True, "stream": True,
                      "stream_options": {"include_usage": True}}
    usage = lambda e: (e.get("usage") or {}).get("completion_tokens", 0)  # noqa: E731  (the last chunk's)
    async with _session(streams) as s:
        counts = await asyncio.gather(*[_sse(s, f"{base}/v1/completions", body(i), usage,
                                             None if mark is None else lambda e, i=i: e.get("choices") and mark(i))
                                        for i in range(streams)])
    return sum(counts)


def _session(streams: int):
    """An aiohttp session that holds every stream's connection at once (aiohttp's default caps them at 100, which
    would run streams beyond 100 one after another)."""
    import aiohttp

    return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600),
                                 connector=aiohttp.TCPConnector(limit=streams))


def _http_tokens(event: dict) -> int:
    return int(event.get("num_output_tokens") or 0)


def _http_marker(mark, i: int):
    """For stream i's _sse: mark(i) at each generate_stream event that brought tokens (None: no marks)."""
    if mark is None:
        return None
    seen = [0]

    def on_event(event: dict) -> None:
        if _http_tokens(event) > seen[0]:
            seen[0] = _http_tokens(event)
            mark(i)
    return on_event


def wait_for_shim(server, timeout: float = 60.0) -> None:
    """The launcher starts the shim without waiting for it: until its /health answers."""
    import urllib.request

    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{server.openai_port}/health", timeout=2):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def served_settings(streams: int, **flags) -> dict:
    """The server flags the served runs use for `streams` concurrent streams (every stream runs at once)."""
    return {"max_num_seqs": streams, "max_model_len": 512, "max_num_batched_tokens": max(2048, 2 * streams), **flags}


def make_server(settings: dict, repository=None):
    """A TritonServer (not started) with these flags and the OpenAI shim, every port a free one."""
    from ernie_serve.serving.launcher import TritonServer, free_port

    return TritonServer({k: str(v) for k, v in settings.items()}, repository=repository, http_port=free_port(),
                        grpc_port=free_port(), metrics_port=free_port(), openai_port=free_port())


def served(server, path: str, streams: int, max_tokens: int, mark=None) -> Run:
    """One run of `streams` requests through `path` ("grpc", "http" or "shim") of a started server (its shim up:
    wait_for_shim, or its start-up would count as CPU of the first run). mark(i): called as each response of
    stream i that brought tokens arrives (the shim's: each chunk with a choice), e.g. to time inter-token gaps."""
    client = {"grpc": lambda: _grpc(server.grpc_url, streams, max_tokens, mark),
              "http": lambda: _http(server.http_url, streams, max_tokens, mark),
              "shim": lambda: _shim(f"http://127.0.0.1:{server.openai_port}", streams, max_tokens, mark)}[path]
    procs = serving_processes(server)
    before = {name: cpu_seconds(pid) for name, pid in procs.items()}
    own = time.process_time()
    t0 = time.perf_counter()
    tokens = asyncio.run(client())
    seconds = time.perf_counter() - t0
    spent = {name: cpu_seconds(pid) - before[name] for name, pid in procs.items()}
    spent["client (this process)"] = time.process_time() - own
    if tokens != streams * max_tokens:
        raise RuntimeError(f"{path}: {tokens} tokens came back, {streams * max_tokens} were asked for")
    return Run(path, streams, tokens, seconds, {k: 1e3 * v / tokens for k, v in spent.items()})


def offline(llm, streams: int, max_tokens: int) -> Run:
    """The same prompts through the offline LLM (tokenized as the ensemble's tokenizer does: with BOS)."""
    from ernie_serve import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    own = time.process_time()
    t0 = time.perf_counter()
    outs = llm.generate([PROMPT.format(i=i) for i in range(streams)], params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return Run("offline", streams, tokens, seconds, {"this process": 1e3 * (time.process_time() - own) / tokens})
