#!/usr/bin/env python3
"""This checkout's CPU kernels against another git revision's, both loaded in one process and run in alternation.

    .venv/bin/python scripts/bench_kernels_ab.py --base HEAD~2                       # decode-sized GEMMs
    .venv/bin/python scripts/bench_kernels_ab.py --base HEAD~2 --attention                 # paged attention
    .venv/bin/python scripts/bench_kernels_ab.py --base HEAD~2 --prefill --bits 16         # prefill-sized GEMMs
    .venv/bin/python scripts/bench_kernels_ab.py --base HEAD~2 --workload mixed --dtype bfloat16 --rounds 4
    .venv/bin/python scripts/bench_kernels_ab.py --base HEAD~2 --workload uniform --dtype bfloat16 --quantization wint8

Why: this shared 2-core VM swings by up to 2x within minutes, so two runs one after the other do not rank two
kernel builds; alternating them in one process, on the same weights, does. The base revision's
backend/ernie_serve/cpu_kernels is built beside this one's (build.compile_library).

GEMMs (default): every routed expert of a MoE layer in one call (16 experts: SwiGLU up K1024 x N1408 and down
K704 x N1024, the benchmark checkpoint's shapes) at 1, 2, 4, 8 and 12 rows an expert, and a dense 1024 x 1536 layer
at 16 and 32 rows, per weight format (--bits 32,16,8,4: float32, bfloat16, int8, int4 codes); the weights are sized
past the L3 so each call streams them from memory, as a decode step does. Prints each build's weight GB/s (median
over the rounds), the median of the rounds' new / base (each round runs the two back to back), and whether the
outputs are bit-identical.

Attention (--attention): ernie_paged_attention from a float32 paged cache (8 heads, 2 KV heads, head_dim 128, blocks
of 16), or with --dtype bfloat16 a bfloat16 one in blocks of 64 (the engine's then), on prefill chunks, chunks on a
cached context and decodes; median times and the median of the rounds' ratios. --cold reads the cache from memory.

Prefill GEMMs (--prefill): compute-bound shapes, hundreds of rows an expert and thousands for a dense layer; G
multiply-adds a second of each build.

Engine (--workload): one LLM on the benchmark checkpoint (prefix caching off, so every round computes its
prefills), the library swapped between rounds, the order flipped every round; tok/s a round, the median ratio,
and whether the greedy tokens agree. --quantization wint8 / wint4 gives it weight-only int weights (with --dtype
bfloat16 the rest in bfloat16, as bench_cpu_dtypes.py's wint8-bf16).
"""
from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import ml_dtypes
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "backend"))
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "scripts" / "peers"))

from ernie_serve._env import setup_model_process  # noqa: E402

KERNELS = "backend/ernie_serve/cpu_kernels"


def build_revision(rev: str, into: Path) -> Path:
    """The C kernels of git revision `rev`, compiled for the host CPU into `into`."""
    from ernie_serve.cpu_kernels import build

    src = into / "src"
    src.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, KERNELS], check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", str(src), "--strip-components", str(KERNELS.count("/") + 1)],
                   input=archive.stdout, check=True)
    out = into / "base.so"
    build.compile_library(out, sorted(src.glob("*.c")))
    return out


def _alternating(libs: dict[str, ctypes.CDLL], rounds: int):
    """(round, build) in the order they run: both builds each round, which goes first flipped every round, so the
    box's drift hurts both alike."""
    for r in range(rounds):
        for name in (list(libs) if r % 2 == 0 else list(libs)[::-1]):
            yield r, name


def _weights(bits: int, k: int, n: int, count: int, rng: np.random.Generator):
    """`count` random [k, n] weights in the serving layout of `bits`, with their scales (None for floats)."""
    import paddle

    from ernie_serve.cpu_kernels import cpu_gemm
    from ernie_serve.quantization import formats

    if bits in (32, 16):
        return [cpu_gemm.packed((rng.standard_normal((k, n)) * 0.03).astype(np.float32), bits)
                for _ in range(count)], None
    quantized = [formats.quantize_weight_only(rng.standard_normal((k, n)).astype(np.float32), bits)
                 for _ in range(count)]
    return ([cpu_gemm.packed_codes(q, bits) for q, _ in quantized],
            [paddle.to_tensor(s) for _, s in quantized])


