"""Bounded soak: mixed traffic against a real tritonserver + OpenAI shim; nothing lost, nothing leaks.

    .venv/bin/python scripts/soak.py                          # 10 minutes, 8 clients
    .venv/bin/python scripts/soak.py --duration 45 --checkpoint 15 --out out/soak-ci.json

Starts `ernie-serve`'s TritonServer on free ports (the embedded tiny model) and runs `--clients` threads
until `--duration` seconds have passed. Each picks, at random (fixed --seed), one of: a shim chat
stream, a shim completion, a gRPC stream on the `ernie` ensemble, each read to its end or cancelled
after a few responses (`--cancel-rate`), or a bad request (shim 400, gRPC INVALID_ARG). Every request
must end the way its kind says: a stream with [DONE] (an error event counts as an unexpected error),
a refusal with its status. Anything else, or no answer within --request-timeout, is "lost".

Every --checkpoint seconds the clients pause until the engine is idle, then the script records the
RSS of tritonserver, its python stubs and the shim, and the KV cache's free blocks (which must be the
whole pool when idle). Passes when nothing is lost or unexpected, KV is whole at every checkpoint,
and RSS grew less than --max-rss-growth-mb from the first checkpoint to the last. Prints a table and
writes JSON; exits 1 on a failure.
"""
from __future__ import annotations

import argparse
import json
import queue
import random
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = {"max_model_len": "512", "max_num_seqs": "8", "block_size": "16", "num_gpu_blocks_override": "256"}
KINDS = ("shim_chat_stream", "shim_completion", "grpc_stream", "shim_bad_request", "grpc_bad_request")
WEIGHTS = (4, 2, 3, 1, 1)


@dataclass
class Tally:
    outcomes: Counter = field(default_factory=Counter)  # (kind, outcome) -> count
    failures: list[str] = field(default_factory=list)  # first few unexpected / lost, with detail
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, kind: str, outcome: str, detail: str = "") -> None:
        with self.lock:
            self.outcomes[(kind, outcome)] += 1
            if outcome in ("lost", "unexpected") and len(self.failures) < 20:
                self.failures.append(f"{kind}: {outcome}: {detail[:300]}")


