"""Tensor parallelism and prefill/decode disaggregation on the CPU: what they cost and give here.

    .venv/bin/python scripts/bench_parallel.py                  # both parts
    .venv/bin/python scripts/bench_parallel.py --parts tp       # TP=1 vs TP=2 only

1. `tp`: the benchmark checkpoint (scripts/bench_offline.py's bench_checkpoint: 8 layers, hidden 1024,
   16 experts top-4) offline at tensor_parallel_size 1 and 2 (and 2 with expert parallelism), greedy,
   16 requests x (64 prompt + 64 output): tokens/s, decode step p50 at 16 running, and whether the
   tokens equal TP=1's.
2. `pd`: the same checkpoint served at a fixed load (12 requests of 256 prompt + 32 output tokens, one
   every 4 s): one mixed engine vs a 1P1D pair (the prefill engine in its own process, the decode
   engine here, KV over pyzmq on loopback); TTFT (arrival -> first token) and ITL (gaps between a
   request's tokens), p50 / p90.

The 2-core caveat: every configuration shares the same two cores. TP=2 gives each rank one core where
TP=1 gives its one rank two, so TP can only add collective overhead here (its point is memory and
bandwidth per device); 1P1D likewise gives each role one core, and its point (decode steps not
stalled behind other requests' prefills) competes with halving each side's compute. Each run is a
subprocess; results go to out/bench_parallel.json.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
TP_CONFIGS = {"tp1": dict(tensor_parallel_size=1), "tp2": dict(tensor_parallel_size=2),
              "tp2_ep": dict(tensor_parallel_size=2, enable_expert_parallel=True)}
ENGINE = dict(max_model_len=512, max_num_seqs=16, block_size=64, skip_tokenizer_init=True, disable_progress_bar=True)


def _prompts(n: int, length: int, vocab: int = 32000, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, size=length).tolist() for _ in range(n)]


# ---------------------------------------------------------------- part 1: tensor parallel, offline
def run_tp(model: str, name: str, out: Path) -> None:
    from ernie_serve import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(model=model, **ENGINE, **TP_CONFIGS[name])
    startup = time.perf_counter() - t0
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    llm.generate(prompt_token_ids=_prompts(4, 16, seed=1), sampling_params=SamplingParams(temperature=0, max_tokens=4),
                 use_tqdm=False)  # warm-up
    steps: list[tuple[int, float]] = []
    step = llm.engine.step

    def timed_step():
        t = time.perf_counter()
        outs = step()
        steps.append((len(llm.engine.scheduler.running), time.perf_counter() - t))
        return outs

    llm.engine.step = timed_step
    t0 = time.perf_counter()
    outs = llm.generate(prompt_token_ids=_prompts(16, 64), sampling_params=params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    decode = [dt for n, dt in steps if n == 16]
    tokens = [o.outputs[0].token_ids for o in outs]
    out.write_text(json.dumps({"config": name, "startup_s": round(startup, 1), "elapsed_s": round(elapsed, 2),
                               "tokens_per_s": round(sum(map(len, tokens)) / elapsed, 1),
                               "decode_step_ms_p50": round(1000 * float(np.median(decode)), 1),
                               "tokens": tokens}))
    llm.engine.close()


# ---------------------------------------------------------------- part 2: 1P1D vs mixed, fixed load
def serve_prefill(model: str, port: int) -> None:
    """The prefill server of the pair, in its own process (until killed)."""
    from ernie_serve.config import EngineConfig
    from ernie_serve.serving.disagg import engine_front

    front = engine_front(EngineConfig(model=model, **ENGINE, splitwise_role="prefill", engine_worker_queue_port=port))
    print("ready", flush=True)
    threading.Event().wait()
    front.shutdown(drain=False)


def run_load(model: str, name: str, out: Path, num: int, interval: float, prompt_len: int, output_len: int) -> None:
    from ernie_serve.config import EngineConfig
    from ernie_serve.sampling_params import SamplingParams
    from ernie_serve.serving.disagg import engine_front
    from ernie_serve.serving.launcher import free_port

    prefill = None
    if name == "1p1d":
        port = free_port()
        prefill = subprocess.Popen([sys.executable, __file__, "--_prefill", model, str(port)], stdout=subprocess.PIPE,
                                   text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
        assert prefill.stdout.readline().strip() == "ready"
        config = EngineConfig(model=model, **ENGINE, splitwise_role="decode", innode_prefill_ports=str(port))
    else:
        config = EngineConfig(model=model, **ENGINE)
    front = engine_front(config)
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    # warm-up: one request through the whole path
    done = threading.Event()
    front.add_request("warm", _prompts(1, 32, seed=9)[0], SamplingParams(temperature=0, max_tokens=2),
                      lambda o, e: done.set() if o.finished or e else None)
    done.wait(300)
    arrivals, token_times, finished = {}, {}, threading.Semaphore(0)

    def callback(rid):
        def on_output(o, err):
            if o.outputs[0].token_ids_delta:
                token_times.setdefault(rid, []).extend([time.perf_counter()] * len(o.outputs[0].token_ids_delta))
            if o.finished or err is not None:
                finished.release()
        return on_output

    for i, prompt in enumerate(_prompts(num, prompt_len, seed=2)):
        target = (arrivals["r0"] if i else time.perf_counter()) + i * interval
        time.sleep(max(0.0, target - time.perf_counter()))
        arrivals[f"r{i}"] = time.perf_counter()
        front.add_request(f"r{i}", prompt, params, callback(f"r{i}"))
    for _ in range(num):
        finished.acquire(timeout=600)
    ttft = [token_times[r][0] - arrivals[r] for r in arrivals if r in token_times]
    itl = [b - a for r in token_times for a, b in zip(token_times[r], token_times[r][1:])]
    out.write_text(json.dumps({"config": name, "completed": len(token_times),
                               "ttft_ms_p50": round(1000 * float(np.percentile(ttft, 50)), 1),
                               "ttft_ms_p90": round(1000 * float(np.percentile(ttft, 90)), 1),
                               "itl_ms_p50": round(1000 * float(np.percentile(itl, 50)), 1),
                               "itl_ms_p90": round(1000 * float(np.percentile(itl, 90)), 1)}))
    front.shutdown(drain=False)
    if prefill is not None:
        prefill.kill()
        prefill.wait()


def _sub(args: list[str], threads: int | None = None) -> None:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    subprocess.run([sys.executable, __file__, *args], env=env, check=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default="tp,pd")
    ap.add_argument("--out", type=Path, default=ROOT / "out")
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--interval", type=float, default=4.0, help="seconds between arrivals (pd)")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--_tp", nargs=3, help=argparse.SUPPRESS)
    ap.add_argument("--_load", nargs=3, help=argparse.SUPPRESS)
    ap.add_argument("--_prefill", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._tp:
        return run_tp(args._tp[0], args._tp[1], Path(args._tp[2]))
    if args._load:
        return run_load(args._load[0], args._load[1], Path(args._load[2]), args.requests, args.interval,
                        args.prompt_len, args.output_len)
    if args._prefill:
        return serve_prefill(args._prefill[0], int(args._prefill[1]))

    from bench_offline import bench_checkpoint

    model = str(bench_checkpoint())
    args.out.mkdir(parents=True, exist_ok=True)
    summary = {"checkpoint": model, "cores": len(os.sched_getaffinity(0)), "date": time.strftime("%Y-%m-%d %H:%M"),
               "load_average": os.getloadavg()}
    if "tp" in args.parts:
        rows = []
        for name in TP_CONFIGS:
            path = args.out / f"bench_parallel_{name}.json"
            _sub(["--_tp", model, name, str(path)])
            rows.append(json.loads(path.read_text()))
        print(f"\n{'config':8} {'tok/s':>7} {'decode p50 ms':>14} {'startup s':>10}  tokens = TP=1")
        for r in rows:
            r["same_tokens_as_tp1"] = r["tokens"] == rows[0]["tokens"]
            print(f"{r['config']:8} {r['tokens_per_s']:7.1f} {r['decode_step_ms_p50']:14.1f} {r['startup_s']:10.1f}  "
                  f"{r['same_tokens_as_tp1']}")
        for r in rows:
            del r["tokens"]
        summary["tp"] = rows
    if "pd" in args.parts:
        rows = []
        extra = ["--requests", str(args.requests), "--interval", str(args.interval), "--prompt-len",
                 str(args.prompt_len), "--output-len", str(args.output_len)]
        for name, threads in (("mixed", None), ("1p1d", 1)):
            path = args.out / f"bench_parallel_{name}.json"
            _sub(["--_load", model, name, str(path), *extra], threads)
            rows.append(json.loads(path.read_text()))
        print(f"\n{args.requests} requests x ({args.prompt_len} prompt + {args.output_len} output), one every "
              f"{args.interval} s")
        print(f"{'config':8} {'TTFT p50':>9} {'TTFT p90':>9} {'ITL p50':>8} {'ITL p90':>8}  (ms)")
        for r in rows:
            print(f"{r['config']:8} {r['ttft_ms_p50']:9.0f} {r['ttft_ms_p90']:9.0f} {r['itl_ms_p50']:8.0f} "
                  f"{r['itl_ms_p90']:8.0f}")
        summary["pd"] = {"requests": args.requests, "interval_s": args.interval, "prompt_len": args.prompt_len,
                         "output_len": args.output_len, "rows": rows}
    (args.out / "bench_parallel.json").write_text(json.dumps(summary, indent=2))
    print(f"\nwrote {args.out / 'bench_parallel.json'}")


if __name__ == "__main__":
    main()
