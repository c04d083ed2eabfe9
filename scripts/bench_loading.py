#!/usr/bin/env python3
"""Load time and peak host RAM of one tensor-parallel rank loading a synthetic ERNIE-4.5-300B-A47B-shaped checkpoint,
and their extrapolation to the whole 54-layer model (docs/loading.md quotes the results).

    scripts/bench_loading.py make --out /tmp/ernie300b-synth --experts 8
    scripts/bench_loading.py all --synth /tmp/ernie300b-synth --old /tmp/old --json benchmarks/results/loading.json

`make` writes two bf16 "-PT" checkpoints with the real model's shapes (hidden 8192, 64 query / 8 KV heads of 128,
vocab 103,424, experts of intermediate 3584): `layer/`, one MoE layer with `--experts` of the 64 routed experts (and a
1,024-row vocabulary, so the layer dominates), and `vocab/`, the real embedding and untied lm_head with one attention
layer and a token MLP. Values are random bytes of finite bf16: loading does not look at them.

`run` measures one rank in this process: kernels_backend.weights.load_device_weights on a device that keeps nothing
(HostSideOnly: a GPU rank's host does everything up to the copy, which is counted and dropped), so the figures are the
host's: the wall time and the peak RSS (VmHWM) of the load. `all` runs every case in a fresh process, before (the
tree at --old, a `git worktree` of the old commit, on PYTHONPATH) and after (this tree), with the page cache warm.

Extrapolation to the 54 layers (3 dense + 51 MoE): time scales with the bytes of the layers (the measured layer's
time per byte, times the full model's layer bytes), plus the measured vocabulary part. The new loader's peak does not
grow with the layer count (it is bounded by the largest tensor), so its 54-layer peak is the larger measured one; the
old loader held the rank's whole shard before placing any of it (fp32, or int8 codes when quantizing), so its
estimate adds the rest of the rank's layers in that form to the larger measured peak.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 8192, 64, 8, 128, 103424
EXPERTS, MOE_INTER, DENSE_INTER, LAYERS, DENSE_LAYERS = 64, 3584, 28672, 54, 3


def _config(vocab: int, experts: int, moe: bool, intermediate: int) -> dict:
    return dict(architectures=["Ernie4_5_MoeForCausalLM" if moe else "Ernie4_5ForCausalLM"], vocab_size=vocab,
                hidden_size=HIDDEN, num_hidden_layers=1, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                head_dim=HEAD_DIM, intermediate_size=intermediate, max_position_embeddings=131072, rms_norm_eps=1e-5,
                rope_theta=500000.0, tie_word_embeddings=False, torch_dtype="bfloat16",
                **(dict(moe_num_experts=experts, moe_k=min(8, experts), moe_intermediate_size=MOE_INTER,
                        moe_num_shared_experts=0, moe_layer_start_index=0, moe_layer_end_index=0) if moe else {}))


def _tensors(vocab: int, experts: int, moe: bool, intermediate: int) -> dict[str, tuple[str, tuple[int, ...]]]:
    """name -> (safetensors dtype, shape), "-PT" names and [out, in] layout."""
    p, q, kv = "model.layers.0.", HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    t = {"model.embed_tokens.weight": ("BF16", (vocab, HIDDEN)), "lm_head.weight": ("BF16", (vocab, HIDDEN)),
         "model.norm.weight": ("BF16", (HIDDEN,)), p + "input_layernorm.weight": ("BF16", (HIDDEN,)),
         p + "post_attention_layernorm.weight": ("BF16", (HIDDEN,)), p + "self_attn.q_proj.weight": ("BF16", (q, HIDDEN)),
         p + "self_attn.k_proj.weight": ("BF16", (kv, HIDDEN)), p + "self_attn.v_proj.weight": ("BF16", (kv, HIDDEN)),
         p + "self_attn.o_proj.weight": ("BF16", (HIDDEN, q))}
    if moe:
        t[p + "mlp.gate.weight"] = ("F32", (experts, HIDDEN))
        t[p + "mlp.moe_statics.e_score_correction_bias"] = ("F32", (1, experts))
        for e in range(experts):
            for kind, shape in (("gate_proj", (MOE_INTER, HIDDEN)), ("up_proj", (MOE_INTER, HIDDEN)),
                                ("down_proj", (HIDDEN, MOE_INTER))):
                t[p + f"mlp.experts.{e}.{kind}.weight"] = ("BF16", shape)
    else:
        for kind, shape in (("gate_proj", (intermediate, HIDDEN)), ("up_proj", (intermediate, HIDDEN)),
                            ("down_proj", (HIDDEN, intermediate))):
            t[p + f"mlp.{kind}.weight"] = ("BF16", shape)
    return t


def _write(out: Path, config: dict, tensors: dict[str, tuple[str, tuple[int, ...]]]) -> None:
    """A safetensors file written tensor by tensor (never the whole checkpoint in memory)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=1))
    header, pos = {}, 0
    for name in sorted(tensors):
        code, shape = tensors[name]
        n = int(np.prod(shape)) * (2 if code == "BF16" else 4)
        header[name] = {"dtype": code, "shape": list(shape), "data_offsets": [pos, pos + n]}
        pos += n
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    rng = np.random.default_rng(0)
    block = rng.standard_normal(1 << 22, dtype=np.float32) * 0.02  # 16 MiB of fp32, repeated
    with open(out / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(head)) + head)
        for name in sorted(tensors):
            code, shape = tensors[name]
            left = int(np.prod(shape))
            while left:
                part = block[:min(left, block.size)]
                f.write((part.view(np.uint32) >> 16).astype(np.uint16).tobytes() if code == "BF16" else part.tobytes())
                left -= part.size


