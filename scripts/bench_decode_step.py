#!/usr/bin/env python3
"""Decode-step time with the decoder layers in one C call a step (model/cpu_layers.py) against the same engine
running its Python layers, side by side in one process: alternating waves of the same requests, step time
percentiles, where the step's time goes (the C layer stack, lm_head, the rest of the runner, the engine around it),
and whether the greedy tokens agree.

    .venv/bin/python scripts/bench_decode_step.py [--model DIR] [--quantization wint8] [--rounds 3]
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


class CallTimer:
    """Seconds spent in wrapped callables, by name."""

    def __init__(self):
        self.spent: dict[str, float] = {}

    def wrap(self, owner, attr: str, name: str) -> None:
        fn = getattr(owner, attr)

        def timed(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.spent[name] = self.spent.get(name, 0.0) + time.perf_counter() - t
        setattr(owner, attr, timed)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=None, help="checkpoint (default: the benchmark-size one)")
    ap.add_argument("--quantization", default=None, help="e.g. wint8, wint4 (default: the checkpoint's dtype)")
    ap.add_argument("--num-seqs", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=101)
    ap.add_argument("--output-len", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3, help="waves per path, alternating")
    ap.add_argument("--out", type=Path, default=ROOT / "out" / "bench_decode_step.json")
    args = ap.parse_args()

    from ernie_serve import LLM, SamplingParams
    from ernie_serve.cpu_kernels import cpu_attention, cpu_gemm, cpu_layer

    if args.model is None:
        from bench_offline import bench_checkpoint
        args.model = bench_checkpoint()
    timer = CallTimer()
    timer.wrap(cpu_layer, "decoder_layers", "layer stack (C)")
    timer.wrap(cpu_gemm, "gemm", "gemm calls (lm_head; the dense layers on the Python path)")
    timer.wrap(cpu_gemm, "moe_gemm", "expert gemm calls (Python path)")
    timer.wrap(cpu_attention, "paged_attention", "attention calls (Python path)")
    kw = {"quantization": args.quantization} if args.quantization else {}
    llm = LLM(model=str(args.model), max_model_len=512, max_num_seqs=args.num_seqs, skip_tokenizer_init=True,
              disable_progress_bar=True, **kw)
    eng, model = llm.engine, llm.engine.runner.executor.model
    stack = model.cpu_layers
    if stack is None:
        sys.exit("this model's layers are not covered by the C stack (see model/cpu_layers.py); nothing to compare")
    timer.wrap(eng.runner, "execute", "runner")
    rng = np.random.default_rng(0)
    prompts = [rng.integers(100, model.config.vocab_size - 1, args.prompt_len).tolist() for _ in range(args.num_seqs)]
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    results: dict[str, dict] = {"c_stack": {"steps": [], "spent": {}}, "python": {"steps": [], "spent": {}}}
    tokens: dict[str, dict[int, list[int]]] = {}
    for rnd in range(args.rounds):
        for path in results:
            model.cpu_layers = stack if path == "c_stack" else None
            for i, p in enumerate(prompts):
                eng.add_request(f"{path}{rnd}-{i}", p + [rnd], params)  # a new last token: no whole-prompt cache hit
            eng.step()  # the prefill
            timer.spent.clear()
            steps, outs = [], {}
            while eng.scheduler.running:
                t = time.perf_counter()
                for o in eng.step():
                    if o.finished:
                        outs[int(o.request_id.split("-")[1])] = list(o.outputs[0].token_ids)
                steps.append(time.perf_counter() - t)
            r = results[path]
            r["steps"] += steps
            for k, v in timer.spent.items():
                r["spent"][k] = r["spent"].get(k, 0.0) + v / len(steps)
            tokens.setdefault(path, outs)
            print(f"round {rnd + 1}/{args.rounds} {path:8s} decode step p50 {np.median(steps) * 1e3:6.1f} ms",
                  flush=True)
    model.cpu_layers = stack
    summary = {"model": str(args.model), "quantization": args.quantization, "num_seqs": args.num_seqs}
    print(f"\n{args.num_seqs} running, decode steps of {args.prompt_len}-token prompts, {args.rounds} waves a path")
    for path, r in results.items():
        ms = np.asarray(r["steps"]) * 1e3
        spent = {k: round(v / args.rounds * 1e3, 2) for k, v in r["spent"].items()}
        rest = spent.get("runner", 0) - sum(v for k, v in spent.items() if k != "runner")
        summary[path] = {"p50_ms": round(float(np.median(ms)), 2), "p90_ms": round(float(np.percentile(ms, 90)), 2),
                         "ms_a_step": spent, "engine_outside_runner_ms": round(float(ms.mean()) - spent.get("runner", 0), 2)}
        print(f"{path:8s} p50 {np.median(ms):6.1f} ms  p90 {np.percentile(ms, 90):6.1f} ms  "
              f"runner {spent.get('runner', 0):5.1f} ms of which {', '.join(f'{k} {v:.1f}' for k, v in spent.items() if k != 'runner')}"
              f" (the rest of the runner {rest:.1f}); engine outside the runner {summary[path]['engine_outside_runner_ms']:.1f} ms")
    ratio = summary["python"]["p50_ms"] / summary["c_stack"]["p50_ms"]
    same = sum(tokens["c_stack"][i] == tokens["python"][i] for i in tokens["c_stack"])
    summary.update(speedup_p50=round(ratio, 3), greedy_equal=f"{same}/{len(tokens['c_stack'])}")
    print(f"C stack vs Python layers: {ratio:.2f}x at p50; greedy tokens equal on {same}/{len(tokens['c_stack'])}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
