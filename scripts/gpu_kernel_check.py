"""Check and time the ernie_kernels on one H100/H200 (torch + triton + numpy + ml_dtypes; no Paddle).

For each kernel: correctness against its NumPy reference on small shapes (the compiled kernel, bf16
dots), then do_bench timing on serving-sized shapes against a torch bf16 equivalent and against the
HBM roofline (bytes moved / peak bandwidth: 4.8 TB/s H200, 3.35 TB/s H100). Prints a table and writes
JSON to $OUT (or ./out). `--cpu-smoke` runs only the correctness part, tiny shapes, under
TRITON_INTERPRET=1 on CPU, to check the script itself.

    python scripts/gpu_kernel_check.py            # GPU, a few minutes
    python scripts/gpu_kernel_check.py --cpu-smoke
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SMOKE = "--cpu-smoke" in sys.argv
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
sys.path.insert(0, str(ROOT / "kernels"))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from ernie_kernels import fused_moe, rms_norm, weight_only_linear  # noqa: E402
from ernie_kernels.unified_attention import (attention_programs, kv_splits, queries_per_program,  # noqa: E402
                                             unified_attention)
from ernie_kernels import reference as ref  # noqa: E402


def _load_formats():
    """formats.py by path: the engine package's __init__ may pull in Paddle, which a torch-only GPU host lacks."""
    spec = importlib.util.spec_from_file_location("ernie_formats", ROOT / "backend/ernie_serve/quantization/formats.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


F = _load_formats()
DEV = "cpu" if SMOKE else "cuda"
ACT = torch.float32 if SMOKE else torch.bfloat16
RESULTS: list[dict] = []


def t(a: np.ndarray, fp8: bool = False, act: bool = False) -> torch.Tensor:
    x = torch.from_numpy(np.ascontiguousarray(a)).to(DEV)
    if fp8:
        return x.view(torch.float8_e4m3fn)
    return x.to(ACT) if act else x


def rel_err(y: torch.Tensor, expect: np.ndarray) -> float:
    y = y.float().cpu().numpy()
    return float(np.linalg.norm(y - expect) / max(np.linalg.norm(expect), 1e-30))


def check(name: str, y: torch.Tensor, expect: np.ndarray, tol: float) -> None:
    err = rel_err(y, expect)
    RESULTS.append({"kind": "correctness", "case": name, "rel_err": err, "tol": tol, "ok": err <= tol})
    print(f"  {'ok ' if err <= tol else 'BAD'} {name:40s} rel_err {err:.2e} (tol {tol:.0e})", flush=True)


def bench(name: str, fn, torch_fn, nbytes: float, bw: float) -> None:
    from triton.testing import do_bench

    ms = do_bench(fn, warmup=10, rep=50)
    ms_t = do_bench(torch_fn, warmup=10, rep=50) if torch_fn is not None else float("nan")
    roof = nbytes / bw * 1e3
    RESULTS.append({"kind": "timing", "case": name, "triton_ms": ms, "torch_bf16_ms": ms_t, "roofline_ms": roof,
                    "bytes": nbytes, "frac_of_roofline": roof / ms})
    print(f"  {name:40s} triton {ms * 1e3:9.1f} us  torch {ms_t * 1e3:9.1f} us  roofline {roof * 1e3:8.1f} us "
          f"({roof / ms:5.1%})", flush=True)


# ------------------------------------------------------------------ correctness (small shapes)

def correctness() -> None:
    rng = np.random.default_rng(0)
    tol = 1e-4 if SMOKE else 2e-2  # fp32 in the interpreter; bf16 operands on GPU
    print("correctness", flush=True)
    x = rng.standard_normal((8, 256)).astype(np.float32)
    r = rng.standard_normal((8, 256)).astype(np.float32)
    w = rng.standard_normal(256).astype(np.float32)
    y, _ = rms_norm(t(x, act=True), t(w), 1e-5, residual=t(r, act=True))
    check("rms_norm+residual", y, ref.rms_norm(x, w, 1e-5, r)[0], tol)

    wt = rng.standard_normal((256, 192)).astype(np.float32)
    for method in ("wint8", "wint4", "block_wise_fp8"):
        fp8 = method == "block_wise_fp8"
        q, s = F.quantize_block_fp8(wt) if fp8 else F.quantize_weight_only(wt, 8 if method == "wint8" else 4)
        check(f"weight_only_linear {method}", weight_only_linear(t(x, act=True), t(q, fp8=fp8), t(s), method),
              ref.weight_only_linear(x, q, s, method), tol if not fp8 else max(tol, 2e-3))

    e, h, i, tok, k = 8, 256, 128, 12, 2
    xm = rng.standard_normal((tok, h)).astype(np.float32)
    ug = (rng.standard_normal((e, h, 2 * i)) * 0.1).astype(np.float32)
    dn = (rng.standard_normal((e, i, h)) * 0.1).astype(np.float32)
    ids = np.stack([rng.permutation(e)[:k] for _ in range(tok)]).astype(np.int64)
    wts = rng.random((tok, k)).astype(np.float32)
    for method in (None, "wint8", "wint4", "w4a8", "block_wise_fp8"):
        args, a1, a2 = _moe_weights(ug, dn, method, xm)
        y = fused_moe(t(xm, act=True), *args[:2], t(ids), t(wts), method, *args[2:],
                      *(None if a is None else t(a) for a in (a1, a2)))
        raw = [a.cpu().view(torch.uint8).numpy() if a.dtype == torch.float8_e4m3fn else a.cpu().numpy()
               for a in args]
        expect = ref.fused_moe(xm, raw[0], raw[1], ids, wts, method, *(raw[2:] or [None, None]), a1, a2)
        # activation-quantizing methods see bf16-rounded inputs quantized on GPU: a few code flips
        check(f"fused_moe {method}", y, expect, tol * (3 if method in ("w4a8", "block_wise_fp8") else 1))

    # one mixed step: a decode, a 3-token verification, a prefill chunk over cached blocks, a fresh prefill
    hq, kvh, d, page = 8, 2, 64, 16
    q_lens, lens = np.array([1, 3, 20, 9]), np.array([5, 40, 36, 9], np.int32)
    need = -(-lens // page)
    nblk = int(need.sum()) + 2
    order = rng.permutation(nblk)
    tables = np.zeros((4, int(need.max())), np.int32)
    for i, (a, n) in enumerate(zip(np.concatenate([[0], np.cumsum(need)[:-1]]), need)):
        tables[i, :n] = order[a:a + n]
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    q = rng.standard_normal((int(qsl[-1]), hq, d)).astype(np.float32)
    kc = rng.standard_normal((nblk, page, kvh, d)).astype(np.float32)
    vc = rng.standard_normal((nblk, page, kvh, d)).astype(np.float32)
    ks, vs = F.calibrate_kv_scale(kc), F.calibrate_kv_scale(vc)
    k8, v8 = F.quantize_kv_static(kc, ks), F.quantize_kv_static(vc, vs)
    for name, kk, vv, sk, sv in (("bf16", t(kc, act=True), t(vc, act=True), None, None),
                                 ("int8 C8", t(k8), t(v8), t(ks), t(vs))):
        expect = ref.unified_attention(q, k8 if sk is not None else kc, v8 if sv is not None else vc, tables, lens,
                                       qsl, d ** -0.5, ks if sk is not None else None, vs if sv is not None else None)
        for splits in (1, 4):
            out = attention(t(q, act=True), kk, vv, tables, lens, qsl, sk, sv, num_splits=splits)
            check(f"unified_attention mixed step {name}" + (f" split-KV {splits}" if splits > 1 else ""), out,
                  expect, tol)


def attention(q, k_cache, v_cache, tables: np.ndarray, lens: np.ndarray, qsl: np.ndarray, k_scale=None,
              v_scale=None, num_splits: int = 1):
    """unified_attention with its per-step index data built as the engine builds it."""
    block_q = queries_per_program(q.shape[1] // k_cache.shape[2], int(np.diff(qsl).max()))
    seq, q0 = attention_programs(qsl, block_q)
    out = torch.empty_like(q)
    return unified_attention(q, k_cache, v_cache, out, t(tables), t(lens), t(qsl), t(seq), t(q0), block_q,
                             q.shape[2] ** -0.5, k_scale, v_scale, num_splits=num_splits)


def _moe_weights(ug: np.ndarray, dn: np.ndarray, method, calib_x: np.ndarray):
    """Device tensors (up_gate, down[, up_gate_scale, down_scale]) and w4a8 activation scales."""
    if method is None:
        return [t(ug, act=True), t(dn, act=True)], None, None
    if method == "block_wise_fp8":
        (q1, s1), (q2, s2) = F.quantize_block_fp8(ug), F.quantize_block_fp8(dn)
        return [t(q1, fp8=True), t(q2, fp8=True), t(s1), t(s2)], None, None
    (q1, s1), (q2, s2) = (F.quantize_weight_only(w, 8 if method == "wint8" else 4) for w in (ug, dn))
    a1 = a2 = None
    if method == "w4a8":
        e = ug.shape[0]
        a1 = np.full(e, F.calibrate_activation_scale(calib_x), np.float32)
        a2 = np.full(e, 0.02, np.float32)
    return [t(q1), t(q2), t(s1), t(s2)], a1, a2


# ------------------------------------------------------------------ timing (serving shapes)

def timing(bw: float) -> None:
    rng = np.random.default_rng(1)
    print("timing", flush=True)
    tok, h = 4096, 8192
    x, r = (torch.randn(tok, h, device=DEV, dtype=ACT) for _ in range(2))
    w = torch.ones(h, device=DEV, dtype=ACT)

    def torch_rms():
        s = (x.float() + r.float())
        return (s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-5) * w.float()).to(ACT), s.to(ACT)
    bench("rms_norm+residual 4096x8192", lambda: rms_norm(x, w, 1e-5, residual=r), torch_rms, 4 * tok * h * 2, bw)

    m, k, n = 16, 8192, 8192
    xa = torch.randn(m, k, device=DEV, dtype=ACT)
    wb = torch.randn(k, n, device=DEV, dtype=ACT) * 0.02
    for method, bits in (("wint8", 8), ("wint4", 4), ("block_wise_fp8", 8)):
        fp8 = method == "block_wise_fp8"
        wnp = wb.float().cpu().numpy()
        q, s = F.quantize_block_fp8(wnp) if fp8 else F.quantize_weight_only(wnp, bits)
        qd, sd = t(q, fp8=fp8), t(s)
        bench(f"weight_only_linear {method} {m}x{k}x{n}", lambda: weight_only_linear(xa, qd, sd, method),
              lambda: xa @ wb, k * n * bits / 8 + 4 * s.size + 2 * m * (k + n), bw)

    # ERNIE-4.5-21B-A3B MoE layer: 64 experts, top-6, hidden 2560, moe_intermediate 1536
    e, h, i, k6 = 64, 2560, 1536, 6
    ug = (rng.standard_normal((e, h, 2 * i), dtype=np.float32) * 0.02)
    dn = (rng.standard_normal((e, i, h), dtype=np.float32) * 0.02)
    ug_t, dn_t = t(ug, act=True), t(dn, act=True)
    calib = rng.standard_normal((64, h), dtype=np.float32)
    methods = {m: _moe_weights(ug, dn, m, calib) for m in (None, "wint8", "wint4", "w4a8", "block_wise_fp8")}
    del ug, dn
    for tok in (16, 256):
        xm = torch.randn(tok, h, device=DEV, dtype=ACT)
        ids_np = np.stack([rng.permutation(e)[:k6] for _ in range(tok)]).astype(np.int64)
        ids = t(ids_np)
        wts = torch.rand(tok, k6, device=DEV, dtype=torch.float32)
        active = len(np.unique(ids_np))

        def torch_moe():  # grouped bf16 reference: one matmul pair per active expert
            out = torch.zeros_like(xm)
            flat = ids.reshape(-1)
            for ex in torch.unique(flat).tolist():
                slot = (flat == ex).nonzero().squeeze(1)
                hh = xm[slot // k6] @ ug_t[ex]
                a = torch.nn.functional.silu(hh[:, :i]) * hh[:, i:]
                out.index_add_(0, slot // k6, (a @ dn_t[ex]) * wts.reshape(-1)[slot, None].to(ACT))
            return out
        for method, bpp in ((None, 2), ("wint8", 1), ("wint4", 0.5), ("w4a8", 0.5), ("block_wise_fp8", 1)):
            args, a1, a2 = methods[method]
            extra = [None if a is None else t(a) for a in (a1, a2)]
            fn = lambda: fused_moe(xm, args[0], args[1], ids, wts, method, *args[2:], *extra)  # noqa: E731
            nbytes = active * 3 * h * i * bpp + tok * h * 2 * 2
            bench(f"fused_moe {method or 'bf16'} T={tok} ({active} experts)", fn,
                  torch_moe if method is None else None, nbytes, bw)

    # decode attention, 21B-A3B heads: 20 q heads, 4 kv heads, head_dim 128; 64 seqs x 2048 tokens
    b, hq, kvh, d, page, seq = 64, 20, 4, 128, 64, 2048
    nblk = b * seq // page
    q = torch.randn(b, hq, d, device=DEV, dtype=ACT)
    kc = torch.randn(nblk, page, kvh, d, device=DEV, dtype=ACT)
    vc = torch.randn(nblk, page, kvh, d, device=DEV, dtype=ACT)
    tables_np = rng.permutation(nblk).astype(np.int32).reshape(b, -1)
    lens_np = np.full(b, seq, np.int32)
    qsl_np = np.arange(b + 1, dtype=np.int32)
    tables = t(tables_np)
    kd = kc[tables.long()].reshape(b, -1, kvh, d).transpose(1, 2).contiguous()  # pre-gathered: torch best case
    vd = vc[tables.long()].reshape(b, -1, kvh, d).transpose(1, 2).contiguous()

    def torch_attn():
        return torch.nn.functional.scaled_dot_product_attention(q[:, :, None, :], kd, vd, enable_gqa=True)
    block_q = queries_per_program(hq // kvh, 1)
    seqs, q0 = (t(a) for a in attention_programs(qsl_np, block_q))
    lens, qsl, out = t(lens_np), t(qsl_np), torch.empty_like(q)  # the step's index data, built once

    def ours(k_cache, v_cache, k_scale=None, v_scale=None):
        return unified_attention(q, k_cache, v_cache, out, tables, lens, qsl, seqs, q0, block_q, d ** -0.5,
                                 k_scale, v_scale)
    bench(f"unified_attention decode bf16 B={b} S={seq}", lambda: ours(kc, vc), torch_attn,
          2 * b * seq * kvh * d * 2, bw)
    k8 = torch.randint(-127, 128, kc.shape, device=DEV, dtype=torch.int8)
    v8 = torch.randint(-127, 128, vc.shape, device=DEV, dtype=torch.int8)
    sc = torch.ones(kvh * d, device=DEV, dtype=torch.float32)
    bench(f"unified_attention decode int8 C8 B={b} S={seq}", lambda: ours(k8, v8, sc, sc), None,
          2 * b * seq * kvh * d, bw)

    # split KV: a small batch over long contexts, unsplit and as the engine splits it (2 programs per SM)
    b, seq = 4, 32768
    nblk = b * seq // page
    q = torch.randn(b, hq, d, device=DEV, dtype=ACT)
    kc = torch.randn(nblk, page, kvh, d, device=DEV, dtype=ACT)
    vc = torch.randn(nblk, page, kvh, d, device=DEV, dtype=ACT)
    tables = t(rng.permutation(nblk).astype(np.int32).reshape(b, -1))
    lens, qsl, out = t(np.full(b, seq, np.int32)), t(np.arange(b + 1, dtype=np.int32)), torch.empty_like(q)
    seqs, q0 = (t(a) for a in attention_programs(np.arange(b + 1), block_q))
    splits = kv_splits(int(seqs.shape[0]), kvh, seq, 2 * torch.cuda.get_device_properties(0).multi_processor_count)
    for n in sorted({1, splits}):
        bench(f"unified_attention decode bf16 B={b} S={seq} splits={n}",
              lambda n=n: unified_attention(q, kc, vc, out, tables, lens, qsl, seqs, q0, block_q, d ** -0.5,
                                            num_splits=n), None, 2 * b * seq * kvh * d * 2, bw)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cpu-smoke", action="store_true", help="correctness only, tiny shapes, TRITON_INTERPRET=1")
    p.add_argument("--out", default=os.environ.get("OUT", "out"), help="directory for gpu_kernel_check.json")
    args = p.parse_args()
    start = time.time()
    device = "cpu (interpreter)" if SMOKE else torch.cuda.get_device_name()
    bw = 4.8e12 if "H200" in device else 3.35e12
    print(f"device: {device}; roofline bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    correctness()
    if not SMOKE:
        timing(bw)
    ok = all(r["ok"] for r in RESULTS if r["kind"] == "correctness")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_kernel_check.json").write_text(json.dumps(
        {"device": device, "bandwidth_Bps": bw, "all_correct": ok, "seconds": time.time() - start,
         "results": RESULTS}, indent=1))
    print(f"{'all correct' if ok else 'SOME KERNELS WRONG'}; wrote {out / 'gpu_kernel_check.json'} "
          f"in {time.time() - start:.0f}s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
