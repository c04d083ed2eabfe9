"""Where each tensor of an ERNIE-4.5 checkpoint goes, and the assembler that fills targets piece by piece.

Framework free (NumPy only): the Paddle loader (model/loader.py) fills an ErnieForCausalLM through it, and
the kernels backend (kernels_backend/weights.py) streams its device weights through it, on machines without Paddle
too. Each tensor is read in part, as much of it as this tensor-parallel rank keeps (`local_part`), in its stored
dtype (docs/loading.md).

Both checkpoint dialects ("-PT": model.*, torch [out, in], separate q/k/v and gate/up; "-Paddle": ernie.*,
[in, out], fused qkv_proj / up_gate_proj) map onto one parameter layout: Paddle's [in, out], q/k/v fused as
qkv_proj, gate/up fused as up_gate_proj (gate first), routed experts stacked.
"""
from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from .. import load_progress
from ..quantization.formats import (QUANT_TENSOR_SUFFIXES, REQUIRED_TENSORS, normalize_quantized, quantized_shape,
                                     shard_quantized)
from .config import ErnieModelConfig
from .parallel import SINGLE_RANK, ParallelLayout
from .safetensors_io import SafetensorsReader, iter_tensors, read_header

log = logging.getLogger(__name__)


@dataclass
class Piece:
    """Where one checkpoint tensor goes: `param[index] = tensor (transposed if torch layout)`."""

    param: str
    index: tuple = ()
    transpose: bool = False


@dataclass
class QuantPiece:
    """A pre-quantized tensor: `key` (quant_weight, weight_scale, ...) of the quantized weight `param`
    (expert `expert` of a stacked experts parameter, or None)."""

    param: str
    expert: int | None
    key: str


@dataclass
class KVScale:
    """A C8 KV cache static scale: `which` is "k" or "v"."""

    layer: int
    which: str


def rank_directories(model_dir: Path) -> list[Path]:
    """rank0/, rank1/, ... of a checkpoint split per tensor-parallel rank (FastDeploy's pre-sharded layout,
    e.g. W4A8C8-TP4); empty for a full checkpoint."""
    dirs = []
    while (model_dir / f"rank{len(dirs)}").is_dir():
        dirs.append(model_dir / f"rank{len(dirs)}")
    return dirs


def tensor_directory(model_dir: Path, layout: ParallelLayout | None = None) -> tuple[Path, bool]:
    """Where this rank's tensors are: the checkpoint itself (a full checkpoint, sliced while loading) or
    its rank directory (a pre-sharded one, already sliced: True). A pre-sharded checkpoint is served with
    exactly as many ranks as it was split for."""
    ranks = rank_directories(model_dir)
    if not ranks:
        return model_dir, False
    world, rank = (layout.world_size, layout.rank) if layout is not None else (1, 0)
    if len(ranks) != world:
        raise ValueError(f"{model_dir} is split for {len(ranks)} tensor-parallel ranks (rank0/ .. "
                         f"rank{len(ranks) - 1}/), so it must be served with tensor_parallel_size={len(ranks)}, "
                         f"not {world}; to serve another rank count, give the full (unsplit) checkpoint")
    return ranks[rank], True


def checkpoint_shards(model_dir: Path) -> list[Path]:
    """The safetensors files of one directory of tensors (a full checkpoint or one rank's directory)."""
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [model_dir / f for f in sorted(set(weight_map.values()))]
    shards = sorted(model_dir.glob("*.safetensors"))
    if not shards:
        hint = " (a pre-sharded checkpoint: see tensor_directory)" if rank_directories(model_dir) else ""
        raise FileNotFoundError(f"{model_dir}: no *.safetensors files and no model.safetensors.index.json{hint}")
    return shards


_LAYER = re.compile(r"^(?:model|ernie)\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|up_gate_proj)\.weight$")
_MLP = re.compile(r"^mlp\.(shared_experts\.)?(gate_proj|up_proj|down_proj|up_gate_proj)\.weight$")


def map_tensor_name(name: str, cfg: ErnieModelConfig) -> Piece | QuantPiece | KVScale | str | None:
    """A Piece for model weights, a QuantPiece / KVScale for quantized checkpoints' tensors, "mtp" for
    MTP-head tensors, "ignore" for known extras, None if unknown."""
    base, _, suffix = name.rpartition(".")
    if suffix in QUANT_TENSOR_SUFFIXES and ".mtp_" not in name:
        return _map_quant_tensor(name, base, suffix, cfg)
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


