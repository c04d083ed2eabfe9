"""The serving path at a GPU's pace: the offline engine against the served paths (Triton's gRPC stream, its HTTP
generate_stream, the OpenAI shim) on the simulated device (execution_backend='simulated'; docs/serving-path.md), side
by side, at the modeled step time (time scale 1) and at the smallest time scale the host keeps pace with.

    .venv/bin/python scripts/bench_serving_path.py                                # 21B-A3B on h200, wint8 and bf16,
                                                                                  # 64 and 256 streams
    .venv/bin/python scripts/bench_serving_path.py --streams 8 --max-tokens 32 --scales 1,4 --quantizations wint8

One workload (scripts/served_throughput.py's: `streams` greedy requests at once, ignore_eos, `max-tokens` tokens
each). For each quantization and time scale: one offline engine (LLM) and one server (tritonserver + the ensemble's
stubs + the shim), each run once per stream count and path. A time scale s is carried when every path's step stretch
(the host's gap between busy steps over their modeled time: GPU idle time the host causes) is at most
--carry-stretch; the scales are tried in order after 1 until one is carried for every stream count.

Per run: tok/s and its ratio to offline; tokens per response (the client's count of responses carrying tokens);
inter-response gaps per stream, p50 / p99 (ITL: one token a response unless a stream coalesces); step stretch and
the sleeps' overshoot from the simulated device's counters (Triton's metrics port, or the offline engine's stats);
per process, from /proc (utime + stime): CPU ms a token and a response, its busiest thread's share of a core, and
the cores it needs at the modeled token rate (CPU s a token x the offline run's tokens over its modeled
seconds). The client (this process) is reported apart, never inside "serving". Offline is one process: engine and
caller together.

Writes benchmarks/results/serving_path-<time>.json (commit, CPU, command, load average, the simulation's constants,
every figure) and prints one table.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from served_throughput import (  # noqa: E402
    _TICK, Run, cpu_seconds, make_server, offline, served, served_settings, serving_processes, wait_for_shim)

PATHS = ("offline", "grpc", "http", "shim")
THREADS_LISTED = 8  # a process's busiest threads the JSON lists
STRETCH_KEYS = ("simulated_modeled_seconds", "simulated_busy_gap_seconds", "simulated_busy_modeled_seconds",
                "simulated_overshoot_seconds", "simulated_steps")
# the engine's stats key -> its counter on Triton's metrics port (serving/metrics.py SIMULATION_METRICS)
METRIC_NAMES = {"simulated_modeled_seconds": "ernie:simulated_modeled_seconds_total",
                "simulated_busy_gap_seconds": "ernie:simulated_busy_gap_seconds_total",
                "simulated_busy_modeled_seconds": "ernie:simulated_busy_modeled_seconds_total",
                "simulated_overshoot_seconds": "ernie:simulated_overshoot_seconds_total",
                "simulated_steps": "ernie:simulated_steps_total"}


# ---------------------------------------------------------------- what /proc says

def thread_cpu(pid: int) -> dict[int, tuple[str, float]]:
    """tid -> (thread name, utime + stime seconds) of every thread of a process (empty once it is gone)."""
    out = {}
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
            name = (task / "comm").read_text().strip()
        except OSError:
            continue
        out[int(task.name)] = (name, (int(fields[11]) + int(fields[12])) / _TICK)
    return out


@dataclass
class ThreadWindow:
    """Every thread's CPU of some processes over one run (taken around it)."""
    pids: dict[str, int]
    before: dict[str, dict[int, tuple[str, float]]] = field(default_factory=dict)
    after: dict[str, dict[int, tuple[str, float]]] = field(default_factory=dict)

    def __enter__(self) -> "ThreadWindow":
        self.before = {name: thread_cpu(pid) for name, pid in self.pids.items()}
        return self

    def __exit__(self, *exc) -> None:
        self.after = {name: thread_cpu(pid) for name, pid in self.pids.items()}

    def spent(self, name: str) -> list[tuple[str, int, float]]:
        """A process's threads over the window: (name, tid, CPU seconds), busiest first."""
        return sorted(((thread, tid, cpu - self.before[name].get(tid, (thread, 0.0))[1])
                       for tid, (thread, cpu) in self.after[name].items()), key=lambda t: -t[2])

    def busiest(self, name: str) -> tuple[str, float]:
        """A process's busiest thread over the window: (its name, CPU seconds)."""
        thread, _, cpu = next(iter(self.spent(name)), ("-", 0, 0.0))
        return thread, cpu


