"""Accuracy, memory and speed of each quantization format against fp32, on one checkpoint.

    .venv/bin/python scripts/bench_quant_accuracy.py                      # the benchmark-size model
    .venv/bin/python scripts/bench_quant_accuracy.py --formats fp32,wint8 --max-tokens 16

Per format: greedy decoding of 16 random prompts (32 tokens) through ernie_serve.LLM
(skip_tokenizer_init, max_num_seqs=16); logits of every format on fp32's sequences (prompt + fp32's
64 greedy tokens, teacher-forced, one batched forward) against fp32's: max / mean absolute error and
top-1 agreement; free-running greedy agreement (position by position, so one early divergence costs
every later token); resident weight bytes; load time; decode tok/s (prompts already prefix-cached).
wint8 / wint4 / block_wise_fp8 are quantized online while loading; wint2 and w4a8 are written first
with scripts/quantize_checkpoint.py's code (w4a8 calibrated on 8 random sequences), cached next to
the checkpoint. wint8 / wint4 / w4a8 run through cpu_kernels/cpu_qgemm.c (integer dot products over the
codes as stored); wint2 and block_wise_fp8 still dequantize fp32 tiles every forward, so wint2 decodes
fewer free-running tokens (--slow-tokens) to keep the run near 10 minutes.
Prints a table and writes out/bench_quant_accuracy.json.
"""
from __future__ import annotations

import argparse
import gc
import json
import shutil
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "backend"))

from ernie_serve import LLM, SamplingParams  # noqa: E402  (first: it sets the MKL/threads env paddle reads)
import paddle  # noqa: E402
from ernie_serve.model.attention import AttentionMetadata  # noqa: E402
from ernie_serve.model.quantize_checkpoint import quantize_checkpoint  # noqa: E402
from ernie_serve.model.quantized_layers import weight_memory_report  # noqa: E402

FORMATS = ("fp32", "wint8", "wint4", "block_wise_fp8", "wint2", "w4a8")
OFFLINE = ("wint2", "w4a8")  # served from a pre-quantized checkpoint
SLOW = ("wint2",)


def bench_checkpoint() -> Path:
    from ernie_serve.demo.tiny_model import build_checkpoint
    from ernie_serve.paths import models_dir

    path = models_dir() / "bench-ernie-moe"
    if not (path / "BUILD").exists():
        print(f"building {path} (1.3 GB, once)")
        build_checkpoint(path, "bench")
    return path


def model_dir_for(base: Path, fmt: str) -> tuple[Path, str | None, float]:
    """(directory to serve, --quantization value, seconds spent writing a pre-quantized checkpoint)."""
    if fmt not in OFFLINE:
        return base, None if fmt == "fp32" else fmt, 0.0
    out = base.parent / f"{base.name}-{fmt}"
    source = (base / "BUILD").read_text() if (base / "BUILD").exists() else str(base.stat().st_mtime)
    if (out / "SOURCE").exists() and (out / "SOURCE").read_text() == source:
        return out, None, 0.0
    shutil.rmtree(out, ignore_errors=True)
    t0 = time.perf_counter()
    quantize_checkpoint(base, out, fmt)
    (out / "SOURCE").write_text(source)  # which build of the checkpoint this was quantized from
    return out, None, time.perf_counter() - t0


@paddle.no_grad()
def forced_logits(model, seqs: list[list[int]], prompt_len: int) -> np.ndarray:
    """[num_seqs, len - prompt_len, V] logits predicting each generated token (one batched prefill)."""
    n = len(seqs[0])
    ids = np.concatenate(seqs).astype(np.int64)
    pos = np.tile(np.arange(n), len(seqs))
    meta = AttentionMetadata.build([n] * len(seqs), [n] * len(seqs), None, 16, None, n - 1)
    hidden = model(paddle.to_tensor(ids), paddle.to_tensor(pos), meta, None).reshape([len(seqs), n, -1])
    rows = hidden[:, prompt_len - 1 : n - 1].reshape([-1, hidden.shape[-1]])
    return model.compute_logits(rows).numpy().reshape(len(seqs), n - prompt_len, -1)


