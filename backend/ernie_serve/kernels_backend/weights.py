"""The model's weights for the kernels backend: read from the checkpoint into host arrays, then placed on the
device once, in the form the kernels read.

Reading needs no Paddle (model/checkpoint_map.py maps and assembles; quantization/formats.py quantizes), so
the same loader serves a torch-only GPU box. A quantized weight is quantized the moment its last piece
arrives, one expert at a time, so no fp32 copy of a quantized matrix is ever held whole. On the device:
float weights in the activation dtype (bf16 on a GPU), the router gate and its bias in fp32, quantized
weights as int8 / packed int4 / fp8 / wint2 codes plus their scales, routed experts stacked [E, ...].
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..model.checkpoint_map import (Assembler, Target, fill_from_checkpoint, fill_mtp, note_checkpoint_layout,
                                    rank_kv_scales, read_mtp_checkpoint)
from ..model.config import ErnieModelConfig
from ..model.parallel import SINGLE_RANK, ParallelLayout
from ..quantization import formats as fmt
from ..quantization.plan import QuantPlan
from .framework import TensorOps

log = logging.getLogger(__name__)


class HostFloat:
    """An assembler sink for a float parameter."""

    def __init__(self):
        self.value: np.ndarray | None = None

    def set_value(self, v: np.ndarray) -> None:
        self.value = np.array(v, dtype=np.float32)


class HostQuant:
    """An assembler sink for a quantized matrix [K, N]: holds formats.normalize_quantized's tensors."""

    def __init__(self, method: str, in_features: int, out_features: int):
        self.method = fmt.check_method(method)
        self.in_features, self.out_features = in_features, out_features
        self.tensors: dict[str, np.ndarray] | None = None

    def load_float(self, w_KN: np.ndarray, **calibration) -> None:
        if tuple(np.shape(w_KN)) != (self.in_features, self.out_features):
            raise ValueError(f"a [{self.in_features}, {self.out_features}] {self.method} weight got shape "
                             f"{list(np.shape(w_KN))}")
        self.load_quantized(fmt.quantize_float(w_KN, self.method, **calibration))

    def load_quantized(self, tensors: dict[str, np.ndarray], *, transposed: bool = False) -> None:
        self.tensors = fmt.normalize_quantized(self.method, tensors, self.in_features, self.out_features,
                                               transposed=transposed)


def _linear_sink(k: int, n: int, method: str | None) -> HostFloat | HostQuant:
    return HostFloat() if method is None else HostQuant(method, k, n)


def host_targets(cfg: ErnieModelConfig, plan: QuantPlan | None,
                 layout: ParallelLayout = SINGLE_RANK) -> dict[str, Target]:
    """Every parameter of the model (by checkpoint_map's names) with a host sink of the right kind, shaped as
    `layout`'s rank holds it (model/parallel.py: the vocabulary, heads and intermediate sizes split)."""
    h, dense = cfg.hidden_size, plan.dense if plan else None
    vocab = len(layout.split(cfg.vocab_size))
    t: dict[str, Target] = {"embed_tokens.weight": Target((vocab, h), HostFloat()),
                            "norm.weight": Target((h,), HostFloat())}
    if not cfg.tie_word_embeddings:
        t["lm_head.weight"] = Target((h, vocab), HostFloat())
    for i in range(cfg.num_hidden_layers):
        layer_targets(t, f"layers.{i}.", cfg, cfg.is_moe_layer(i), dense, plan.moe_method(i) if plan else None, layout)
    return t


def layer_targets(t: dict[str, Target], p: str, cfg: ErnieModelConfig, moe: bool, dense: str | None,
                  moe_method: str | None, layout: ParallelLayout = SINGLE_RANK) -> None:
    """A decoder layer's parameters under prefix p (a target layer's `layers.{i}.`, the MTP head's `block.`), as
    `layout`'s rank holds them."""
    h, hd, ranks = cfg.hidden_size, cfg.head_dim, layout.world_size

    def linear(name: str, k: int, n: int, method: str | None) -> None:
        t[name] = Target((k, n), _linear_sink(k, n, method))

    q, kv = len(layout.query_heads(cfg)) * hd, len(layout.kv_heads(cfg)) * hd
    t[p + "input_layernorm.weight"] = Target((h,), HostFloat())
    t[p + "post_attention_layernorm.weight"] = Target((h,), HostFloat())
    linear(p + "self_attn.qkv_proj.weight", h, q + 2 * kv, dense)
    linear(p + "self_attn.o_proj.weight", q, h, dense)
    if moe:
        e, inter = len(layout.experts(cfg)), layout.expert_intermediate(cfg)
        t[p + "mlp.gate.weight"] = Target((h, cfg.moe_num_experts), HostFloat())
        t[p + "mlp.gate.e_score_correction_bias"] = Target((1, cfg.moe_num_experts), HostFloat())
        for kind, k, n in (("up_gate_proj", h, 2 * inter), ("down_proj", inter, h)):
            sink = HostFloat() if moe_method is None else [HostQuant(moe_method, k, n) for _ in range(e)]
            t[p + f"mlp.experts.{kind}"] = Target((e, k, n), sink)
        if cfg.moe_num_shared_experts:
            shared = cfg.moe_intermediate_size * cfg.moe_num_shared_experts // ranks
            linear(p + "mlp.shared_experts.up_gate_proj.weight", h, 2 * shared, dense)
            linear(p + "mlp.shared_experts.down_proj.weight", shared, h, dense)
    else:
        inter = cfg.intermediate_size // ranks
        linear(p + "mlp.up_gate_proj.weight", h, 2 * inter, dense)
        linear(p + "mlp.down_proj.weight", inter, h, dense)


