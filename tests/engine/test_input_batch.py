"""The model runner's persistent block tables (engine/input_batch.py): on any sequence of steps — requests
joining, growing in place, preempted (their list replaced), rewound (shrunk), leaving and coming back — the
metadata built from the kept rows equals the one built from scratch from every request's block list."""
from __future__ import annotations

import numpy as np
import pytest

from ernie_serve.engine.input_batch import InputBatch
from ernie_serve.step_contract import MAX_BATCHED_QUERY
from ernie_serve.model.attention_metadata import AttentionMetadata


def _from_scratch(blocks: list[list[int]], starts: list[int], q_lens: list[int], bs: int) -> AttentionMetadata:
    """What ModelRunner built before it kept rows: per-row block lists and a Python loop."""
    slots, positions = [], []
    for table, start, n in zip(blocks, starts, q_lens):
        pos = np.arange(start, start + n)
        positions.append(pos)
        slots.append(np.asarray(table, dtype=np.int64)[pos // bs] * bs + pos % bs)
    pos = np.concatenate(positions)
    return AttentionMetadata.build(q_lens, [s + n for s, n in zip(starts, q_lens)], blocks, bs, np.concatenate(slots),
                                   int(pos.max()), MAX_BATCHED_QUERY), pos


@pytest.mark.parametrize("seed", range(6))
def test_kept_rows_give_the_metadata_built_from_scratch_on_random_steps(seed: int) -> None:
    rng = np.random.default_rng(seed)
    bs = int(rng.choice([1, 4, 16, 64]))
    batch = InputBatch(bs, max_blocks_per_row=2, max_rows=2)  # small, so rows and columns must grow
    live: dict[int, dict] = {}
    next_key, next_block = 0, 1
    for _ in range(150):
        op = rng.random()
        if op < 0.2 or not live:  # a request joins
            live[next_key] = {"blocks": [], "computed": 0}
            next_key += 1
        elif op < 0.3:  # finishes
            live.pop(int(rng.choice(list(live))))
        elif op < 0.4:  # preempted: its list is replaced by a new one, recomputed from 0
            r = live[int(rng.choice(list(live)))]
            r["blocks"], r["computed"] = [], 0
        elif op < 0.45:  # a rewind: the table shrinks in place (the engine never does; the batch copes)
            r = live[int(rng.choice(list(live)))]
            del r["blocks"][max(1, len(r["blocks"]) - 2):]  # and regrows with new blocks before it is seen
            r["computed"] = min(r["computed"], max(0, len(r["blocks"]) - 1) * bs)
        keys = [k for k in live if rng.random() < 0.8]  # some requests skip a step (token budget)
        if not keys:
            continue
        q_lens = [int(rng.choice([1, 1, 1, 3, MAX_BATCHED_QUERY + 5])) for _ in keys]
        order = sorted(range(len(keys)), key=lambda i: q_lens[i] > MAX_BATCHED_QUERY)
        keys, q_lens = [keys[i] for i in order], [q_lens[i] for i in order]
        for k, n in zip(keys, q_lens):  # blocks grow in place to cover the new tokens
            r = live[k]
            while len(r["blocks"]) * bs < r["computed"] + n:
                r["blocks"].append(next_block)
                next_block += 1
        blocks = [live[k]["blocks"] for k in keys]
        starts = [live[k]["computed"] for k in keys]
        rows = batch.rows_for(keys, blocks)
        got, got_pos = batch.attention_metadata(rows, np.array(starts), np.array(q_lens), MAX_BATCHED_QUERY)
        want, want_pos = _from_scratch(blocks, starts, q_lens, bs)
        np.testing.assert_array_equal(got_pos, want_pos)
        for name in ("query_start_loc", "seq_lens", "block_tables", "slot_mapping"):
            np.testing.assert_array_equal(getattr(got, name), getattr(want, name), err_msg=name)
        assert (got.num_decodes, got.max_position, got.block_size) == (want.num_decodes, want.max_position, bs)
        assert batch.num_rows == len(keys)  # rows of requests absent from the step are released
        for k, n in zip(keys, q_lens):
            live[k]["computed"] += n


def test_a_row_short_of_blocks_is_refused_naming_it() -> None:
    batch = InputBatch(4)
    rows = batch.rows_for([7], [[3]])
    with pytest.raises(ValueError, match=r"block_tables\[0\] has 1 blocks, 2 needed"):
        batch.attention_metadata(rows, np.array([4]), np.array([1]), MAX_BATCHED_QUERY)


def test_two_rows_of_one_request_are_refused() -> None:
    with pytest.raises(ValueError, match="distinct"):
        InputBatch(4).rows_for([1, 1], [[1], [2]])
