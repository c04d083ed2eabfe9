"""Write ERNIE-4.5 checkpoints in either dialect (used by the demo/benchmark builders and tests).

Names and layouts are those of the public checkpoints: "-PT" (torch [out, in], `model.` prefix,
separate q/k/v and gate/up) and "-Paddle" ([in, out], `ernie.` prefix, fused qkv_proj and
up_gate_proj with gate first).
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

from .config import ErnieModelConfig
from .safetensors_io import save_file


def pt_to_paddle(tensors: dict[str, np.ndarray], cfg: ErnieModelConfig) -> dict[str, np.ndarray]:
    """Convert "-PT" tensors to the "-Paddle" layout (transpose linears, fuse qkv and gate/up)."""
    out: dict[str, np.ndarray] = {}
    fused: dict[str, dict[str, np.ndarray]] = {}
    for name, t in tensors.items():
        new = "ernie." + name[len("model."):] if name.startswith("model.") else name
        m = re.match(r"(.+)\.(q_proj|k_proj|v_proj|gate_proj|up_proj)\.weight$", new)
        if m:
            base, kind = m.groups()
            key = base + (".qkv_proj.weight" if kind in ("q_proj", "k_proj", "v_proj") else ".up_gate_proj.weight")
            fused.setdefault(key, {})[kind] = t
            continue
        if t.ndim == 2 and not new.endswith(("embed_tokens.weight", "e_score_correction_bias")) and "norm" not in new:
            t = t.T  # every other 2-D weight is a linear ([out, in] -> [in, out]), gate included
        out[new] = np.ascontiguousarray(t)
    for key, parts in fused.items():
        order = ("q_proj", "k_proj", "v_proj") if key.endswith("qkv_proj.weight") else ("gate_proj", "up_proj")
        out[key] = np.ascontiguousarray(np.concatenate([parts[k].T for k in order], axis=1))
    return out


def write_checkpoint(out_dir: Path, config: dict, tensors: dict[str, np.ndarray], *,
                     max_shard_bytes: int = 1 << 30, bf16: bool = False,
                     generation_config: dict | None = None) -> None:
    """Sharded safetensors + model.safetensors.index.json + config.json (+ generation_config.json)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name in sorted(tensors):
        nbytes = tensors[name].nbytes // (2 if bf16 else 1)
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensors[name]
        size += nbytes
    weight_map = {}
    keep_fp32 = {n for n in tensors if n.endswith((".mlp.gate.weight", "e_score_correction_bias"))}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        low = {n for n in shard if bf16 and n not in keep_fp32 and shard[n].dtype == np.float32}
        save_file(shard, out_dir / fname, bf16=low)
        weight_map.update({n: fname for n in shard})
    index = {"metadata": {"total_size": int(sum(t.nbytes for t in tensors.values()))}, "weight_map": weight_map}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    if generation_config is not None:
        (out_dir / "generation_config.json").write_text(json.dumps(generation_config, indent=2))
