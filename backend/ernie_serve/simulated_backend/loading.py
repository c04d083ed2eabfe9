"""Builds the simulated executor from an EngineConfig: the target it names, the target's KV pool size, the replay
tokenized by the served tokenizer. Says loudly that it is a simulation."""
from __future__ import annotations

import logging
from pathlib import Path

from ..config import EngineConfig
from ..model.config import ErnieModelConfig
from .executor import SimulatedExecutor, SimulatedKVPool
from .replay import Replay
from .step_model import kv_pool_blocks, total_weight_bytes
from .targets import GPUS, MODELS, Target

log = logging.getLogger(__name__)


def target_from_config(config: EngineConfig) -> Target:
    """The target the config's simulated_* fields, quantization and tensor_parallel_size name (support.py has
    checked the names)."""
    return Target(GPUS[config.simulated_gpu], MODELS[config.simulated_model], config.quantization,
                  config.tensor_parallel_size, config.simulated_time_scale)


def load_simulated(config: EngineConfig, model_dir: Path, model_cfg: ErnieModelConfig,
                   num_output_ids: int | None) -> tuple[SimulatedExecutor, int]:
    """The executor and its CPU tier's block count (swap_space over the target's block bytes; bookkeeping only)."""
    target = target_from_config(config)
    m = target.model
    num_blocks = config.num_gpu_blocks_override or kv_pool_blocks(
        target, config.gpu_memory_utilization, config.block_size, config.max_num_seqs, config.max_num_batched_tokens)
    config.check_kv_pool(num_blocks, "raise gpu_memory_utilization or tensor_parallel_size, or quantize the weights "
                                     "(--quantization),")
    block_bytes = (config.block_size * m.kv_bytes_per_token(target.constants.kv_dtype_bytes)
                   / target.tensor_parallel_size)
    num_host_blocks = int((config.swap_space or 0) * 2**30 // block_bytes)
    vocab = num_output_ids or model_cfg.vocab_size
    memo = target.constants.replay_memo_entries
    if config.skip_tokenizer_init:
        eos = model_cfg.eos_token_id
        replay = Replay.fixed_pattern(vocab, list(eos) if isinstance(eos, (list, tuple)) else [_eos(None, model_cfg)],
                                      memo)
    else:
        from ..tokenizer import ErnieTokenizer

        tokenizer = ErnieTokenizer.from_pretrained(config.tokenizer or model_dir)
        replay = Replay.from_tokenizer(tokenizer, _eos(tokenizer, model_cfg), memo)
    cache = SimulatedKVPool(num_blocks, m.num_layers, config.block_size, m.config.num_key_value_heads,
                            m.config.head_dim)
    log.warning("SIMULATED execution backend: no model runs. Steps sleep for the modeled time of %s (%.1f GB of "
                "weights a GPU, %d KV blocks); outputs are replayed text, never an answer to a prompt. A benchmark "
                "instrument for the host path only.", target.describe(), total_weight_bytes(target) / 1e9, num_blocks)
    return SimulatedExecutor(target, cache, replay, vocab), num_host_blocks


def _eos(tokenizer, model_cfg: ErnieModelConfig) -> int:
    """The EOS id that ends each replayed document: the tokenizer's, else the checkpoint config's (its first)."""
    eos = tokenizer.eos_token_id if tokenizer is not None else None
    if eos is None:
        eos = model_cfg.eos_token_id
        eos = eos[0] if isinstance(eos, (list, tuple)) else eos
    return int(eos if eos is not None else 2)
