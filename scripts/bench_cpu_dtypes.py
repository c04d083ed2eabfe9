"""Decode and prefill on the CPU reference backend per weight format, side by side in one process: float32,
bfloat16 (--dtype) and the weight-only int formats (--quantization), on the benchmark-size ERNIE-4.5 MoE.

    .venv/bin/python scripts/bench_cpu_dtypes.py                      # float32, bfloat16, wint8
    .venv/bin/python scripts/bench_cpu_dtypes.py --formats bfloat16,wint8,wint4 --rounds 3

Each engine prefills 16 prompts of 200 tokens (one step), then decodes 32 tokens with 16 running, each step timed
on its own (the engine's step wrapped); rounds alternate the engines so a noisy box hurts each alike. Prints the
prefill step's ms (best round and median), the decode steps' median ms (best round and median of rounds), the
resident weight bytes, and each format's decode speed relative to bfloat16.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from bench_offline import bench_checkpoint  # noqa: E402

FORMATS = {"float32": dict(dtype="float32"), "bfloat16": dict(dtype="bfloat16"),
           "wint8": dict(quantization="wint8"), "wint4": dict(quantization="wint4"),
           "wint8-bf16": dict(quantization="wint8", dtype="bfloat16"),
           "wint4-bf16": dict(quantization="wint4", dtype="bfloat16")}


def _timed_steps(llm, prompts: list[list[int]], params) -> list[float]:
    """ms of each engine step of one generate: the prefill first, then the decodes."""
    engine, times = llm.engine, []
    step = engine.step

    def timed():
        t = time.perf_counter()
        out = step()
        times.append((time.perf_counter() - t) * 1e3)
        return out

    engine.step = timed
    try:
        llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    finally:
        engine.step = step
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--formats", default="float32,bfloat16,wint8", help=f"comma list of {', '.join(FORMATS)}")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--running", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=200)
    ap.add_argument("--decode-steps", type=int, default=32)
    args = ap.parse_args()
    formats = [f for f in args.formats.split(",") if f]
    if not set(formats) <= set(FORMATS):
        ap.error(f"--formats {args.formats}: each must be one of {', '.join(FORMATS)}")

    import numpy as np
    from tqdm import tqdm

    from ernie_serve import LLM, SamplingParams
    from ernie_serve.model.quantized_layers import weight_memory_report

    model = bench_checkpoint()
    rng = np.random.default_rng(0)
    prompts = [rng.integers(10, 32000, size=args.prompt_len).tolist() for _ in range(args.running)]
    engines = {f: LLM(model=str(model), skip_tokenizer_init=True, disable_progress_bar=True, max_num_seqs=args.running,
                      enable_prefix_caching=False, **FORMATS[f]) for f in tqdm(formats, desc="loading engines")}
    many = SamplingParams(temperature=0, max_tokens=args.decode_steps + 1, ignore_eos=True)
    prefill: dict[str, list[float]] = {f: [] for f in formats}
    decode: dict[str, list[float]] = {f: [] for f in formats}
    for _ in tqdm(range(args.rounds), desc="rounds"):
        for f, llm in engines.items():
            steps = _timed_steps(llm, prompts, many)
            if len(steps) < 2:
                raise SystemExit(f"{f}: the prompts did not prefill in one step ({len(steps)} steps)")
            prefill[f].append(steps[0])
            decode[f].append(statistics.median(steps[1:]))
    base = min(decode["bfloat16"]) if "bfloat16" in decode else None
    print(f"\n{args.running} x {args.prompt_len}-token prompts, then {args.decode_steps} decode steps at "
          f"{args.running} running; {args.rounds} alternating rounds")
    print(f"{'format':9} {'weights MiB':>11} {'prefill ms (best / median)':>27} "
          f"{'decode ms a step (best / median)':>33} {'decode vs bf16':>15}")
    for f in formats:
        mib = weight_memory_report(engines[f].engine.model)["total_bytes"] / 2**20
        rel = f"{base / min(decode[f]):.2f}x" if base else "-"
        print(f"{f:9} {mib:11.1f} {min(prefill[f]):13.0f} / {statistics.median(prefill[f]):7.0f} "
              f"{min(decode[f]):22.1f} / {statistics.median(decode[f]):6.1f} {rel:>15}")


if __name__ == "__main__":
    main()