class Clients:
    """The request kinds; each call returns (outcome, detail) with outcome ok | cancelled | refused |
    unexpected | lost."""

    def __init__(self, server, request_timeout: float, cancel_rate: float):
        self.server = server
        self.shim = f"http://{server.host}:{server.openai_port}"
        self.timeout = request_timeout
        self.cancel_rate = cancel_rate

    def shim_chat_stream(self, rng: random.Random) -> tuple[str, str]:
        body = {"model": "ernie", "messages": [{"role": "user", "content": f"tell me about {rng.randint(0, 99)}"}],
                "max_tokens": rng.randint(8, 64), "stream": True, "temperature": rng.choice([0, 0.8])}
        cancel_after = rng.randint(1, 4) if rng.random() < self.cancel_rate else None
        return self._shim_stream("/v1/chat/completions", body, cancel_after)

    def shim_completion(self, rng: random.Random) -> tuple[str, str]:
        body = {"model": "ernie", "prompt": f"story {rng.randint(0, 99)}", "max_tokens": rng.randint(4, 48)}
        try:
            r = httpx.post(self.shim + "/v1/completions", json=body, timeout=self.timeout)
        except httpx.TimeoutException as e:
            return "lost", f"no answer: {e}"
        except httpx.HTTPError as e:
            return "unexpected", repr(e)
        if r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("stop", "length"):
            return "ok", ""
        return "unexpected", f"{r.status_code} {r.text}"

    def shim_bad_request(self, rng: random.Random) -> tuple[str, str]:
        body = rng.choice([{"model": "ernie", "prompt": "x", "max_tokens": -1},
                           {"model": "ernie", "prompt": "x", "temperature": "hot"},
                           {"model": "ernie", "messages": "not a list"}])
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        try:
            r = httpx.post(self.shim + path, json=body, timeout=self.timeout)
        except httpx.TimeoutException as e:
            return "lost", f"no answer: {e}"
        return ("refused", "") if r.status_code == 400 else ("unexpected", f"{r.status_code} {r.text}")

    def _shim_stream(self, path: str, body: dict, cancel_after: int | None) -> tuple[str, str]:
        events: list[str] = []
        try:
            with httpx.stream("POST", self.shim + path, json=body, timeout=self.timeout) as r:
                if r.status_code != 200:
                    return "unexpected", f"{r.status_code} {r.read().decode()}"
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        if cancel_after is not None and len(events) >= cancel_after:
                            return "cancelled", ""  # leaving the block closes the connection
        except httpx.TimeoutException as e:
            return "lost", f"stalled after {len(events)} events: {e}"
        except httpx.HTTPError as e:
            return "lost", f"cut after {len(events)} events: {e!r}"
        if any('"error"' in e for e in events):
            return "unexpected", next(e for e in events if '"error"' in e)
        return ("ok", "") if events and events[-1] == "[DONE]" else ("lost", f"no [DONE] after {len(events)} events")

    def grpc_stream(self, rng: random.Random) -> tuple[str, str]:
        max_tokens = rng.randint(8, 64)
        cancel_after = rng.randint(1, 4) if rng.random() < self.cancel_rate else None
        return self._grpc({"text_input": f"story {rng.randint(0, 99)}", "max_tokens": max_tokens, "stream": True},
                          cancel_after, expect_error=None)

    def grpc_bad_request(self, rng: random.Random) -> tuple[str, str]:
        inputs = rng.choice([{"text_input": "x", "max_tokens": 0}, {"max_tokens": 4},
                             {"text_input": "x", "sampling_parameters": "{not json"}])
        return self._grpc(inputs, None, expect_error=True)

    def _grpc(self, fields: dict, cancel_after: int | None, expect_error: bool | None) -> tuple[str, str]:
        import tritonclient.grpc as grpcclient

        inputs = []
        for name, value in fields.items():
            arr = (np.array([[value.encode()]], dtype=np.object_) if isinstance(value, str) else
                   np.array([[value]], dtype=np.bool_) if isinstance(value, bool) else np.array([[value]], np.int32))
            inp = grpcclient.InferInput(name, [1, 1], {np.object_: "BYTES", np.bool_: "BOOL",
                                                       np.int32: "INT32"}[arr.dtype.type])
            inp.set_data_from_numpy(arr)
            inputs.append(inp)
        client = grpcclient.InferenceServerClient(self.server.grpc_url)
        answers: queue.Queue = queue.Queue()
        client.start_stream(lambda result, error: answers.put((result, error)))
        cancelled = False
        try:
            client.async_stream_infer("ernie", inputs, enable_empty_final_response=True)
            responses = 0
            while True:
                try:
                    result, error = answers.get(timeout=self.timeout)
                except queue.Empty:
                    return "lost", f"no final after {responses} responses"
                if error is not None:  # in-band stream errors carry no code in tritonserver 2.51, only text
                    return ("refused", "") if expect_error else ("unexpected", error.message())
                responses += 1
                if result.get_response().parameters["triton_final_response"].bool_param:
                    return ("unexpected", "served a bad request") if expect_error else ("ok", "")
                if cancel_after is not None and responses >= cancel_after:
                    cancelled = True
                    return "cancelled", ""
        finally:
            client.stop_stream(cancel_requests=cancelled)
            client.close()


@dataclass
class Checkpoint:
    at_s: float
    rss_mb: dict[str, float]
    kv_free: int
    kv_total: int


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def checkpoint(server, started: float, idle_timeout: float) -> Checkpoint:
    """Wait for the engine to be idle, then read RSS per process and the KV pool."""
    from ernie_serve.serving.health import ernie_samples, python_stubs, requests_in_engines

    deadline = time.monotonic() + idle_timeout
    while True:
        samples = ernie_samples(server.metrics_url)
        if requests_in_engines(samples) == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    values = {name: v for name, _, v in samples}
    rss = {"tritonserver": rss_mb(server.proc.pid)}
    rss.update({s.instance: rss_mb(s.pid) for s in python_stubs(server.proc.pid)})
    if server.openai_proc is not None:
        rss["shim"] = rss_mb(server.openai_proc.pid)
    return Checkpoint(round(time.monotonic() - started, 1), rss, int(values["ernie:kv_cache_free_blocks"]),
                      int(values["ernie:kv_cache_total_blocks"]))


def run(args: argparse.Namespace) -> dict:
    from ernie_serve.serving.launcher import TritonServer, free_port

    # the shim at warning level: its access log (a line a request) would bury what matters
    server = TritonServer(SETTINGS, http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(),
                          openai_port=free_port(), openai_args=("--log-level", "warning"))
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
        result = soak(server, args)
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


