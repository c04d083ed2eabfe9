"""The model's weights for the kernels backend: streamed from the checkpoint onto the device, tensor by tensor, in
the form the kernels read.

Reading needs no Paddle (model/checkpoint_map.py maps and assembles; quantization/formats.py quantizes), so the
same loader serves a torch-only GPU box. Each rank reads only its slices of the checkpoint, in the stored dtype
(bf16 stays bf16 until the device casts it), and every parameter goes to the device the moment its last piece
arrives; routed experts are written one by one into their stacked [E, ...] device tensors. A quantized weight is
quantized when its last piece arrives, one matrix (one expert) at a time. So the host holds, besides the file
reads, at most one tensor's slice, the parameter it belongs to while that one is assembled from pieces (q/k/v into
qkv, gate/up into up_gate, one expert's), and for a quantized one its fp32 working copy and codes: never a layer,
never the shard (docs/loading.md has the figures). On the device: float weights in the activation dtype (bf16 on
a GPU), norms, the router gate and its bias in fp32, quantized weights as int8 / packed int4 / fp8 / wint2 codes
plus their scales, routed experts stacked [E, ...].
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from ..model.checkpoint_map import (Assembler, Target, fill_from_checkpoint, fill_mtp, note_checkpoint_layout,
                                    rank_kv_scales, read_mtp_checkpoint)
from ..model.config import ErnieModelConfig
from ..model.parallel import SINGLE_RANK, ParallelLayout
from ..quantization import formats as fmt
from ..quantization.plan import QuantPlan
from .framework import TensorOps, dtype_name

log = logging.getLogger(__name__)
ACT = "act"  # a FloatSink's dtype: the ops' activation dtype (bf16 on a GPU, fp32 in the interpreter)


class FloatSink:
    """An assembler sink for a float parameter: on the device as soon as it is whole, in `dtype` (ACT or float32),
    reshaped to `device_shape` when given. It takes the checkpoint's dtype: the device casts."""

    takes_stored_dtype = True

    def __init__(self, ops: TensorOps, shape: tuple[int, ...], dtype: str = ACT,
                 device_shape: tuple[int, ...] | None = None):
        self.ops, self.shape, self.device_shape = ops, tuple(shape), device_shape
        self.dtype = ops.act_dtype if dtype == ACT else dtype
        self.tensor: Any = None

    def set_value(self, v: np.ndarray) -> None:
        v = np.asarray(v)
        self.tensor = self.ops.tensor(v if self.device_shape is None else v.reshape(self.device_shape), self.dtype)


class HostFloat:
    """An assembler sink that keeps a float parameter on the host in fp32 (the MTP head's linear_proj, split in two
    before it is placed)."""

    def __init__(self):
        self.value: np.ndarray | None = None

    def set_value(self, v: np.ndarray) -> None:
        self.value = np.array(v, dtype=np.float32)


class QuantSink:
    """An assembler sink for a quantized matrix [K, N]: quantizes a float weight, normalizes pre-quantized ones
    (formats.normalize_quantized), and hands the host tensors to `place`, keeping what it returns (`tensors`)."""

    def __init__(self, method: str, in_features: int, out_features: int,
                 place: Callable[[dict[str, np.ndarray]], dict[str, Any]]):
        self.method = fmt.check_method(method)
        self.in_features, self.out_features = in_features, out_features
        self.tensors: dict[str, Any] | None = None
        self._place = place

    def load_float(self, w_KN: np.ndarray, **calibration) -> None:
        if tuple(np.shape(w_KN)) != (self.in_features, self.out_features):
            raise ValueError(f"a [{self.in_features}, {self.out_features}] {self.method} weight got shape "
                             f"{list(np.shape(w_KN))}")
        self.load_quantized(fmt.quantize_float(w_KN, self.method, **calibration))

    def load_quantized(self, tensors: dict[str, np.ndarray], *, transposed: bool = False) -> None:
        host = fmt.normalize_quantized(self.method, tensors, self.in_features, self.out_features, transposed=transposed)
        self.tensors = self._place(host)


class DeviceQuant(QuantSink):
    """A quantized dense linear: its tensors on the device as soon as it is quantized (or read pre-quantized)."""

    def __init__(self, ops: TensorOps, method: str, in_features: int, out_features: int):
        if method not in DENSE_METHODS:
            raise ValueError(f"a dense linear quantized as {method!r}: the kernels backend runs dense layers in "
                             f"{', '.join(DENSE_METHODS)} (FastDeploy's wint2 / w4a8 use wint8 for them)")
        super().__init__(method, in_features, out_features, lambda t: {k: ops.tensor(v) for k, v in t.items()})


