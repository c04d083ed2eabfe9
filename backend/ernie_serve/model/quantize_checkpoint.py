"""Write checkpoints the loader serves directly: a pre-quantized "-Paddle"-style checkpoint from a
full-precision one (scripts/quantize_checkpoint.py), and a checkpoint split per tensor-parallel rank
(scripts/shard_checkpoint.py).

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
import re
import shutil
from pathlib import Path

import ml_dtypes
import numpy as np
import paddle
from tqdm.auto import tqdm

from ..quantization.plan import QuantPlan
from .attention import AttentionMetadata
from .checkpoint_writer import write_checkpoint
from .config import ErnieModelConfig
from .kv_cache import PagedKVCache
from .layers import Linear, silu_and_mul
from .loader import load_model
from .moe import FusedExperts
from .parallel import ParallelLayout
from .quantized_layers import QuantLinear, QuantMoEExperts, quantize_float



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


def _float_tensors(param: str, value: np.ndarray, first_expert: int = 0) -> dict[str, np.ndarray]:
    """A float parameter under its checkpoint name(s): stacked experts [E, ...] one by one
    (`experts.<e>.<kind>.weight`, e counted from first_expert), everything else as it is."""
    m = _STACKED_EXPERTS.match(param)
    if m is None:
        return {_checkpoint_name(param): value}
    path, kind = m.groups()
    return {f"ernie.{path}.{first_expert + e}.{kind}.weight": value[e] for e in range(value.shape[0])}


_STACKED_EXPERTS = re.compile(r"^(layers\.\d+\.mlp\.experts)\.(up_gate_proj|down_proj)$")


def checkpoint_tensors(model) -> dict[str, np.ndarray]:
    """A loaded model's weights under "-Paddle" checkpoint names, as its layers hold them: quantized layers'
    tensors, this rank's shard under a tensor-parallel layout (routed experts keep their global numbers),
    the C8 cache's static scales. load_model reads them back into the same model."""
    cfg, layout = model.config, model.layout
    first_expert = layout.experts(cfg).start
    tensors: dict[str, np.ndarray] = {}
    in_experts = set()
    for path, layer in model.named_sublayers():
        if isinstance(layer, QuantMoEExperts):
            for kind in ("up_gate_proj", "down_proj"):
                for e, linear in enumerate(getattr(layer, kind)):
                    in_experts.add(id(linear))
                    tensors.update({f"ernie.{path}.{first_expert + e}.{kind}.{k}": v for k, v in linear.export().items()})
    for path, layer in model.named_sublayers():
        if isinstance(layer, QuantLinear) and id(layer) not in in_experts:
            tensors.update({f"ernie.{path}.{k}": v for k, v in layer.export().items()})
    for name, p in model.named_parameters():
        tensors.update(_float_tensors(name, p.numpy(), first_expert))
    quant = model.kv_cache_quant
    if quant is not None and quant.static:
        for i in range(cfg.num_hidden_layers):
            tensors[f"ernie.layers.{i}.self_attn.cachek_matmul.activation_scale"] = quant.k_scales[i]
            tensors[f"ernie.layers.{i}.self_attn.cachev_matmul.activation_scale"] = quant.v_scales[i]
    tensors.update(model.mtp_weights)
    return tensors


def shard_checkpoint(model_dir: str | Path, out_dir: str | Path, tensor_parallel_size: int, *,
                     expert_parallel: bool = False, quantization: str | None = None,
                     show_progress: bool = False) -> Path:
    """Split a full checkpoint into rank0/ .. rank{N-1}/ (FastDeploy's pre-sharded layout), each holding
    exactly what that rank loads: its slice of every weight, quantized as serving it would be (a
    pre-quantized checkpoint's tensors split as they are; `quantization`: each rank's slice quantized
    online). Serving the result with the same tensor_parallel_size (and expert parallelism) loads only
    each rank's bytes. config.json and the tokenizer files are kept at the top and in every rank."""
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise FileExistsError(f"{out_dir} exists and is not empty: remove it or choose another --out")
    config = json.loads((model_dir / "config.json").read_text())
    cfg = ErnieModelConfig.from_dict(config)
    plan = QuantPlan.resolve(quantization, cfg.quantization_config)
    if plan is not None and plan.quantizes_weights:
        config["quantization_config"] = plan.to_config(prequantized=True)
    partial = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    _copy_side_files(model_dir, partial)
    (partial / "config.json").write_text(json.dumps(config, indent=2))
    for rank in tqdm(range(tensor_parallel_size), desc="Sharding", unit="rank", disable=not show_progress):
        layout = ParallelLayout(rank, tensor_parallel_size, expert_parallel)
        model = load_model(model_dir, show_progress=False, quantization=quantization, layout=layout)
        rank_dir = partial / f"rank{rank}"
        write_checkpoint(rank_dir, config, checkpoint_tensors(model), max_shard_bytes=512 << 20)
        _copy_side_files(model_dir, rank_dir)
    if out_dir.exists():
        out_dir.rmdir()
    partial.rename(out_dir)
    return out_dir


def _copy_side_files(model_dir: Path, dest: Path) -> None:
    """Tokenizer, generation config, ...: everything but the tensors and the config (written anew)."""
    for f in model_dir.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name not in ("model.safetensors.index.json",
                                                                         "config.json", "BUILD"):
            shutil.copy2(f, dest / f.name)


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
            tensors.update(_float_tensors(name, p.numpy()))
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
    _copy_side_files(model_dir, partial)
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