def make(args) -> None:
    root = Path(args.out)
    _write(root / "layer", _config(1024, args.experts, True, DENSE_INTER), _tensors(1024, args.experts, True, 0))
    _write(root / "vocab", _config(VOCAB, 0, False, 64), _tensors(VOCAB, 0, False, 64))
    print(f"wrote {root}/layer and {root}/vocab")


class _Placeholder:
    """What a device tensor would be: a shape and a dtype, no data."""

    def __init__(self, shape, dtype: str):
        self.shape, self.dtype = tuple(int(s) for s in shape), dtype

    def __getitem__(self, index):
        return _Placeholder(self.shape[1:], self.dtype) if isinstance(index, int) else self

    def reshape(self, shape):
        return _Placeholder(shape, self.dtype)


def _host_side_only():
    from ernie_serve.kernels_backend.framework import TensorOps

    class HostSideOnly(TensorOps):
        """A device that keeps nothing: the host's side of a GPU rank's load (activations and float weights bf16)."""
        name, on_gpu = "none", True

        def __init__(self):
            self.placed_bytes = 0

        def _from_host(self, a):
            self.placed_bytes += a.nbytes
            return _Placeholder(a.shape, a.dtype.name)

        def _view(self, t, dtype):
            return _Placeholder(t.shape, dtype)

        def cast(self, t, dtype):
            return _Placeholder(t.shape, dtype)

        def empty(self, shape, dtype):
            return _Placeholder(shape, dtype)

        def copy_(self, dst, src):
            pass

    return HostSideOnly()


