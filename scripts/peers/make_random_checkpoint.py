"""Write a randomly initialized ERNIE-4.5 MoE checkpoint in the HF "-PT" layout.

Runs in the hf peer env (.peers/hf): it is HF transformers' own `Ernie4_5_MoeForCausalLM` that
builds and saves the model, so the tensor names and config.json are exactly what `save_pretrained`
writes for the released "-PT" checkpoints.

    .peers/hf/bin/python scripts/peers/make_random_checkpoint.py \
        --config scripts/peers/configs/bench-moe-8l.json --out .cache/models/peer-bench-moe-8l
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from transformers import Ernie4_5_MoeConfig, Ernie4_5_MoeForCausalLM


def load_overrides(path: Path) -> dict:
    overrides = json.loads(path.read_text())
    if not isinstance(overrides, dict):
        raise SystemExit(f"{path}: expected a JSON object of Ernie4_5_MoeConfig fields, got {type(overrides).__name__}")
    # keys starting with "_" are notes for people, not config fields
    return {k: v for k, v in overrides.items() if not k.startswith("_")}


def check_head_dim(config: Ernie4_5_MoeConfig) -> None:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if head_dim not in (64, 128):
        # vLLM's CPU attention backend only has kernels for some head sizes; the peers must share one model
        print(f"warning: head_dim {head_dim} is not 64 or 128; vLLM's CPU build will refuse this model", file=sys.stderr)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, required=True, help="JSON object of Ernie4_5_MoeConfig fields")
    parser.add_argument("--out", type=Path, required=True, help="checkpoint directory to write")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--force", action="store_true", help="overwrite an existing checkpoint")
    args = parser.parse_args()

    if (args.out / "config.json").exists() and not args.force:
        print(f"{args.out} already holds a checkpoint; pass --force to overwrite")
        return

    config = Ernie4_5_MoeConfig(**load_overrides(args.config))
    config.architectures = ["Ernie4_5_MoeForCausalLM"]
    check_head_dim(config)
    torch.manual_seed(args.seed)
    model = Ernie4_5_MoeForCausalLM(config).to(torch.float32).eval()
    model.save_pretrained(args.out, safe_serialization=True)

    n_params = sum(p.numel() for p in model.parameters())
    files = sorted(p.name for p in args.out.iterdir())
    print(f"wrote {args.out}: {n_params / 1e6:.1f}M parameters (fp32), files {files}")


if __name__ == "__main__":
    main()