# ---------------------------------------------------------------- on the device

@dataclass
class DeviceLinear:
    """One linear [K, N] on the device: a float weight, or quantized codes plus scales."""

    in_features: int
    out_features: int
    method: str | None
    weight: Any  # float [K, N] or quant_weight
    scale: Any = None  # weight_scale [N] (wint8 / wint4) or weight_scale_inv [K/128, N/128] (block_wise_fp8)

    @classmethod
    def place(cls, ops: TensorOps, sink: HostFloat | HostQuant) -> "DeviceLinear":
        if isinstance(sink, HostFloat):
            k, n = sink.value.shape
            return cls(k, n, None, ops.tensor(sink.value, ops.act_dtype))
        t = sink.tensors
        if sink.method not in DENSE_METHODS:
            raise ValueError(f"a dense linear quantized as {sink.method!r}: the kernels backend runs dense layers in "
                             f"{', '.join(DENSE_METHODS)} (FastDeploy's wint2 / w4a8 use wint8 for them)")
        return cls(sink.in_features, sink.out_features, sink.method, ops.tensor(t["quant_weight"]),
                   ops.tensor(t[scale_key(sink.method)]))


DENSE_METHODS = ("wint8", "wint4", "block_wise_fp8")
WINT2_SCALES = tuple(k for k in fmt.REQUIRED_TENSORS["wint2"] if k != "quant_weight")  # as fused_moe takes them


def scale_key(method: str) -> str:
    """The checkpoint name of a method's weight scale (block_wise_fp8's 128x128 block scales are *_inv)."""
    return "weight_scale_inv" if method == "block_wise_fp8" else "weight_scale"


def device_bytes(*parts: Any) -> int:
    """Device bytes of tensors, however nested in the Device* dataclasses, dicts and lists (None counts 0)."""
    total = 0
    for p in parts:
        if p is None:
            continue
        if hasattr(p, "__dataclass_fields__"):
            total += device_bytes(*(getattr(p, f) for f in p.__dataclass_fields__))
        elif isinstance(p, dict):
            total += device_bytes(*p.values())
        elif isinstance(p, (list, tuple)):
            total += device_bytes(*p)
        elif hasattr(p, "element_size"):
            total += TensorOps.nbytes(p)
    return total


@dataclass
class DeviceExperts:
    """Routed experts stacked [E, ...]: up_gate [E, H, 2I] (gate first), down [E, I, H], float or quantized
    (scales as ernie_kernels.fused_moe takes them)."""

    method: str | None
    up_gate: Any
    down: Any
    up_gate_scale: Any = None
    down_scale: Any = None
    up_gate_act_scale: Any = None
    down_act_scale: Any = None


def place_experts(ops: TensorOps, up_gate: HostFloat | list[HostQuant],
                  down: HostFloat | list[HostQuant]) -> DeviceExperts:
    if isinstance(up_gate, HostFloat):
        return DeviceExperts(None, ops.tensor(up_gate.value, ops.act_dtype), ops.tensor(down.value, ops.act_dtype))
    method = up_gate[0].method

    def stacked(sinks: list[HostQuant], key: str) -> np.ndarray:
        return np.stack([s.tensors[key] for s in sinks])

    def scales(sinks: list[HostQuant]) -> Any:
        if method == "wint2":
            return {k: ops.tensor(stacked(sinks, k)) for k in WINT2_SCALES}
        return ops.tensor(stacked(sinks, scale_key(method)))

    act = {}
    if method == "w4a8":
        act = {"up_gate_act_scale": ops.tensor(stacked(up_gate, "activation_scale").reshape(-1)),
               "down_act_scale": ops.tensor(stacked(down, "activation_scale").reshape(-1))}
    return DeviceExperts(method, ops.tensor(stacked(up_gate, "quant_weight")), ops.tensor(stacked(down, "quant_weight")),
                         scales(up_gate), scales(down), **act)