_KV_SCALE = re.compile(r"^(?:model|ernie)\.layers\.(\d+)\.self_attn\.cache([kv])_matmul$")


def _map_quant_tensor(name: str, base: str, suffix: str, cfg: ErnieModelConfig) -> QuantPiece | KVScale | None:
    m = _KV_SCALE.match(base)
    if m:
        return KVScale(int(m.group(1)), m.group(2)) if suffix == "activation_scale" else None
    piece = map_tensor_name(base + ".weight", cfg)
    if not isinstance(piece, Piece):
        return None
    expert = None
    if piece.param.endswith(("mlp.experts.up_gate_proj", "mlp.experts.down_proj")):
        expert, rest = piece.index[0], piece.index[1:]
    else:
        rest = piece.index
    if piece.transpose or any(r != slice(None) for r in rest):
        raise ValueError(f"pre-quantized tensor {name!r}: only the \"-Paddle\" layout (ernie.*, fused qkv_proj "
                         f"and up_gate_proj, [in, out]) is read for quantized weights")
    return QuantPiece(piece.param, expert, suffix)


def _is_torch_lm_head(cfg: ErnieModelConfig) -> bool:
    return cfg.raw.get("_checkpoint_layout", "torch") == "torch"


@dataclass
class Target:
    """A parameter the checkpoint fills. `sink` has `set_value(float array)` (a Paddle parameter, a host
    array holder), or is a quantized layer (`load_float` / `load_quantized` / `method`, a QuantLinear or its
    host twin), or is a list of quantized layers for stacked experts, each filled and quantized on its own."""

    shape: tuple
    sink: object

    @property
    def per_expert(self) -> bool:
        return isinstance(self.sink, list)

    def layer(self, expert: int | None):
        """The quantized layer taking this piece (None for a float parameter)."""
        sink = self.sink[expert] if self.per_expert else self.sink
        return sink if hasattr(sink, "load_quantized") else None

    def commit(self, expert: int | None, value: np.ndarray) -> None:
        """Hand a whole (expert of a) parameter to its sink. `value` is in the checkpoint's dtype (bf16 stays bf16):
        a sink that says `takes_stored_dtype` gets it so, a quantized layer gets a float32 copy to quantize (one
        matrix at a time), any other sink (a Paddle parameter) float32."""
        layer = self.layer(expert)
        if layer is not None:
            layer.load_float(np.asarray(value, np.float32))  # quantized now; the caller drops value
            return
        sink = self.sink[expert] if self.per_expert else self.sink
        if not getattr(sink, "takes_stored_dtype", False):
            value = np.ascontiguousarray(value, dtype=np.float32)
        sink.set_value(value)


def local_part(piece: Piece, value_shape: tuple[int, ...], layout: ParallelLayout,
               cfg: ErnieModelConfig) -> tuple[Piece, int | None, np.ndarray | None] | None:
    """This rank's part of a checkpoint piece whose value (in the parameter's layout) has `value_shape`: the piece
    indexed into the rank's shard of the parameter, and the value's axis and the indices along it the rank keeps
    (None, None: all of it); None when none of it belongs to this rank. Computed from shapes alone, so a reader
    can read just that part."""
    shard = layout.shard_of(piece.param, cfg)
    if shard is None:
        return piece, None, None
    axis, keep = shard
    index = list(piece.index) + [slice(None)] * (axis + 1 - len(piece.index))
    entry = index[axis]
    if isinstance(entry, int):  # one expert of stacked experts, under expert parallelism
        hit = np.flatnonzero(keep == entry)
        if not hit.size:
            return None
        index[axis] = int(hit[0])
        return Piece(piece.param, tuple(index)), None, None
    value_axis = axis - sum(isinstance(i, int) for i in index[:axis])  # integer entries drop their axis
    start = entry.start or 0
    stop = entry.stop if entry.stop is not None else start + value_shape[value_axis]
    pos = np.flatnonzero((keep >= start) & (keep < stop))
    if not pos.size:
        return None
    if pos[-1] - pos[0] + 1 != pos.size:
        raise AssertionError(f"shard of {piece.param} is not contiguous for {entry}")
    whole = pos.size == keep.size and all(i == slice(None) for j, i in enumerate(index) if j != axis)
    index[axis] = slice(None) if whole else slice(int(pos[0]), int(pos[-1]) + 1)
    while index and index[-1] == slice(None):
        index.pop()
    return Piece(piece.param, tuple(index)), value_axis, keep[pos] - start


