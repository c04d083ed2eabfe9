"""Bounded soak: mixed traffic against a real tritonserver + OpenAI shim; nothing lost, nothing leaks.

    .venv/bin/python scripts/soak.py                          # 10 minutes, 8 clients, the embedded tiny model
    .venv/bin/python scripts/soak.py --duration 45 --checkpoint 15 --out out/soak-ci.json
    .venv/bin/python scripts/soak.py --simulated-gpu h200 --simulated-model ernie-4.5-21b-a3b --quantization wint8 \\
        --clients 256 --duration 1200 --checkpoint 240 --max-rss-growth-pct 5

Starts `ernie-serve`'s TritonServer on free ports and runs `--clients` concurrent clients (asyncio tasks on one
event loop, so hundreds of streams cost the client little CPU beside the server) until `--duration` seconds have
passed. The server runs the embedded tiny model, or with --simulated-gpu / --simulated-model the simulated
execution backend (docs/serving-path.md: a forward that sleeps for the target's modeled step time and replays
ERNIE-Thinking-shaped text), with the reasoning and tool-call parsers on and max_num_seqs sized to the clients.
Each client picks, at random (fixed --seed), one of: a shim chat stream (half of them offering a tool), a shim
completion, a gRPC stream on the `ernie` ensemble, each read to its end or cancelled after a few responses
(`--cancel-rate`), or a bad request (shim 400, gRPC INVALID_ARG). Every request must end the way its kind says:
a stream with [DONE] (an error event counts as an unexpected error), a refusal with its status. Anything else,
or no answer within --request-timeout, is "lost".

Every --checkpoint seconds the clients pause until the engine is idle, then the script records the requests done
so far, the RSS of tritonserver, its python stubs and the shim, and the KV cache's free blocks (which must be the
whole pool when idle). Passes when nothing is lost or unexpected, KV is whole at every checkpoint, and RSS grew
less than --max-rss-growth-mb (summed over processes) and --max-rss-growth-pct (each process) from the first
checkpoint under load to the last. Prints a table and writes JSON; exits 1 on a failure.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import re
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
TINY_SETTINGS = {"max_model_len": "512", "max_num_seqs": "8", "block_size": "16", "num_gpu_blocks_override": "256"}
KINDS = ("shim_chat_stream", "shim_completion", "grpc_stream", "shim_bad_request", "grpc_bad_request")
WEIGHTS = (4, 2, 3, 1, 1)
GRPC_CHANNELS = 8  # streams share a few channels (HTTP/2 multiplexes them) instead of one channel a request
# the tool the simulated text's <tool_call> block calls (simulated_backend/replay.py)
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather forecast for a city on a date.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "date": {"type": "string"},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "date"]}}}
# a chat stream's delta with a non-empty reasoning text / tool call list: the parsers split what came back
PARSED_FIELDS = {"reasoning_content": re.compile(r'"reasoning_content":\s*"[^"]'),
                 "tool_calls": re.compile(r'"tool_calls":\s*\[\s*\{')}


@dataclass(frozen=True)
class Traffic:
    """How long the generated answers are: the simulated text's </think> and <tool_call> come after a hundred
    tokens or so, so its streams run longer than the tiny model's."""
    min_tokens: int
    max_tokens: int


TINY_TRAFFIC = Traffic(8, 64)
SIMULATED_TRAFFIC = Traffic(16, 256)
PROMPT_BUDGET = 256  # tokens a soak prompt takes at most: the chat template, the tool, a short question


def server_settings(args: argparse.Namespace) -> dict[str, str]:
    """The server's flags: the tiny model's fixed small pool, or the simulated target sized to the clients (every
    stream in the batch at once; the KV pool sized like the target GPU's, as the simulated backend does)."""
    if args.simulated_gpu is None:
        return dict(TINY_SETTINGS)
    settings = {"execution_backend": "simulated", "simulated_gpu": args.simulated_gpu,
                "simulated_model": args.simulated_model, "max_num_seqs": args.clients,
                "max_model_len": PROMPT_BUDGET + SIMULATED_TRAFFIC.max_tokens,
                "max_num_batched_tokens": max(2048, 2 * args.clients),
                "reasoning_parser": "ernie-x1", "tool_call_parser": "ernie-x1"}
    if args.quantization not in (None, "bf16"):
        settings["quantization"] = args.quantization
    return {k: str(v) for k, v in settings.items()}