def run_format(fmt: str, base: Path, prompts: list[list[int]], n_tokens: int, ref: dict | None) -> dict:
    model_dir, quant, write_s = model_dir_for(base, fmt)
    t0 = time.perf_counter()
    llm = LLM(model=str(model_dir), skip_tokenizer_init=True, quantization=quant, max_num_seqs=16,
              max_model_len=256, block_size=16, disable_progress_bar=True)
    load_s = time.perf_counter() - t0
    prefill = SamplingParams(temperature=0, ignore_eos=True, max_tokens=1)
    llm.generate(prompt_token_ids=prompts, sampling_params=prefill)  # later runs hit the prefix cache
    t0 = time.perf_counter()
    outs = llm.generate(prompt_token_ids=prompts,
                        sampling_params=SamplingParams(temperature=0, ignore_eos=True, max_tokens=n_tokens))
    decode_s = time.perf_counter() - t0
    tokens = [o.outputs[0].token_ids for o in outs]
    mem = weight_memory_report(llm.engine.model)
    row = {"format": fmt, "model_dir": str(model_dir), "load_s": load_s, "quantize_write_s": write_s,
           "free_tokens": n_tokens, "decode_tok_s": len(prompts) * n_tokens / decode_s, "tokens": tokens, **mem}
    if ref is None:  # fp32 itself: its continuations are the teacher-forced sequences
        row["seqs"] = [p + t for p, t in zip(prompts, tokens)]
        row["repeat_last_token_seqs"] = sum(all(x == p[-1] for x in t) for p, t in zip(prompts, tokens))
        row["logits"] = forced_logits(llm.engine.model, row["seqs"], len(prompts[0]))
    else:
        logits = forced_logits(llm.engine.model, ref["seqs"], len(prompts[0]))
        err = np.abs(logits - ref["logits"])
        top5, ref5 = np.argsort(-logits, -1)[..., :5], np.argsort(-ref["logits"], -1)[..., :5]
        overlap = (top5[..., :, None] == ref5[..., None, :]).any(-1).mean()
        row.update(max_logit_err=float(err.max()), mean_logit_err=float(err.mean()),
                   ref_logit_std=float(ref["logits"].std()), forced_top5_overlap=float(overlap),
                   forced_top1_agree=float((logits.argmax(-1) == ref["logits"].argmax(-1)).mean()))
        same = [[a == b for a, b in zip(t, r[:n_tokens])] for t, r in zip(tokens, ref["tokens"])]
        row["greedy_agree"] = float(np.mean(same))
        row["greedy_prefix"] = float(np.mean([s.index(False) if False in s else len(s) for s in same]))
    del llm
    gc.collect()
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="checkpoint directory (default: the benchmark-size demo model; 'tiny': "
                    "the fitted demo model, whose greedy continuations are not a repeat of the last token)")
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64, help="fp32 greedy tokens (the teacher-forced length)")
    ap.add_argument("--slow-tokens", type=int, default=24, help=f"free-running tokens for {', '.join(SLOW)}")
    ap.add_argument("--out", default=str(ROOT / "out" / "bench_quant_accuracy.json"))
    args = ap.parse_args()
    if args.model == "tiny":
        from ernie_serve.demo.tiny_model import ensure_tiny_model

        base = ensure_tiny_model()
    else:
        base = Path(args.model) if args.model else bench_checkpoint()
    formats = [f for f in args.formats.split(",") if f]
    if formats[0] != "fp32":
        formats = ["fp32"] + [f for f in formats if f != "fp32"]
    vocab = json.loads((base / "config.json").read_text())["vocab_size"]
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, vocab, args.prompt_len).tolist() for _ in range(args.num_prompts)]
    start = time.perf_counter()
    rows, ref = [], None
    for fmt in formats:
        n = args.max_tokens if fmt == "fp32" or fmt not in SLOW else min(args.slow_tokens, args.max_tokens)
        try:
            row = run_format(fmt, base, prompts, n, ref)
        except ValueError as e:  # a format this checkpoint's shapes do not allow (wint2 needs K % 64 == 0)
            print(f"  {fmt}: skipped: {e}")
            continue
        if ref is None:
            ref = row
        rows.append(row)
        print(f"  {fmt}: done ({time.perf_counter() - start:.0f} s so far)", flush=True)
    print_table(rows, args)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    keep = [{k: v for k, v in r.items() if k not in ("logits", "seqs", "tokens")} for r in rows]
    out.write_text(json.dumps({"checkpoint": str(base), "num_prompts": args.num_prompts, "prompt_len": args.prompt_len,
                               "teacher_forced_tokens": args.max_tokens, "results": keep,
                               "total_s": time.perf_counter() - start}, indent=2))
    print(f"wrote {out}")


def print_table(rows: list[dict], args) -> None:
    fp32 = rows[0]
    mib = 2 ** 20
    head = (f"{'format':<15}{'max|dlogit|':>12}{'mean|dlogit|':>13}{'top1 (forced)':>14}{'top5 ovl':>9}"
            f"{'greedy agree':>13}"
            f"{'1st diverge':>12}{'quant MiB':>10}{'(fp32)':>8}{'x':>6}{'model MiB':>10}{'x':>6}{'load s':>8}"
            f"{'tok/s':>8}{'vs fp32':>8}")
    print(f"\n{args.num_prompts} prompts x {args.prompt_len} tokens; logits teacher-forced over fp32's "
          f"{args.max_tokens} greedy tokens (fp32 logit std {rows[1].get('ref_logit_std', 0) if len(rows) > 1 else 0:.2f});"
          f" greedy agreement over the free-running tokens (n in the last column's note)")
    if fp32["repeat_last_token_seqs"]:
        print(f"NOTE: fp32 greedy just repeats the last prompt token in {fp32['repeat_last_token_seqs']} of "
              f"{args.num_prompts} sequences on this checkpoint, so top-1 / greedy agreement say little there; "
              f"top-5 overlap and the logit errors still do")
    print(head)
    for r in rows:
        q, qf = r["quantized_bytes"], r["quantized_fp32_bytes"]
        cells = [f"{r['format']:<15}"]
        if r is fp32:
            cells += [f"{'-':>12}{'-':>13}{'-':>14}{'-':>9}{'-':>13}{'-':>12}"]
        else:
            cells += [f"{r['max_logit_err']:>12.3f}{r['mean_logit_err']:>13.4f}{r['forced_top1_agree']:>14.3f}"
                      f"{r['forced_top5_overlap']:>9.3f}"
                      f"{r['greedy_agree']:>13.3f}{r['greedy_prefix']:>12.1f}"]
        cells += [f"{q / mib:>10.1f}{qf / mib:>8.1f}{(qf / q if q else 1):>6.2f}{r['total_bytes'] / mib:>10.1f}"
                  f"{fp32['total_bytes'] / r['total_bytes']:>6.2f}{r['load_s']:>8.1f}{r['decode_tok_s']:>8.1f}"
                  f"{r['decode_tok_s'] / fp32['decode_tok_s']:>8.2f}  n={r['free_tokens']}"]
        if r["quantize_write_s"]:
            cells.append(f" (+{r['quantize_write_s']:.0f} s to write the checkpoint)")
        print("".join(cells))


if __name__ == "__main__":
    main()
