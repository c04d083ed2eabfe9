"""A step sent to the tensor-parallel workers as what changed since the last one, as vLLM v1 does.

A StepInput's block tables are most of its bytes and grow with context length (a [B, nb] table padded
to the longest sequence), yet from one decode step to the next a request's table changes only by the
blocks appended as it grows. So the driver's StepDeltaEncoder sends, per row, the request's key, where
its new tokens start, how many there are, and only the blocks the worker has not seen (or the whole
table, marked replaced, when it was rewritten: a preemption, a draft rewind that shrank it, a request
that skipped a step). Each worker's PersistentBatch keeps the tables and rebuilds the StepInput the
driver encoded, array for array, with the driver's own AttentionMetadata.build.

Both sides keep the tables of the last step's rows only: a key absent from a step is forgotten on both
sides by that one rule, so no removal message exists, state stays bounded by the batch size, and a
request that comes back is sent whole. Whether a table is sent as appended blocks is decided by its
contents (the remembered table must be a prefix of the current one), never by what happened to the
request, so the driver need not notice preemptions or rewinds, and a key reused across steps would
still be sent right (only two rows of one step must not share a key).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..model.attention_metadata import AttentionMetadata
from ..step_contract import (MAX_BATCHED_QUERY, KVOp, StepInput, kv_ops_from_json, kv_ops_to_json, pack_frames,
                             unpack_frames)

_EMPTY = np.zeros(0, dtype=np.int64)
_ARRAYS = ("token_ids", "sample_rows", "row_keys", "starts", "query_lens", "replaced", "num_new_blocks",
           "new_blocks")


@dataclass
class StepDelta:
    """What one step message carries. Positions, seq_lens, query_start_loc, slot_mapping, the padded block
    tables and num_decodes are not in it: the worker derives them from the rows and its tables."""
    token_ids: np.ndarray = field(default_factory=lambda: _EMPTY)  # [T] as in the StepInput
    sample_rows: np.ndarray = field(default_factory=lambda: _EMPTY)  # [R] as in the StepInput
    row_keys: np.ndarray = field(default_factory=lambda: _EMPTY)  # [B] Request.row_key of each row
    starts: np.ndarray = field(default_factory=lambda: _EMPTY)  # [B] tokens cached before this step
    query_lens: np.ndarray = field(default_factory=lambda: _EMPTY)  # [B] tokens computed this step
    replaced: np.ndarray = field(default_factory=lambda: _EMPTY)  # [B] 1: the row's blocks are its whole table
    num_new_blocks: np.ndarray = field(default_factory=lambda: _EMPTY)  # [B] how many of new_blocks are the row's
    new_blocks: np.ndarray = field(default_factory=lambda: _EMPTY)  # every row's blocks, concatenated in row order
    max_position: int = 0
    kv_ops: list[KVOp] = field(default_factory=list)

    def to_frames(self) -> list[bytes | np.ndarray]:
        return pack_frames({"max_position": self.max_position, "kv_ops": kv_ops_to_json(self.kv_ops)},
                           [getattr(self, name) for name in _ARRAYS])

    @classmethod
    def from_frames(cls, frames: list) -> "StepDelta":
        header, arrays = unpack_frames(frames)
        return cls(**dict(zip(_ARRAYS, arrays)), max_position=header["max_position"],
                   kv_ops=kv_ops_from_json(header["kv_ops"]))


class StepDeltaEncoder:
    """The driver's side: remembers the block table it last sent for each row key."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self._tables: dict[int, list[int]] = {}

    def encode(self, step: StepInput) -> list[bytes | np.ndarray]:
        return self.delta(step).to_frames()

    def delta(self, step: StepInput) -> StepDelta:
        rows = len(step.seq_lens)
        keys = step.row_keys.tolist()
        if len(keys) != rows:
            raise ValueError(f"StepInput.row_keys must name each of the step's {rows} rows, got {len(keys)} keys: "
                             "tensor-parallel workers keep each request's block table under its key "
                             "(ModelRunner.execute fills it from Request.row_key)")
        if len(set(keys)) != rows:
            raise ValueError(f"StepInput.row_keys must be distinct, got {keys}")
        query_lens = np.diff(step.query_start_loc) if rows else _EMPTY
        # AttentionMetadata.build copies only the blocks a row's tokens fill and pads with 0: the rest of a
        # padded row is not the request's. Lists, not arrays: per-row NumPy calls made this several times slower.
        need = (-(-step.seq_lens // self.block_size)).tolist()
        tables, replaced, num_new, new_blocks = {}, [], [], []
        for key, padded, nb in zip(keys, step.block_tables.tolist(), need):
            table = padded[:nb]
            sent = self._tables.get(key)
            is_prefix = sent is not None and table[: len(sent)] == sent  # False when the table shrank
            new = table[len(sent):] if is_prefix else table
            replaced.append(0 if is_prefix else 1)
            num_new.append(len(new))
            new_blocks.extend(new)
            tables[key] = table
        self._tables = tables  # the last step's rows only: the worker forgets by the same rule
        return StepDelta(step.token_ids, step.sample_rows, step.row_keys, step.seq_lens - query_lens, query_lens,
                         np.asarray(replaced, dtype=np.int64), np.asarray(num_new, dtype=np.int64),
                         np.asarray(new_blocks, dtype=np.int64), step.max_position, step.kv_ops)


class PersistentBatch:
    """A worker's side: keeps the block tables of the last step's rows and rebuilds each step from its delta."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self._tables: dict[int, list[int]] = {}

    def apply(self, frames: list) -> StepInput:
        return self.rebuild(StepDelta.from_frames(frames))

    def rebuild(self, d: StepDelta) -> StepInput:
        keys, blocks, tables, end = d.row_keys.tolist(), d.new_blocks.tolist(), {}, 0
        for key, replaced, n in zip(keys, d.replaced.tolist(), d.num_new_blocks.tolist()):
            new, end = blocks[end : end + n], end + n
            if replaced:
                tables[key] = new
            elif key in self._tables:
                tables[key] = self._tables[key] + new
            else:
                raise RuntimeError(f"the step appends {n} blocks to request key {key}, whose table this worker "
                                   "does not hold (it was not in the last step): the driver's StepDeltaEncoder "
                                   "and this PersistentBatch are out of step, which is a bug")
        self._tables = tables
        if not keys:  # a KV-ops-only step
            return StepInput(token_ids=d.token_ids, sample_rows=d.sample_rows, max_position=d.max_position,
                             kv_ops=d.kv_ops, row_keys=d.row_keys)
        if len(d.token_ids) != d.query_lens.sum():
            raise RuntimeError(f"the step carries {len(d.token_ids)} tokens for rows computing "
                               f"{int(d.query_lens.sum())}: its message is corrupt")
        meta = AttentionMetadata.build(d.query_lens, d.starts + d.query_lens, [tables[k] for k in keys],
                                       self.block_size, None, d.max_position, MAX_BATCHED_QUERY)
        row_of_token = np.repeat(np.arange(len(keys)), d.query_lens)
        positions = np.repeat(d.starts - meta.query_start_loc[:-1], d.query_lens) + np.arange(len(d.token_ids))
        bs = self.block_size
        slots = meta.block_tables[row_of_token, positions // bs] * bs + positions % bs
        return StepInput(d.token_ids, positions, meta.query_start_loc, meta.seq_lens, meta.block_tables, slots,
                         d.sample_rows, meta.num_decodes, d.max_position, d.kv_ops, d.row_keys)
