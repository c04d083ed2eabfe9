"""A step's attention metadata: plain index data, built once per step by the model runner (as vLLM's attention
metadata and nano-vllm's context), read by every attention backend: where each sequence's new tokens sit in
the flattened step, how many tokens each sees, its block table, the cache slot of every new token, and how
many leading sequences are decodes. The reference backend derives its masks and tiles from it
(model/attention.py); the kernels backend hands the same arrays to the unified attention kernel."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, TypeVar

import numpy as np

T = TypeVar("T")


@dataclass(eq=False)
class AttentionMetadata:
    query_start_loc: np.ndarray  # [B+1] int64: sequence i's new tokens are rows [qsl[i], qsl[i+1]) of the step
    seq_lens: np.ndarray  # [B] int64: tokens sequence i sees after this step (cached + new)
    block_tables: np.ndarray | None  # [B, nb] int64 blocks holding each sequence's tokens, 0-padded; None: no cache
    slot_mapping: np.ndarray | None  # [T] int64 cache slot of every new token; None: K/V are not cached
    num_decodes: int  # the first num_decodes sequences compute few tokens each (decodes, draft verification)
    block_size: int
    max_position: int
    _derived: dict[str, Any] = field(default_factory=dict, init=False, repr=False)

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        context_lens: list[int],
        block_tables: list[list[int]] | None,
        block_size: int,
        slot_mapping: np.ndarray | None,
        max_position: int,
        max_decode_query_len: int = 8,
    ) -> "AttentionMetadata":
        """One step's metadata. Sequences computing at most max_decode_query_len tokens must come first;
        without block tables every sequence must be fresh (context_len == query_len)."""
        q = np.asarray(query_lens, dtype=np.int64)
        seq_lens = np.asarray(context_lens, dtype=np.int64)
        if len(q) != len(seq_lens) or not len(q) or (q < 1).any() or (seq_lens < q).any():
            raise ValueError(f"query_lens must be >= 1 and <= context_lens, got {query_lens} and {context_lens}")
        tables, num_decodes = None, 0
        if block_tables is None:
            if (seq_lens != q).any():
                raise ValueError("context_lens must equal query_lens when there are no block_tables (nothing cached)")
        else:
            need = -(-seq_lens // block_size)
            tables = np.zeros((len(q), int(need.max())), dtype=np.int64)
            for i, (table, nb) in enumerate(zip(block_tables, need)):
                if len(table) < nb:
                    raise ValueError(f"block_tables[{i}] has {len(table)} blocks, {nb} needed for "
                                     f"{seq_lens[i]} tokens of {block_size}")
                tables[i, :nb] = table[:nb]
            while num_decodes < len(q) and q[num_decodes] <= max_decode_query_len:
                num_decodes += 1
        query_start_loc = np.concatenate([[0], np.cumsum(q)]).astype(np.int64)
        return cls(query_start_loc, seq_lens, tables, slot_mapping, num_decodes, block_size, max_position)

    @property
    def query_lens(self) -> np.ndarray:
        return np.diff(self.query_start_loc)

    @property
    def num_decode_tokens(self) -> int:
        return int(self.query_start_loc[self.num_decodes])

    def derive(self, name: str, build: Callable[["AttentionMetadata"], T]) -> T:
        """What a backend computes from this step's index data (masks on CPU, kernel arguments on GPU):
        built on the first layer's call, reused by the others."""
        if name not in self._derived:
            self._derived[name] = build(self)
        return self._derived[name]
