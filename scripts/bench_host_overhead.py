#!/usr/bin/env python3
"""Host time per engine step outside the model forward: what the scheduler, the runner's batch building, the
sampler and output processing cost a step, at 64 and 256 running requests, decode-heavy (every request
decoding) and prefill-heavy (requests arriving while others decode, prompts chunked), on the embedded tiny
model and the benchmark checkpoint. Each step's wall time is split into the executor's `execute` (the forward)
and the rest, with the rest broken down by phase. Prints a table, writes out/bench_host_overhead.json.

    .venv/bin/python scripts/bench_host_overhead.py [--running 64 256] [--steps 100] [--models tiny bench]

Then the serving half (scripts/served_throughput.py): the same greedy streams through Triton's gRPC stream, its
HTTP generate_stream and the OpenAI shim of a real tritonserver, against the offline LLM, with the CPU each
serving process spends a token (--served-streams 0 skips it).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "backend"))
sys.path.insert(0, str(ROOT / "scripts"))
from bench_decode_step import CallTimer  # noqa: E402  (seconds spent in wrapped calls, by name)

PHASES = (("scheduler", "schedule", "schedule"), ("scheduler", "update_from_output", "update_from_output"),
          ("runner", "sampler", "sampler"), ("output", "process", "outputs"))  # (owner, method, label)


def measure(model: str | None, running: int, workload: str, steps: int, asynchronous: bool, seed: int = 0) -> dict:
    from ernie_serve import LLM, RequestOutputKind, SamplingParams

    llm = LLM(model=model, max_num_seqs=running, max_num_batched_tokens=max(2048, 2 * running),
              max_model_len=2048, disable_progress_bar=True, async_scheduling=asynchronous)
    engine = llm.engine
    clock = CallTimer()
    clock.wrap(engine.runner.executor, "execute", "forward")
    for owner_name, attr, label in PHASES:
        owner = {"scheduler": engine.scheduler, "runner": engine.runner, "output": engine.output}[owner_name]
        clock.wrap(owner, attr, label)
    rng = np.random.default_rng(seed)
    vocab = min(engine.model_config.vocab_size, 1000)
    # as the serving front asks for a request without stop strings (engine_model.py): each step's delta, token ids
    # only (the detokenizer stage decodes them)
    params = SamplingParams(temperature=0, max_tokens=1024, ignore_eos=True, output_kind=RequestOutputKind.DELTA,
                            detokenize=False)
    added = 0

    def add(n: int, prompt_len: int) -> None:
        nonlocal added
        for _ in range(n):
            engine.add_request(f"r{added}", rng.integers(10, vocab, prompt_len).tolist(), params)
            added += 1

    add(running, 32)
    while engine.scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens
                                          for r in engine.scheduler.running):
        engine.step()  # every request admitted and decoding
    for _ in range(5):
        engine.step()
    clock.spent.clear()
    t0 = time.perf_counter()
    for i in range(steps):
        if workload == "prefill-heavy" and i % 4 == 0:
            # a request leaves and a 300-token prompt arrives: prefill chunks share steps with the decodes
            engine.abort_request(next(iter(engine.requests)))
            add(1, 300)
        engine.step()
    wall = time.perf_counter() - t0
    per_step = {k: 1e3 * v / steps for k, v in clock.spent.items()}
    host = 1e3 * wall / steps - per_step["forward"]  # with async scheduling: what the forward does not hide
    result = {"model": model or "tiny", "running": running, "workload": workload, "steps": steps,
              "scheduling": "async" if asynchronous else "sync",
              "step_ms": 1e3 * wall / steps, "forward_ms": per_step["forward"], "host_ms": host,
              "phases_ms": {k: v for k, v in per_step.items() if k != "forward"},
              "running_at_end": len(engine.scheduler.running)}
    engine.close()
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--running", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--workloads", nargs="+", default=["decode-heavy", "prefill-heavy"],
                    choices=["decode-heavy", "prefill-heavy"])
    ap.add_argument("--models", nargs="+", default=["tiny", "bench"], choices=["tiny", "bench"])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--scheduling", nargs="+", default=["sync", "async"], choices=["sync", "async"],
                    help="async: --async-scheduling, the next step runs while this one's outputs are made; its "
                         "host ms is the host time the forward does not hide")
    ap.add_argument("--served-streams", type=int, nargs="+", default=[64, 256],
                    help="concurrent streams of the serving half (0: skip it)")
    ap.add_argument("--served-tokens", type=int, default=128, help="tokens each served stream generates")
    ap.add_argument("--paths", nargs="+", default=["grpc", "http", "shim"], choices=["grpc", "http", "shim"])
    ap.add_argument("--stream-intervals", type=int, nargs="+", default=[1],
                    help="the server's --stream-interval values to run the serving half with")
    ap.add_argument("--out", type=Path, default=ROOT / "out" / "bench_host_overhead.json")
    args = ap.parse_args()

    from tqdm import tqdm

    models = {"tiny": None}
    if "bench" in args.models:
        from bench_offline import bench_checkpoint
        models["bench"] = str(bench_checkpoint())
    cases = [(m, n, w, a) for m in args.models for n in args.running for w in args.workloads for a in args.scheduling]
    results = [measure(models[m], n, w, args.steps, a == "async")
               for m, n, w, a in tqdm(cases, desc="host overhead", unit="case")]
    print(f"\n{'model':6} {'running':>7} {'workload':14} {'sched':5} {'step ms':>8} {'forward':>8} {'host ms':>8} "
          f"{'host %':>7}  schedule / update / sampler / outputs (ms)")
    for r in results:
        p = r["phases_ms"]
        print(f"{r['model'] if r['model'] == 'tiny' else 'bench':6} {r['running']:>7} {r['workload']:14} "
              f"{r['scheduling']:5} "
              f"{r['step_ms']:8.2f} {r['forward_ms']:8.2f} {r['host_ms']:8.2f} "
              f"{100 * r['host_ms'] / r['step_ms']:6.0f}%  "
              f"{p['schedule']:.2f} / {p['update_from_output']:.2f} / {p['sampler']:.2f} / {p['outputs']:.2f}")
    served = [] if args.served_streams == [0] else serving_half(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"results": results, "served": served}, indent=2))
    print(f"\nwrote {args.out}")


def serving_half(args) -> list[dict]:
    """Served vs offline tok/s and CPU ms a token per process, for each stream count and scheduling mode."""
    from dataclasses import asdict

    from ernie_serve import LLM
    from served_throughput import make_server, offline, served, served_settings, wait_for_shim

    rows = []
    for streams in args.served_streams:
        settings = served_settings(streams)
        for mode in args.scheduling:
            asynchronous = mode == "async"
            llm = LLM(model=None, disable_progress_bar=True, async_scheduling=asynchronous, **settings)
            ref = offline(llm, streams, args.served_tokens)
            llm.engine.close()
            del llm
            rows.append(dict(asdict(ref), scheduling=mode, stream_interval=None, vs_offline=1.0))
            for interval in args.stream_intervals:
                server = make_server(dict(settings, async_scheduling=asynchronous, stream_interval=interval))
                with server:
                    wait_for_shim(server)
                    for path in args.paths:
                        run = served(server, path, streams, args.served_tokens)
                        rows.append(dict(asdict(run), scheduling=mode, stream_interval=interval,
                                         vs_offline=run.tok_per_s / ref.tok_per_s))
    print(f"\n{'streams':>7} {'sched':5} {'path':8} {'interval':>8} {'tok/s':>8} {'vs offline':>10}  "
          "CPU ms a token by process")
    for r in rows:
        cpu = r["cpu_ms_per_token"]
        serving = sum(v for k, v in cpu.items() if not k.startswith("client") and r["path"] != "offline")
        detail = ", ".join(f"{k} {v:.3f}" for k, v in cpu.items())
        print(f"{r['streams']:>7} {r['scheduling']:5} {r['path']:8} {r['stream_interval'] or '':>8} "
              f"{r['tokens'] / r['seconds']:8.0f} "
              f"{r['vs_offline']:9.2f}x  {f'serving sum {serving:.3f}: ' if serving else ''}{detail}")
    return rows


if __name__ == "__main__":
    main()