class ExpertStack:
    """A layer's routed experts of one kind (up_gate or down) as stacked device tensors [E, ...]: each expert is
    written into its row as soon as it is whole (quantized, when it is quantized), so only one expert at a time is
    ever on the host. `sinks` are the per-expert sinks the assembler fills (a Target's list)."""

    def __init__(self, ops: TensorOps, num_experts: int, k: int, n: int, method: str | None):
        self.ops, self.num_experts, self.method = ops, num_experts, method
        self.device: dict[str, Any] = {}  # "weight" (float), or the method's tensors: quant_weight, scales, ...
        if method is None:
            sinks = [_StackedFloat(self, e) for e in range(num_experts)]
        else:
            sinks = [QuantSink(method, k, n, place=lambda t, e=e: self.put(e, t)) for e in range(num_experts)]
        self.sinks = ExpertSinks(sinks, self)

    def put(self, expert: int, tensors: dict[str, np.ndarray]) -> dict:
        for key, arr in tensors.items():
            if key == "activation_scale":
                arr = np.asarray(arr).reshape(())  # one value an expert: the stack is [E]
            src = self.ops.tensor(arr, self.ops.act_dtype if key == "weight" else None)
            if key not in self.device:
                self.device[key] = self.ops.empty([self.num_experts, *arr.shape], dtype_name(src))
            self.ops.copy_(self.device[key][expert], src)
        return {}  # the sink keeps nothing: its tensors are in the stack now


class ExpertSinks(list):
    """The per-expert sinks of one ExpertStack (a Target's list of sinks), and the stack they fill."""

    def __init__(self, sinks: list, stack: ExpertStack):
        super().__init__(sinks)
        self.stack = stack


class _StackedFloat:
    """One float expert of an ExpertStack."""

    takes_stored_dtype = True

    def __init__(self, stack: ExpertStack, expert: int):
        self.stack, self.expert = stack, expert

    def set_value(self, v: np.ndarray) -> None:
        self.stack.put(self.expert, {"weight": v})


def _linear_sink(ops: TensorOps, k: int, n: int, method: str | None) -> FloatSink | DeviceQuant:
    return FloatSink(ops, (k, n)) if method is None else DeviceQuant(ops, method, k, n)


def host_targets(ops: TensorOps, cfg: ErnieModelConfig, plan: QuantPlan | None,
                 layout: ParallelLayout = SINGLE_RANK) -> dict[str, Target]:
    """Every parameter of the model (by checkpoint_map's names) with a sink that places it on `ops`' device, shaped
    as `layout`'s rank holds it (model/parallel.py: the vocabulary, heads and intermediate sizes split)."""
    h, dense = cfg.hidden_size, plan.dense if plan else None
    vocab = len(layout.split(cfg.vocab_size))
    t: dict[str, Target] = {"embed_tokens.weight": Target((vocab, h), FloatSink(ops, (vocab, h))),
                            "norm.weight": Target((h,), FloatSink(ops, (h,), "float32"))}
    if not cfg.tie_word_embeddings:
        t["lm_head.weight"] = Target((h, vocab), FloatSink(ops, (h, vocab)))
    for i in range(cfg.num_hidden_layers):
        layer_targets(ops, t, f"layers.{i}.", cfg, cfg.is_moe_layer(i), dense, plan.moe_method(i) if plan else None,
                      layout)
    return t


def layer_targets(ops: TensorOps, t: dict[str, Target], p: str, cfg: ErnieModelConfig, moe: bool, dense: str | None,
                  moe_method: str | None, layout: ParallelLayout = SINGLE_RANK) -> None:
    """A decoder layer's parameters under prefix p (a target layer's `layers.{i}.`, the MTP head's `block.`), as
    `layout`'s rank holds them."""
    h, hd, ranks = cfg.hidden_size, cfg.head_dim, layout.world_size

    def linear(name: str, k: int, n: int, method: str | None) -> None:
        t[name] = Target((k, n), _linear_sink(ops, k, n, method))

    q, kv = len(layout.query_heads(cfg)) * hd, len(layout.kv_heads(cfg)) * hd
    t[p + "input_layernorm.weight"] = Target((h,), FloatSink(ops, (h,), "float32"))
    t[p + "post_attention_layernorm.weight"] = Target((h,), FloatSink(ops, (h,), "float32"))
    linear(p + "self_attn.qkv_proj.weight", h, q + 2 * kv, dense)
    linear(p + "self_attn.o_proj.weight", q, h, dense)
    if moe:
        e, inter, experts = len(layout.experts(cfg)), layout.expert_intermediate(cfg), cfg.moe_num_experts
        t[p + "mlp.gate.weight"] = Target((h, experts), FloatSink(ops, (h, experts), "float32"))
        t[p + "mlp.gate.e_score_correction_bias"] = Target((1, experts),
                                                           FloatSink(ops, (1, experts), "float32", (experts,)))
        for kind, k, n in (("up_gate_proj", h, 2 * inter), ("down_proj", inter, h)):
            t[p + f"mlp.experts.{kind}"] = Target((e, k, n), ExpertStack(ops, e, k, n, moe_method).sinks)
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
    def of(cls, sink: FloatSink | DeviceQuant) -> "DeviceLinear":
        """The linear a filled sink placed."""
        if isinstance(sink, FloatSink):
            return cls(*sink.shape, None, sink.tensor)
        t = sink.tensors
        return cls(sink.in_features, sink.out_features, sink.method, t["quant_weight"], t[scale_key(sink.method)])


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


