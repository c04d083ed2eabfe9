"""cpu_layer.c's descriptors as ctypes structures, and its one entry point: a stack of decoder layers run over the
step's hidden states in place. model/cpu_layers.py fills the descriptors from a loaded model; the structures mirror
the C typedefs field for field (the C file is the reference for what each field means)."""
from __future__ import annotations

import ctypes

import numpy as np

from . import build

_P, _F, _I32 = ctypes.c_void_p, ctypes.c_float, ctypes.c_int32


class Linear(ctypes.Structure):
    _fields_ = [("w", _P), ("scale", _P), ("k", _I32), ("n", _I32), ("bits", _I32), ("act_scale", _F)]


class Experts(ctypes.Structure):
    _fields_ = [("up_gate", _P), ("down", _P), ("up_gate_scale", _P), ("down_scale", _P), ("up_gate_act", _P),
                ("down_act", _P), ("router", _P),
                ("router_bias", _P), ("num_experts", _I32), ("top_k", _I32), ("up_gate_cols", _I32), ("bits", _I32),
                ("norm_min", _F), ("_pad", _F)]


class Layer(ctypes.Structure):
    _fields_ = [("input_norm", _P), ("post_norm", _P), ("qkv", Linear), ("o", Linear), ("mlp_up_gate", Linear),
                ("mlp_down", Linear), ("experts", ctypes.POINTER(Experts)), ("k_cache", _P), ("v_cache", _P)]


class Dims(ctypes.Structure):
    _fields_ = [("hidden", _I32), ("num_heads", _I32), ("num_kv_heads", _I32), ("head_dim", _I32), ("eps", _F),
                ("attn_scale", _F), ("kv_bf16", _I32), ("_pad", _I32)]


class Step(ctypes.Structure):
    _fields_ = [("num_tokens", _I32), ("num_seqs", _I32), ("block_size", _I32), ("table_stride", _I32),
                ("positions", _P), ("slot_mapping", _P), ("block_tables", _P), ("query_start_loc", _P),
                ("seq_lens", _P), ("cos", _P), ("sin", _P), ("num_positions", ctypes.c_int64),
                ("num_blocks", ctypes.c_int64)]


def work_floats(dims: Dims, layers: ctypes.Array, num_tokens: int) -> int:
    """The float32 work buffer decoder_layers needs for a step of num_tokens."""
    return int(build.library().ernie_decoder_layers_work(ctypes.byref(dims), layers, len(layers), num_tokens))


def decoder_layers(dims: Dims, layers: ctypes.Array, step: Step, x: np.ndarray, work: np.ndarray) -> np.ndarray:
    """Runs every layer of `layers` over x [num_tokens, hidden] float32 (C-contiguous) in place. `work`: the float32
    buffer the caller keeps between steps; returned as it is, or a larger one when this step needs more. A step whose
    positions, slots, block tables or sequence bounds are out of range (cpu_layer.c's step_in_range) raises
    ValueError with x untouched."""
    need = work_floats(dims, layers, step.num_tokens)
    if work.dtype != np.float32 or work.size < need:
        work = np.empty(need, np.float32)
    rc = build.library().ernie_decoder_layers(ctypes.byref(dims), layers, len(layers), ctypes.byref(step),
                                              x.ctypes.data, work.ctypes.data)
    if rc == -2:
        raise ValueError(f"cpu_layer.c: a step of {step.num_tokens} tokens in {step.num_seqs} sequences has a position, "
                         f"slot, block table entry or sequence bound outside the model's {step.num_positions} "
                         f"positions and its cache of {step.num_blocks} blocks of {step.block_size}")
    if rc != 0:
        raise MemoryError("cpu_layer.c: a kernel could not allocate its work memory")
    return work
