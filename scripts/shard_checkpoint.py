"""Split a checkpoint per tensor-parallel rank (rank0/ .. rankN-1/, FastDeploy's pre-sharded layout), so that
each rank of `--tensor-parallel-size N` reads only its own bytes at start-up.

    .venv/bin/python scripts/shard_checkpoint.py --model IN --out OUT --tensor-parallel-size 2
    .venv/bin/python scripts/shard_checkpoint.py --model IN --out OUT --tensor-parallel-size 2 --quantization wint8
    .venv/bin/python scripts/shard_checkpoint.py --model IN --out OUT --tensor-parallel-size 2 --enable-expert-parallel

A pre-quantized checkpoint (scripts/quantize_checkpoint.py) is split in its quantized form; --quantization
quantizes each rank's slice of a float checkpoint. Serve OUT with the same --tensor-parallel-size (and
--enable-expert-parallel when it was split that way).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "backend"))

from ernie_serve.model.quantize_checkpoint import shard_checkpoint  # noqa: E402
from ernie_serve.quantization.formats import METHODS  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="full checkpoint directory (HF -PT or -Paddle, float or pre-quantized)")
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--tensor-parallel-size", type=int, required=True)
    ap.add_argument("--enable-expert-parallel", action="store_true", help="split routed experts whole across ranks")
    ap.add_argument("--quantization", choices=METHODS, help="quantize each rank's slice of a float checkpoint")
    args = ap.parse_args()
    model, out = Path(args.model), Path(args.out)
    if out.resolve() == model.resolve():
        sys.exit("--out must differ from --model")
    t0 = time.perf_counter()
    shard_checkpoint(model, out, args.tensor_parallel_size, expert_parallel=args.enable_expert_parallel,
                     quantization=args.quantization, show_progress=True)
    size = sum(f.stat().st_size for f in out.glob("rank*/*.safetensors"))
    print(f"wrote {out} ({args.tensor_parallel_size} ranks, {size / 2**20:.1f} MiB of safetensors) "
          f"in {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
