"""StepInput, the step as index data that crosses to the tensor-parallel workers, survives its wire format."""
from __future__ import annotations

import numpy as np

from ernie_serve.step_contract import KVOp, StepInput
from ernie_serve.model.attention import AttentionMetadata


def _roundtrip(step: StepInput) -> StepInput:
    return StepInput.from_frames([bytes(f) for f in step.to_frames()])


def test_a_step_survives_its_frames_with_its_attention_metadata_and_kv_ops():
    meta = AttentionMetadata.build([1, 3], [9, 3], [[4, 5], [6]], 8, np.array([40, 48, 49, 50]), 8)
    step = StepInput.for_tokens(np.array([5, 6, 7, 8]), np.array([8, 0, 1, 2]), meta, np.array([0, 3]),
                                [KVOp("swap_in", 2, 4), KVOp("copy", 1, 6)], np.array([17, 3]))
    got = _roundtrip(step)
    for name in ("token_ids", "positions", "query_start_loc", "seq_lens", "block_tables", "slot_mapping",
                 "sample_rows", "row_keys"):
        np.testing.assert_array_equal(getattr(got, name), getattr(step, name), err_msg=name)
    assert (got.num_decodes, got.max_position, got.kv_ops) == (meta.num_decodes, 8, step.kv_ops)
    rebuilt = got.attention_metadata(8)
    np.testing.assert_array_equal(rebuilt.block_tables, meta.block_tables)
    assert rebuilt.num_decode_tokens == meta.num_decode_tokens


def test_a_kv_ops_only_step_has_no_tokens_and_survives_its_frames():
    got = _roundtrip(StepInput(kv_ops=[KVOp("swap_out", 3, 0)]))
    assert got.num_tokens == 0 and got.sample_rows.size == 0 and got.kv_ops == [KVOp("swap_out", 3, 0)]