def soak(server, args: argparse.Namespace) -> dict:
    clients = Clients(server, args.request_timeout, args.cancel_rate)
    tally = Tally()
    started = time.monotonic()
    end = started + args.duration
    running = threading.Event()
    running.set()
    in_request = threading.Semaphore(args.clients)

    def client_loop(i: int) -> None:
        rng = random.Random(args.seed * 1000 + i)
        while time.monotonic() < end:
            running.wait()
            with in_request:
                if time.monotonic() >= end:
                    return
                kind = rng.choices(KINDS, WEIGHTS)[0]
                try:
                    outcome, detail = getattr(clients, kind)(rng)
                except Exception as e:  # noqa: BLE001 - a client-side surprise is a finding too
                    outcome, detail = "unexpected", repr(e)
                tally.add(kind, outcome, detail)

    threads = [threading.Thread(target=client_loop, args=(i,), daemon=True) for i in range(args.clients)]
    points = [checkpoint(server, started, args.request_timeout)]
    for t in threads:
        t.start()
    next_point = started + args.checkpoint
    while time.monotonic() < end:
        time.sleep(min(1.0, max(0.0, min(next_point, end) - time.monotonic())))
        if time.monotonic() >= next_point and time.monotonic() < end:
            running.clear()  # pause: every client finishes its request, then waits
            for _ in range(args.clients):
                in_request.acquire()
            points.append(checkpoint(server, started, args.request_timeout))
            for _ in range(args.clients):
                in_request.release()
            running.set()
            next_point += args.checkpoint
    for t in threads:
        t.join(args.request_timeout + 30)
    points.append(checkpoint(server, started, args.request_timeout))
    alive = server.proc.poll() is None and server.health_problem() is None
    return summarize(args, tally, points, alive)


def summarize(args, tally: Tally, points: list[Checkpoint], alive: bool) -> dict:
    by_outcome = Counter()
    for (_, outcome), n in tally.outcomes.items():
        by_outcome[outcome] += n
    # From the first checkpoint taken under load (the first one is before any request: warm-up grows RSS).
    base = points[1] if len(points) > 2 else points[0]
    growth = {name: round(points[-1].rss_mb.get(name, 0) - mb, 1) for name, mb in base.rss_mb.items()}
    kv_whole = all(p.kv_free == p.kv_total for p in points)
    failures = []
    if by_outcome["lost"]:
        failures.append(f"{by_outcome['lost']} lost")
    if by_outcome["unexpected"]:
        failures.append(f"{by_outcome['unexpected']} unexpected")
    if not kv_whole:
        failures.append("KV blocks missing when idle")
    if sum(growth.values()) > args.max_rss_growth_mb:
        failures.append(f"RSS grew {sum(growth.values()):.0f} MB (limit {args.max_rss_growth_mb})")
    if not alive:
        failures.append("the server is not healthy at the end")
    return {"duration_s": args.duration, "clients": args.clients, "seed": args.seed, "cancel_rate": args.cancel_rate,
            "requests": sum(by_outcome.values()), "by_outcome": dict(by_outcome),
            "by_kind": {f"{k}/{o}": n for (k, o), n in sorted(tally.outcomes.items())},
            "checkpoints": [p.__dict__ for p in points], "rss_growth_mb": growth, "kv_whole_when_idle": kv_whole,
            "first_failures": tally.failures, "failures": failures, "passed": not failures}


def print_table(result: dict) -> None:
    print(f"soak: {result['duration_s']:.0f} s, {result['clients']} clients, {result['requests']} requests: "
          + ", ".join(f"{o} {n}" for o, n in sorted(result["by_outcome"].items())))
    names = list(result["checkpoints"][0]["rss_mb"])
    print(f"{'t (s)':>7} {'KV free':>9} " + " ".join(f"{n[:14]:>14}" for n in names) + "   (RSS MB)")
    for p in result["checkpoints"]:
        print(f"{p['at_s']:>7.0f} {p['kv_free']:>4}/{p['kv_total']:<4} "
              + " ".join(f"{p['rss_mb'].get(n, 0):>14.0f}" for n in names))
    print("RSS growth (MB) since the first loaded checkpoint:",
          ", ".join(f"{n} {g:+.0f}" for n, g in result["rss_growth_mb"].items()))
    for line in result["first_failures"]:
        print("  ", line)
    print("PASSED" if result["passed"] else "FAILED: " + "; ".join(result["failures"]))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=600.0, help="seconds of traffic (default 600)")
    ap.add_argument("--clients", type=int, default=8, help="concurrent client threads")
    ap.add_argument("--checkpoint", type=float, default=60.0, help="seconds between idle checkpoints")
    ap.add_argument("--cancel-rate", type=float, default=0.2, help="share of streams cancelled mid-way")
    ap.add_argument("--request-timeout", type=float, default=120.0, help="seconds without an answer = lost")
    ap.add_argument("--max-rss-growth-mb", type=float, default=150.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=ROOT / "out" / "soak.json")
    args = ap.parse_args(argv)
    for name in ("duration", "checkpoint", "request_timeout"):
        if getattr(args, name) <= 0:
            ap.error(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")
    if args.clients < 1 or not 0 <= args.cancel_rate <= 1:
        ap.error("--clients must be >= 1 and --cancel-rate within [0, 1]")
    result = run(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print_table(result)
    print(f"wrote {args.out}")
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