def localize(piece: Piece, value: np.ndarray, layout: ParallelLayout,
             cfg: ErnieModelConfig) -> tuple[Piece, np.ndarray] | None:
    """This rank's part of a checkpoint piece (`value` already in the parameter's layout), indexed into
    the rank's shard of the parameter; None when none of it belongs to this rank."""
    part = local_part(piece, value.shape, layout, cfg)
    if part is None:
        return None
    local, axis, keep = part
    return local, (value if axis is None else np.take(value, keep, axis=axis))


class Assembler:
    """Fills targets piece by piece and tells which ones never got all their pieces.

    With a tensor-parallel layout, each piece of a full checkpoint is first cut down to this rank's part
    (`localize`; quantized weights with `formats.shard_quantized`). A pre-sharded checkpoint (`presharded`:
    a rank's own directory) already holds the rank's part of every tensor, under the full model's names;
    only routed experts under expert parallelism are renumbered (their global index to this rank's)."""

    def __init__(self, targets: dict[str, Target], layout: ParallelLayout | None = None,
                 cfg: ErnieModelConfig | None = None, presharded: bool = False):
        """`layout`: a tensor-parallel rank's ParallelLayout (None: one rank, every piece whole)."""
        self.targets = targets
        self.layout, self.cfg = layout, cfg
        self.presharded = presharded
        self.buffers: dict[tuple, np.ndarray] = {}
        self.buffer_filled: dict[tuple, int] = {}
        self.quant_parts: dict[tuple, dict[str, np.ndarray]] = {}
        self.filled: dict[str, int] = {}

    def _target(self, tensor_name: str, param: str) -> Target:
        if param not in self.targets:
            raise ValueError(f"checkpoint tensor {tensor_name!r} maps to {param!r}, which this model "
                             f"config does not have (check moe_layer_* / tie_word_embeddings in config.json)")
        return self.targets[param]

    def _shard(self, param: str) -> tuple[int, np.ndarray] | None:
        parallel = self.layout is not None and self.layout.is_parallel
        return self.layout.shard_of(param, self.cfg) if parallel else None

    def _local_expert(self, tensor_name: str, param: str, expert: int) -> int | None:
        """A routed expert's index among this rank's experts; None when another rank owns it."""
        shard = self._shard(param)
        if shard is None or shard[0] != 0:
            return expert  # every rank holds every expert (split by intermediate size, or one rank)
        hit = np.flatnonzero(shard[1] == expert)
        if not hit.size and self.presharded:
            raise ValueError(f"{tensor_name!r}: expert {expert} belongs to another expert-parallel rank, but it "
                             f"is in this rank's directory of a pre-sharded checkpoint (split for another layout?)")
        return int(hit[0]) if hit.size else None

    def _presharded_piece(self, tensor_name: str, piece: Piece) -> Piece:
        lead = piece.index[:1] if piece.index and isinstance(piece.index[0], int) else ()  # a routed expert
        if any(i != slice(None) for i in piece.index[len(lead):]):
            raise ValueError(f"pre-sharded checkpoint tensor {tensor_name!r} is part of {piece.param}: a rank's "
                             f"directory must use the fused \"-Paddle\" names (qkv_proj, up_gate_proj), whole")
        if not lead:
            return Piece(piece.param)
        expert = self._local_expert(tensor_name, piece.param, lead[0])
        return Piece(piece.param, (expert,))

    def put(self, tensor_name: str, piece: Piece, arr: np.ndarray) -> None:
        """A checkpoint tensor held whole in memory (the MTP head's, tests')."""
        target = self._target(tensor_name, piece.param)
        value = arr.T if piece.transpose else arr
        if self.presharded:
            piece = self._presharded_piece(tensor_name, piece)
        elif self.layout is not None and self.layout.is_parallel:
            local = localize(piece, value, self.layout, self.cfg)
            if local is None:
                return
            piece, value = local
        self._fill(tensor_name, arr.shape, target, piece, value)

    def put_from(self, reader: SafetensorsReader, tensor_name: str, piece: Piece) -> None:
        """Read only this rank's part of a checkpoint tensor (nothing when none of it is the rank's), in its stored
        dtype, and put it."""
        target = self._target(tensor_name, piece.param)
        shape, transpose = reader.tensors[tensor_name].shape, piece.transpose
        axis = keep = None
        if self.presharded:
            piece = self._presharded_piece(tensor_name, piece)
        elif self.layout is not None and self.layout.is_parallel:
            part = local_part(piece, shape[::-1] if transpose else shape, self.layout, self.cfg)
            if part is None:
                return
            piece, axis, keep = part
        if axis is not None and transpose:
            axis = len(shape) - 1 - axis  # the value's axis in the tensor as stored (transposed pieces are 2-D)
        self._fill(tensor_name, shape, target, piece, reader.read(tensor_name, axis, keep, transpose=transpose))

    def _fill(self, tensor_name: str, arr_shape: tuple, target: Target, piece: Piece, value: np.ndarray) -> None:
        """Put this rank's `value` (in the parameter's layout) where `piece` says: the whole target, or a piece of
        it that waits in a buffer (in the checkpoint's dtype) until all its pieces arrived."""
        shape, index, expert = target.shape, piece.index, None
        if target.per_expert:
            expert, index, shape = index[0], index[1:], shape[1:]
        if not index:
            if tuple(value.shape) != shape:
                raise ValueError(f"checkpoint tensor {tensor_name!r} has shape {list(arr_shape)}, expected "
                                 f"{list(shape[::-1]) if piece.transpose else list(shape)} for {piece.param}")
            target.commit(expert, value)
            self.filled[piece.param] = self.filled.get(piece.param, 0) + value.size
            return
        key = (piece.param, expert)
        buf = self.buffers.get(key)
        if buf is None:
            buf = self.buffers[key] = np.zeros(shape, value.dtype)
        if buf[index].shape != value.shape:
            raise ValueError(f"checkpoint tensor {tensor_name!r} has shape {list(arr_shape)}, which does not fit "
                             f"{piece.param}{list(buf[index].shape)} (check head_dim / intermediate sizes)")
        buf[index] = value
        self.filled[piece.param] = self.filled.get(piece.param, 0) + value.size
        self.buffer_filled[key] = self.buffer_filled.get(key, 0) + value.size
        if self.buffer_filled[key] == buf.size:
            del self.buffer_filled[key]
            target.commit(expert, self.buffers.pop(key))

    def put_quantized(self, tensor_name: str, piece: QuantPiece, arr: np.ndarray) -> None:
        target = self._target(tensor_name, piece.param)
        expert = piece.expert
        if expert is not None:
            expert = self._local_expert(tensor_name, piece.param, expert)
            if expert is None:
                return  # another expert-parallel rank's expert
        layer = target.layer(expert)
        if layer is None:
            raise ValueError(f"checkpoint tensor {tensor_name!r} is quantized but {piece.param} is fp32 in this "
                             f"load: quantization_config (dense_quant_type / moe_quant_type) must name its method")
        key = "weight_scale_inv" if layer.method == "block_wise_fp8" and piece.key == "weight_scale" else piece.key
        parts = self.quant_parts.setdefault((piece.param, expert), {})
        parts[key] = np.array(arr)
        if not all(k in parts for k in REQUIRED_TENSORS[layer.method]):
            return
        tensors = self.quant_parts.pop((piece.param, expert))
        shard = None if self.presharded else self._shard(piece.param)
        axis = None if shard is None else shard[0] - target.per_expert
        if axis is not None and axis >= 0:  # split by rows or columns, not whole experts
            k, n = quantized_shape(layer.method, np.shape(tensors["quant_weight"]))
            full = normalize_quantized(layer.method, tensors, k, n)
            tensors = shard_quantized(layer.method, full, axis, shard[1], what=piece.param)
        layer.load_quantized(tensors)
        n = layer.in_features * layer.out_features
        self.filled[piece.param] = self.filled.get(piece.param, 0) + n

    def missing(self) -> list[str]:
        return [n for n, t in self.targets.items() if self.filled.get(n, 0) != int(np.prod(t.shape))]