@dataclass
class Tally:
    outcomes: Counter = field(default_factory=Counter)  # (kind, outcome) -> count
    failures: list[str] = field(default_factory=list)  # first few unexpected / lost, with detail
    parsed: Counter = field(default_factory=Counter)  # chat streams whose events carried the parsers' fields

    def add(self, kind: str, outcome: str, detail: str = "") -> None:
        self.outcomes[(kind, outcome)] += 1
        if outcome in ("lost", "unexpected") and len(self.failures) < 20:
            self.failures.append(f"{kind}: {outcome}: {detail[:300]}")


class Trace:
    """httpcore's trace events of one request: on a failure, says whether the request went out on a new
    connection or on a pooled one the server may have closed meanwhile, and the last step that ran."""

    def __init__(self):
        self.events: list[str] = []
        self.started = time.monotonic()

    async def __call__(self, name: str, info: dict) -> None:
        self.events.append(name)

    def __str__(self) -> str:
        conn = "new connection" if any(e.startswith("connection.connect_tcp") for e in self.events) else \
            "pooled connection"
        failed = next((e for e in self.events if e.endswith(".failed")), None)
        step = failed or (self.events[-1] if self.events else "none")
        return f"{conn}, {'failed at' if failed else 'last step'} {step}, {time.monotonic() - self.started:.1f} s in"