@dataclass
class DeviceLayer:
    input_norm: Any
    post_norm: Any
    qkv: DeviceLinear
    o: DeviceLinear
    mlp_up_gate: DeviceLinear | None = None  # a dense layer's MLP, or an MoE layer's shared experts
    mlp_down: DeviceLinear | None = None
    gate: Any = None  # router [H, E] fp32 (MoE layers)
    gate_bias: Any = None  # [E] fp32
    experts: DeviceExperts | None = None

    @property
    def is_moe(self) -> bool:
        return self.experts is not None


def place_layer(ops: TensorOps, sink: dict[str, Any], p: str, moe: bool) -> DeviceLayer:
    """The decoder layer under prefix p (layer_targets' names) on the device; its sinks are taken from `sink`."""
    layer = DeviceLayer(
        input_norm=ops.tensor(sink.pop(p + "input_layernorm.weight").value),
        post_norm=ops.tensor(sink.pop(p + "post_attention_layernorm.weight").value),
        qkv=DeviceLinear.place(ops, sink.pop(p + "self_attn.qkv_proj.weight")),
        o=DeviceLinear.place(ops, sink.pop(p + "self_attn.o_proj.weight")))
    mlp = p + ("mlp.shared_experts." if moe else "mlp.")
    if mlp + "up_gate_proj.weight" in sink:
        layer.mlp_up_gate = DeviceLinear.place(ops, sink.pop(mlp + "up_gate_proj.weight"))
        layer.mlp_down = DeviceLinear.place(ops, sink.pop(mlp + "down_proj.weight"))
    if moe:
        layer.gate = ops.tensor(sink.pop(p + "mlp.gate.weight").value)
        layer.gate_bias = ops.tensor(sink.pop(p + "mlp.gate.e_score_correction_bias").value.reshape(-1))
        layer.experts = place_experts(ops, sink.pop(p + "mlp.experts.up_gate_proj"), sink.pop(p + "mlp.experts.down_proj"))
    return layer


@dataclass
class DeviceMTP:
    """The MTP head (model/mtp.py has its math): its norms, linear_proj split into the halves that multiply the
    normed embedding and the normed hidden state (so no [T, 2H] concatenation is built), one dense decoder layer.
    Float weights, as the reference backend keeps them."""

    emb_norm: Any
    hidden_norm: Any
    embed_proj: DeviceLinear  # linear_proj[:H]
    hidden_proj: DeviceLinear  # linear_proj[H:]
    block: DeviceLayer


def place_mtp(ops: TensorOps, cfg: ErnieModelConfig, tensors: dict[str, np.ndarray], source: str,
              layout: ParallelLayout = SINGLE_RANK) -> DeviceMTP:
    """The MTP head from its checkpoint tensors (the target checkpoint's mtp_* ones, or a separate MTP checkpoint's).
    Under tensor parallelism its decoder layer is split as a target layer is; linear_proj is replicated."""
    h = cfg.hidden_size
    t = {"emb_norm.weight": Target((h,), HostFloat()), "hidden_norm.weight": Target((h,), HostFloat()),
         "linear_proj.weight": Target((2 * h, h), HostFloat())}
    layer_targets(t, "block.", cfg, moe=False, dense=None, moe_method=None, layout=layout)
    fill_mtp(Assembler(t, layout, cfg), tensors, cfg, source)
    sink = {name: target.sink for name, target in t.items()}
    proj = sink.pop("linear_proj.weight").value
    halves = [HostFloat() for _ in range(2)]
    halves[0].set_value(proj[:h])
    halves[1].set_value(proj[h:])
    return DeviceMTP(ops.tensor(sink.pop("emb_norm.weight").value), ops.tensor(sink.pop("hidden_norm.weight").value),
                     DeviceLinear.place(ops, halves[0]), DeviceLinear.place(ops, halves[1]),
                     place_layer(ops, sink, "block.", moe=False))