def note_checkpoint_layout(model_dir: Path, cfg: ErnieModelConfig) -> None:
    """Record in cfg whether the checkpoint is "-Paddle" (ernie.*) or "-PT": a lone lm_head.weight is laid
    out like the rest of its checkpoint."""
    ranks = rank_directories(model_dir)
    names = [n for s in checkpoint_shards(ranks[0] if ranks else model_dir) for n in read_header(s)[0]]
    cfg.raw["_checkpoint_layout"] = "paddle" if any(n.startswith("ernie.") for n in names) else "torch"


def fill_from_checkpoint(model_dir: Path, cfg: ErnieModelConfig, asm: Assembler,
                         show_progress: bool = True) -> tuple[dict[str, np.ndarray], dict[tuple[int, str], np.ndarray]]:
    """Stream every tensor of the checkpoint (this rank's directory of a pre-sharded one) into the assembler's
    targets; checks nothing is missing. Returns what is not a model weight: the MTP head's tensors, and C8 KV
    scales by (layer, "k" | "v") as the checkpoint holds them (full, or this rank's under pre-sharding)."""
    tensors_dir, asm.presharded = tensor_directory(model_dir, asm.layout)
    shards = checkpoint_shards(tensors_dir)
    total = sum(info["data_offsets"][1] - info["data_offsets"][0] for s in shards for info in read_header(s)[0].values())
    mtp: dict[str, np.ndarray] = {}
    kv_scales: dict[tuple[int, str], np.ndarray] = {}
    done = 0
    with tqdm(total=total, desc=f"Loading {tensors_dir.name}", unit="B", unit_scale=True, unit_divisor=1024,
              disable=not show_progress) as bar:
        for shard in shards:
            with SafetensorsReader(shard) as reader:
                for name, info in reader.tensors.items():
                    _fill_one(reader, name, map_tensor_name(name, cfg), asm, cfg, mtp, kv_scales)
                    done += info.nbytes  # of the checkpoint gone through (a rank reads its part of it)
                    bar.update(info.nbytes)
                    load_progress.tick("weights", done, total)
    missing = asm.missing()
    if missing:
        raise ValueError(f"checkpoint {model_dir} is missing tensors for: {', '.join(missing[:8])}"
                         + (f" and {len(missing) - 8} more" if len(missing) > 8 else ""))
    return mtp, kv_scales


