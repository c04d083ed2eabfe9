"""Write a pre-quantized "-Paddle"-style checkpoint from a full-precision one (scripts/quantize_checkpoint.py).

Every quantized linear becomes `<name>.quant_weight` + its scales (formats.py layouts, [in, out],
unpermuted), routed experts one by one (`mlp.experts.<e>.up_gate_proj.*`); embeddings, norms, the
router and lm_head are written in fp32; config.json gets a quantization_config with is_quantized.
The weights are quantized by the same function the loader's online quantization uses, so serving the
written checkpoint gives the same outputs as `--quantization <method>` on the original.

W4A8 needs static activation scales and the C8 cache static K/V scales: both are calibrated by
running the fp32 model over calibration tokens (absmax of each expert's routed inputs, of K and V
per channel). Random token ids are the default calibration set; pass real prompts' ids for a real model.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import ml_dtypes
import numpy as np
import paddle

from ..model.attention import AttentionMetadata
from ..model.checkpoint_writer import write_checkpoint
from ..model.kv_cache import PagedKVCache
from ..model.layers import Linear, silu_and_mul
from ..model.loader import load_model
from ..model.moe import FusedExperts
from .layers import quantize_float
from .plan import QuantPlan


def calibration_ids(vocab_size: int, num_seqs: int = 8, seq_len: int = 64, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab_size, seq_len).tolist() for _ in range(num_seqs)]


@paddle.no_grad()
def calibrate(model, token_ids: list[list[int]]) -> tuple[dict[tuple[str, int], tuple[float, float]], dict]:
    """Run the fp32 model over each sequence. Returns per (experts path, expert) the absmax of its
    up_gate input and of its down input (routed tokens; all tokens for an expert never routed), and
    per layer the channel-wise absmax of K and V as written to the cache."""
    cfg = model.config
    stats: dict[tuple[str, int], list[float]] = {}
    hooks = []
    for path, layer in model.named_sublayers():
        if isinstance(layer, FusedExperts):
            hooks.append(layer.register_forward_pre_hook(_expert_hook(path, layer, stats)))
    kv_amax = [[np.zeros(cfg.kv_size, np.float32) for _ in range(2)] for _ in range(cfg.num_hidden_layers)]
    try:
        for ids in token_ids:
            n = len(ids)
            bs = 16
            nb = -(-n // bs)
            cache = PagedKVCache(cfg.num_hidden_layers, nb, bs, cfg.num_key_value_heads, cfg.head_dim)
            slots = np.arange(n, dtype=np.int64)
            meta = AttentionMetadata.build([n], [n], [list(range(nb))], bs, slots, n - 1)
            model(paddle.to_tensor(np.asarray(ids, np.int64)), paddle.to_tensor(np.arange(n)), meta, cache)
            for i in range(cfg.num_hidden_layers):
                for j, store in enumerate((cache.k[i], cache.v[i])):
                    written = store.reshape(-1, cfg.kv_size)[:n]
                    kv_amax[i][j] = np.maximum(kv_amax[i][j], np.abs(written).max(axis=0))
    finally:
        for h in hooks:
            h.remove()
    scales = {key: (v[0], v[1]) for key, v in stats.items()}
    kv = {"k": [np.where(a[0] > 0, a[0], 1.0) for a in kv_amax], "v": [np.where(a[1] > 0, a[1], 1.0) for a in kv_amax]}
    return scales, kv


def _expert_hook(path: str, experts: FusedExperts, stats: dict):
    def hook(layer, inputs):
        x, ids = inputs[0].numpy(), inputs[1].numpy()
        for e in range(experts.num_experts):
            rows = (ids == e).any(axis=1)
            xe = x[rows] if rows.any() else x
            h = silu_and_mul(paddle.to_tensor(xe @ experts.up_gate_proj[e].numpy())).numpy()
            old = stats.get((path, e), [0.0, 0.0])
            stats[(path, e)] = [max(old[0], float(np.abs(xe).max())), max(old[1], float(np.abs(h).max()))]
    return hook


def _checkpoint_name(param: str) -> str:
    if param == "lm_head.weight":
        return param
    if param.endswith("mlp.gate.e_score_correction_bias"):
        return "ernie." + param.replace("mlp.gate.e_score_correction_bias", "mlp.moe_statics.e_score_correction_bias")
    return "ernie." + param


def quantize_checkpoint(model_dir: str | Path, out_dir: str | Path, method: str, *, kv_cache_int8: bool = False,
                        calib_ids: list[list[int]] | None = None, show_progress: bool = False) -> Path:
    """Read model_dir (fp32/bf16, either dialect), write the quantized checkpoint to out_dir."""
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise FileExistsError(f"{out_dir} exists and is not empty: remove it or choose another --out")
    plan = QuantPlan.for_method(method)
    plan.kv_cache = "int8" if kv_cache_int8 else None
    model = load_model(model_dir, show_progress=show_progress)
    cfg = model.config
    act_scales, kv_scales = {}, None
    if method == "w4a8" or kv_cache_int8:
        act_scales, kv_scales = calibrate(model, calib_ids or calibration_ids(cfg.vocab_size))

    tensors: dict[str, np.ndarray] = {}
    quantized_params = set()
    for path, layer in model.named_sublayers():
        if not path.startswith("layers."):
            continue  # lm_head stays fp32
        layer_idx = int(path.split(".")[1])
        if isinstance(layer, Linear):
            m = plan.dense
            if m is not None:
                tensors.update(_quantized(f"ernie.{path}", layer.weight.numpy(), m, None))
                quantized_params.add(f"{path}.weight")
        elif isinstance(layer, FusedExperts):
            m = plan.moe_method(layer_idx)
            if m is None:
                continue
            for kind in ("up_gate_proj", "down_proj"):
                stacked = getattr(layer, kind).numpy()
                for e in range(layer.num_experts):
                    a = act_scales.get((path, e))
                    scale = None if a is None else np.float32((a[0] if kind == "up_gate_proj" else a[1]) / 127.0)
                    tensors.update(_quantized(f"ernie.{path}.{e}.{kind}", stacked[e], m, scale))
                quantized_params.add(f"{path}.{kind}")
    for name, p in model.named_parameters():
        if name not in quantized_params:
            tensors[_checkpoint_name(name)] = p.numpy()
    tensors.update(model.mtp_weights)
    if kv_cache_int8:
        for i in range(cfg.num_hidden_layers):
            for w in "kv":
                tensors[f"ernie.layers.{i}.self_attn.cache{w}_matmul.activation_scale"] = kv_scales[w][i]

    config = json.loads((model_dir / "config.json").read_text())
    config["quantization_config"] = plan.to_config(prequantized=True)
    partial = out_dir.with_name(out_dir.name + ".partial")  # renamed when complete: never a half checkpoint
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    for f in model_dir.iterdir():  # tokenizer, generation config, ...
        if f.is_file() and f.suffix != ".safetensors" and f.name not in ("model.safetensors.index.json",
                                                                         "config.json", "BUILD"):
            shutil.copy2(f, partial / f.name)
    write_checkpoint(partial, config, tensors, max_shard_bytes=512 << 20)
    if out_dir.exists():
        out_dir.rmdir()
    partial.rename(out_dir)
    return out_dir


def _quantized(prefix: str, w: np.ndarray, method: str, activation_scale) -> dict[str, np.ndarray]:
    if method == "w4a8" and activation_scale is None:
        raise ValueError(f"{prefix}: w4a8 needs calibration (dense linears use wint8 under w4a8)")
    t = quantize_float(w, method, **({"activation_scale": activation_scale} if method == "w4a8" else {}))
    if method == "block_wise_fp8":
        t["quant_weight"] = t["quant_weight"].view(np.uint8).view(ml_dtypes.float8_e4m3fn)
    return {f"{prefix}.{k}": np.asarray(v) for k, v in t.items()}