def _vm(field: str) -> int:
    """A /proc/self/status figure (VmRSS, VmHWM) in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


class _AnonPeak:
    """The peak of RssAnon (memory only this process holds; RSS also counts the pages of a memory-mapped file it
    touched, which the kernel may drop) sampled every 10 ms in a thread."""

    def __init__(self):
        self.peak, self._stop = 0, threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(0.01):
            self.peak = max(self.peak, _vm("RssAnon"))

    def __enter__(self) -> "_AnonPeak":
        self.peak = _vm("RssAnon")
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _vm("RssAnon"))


def run(args) -> None:
    from ernie_serve.kernels_backend.weights import load_device_weights
    from ernie_serve.model.config import ErnieModelConfig
    from ernie_serve.model.parallel import ParallelLayout

    ops = _host_side_only()
    cfg = ErnieModelConfig.from_pretrained(args.checkpoint)
    before, anon_before = _vm("VmRSS"), _vm("RssAnon")
    start = time.perf_counter()
    with _AnonPeak() as anon:
        load_device_weights(args.checkpoint, cfg, ops, args.quantization, show_progress=False,
                            layout=ParallelLayout(args.rank, args.tp))
    seconds = time.perf_counter() - start
    print(json.dumps({"seconds": round(seconds, 2), "rss_before_bytes": before, "peak_rss_bytes": _vm("VmHWM"),
                      "anon_before_bytes": anon_before, "peak_anon_bytes": anon.peak,
                      "placed_bytes": ops.placed_bytes}))


def _checkpoint_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


def _full_model_bytes() -> dict[str, int]:
    """Bytes of the real 54-layer checkpoint (bf16; the router in fp32), by part."""
    attn = 2 * HIDDEN * (2 * HEADS * HEAD_DIM + 2 * KV_HEADS * HEAD_DIM) + 2 * 2 * HIDDEN
    moe = attn + 2 * EXPERTS * 3 * HIDDEN * MOE_INTER + 4 * (EXPERTS * HIDDEN + EXPERTS)
    dense = attn + 2 * 3 * HIDDEN * DENSE_INTER
    return {"vocab": 2 * 2 * VOCAB * HIDDEN + 2 * HIDDEN, "moe_layer": moe, "dense_layer": dense,
            "layers": (LAYERS - DENSE_LAYERS) * moe + DENSE_LAYERS * dense}


def _commit(tree: Path) -> str:
    return subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True).stdout.strip()


def _cpu() -> str:
    """The CPU model, vCPUs and the vector extensions that matter for the host's copies and casts."""
    info = Path("/proc/cpuinfo").read_text()
    model = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")),
                 platform.processor())
    flags = set(next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), []))
    isa = [name for flag, name in (("avx2", "AVX2"), ("avx512f", "AVX-512"), ("avx512_vnni", "VNNI"),
                                   ("avx512_bf16", "BF16"), ("amx_tile", "AMX")) if flag in flags]
    return f"{model} VM ({os.cpu_count()} vCPUs; {', '.join(isa)})"


def _measure(tree: Path, checkpoint: Path, tp: int, quantization: str | None) -> dict:
    for f in checkpoint.glob("*.safetensors"):  # a warm page cache: the figures are the loader's, not the disk's
        with open(f, "rb") as fh:
            while fh.read(64 << 20):
                pass
    cmd = [sys.executable, str(Path(__file__).resolve()), "run", "--checkpoint", str(checkpoint), "--tp", str(tp),
           "--rank", "0"] + (["--quantization", quantization] if quantization else [])
    env = dict(os.environ, PYTHONPATH=str(tree / "backend"))
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


# What the old loader held on the host per bf16 byte of a layer's weights until it placed the shard: fp32 copies, or
# the codes of weights it quantized one matrix at a time (int8: half the bf16 bytes)
OLD_HELD_PER_BF16_BYTE = {None: 2.0, "wint8": 0.5, "wint4": 0.25}


def _gib(n: float) -> float:
    return round(n / 2**30, 2)


