"""reference_backend/loading.kv_pool_blocks: one rank's device and CPU-tier KV blocks from the EngineConfig's memory
flags and the model's shape (bytes per block counted here by hand, so a change in what a block holds shows)."""
from __future__ import annotations

import dataclasses

import pytest

from ernie_serve.config import DEFAULT_CPU_KV_BYTES, EngineConfig
from ernie_serve.model.config import ErnieModelConfig
from ernie_serve.model.parallel import ParallelLayout
from ernie_serve.reference_backend.loading import kv_pool_blocks

BLOCK = 16
ONE_RANK = ParallelLayout()


@pytest.fixture(scope="module")
def model_cfg(tiny_model_dir) -> ErnieModelConfig:
    cfg = ErnieModelConfig.from_pretrained(tiny_model_dir)
    assert cfg.num_key_value_heads == 2  # the tensor-parallel cases below split two KV heads over two ranks
    return cfg


def _config(**kw) -> EngineConfig:
    return EngineConfig(**{"execution_backend": "reference", "block_size": BLOCK, "max_model_len": 256, **kw})


def _block_bytes(cfg: ErnieModelConfig, layers: int, kv_heads: int, code_bytes: int) -> int:
    return 2 * layers * BLOCK * kv_heads * cfg.head_dim * code_bytes  # K and V, every layer


def test_blocks_are_kv_cache_memory_over_a_blocks_bytes(model_cfg):
    layers = model_cfg.num_hidden_layers
    per_block = _block_bytes(model_cfg, layers, model_cfg.num_key_value_heads, 4)
    memory = 40 * per_block + per_block - 1  # a partial block is not a block
    assert kv_pool_blocks(_config(kv_cache_memory=memory), model_cfg, ONE_RANK, layers, False) == (40, 0)
    # bfloat16 weights keep a bfloat16 cache: twice the blocks; C8 (int8 codes) four times
    assert kv_pool_blocks(_config(kv_cache_memory=memory, dtype="bfloat16"), model_cfg, ONE_RANK, layers,
                          False)[0] == 81
    assert kv_pool_blocks(_config(kv_cache_memory=memory), model_cfg, ONE_RANK, layers, True)[0] == 163
    # one more cache layer (the MTP head's) makes every block bigger
    assert kv_pool_blocks(_config(kv_cache_memory=memory), model_cfg, ONE_RANK, layers + 1, False)[0] == \
        memory // _block_bytes(model_cfg, layers + 1, model_cfg.num_key_value_heads, 4)


def test_without_kv_cache_memory_the_pool_is_the_cpu_default(model_cfg):
    layers = model_cfg.num_hidden_layers
    per_block = _block_bytes(model_cfg, layers, model_cfg.num_key_value_heads, 4)
    assert kv_pool_blocks(_config(), model_cfg, ONE_RANK, layers, False)[0] == DEFAULT_CPU_KV_BYTES // per_block


def test_num_gpu_blocks_override_wins_over_kv_cache_memory(model_cfg):
    layers = model_cfg.num_hidden_layers
    config = _config(kv_cache_memory=1 << 20, num_gpu_blocks_override=37)
    assert kv_pool_blocks(config, model_cfg, ONE_RANK, layers, False) == (37, 0)


def test_a_pool_too_small_for_one_max_model_len_sequence_is_refused_naming_the_flag(model_cfg):
    layers = model_cfg.num_hidden_layers
    per_block = _block_bytes(model_cfg, layers, model_cfg.num_key_value_heads, 4)
    need = 256 // BLOCK
    assert kv_pool_blocks(_config(kv_cache_memory=need * per_block), model_cfg, ONE_RANK, layers, False)[0] == need
    with pytest.raises(ValueError) as e:
        kv_pool_blocks(_config(kv_cache_memory=(need - 1) * per_block), model_cfg, ONE_RANK, layers, False)
    message = str(e.value)
    assert f"KV pool of {need - 1} blocks cannot hold one max_model_len=256 sequence ({need} blocks of {BLOCK})" \
        in message
    assert "raise kv_cache_memory" in message and "lower max_model_len" in message
    with pytest.raises(ValueError, match=f"KV pool of {need - 1} blocks"):
        kv_pool_blocks(_config(num_gpu_blocks_override=need - 1), model_cfg, ONE_RANK, layers, False)


