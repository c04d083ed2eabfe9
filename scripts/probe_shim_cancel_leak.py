"""Native memory and hangs per cancelled Triton stream, isolated from the rest of the shim.

A child process serves a minimal GRPCInferenceService over grpc.aio (ModelConfig, ModelStreamInfer that streams
text responses until the client cancels or the last one, ServerMetadata that reports its stream counters); this
process drives tritonclient's grpc.aio client against it and ends each stream one way (`--mode`), sampling glibc's
in-use bytes (mallinfo2: uordblks + hblkhd) and RSS after gc every `--every` streams. Every stream's end is awaited
with a bound: a stream that does not end in time, or a server stream still open at the end, is a hang.

Modes (k = 1-3 responses read first):
  raw-task-cancel     the task awaiting call.__anext__() is cancelled, then call.cancel() (the shim's old disconnect)
  raw-outside-cancel  call.cancel() while the read is pending; the reading task ends by itself
  raw-break           call.cancel() with no read pending
  shield              each read in its own task behind asyncio.shield; the caller is cancelled, then call.cancel()
  reader-queue        one reader task per stream feeding a queue; the consumer is cancelled, then call.cancel()
  backend-cancel      TritonBackend.generate consumed by a task that is cancelled mid-read (the shim's disconnect)
  backend-break       TritonBackend.generate left by break (aclose)
  backend-finish      TritonBackend.generate read to its final response (the stream is closed, not cancelled)

  .venv/bin/python scripts/probe_shim_cancel_leak.py --mode backend-cancel --streams 5000

--full-path instead starts tritonserver with the launcher (the tiny model, the soak's small settings; --simulated:
the soak's simulated target) and its
`ernie-openai` shim, and drops `--streams` HTTP streams after their first event, `--concurrency` at a time: the
shim's RSS every `--every`, each drop bounded, and the engines must be idle again after every batch. The shim ends a
dropped stream as ernie-serve starts it (`--engine-control auto`: an abort in the engines, no gRPC cancellation);
`--engine-control off` gives the gRPC cancellation, which tritonserver 2.51 can deadlock on (docs/reliability.md).
Triton's failure counters by reason (CANCELED: gRPC cancellations it saw) are in the result.

  .venv/bin/python scripts/probe_shim_cancel_leak.py --full-path --streams 3000 --concurrency 8
"""
from __future__ import annotations

import argparse
import asyncio
import ctypes
import gc
import json
import os
import random
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "client"))

MODES = ("raw-task-cancel", "raw-outside-cancel", "raw-break", "shield", "reader-queue", "backend-cancel",
         "backend-break", "backend-finish")


# ---------------------------------------------------------------- server (child process)