class Arrivals:
    """When each stream's responses arrived (served_throughput.served's mark)."""

    def __init__(self, streams: int):
        self.times: list[list[float]] = [[] for _ in range(streams)]

    def mark(self, i: int) -> None:
        self.times[i].append(time.perf_counter())

    @property
    def responses(self) -> int:
        return sum(len(t) for t in self.times)

    def gaps_ms(self) -> np.ndarray:
        return np.concatenate([np.diff(t) for t in self.times if len(t) > 1] or [np.zeros(0)]) * 1e3


def served_counters(metrics_url: str) -> dict[str, float]:
    """The simulated device's counters from Triton's metrics port, summed over engine instances."""
    from ernie_serve.serving.health import ernie_samples

    samples = ernie_samples(metrics_url)
    return {key: sum(v for n, _, v in samples if n == name) for key, name in METRIC_NAMES.items()}


def counter_delta(before: dict, after: dict) -> dict[str, float]:
    return {k: float(after.get(k, 0.0)) - float(before.get(k, 0.0)) for k in STRETCH_KEYS}


# ---------------------------------------------------------------- one run's figures

@dataclass
class PathResult:
    quantization: str
    streams: int
    time_scale: float
    path: str
    tokens: int
    seconds: float
    responses: int | None
    itl_ms: dict[str, float] | None
    device: dict[str, float]  # counter deltas over the run
    processes: dict[str, dict]  # name -> CPU figures
    client: dict[str, float] | None
    tok_per_s: float = 0.0
    vs_offline: float | None = None
    step_stretch: float = 0.0
    modeled_tok_per_s: float = 0.0  # this run's tokens / its modeled (unscaled) seconds
    # the rate the cores are figured at: the offline run's modeled rate at this stream count (full batches, what
    # the target delivers), else this run's own
    target_tok_per_s: float = 0.0
    serving_cores_at_modeled_rate: float = 0.0
    load_average: list[float] = field(default_factory=lambda: list(os.getloadavg()))
    coalesce_ms: float = 0.0  # the server's --stream-coalesce-ms (served runs)
    engine_core_process: bool = True  # the server's --engine-core-process (served runs)
    async_scheduling: bool = True  # the engine's --async-scheduling (the simulated device's default: on)

    def finish(self, target_tok_per_s: float | None = None) -> "PathResult":
        d = self.device
        self.tok_per_s = self.tokens / self.seconds
        self.step_stretch = d["simulated_busy_gap_seconds"] / d["simulated_busy_modeled_seconds"] \
            if d["simulated_busy_modeled_seconds"] else 0.0
        self.modeled_tok_per_s = self.tokens / d["simulated_modeled_seconds"] if d["simulated_modeled_seconds"] else 0.0
        rate = self.target_tok_per_s = target_tok_per_s or self.modeled_tok_per_s
        for p in self.processes.values():
            p["cores_at_modeled_rate"] = p["cpu_ms_per_token"] * 1e-3 * rate
            p["busiest_thread_cores_at_modeled_rate"] = p["busiest_thread_ms_per_token"] * 1e-3 * rate
        self.serving_cores_at_modeled_rate = sum(p["cores_at_modeled_rate"] for p in self.processes.values())
        return self


