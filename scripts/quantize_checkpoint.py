"""Write a pre-quantized "-Paddle"-style checkpoint that `load_model` / `--model OUT` serve directly.

    .venv/bin/python scripts/quantize_checkpoint.py --model IN --out OUT --quantization wint4
    .venv/bin/python scripts/quantize_checkpoint.py --model IN --out OUT --quantization w4a8 --kv-cache-int8

wint8 / wint4 / block_wise_fp8 quantize every dense linear and routed expert; wint2 and w4a8 are MoE
formats (their dense linears are wint8, as FastDeploy's). w4a8 and --kv-cache-int8 calibrate static
scales on --calib-seqs random token sequences (or the token ids in --calib-file, a JSON list of lists).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "backend"))

from ernie_serve.model.quantize_checkpoint import calibration_ids, quantize_checkpoint  # noqa: E402
from ernie_serve.model.quantized_layers import METHODS  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="full-precision checkpoint directory (HF -PT or -Paddle)")
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--quantization", required=True, choices=METHODS)
    ap.add_argument("--kv-cache-int8", action="store_true", help="also calibrate static C8 KV cache scales")
    ap.add_argument("--calib-seqs", type=int, default=8, help="random calibration sequences (of 64 tokens)")
    ap.add_argument("--calib-file", help="JSON list of token-id lists to calibrate on instead")
    args = ap.parse_args()
    model, out = Path(args.model), Path(args.out)
    if out.resolve() == model.resolve():
        sys.exit("--out must differ from --model")
    calib = None
    if args.calib_file:
        calib = json.loads(Path(args.calib_file).read_text())
    elif args.quantization == "w4a8" or args.kv_cache_int8:
        vocab = json.loads((model / "config.json").read_text())["vocab_size"]
        calib = calibration_ids(vocab, num_seqs=args.calib_seqs)
    t0 = time.perf_counter()
    quantize_checkpoint(model, out, args.quantization, kv_cache_int8=args.kv_cache_int8, calib_ids=calib,
                        show_progress=True)
    size = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    print(f"wrote {out} ({size / 2**20:.1f} MiB of safetensors) in {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