def _fill_one(reader: SafetensorsReader, name: str, target, asm: Assembler, cfg: ErnieModelConfig,
              mtp: dict[str, np.ndarray], kv_scales: dict[tuple[int, str], np.ndarray]) -> None:
    """One checkpoint tensor to where map_tensor_name says. Model weights are read in part (this rank's) and in
    their stored dtype; the rest (MTP head, C8 KV scales, pre-quantized tensors) whole, floats widened to fp32."""
    if target is None:
        raise ValueError(f"unexpected tensor {name!r} in {reader.path.name}: not part of "
                         f"{cfg.architecture} with this config.json")
    if target == "mtp":
        mtp[name] = reader.read(name, widen=True)
    elif target == "ignore":
        log.info("ignoring %s (tie_word_embeddings is true)", name)
    elif isinstance(target, KVScale):
        kv_scales[(target.layer, target.which)] = reader.read(name, widen=True).astype(np.float32).reshape(-1)
    elif isinstance(target, QuantPiece):
        asm.put_quantized(name, target, reader.read(name, widen=True))
    else:
        asm.put_from(reader, name, target)


def static_kv_scales(scales: dict[tuple[int, str], np.ndarray],
                     num_layers: int) -> tuple[list[np.ndarray], list[np.ndarray]] | None:
    """Per-layer static C8 K and V scales when the checkpoint has them for every layer; None when it has
    none (the cache then uses dynamic per-block scales)."""
    if not scales:
        return None
    want = [(i, w) for i in range(num_layers) for w in "kv"]
    absent = [f"layers.{i}.self_attn.cache{w}_matmul.activation_scale" for i, w in want if (i, w) not in scales]
    if absent:
        raise ValueError(f"C8 KV cache: the checkpoint has static scales for some layers but not {absent[:4]}")
    return [scales[(i, "k")] for i in range(num_layers)], [scales[(i, "v")] for i in range(num_layers)]


