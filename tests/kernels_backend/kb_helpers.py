"""Small random checkpoints and engines for the kernels-vs-reference tests."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from ernie_serve import LLM, SamplingParams
from ernie_serve.demo.tiny_model import random_weights
from ernie_serve.step_contract import StepInput
from ernie_serve.model.checkpoint_writer import write_checkpoint

_ARCH = {"architectures": ["Ernie4_5_MoeForCausalLM"], "max_position_embeddings": 1024}
BASE = dict(_ARCH, vocab_size=512, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, intermediate_size=96)
MOE = dict(BASE, moe_num_experts=6, moe_k=2, moe_intermediate_size=32)
# The HF-parity shapes (tests/model/test_hf_parity.py), written by our own random writer
SHAPES = {
    "moe_tied_shared": dict(MOE, tie_word_embeddings=True, moe_num_shared_experts=1, moe_layer_start_index=1,
                            moe_layer_end_index=2),
    "moe_untied_noshared_interval2": dict(MOE, tie_word_embeddings=False, moe_num_shared_experts=0,
                                          moe_layer_start_index=0, moe_layer_end_index=2, moe_layer_interval=2),
    "moe_headdim24_two_shared": dict(MOE, tie_word_embeddings=True, head_dim=24, moe_num_shared_experts=2,
                                     moe_layer_start_index=2, moe_layer_end_index=2),
    "moe_one_kv_head": dict(MOE, num_key_value_heads=1, tie_word_embeddings=True, moe_num_shared_experts=1,
                            moe_layer_start_index=1, moe_layer_end_index=2),
    "dense_one_kv_head_headdim24": dict(BASE, architectures=["Ernie4_5ForCausalLM"], num_key_value_heads=1,
                                        tie_word_embeddings=False, head_dim=24),
    "dense_gqa4_headdim80": dict(BASE, architectures=["Ernie4_5ForCausalLM"], num_attention_heads=8,
                                 num_key_value_heads=2, head_dim=80, tie_word_embeddings=False),
    "moe_odd_sizes": dict(MOE, hidden_size=68, num_attention_heads=3, num_key_value_heads=1, head_dim=20,
                          intermediate_size=50, moe_intermediate_size=20, moe_num_experts=5, moe_k=3,
                          moe_num_shared_experts=1, tie_word_embeddings=False, moe_layer_start_index=1,
                          moe_layer_end_index=2),
}
# Every K a multiple of 128 (block_wise_fp8) and of 64 (wint2)
QUANT = dict(_ARCH, vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=32, moe_num_experts=4, moe_k=2,
             moe_intermediate_size=128, moe_num_shared_experts=1, moe_layer_start_index=1, moe_layer_end_index=1,
             tie_word_embeddings=False)

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def prompts(vocab: int, lengths=(5, 23, 40)) -> list[list[int]]:
    return [np.random.default_rng(n).integers(3, vocab, size=n).tolist() for n in lengths]


def write(d: Path, config: dict, seed: int = 3) -> Path:
    write_checkpoint(d, config, random_weights(config, seed=seed), max_shard_bytes=400_000)
    return d


def engine(model_dir, backend: str, **kw) -> LLM:
    kw = dict(dict(max_model_len=256, block_size=16), **kw)
    return LLM(model=str(model_dir), execution_backend=backend, skip_tokenizer_init=kw.pop("skip", True),
               disable_progress_bar=True, **kw)


def greedy(llm: LLM, ids: list[list[int]], params: SamplingParams = GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=ids, sampling_params=params,
                                                         use_tqdm=False)]


def prefill_step(lengths: list[int], vocab: int, block_size: int = 16) -> StepInput:
    """One step prefilling fresh sequences (each from position 0) in consecutive cache blocks; every row's
    logits are asked for, so a test can compare all of them."""
    rng = np.random.default_rng(7)
    ids, pos, slots, tables, start = [], [], [], [], 0
    for n in lengths:
        nb = -(-n // block_size)
        blocks = np.arange(start, start + nb)
        start += nb
        p = np.arange(n)
        ids.append(rng.integers(3, vocab, size=n))
        pos.append(p)
        slots.append(blocks[p // block_size] * block_size + p % block_size)
        tables.append(blocks)
    width = max(len(t) for t in tables)
    table = np.zeros((len(lengths), width), np.int64)
    for i, t in enumerate(tables):
        table[i, : len(t)] = t
    cat = np.concatenate
    return StepInput(token_ids=cat(ids).astype(np.int64), positions=cat(pos).astype(np.int64),
                     query_start_loc=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
                     seq_lens=np.asarray(lengths, np.int64), block_tables=table, slot_mapping=cat(slots).astype(np.int64),
                     sample_rows=np.arange(sum(lengths), dtype=np.int64), num_decodes=0, max_position=max(lengths) - 1)


def step_logits(llm: LLM, step: StepInput) -> np.ndarray:
    _, logits = llm.engine.runner.executor.execute(step)
    return logits if isinstance(logits, np.ndarray) else logits.numpy()


def prefill_then_decode(prefill: LLM, decode: LLM, ids: list[int], params: SamplingParams) -> list[int]:
    """Disaggregation's engine half: `prefill` computes the prompt's KV and exports it (across the wire format),
    `decode` continues the request from it. Returns the decode engine's tokens; both pools end empty."""
    from ernie_serve.engine.kv_transfer import KVTransfer

    p, d = prefill.engine, decode.engine
    p.add_request("t", ids, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True), hold_kv=True)
    while p.has_unfinished_requests():
        p.step()
    transfer = KVTransfer.from_frames(p.export_kv("t").to_frames())
    assert p.kv.pool.num_free == p.kv.pool.num_blocks  # the held blocks were released
    d.add_prefilled_request(transfer, params)
    outs = []
    while d.has_unfinished_requests():
        outs += [o for o in d.step() if o.finished]
    assert d.kv.pool.num_free == d.kv.pool.num_blocks
    return outs[0].outputs[0].token_ids