class Clients:
    """The request kinds; each call returns (outcome, detail) with outcome ok | cancelled | refused |
    unexpected | lost. One event loop drives them all."""

    def __init__(self, server, request_timeout: float, cancel_rate: float, traffic: Traffic, http: httpx.AsyncClient,
                 grpc_clients: list, tally: Tally):
        self.tally = tally
        self.server = server
        self.shim = f"http://{server.host}:{server.openai_port}"
        self.timeout = request_timeout
        self.cancel_rate = cancel_rate
        self.traffic = traffic
        self.http = http
        self.grpc_clients = grpc_clients
        self._next_channel = 0

    def _max_tokens(self, rng: random.Random) -> int:
        return rng.randint(self.traffic.min_tokens, self.traffic.max_tokens)

    async def shim_chat_stream(self, rng: random.Random) -> tuple[str, str]:
        body = {"model": "ernie", "messages": [{"role": "user", "content": f"tell me about {rng.randint(0, 99)}"}],
                "max_tokens": self._max_tokens(rng), "stream": True, "temperature": rng.choice([0, 0.8])}
        if rng.random() < 0.5:
            body["tools"] = [WEATHER_TOOL]
        cancel_after = rng.randint(1, 4) if rng.random() < self.cancel_rate else None
        return await self._shim_stream("/v1/chat/completions", body, cancel_after)

    async def shim_completion(self, rng: random.Random) -> tuple[str, str]:
        body = {"model": "ernie", "prompt": f"story {rng.randint(0, 99)}", "max_tokens": self._max_tokens(rng)}
        trace = Trace()
        try:
            r = await self.http.post(self.shim + "/v1/completions", json=body, timeout=self.timeout,
                                     extensions={"trace": trace})
        except httpx.TimeoutException as e:
            return "lost", f"no answer: {e!r} ({trace})"
        except httpx.HTTPError as e:
            return "unexpected", f"{e!r} ({trace})"
        if r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("stop", "length"):
            return "ok", ""
        return "unexpected", f"{r.status_code} {r.text}"

    async def shim_bad_request(self, rng: random.Random) -> tuple[str, str]:
        body = rng.choice([{"model": "ernie", "prompt": "x", "max_tokens": -1},
                           {"model": "ernie", "prompt": "x", "temperature": "hot"},
                           {"model": "ernie", "messages": "not a list"}])
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        trace = Trace()
        try:
            r = await self.http.post(self.shim + path, json=body, timeout=self.timeout, extensions={"trace": trace})
        except httpx.TimeoutException as e:
            return "lost", f"no answer: {e!r} ({trace})"
        except httpx.HTTPError as e:
            return "unexpected", f"{e!r} ({trace})"
        return ("refused", "") if r.status_code == 400 else ("unexpected", f"{r.status_code} {r.text}")

    async def _shim_stream(self, path: str, body: dict, cancel_after: int | None) -> tuple[str, str]:
        events: list[str] = []
        trace = Trace()
        try:
            async with self.http.stream("POST", self.shim + path, json=body, timeout=self.timeout,
                                        extensions={"trace": trace}) as r:
                if r.status_code != 200:
                    return "unexpected", f"{r.status_code} {(await r.aread()).decode()}"
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        if cancel_after is not None and len(events) >= cancel_after:
                            return "cancelled", ""  # leaving the block closes the connection
        except httpx.TimeoutException as e:
            return "lost", f"stalled after {len(events)} events: {e!r} ({trace})"
        except httpx.HTTPError as e:
            return "lost", f"cut after {len(events)} events: {e!r} ({trace})"
        for name, seen in PARSED_FIELDS.items():  # evidence the parsers ran on what came back
            self.tally.parsed[name] += any(seen.search(e) for e in events)
        if any('"error"' in e for e in events):
            return "unexpected", next(e for e in events if '"error"' in e)
        return ("ok", "") if events and events[-1] == "[DONE]" else ("lost", f"no [DONE] after {len(events)} events")

    async def grpc_stream(self, rng: random.Random) -> tuple[str, str]:
        max_tokens = self._max_tokens(rng)
        cancel_after = rng.randint(1, 4) if rng.random() < self.cancel_rate else None
        return await self._grpc({"text_input": f"story {rng.randint(0, 99)}", "max_tokens": max_tokens,
                                 "stream": True}, cancel_after, expect_error=None)

    async def grpc_bad_request(self, rng: random.Random) -> tuple[str, str]:
        inputs = rng.choice([{"text_input": "x", "max_tokens": 0}, {"max_tokens": 4},
                             {"text_input": "x", "sampling_parameters": "{not json"}])
        return await self._grpc(inputs, None, expect_error=True)

    async def _grpc(self, fields: dict, cancel_after: int | None, expect_error: bool | None) -> tuple[str, str]:
        import tritonclient.grpc.aio as grpcclient

        inputs = []
        for name, value in fields.items():
            arr = (np.array([[value.encode()]], dtype=np.object_) if isinstance(value, str) else
                   np.array([[value]], dtype=np.bool_) if isinstance(value, bool) else np.array([[value]], np.int32))
            inp = grpcclient.InferInput(name, [1, 1], {np.object_: "BYTES", np.bool_: "BOOL",
                                                       np.int32: "INT32"}[arr.dtype.type])
            inp.set_data_from_numpy(arr)
            inputs.append(inp)
        client = self.grpc_clients[self._next_channel % len(self.grpc_clients)]
        self._next_channel += 1
        done = asyncio.Event()

        async def requests():
            yield {"model_name": "ernie", "inputs": inputs, "enable_empty_final_response": True}
            await done.wait()  # the request side stays open until this stream is over: no half-close mid-stream

        stream = client.stream_infer(requests())
        answers = stream.__aiter__()
        responses = 0
        try:
            while True:
                try:
                    result, error = await asyncio.wait_for(answers.__anext__(), self.timeout)
                except asyncio.TimeoutError:
                    return "lost", f"no final after {responses} responses"
                except StopAsyncIteration:
                    return "lost", f"stream closed after {responses} responses, no final"
                if error is not None:  # in-band stream errors carry no code in tritonserver 2.51, only text
                    return ("refused", "") if expect_error else ("unexpected", str(error))
                responses += 1
                if result.get_response().parameters["triton_final_response"].bool_param:
                    return ("unexpected", "served a bad request") if expect_error else ("ok", "")
                if cancel_after is not None and responses >= cancel_after:
                    stream.cancel()  # the RPC's cancellation: tritonserver cancels the request in the engine
                    return "cancelled", ""
        finally:
            done.set()
            stream.cancel()  # ends the RPC; a no-op once tritonserver has closed it


