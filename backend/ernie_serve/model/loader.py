"""Load an ERNIE-4.5 checkpoint directory (HF "-PT" or "-Paddle" safetensors) into ErnieForCausalLM.

Both dialects map onto one parameter layout: Paddle's [in, out], q/k/v fused as qkv_proj, gate/up
fused as up_gate_proj (gate first), routed experts stacked. Tensors stream shard by shard from
memory-mapped files; a fused parameter is assembled in a buffer until all its pieces arrived.
"""
from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import paddle
from tqdm.auto import tqdm

from .config import ErnieModelConfig
from .ernie import ErnieForCausalLM
from .safetensors_io import iter_tensors, read_header

log = logging.getLogger(__name__)


@dataclass
class Piece:
    """Where one checkpoint tensor goes: `param[index] = tensor (transposed if torch layout)`."""

    param: str
    index: tuple = ()
    transpose: bool = False


def checkpoint_shards(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [model_dir / f for f in sorted(set(weight_map.values()))]
    shards = sorted(model_dir.glob("*.safetensors"))
    if not shards:
        raise FileNotFoundError(f"{model_dir}: no *.safetensors files and no model.safetensors.index.json")
    return shards


_LAYER = re.compile(r"^(?:model|ernie)\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|up_gate_proj)\.weight$")
_MLP = re.compile(r"^mlp\.(shared_experts\.)?(gate_proj|up_proj|down_proj|up_gate_proj)\.weight$")


def map_tensor_name(name: str, cfg: ErnieModelConfig) -> Piece | str | None:
    """A Piece for model weights, "mtp" for MTP-head tensors, "ignore" for known extras, None if unknown."""
    torch_layout = name.startswith("model.") or (name == "lm_head.weight" and _is_torch_lm_head(cfg))
    if ".mtp_" in name or name.startswith(("model.mtp", "ernie.mtp")):
        return "mtp"
    if name in ("model.embed_tokens.weight", "ernie.embed_tokens.weight"):
        return Piece("embed_tokens.weight")
    if name in ("model.norm.weight", "ernie.norm.weight"):
        return Piece("norm.weight")
    if name == "lm_head.weight":
        return "ignore" if cfg.tie_word_embeddings else Piece("lm_head.weight", (), torch_layout)
    m = _LAYER.match(name)
    if not m:
        return None
    layer, rest = int(m.group(1)), m.group(2)
    p = f"layers.{layer}."
    if rest in ("input_layernorm.weight", "post_attention_layernorm.weight"):
        return Piece(p + rest)
    q, kv = cfg.q_size, cfg.kv_size
    qkv = {"self_attn.q_proj.weight": (0, q), "self_attn.k_proj.weight": (q, q + kv),
           "self_attn.v_proj.weight": (q + kv, q + 2 * kv)}
    if rest in qkv:
        a, b = qkv[rest]
        return Piece(p + "self_attn.qkv_proj.weight", (slice(None), slice(a, b)), True)
    if rest in ("self_attn.qkv_proj.weight", "self_attn.o_proj.weight"):
        return Piece(p + rest, (), torch_layout)
    if rest == "mlp.gate.weight":
        return Piece(p + "mlp.gate.weight", (), torch_layout)
    if rest in ("mlp.moe_statics.e_score_correction_bias", "mlp.gate.moe_statics.e_score_correction_bias"):
        return Piece(p + "mlp.gate.e_score_correction_bias")
    m = _EXPERT.match(rest)
    if m:
        e, kind = int(m.group(1)), m.group(2)
        inter = cfg.moe_intermediate_size
        if kind == "down_proj":
            return Piece(p + "mlp.experts.down_proj", (e,), torch_layout)
        cols = {"gate_proj": slice(0, inter), "up_proj": slice(inter, 2 * inter), "up_gate_proj": slice(None)}[kind]
        return Piece(p + "mlp.experts.up_gate_proj", (e, slice(None), cols), torch_layout)
    m = _MLP.match(rest)
    if m:
        shared, kind = m.group(1) or "", m.group(2)
        base = p + "mlp." + shared
        if kind in ("down_proj", "up_gate_proj"):
            return Piece(base + kind + ".weight", (), torch_layout)
        inter = cfg.intermediate_size if not shared else cfg.moe_intermediate_size * cfg.moe_num_shared_experts
        cols = slice(0, inter) if kind == "gate_proj" else slice(inter, 2 * inter)
        return Piece(base + "up_gate_proj.weight", (slice(None), cols), True)
    return None


def _is_torch_lm_head(cfg: ErnieModelConfig) -> bool:
    return cfg.raw.get("_checkpoint_layout", "torch") == "torch"


class _Assembler:
    """Fills parameters piece by piece and tells which ones never got all their pieces."""

    def __init__(self, params: dict[str, paddle.Tensor]):
        self.params = params
        self.buffers: dict[str, np.ndarray] = {}
        self.filled: dict[str, int] = {}

    def put(self, tensor_name: str, piece: Piece, arr: np.ndarray) -> None:
        if piece.param not in self.params:
            raise ValueError(f"checkpoint tensor {tensor_name!r} maps to {piece.param!r}, which this model "
                             f"config does not have (check moe_layer_* / tie_word_embeddings in config.json)")
        param = self.params[piece.param]
        value = arr.T if piece.transpose else arr
        shape = tuple(param.shape)
        if not piece.index:
            if tuple(value.shape) != shape:
                raise ValueError(f"checkpoint tensor {tensor_name!r} has shape {list(arr.shape)}, expected "
                                 f"{list(shape[::-1]) if piece.transpose else list(shape)} for {piece.param}")
            param.set_value(np.ascontiguousarray(value, dtype=np.float32))
            self.filled[piece.param] = int(np.prod(shape))
            return
        buf = self.buffers.get(piece.param)
        if buf is None:
            buf = self.buffers[piece.param] = np.zeros(shape, np.float32)
        if buf[piece.index].shape != value.shape:
            raise ValueError(f"checkpoint tensor {tensor_name!r} has shape {list(arr.shape)}, which does not fit "
                             f"{piece.param}{list(buf[piece.index].shape)} (check head_dim / intermediate sizes)")
        buf[piece.index] = value
        self.filled[piece.param] = self.filled.get(piece.param, 0) + value.size
        if self.filled[piece.param] == buf.size:
            param.set_value(self.buffers.pop(piece.param))

    def missing(self) -> list[str]:
        return [n for n, p in self.params.items() if self.filled.get(n, 0) != int(np.prod(p.shape))]


def load_model(model_dir: str | Path, num_output_ids: int | None = None, show_progress: bool = True,
               cfg: ErnieModelConfig | None = None) -> ErnieForCausalLM:
    """Build the model and fill it from the checkpoint; MTP tensors land in `model.mtp_weights`."""
    model_dir = Path(model_dir)
    cfg = cfg or ErnieModelConfig.from_pretrained(model_dir)
    shards = checkpoint_shards(model_dir)
    names = [n for s in shards for n in read_header(s)[0]]
    cfg.raw["_checkpoint_layout"] = "paddle" if any(n.startswith("ernie.") for n in names) else "torch"
    paddle.nn.initializer.set_global_initializer(paddle.nn.initializer.Constant(0.0),
                                                 paddle.nn.initializer.Constant(0.0))
    try:
        model = ErnieForCausalLM(cfg, num_output_ids)
    finally:
        paddle.nn.initializer.set_global_initializer(None, None)
    model.eval()
    params = dict(model.named_parameters())
    for p in params.values():
        p.stop_gradient = True
    asm = _Assembler(params)
    mtp: dict[str, np.ndarray] = {}
    with tqdm(total=len(names), desc=f"Loading {model_dir.name}", unit="tensor", disable=not show_progress) as bar:
        for shard in shards:
            for name, arr, _code in iter_tensors(shard):
                target = map_tensor_name(name, cfg)
                if target is None:
                    raise ValueError(f"unexpected tensor {name!r} in {shard.name}: not part of "
                                     f"{cfg.architecture} with this config.json")
                if target == "mtp":
                    mtp[name] = np.array(arr, dtype=np.float32)
                elif target == "ignore":
                    log.info("ignoring %s (tie_word_embeddings is true)", name)
                else:
                    asm.put(name, target, arr)
                bar.update(1)
    missing = asm.missing()
    if missing:
        raise ValueError(f"checkpoint {model_dir} is missing tensors for: {', '.join(missing[:8])}"
                         + (f" and {len(missing) - 8} more" if len(missing) > 8 else ""))
    model.mtp_weights = mtp
    return model