def all_cases(args) -> None:
    synth, here = Path(args.synth), Path(__file__).resolve().parents[1]
    trees = {"before": Path(args.old), "after": here}
    experts = json.loads((synth / "layer" / "config.json").read_text())["moe_num_experts"]
    full = _full_model_bytes()
    layer_bytes, vocab_bytes = _checkpoint_bytes(synth / "layer"), _checkpoint_bytes(synth / "vocab")
    rows, load_start = [], os.getloadavg()
    for quantization in args.quantizations:
        quantization = None if quantization == "none" else quantization
        for tp in args.tp:
            for code, tree in trees.items():
                m = {part: _measure(tree, synth / part, tp, quantization) for part in ("layer", "vocab")}
                seconds54 = m["layer"]["seconds"] * full["layers"] / layer_bytes + m["vocab"]["seconds"]
                anon54 = max(m["layer"]["peak_anon_bytes"], m["vocab"]["peak_anon_bytes"])
                if code == "before":  # it held the rank's whole shard before placing any: add the rest of it
                    anon54 += OLD_HELD_PER_BF16_BYTE[quantization] * (full["layers"] - layer_bytes) / tp
                row = [f"{code} ({_commit(tree)})", f"rank 0 of {tp}", quantization or "bf16",
                       m["layer"]["seconds"], _gib(m["layer"]["peak_anon_bytes"]), _gib(m["layer"]["peak_rss_bytes"]),
                       m["vocab"]["seconds"], _gib(m["vocab"]["peak_anon_bytes"]), _gib(m["vocab"]["peak_rss_bytes"]),
                       _gib(m["layer"]["placed_bytes"] + m["vocab"]["placed_bytes"]), round(seconds54), _gib(anon54)]
                rows.append(row)
                print(" | ".join(str(c) for c in row), flush=True)
    result = {
        "title": "Loading one tensor-parallel rank of ERNIE-4.5-300B-A47B: time and peak host RAM, before and after "
                 "streamed slices (synthetic layer, CPU)",
        "commit": _commit(here),
        "cpu": _cpu(),
        "command": "scripts/bench_loading.py make --out /tmp/ernie300b-synth --experts 8 && git worktree add /tmp/old "
                   f"{_commit(Path(args.old))} && " + " ".join([".venv/bin/python scripts/bench_loading.py"] + sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d"),
        "columns": ["loader", "rank", "weights", f"MoE layer ({experts}/{EXPERTS} experts) s", "peak anon GiB",
                    "peak RSS GiB", "vocab s", "peak anon GiB", "peak RSS GiB", "sent to device GiB",
                    "54 layers s (est.)", "54 layers peak anon GiB (est.)"],
        "rows": rows,
        "notes": [
            f"Checkpoints (bf16, -PT layout, real 300B shapes): 'MoE layer' = one MoE layer with {experts} of the 64 "
            f"routed experts and a 1,024-row vocabulary ({layer_bytes / 2**30:.2f} GiB); 'vocab' = the real embedding and "
            f"untied lm_head (103,424 x 8192) with one attention layer and a 64-wide MLP "
            f"({vocab_bytes / 2**30:.2f} GiB).",
            "One rank (rank 0) measured in a fresh process: load_device_weights onto a device that keeps nothing, so "
            "the figures are the host side of a GPU rank; page cache warm. 'peak anon' is the peak of RssAnon (sampled "
            "every 10 ms): memory the rank holds itself. 'peak RSS' (VmHWM) also counts the pages of the memory-mapped "
            "file the old loader touched, which the kernel may drop. Both include the ~0.05 GiB interpreter. 'sent to "
            "device' is what crossed to the device (the old loader sent fp32 and cast there).",
            f"54-layer estimate: the measured layer's time scaled by the full model's layer bytes "
            f"({full['layers'] / 2**30:.0f} GiB: 51 MoE layers of 64 experts + 3 dense) over the measured layer's, plus "
            "the vocab part. Peak anon: the new loader's does not grow with layers (the larger measured one); the old "
            "loader held the rank's whole shard before placing any of it (fp32, or int8 codes when quantizing), so its "
            "estimate adds the rest of the rank's layers in that form (2x, or 0.5x for wint8, the unmeasured bf16 "
            "layer bytes / tp) to the larger measured peak.",
            f"A shared 2-vCPU VM (load average {load_start[0]:.1f} at the start, {os.getloadavg()[0]:.1f} at the end): "
            "compare rows within this run; absolute seconds are slow.",
        ],
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.json}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make", help="write the synthetic checkpoints")
    m.add_argument("--out", required=True)
    m.add_argument("--experts", type=int, default=8, help="routed experts in the layer checkpoint (of 64)")
    r = sub.add_parser("run", help="measure one rank's load in this process (prints JSON)")
    r.add_argument("--checkpoint", required=True)
    r.add_argument("--tp", type=int, default=1)
    r.add_argument("--rank", type=int, default=0)
    r.add_argument("--quantization", default=None)
    a = sub.add_parser("all", help="every case before and after, each in a fresh process; writes --json")
    a.add_argument("--synth", required=True)
    a.add_argument("--old", required=True, help="a checkout of the old commit (git worktree add /tmp/old COMMIT)")
    a.add_argument("--json", required=True)
    a.add_argument("--tp", type=int, nargs="+", default=[1, 8])
    a.add_argument("--quantizations", nargs="+", default=["none", "wint8"])
    args = p.parse_args()
    {"make": make, "run": run, "all": all_cases}[args.cmd](args)


if __name__ == "__main__":
    main()
