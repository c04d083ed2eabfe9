"""The kernels backend end to end on one GPU, with torch (the borrowed H200 box has torch, triton and
transformers but no Paddle): the engine through `LLM`, on the benchmark-size checkpoint generated here.

For bf16 weights and each quantized format (wint8, wint4, block_wise_fp8):
  - teacher-forced logit error against HF transformers' fp32 model on the same GPU (an independent oracle),
    and top-1 agreement;
  - decode tok/s at 1 / 16 / 64 / 256 running sequences, with and without CUDA graphs, each as a ratio to the HBM
    roofline (resident weight bytes / step time over the peak bandwidth) and to HF `generate` in bf16;
  - beside them, what the simulated device's step model (docs/serving-path.md) gives this GPU for the same
    checkpoint's decode steps at 64 and 256: how far the serving benchmark's instrument is from the GPU.
Prints a table and writes gpu_engine_check.json to --out. A time budget (--budget-s) skips what does not fit
and says so in the JSON. `--cpu-smoke` runs the same code on a tiny model in triton's CPU interpreter
(what CI runs).

    python scripts/gpu_engine_check.py --out $OUT          # GPU, ~5 minutes
    python scripts/gpu_engine_check.py --cpu-smoke --out /tmp/x
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from gpu_check_env import ROOT, prepare

SMOKE = prepare("torch")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from ernie_serve import LLM  # noqa: E402
from gpu_check_common import (decode_rate, forced_sequences, log, logit_error, prefill_step,  # noqa: E402
                              write_bench_checkpoint)

PEAK_BW = {"H200": 4.8e12, "H100": 3.35e12}

def hf_model(ckpt: Path, dtype):
    from transformers import AutoModelForCausalLM

    dev = "cpu" if SMOKE else "cuda"
    return AutoModelForCausalLM.from_pretrained(ckpt, dtype=dtype).to(dev).eval()


@torch.no_grad()
def hf_forced_logits(model, seqs: list[list[int]]) -> np.ndarray:
    dev = next(model.parameters()).device
    return torch.cat([model(torch.tensor([s], device=dev)).logits[0].float() for s in seqs]).cpu().numpy()


@torch.no_grad()
def hf_generate_rate(model, batch: int, prompt_len: int, steps: int, vocab: int) -> float:
    dev = next(model.parameters()).device
    ids = torch.tensor(forced_sequences(vocab, batch, prompt_len), device=dev)

    def run(n: int) -> float:
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    run(2)  # warm-up
    prefill = run(1)
    return batch * (steps - 1) / max(run(steps) - prefill, 1e-9)


def simulated_beside(device: str, ckpt: Path, formats: list, batches: list[int], context: int) -> dict:
    """What the simulated device's step model (docs/serving-path.md) says this GPU takes for the same checkpoint's
    decode steps, for each format, to read beside the measured ones: how far the instrument is from the GPU."""
    from ernie_serve.model.config import ErnieModelConfig
    from ernie_serve.simulated_backend.__main__ import modeled_decode
    from ernie_serve.simulated_backend.targets import GPUS, ModelShape, Target

    gpu = next((name for name in GPUS if name in device.lower()), "h200" if SMOKE else None)
    if gpu is None:
        return {"why": f"no simulated target for {device}; known: {', '.join(GPUS)}"}
    shape = ModelShape(ckpt.name, ErnieModelConfig.from_pretrained(ckpt))
    return {fmt or ("fp32" if SMOKE else "bf16"): modeled_decode(Target(GPUS[gpu], shape, fmt, 1), batches, context)
            for fmt in formats}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ROOT / "out")))
    ap.add_argument("--cpu-smoke", action="store_true")
    ap.add_argument("--budget-s", type=float, default=330.0, help="skip what would start after this many seconds")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    formats = [None, "wint8"] if SMOKE else [None, "wint8", "wint4", "block_wise_fp8"]
    batches = [1, 2] if SMOKE else [1, 16, 64, 256]
    steps, prompt_len, n_forced, forced_len = (2, 8, 2, 12) if SMOKE else (32, 32, 4, 64)
    graph_modes = [False] if SMOKE else [False, True]
    device = "cpu (triton interpreter)" if SMOKE else torch.cuda.get_device_name()
    peak = next((bw for name, bw in PEAK_BW.items() if name in device), None)
    report: dict = {"device": device, "smoke": SMOKE, "peak_bw": peak, "formats": {}, "skipped": [], "errors": []}

    ckpt, config = write_bench_checkpoint(args.out, SMOKE)
    vocab = config["vocab_size"]
    log(f"checkpoint {ckpt}")
    seqs = forced_sequences(vocab, n_forced, forced_len)
    hf32 = hf_model(ckpt, torch.float32)
    ref = hf_forced_logits(hf32, seqs)
    del hf32
    hf16 = hf_model(ckpt, torch.float32 if SMOKE else torch.bfloat16)
    report["hf_bf16_forced"] = logit_error(hf_forced_logits(hf16, seqs), ref)
    report["hf_generate_tok_s"] = {b: hf_generate_rate(hf16, b, prompt_len, steps, vocab) for b in batches}
    del hf16
    log(f"HF: {report['hf_generate_tok_s']}")

    for fmt in formats:
        name = fmt or ("fp32" if SMOKE else "bf16")
        entry: dict = {"decode": []}
        report["formats"][name] = entry
        for graphs in graph_modes:
            if time.perf_counter() - start > args.budget_s:
                report["skipped"].append(f"{name} graphs={graphs}: over the time budget")
                continue
            try:
                t0 = time.perf_counter()
                llm = LLM(model=str(ckpt), execution_backend="kernels", quantization=fmt, skip_tokenizer_init=True,
                          max_num_seqs=max(batches), max_model_len=256, block_size=64, use_cudagraph=graphs,
                          disable_progress_bar=True)
                entry.setdefault("load_s", {})[str(graphs)] = time.perf_counter() - t0
                shard = llm.engine.runner.executor
                weight_bytes = shard.model.weights.nbytes
                entry["weight_bytes"] = weight_bytes
                if not graphs:
                    _, logits = shard.execute(prefill_step(seqs, 64))
                    entry["forced"] = logit_error(logits.numpy(), ref)
                for b in batches:
                    r = decode_rate(llm, b, prompt_len, steps, vocab)
                    r["cuda_graphs"] = graphs
                    r["roofline"] = (weight_bytes / (r["step_ms"] / 1e3)) / peak if peak else None
                    r["vs_hf_generate"] = r["tok_s"] / report["hf_generate_tok_s"][b]
                    entry["decode"].append(r)
                    log(f"{name} graphs={graphs} batch {b}: {r['tok_s']:.0f} tok/s, {r['step_ms']:.2f} ms/step")
                if fmt is None and graphs == graph_modes[-1]:  # what sampling on the device costs over greedy
                    b = batches[len(batches) // 2]
                    entry["sampled_decode"] = decode_rate(llm, b, prompt_len, steps, vocab, sampled=True)
                    log(f"{name} graphs={graphs} batch {b} sampled: {entry['sampled_decode']['tok_s']:.0f} tok/s")
                del llm
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
            except Exception as e:  # one format failing must not hide the others' figures
                report["errors"].append(f"{name} graphs={graphs}: {type(e).__name__}: {e}")
                log(report["errors"][-1])
    report["simulated"] = simulated_beside(device, ckpt, formats, batches[-2:], prompt_len + steps // 2)
    report["seconds"] = time.perf_counter() - start
    (args.out / "gpu_engine_check.json").write_text(json.dumps(report, indent=2))
    print(f"\n{'format':<16}{'max err':>9}{'top1':>7}  decode tok/s by batch (graphs off / on)")
    for name, e in report["formats"].items():
        f = e.get("forced", {})
        rates = {}
        for r in e["decode"]:  # greedy rows; sampled_decode is reported in the JSON
            rates.setdefault(r["batch"], {})[r["cuda_graphs"]] = r["tok_s"]
        cells = "  ".join(f"{b}: {v.get(False, 0):.0f}/{v.get(True, 0):.0f}" for b, v in rates.items())
        print(f"{name:<16}{f.get('max_abs_err_rel', float('nan')):>9.4f}{f.get('top1_agreement', float('nan')):>7.2f}  {cells}")
    print(f"HF generate tok/s: {report['hf_generate_tok_s']}; errors: {len(report['errors'])}; "
          f"skipped: {len(report['skipped'])}; {report['seconds']:.0f} s")
    sys.exit(1 if report["errors"] else 0)


if __name__ == "__main__":
    main()
