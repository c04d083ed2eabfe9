"""Long-prompt cost on the embedded tiny model: prefill time and peak memory by prompt length.

    .venv/bin/python scripts/bench_long_context.py                      # 2k, 8k, 16k, 32k
    .venv/bin/python scripts/bench_long_context.py --lengths 2048,8192

Each length runs in its own process, so its peak RSS is that prompt's alone: one request of N random
token ids through `LLM.generate` with the engine's defaults (chunked prefill, max_num_batched_tokens 8192,
block_size 64), greedy, then a few decode steps at that context. The tiny model's positions end at 4096;
past that RoPE extrapolates, which changes what it says, not what it costs. Reported: prefill seconds
(every step up to the first token), decode ms per step at the full context, peak RSS, and RSS once the
model is loaded and warmed up (the difference is what the prompt cost). Prints a table and writes
out/bench_long_context.json.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_LENGTHS = "2048,8192,16384,32768"


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def run_one(prompt_len: int, decode_steps: int, out: Path) -> None:
    """One prompt length (runs in a subprocess of the main script)."""
    import numpy as np

    from ernie_serve import LLM, SamplingParams
    from ernie_serve.demo.tiny_model import ensure_tiny_model

    llm = LLM(model=str(ensure_tiny_model()), max_model_len=prompt_len + decode_steps + 1, skip_tokenizer_init=True,
              disable_progress_bar=True)
    vocab = llm.engine.model_config.vocab_size
    rng = np.random.default_rng(0)
    greedy = SamplingParams(temperature=0, max_tokens=decode_steps + 1, ignore_eos=True)
    llm.generate(prompt_token_ids=[rng.integers(3, vocab, 64).tolist()], sampling_params=greedy, use_tqdm=False)
    loaded_rss = _peak_rss_mb()

    steps: list[tuple[bool, float]] = []  # (decoding, seconds)
    engine_step = llm.engine.step

    def timed_step():
        running = llm.engine.scheduler.running
        decoding = bool(running) and all(r.num_computed_tokens >= r.num_prompt_tokens for r in running)
        t = time.perf_counter()
        outs = engine_step()
        steps.append((decoding, time.perf_counter() - t))
        return outs

    llm.engine.step = timed_step
    prompt = rng.integers(3, vocab, prompt_len).tolist()
    t0 = time.perf_counter()
    llm.generate(prompt_token_ids=[prompt], sampling_params=greedy, use_tqdm=False)
    total = time.perf_counter() - t0
    decode = [dt for decoding, dt in steps if decoding]
    result = {
        "prompt_len": prompt_len,
        "prefill_s": round(sum(dt for decoding, dt in steps if not decoding), 2),
        "prefill_steps": sum(not decoding for decoding, _ in steps),
        "decode_ms_per_step": round(1000 * float(np.median(decode)), 1) if decode else None,
        "total_s": round(total, 2),
        "peak_rss_mb": round(_peak_rss_mb()),
        "loaded_rss_mb": round(loaded_rss),
        "max_num_batched_tokens": llm.engine.config.max_num_batched_tokens,
        "block_size": llm.engine.config.block_size,
    }
    out.write_text(json.dumps(result))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default=DEFAULT_LENGTHS,
                    help=f"comma list of prompt lengths (default {DEFAULT_LENGTHS})")
    ap.add_argument("--decode-steps", type=int, default=8, help="decode steps timed after each prompt")
    ap.add_argument("--out", type=Path, default=ROOT / "out")
    ap.add_argument("--_run-one", nargs=2, metavar=("LEN", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._run_one:
        run_one(int(args._run_one[0]), args.decode_steps, Path(args._run_one[1]))
        return

    try:
        lengths = [int(x) for x in args.lengths.split(",") if x]
    except ValueError:
        lengths = []
    if not lengths or min(lengths) < 1:
        raise SystemExit(f"--lengths must be positive integers, got {args.lengths!r}")
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for n in lengths:
        part = args.out / f"bench_long_context_{n}.json"
        part.unlink(missing_ok=True)
        print(f"[bench] prompt of {n} tokens", flush=True)
        proc = subprocess.run([sys.executable, __file__, "--_run-one", str(n), str(part),
                               "--decode-steps", str(args.decode_steps)], env=dict(os.environ, PYTHONUNBUFFERED="1"))
        if proc.returncode != 0 or not part.exists():
            print(f"[bench] {n} tokens failed (exit {proc.returncode})", flush=True)
            continue
        rows.append(json.loads(part.read_text()))
        part.unlink()

    print(f"\n{'prompt':>7} {'prefill s':>10} {'decode ms/step':>15} {'peak RSS MB':>12} {'loaded RSS MB':>14}")
    for r in rows:
        decode = "-" if r["decode_ms_per_step"] is None else f"{r['decode_ms_per_step']:.1f}"
        print(f"{r['prompt_len']:>7} {r['prefill_s']:>10.1f} {decode:>15} {r['peak_rss_mb']:>12} "
              f"{r['loaded_rss_mb']:>14}")
    summary = {"model": "tiny-ernie-moe", "date": time.strftime("%Y-%m-%d %H:%M"), "cpus": len(os.sched_getaffinity(0)),
               "load_average": os.getloadavg(), "decode_steps": args.decode_steps, "rows": rows}
    (args.out / "bench_long_context.json").write_text(json.dumps(summary, indent=2))
    print(f"\nwrote {args.out / 'bench_long_context.json'}")


if __name__ == "__main__":
    main()
