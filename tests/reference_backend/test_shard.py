"""reference_backend/shard.ModelShard on the tiny model, driven directly (no engine): its KV pool's whole-block export
and import (the prefill/decode hand-off's format), the CPU tier's swaps, and the cache dtype its weights choose."""
from __future__ import annotations

import numpy as np
import pytest

from ernie_serve.kv_blocks import CODE_DTYPES
from ernie_serve.model.loader import load_model
from ernie_serve.reference_backend.shard import ModelShard
from ernie_serve.step_contract import KVOp, StepInput

BLOCK = 16
NUM_BLOCKS = 14
EMPTY = NUM_BLOCKS - 1  # no test writes it: a zero block to copy over others
NUM_HOST_BLOCKS = 4
PROMPT = 40  # three blocks, the last one part-filled


def _shard(model_dir, weight_bits: int = 32) -> ModelShard:
    """As loading.load_reference_shard builds one rank's shard, with a small pool."""
    model = load_model(model_dir, show_progress=False)
    return ModelShard(model, NUM_BLOCKS, BLOCK, NUM_HOST_BLOCKS, None, weight_bits)


def _prefill(shard: ModelShard, blocks: list[int], n: int = PROMPT, seed: int = 3) -> np.ndarray:
    """One sequence's prompt of n tokens written into `blocks`; the logits of its last token."""
    vocab = shard.model.config.vocab_size
    ids = np.random.default_rng(seed).integers(3, vocab, size=n).astype(np.int64)
    pos = np.arange(n, dtype=np.int64)
    table = np.asarray([blocks], np.int64)
    step = StepInput(token_ids=ids, positions=pos, query_start_loc=np.asarray([0, n], np.int64),
                     seq_lens=np.asarray([n], np.int64), block_tables=table,
                     slot_mapping=table[0, pos // BLOCK] * BLOCK + pos % BLOCK,
                     sample_rows=np.asarray([n - 1], np.int64), num_decodes=0, max_position=n - 1)
    _, logits = shard.execute(step)
    return logits.numpy().copy()


def _decode(shard: ModelShard, blocks: list[int], token: int, position: int) -> np.ndarray:
    """One decode token at `position` of a sequence whose earlier KV is in `blocks`: its logits."""
    table = np.asarray([blocks], np.int64)
    step = StepInput(token_ids=np.asarray([token], np.int64), positions=np.asarray([position], np.int64),
                     query_start_loc=np.asarray([0, 1], np.int64), seq_lens=np.asarray([position + 1], np.int64),
                     block_tables=table, slot_mapping=np.asarray([blocks[position // BLOCK] * BLOCK
                                                                  + position % BLOCK], np.int64),
                     sample_rows=np.asarray([0], np.int64), num_decodes=1, max_position=position)
    _, logits = shard.execute(step)
    return logits.numpy().copy()


@pytest.fixture(scope="module")
def shard(tiny_model_dir) -> ModelShard:
    return _shard(tiny_model_dir)


def test_export_then_import_into_other_blocks_gives_the_same_blocks_and_the_same_next_token(shard):
    src, dst = [0, 1, 2], [6, 7, 8]
    _prefill(shard, src)
    exported = shard.export_kv(src)
    cfg = shard.model.config
    assert exported.shape == (cfg.num_hidden_layers, 2, 3, BLOCK, cfg.num_key_value_heads, cfg.head_dim)
    assert exported.dtype == "float32" and exported.scale_kind is None
    slots = exported.codes.reshape(*exported.shape[:2], 3 * BLOCK, *exported.shape[4:])
    assert (np.abs(slots[:, :, :PROMPT]).sum(axis=(0, 1, 3, 4)) > 0).all()  # every prompt token's KV is there
    assert not exported.codes[:, :, 2, PROMPT % BLOCK:].any()  # the last block's unwritten slots stay zero
    assert not shard.export_kv(dst).codes.any()
    shard.import_kv(dst, exported)
    np.testing.assert_array_equal(shard.export_kv(dst).codes, exported.codes)
    # the imported blocks serve a decode exactly as the originals do
    np.testing.assert_array_equal(_decode(shard, dst, 11, PROMPT), _decode(shard, src, 11, PROMPT))


def test_swapping_blocks_out_to_the_cpu_tier_and_back_in_restores_their_content(shard):
    blocks = [3, 4, 5]
    _prefill(shard, blocks, seed=5)
    before = shard.export_kv(blocks).codes.copy()
    assert shard.host_cache.shape[0] == NUM_HOST_BLOCKS and not shard.host_cache.any()
    shard.apply_kv_ops([KVOp("swap_out", 3, 2), KVOp("swap_out", 4, 0), KVOp("swap_out", 5, 1)])
    np.testing.assert_array_equal(shard.host_cache[[2, 0, 1]], before.transpose(2, 0, 1, 3, 4, 5))
    shard.apply_kv_ops([KVOp("copy", EMPTY, b) for b in blocks])  # what evicting them and reusing the blocks leaves
    assert not shard.export_kv(blocks).codes.any()
    shard.apply_kv_ops([KVOp("swap_in", 1, 5), KVOp("swap_in", 2, 3), KVOp("swap_in", 0, 4)])
    np.testing.assert_array_equal(shard.export_kv(blocks).codes, before)


def test_a_kv_ops_only_step_applies_its_ops_and_runs_no_forward(shard):
    blocks = [9, 10]
    _prefill(shard, blocks, n=BLOCK + 3, seed=9)
    before = shard.export_kv([9]).codes.copy()
    assert shard.execute(StepInput(kv_ops=[KVOp("copy", 9, 12)])) == (None, None)
    np.testing.assert_array_equal(shard.export_kv([12]).codes, before)


def test_bfloat16_weights_keep_a_bfloat16_cache_and_tier_whose_blocks_round_trip_exactly(tiny_model_dir):
    shard = _shard(tiny_model_dir, weight_bits=16)
    assert shard.cache.code_dtype == CODE_DTYPES["bfloat16"]
    assert shard.host_cache.dtype == CODE_DTYPES["bfloat16"]
    assert shard.model.layers[0].self_attn.qkv_proj.bits == 16
    _prefill(shard, [0, 1, 2])
    exported = shard.export_kv([0, 1, 2])
    assert exported.dtype == "bfloat16" and exported.codes[:, :, :2].any()
    shard.import_kv([6, 7, 8], exported)
    np.testing.assert_array_equal(shard.export_kv([6, 7, 8]).codes, exported.codes)
    shard.apply_kv_ops([KVOp("swap_out", 0, 3), KVOp("copy", EMPTY, 0), KVOp("swap_in", 3, 0)])
    np.testing.assert_array_equal(shard.export_kv([0]).codes, exported.codes[:, :, :1])
