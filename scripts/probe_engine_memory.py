#!/usr/bin/env python3
"""Where an engine's memory goes under a long stream of short requests: tracemalloc's top lines against the start,
the RSS, and the sizes of the structures that are meant to be bounded (the prefix cache's tables, at most the
pool's block count; the simulated device's replay memo, at most SimulationConstants.replay_memo_entries), every
--every finished requests. It separates growth that levels off at those bounds from a leak (a line that keeps
growing past them). The engine is the offline LLMEngine on the simulated device (no model, the host side real),
as the engine core process runs it.

    .venv/bin/python scripts/probe_engine_memory.py [--requests 40000] [--every 5000] [--running 256]
"""
from __future__ import annotations

import argparse
import gc
import os
import random
import sys
import time
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "backend"))


def rss_mb() -> float:
    return int(Path(f"/proc/{os.getpid()}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=40000)
    ap.add_argument("--every", type=int, default=5000)
    ap.add_argument("--running", type=int, default=256)
    ap.add_argument("--top", type=int, default=6)
    args = ap.parse_args()
    from ernie_serve import LLM, RequestOutputKind, SamplingParams

    llm = LLM(execution_backend="simulated", simulated_gpu="h200", simulated_model="ernie-4.5-21b-a3b",
              quantization="wint8", max_num_seqs=args.running, disable_progress_bar=True)
    engine = llm.engine
    vocab = min(engine.model_config.vocab_size, 4000)
    rng = random.Random(0)
    tracemalloc.start(1)
    base = tracemalloc.take_snapshot()
    added = done = 0
    t0 = time.time()
    print(f"start: RSS {rss_mb():.1f} MB", flush=True)
    while done < args.requests:
        while added < args.requests and added - done < args.running:
            prompt = [rng.randrange(100, vocab) for _ in range(rng.randrange(8, 200))]
            engine.add_request(f"r{added}", prompt, SamplingParams(
                max_tokens=rng.randrange(4, 24), temperature=0, output_kind=RequestOutputKind.DELTA, detokenize=False))
            added += 1
        for out in engine.step():
            if not out.finished:
                continue
            done += 1
            if done % args.every:
                continue
            gc.collect()
            snap = tracemalloc.take_snapshot()
            pool = engine.kv.pool
            traced = sum(s.size for s in snap.statistics("filename")) / 2**20
            print(f"{done} requests, {time.time() - t0:.0f} s: RSS {rss_mb():.1f} MB, traced {traced:.1f} MB; "
                  f"prefix cache {len(pool.cached)} entries (pool {pool.num_blocks} blocks), replay memo "
                  f"{len(engine.runner.executor.replay._base)} (bound {engine.runner.executor.replay.memo_entries}), "
                  f"requests held {len(engine.output.requests)}", flush=True)
            for stat in snap.compare_to(base, "lineno")[: args.top]:
                print("    ", str(stat)[:200], flush=True)
    engine.close()


if __name__ == "__main__":
    main()