def process_figures(window: ThreadWindow, name: str, cpu_s: float, tokens: int, responses: int | None,
                    seconds: float) -> dict:
    thread, thread_s = window.busiest(name)
    # the busiest threads by name/tid (a Python stub's threads all carry the interpreter's name)
    threads = {f"{t}/{tid}": 1e3 * cpu / tokens for t, tid, cpu in window.spent(name)[:THREADS_LISTED] if cpu > 0}
    return {"cpu_ms_per_token": 1e3 * cpu_s / tokens,
            "cpu_ms_per_response": 1e3 * cpu_s / responses if responses else None,
            "busiest_thread": thread, "busiest_thread_utilisation": thread_s / seconds,
            "busiest_thread_ms_per_token": 1e3 * thread_s / tokens, "threads_ms_per_token": threads}


def itl_figures(arrivals: Arrivals) -> dict[str, float]:
    gaps = arrivals.gaps_ms()
    if not gaps.size:
        return {"p50": 0.0, "p99": 0.0}
    return {"p50": float(np.percentile(gaps, 50)), "p99": float(np.percentile(gaps, 99))}


def run_offline(llm, q: str, streams: int, scale: float, max_tokens: int) -> PathResult:
    before = llm.engine.stats()
    with ThreadWindow({"offline": os.getpid()}) as window:
        cpu0 = cpu_seconds(os.getpid())
        run: Run = offline(llm, streams, max_tokens)
        cpu = cpu_seconds(os.getpid()) - cpu0
    procs = {"offline (engine + caller)": process_figures(window, "offline", cpu, run.tokens, None, run.seconds)}
    return PathResult(q, streams, scale, "offline", run.tokens, run.seconds, None, None,
                      counter_delta(before, llm.engine.stats()), procs, None).finish()


def run_served(server, path: str, q: str, streams: int, scale: float, max_tokens: int) -> PathResult:
    pids = serving_processes(server)
    arrivals = Arrivals(streams)
    before = served_counters(server.metrics_url)
    with ThreadWindow(pids | {"client": os.getpid()}) as window:
        run: Run = served(server, path, streams, max_tokens, arrivals.mark)
    time.sleep(0.2)  # the engine flushes its metrics once idle
    device = counter_delta(before, served_counters(server.metrics_url))
    ms = run.cpu_ms_per_token  # process name -> CPU ms a token over the run (served_throughput)
    responses = arrivals.responses
    procs = {name: process_figures(window, name, ms[name] * run.tokens / 1e3, run.tokens, responses, run.seconds)
             for name in pids}
    client_cpu = ms["client (this process)"] * run.tokens / 1e3
    client = process_figures(window, "client", client_cpu, run.tokens, responses, run.seconds)
    return PathResult(q, streams, scale, path, run.tokens, run.seconds, responses, itl_figures(arrivals), device,
                      procs, client).finish()


# ---------------------------------------------------------------- one target, one scale

def engine_flags(q: str, scale: float, gpu: str, model: str, parsers: bool) -> dict:
    flags = {"execution_backend": "simulated", "simulated_gpu": gpu, "simulated_model": model,
             "simulated_time_scale": scale}
    if q != "bf16":
        flags["quantization"] = q
    if parsers:
        flags.update(reasoning_parser="ernie-x1", tool_call_parser="ernie-x1")
    return flags


def measure_scale(args: argparse.Namespace, q: str, scale: float) -> list[PathResult]:
    """Every stream count through every path of one engine configuration (an offline engine, then a server)."""
    flags = served_settings(max(args.streams), **engine_flags(q, scale, args.gpu, args.model, args.parsers))
    results = []
    for asynchronous in args.async_scheduling:
        if "offline" not in args.paths:
            break
        from ernie_serve import LLM

        llm = LLM(**flags, async_scheduling=asynchronous, disable_progress_bar=True)
        offline(llm, 2, 4)  # warm-up
        for n in args.streams:
            r = run_offline(llm, q, n, scale, args.max_tokens)
            r.async_scheduling = asynchronous
            results.append(report(r))
        llm.engine.close()
        del llm
    served_paths = [p for p in args.paths if p != "offline"]
    variants = [(c, core, a) for a in args.async_scheduling for core in args.engine_core_process
                for c in args.coalesce_ms] if served_paths else []
    for coalesce, core, asynchronous in variants:
        with make_server({**flags, "stream_coalesce_ms": coalesce, "engine_core_process": core,
                          "async_scheduling": asynchronous}) as server:
            wait_for_shim(server)
            for path in served_paths:  # warm-up: each path's first connection and imports
                served(server, path, 2, 4)
            for n in args.streams:
                for path in served_paths:
                    r = run_served(server, path, q, n, scale, args.max_tokens)
                    r.coalesce_ms, r.engine_core_process, r.async_scheduling = coalesce, core, asynchronous
                    results.append(report(r))
    # each served run against the offline engine with the same scheduling
    offline_runs = {(r.streams, r.async_scheduling): r for r in results if r.path == "offline"}
    for r in results:
        base = offline_runs.get((r.streams, r.async_scheduling))
        if base is not None:
            r.vs_offline = r.tok_per_s / base.tok_per_s
            r.finish(base.modeled_tok_per_s)
    return results