def rank_kv_scales(scales: dict[tuple[int, str], np.ndarray], cfg: ErnieModelConfig,
                   layout: ParallelLayout | None = None) -> tuple[list[np.ndarray], list[np.ndarray]] | None:
    """static_kv_scales cut to the KV heads `layout`'s rank holds (a pre-sharded rank directory's are already)."""
    static = static_kv_scales(scales, cfg.num_hidden_layers)
    if static is None:
        return None
    heads = (layout or SINGLE_RANK).kv_heads(cfg)
    cols = slice(heads.start * cfg.head_dim, heads.stop * cfg.head_dim)
    local = len(heads) * cfg.head_dim

    def mine(s: np.ndarray) -> np.ndarray:
        if s.size == cfg.kv_size:
            return s[cols]
        if s.size == local:
            return s
        raise ValueError(f"C8 KV cache scales have {s.size} channels; expected {cfg.kv_size} (every KV head) or "
                         f"{local} (this rank's)")
    return [mine(s) for s in static[0]], [mine(s) for s in static[1]]


_MTP = re.compile(r"^(model|ernie)\.mtp_(emb_norm|hidden_norm|linear_proj|block)\.0\.(.+)$")


def map_mtp_tensor_name(name: str, cfg: ErnieModelConfig) -> Piece | None:
    """Where an MTP-head tensor goes in ErnieMTP ("-PT" `model.mtp_*` or "-Paddle" `ernie.mtp_*`); None if unknown.
    The block's tensors are named like a decoder layer's and map as one more layer would."""
    m = _MTP.match(name)
    if not m:
        return None
    prefix, part, rest = m.groups()
    if part in ("emb_norm", "hidden_norm", "linear_proj"):
        return Piece(f"{part}.weight", (), part == "linear_proj" and prefix == "model") if rest == "weight" else None
    layer = f"layers.{cfg.num_hidden_layers}."
    piece = map_tensor_name(f"{prefix}.{layer}{rest}", cfg)
    if not isinstance(piece, Piece):
        return None
    return Piece("block." + piece.param[len(layer):], piece.index, piece.transpose)


def fill_mtp(asm: "Assembler", tensors: dict[str, np.ndarray], cfg: ErnieModelConfig, source: str) -> None:
    """Fill an MTP head's targets (ErnieMTP's parameter names) from its checkpoint tensors; refuses none, unknown
    or missing ones, naming `source` (the checkpoint they came from)."""
    if not tensors:
        raise ValueError(f"{source} has no MTP-head tensors (model.mtp_* / ernie.mtp_*): speculative_config "
                         f"method 'mtp' needs them; give the MTP checkpoint as speculative_config.model")
    for name, arr in tensors.items():
        piece = map_mtp_tensor_name(name, cfg)
        if piece is None:
            raise ValueError(f"unexpected MTP tensor {name!r} in {source}: expected mtp_emb_norm / mtp_hidden_norm / "
                             f"mtp_linear_proj / mtp_block (one dense decoder layer), index 0")
        asm.put(name, piece, arr)
    missing = asm.missing()
    if missing:
        raise ValueError(f"{source} is missing MTP tensors for: {', '.join(missing[:8])}")


_SHARED_WITH_TARGET = {"model.embed_tokens.weight", "ernie.embed_tokens.weight", "model.norm.weight", "ernie.norm.weight",
                       "lm_head.weight"}


def read_mtp_checkpoint(path: str | Path, cfg: ErnieModelConfig) -> dict[str, np.ndarray]:
    """The MTP-head tensors of a separate checkpoint directory (speculative_config.model)."""
    out = {}
    for shard in checkpoint_shards(Path(path)):
        for name, arr, _code in iter_tensors(shard):
            if map_tensor_name(name, cfg) == "mtp":
                out[name] = np.array(arr, dtype=np.float32)
            elif name not in _SHARED_WITH_TARGET:  # the head uses the target's own copies of these
                raise ValueError(f"unexpected tensor {name!r} in the MTP checkpoint {path}: only mtp_* tensors "
                                 f"(and the shared embedding / norm / lm_head, which are not read) belong there")
    return out
