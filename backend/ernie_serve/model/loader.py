"""Load an ERNIE-4.5 checkpoint directory (HF "-PT" or "-Paddle" safetensors) into ErnieForCausalLM.

Where each checkpoint tensor goes is model/checkpoint_map.py's business (framework free); this module
builds the Paddle model and gives the assembler its parameters and quantized layers as targets. Tensors
stream one at a time from the checkpoint's files (model/safetensors_io.py's reader); a fused parameter is
assembled in a buffer until all its pieces arrived.

Quantized loading (a QuantPlan from `quantization=` or config.json's quantization_config): the model
is built with empty quantized layers, so no fp32 copy of a quantized weight is ever allocated whole.
A weight is quantized the moment its last piece arrives and its buffer dropped; stacked experts are
assembled and quantized one expert at a time. Pre-quantized tensors (`<linear>.quant_weight`,
`.weight_scale`, ...; "-Paddle" layout, experts one by one) go into those layers as they are.

Tensor-parallel loading (a ParallelLayout): every rank reads only its slice of each tensor of the full
checkpoint (model/parallel.py says which), so the model it builds holds only its shard. Quantized
weights: online quantization quantizes the rank's slice (as FastDeploy does); a pre-quantized full
checkpoint's tensors are split in their quantized form (formats.shard_quantized), so every rank count
serves the same quantized weights. A checkpoint already split per rank (rank0/, rank1/, ...: FastDeploy's
pre-sharded layout, or scripts/shard_checkpoint.py's) is read from the rank's own directory.
"""
from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import paddle

from .layer_builder import FLOAT_LAYERS
from .quantized_layers import QuantizedLayers, QuantLinear, QuantMoEExperts
from ..quantization.plan import QuantPlan
from .checkpoint_map import (Assembler, Target, fill_from_checkpoint, fill_mtp, note_checkpoint_layout,
                             rank_kv_scales, tensor_directory)
from .config import ErnieModelConfig
from .ernie import ErnieForCausalLM
from .kv_cache import KVCacheQuant
from .parallel import SINGLE_RANK, ParallelLayout

log = logging.getLogger(__name__)


def _targets(model: ErnieForCausalLM) -> dict[str, Target]:
    """Checkpoint targets by Piece.param name: every parameter, and the quantized layers under the
    name their float weight would have (`<path>.weight`, `<experts>.up_gate_proj` / `.down_proj`)."""
    targets = {n: Target(tuple(p.shape), p) for n, p in model.named_parameters()}
    in_experts = set()
    for path, layer in model.named_sublayers():
        if isinstance(layer, QuantMoEExperts):
            for kind in ("up_gate_proj", "down_proj"):
                linears = list(getattr(layer, kind))
                in_experts.update(id(q) for q in linears)
                first = linears[0]
                targets[f"{path}.{kind}"] = Target((len(linears), first.in_features, first.out_features), linears)
    for path, layer in model.named_sublayers():
        if isinstance(layer, QuantLinear) and id(layer) not in in_experts:
            targets[f"{path}.weight"] = Target((layer.in_features, layer.out_features), layer)
    return targets


def load_model(model_dir: str | Path, num_output_ids: int | None = None, show_progress: bool = True,
               cfg: ErnieModelConfig | None = None, quantization: str | None = None,
               layout: ParallelLayout = SINGLE_RANK) -> ErnieForCausalLM:
    """Build the model and fill it from the checkpoint; MTP tensors land in `model.mtp_weights`.

    `quantization` (wint8 | wint4 | block_wise_fp8 | wint2): quantize a float checkpoint while loading.
    A checkpoint whose config.json has a quantization_config is loaded as that config says.
    `layout`: build and fill only this tensor-parallel rank's shard.
    """
    model_dir = Path(model_dir)
    cfg = cfg or ErnieModelConfig.from_pretrained(model_dir)
    note_checkpoint_layout(model_dir, cfg)
    plan = QuantPlan.resolve(quantization, cfg.quantization_config)
    paddle.nn.initializer.set_global_initializer(paddle.nn.initializer.Constant(0.0),
                                                 paddle.nn.initializer.Constant(0.0))
    try:
        layers = QuantizedLayers(plan) if plan and plan.quantizes_weights else FLOAT_LAYERS
        model = ErnieForCausalLM(cfg, num_output_ids, layers=layers, layout=layout)
    finally:
        paddle.nn.initializer.set_global_initializer(None, None)
    model.eval()
    for p in model.parameters():
        p.stop_gradient = True
    mtp, kv_scales = fill_from_checkpoint(model_dir, cfg, Assembler(_targets(model), layout, cfg), show_progress)
    model.mtp_weights = mtp
    if plan is not None and plan.kv_cache == "int8":
        model.kv_cache_quant = _kv_cache_quant(kv_scales, cfg, layout)
    elif kv_scales:
        log.info("ignoring the checkpoint's C8 KV scales: quantization_config has no kv_cache_quant_type")
    return model


def _kv_cache_quant(scales: dict[tuple[int, str], np.ndarray], cfg: ErnieModelConfig,
                    layout: ParallelLayout) -> KVCacheQuant:
    """Static channel-wise scales when the checkpoint has them for every layer, else dynamic ones."""
    static = rank_kv_scales(scales, cfg, layout)
    return KVCacheQuant() if static is None else KVCacheQuant(*static)


def load_mtp(cfg: ErnieModelConfig, tensors: dict[str, np.ndarray], source: str,
             layout: ParallelLayout = SINGLE_RANK, presharded: bool = False) -> "ErnieMTP":
    """The MTP head from its checkpoint tensors (`model.mtp_weights`, or a separate MTP checkpoint's); `layout`:
    this tensor-parallel rank's part of it (`presharded`: the tensors are a rank directory's, already cut)."""
    from .mtp import ErnieMTP

    paddle.nn.initializer.set_global_initializer(paddle.nn.initializer.Constant(0.0),
                                                 paddle.nn.initializer.Constant(0.0))
    try:
        mtp = ErnieMTP(cfg, layout)
    finally:
        paddle.nn.initializer.set_global_initializer(None, None)
    mtp.eval()
    for p in mtp.parameters():
        p.stop_gradient = True
    fill_mtp(Assembler(_targets(mtp), layout, cfg, presharded), tensors, cfg, source)
    return mtp


def load_mtp_head(model: ErnieForCausalLM, model_dir: str | Path, source: str | None) -> "ErnieMTP":
    """The target's MTP head, on the target's layout: from the checkpoint's own mtp_* tensors (source None) or
    from a separate MTP checkpoint (speculative_config.model)."""
    from .checkpoint_map import read_mtp_checkpoint

    if source:
        weights, presharded = read_mtp_checkpoint(source, model.config), False
    else:
        weights, presharded = model.mtp_weights, tensor_directory(Path(model_dir), model.layout)[1]
    head = load_mtp(model.config, weights, source or str(model_dir), model.layout, presharded)
    model.mtp_weights = {}  # loaded into the head; the float copies are not needed twice
    return head


