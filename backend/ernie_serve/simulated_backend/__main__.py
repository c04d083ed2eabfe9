"""The step model's figures for one target, as JSON: what a GPU check writes beside its measured decode steps.

    python -m ernie_serve.simulated_backend --gpu h200 --model ernie-4.5-21b-a3b --quantization wint8 \
        --batch 64,256 --context 2048
"""
from __future__ import annotations

import argparse
import json
from dataclasses import asdict

import numpy as np

from .step_model import StepModel, kv_pool_blocks, total_weight_bytes
from .targets import GPUS, MODELS, Target


def modeled_decode(target: Target, batches: list[int], context: int) -> dict:
    """Each batch's decode step (every sequence at `context` tokens) and its token rate, with the target's
    constants, weights and KV pool (64-token blocks, gpu_memory_utilization 0.9)."""
    model = StepModel(target)
    steps = {}
    for b in batches:
        cost = model.cost(b, b, np.full(b, context))
        steps[str(b)] = {**asdict(cost), "tok_per_s": b / cost.seconds}
    return {"gpu": asdict(target.gpu), "model": target.model.describe(), "quantization": target.quantization or "bfloat16",
            "tensor_parallel_size": target.tensor_parallel_size, "context": context,
            "weight_bytes_per_gpu": total_weight_bytes(target),
            "kv_pool_blocks_64": kv_pool_blocks(target, 0.9, 64, max(batches), 8192),
            "constants": asdict(target.constants), "decode_steps": steps}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpu", choices=list(GPUS), default="h200")
    p.add_argument("--model", choices=list(MODELS), default="ernie-4.5-21b-a3b")
    p.add_argument("--quantization", default=None, help="wint8, wint4, ... (none: bfloat16)")
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--batch", default="64,256", help="running sequences, comma-separated")
    p.add_argument("--context", type=int, default=2048, help="each sequence's context tokens")
    args = p.parse_args(argv)
    target = Target(GPUS[args.gpu], MODELS[args.model], args.quantization, args.tensor_parallel_size)
    print(json.dumps(modeled_decode(target, [int(b) for b in args.batch.split(",")], args.context), indent=1))


if __name__ == "__main__":
    main()
