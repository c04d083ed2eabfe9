"""The KV pool gets as many blocks as its memory holds in the cache's own format."""
from __future__ import annotations

from ernie_serve.config import EngineConfig
from ernie_serve.demo.tiny_model import random_weights
from ernie_serve.engine.llm_engine import LLMEngine
from ernie_serve.model.checkpoint_writer import write_checkpoint
from ernie_serve.model.kv_cache import PagedKVCache

CONFIG = {"architectures": ["Ernie4_5_MoeForCausalLM"], "vocab_size": 256, "hidden_size": 64,
          "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 1,
          "head_dim": 16, "moe_num_experts": 4, "moe_k": 2, "moe_intermediate_size": 32,
          "moe_layer_start_index": 1, "tie_word_embeddings": True, "max_position_embeddings": 512}


def _engine(model_dir, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model_dir), skip_tokenizer_init=True, max_model_len=128, block_size=16,
                                  disable_progress_bar=True, **kw))


def test_c8_pool_holds_four_times_the_fp32_blocks_in_the_same_memory_and_bfloat16_twice(tmp_path):
    fp32 = tmp_path / "fp32"
    c8 = tmp_path / "c8"
    write_checkpoint(fp32, CONFIG, random_weights(CONFIG, seed=1))
    write_checkpoint(c8, dict(CONFIG, quantization_config={"kv_cache_quant_type": "int8"}),
                     random_weights(CONFIG, seed=1))
    memory = 64 * PagedKVCache.bytes_per_block(2, 16, 1, 16)  # 64 fp32 blocks
    a = _engine(fp32, kv_cache_memory=memory, swap_space=memory / 2**30)
    b = _engine(c8, kv_cache_memory=memory, swap_space=memory / 2**30)
    assert b.runner.cache.k[0].dtype.itemsize == 1
    assert a.kv.pool.num_blocks == 64 and b.kv.pool.num_blocks == 256
    # the CPU tier stores float32 blocks in both cases
    assert a.kv.pool.num_host_blocks == b.kv.pool.num_host_blocks == 64
    # --dtype bfloat16: the device cache and the CPU tier both hold bfloat16 blocks
    c = _engine(fp32, kv_cache_memory=memory, swap_space=memory / 2**30, dtype="bfloat16")
    assert c.runner.cache.k[0].dtype.name == "bfloat16" and c.runner.executor.host_cache.dtype.name == "bfloat16"
    assert c.kv.pool.num_blocks == 128 and c.kv.pool.num_host_blocks == 128