@dataclass
class Checkpoint:
    at_s: float
    rss_mb: dict[str, float]
    kv_free: int
    kv_total: int
    done: dict[str, int] = field(default_factory=dict)  # requests finished so far, by kind
    lost: int = 0


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def checkpoint(server, started: float, idle_timeout: float, tally: Tally | None = None) -> Checkpoint:
    """Wait for the engine to be idle, then read RSS per process and the KV pool."""
    from ernie_serve.serving.health import engine_cores, ernie_samples, python_stubs, requests_in_engines

    deadline = time.monotonic() + idle_timeout
    while True:
        samples = ernie_samples(server.metrics_url)
        if requests_in_engines(samples) == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    values = {name: v for name, _, v in samples}
    rss = {"tritonserver": rss_mb(server.proc.pid)}
    stubs = python_stubs(server.proc.pid)
    rss.update({s.instance: rss_mb(s.pid) for s in stubs})
    rss.update({f"{instance} core": rss_mb(pid) for instance, pid in engine_cores(stubs).items()})
    if server.openai_proc is not None:
        rss["shim"] = rss_mb(server.openai_proc.pid)
    done, lost = Counter(), 0
    for (kind, outcome), n in (tally.outcomes.items() if tally else ()):
        done[kind] += n
        lost += n if outcome == "lost" else 0
    return Checkpoint(round(time.monotonic() - started, 1), rss, int(values["ernie:kv_cache_free_blocks"]),
                      int(values["ernie:kv_cache_total_blocks"]), {k: done[k] for k in KINDS}, lost)


def run(args: argparse.Namespace) -> dict:
    from ernie_serve.serving.launcher import TritonServer, free_port

    # httpx logs a line a request at INFO once ernie_serve has configured logging: it would bury what matters
    logging.getLogger("httpx").setLevel(logging.WARNING)
    # the shim at warning level: its access log (a line a request) would bury what matters
    server = TritonServer(server_settings(args), http_port=free_port(), grpc_port=free_port(),
                          metrics_port=free_port(), openai_port=free_port(), openai_args=("--log-level", "warning"))
    server.start(timeout=300)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"http://{server.host}:{server.openai_port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("the shim did not become healthy")
            time.sleep(0.2)
        result = asyncio.run(soak(server, args))
        if not result["passed"]:
            report_server(server)
        return result
    except BaseException:
        report_server(server)
        raise
    finally:
        server.stop()
        server.cleanup()


def report_server(server) -> None:
    """What the server says about a failure, before its run dir is removed: its health and its log's tail."""
    print(f"tritonserver {'running' if server.proc.poll() is None else f'exited with {server.proc.returncode}'}; "
          f"health: {server.health_problem() or 'no problem seen'}\n--- tritonserver log (tail) ---\n"
          f"{server.log_tail(80)}", file=sys.stderr, flush=True)