@dataclass
class DeviceWeights:
    embed: Any  # [V, H]; a tensor-parallel rank's vocabulary rows [V/N, H] from vocab_start
    norm: Any
    lm_head: Any  # [H, V] (a rank's [H, V/N]), or None when tied to embed
    layers: list[DeviceLayer]
    kv_scales: tuple[list[Any], list[Any]] | None = None  # static C8 scales per layer (K, V)
    mtp: DeviceMTP | None = None  # speculative_config method "mtp"
    vocab_start: int = 0  # the first vocabulary row this rank holds

    @property
    def nbytes(self) -> int:
        """Resident bytes of the model's weights (the C8 scales belong to the KV cache)."""
        return device_bytes(self.embed, self.norm, self.lm_head, self.layers, self.mtp)


# K (and for fp8 experts N) of every matrix a method's kernels read must be a multiple of its block
_ALIGN = {"block_wise_fp8": 128, "wint2": 64}


def check_kernel_shapes(cfg: ErnieModelConfig, plan: QuantPlan | None, layout: ParallelLayout = SINGLE_RANK) -> None:
    """Refuse at start-up a quantization whose kernels cannot tile this model's matrices (a rank's slices of them
    under tensor parallelism)."""
    if plan is None or not plan.quantizes_weights:
        return
    n = layout.world_size
    dense_k = [cfg.hidden_size, len(layout.query_heads(cfg)) * cfg.head_dim]
    if any(not cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers)):
        dense_k.append(cfg.intermediate_size // n)
    if cfg.moe_num_shared_experts:
        dense_k.append(cfg.moe_intermediate_size * cfg.moe_num_shared_experts // n)
    moe_dims = [cfg.hidden_size, layout.expert_intermediate(cfg)]
    checks = [(plan.dense, "dense", dense_k)]
    checks += [(plan.moe_method(i), "MoE", moe_dims) for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)]
    for method, where, dims in checks:
        align = _ALIGN.get(method)
        bad = sorted({d for d in dims if align and d % align})
        if bad:
            split = f" split over tensor_parallel_size={n}" if n > 1 else ""
            raise ValueError(f"{method} {where} weights need every matrix dimension the kernels tile to be a multiple "
                             f"of {align}; this model{split} has {bad} (hidden_size {cfg.hidden_size}, intermediate "
                             f"sizes {cfg.intermediate_size} / {cfg.moe_intermediate_size}): choose another "
                             f"--quantization" + (" or a smaller tensor_parallel_size" if n > 1 else ""))


def load_device_weights(model_dir: str | Path, cfg: ErnieModelConfig, ops: TensorOps, quantization: str | None,
                        show_progress: bool = True, mtp: dict | None = None,
                        layout: ParallelLayout = SINGLE_RANK) -> tuple[DeviceWeights, QuantPlan | None]:
    """Read the checkpoint (quantizing as FastDeploy's --quantization / the checkpoint's quantization_config
    say) and place every weight on the device. Returns the weights and the resolved quantization plan.
    `mtp`: an "mtp" speculative_config: the MTP head is placed too, from its "model" checkpoint if it names one.
    `layout`: a tensor-parallel rank's, which then holds its slices (a full or a pre-sharded checkpoint)."""
    model_dir = Path(model_dir)
    note_checkpoint_layout(model_dir, cfg)
    plan = QuantPlan.resolve(quantization, cfg.quantization_config)
    check_kernel_shapes(cfg, plan, layout)
    targets = host_targets(cfg, plan if plan and plan.quantizes_weights else None, layout)
    mtp_tensors, kv_scales = fill_from_checkpoint(model_dir, cfg, Assembler(targets, layout, cfg), show_progress)
    sink = {name: t.sink for name, t in targets.items()}
    layers = [place_layer(ops, sink, f"layers.{i}.", cfg.is_moe_layer(i)) for i in range(cfg.num_hidden_layers)]
    lm_head = sink.pop("lm_head.weight", None)
    weights = DeviceWeights(ops.tensor(sink.pop("embed_tokens.weight").value, ops.act_dtype),
                            ops.tensor(sink.pop("norm.weight").value),
                            None if lm_head is None else ops.tensor(lm_head.value, ops.act_dtype), layers,
                            vocab_start=layout.split(cfg.vocab_size).start)
    if mtp is not None:
        source = mtp.get("model")
        weights.mtp = place_mtp(ops, cfg, read_mtp_checkpoint(source, cfg) if source else mtp_tensors,
                                source or str(model_dir), layout)
    if plan is not None and plan.kv_cache == "int8":
        static = rank_kv_scales(kv_scales, cfg, layout)
        if static is not None:
            weights.kv_scales = ([ops.tensor(s) for s in static[0]], [ops.tensor(s) for s in static[1]])
    elif kv_scales:
        log.info("ignoring the checkpoint's C8 KV scales: quantization_config has no kv_cache_quant_type")
    return weights, plan
