"""Persistent device buffers for a step's index data, filled from a StepInput on the host.

Every step writes its token ids, positions, slot mapping, block tables, sequence lengths and attention
programs into the leading rows of buffers allocated once at their largest size, so the kernels always read
the same memory: what a CUDA graph needs to replay a captured step on new inputs, and no per-step
allocation otherwise. A decode step padded to a graph bucket (cuda_graphs.py) writes padding rows that
touch nothing: slot -1 (not written), one visible key, logits dropped. The step's split-KV attention count
(ernie_kernels.unified_attention.kv_splits) is decided here too.
"""
from __future__ import annotations

import numpy as np

from ..step_contract import StepInput
from .framework import TensorOps
from .model import StepTensors


class StepBuffers:
    def __init__(self, ops: TensorOps, max_tokens: int, max_seqs: int, max_blocks_per_seq: int, group: int,
                 dynamic_kv: bool, kv_heads: int = 1, split_kv_target: int = 0):
        """group: query heads per KV head (it sets how many queries one attention program serves);
        split_kv_target: the attention programs a step should reach by splitting its keys (0: never split)."""
        self.ops = ops
        self.max_tokens, self.max_seqs, self.max_blocks = max_tokens, max_seqs, max_blocks_per_seq
        self.group, self.kv_heads, self.split_kv_target = group, kv_heads, split_kv_target
        self.token_ids = ops.zeros([max_tokens], "int64")
        self.positions = ops.zeros([max_tokens], "int64")
        self.slot_mapping = ops.zeros([max_tokens], "int64")
        self.query_start_loc = ops.zeros([max_seqs + 1], "int32")
        self.seq_lens = ops.zeros([max_seqs], "int32")
        self.block_tables = ops.zeros([max_seqs, max_blocks_per_seq], "int32")
        self.prog_seq = ops.zeros([max_tokens + max_seqs], "int32")
        self.prog_q = ops.zeros([max_tokens + max_seqs], "int32")
        self.logit_rows = ops.zeros([max_tokens], "int64")
        self.kv_runs = ops.zeros([max_tokens, 4], "int32") if dynamic_kv else None

    def fill(self, step: StepInput, block_size: int, pad_seqs_to: int | None = None) -> StepTensors:
        """Write a step (optionally a decode-only step padded to `pad_seqs_to` sequences of one token each)."""
        from ernie_kernels.kv_write import block_runs
        from ernie_kernels.unified_attention import attention_programs, kv_splits, queries_per_program

        ids, pos, slots = step.token_ids, step.positions, step.slot_mapping
        qsl, lens, tables = step.query_start_loc, step.seq_lens, step.block_tables
        rows = step.sample_rows
        b = len(lens)
        if pad_seqs_to is not None and pad_seqs_to > b:
            pad = pad_seqs_to - b
            ids = np.concatenate([ids, np.zeros(pad, np.int64)])
            pos = np.concatenate([pos, np.zeros(pad, np.int64)])
            slots = np.concatenate([slots, np.full(pad, -1, np.int64)])
            qsl = np.concatenate([qsl, qsl[-1] + 1 + np.arange(pad)])
            lens = np.concatenate([lens, np.ones(pad, np.int64)])
            tables = np.concatenate([tables, np.zeros((pad, tables.shape[1]), np.int64)])
            rows = np.arange(pad_seqs_to, dtype=np.int64)
            b = pad_seqs_to
        t = len(ids)
        if t > self.max_tokens or b > self.max_seqs or tables.shape[1] > self.max_blocks:
            raise ValueError(f"step of {t} tokens, {b} sequences, {tables.shape[1]} blocks a sequence exceeds the "
                             f"buffers ({self.max_tokens}, {self.max_seqs}, {self.max_blocks})")
        full_tables = np.zeros((b, self.max_blocks), np.int32)
        full_tables[:, : tables.shape[1]] = tables
        q_lens = np.diff(qsl)
        block_q = queries_per_program(self.group, int(q_lens.max()) if b else 1)
        prog_seq, prog_q = attention_programs(qsl, block_q)
        # a padded (graph) step decides from the longest possible context, so the captured split count holds for
        # every replay of its bucket
        longest = self.max_blocks * block_size if pad_seqs_to is not None else int(lens.max()) if b else 0
        splits = kv_splits(len(prog_seq), self.kv_heads, longest, self.split_kv_target)
        w = self.ops.write
        runs = None
        if self.kv_runs is not None:
            runs = w(self.kv_runs, block_runs(slots, block_size))
        return StepTensors(
            token_ids=w(self.token_ids, ids.astype(np.int64)), positions=w(self.positions, pos.astype(np.int64)),
            slot_mapping=w(self.slot_mapping, slots.astype(np.int64)),
            query_start_loc=w(self.query_start_loc, qsl.astype(np.int32)),
            seq_lens=w(self.seq_lens, lens.astype(np.int32)), block_tables=w(self.block_tables, full_tables),
            prog_seq=w(self.prog_seq, prog_seq), prog_q=w(self.prog_q, prog_q), block_q=block_q, kv_splits=splits,
            logit_rows=w(self.logit_rows, rows.astype(np.int64)), kv_runs=runs)