async def soak(server, args: argparse.Namespace) -> dict:
    import tritonclient.grpc.aio as grpcclient

    traffic = TINY_TRAFFIC if args.simulated_gpu is None else SIMULATED_TRAFFIC
    # httpx's default idle expiry (5 s), as a plain client pools: the shim keeps an idle connection longer
    # (ernie-openai --timeout-keep-alive, 75 s), so the client always closes first, even when both event loops lag.
    limits = httpx.Limits(max_connections=args.clients + 8, max_keepalive_connections=args.clients + 8,
                          keepalive_expiry=5.0)
    grpc_clients = [grpcclient.InferenceServerClient(server.grpc_url) for _ in range(GRPC_CHANNELS)]
    tally = Tally()
    own_cpu = time.process_time()
    started = time.monotonic()
    end = started + args.duration
    running = asyncio.Event()
    running.set()
    in_flight = [0]

    async with httpx.AsyncClient(limits=limits) as http:
        clients = Clients(server, args.request_timeout, args.cancel_rate, traffic, http, grpc_clients, tally)

        async def client_loop(i: int) -> None:
            rng = random.Random(args.seed * 1000 + i)
            while time.monotonic() < end:
                await running.wait()
                if time.monotonic() >= end:
                    return
                kind = rng.choices(KINDS, WEIGHTS)[0]
                in_flight[0] += 1
                try:
                    outcome, detail = await getattr(clients, kind)(rng)
                except Exception as e:  # noqa: BLE001 - a client-side surprise is a finding too
                    outcome, detail = "unexpected", repr(e)
                finally:
                    in_flight[0] -= 1
                tally.add(kind, outcome, detail)

        async def drained() -> None:
            """Until every client has finished its request (each request is bounded by its own timeout)."""
            while in_flight[0]:
                await asyncio.sleep(0.1)

        points = [checkpoint(server, started, args.request_timeout, tally)]
        tasks = [asyncio.create_task(client_loop(i)) for i in range(args.clients)]
        next_point = started + args.checkpoint
        while time.monotonic() < end:
            await asyncio.sleep(min(1.0, max(0.0, min(next_point, end) - time.monotonic())))
            if time.monotonic() >= next_point and time.monotonic() < end:
                running.clear()  # pause: every client finishes its request, then waits
                await drained()
                points.append(await asyncio.to_thread(checkpoint, server, started, args.request_timeout, tally))
                print_checkpoint(points[-1])
                running.set()
                next_point += args.checkpoint
        _, late = await asyncio.wait(tasks, timeout=args.request_timeout + 30)
        for t in late:
            t.cancel()
        points.append(await asyncio.to_thread(checkpoint, server, started, args.request_timeout, tally))
    for c in grpc_clients:
        await c.close()
    alive = server.proc.poll() is None and server.health_problem() is None
    result = summarize(args, tally, points, alive)
    result["client_cpu_s"] = round(time.process_time() - own_cpu, 1)  # this process: the clients' own cost
    return result


def print_checkpoint(p: Checkpoint) -> None:
    """One line as each checkpoint is taken, so a long soak shows where it stands."""
    print(f"checkpoint {p.at_s:.0f} s: {sum(p.done.values())} requests, {p.lost} lost, KV {p.kv_free}/{p.kv_total} "
          "free, RSS MB " + ", ".join(f"{n} {mb:.0f}" for n, mb in p.rss_mb.items()), flush=True)


def rss_growth(points: list[Checkpoint]) -> tuple[dict[str, float], dict[str, float]]:
    """Per process: RSS growth in MB and in % from the first checkpoint under load to the last (the checkpoint
    before any request is left out when there are later ones: warm-up grows RSS)."""
    base = points[1] if len(points) > 2 else points[0]
    mb = {name: round(points[-1].rss_mb.get(name, 0) - v, 1) for name, v in base.rss_mb.items()}
    pct = {name: round(100 * mb[name] / v, 2) if v else 0.0 for name, v in base.rss_mb.items()}
    return mb, pct


def summarize(args, tally: Tally, points: list[Checkpoint], alive: bool) -> dict:
    by_outcome = Counter()
    for (_, outcome), n in tally.outcomes.items():
        by_outcome[outcome] += n
    growth, growth_pct = rss_growth(points)
    kv_whole = all(p.kv_free == p.kv_total for p in points)
    failures = []
    if by_outcome["lost"]:
        failures.append(f"{by_outcome['lost']} lost")
    if by_outcome["unexpected"]:
        failures.append(f"{by_outcome['unexpected']} unexpected")
    if not kv_whole:
        failures.append("KV blocks missing when idle")
    if args.max_rss_growth_mb is not None and sum(growth.values()) > args.max_rss_growth_mb:
        failures.append(f"RSS grew {sum(growth.values()):.0f} MB (limit {args.max_rss_growth_mb})")
    if args.max_rss_growth_pct is not None:
        over = [f"{n} {p:+.1f}%" for n, p in growth_pct.items() if p > args.max_rss_growth_pct]
        if over:
            failures.append(f"RSS grew over {args.max_rss_growth_pct}%: {', '.join(over)}")
    if not alive:
        failures.append("the server is not healthy at the end")
    return {"duration_s": args.duration, "clients": args.clients, "seed": args.seed, "cancel_rate": args.cancel_rate,
            "server": server_settings(args), "requests": sum(by_outcome.values()), "by_outcome": dict(by_outcome),
            "by_kind": {f"{k}/{o}": n for (k, o), n in sorted(tally.outcomes.items())},
            "chat_streams_with": dict(tally.parsed),
            "checkpoints": [p.__dict__ for p in points], "rss_growth_mb": growth, "rss_growth_pct": growth_pct,
            "max_rss_growth_mb": args.max_rss_growth_mb, "max_rss_growth_pct": args.max_rss_growth_pct,
            "kv_whole_when_idle": kv_whole, "first_failures": tally.failures, "failures": failures,
            "passed": not failures}