def test_the_cpu_tier_holds_swap_space_in_blocks_of_the_caches_host_dtype(model_cfg):
    layers, heads = model_cfg.num_hidden_layers, model_cfg.num_key_value_heads
    swap = 0.01  # GiB
    config = _config(kv_cache_memory=1 << 24, swap_space=swap)
    host = int(swap * (1 << 30))
    assert kv_pool_blocks(config, model_cfg, ONE_RANK, layers, False)[1] == host // _block_bytes(model_cfg, layers,
                                                                                                  heads, 4)
    bf16 = _config(kv_cache_memory=1 << 24, swap_space=swap, dtype="bfloat16")
    assert kv_pool_blocks(bf16, model_cfg, ONE_RANK, layers, False)[1] == host // _block_bytes(model_cfg, layers,
                                                                                                heads, 2)
    # a C8 cache swaps out float32 values (PagedKVCache.host_dtype): its tier holds no more blocks than float32's
    assert kv_pool_blocks(config, model_cfg, ONE_RANK, layers, True)[1] == host // _block_bytes(model_cfg, layers,
                                                                                                 heads, 4)
    assert kv_pool_blocks(_config(kv_cache_memory=1 << 24, swap_space=0), model_cfg, ONE_RANK, layers, False)[1] == 0


@pytest.mark.parametrize("rank", [0, 1])
def test_a_tensor_parallel_ranks_blocks_hold_only_its_kv_heads(model_cfg, rank):
    """kv_cache_memory is per rank: with two KV heads over two ranks each block holds one, so the same bytes give
    twice the blocks, and the CPU tier counts blocks of the rank's heads too."""
    layers = model_cfg.num_hidden_layers
    layout = ParallelLayout(rank=rank, world_size=2)  # no group: kv_pool_blocks only asks which heads it holds
    assert len(layout.kv_heads(model_cfg)) == 1
    config = _config(kv_cache_memory=40 * _block_bytes(model_cfg, layers, 2, 4), swap_space=0.01)
    assert kv_pool_blocks(config, model_cfg, ONE_RANK, layers, False)[0] == 40
    host = int(0.01 * (1 << 30))
    assert kv_pool_blocks(config, model_cfg, layout, layers, False) == (80, host // _block_bytes(model_cfg, layers,
                                                                                                 1, 4))


def test_a_single_kv_head_is_replicated_so_a_tensor_parallel_rank_gets_no_more_blocks(model_cfg):
    """With fewer KV heads than ranks each rank keeps the one its query heads read: blocks as big as one rank's."""
    one_head = dataclasses.replace(model_cfg, num_key_value_heads=1)
    layers = one_head.num_hidden_layers
    config = _config(kv_cache_memory=40 * _block_bytes(one_head, layers, 1, 4))
    assert kv_pool_blocks(config, one_head, ONE_RANK, layers, False)[0] == 40
    assert kv_pool_blocks(config, one_head, ParallelLayout(rank=1, world_size=2), layers, False)[0] == 40


def test_a_larger_head_dim_makes_fewer_blocks(model_cfg):
    wide = dataclasses.replace(model_cfg, head_dim=2 * model_cfg.head_dim)
    layers = model_cfg.num_hidden_layers
    config = _config(kv_cache_memory=40 * _block_bytes(model_cfg, layers, model_cfg.num_key_value_heads, 4))
    assert kv_pool_blocks(config, model_cfg, ONE_RANK, layers, False)[0] == 40
    assert kv_pool_blocks(config, wide, ONE_RANK, layers, False)[0] == 20