def carried(results: list[PathResult], streams: int, limit: float) -> bool:
    runs = [r for r in results if r.streams == streams]
    return bool(runs) and all(r.step_stretch <= limit for r in runs)


def report(r: PathResult) -> PathResult:
    print(f"  {r.quantization} {r.streams} streams x{r.time_scale:g} {r.path} (coalesce {r.coalesce_ms:g} ms, "
          f"engine core {'in its own process' if r.engine_core_process else 'in the stub'}, "
          f"{'async' if r.async_scheduling else 'sync'} scheduling): "
          f"{r.tok_per_s:.0f} tok/s, stretch "
          f"{100 * r.step_stretch:.1f}%", flush=True)
    return r


# ---------------------------------------------------------------- table and file

def table(results: list[PathResult], scales: dict[str, float | None]) -> str:
    head = (f"{'quant':6} {'strm':>4} {'s':>3} {'path':7} {'coal':>4} {'core':>4} {'sch':>5} {'tok/s':>7} {'x off':>6} {'tok/resp':>8} {'ITL p50':>8} "
            f"{'p99':>7} {'stretch':>8} {'busiest process ms/tok':>26} {'serving ms/tok':>14} "
            f"{'busiest thread':>24} {'cores@rate':>10} {'client ms/tok':>13}")
    lines = [head, "-" * len(head)] + [_row(r) for r in results]
    tried = max(r.time_scale for r in results) if results else 1
    lines.append("smallest time scale carried (every path's stretch within the limit): " + ", ".join(
        f"{k}: {f'none up to {tried:g}' if v is None else format(v, 'g')}" for k, v in scales.items()))
    return "\n".join(lines)


def _row(r: PathResult) -> str:
    procs = r.processes
    name, top = max(procs.items(), key=lambda kv: kv[1]["cpu_ms_per_token"])
    owner, busy = max(procs.items(), key=lambda kv: kv[1]["busiest_thread_utilisation"])
    thread = f"{(owner[:10] + '/' + busy['busiest_thread'][:8])[:17]} {busy['busiest_thread_utilisation']:.0%}"
    itl = r.itl_ms or {}
    coal = "-" if r.path == "offline" else format(r.coalesce_ms, "g")
    core = "-" if r.path == "offline" else ("proc" if r.engine_core_process else "stub")
    sched = "async" if r.async_scheduling else "sync"
    return (f"{r.quantization:6} {r.streams:>4} {r.time_scale:>3g} {r.path:7} {coal:>4} {core:>4} {sched:>5} {r.tok_per_s:>7.0f} "
            f"{_num(r.vs_offline, '.2f'):>6} {_num(r.tokens / r.responses if r.responses else None, '.2f'):>8} "
            f"{_num(itl.get('p50'), '.1f'):>8} {_num(itl.get('p99'), '.1f'):>7} {100 * r.step_stretch:>7.1f}% "
            f"{name[:17] + ' ' + format(top['cpu_ms_per_token'], '.3f'):>26} "
            f"{sum(p['cpu_ms_per_token'] for p in procs.values()):>14.3f} {thread:>24} "
            f"{r.serving_cores_at_modeled_rate:>10.2f} {_num(r.client and r.client['cpu_ms_per_token'], '.3f'):>13}")