def print_table(result: dict) -> None:
    print(f"soak: {result['duration_s']:.0f} s, {result['clients']} clients, {result['requests']} requests: "
          + ", ".join(f"{o} {n}" for o, n in sorted(result["by_outcome"].items())))
    names = list(result["checkpoints"][0]["rss_mb"])
    print(f"{'t (s)':>7} {'done':>7} {'lost':>5} {'KV free':>13} " + " ".join(f"{n[:14]:>14}" for n in names)
          + "   (RSS MB)")
    for p in result["checkpoints"]:
        print(f"{p['at_s']:>7.0f} {sum(p['done'].values()):>7} {p['lost']:>5} {p['kv_free']:>6}/{p['kv_total']:<6} "
              + " ".join(f"{p['rss_mb'].get(n, 0):>14.0f}" for n in names))
    print("RSS growth since the first loaded checkpoint:",
          ", ".join(f"{n} {g:+.0f} MB ({result['rss_growth_pct'][n]:+.1f}%)"
                    for n, g in result["rss_growth_mb"].items()))
    for line in result["first_failures"]:
        print("  ", line)
    print("PASSED" if result["passed"] else "FAILED: " + "; ".join(result["failures"]))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=600.0, help="seconds of traffic (default 600)")
    ap.add_argument("--clients", type=int, default=8, help="concurrent clients (asyncio tasks)")
    ap.add_argument("--checkpoint", type=float, default=60.0, help="seconds between idle checkpoints")
    ap.add_argument("--cancel-rate", type=float, default=0.2, help="share of streams cancelled mid-way")
    ap.add_argument("--request-timeout", type=float, default=120.0, help="seconds without an answer = lost")
    ap.add_argument("--max-rss-growth-mb", type=float, default=None,
                    help="limit on the RSS growth summed over processes (default 150 unless --max-rss-growth-pct)")
    ap.add_argument("--max-rss-growth-pct", type=float, default=None, help="limit on each process's RSS growth in %%")
    ap.add_argument("--simulated-gpu", default=None, help="run on the simulated backend for this GPU (h200, ...)")
    ap.add_argument("--simulated-model", default=None, help="the simulated model shape (ernie-4.5-21b-a3b, ...)")
    ap.add_argument("--quantization", default=None, help="the simulated target's weights (wint8, ...; default bf16)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=ROOT / "out" / "soak.json")
    args = ap.parse_args(argv)
    for name in ("duration", "checkpoint", "request_timeout"):
        if getattr(args, name) <= 0:
            ap.error(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")
    if args.clients < 1 or not 0 <= args.cancel_rate <= 1:
        ap.error("--clients must be >= 1 and --cancel-rate within [0, 1]")
    for name in ("max_rss_growth_mb", "max_rss_growth_pct"):
        if getattr(args, name) is not None and getattr(args, name) < 0:
            ap.error(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    if (args.simulated_gpu is None) != (args.simulated_model is None):
        ap.error("--simulated-gpu and --simulated-model go together")
    if args.quantization is not None and args.simulated_gpu is None:
        ap.error("--quantization applies to the simulated target only (with --simulated-gpu)")
    if args.max_rss_growth_mb is None and args.max_rss_growth_pct is None:
        args.max_rss_growth_mb = 150.0
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = run(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print_table(result)
    print(f"wrote {args.out}")
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
