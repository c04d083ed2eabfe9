#!/usr/bin/env python
"""GPU readiness without a GPU: compile every kernel launch the kernels backend makes, for the seeds' GPUs, on the
real ERNIE-4.5 shapes, and check shared memory, registers and spills.

How. The kernels backend's own forward (kernels_backend/model.py: KernelModel over StepBuffers and a DeviceKVCache)
runs on CPU torch tensors whose weights are torch.empty (nothing is computed: dense float matmuls return empty
results) while triton's JIT is pointed at a stand-in driver whose target is the architecture under test. Every
kernel launch then compiles for that target, with the specialization the JIT's own binder picks from the real
arguments (dtypes, 16-byte divisibility, constexprs such as tile sizes derived from the shapes), exactly as it
would on that GPU, and returns without launching. Shared memory is triton's metadata; registers and spills come
from ptxas -v (triton's bundled ptxas) on the kernel's PTX.

Cases: the models' per-rank shapes (21B-A3B at TP1 / TP2, 300B-A47B at TP2 / TP4 / TP8, EP included, the dense
0.3B), prefill (512 tokens) and decode (64 and 1 sequences at 2k context, split-KV attention) batches, bf16
activations and every weight format the seeds deploy (bf16, wint8, wint4, wint2, W4A8, block_wise_fp8 on sm_89 /
sm_90 only), float and C8 KV caches (static and dynamic scales). Two layers a model (one dense, one MoE): every
layer of a kind launches the same kernels.

    .venv/bin/python scripts/gpu_aot_check.py --json out/gpu_aot.json            # all cases, sm_80 / sm_89 / sm_90
    .venv/bin/python scripts/gpu_aot_check.py --archs 90 --cases "300B-A47B tp8 wint8"

Exits non-zero on any compile error, shared memory over the architecture's per-block limit, spills in a hot
kernel (attention, the MoE and weight-only GEMMs: a step's time), or a TF32 MMA in a kernel that promises IEEE fp32
(the router's logits).
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
for sub in ("backend", "kernels"):
    sys.path.insert(0, str(ROOT / sub))

import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime.driver import driver  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402
from tqdm import tqdm  # noqa: E402

from ernie_serve.kernels_backend.framework import TorchOps, dtype_name  # noqa: E402
from ernie_serve.kernels_backend.kv_cache import DeviceKVCache  # noqa: E402
from ernie_serve.kernels_backend.model import KernelModel  # noqa: E402
from ernie_serve.kernels_backend.step_buffers import StepBuffers  # noqa: E402
from ernie_serve.kernels_backend.weights import (DeviceExperts, DeviceLayer, DeviceLinear, DeviceWeights,  # noqa: E402
                                                 WINT2_SCALES, scale_key)
from ernie_serve.model.config import ErnieModelConfig  # noqa: E402
from ernie_serve.model.parallel import ParallelLayout  # noqa: E402
from ernie_serve.quantization import formats as fmt  # noqa: E402
from ernie_serve.quantization.plan import QuantPlan  # noqa: E402
from ernie_serve.step_contract import StepInput  # noqa: E402

# ../shared/reference/ernie45-model.md; two layers (one dense, one MoE) of each
MODELS = {
    "0.3B": dict(architectures=["Ernie4_5ForCausalLM"], vocab_size=103424, hidden_size=1024, num_hidden_layers=1,
                 num_attention_heads=16, num_key_value_heads=2, head_dim=128, intermediate_size=3072,
                 tie_word_embeddings=True),
    "21B-A3B": dict(architectures=["Ernie4_5_MoeForCausalLM"], vocab_size=103424, hidden_size=2560,
                    num_hidden_layers=2, num_attention_heads=20, num_key_value_heads=4, head_dim=128,
                    intermediate_size=12288, moe_intermediate_size=1536, moe_num_experts=64, moe_k=6,
                    moe_num_shared_experts=2, moe_layer_start_index=1, moe_layer_end_index=1,
                    tie_word_embeddings=True),
    "300B-A47B": dict(architectures=["Ernie4_5_MoeForCausalLM"], vocab_size=103424, hidden_size=8192,
                      num_hidden_layers=2, num_attention_heads=64, num_key_value_heads=8, head_dim=128,
                      intermediate_size=28672, moe_intermediate_size=3584, moe_num_experts=64, moe_k=8,
                      moe_num_shared_experts=0, moe_layer_start_index=1, moe_layer_end_index=1,
                      tie_word_embeddings=False),
}
# (model, tensor-parallel size, expert parallel, --quantization, KV cache: None | "c8-static" | "c8-dynamic")
CASES = [
    ("0.3B", 1, False, None, None),
    ("21B-A3B", 1, False, None, None),
    ("21B-A3B", 1, False, "wint8", None),
    ("21B-A3B", 1, False, "wint4", "c8-dynamic"),
    ("21B-A3B", 1, False, "block_wise_fp8", None),
    ("21B-A3B", 2, False, "wint4", None),  # A30 pairs
    ("300B-A47B", 8, False, "wint8", None),
    ("300B-A47B", 4, False, "wint4", None),
    ("300B-A47B", 4, False, "w4a8", "c8-static"),  # the W4A8C8-TP4 checkpoint
    ("300B-A47B", 4, True, "w4a8", "c8-static"),
    ("300B-A47B", 2, False, "wint2", None),
    ("300B-A47B", 4, False, "block_wise_fp8", None),
]
ARCHS = {80: ("A800 / A30", 108, 163 * 1024), 89: ("L20", 92, 99 * 1024), 90: ("H800 / H20 / H200", 132, 227 * 1024)}
FP8_MIN_ARCH = 89
HOT = ("_unified_attention_kernel", "_fused_moe_kernel", "_wo_gemm_kernel")  # a step's time: spills there matter
IEEE_FP32 = ("_router_logits_kernel",)  # fp32 dots that must not round their inputs to TF32
BLOCK_SIZE = 64  # FastDeploy's default
BATCHES = {"prefill512": [(256, 0), (256, 0)], "decode64": [(1, 2047)] * 64, "decode1": [(1, 2047)]}


class _Target:
    """The stand-in driver: only what the JIT asks before compiling (no device, no launch)."""

    def __init__(self, arch: int):
        self.arch = arch

    def get_current_target(self) -> GPUTarget:
        return GPUTarget("cuda", self.arch, 32)

    def get_current_device(self) -> int:
        return self.arch  # one JIT cache per architecture

    def get_current_stream(self, device: Any = None) -> int:
        return 0


class AotOps(TorchOps):
    """torch on the CPU as the kernels backend sees a GPU: bf16 activations, the GPU's SM count (split-KV attention
    sizes itself on it), and dense float matmuls that only shape their results (cuBLAS's, not ours to check)."""

    act_dtype = "bfloat16"

    def __init__(self, sms: int):
        super().__init__()
        self.sms = sms

    def multiprocessor_count(self) -> int:
        return self.sms

    def matmul(self, x, w):
        return self.empty([x.shape[0], w.shape[1]], dtype_name(x))

    def matmul_nt(self, x, w):
        return self.empty([x.shape[0], w.shape[0]], dtype_name(x))


# ---------------------------------------------------------------- weights of the right shapes, uninitialized
_SAMPLE_K, _SAMPLE_N = 256, 384


@functools.cache
def _quant_layout(method: str) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """A method's tensors as the kernels read them, for a [256, 384] sample (scaled to any [K, N] by _shape)."""
    w = np.random.default_rng(0).standard_normal((_SAMPLE_K, _SAMPLE_N)).astype(np.float32)
    calib = {"activation_scale": 1.0} if method == "w4a8" else {}
    t = fmt.normalize_quantized(method, fmt.quantize_float(w, method, **calib), _SAMPLE_K, _SAMPLE_N)
    return {k: (v.shape, v.dtype) for k, v in t.items()}


def _shape(sample: tuple[int, ...], k: int, n: int) -> list[int]:
    """A sample tensor's shape for [K, N]: the leading dim follows K, the last N (a [1] stays [1])."""
    if len(sample) == 1:
        return [1] if sample[0] == 1 else [math.ceil(n * sample[0] / _SAMPLE_N)]
    return [math.ceil(k * sample[0] / _SAMPLE_K), math.ceil(n * sample[1] / _SAMPLE_N)]


def _empty(ops: AotOps, shape: list[int], dtype: np.dtype) -> torch.Tensor:
    name = "float8_e4m3fn" if dtype == ml_dtypes.float8_e4m3fn else np.dtype(dtype).name
    return ops.empty(shape, name)


def _quant_tensors(ops: AotOps, method: str, k: int, n: int, lead: list[int]) -> dict[str, torch.Tensor]:
    return {key: _empty(ops, lead + _shape(shape, k, n), dtype) for key, (shape, dtype) in _quant_layout(method).items()}


def _linear(ops: AotOps, k: int, n: int, method: str | None) -> DeviceLinear:
    if method is None:
        return DeviceLinear(k, n, None, ops.empty([k, n], ops.act_dtype))
    t = _quant_tensors(ops, method, k, n, [])
    return DeviceLinear(k, n, method, t["quant_weight"], t[scale_key(method)])


def _experts(ops: AotOps, e: int, h: int, inter: int, method: str | None) -> DeviceExperts:
    if method is None:
        return DeviceExperts(None, ops.empty([e, h, 2 * inter], ops.act_dtype), ops.empty([e, inter, h], ops.act_dtype))
    ug, dn = _quant_tensors(ops, method, h, 2 * inter, [e]), _quant_tensors(ops, method, inter, h, [e])

    def scales(t):
        return {k: t[k] for k in WINT2_SCALES} if method == "wint2" else t[scale_key(method)]
    act = {}
    if method == "w4a8":
        act = dict(up_gate_act_scale=ug["activation_scale"].reshape(-1), down_act_scale=dn["activation_scale"].reshape(-1))
    return DeviceExperts(method, ug["quant_weight"], dn["quant_weight"], scales(ug), scales(dn), **act)


def empty_weights(cfg: ErnieModelConfig, plan: QuantPlan | None, layout: ParallelLayout, ops: AotOps) -> DeviceWeights:
    """DeviceWeights with the shapes, dtypes and formats weights.load_device_weights gives a rank, uninitialized."""
    h, hd, n = cfg.hidden_size, cfg.head_dim, layout.world_size
    dense = plan.dense if plan else None
    q, kv = len(layout.query_heads(cfg)) * hd, len(layout.kv_heads(cfg)) * hd
    layers = []
    for i in range(cfg.num_hidden_layers):
        moe = cfg.is_moe_layer(i)
        layer = DeviceLayer(ops.empty([h], "float32"), ops.empty([h], "float32"), _linear(ops, h, q + 2 * kv, dense),
                            _linear(ops, q, h, dense))
        inter = (cfg.moe_intermediate_size * cfg.moe_num_shared_experts if moe else cfg.intermediate_size) // n
        if inter:
            layer.mlp_up_gate, layer.mlp_down = _linear(ops, h, 2 * inter, dense), _linear(ops, inter, h, dense)
        if moe:
            e = cfg.moe_num_experts
            layer.gate, layer.gate_bias = ops.empty([h, e], "float32"), ops.empty([e], "float32")
            layer.experts = _experts(ops, len(layout.experts(cfg)), h, layout.expert_intermediate(cfg),
                                     plan.moe_method(i) if plan else None)
        layers.append(layer)
    vocab = len(layout.split(cfg.vocab_size))
    lm_head = None if cfg.tie_word_embeddings else ops.empty([h, vocab], ops.act_dtype)
    return DeviceWeights(ops.empty([vocab, h], ops.act_dtype), ops.empty([h], "float32"), lm_head, layers,
                         vocab_start=layout.split(cfg.vocab_size).start)


def _step(batch: list[tuple[int, int]]) -> StepInput:
    """Sequences of (new tokens, tokens already cached), each in its own consecutive blocks."""
    ids, pos, slots, tables, lens, start = [], [], [], [], [], 0
    for new, cached in batch:
        total = cached + new
        nb = -(-total // BLOCK_SIZE)
        blocks = np.arange(start, start + nb)
        start += nb
        p = np.arange(cached, total)
        ids.append(np.full(new, 5))
        pos.append(p)
        slots.append(blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE)
        tables.append(blocks)
        lens.append(total)
    table = np.zeros((len(batch), max(len(t) for t in tables)), np.int64)
    for i, t in enumerate(tables):
        table[i, : len(t)] = t
    q = [new for new, _ in batch]
    cat = np.concatenate
    return StepInput(token_ids=cat(ids).astype(np.int64), positions=cat(pos).astype(np.int64),
                     query_start_loc=np.concatenate([[0], np.cumsum(q)]).astype(np.int64),
                     seq_lens=np.asarray(lens, np.int64), block_tables=table, slot_mapping=cat(slots).astype(np.int64),
                     sample_rows=(np.cumsum(q) - 1).astype(np.int64), num_decodes=sum(n == 1 for n in q),
                     max_position=max(lens) - 1)


# ---------------------------------------------------------------- compile and inspect
@dataclass
class Launch:
    name: str
    kernel: Any = None  # triton's CompiledKernel
    error: str | None = None


class Recorder:
    """While active, every JIT launch compiles for the stand-in target and is recorded instead of launched."""

    def __init__(self):
        self.launches: list[Launch] = []
        self._run = JITFunction.run

    def __enter__(self) -> "Recorder":
        run = self._run

        def compile_only(jit, *args, grid, warmup, **kwargs):
            try:
                self.launches.append(Launch(jit.fn.__name__, run(jit, *args, grid=grid, warmup=True, **kwargs)))
            except Exception as e:  # noqa: BLE001 - a compile error is this check's finding
                self.launches.append(Launch(jit.fn.__name__, error=f"{type(e).__name__}: {str(e)[:400]}"))
            return None

        JITFunction.run = compile_only
        return self

    def __exit__(self, *exc) -> None:
        JITFunction.run = self._run


_PTXAS = Path(triton.__file__).parent / "backends/nvidia/bin/ptxas"
_REGS = re.compile(r"Used (\d+) registers")
_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
_ptxas_cache: dict[str, tuple[int | None, int | None]] = {}


def ptxas_usage(kernel: Any, arch: int) -> tuple[int | None, int | None]:
    """(registers, spilled bytes) of a compiled kernel, from ptxas -v on its PTX."""
    key = kernel.hash
    if key not in _ptxas_cache:
        gpu = f"sm_{arch}a" if arch == 90 else f"sm_{arch}"
        with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
            f.write(kernel.asm["ptx"])
            f.flush()
            out = subprocess.run([str(_PTXAS), "-v", f"--gpu-name={gpu}", f.name, "-o", "/dev/null"],
                                 capture_output=True, text=True)
        text = out.stdout + out.stderr
        regs, spills = _REGS.search(text), _SPILLS.search(text)
        _ptxas_cache[key] = (int(regs.group(1)) if regs else None,
                             int(spills.group(1)) + int(spills.group(2)) if spills else None)
    return _ptxas_cache[key]


def run_case(model: str, tp: int, ep: bool, quant: str | None, kv: str | None, arch: int) -> list[Launch]:
    """Every launch of the case's forwards (each batch), compiled for `arch`."""
    cfg = ErnieModelConfig.from_dict(MODELS[model])
    _, sms, _ = ARCHS[arch]
    ops = AotOps(sms)
    layout = ParallelLayout(0, tp, ep)
    layout.check(cfg)
    plan = QuantPlan.resolve(quant, None)
    weights = empty_weights(cfg, plan if plan and plan.quantizes_weights else None, layout, ops)
    kv_heads = len(layout.kv_heads(cfg))
    static = None
    if kv == "c8-static":
        static = tuple([ops.empty([kv_heads * cfg.head_dim], "float32") for _ in range(cfg.num_hidden_layers)]
                       for _ in range(2))
    weights.kv_scales = static
    model_obj = KernelModel(cfg, weights, ops, len(layout.split(cfg.vocab_size)), 4096, layout)
    num_blocks = sum(-(-(c + n) // BLOCK_SIZE) for c, n in BATCHES["decode64"]) + 8
    cache = DeviceKVCache(ops, cfg.num_hidden_layers, num_blocks, BLOCK_SIZE, kv_heads, cfg.head_dim,
                          int8=kv is not None, static_scales=static)
    buffers = StepBuffers(ops, 512, 64, 4096 // BLOCK_SIZE, model_obj.num_heads // model_obj.num_kv_heads,
                          cache.dynamic is not None, kv_heads, split_kv_target=2 * sms)
    driver.set_active(_Target(arch))
    try:
        with Recorder() as rec:
            for batch in BATCHES.values():
                st = buffers.fill(_step(batch), BLOCK_SIZE)
                hidden = model_obj.forward(st, cache)
                model_obj.compute_logits(ops.rows(hidden, st.logit_rows))
    finally:
        _reset_driver()
    return rec.launches


def _reset_driver() -> None:
    """Back to triton's own (lazily made) driver; triton 3.6's reset_active would make it now, and fail without a
    GPU."""
    if hasattr(driver, "_active"):
        driver._active = None
    else:
        driver.reset_active()


def case_name(model: str, tp: int, ep: bool, quant: str | None, kv: str | None) -> str:
    return " ".join([model, f"tp{tp}"] + (["ep"] if ep else []) + [quant or "bf16"] + ([kv] if kv else []))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", default=str(ROOT / "out" / "gpu_aot.json"))
    p.add_argument("--archs", type=int, nargs="+", default=sorted(ARCHS), choices=sorted(ARCHS))
    p.add_argument("--cases", nargs="+", help="case names to run (default: all), e.g. '300B-A47B tp8 wint8'")
    args = p.parse_args(argv)
    cases = [c for c in CASES if not args.cases or case_name(*c) in args.cases]
    if not cases:
        p.error(f"no case named {args.cases}; cases: {[case_name(*c) for c in CASES]}")
    records, failures = [], []
    work = [(c, a) for c in cases for a in args.archs if not (c[3] == "block_wise_fp8" and a < FP8_MIN_ARCH)]
    t0 = time.time()
    for case, arch in tqdm(work, desc="compiling", unit="case"):
        name = case_name(*case)
        seen: set = set()
        for launch in run_case(*case, arch):
            key = (launch.name, launch.kernel.hash if launch.kernel is not None else launch.error)
            if key in seen:
                continue
            seen.add(key)
            rec = {"name": launch.name, "arch": f"sm_{arch}", "config": name, "triton": triton.__version__,
                   "ok": launch.error is None, "error": launch.error, "shared_bytes": None, "registers": None,
                   "spills": None, "num_warps": None, "num_stages": None, "tf32": None}
            if launch.kernel is not None:
                md = launch.kernel.metadata
                rec.update(shared_bytes=int(md.shared), num_warps=md.num_warps, num_stages=md.num_stages)
                rec["registers"], rec["spills"] = ptxas_usage(launch.kernel, arch)
                rec["tf32"] = ".tf32" in launch.kernel.asm["ptx"]  # mma / wgmma on TF32 operands
            why = _failure(rec, arch)
            if why:
                rec["ok"] = False
                rec["error"] = rec["error"] or why
                failures.append(f"{name} sm_{arch} {launch.name}: {rec['error']}")
            records.append(rec)
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"kernels": records}, indent=1))
    _print_table(records)
    print(f"{len(records)} compiled kernels ({len(work)} case x arch runs, {time.time() - t0:.0f} s) -> {out}")
    for f in failures:
        print("FAIL", f)
    return 1 if failures else 0


def _failure(rec: dict, arch: int) -> str | None:
    if rec["error"]:
        return rec["error"]
    limit = ARCHS[arch][2]
    if rec["shared_bytes"] > limit:
        return f"shared memory {rec['shared_bytes']} bytes > sm_{arch}'s {limit} per block"
    if rec["spills"] and rec["name"] in HOT:
        return f"{rec['spills']} bytes of register spills in a hot kernel ({rec['registers']} registers)"
    if rec["tf32"] and rec["name"] in IEEE_FP32:
        return "a TF32 MMA in a kernel whose fp32 dot must be IEEE"
    return None


def _print_table(records: list[dict]) -> None:
    """Per kernel and arch: the worst shared memory / registers / spills over the cases."""
    worst: dict[tuple[str, str], dict] = {}
    for r in records:
        w = worst.setdefault((r["name"], r["arch"]), {"cases": 0, "shared": 0, "regs": 0, "spills": 0, "fail": 0})
        w["cases"] += 1
        w["fail"] += not r["ok"]
        w["shared"] = max(w["shared"], r["shared_bytes"] or 0)
        w["regs"] = max(w["regs"], r["registers"] or 0)
        w["spills"] = max(w["spills"], r["spills"] or 0)
    print(f"{'kernel':34} {'arch':6} {'variants':>8} {'max shared':>10} {'max regs':>8} {'max spills':>10} {'fails':>5}")
    for (name, arch), w in sorted(worst.items()):
        print(f"{name:34} {arch:6} {w['cases']:8d} {w['shared']:10d} {w['regs']:8d} {w['spills']:10d} {w['fail']:5d}")


if __name__ == "__main__":
    sys.exit(main())