def _num(v, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def environment(args: argparse.Namespace) -> dict:
    from ernie_serve.simulated_backend.targets import GPUS, MODELS, SimulationConstants

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    commit = subprocess.run(["git", "-C", str(ROOT), "describe", "--always", "--dirty"], capture_output=True,
                            text=True).stdout.strip()
    return {"commit": commit, "cpu_model": cpu, "cpus": os.cpu_count(), "load_average_at_start": os.getloadavg(),
            "command": " ".join([Path(sys.executable).name, *sys.argv]), "label": args.label,
            "gpu": asdict(GPUS[args.gpu]), "model": MODELS[args.model].describe(),
            "constants": asdict(SimulationConstants()), "max_tokens": args.max_tokens,
            "carry_stretch": args.carry_stretch}


def _bool(text: str) -> bool:
    if text.lower() in ("1", "true", "on", "yes"):
        return True
    if text.lower() in ("0", "false", "off", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    csv = lambda kind: lambda s: [kind(x) for x in s.split(",") if x]  # noqa: E731
    p.add_argument("--gpu", default="h200")
    p.add_argument("--model", default="ernie-4.5-21b-a3b")
    p.add_argument("--quantizations", type=csv(str), default=["wint8", "bf16"], help="wint8, bf16, wint4, ...")
    p.add_argument("--streams", type=csv(int), default=[64, 256])
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--scales", type=csv(float), default=[1, 2, 4, 8, 16],
                   help="time scales: 1 always, then the others in order until one is carried")
    p.add_argument("--carry-stretch", type=float, default=0.05, help="the step stretch a carried scale stays within")
    p.add_argument("--paths", type=csv(str), default=list(PATHS))
    p.add_argument("--coalesce-ms", type=csv(float), default=[0.0],
                   help="the servers' --stream-coalesce-ms values, one server each (e.g. 0,20: side by side)")
    p.add_argument("--engine-core-process", type=csv(_bool), default=[True],
                   help="the servers' --engine-core-process values, one server each (e.g. true,false: the engine "
                        "core in its own process and in the stub, side by side)")
    p.add_argument("--async-scheduling", type=csv(_bool), default=[True],
                   help="the engines' --async-scheduling values, offline and served, one engine / server each "
                        "(e.g. true,false: the next step planned ahead of the running one's tokens, and every step "
                        "after the last one's update, side by side); served runs compare with the offline run of "
                        "the same value")
    p.add_argument("--no-parsers", dest="parsers", action="store_false",
                   help="leave out the reasoning and tool-call parsers (on by default: ernie-x1)")
    p.add_argument("--label", default="", help="a note for the JSON, e.g. 'taken under load'")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    unknown = sorted(set(args.paths) - set(PATHS))
    if unknown:
        p.error(f"--paths: unknown {', '.join(unknown)}; known: {', '.join(PATHS)}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    env = environment(args)
    results: list[PathResult] = []
    scales: dict[str, float | None] = {}
    for q in args.quantizations:
        pending = set(args.streams)
        for scale in [1.0] + [s for s in args.scales if s > 1]:
            print(f"[bench_serving_path] {q}, time scale {scale:g}", flush=True)
            runs = measure_scale(args, q, scale)
            results += runs
            for n in sorted(pending):
                # a scale is carried for the first --async-scheduling value (the others are shown beside it)
                if carried([r for r in runs if r.async_scheduling == args.async_scheduling[0]], n, args.carry_stretch):
                    scales[f"{q}/{n}"] = scale
                    pending.discard(n)
            if not pending:
                break
        scales.update({f"{q}/{n}": None for n in pending})
    out = args.out or ROOT / "benchmarks" / "results" / f"serving_path-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({**env, "carried_scale": scales, "runs": [asdict(r) for r in results]}, indent=1) + "\n")
    print(table(results, scales))
    print(f"wrote {out.relative_to(ROOT) if out.is_relative_to(ROOT) else out}")


if __name__ == "__main__":
    main()