def serve(port: int, responses: int, interval: float, size: int) -> None:
    """Stream `responses` responses of about `size` bytes every `interval` s per request."""
    import grpc
    from tritonclient.grpc import model_config_pb2, service_pb2, service_pb2_grpc

    stats = {"started": 0, "active": 0, "cancelled": 0, "finished": 0}

    def response(i: int, last: bool) -> service_pb2.ModelStreamInferResponse:
        r = service_pb2.ModelStreamInferResponse()
        ir = r.infer_response
        ir.model_name = "ensemble"
        ir.id = "x"
        for name, data in (("text_output", ("w%d " % i) * (size // 4)), ("finish_reason", "length" if last else "")):
            out = ir.outputs.add()
            out.name = name
            out.datatype = "BYTES"
            out.shape.append(1)
            raw = data.encode()
            ir.raw_output_contents.append(len(raw).to_bytes(4, "little") + raw)
        return r

    class Servicer(service_pb2_grpc.GRPCInferenceServiceServicer):
        async def ModelConfig(self, request, context):
            cfg = model_config_pb2.ModelConfig(name="ensemble", max_batch_size=0)
            cfg.input.add(name="text_input", data_type=model_config_pb2.TYPE_STRING, dims=[1])
            cfg.input.add(name="max_tokens", data_type=model_config_pb2.TYPE_INT32, dims=[1])
            for n in ("text_output", "finish_reason"):
                cfg.output.add(name=n, data_type=model_config_pb2.TYPE_STRING, dims=[1])
            return service_pb2.ModelConfigResponse(config=cfg)

        async def ServerMetadata(self, request, context):
            return service_pb2.ServerMetadataResponse(name=json.dumps(stats), version="probe")

        async def ModelStreamInfer(self, request_iterator, context):
            stats["started"] += 1
            stats["active"] += 1
            ended = False
            try:
                await request_iterator.__anext__()
                for i in range(responses):
                    await asyncio.sleep(interval)
                    await context.write(response(i, i == responses - 1))
                async for _ in request_iterator:  # Triton ends the stream once the client half-closes
                    pass
                ended = True
                stats["finished"] += 1
            finally:
                stats["active"] -= 1
                if not ended:
                    stats["cancelled"] += 1

    async def main() -> None:
        server = grpc.aio.server()
        service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(Servicer(), server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        print("ready", flush=True)
        await server.wait_for_termination()

    asyncio.run(main())


# ---------------------------------------------------------------- measurements

class _Mallinfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                "fsmblks", "uordblks", "fordblks", "keepcost")]


_libc = ctypes.CDLL("libc.so.6")
_libc.mallinfo2.restype = _Mallinfo2


def sample(streams: int) -> dict:
    gc.collect()
    mi = _libc.mallinfo2()
    with open("/proc/self/statm") as f:
        rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return {"streams": streams, "malloc_in_use_mb": round((mi.uordblks + mi.hblkhd) / 2**20, 2),
            "rss_mb": round(rss / 2**20, 1)}


# ---------------------------------------------------------------- client

class Driver:
    def __init__(self, url: str, mode: str, end_timeout: float):
        import tritonclient.grpc.aio as grpcclient

        from ernie_client.openai.triton import TritonBackend

        self.client = grpcclient.InferenceServerClient(url)
        self.backend = TritonBackend(url, "ensemble", client_factory=lambda _url: self.client)
        self.mode = mode
        self.end_timeout = end_timeout
        self.hung = 0
        self.errors: dict[str, int] = {}

    def _request_stream(self, done: asyncio.Event):
        from tritonclient.grpc import InferInput
        import numpy as np

        inp = InferInput("text_input", [1], "BYTES")
        inp.set_data_from_numpy(np.array([b"hi"], dtype=np.object_))

        async def requests():
            yield {"model_name": "ensemble", "inputs": [inp], "request_id": "r"}
            await done.wait()
        return requests()

    async def one(self, rng: random.Random) -> None:
        k = rng.randint(1, 3)
        cut = asyncio.Event()
        if self.mode.startswith("backend"):
            await self._backend(k, cut)
            return
        done = asyncio.Event()
        call = self.client.stream_infer(self._request_stream(done))
        try:
            if self.mode == "raw-break":
                for _ in range(k):
                    await call.__anext__()
                return
            if self.mode in ("raw-task-cancel", "raw-outside-cancel"):
                async def consume():
                    for _ in range(k):
                        await call.__anext__()
                    cut.set()
                    await call.__anext__()
                    await call.__anext__()
                task = asyncio.ensure_future(consume())
                await cut.wait()
                await asyncio.sleep(0)  # the next read is pending now
                if self.mode == "raw-task-cancel":
                    task.cancel()
                else:
                    call.cancel()
                await self._bounded(task)
            elif self.mode == "shield":
                async def consume():
                    for i in range(k + 2):
                        if i == k:
                            cut.set()
                        await asyncio.shield(asyncio.ensure_future(call.__anext__()))
                task = asyncio.ensure_future(consume())
                await cut.wait()
                await asyncio.sleep(0)
                task.cancel()
                await self._bounded(task)
            elif self.mode == "reader-queue":
                queue: asyncio.Queue = asyncio.Queue()

                async def reader():
                    try:
                        while True:
                            queue.put_nowait(await call.__anext__())
                    except BaseException as e:  # noqa: BLE001 - the end of the stream, however it comes
                        queue.put_nowait(e)

                rtask = asyncio.ensure_future(reader())

                async def consume():
                    for i in range(k + 2):
                        if i == k:
                            cut.set()
                        item = await queue.get()
                        if isinstance(item, BaseException):
                            return
                task = asyncio.ensure_future(consume())
                await cut.wait()
                await asyncio.sleep(0)
                task.cancel()
                await self._bounded(task)
                call.cancel()
                await self._bounded(rtask)
        finally:
            done.set()
            call.cancel()

    async def _backend(self, k: int, cut: asyncio.Event) -> None:
        async def consume():
            n = 0
            async for _step in self.backend.generate({"text_input": "hi"}, "r"):
                n += 1
                if n == k:
                    if self.mode == "backend-break":
                        break
                    if self.mode == "backend-cancel":
                        cut.set()
        task = asyncio.ensure_future(consume())
        if self.mode == "backend-cancel":
            await asyncio.wait([task, asyncio.ensure_future(cut.wait())], return_when=asyncio.FIRST_COMPLETED)
            if not task.done():
                await asyncio.sleep(0)  # the next read is pending now
                task.cancel()
        await self._bounded(task)

    async def _bounded(self, task: asyncio.Future) -> None:
        try:
            await asyncio.wait_for(asyncio.shield(task), self.end_timeout)
        except asyncio.TimeoutError:
            self.hung += 1
            task.cancel()
        except asyncio.CancelledError:
            if not task.cancelled():
                raise
        except StopAsyncIteration:
            pass
        except Exception as e:  # noqa: BLE001 - an error is an end too; counted by kind
            self.errors[type(e).__name__] = self.errors.get(type(e).__name__, 0) + 1

    async def server_stats(self) -> dict:
        md = await self.client.get_server_metadata(as_json=True)
        return json.loads(md["name"])


def _slope(samples: list[dict], key: str) -> float:
    """Least-squares growth of `key` per stream (the samples swing with what gc and gRPC's caches hold)."""
    xs = [s["streams"] for s in samples]
    ys = [s[key] for s in samples]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0


async def drive(args, url: str) -> dict:
    driver = Driver(url, args.mode, args.end_timeout)
    rng = random.Random(1)
    samples = [sample(0)]
    sem = asyncio.Semaphore(args.concurrency)
    started = time.monotonic()
    cpu_started = time.process_time()
    done = 0

    async def run_one():
        nonlocal done
        async with sem:
            await driver.one(rng)
            done += 1

    for start in range(0, args.streams, args.every):
        n = min(args.every, args.streams - start)
        await asyncio.wait_for(asyncio.gather(*(run_one() for _ in range(n))), args.batch_timeout)
        await asyncio.sleep(0.5)  # let closing streams finish
        samples.append(sample(done))
        print(json.dumps(samples[-1]), flush=True)
    # every server stream must end: cancelled ones at once, finished ones once the request side closed
    deadline = time.monotonic() + 10
    stats = await driver.server_stats()
    while stats["active"] and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
        stats = await driver.server_stats()
    elapsed = time.monotonic() - started
    cpu = time.process_time() - cpu_started
    base = samples[1] if len(samples) > 2 else samples[0]
    per_stream = _slope(samples[1:] if len(samples) > 2 else samples, "malloc_in_use_mb") * 1024
    await driver.backend.close()
    import grpc
    return {"mode": args.mode, "grpcio": grpc.__version__, "streams": done, "seconds": round(elapsed, 1),
            "client_cpu_s": round(cpu, 2),
            "hung_streams": driver.hung, "errors": driver.errors, "server": stats,
            "malloc_kb_per_stream": round(per_stream, 3),
            "malloc_mb_delta": round(samples[-1]["malloc_in_use_mb"] - base["malloc_in_use_mb"], 2),
            "rss_mb_delta": round(samples[-1]["rss_mb"] - base["rss_mb"], 1), "samples": samples}


def full_path(args) -> dict:
    """Disconnects through the real stack: tritonserver, the ensemble, the engine, the shim as a process."""
    import concurrent.futures

    import httpx

    root = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(root / "backend"))
    from ernie_serve.serving.health import ernie_samples, requests_in_engines
    from ernie_serve.serving.launcher import TritonServer

    sys.path.insert(0, str(root / "scripts"))
    import soak

    settings = soak.server_settings(soak.parse_args(
        ["--clients", str(args.concurrency)] + (["--simulated-gpu", "h200", "--simulated-model", "ernie-4.5-21b-a3b",
                                                  "--quantization", "wint8"] if args.simulated else [])))
    server = TritonServer(settings, http_port=0, grpc_port=0, metrics_port=0, openai_port=0,
                          openai_args=("--engine-control", args.engine_control))
    server.start(timeout=300)
    try:
        url = f"http://127.0.0.1:{server.openai_port}"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        model = httpx.get(url + "/v1/models", timeout=5).json()["data"][0]["id"]
        body = json.dumps({"model": model, "prompt": "hello there", "max_tokens": 400, "stream": True,
                           "ignore_eos": True}).encode()
        head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                + f"Content-Length: {len(body)}\r\n\r\n".encode())
        pid = server.openai_proc.pid

        def rss_mb() -> float:
            with open(f"/proc/{pid}/status") as f:
                return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024

        wedged = threading.Event()  # once a stream hangs, the rest of the run is skipped

        def drop() -> str:
            if wedged.is_set():
                return "skipped"
            try:
                with socket.create_connection(("127.0.0.1", server.openai_port), timeout=args.end_timeout) as s:
                    s.sendall(head + body)
                    got = b""
                    while b"data:" not in got:
                        chunk = s.recv(200)
                        if not chunk:
                            return "closed"
                        got += chunk
                return "ok"
            except socket.timeout:
                wedged.set()
                return "hung"

        outcomes: dict[str, int] = {}
        samples = [{"streams": 0, "rss_mb": round(rss_mb(), 1)}]
        stuck = 0
        started = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(args.concurrency) as pool:
            for start in range(0, args.streams, args.every):
                n = min(args.every, args.streams - start)
                for outcome in pool.map(lambda _: drop(), range(n)):
                    outcomes[outcome] = outcomes.get(outcome, 0) + 1
                idle_by = time.monotonic() + 10
                while requests_in_engines(ernie_samples(server.metrics_url)) and time.monotonic() < idle_by:
                    time.sleep(0.1)
                stuck = requests_in_engines(ernie_samples(server.metrics_url))
                samples.append({"streams": start + n, "rss_mb": round(rss_mb(), 1), "engine_requests_left": stuck})
                print(json.dumps(samples[-1]), flush=True)
                if wedged.is_set():
                    if args.hold:  # time to look at it: gdb -p <pid> -batch -ex "thread apply all bt"
                        print(f"hung: tritonserver pid {server.proc.pid}, shim pid {pid}; holding {args.hold:g}s",
                              flush=True)
                        time.sleep(args.hold)
                    break
        metrics = httpx.get(url + "/metrics", timeout=5).text
        triton_pending = {line.split('model="')[1].split('"')[0]: float(line.split()[-1])
                          for line in httpx.get(server.metrics_url, timeout=5).text.splitlines()
                          if line.startswith("nv_inference_pending_request_count")}
        in_flight = next((float(line.split()[-1]) for line in metrics.splitlines()
                          if line.startswith("ernie_openai:requests_in_flight")), None)
        failures: dict[str, float] = {}  # "model/reason" -> requests Triton counted failed
        for line in httpx.get(server.metrics_url, timeout=5).text.splitlines():
            if line.startswith("nv_inference_request_failure{"):
                labels = dict(re.findall(r'(\w+)="([^"]*)"', line))
                if float(line.split()[-1]):
                    failures[f"{labels.get('model')}/{labels.get('reason', '')}"] = float(line.split()[-1])
        base = samples[1] if len(samples) > 2 else samples[0]
        return {"mode": "full-path", "engine_control": args.engine_control, "streams": samples[-1]["streams"],
                "seconds": round(time.monotonic() - started, 1),
                "outcomes": outcomes, "engine_requests_left": stuck, "shim_requests_in_flight": in_flight,
                "triton_pending_requests": triton_pending, "triton_failures": failures,
                "rss_kb_per_stream": round(_slope(samples[1:] if len(samples) > 2 else samples, "rss_mb") * 1024, 3),
                "rss_mb_delta": round(samples[-1]["rss_mb"] - base["rss_mb"], 1), "samples": samples}
    finally:
        server.stop()
        server.cleanup()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=MODES, default="backend-cancel")
    ap.add_argument("--streams", type=int, default=5000)
    ap.add_argument("--every", type=int, default=1000)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--responses", type=int, default=8, help="responses per stream (the last finishes it)")
    ap.add_argument("--interval", type=float, default=0.002, help="seconds between a stream's responses")
    ap.add_argument("--size", type=int, default=1024, help="bytes of text per response")
    ap.add_argument("--end-timeout", type=float, default=5.0, help="a stream not ended this long after its cut hangs")
    ap.add_argument("--batch-timeout", type=float, default=300.0)
    ap.add_argument("--out", help="write the result JSON here")
    ap.add_argument("--full-path", action="store_true", help="tritonserver and the shim, dropped HTTP streams")
    ap.add_argument("--hold", type=float, default=0.0, help="--full-path: seconds to keep a hung server up")
    ap.add_argument("--simulated", action="store_true",
                    help="--full-path on the simulated target (soak.py's --simulated-gpu h200 settings)")
    ap.add_argument("--engine-control", choices=("auto", "off"), default="auto",
                    help="--full-path: how the shim ends a dropped stream (auto: an abort in the engines, as "
                         "ernie-serve starts it; off: a gRPC cancellation)")
    ap.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.full_path:
        result = full_path(args)
        print(json.dumps({k: v for k, v in result.items() if k != "samples"}))
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=1))
        return
    if args.serve:
        serve(args.serve, args.responses, args.interval, args.size)
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, __file__, "--serve", str(port), "--responses", str(args.responses),
                               "--interval", str(args.interval), "--size", str(args.size)], stdout=subprocess.PIPE)
    try:
        if server.stdout.readline().strip() != b"ready":
            raise SystemExit("the probe server did not start")
        result = asyncio.run(drive(args, f"127.0.0.1:{port}"))
    finally:
        server.terminate()
        server.wait(10)
    print(json.dumps({k: v for k, v in result.items() if k != "samples"}))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