def experts_of(up_gate: ExpertSinks, down: ExpertSinks) -> DeviceExperts:
    """The stacked experts that two ExpertStacks' sinks placed."""
    ug, dn = up_gate.stack.device, down.stack.device
    method = up_gate.stack.method
    if method is None:
        return DeviceExperts(None, ug["weight"], dn["weight"])

    def scales(stack: dict[str, Any]) -> Any:
        return {k: stack[k] for k in WINT2_SCALES} if method == "wint2" else stack[scale_key(method)]

    act = {}
    if method == "w4a8":
        act = {"up_gate_act_scale": ug["activation_scale"], "down_act_scale": dn["activation_scale"]}
    return DeviceExperts(method, ug["quant_weight"], dn["quant_weight"], scales(ug), scales(dn), **act)


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


def layer_of(sink: dict[str, Any], p: str, moe: bool) -> DeviceLayer:
    """The decoder layer under prefix p (layer_targets' names) that its filled sinks placed; taken from `sink`."""
    layer = DeviceLayer(
        input_norm=sink.pop(p + "input_layernorm.weight").tensor,
        post_norm=sink.pop(p + "post_attention_layernorm.weight").tensor,
        qkv=DeviceLinear.of(sink.pop(p + "self_attn.qkv_proj.weight")),
        o=DeviceLinear.of(sink.pop(p + "self_attn.o_proj.weight")))
    mlp = p + ("mlp.shared_experts." if moe else "mlp.")
    if mlp + "up_gate_proj.weight" in sink:
        layer.mlp_up_gate = DeviceLinear.of(sink.pop(mlp + "up_gate_proj.weight"))
        layer.mlp_down = DeviceLinear.of(sink.pop(mlp + "down_proj.weight"))
    if moe:
        layer.gate = sink.pop(p + "mlp.gate.weight").tensor
        layer.gate_bias = sink.pop(p + "mlp.gate.e_score_correction_bias").tensor
        layer.experts = experts_of(sink.pop(p + "mlp.experts.up_gate_proj"), sink.pop(p + "mlp.experts.down_proj"))
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
    t = {"emb_norm.weight": Target((h,), FloatSink(ops, (h,), "float32")),
         "hidden_norm.weight": Target((h,), FloatSink(ops, (h,), "float32")),
         "linear_proj.weight": Target((2 * h, h), HostFloat())}
    layer_targets(ops, t, "block.", cfg, moe=False, dense=None, moe_method=None, layout=layout)
    fill_mtp(Assembler(t, layout, cfg), tensors, cfg, source)
    sink = {name: target.sink for name, target in t.items()}
    proj = sink.pop("linear_proj.weight").value
    halves = [FloatSink(ops, (h, h)) for _ in range(2)]
    halves[0].set_value(proj[:h])
    halves[1].set_value(proj[h:])
    return DeviceMTP(sink.pop("emb_norm.weight").tensor, sink.pop("hidden_norm.weight").tensor,
                     DeviceLinear.of(halves[0]), DeviceLinear.of(halves[1]), layer_of(sink, "block.", moe=False))


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
    """Stream the checkpoint onto the device (quantizing as FastDeploy's --quantization / the checkpoint's
    quantization_config say), each weight placed as soon as it is read. Returns the weights and the resolved
    quantization plan.
    `mtp`: an "mtp" speculative_config: the MTP head is placed too, from its "model" checkpoint if it names one.
    `layout`: a tensor-parallel rank's, which then holds its slices (a full or a pre-sharded checkpoint)."""
    model_dir = Path(model_dir)
    note_checkpoint_layout(model_dir, cfg)
    plan = QuantPlan.resolve(quantization, cfg.quantization_config)
    check_kernel_shapes(cfg, plan, layout)
    targets = host_targets(ops, cfg, plan if plan and plan.quantizes_weights else None, layout)
    mtp_tensors, kv_scales = fill_from_checkpoint(model_dir, cfg, Assembler(targets, layout, cfg), show_progress)
    sink = {name: t.sink for name, t in targets.items()}
    layers = [layer_of(sink, f"layers.{i}.", cfg.is_moe_layer(i)) for i in range(cfg.num_hidden_layers)]
    lm_head = sink.pop("lm_head.weight", None)
    weights = DeviceWeights(sink.pop("embed_tokens.weight").tensor, sink.pop("norm.weight").tensor,
                            None if lm_head is None else lm_head.tensor, layers,
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
