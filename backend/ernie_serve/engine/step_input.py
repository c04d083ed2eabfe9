"""One engine step as plain index data: what every tensor-parallel rank needs to run it, and nothing else.

The driver (model_runner.ModelRunner) builds it from the scheduler's output; a ModelShard executes it
(engine/model_shard.py). It holds no Request: token ids, positions, the attention metadata's index
arrays, the KV swaps/copies to apply first and which rows to compute logits for, so it crosses a
process boundary as a JSON header plus raw array bytes (no pickling).

Tensor-parallel workers are not sent it whole: the driver sends what changed since the last step
(engine/persistent_batch.py) and each worker rebuilds this same StepInput from its own copy of the
block tables. `row_keys` names each row's request for that; the shards never read it.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

import numpy as np

from ..model.attention_metadata import AttentionMetadata
from .kv_cache_manager import KVOp

_EMPTY = np.zeros(0, dtype=np.int64)
_ARRAYS = ("token_ids", "positions", "query_start_loc", "seq_lens", "block_tables", "slot_mapping", "sample_rows",
           "row_keys")
# Sequences computing at most this many tokens share the batched attention path: they are the step's first
# num_decodes rows. Defined here, next to num_decodes, so the driver and the workers that rebuild a step
# (persistent_batch.py) count decodes by one rule.
MAX_BATCHED_QUERY = 8


@dataclass
class StepInput:
    token_ids: np.ndarray = field(default_factory=lambda: _EMPTY)  # [T] int64, the step's tokens flattened
    positions: np.ndarray = field(default_factory=lambda: _EMPTY)  # [T] int64
    query_start_loc: np.ndarray = field(default_factory=lambda: _EMPTY)  # [B+1] int64 (AttentionMetadata's)
    seq_lens: np.ndarray = field(default_factory=lambda: _EMPTY)  # [B] int64
    block_tables: np.ndarray = field(default_factory=lambda: _EMPTY.reshape(0, 0))  # [B, nb] int64
    slot_mapping: np.ndarray = field(default_factory=lambda: _EMPTY)  # [T] int64
    sample_rows: np.ndarray = field(default_factory=lambda: _EMPTY)  # [R] rows whose logits are computed
    num_decodes: int = 0
    max_position: int = 0
    kv_ops: list[KVOp] = field(default_factory=list)  # applied before the forward, in this order
    row_keys: np.ndarray = field(default_factory=lambda: _EMPTY)  # [B] int64 each row's Request.row_key

    @classmethod
    def for_tokens(cls, token_ids: np.ndarray, positions: np.ndarray, meta: AttentionMetadata,
                   sample_rows: np.ndarray, kv_ops: list[KVOp], row_keys: np.ndarray = _EMPTY) -> "StepInput":
        return cls(token_ids, positions, meta.query_start_loc, meta.seq_lens, meta.block_tables, meta.slot_mapping,
                   sample_rows, meta.num_decodes, meta.max_position, kv_ops, row_keys)

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    def attention_metadata(self, block_size: int) -> AttentionMetadata:
        return AttentionMetadata(self.query_start_loc, self.seq_lens, self.block_tables, self.slot_mapping,
                                 self.num_decodes, block_size, self.max_position)

    def to_frames(self) -> list[bytes | np.ndarray]:
        return pack_frames({"num_decodes": self.num_decodes, "max_position": self.max_position,
                            "kv_ops": kv_ops_to_json(self.kv_ops)},
                           [getattr(self, name) for name in _ARRAYS])

    @classmethod
    def from_frames(cls, frames: list) -> "StepInput":
        header, arrays = unpack_frames(frames)
        return cls(**dict(zip(_ARRAYS, arrays)), num_decodes=header["num_decodes"],
                   max_position=header["max_position"], kv_ops=kv_ops_from_json(header["kv_ops"]))


def pack_frames(header: dict, arrays: list[np.ndarray]) -> list[bytes | np.ndarray]:
    """A JSON header (the arrays' shapes added to it), then each array's raw int64 bytes: no pickling."""
    arrays = [np.ascontiguousarray(a, dtype=np.int64) for a in arrays]
    header = dict(header, shapes=[list(a.shape) for a in arrays])
    return [json.dumps(header).encode()] + [a.reshape(-1).view(np.uint8) for a in arrays]


def unpack_frames(frames: list) -> tuple[dict, list[np.ndarray]]:
    """pack_frames' header and arrays; the arrays are read-only views of the frames."""
    header = json.loads(bytes(frames[0]))
    return header, [np.frombuffer(frame, dtype=np.int64).reshape(shape)
                    for frame, shape in zip(frames[1:], header["shapes"])]


def kv_ops_to_json(ops: list[KVOp]) -> list[list]:
    return [[op.kind, op.src, op.dst] for op in ops]


def kv_ops_from_json(ops: list[list]) -> list[KVOp]:
    return [KVOp(kind, src, dst) for kind, src, dst in ops]