def gemms(libs: dict[str, ctypes.CDLL], bits_list: list[int], rounds: int) -> None:
    rng = np.random.default_rng(0)
    experts = 16
    print(f"{'format':8} {'GEMM':28} {'rows':>4}  " + "  ".join(f"{n:>15}" for n in libs) + "  new/base  same bits")
    for bits in bits_list:
        # float32 experts are 92 MB a layer: two layers' worth (the narrower formats more) exceed the L3 a small
        # VM's core pair gets (~100 MB), so each call streams its weights from memory as a decode step does
        layers = max(2, 64 // bits)
        for k, n, swiglu, dense in ((1024, 1408, 1, False), (704, 1024, 0, False), (1024, 1536, 0, True)):
            count = (16 if dense else experts) * layers
            ws, scales = _weights(bits, k, n, count, rng)
            w_ptrs = (ctypes.c_void_p * count)(*[w.data_ptr() for w in ws])
            s_ptrs = None if scales is None else (ctypes.c_void_p * count)(*[s.data_ptr() for s in scales])
            for per in ((16, 32) if dense else (1, 2, 4, 8, 12)):
                rows = np.full(experts, per, np.int64)
                starts = np.arange(experts, dtype=np.int64) * per
                x = rng.standard_normal((experts * per, k)).astype(np.float32)
                ys = {name: np.zeros((experts * per, n // 2 if swiglu else n), np.float32) for name in libs}
                spent: dict[str, list[float]] = {name: [] for name in libs}
                for _, name in _alternating(libs, rounds):
                    lib, y = libs[name], ys[name]
                    t = time.perf_counter()
                    for layer in range(layers):
                        if dense:  # one layer's weight after another, as a step reads them
                            for i in range(layer * 16, layer * 16 + 16):
                                lib.ernie_gemm(x.ctypes.data, per, k, w_ptrs[i], n,
                                               None if s_ptrs is None else s_ptrs[i], y.ctypes.data, bits, 0, 0)
                        else:
                            at = layer * experts
                            lib.ernie_moe_gemm(
                                x.ctypes.data, rows.ctypes.data, starts.ctypes.data, experts, k,
                                ctypes.cast(ctypes.byref(w_ptrs, at * ctypes.sizeof(ctypes.c_void_p)),
                                            ctypes.c_void_p), n,
                                None if s_ptrs is None else ctypes.cast(
                                    ctypes.byref(s_ptrs, at * ctypes.sizeof(ctypes.c_void_p)), ctypes.c_void_p),
                                y.ctypes.data, bits, swiglu, 0)
                    spent[name].append((time.perf_counter() - t) / layers)
                weight_bytes = (16 if dense else experts) * k * n * bits / 8
                what = f"dense {k}x{n}" if dense else f"{experts} experts {k}x{n}{' swiglu' if swiglu else ''}"
                ratio = statistics.median(b / n for b, n in zip(spent["base"], spent["new"]))
                print(f"{_FORMAT[bits]:8} {what:28} {per:4d}  "
                      + "  ".join(f"{weight_bytes / statistics.median(spent[nm]) / 1e9:9.1f} GB/s" for nm in libs)
                      + f"  {ratio:7.2f}x  {np.array_equal(ys['base'], ys['new'])}", flush=True)


_FORMAT = {32: "float32", 16: "bfloat16", 8: "int8", 4: "int4"}


def prefill_gemms(libs: dict[str, ctypes.CDLL], bits_list: list[int], rounds: int) -> None:
    """Prefill-sized GEMMs: one layer's 16 experts at 32, 200 and 800 rows each (a 16 x 200-token prefill routes
    ~800 rows to each, a step with one prompt's chunk a few dozen), and a dense 1024 x 1536 and SwiGLU 1024 x 1408
    (the shared expert) at 32, 800 and 3200 rows. G multiply-adds a second of each build, the median of the rounds'
    new / base, bit-identity."""
    rng = np.random.default_rng(0)
    experts, CALLS = 16, 6  # a call is a few ms: a round times several, back to back
    print(f"{'format':8} {'GEMM':28} {'rows':>5}  " + "  ".join(f"{n:>14}" for n in libs) + "  new/base  same bits")
    for bits in bits_list:
        for k, n, swiglu, dense in ((1024, 1408, 1, False), (704, 1024, 0, False), (1024, 1536, 0, True),
                                    (1024, 1408, 1, True)):
            ws, scales = _weights(bits, k, n, 1 if dense else experts, rng)
            w_ptrs = (ctypes.c_void_p * len(ws))(*[w.data_ptr() for w in ws])
            s_ptrs = None if scales is None else (ctypes.c_void_p * len(ws))(*[s.data_ptr() for s in scales])
            for per in ((32, 800, 3200) if dense else (32, 200, 800)):
                m = per if dense else experts * per
                rows = np.full(experts, per, np.int64)
                starts = np.arange(experts, dtype=np.int64) * per
                x = rng.standard_normal((m, k)).astype(np.float32)
                ys = {name: np.zeros((m, n // 2 if swiglu else n), np.float32) for name in libs}
                spent: dict[str, list[float]] = {name: [] for name in libs}
                for _, name in _alternating(libs, rounds):
                    lib, y = libs[name], ys[name]
                    t = time.perf_counter()
                    for _ in range(CALLS):
                        if dense:
                            lib.ernie_gemm(x.ctypes.data, m, k, w_ptrs[0], n,
                                           None if s_ptrs is None else s_ptrs[0], y.ctypes.data, bits, swiglu, 0)
                        else:
                            lib.ernie_moe_gemm(x.ctypes.data, rows.ctypes.data, starts.ctypes.data, experts, k,
                                               w_ptrs, n, s_ptrs, y.ctypes.data, bits, swiglu, 0)
                    spent[name].append((time.perf_counter() - t) / CALLS)
                what = (f"dense {k}x{n}" if dense else f"{experts} experts {k}x{n}") + (" swiglu" if swiglu else "")
                ratio = statistics.median(b / n for b, n in zip(spent["base"], spent["new"]))
                print(f"{_FORMAT[bits]:8} {what:28} {per:5d}  "
                      + "  ".join(f"{m * k * n / statistics.median(spent[nm]) / 1e9:8.0f} GMAC/s" for nm in libs)
                      + f"  {ratio:7.2f}x  {np.array_equal(ys['base'], ys['new'])}", flush=True)


def attention(libs: dict[str, ctypes.CDLL], rounds: int, kv_bf16: bool = False, cold: bool = False) -> None:
    """cold: a 256 MB pass before each call (untimed), so the cache comes from memory as in a step, where a layer's
    weights have streamed through the caches since the last layer read it."""
    rng = np.random.default_rng(0)
    flush = np.ones(32 << 20) if cold else None
    nh, nkv, hd, bs = 8, 2, 128, 64 if kv_bf16 else 16  # the engine's block size with --dtype bfloat16 is 64
    print(f"{'bfloat16' if kv_bf16 else 'float32'} cache, blocks of {bs}{', cold (from memory)' if cold else ''}")
    print(f"{'sequences x new tokens on context':36} " + "  ".join(f"{n:>10}" for n in libs) + "  new/base  same bits")
    for seqs, q_len, ctx in ((16, 200, 200), (4, 256, 256), (2, 100, 400), (16, 1, 300), (16, 1, 1000)):
        per = (ctx + bs - 1) // bs
        k_cache = rng.standard_normal((seqs * per, bs, nkv, hd)).astype(np.float32)
        v_cache = rng.standard_normal(k_cache.shape).astype(np.float32)
        if kv_bf16:  # bfloat16 bits, rounded to nearest even as the cache write does
            k_cache, v_cache = (np.asarray(c.astype(ml_dtypes.bfloat16)).view(np.uint16) for c in (k_cache, v_cache))
        tables = np.arange(seqs * per, dtype=np.int64).reshape(seqs, per)
        q = rng.standard_normal((seqs * q_len, nh, hd)).astype(np.float32)
        starts = np.arange(seqs + 1, dtype=np.int64) * q_len
        lens = np.full(seqs, ctx, np.int64)
        outs = {name: np.empty((seqs * q_len, nh * hd), np.float32) for name in libs}
        spent: dict[str, list[float]] = {name: [] for name in libs}
        for _, name in _alternating(libs, rounds):
            took = 0.0
            for _ in range(3):
                if cold:
                    flush.sum()
                t = time.perf_counter()
                libs[name].ernie_paged_attention(
                    q.ctypes.data, k_cache.ctypes.data, v_cache.ctypes.data, int(kv_bf16), tables.ctypes.data, per,
                    starts.ctypes.data, lens.ctypes.data, seqs, nh, nkv, hd, bs, hd ** -0.5, outs[name].ctypes.data)
                took += time.perf_counter() - t
            spent[name].append(took / 3)
        ratio = statistics.median(b / n for b, n in zip(spent["base"], spent["new"]))
        print(f"{f'{seqs} x {q_len} on {ctx}':36} " + "  ".join(f"{statistics.median(spent[n]) * 1e3:7.2f} ms"
                                                               for n in libs)
              + f"  {ratio:7.2f}x  {np.array_equal(outs['base'], outs['new'])}", flush=True)


def engine(libs: dict[str, ctypes.CDLL], workload: str, dtype: str, quantization: str | None, rounds: int,
           tmp: Path) -> None:
    import common
    from bench_offline import bench_checkpoint, write_workload

    from ernie_serve import LLM, SamplingParams
    from ernie_serve.cpu_kernels import build

    path = tmp / f"workload_{workload}.json"
    write_workload(path, workload, max_num_seqs=16)
    w = common.load_workload(path)
    llm = LLM(model=str(bench_checkpoint()), max_model_len=max(512, w.max_seq_len), max_num_seqs=w.max_num_seqs,
              skip_tokenizer_init=True, disable_progress_bar=True, dtype=dtype, quantization=quantization,
              enable_prefix_caching=False)
    params = [SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=w.ignore_eos) for r in w.requests]
    prompts = [r.prompt_token_ids for r in w.requests]
    rates: dict[str, list[float]] = {name: [] for name in libs}
    tokens: dict[str, list[list[int]]] = {}
    for r, name in _alternating(libs, rounds):
        build._lib = libs[name]
        t = time.perf_counter()
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        elapsed = time.perf_counter() - t
        tokens.setdefault(name, [list(o.outputs[0].token_ids) for o in outs])
        rates[name].append(sum(len(o.outputs[0].token_ids) for o in outs) / elapsed)
        print(f"round {r} {name:4}: {rates[name][-1]:7.1f} tok/s", flush=True)
    ratios = [n / b for b, n in zip(rates["base"], rates["new"])]
    what = f"{workload} {dtype}" + (f" {quantization}" if quantization else "")
    print(f"{what}: base median {statistics.median(rates['base']):.1f} tok/s, new median "
          f"{statistics.median(rates['new']):.1f}; new/base a round {[round(x, 3) for x in ratios]}, median "
          f"{statistics.median(ratios):.3f}; greedy tokens equal: {tokens['base'] == tokens['new']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, help="git revision whose kernels are the baseline")
    ap.add_argument("--bits", default="32,16,8,4", help="GEMM formats: 32 float32, 16 bfloat16, 8 / 4 int codes")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--attention", action="store_true", help="paged attention instead of the GEMMs")
    ap.add_argument("--cold", action="store_true", help="--attention: the cache read from memory, as in a step")
    ap.add_argument("--prefill", action="store_true", help="prefill-sized GEMMs (hundreds of rows) instead")
    ap.add_argument("--workload", choices=["mixed", "uniform"], help="run the engine instead of the GEMMs")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--quantization", choices=["wint8", "wint4"], help="--workload: weight-only int weights")
    args = ap.parse_args()
    if args.cold and not args.attention:
        ap.error("--cold times the attention's cache from memory: it needs --attention")
    if args.prefill and (args.attention or args.workload):
        ap.error("--prefill times the GEMMs: not with --attention or --workload")
    if args.quantization and not args.workload:
        ap.error("--quantization sets the engine's weights: it needs --workload (the GEMMs take --bits)")
    setup_model_process()
    from ernie_serve.cpu_kernels import build

    if build.library() is None:
        raise SystemExit("the CPU kernels are not built on this machine (no C compiler?)")
    with tempfile.TemporaryDirectory() as tmp:
        libs = {"base": build.load(build_revision(args.base, Path(tmp)), partial=True), "new": build.library()}
        for lib in libs.values():
            lib.ernie_set_num_threads(build.threads())
        print(f"base: {args.base} ({subprocess.run(['git', '-C', str(ROOT), 'rev-parse', '--short', args.base], capture_output=True, text=True).stdout.strip()}), "
              f"new: this checkout; {build.threads()} threads, {args.rounds} rounds alternating", flush=True)
        if args.workload:
            engine(libs, args.workload, args.dtype, args.quantization, args.rounds, Path(tmp))
        elif args.attention:
            attention(libs, args.rounds, args.dtype == "bfloat16", args.cold)
        else:
            (prefill_gemms if args.prefill else gemms)(libs, [int(b) for b in args.bits.split(",")], args.rounds)


if __name__ == "__main__":
    main()
