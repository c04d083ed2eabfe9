"""Tensor-parallel workers rebuild each step from a delta (tensor_parallel/persistent_batch.py): the StepInput a worker
rebuilds equals, array for array, the one the driver encoded, whatever the scheduler did to the requests."""
from __future__ import annotations

import dataclasses
from itertools import count

import numpy as np
import pytest

from ernie_serve.tensor_parallel.persistent_batch import PersistentBatch, StepDelta, StepDeltaEncoder
from ernie_serve.step_contract import MAX_BATCHED_QUERY, KVOp, StepInput
from ernie_serve.model.attention_metadata import AttentionMetadata

BS = 16


@dataclasses.dataclass
class _Seq:
    """A request as the step builder sees it: a key, its cached token count and its blocks."""
    key: int
    prompt_len: int
    total_len: int
    computed: int = 0
    blocks: list[int] = dataclasses.field(default_factory=list)


def _step(rows: list[tuple[_Seq, int]], rng: np.random.Generator, kv_ops: list[KVOp], bs: int = BS) -> StepInput:
    """The step ModelRunner.execute builds for these (sequence, tokens to compute) rows."""
    rows = sorted(rows, key=lambda r: r[1] > MAX_BATCHED_QUERY)  # decodes first, as the runner orders them
    ids, positions, slots, sample, offset = [], [], [], [], 0
    for s, n in rows:
        pos = np.arange(s.computed, s.computed + n)
        ids.append(rng.integers(0, 50_000, n))
        positions.append(pos)
        slots.append(np.asarray(s.blocks, np.int64)[pos // bs] * bs + pos % bs)
        if s.computed + n >= s.prompt_len:  # samples its last token, and every draft when verifying
            sample.extend(range(offset + n - (n if n <= MAX_BATCHED_QUERY else 1), offset + n))
        offset += n
    pos = np.concatenate(positions)
    meta = AttentionMetadata.build([n for _, n in rows], [s.computed + n for s, n in rows],
                                   [s.blocks for s, _ in rows], bs, np.concatenate(slots), int(pos.max()),
                                   MAX_BATCHED_QUERY)
    return StepInput.for_tokens(np.concatenate(ids).astype(np.int64), pos, meta, np.asarray(sample, np.int64),
                                kv_ops, np.asarray([s.key for s, _ in rows], np.int64))


def _assert_same(got: StepInput, want: StepInput) -> None:
    for f in dataclasses.fields(StepInput):
        a, b = getattr(got, f.name), getattr(want, f.name)
        if isinstance(b, np.ndarray):
            assert (a.dtype, a.shape) == (b.dtype, b.shape), f.name
            np.testing.assert_array_equal(a, b, err_msg=f.name)
        else:
            assert a == b, f.name


def _wire(frames: list) -> list[bytes]:
    return [bytes(f) for f in frames]


def _nbytes(frames: list) -> int:
    return sum(len(f) for f in _wire(frames))


def test_a_worker_rebuilds_every_step_of_a_random_workload_array_for_array():
    rng = np.random.default_rng(0)
    keys, seqs = count(), []
    encoder, worker = StepDeltaEncoder(BS), PersistentBatch(BS)
    seen = dict(kv_only=0, rewritten=0, appended=0, unchanged=0, skipped=0, preempted=0, rewound=0)
    fresh_block = lambda: int(rng.integers(0, 4096))  # noqa: E731 - block 0 is a real block, not padding
    for _ in range(600):
        kv_ops = [KVOp("swap_out", int(rng.integers(64)), int(rng.integers(8)))] if rng.random() < 0.1 else []
        if rng.random() < 0.05 or not seqs and rng.random() < 0.5:
            step = StepInput(kv_ops=kv_ops or [KVOp("copy", 1, 2)])
            seen["kv_only"] += 1
        else:
            for _ in range(rng.poisson(0.6) + (not seqs)):
                prompt = int(rng.integers(1, 200))
                seqs.append(_Seq(next(keys), prompt, prompt + int(rng.integers(1, 120))))
            rows = []
            for s in seqs:
                event = rng.random()
                if event < 0.1:
                    seen["skipped"] += 1
                    continue
                if event < 0.14 and s.computed:  # preempted and rescheduled: recompute on other blocks
                    keep = int(rng.integers(0, len(s.blocks) + 1))  # the prefix cache may give some back
                    s.computed, s.blocks = 0, s.blocks[:keep] + [fresh_block() for _ in range(len(s.blocks) - keep)]
                    seen["preempted"] += 1
                elif event < 0.2 and s.computed > 1:  # rejected drafts: the table shrinks with the tokens
                    s.computed -= int(rng.integers(1, min(s.computed, 2 * BS)))
                    s.blocks = s.blocks[: -(-s.computed // BS) + int(rng.integers(0, 2))]
                    seen["rewound"] += 1
                if s.computed < s.prompt_len:
                    n = min(int(rng.integers(1, 48)), s.prompt_len - s.computed)  # a prefill chunk
                else:
                    n = min(int(rng.integers(1, 5)), s.total_len - s.computed)  # a token plus drafts
                while len(s.blocks) < -(-(s.computed + n) // BS) + int(rng.integers(0, 2)):  # some allocate ahead
                    s.blocks.append(fresh_block())
                rows.append((s, n))
            if not rows:
                continue
            step = _step(rows, rng, kv_ops)
            for s, n in rows:
                s.computed += n
            seqs = [s for s in seqs if s.computed < s.total_len]
        frames = encoder.encode(step)
        delta = StepDelta.from_frames(_wire(frames))
        for key, replaced, new in zip(delta.row_keys, delta.replaced, delta.num_new_blocks):
            kind = "rewritten" if replaced else "appended" if new else "unchanged"
            seen[kind] += 1
        _assert_same(worker.apply(_wire(frames)), step)
    assert all(v >= 20 for v in seen.values()), seen


def test_a_decode_steps_message_does_not_grow_with_context_length():
    rng = np.random.default_rng(1)
    seqs = [_Seq(k, 2000, 4000, computed=2000 + k, blocks=list(rng.integers(0, 10_000, 40))) for k in range(64)]
    encoder = StepDeltaEncoder(64)
    sizes = []
    for _ in range(3):
        step = _step([(s, 1) for s in seqs], rng, [], bs=64)
        sizes.append((_nbytes(step.to_frames()), _nbytes(encoder.encode(step))))
        for s in seqs:
            s.computed += 1
    (full, first), (_, second), (_, third) = sizes
    assert first > full * 0.8  # the first step sends every table whole
    assert second * 4 < full and third * 4 < full, sizes


def test_a_request_absent_from_a_step_is_sent_whole_when_it_returns():
    rng = np.random.default_rng(2)
    a, b = _Seq(0, 40, 80, computed=40, blocks=[7, 8, 9]), _Seq(1, 40, 80, computed=40, blocks=[4, 5, 6])
    encoder, worker = StepDeltaEncoder(BS), PersistentBatch(BS)
    for rows, want_replaced in (([a, b], [1, 1]), ([a], [0]), ([a, b], [0, 1])):
        step = _step([(s, 1) for s in rows], rng, [])
        frames = encoder.encode(step)
        assert StepDelta.from_frames(_wire(frames)).replaced.tolist() == want_replaced
        _assert_same(worker.apply(_wire(frames)), step)
        for s in rows:
            s.computed += 1


def test_a_delta_for_a_table_the_worker_does_not_hold_is_refused():
    rng = np.random.default_rng(3)
    s = _Seq(5, 30, 60, computed=30, blocks=[3, 4])
    encoder = StepDeltaEncoder(BS)
    encoder.encode(_step([(s, 1)], rng, []))
    s.computed += 1
    late_worker = PersistentBatch(BS)  # it never saw the step that sent key 5's table
    with pytest.raises(RuntimeError, match="request key 5, whose table this worker does not hold"):
        late_worker.apply(_wire(encoder.encode(_step([(s, 1)], rng, []))))


def test_a_step_without_row_keys_is_refused_before_anything_is_sent():
    rng = np.random.default_rng(4)
    step = dataclasses.replace(_step([(_Seq(0, 4, 8, blocks=[1]), 4)], rng, []), row_keys=np.zeros(0, np.int64))
    with pytest.raises(ValueError, match="row_keys must name each of the step's 1 rows, got 0 keys"):
        StepDeltaEncoder(BS).encode(step)
