"""The model runner's block tables kept across steps, as vLLM v1's InputBatch keeps its rows.

Rebuilding a step's [B, nb] block table from every request's block list costs a Python loop over
every block of every row, each step, and grows with context length. A request's blocks only ever
grow in place (KVCacheManager extends Request.block_ids) or are replaced by a new list (freed on
preemption or finish, a fork's own copy), so each row keeps a NumPy copy of its table, the list
object it mirrors and how many blocks it has copied: a step copies only the blocks appended since
the last one, or the whole table when the list was replaced, shrank or its last copied block
changed (a guard: the engine never rewrites a list in place). A request absent from a step
loses its row (state stays bounded by the batch; one that comes back is copied whole).

From the rows, the step's positions, slot mapping and padded block tables are a few array
operations, whatever the batch size.
"""
from __future__ import annotations

import numpy as np

from ..model.attention_metadata import AttentionMetadata


class InputBatch:
    def __init__(self, block_size: int, max_blocks_per_row: int = 64, max_rows: int = 64):
        self.block_size = block_size
        self.block_table = np.zeros((max_rows, max(1, max_blocks_per_row)), dtype=np.int64)
        # Per row, as Python lists (read for every row every step; a NumPy scalar read costs several times a list's):
        # how many blocks of its table are copied into block_table, the last of them, and the Request.block_ids it
        # mirrors.
        self.num_blocks: list[int] = [0] * max_rows
        self._last_block: list[int] = [-1] * max_rows
        self._mirrored: list[list[int] | None] = [None] * max_rows
        self._rows: dict[int, int] = {}  # Request.row_key -> row
        self._free_rows = list(range(max_rows - 1, -1, -1))

    @property
    def num_rows(self) -> int:
        return len(self._rows)

    def rows_for(self, keys: list[int], block_lists: list[list[int]]) -> np.ndarray:
        """The rows of one step's requests (in step order), their tables brought up to date; rows of
        requests not in this step are released."""
        present = set(keys)
        if len(present) != len(keys):
            raise ValueError(f"a step's row keys must be distinct, got {keys}")
        for key in [k for k in self._rows if k not in present]:
            self._release(key)
        rows = []
        counts, last, mirrored, row_of = self.num_blocks, self._last_block, self._mirrored, self._rows
        for key, blocks in zip(keys, block_lists):
            row = row_of.get(key)
            if row is None:
                row = row_of[key] = self._take_row()  # (grows the per-row lists in place)
            rows.append(row)
            have, n = counts[row], len(blocks)
            if blocks is not mirrored[row] or n < have or (have and blocks[have - 1] != last[row]):
                mirrored[row], have = blocks, 0  # replaced, shrank or rewritten: copy it whole
            if n > have:
                if n > self.block_table.shape[1]:
                    self._grow_columns(n)
                self.block_table[row, have:n] = blocks[have:n]
                last[row] = blocks[n - 1]
            counts[row] = n
        return np.array(rows, dtype=np.int64)

    def attention_metadata(self, rows: np.ndarray, starts: np.ndarray, query_lens: np.ndarray,
                           max_decode_query_len: int) -> tuple[AttentionMetadata, np.ndarray]:
        """The step's metadata and positions: rows[i] computes query_lens[i] tokens after starts[i] cached ones.
        Rows computing at most max_decode_query_len tokens must come first."""
        bs = self.block_size
        if not len(rows) or (query_lens < 1).any():
            raise ValueError(f"a step needs rows computing >= 1 token each, got query_lens {query_lens.tolist()}")
        seq_lens = starts + query_lens
        need = -(-seq_lens // bs)
        short = np.flatnonzero(np.array(self.num_blocks, dtype=np.int64)[rows] < need)
        if short.size:
            i = int(short[0])
            raise ValueError(f"block_tables[{i}] has {self.num_blocks[rows[i]]} blocks, {int(need[i])} needed "
                             f"for {int(seq_lens[i])} tokens of {bs}")
        query_start_loc = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(query_lens, out=query_start_loc[1:])
        total = int(query_start_loc[-1])
        positions = np.arange(total, dtype=np.int64) + np.repeat(starts - query_start_loc[:-1], query_lens)
        token_rows = np.repeat(rows, query_lens)
        slots = self.block_table[token_rows, positions // bs] * bs + positions % bs
        width = int(need.max())
        tables = self.block_table[rows, :width]
        tables[np.arange(width)[None, :] >= need[:, None]] = 0  # blocks past a row's tokens are not its own
        long = np.flatnonzero(query_lens > max_decode_query_len)
        num_decodes = int(long[0]) if long.size else len(rows)
        meta = AttentionMetadata(query_start_loc, seq_lens, tables, slots, num_decodes, bs, int(positions.max()))
        return meta, positions

    def _take_row(self) -> int:
        if not self._free_rows:
            old = self.block_table.shape[0]
            self.block_table = np.concatenate([self.block_table, np.zeros_like(self.block_table)])
            self.num_blocks += [0] * old
            self._last_block += [-1] * old
            self._mirrored += [None] * old
            self._free_rows = list(range(2 * old - 1, old - 1, -1))
        return self._free_rows.pop()

    def _release(self, key: int) -> None:
        row = self._rows.pop(key)
        self._mirrored[row] = None
        self.num_blocks[row] = 0
        self._free_rows.append(row)

    def _grow_columns(self, n: int) -> None:
        width = max(n, 2 * self.block_table.shape[1])
        grown = np.zeros((self.block_table.shape[0], width), dtype=np.int64)
        grown[:, :self.block_table.shape[1]] = self.block_table
        self.block_table = grown
