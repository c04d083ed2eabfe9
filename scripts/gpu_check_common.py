"""What the GPU checks share (scripts/gpu_engine_check.py on torch, scripts/gpu_paddle_check.py on Paddle): forced
prefill steps, logit error, decode rates. Imports no tensor framework: each check picks its own first."""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from ernie_serve import LLM, SamplingParams
from ernie_serve.demo.tiny_model import CONFIGS, random_weights
from ernie_serve.model.checkpoint_writer import write_checkpoint
from ernie_serve.step_contract import StepInput

SMOKE_CONFIG = dict(CONFIGS["bench"], vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=32, moe_num_experts=4, moe_k=2,
                    moe_intermediate_size=128, moe_layer_end_index=1, max_position_embeddings=1024)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def forced_sequences(vocab: int, n: int, length: int) -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [rng.integers(3, vocab, size=length).tolist() for _ in range(n)]


def prefill_step(seqs: list[list[int]], block_size: int) -> StepInput:
    ids, pos, slots, tables, start = [], [], [], [], 0
    for s in seqs:
        nb = -(-len(s) // block_size)
        blocks = np.arange(start, start + nb)
        start += nb
        p = np.arange(len(s))
        ids += s
        pos.append(p)
        slots.append(blocks[p // block_size] * block_size + p % block_size)
        tables.append(blocks)
    table = np.zeros((len(seqs), max(len(t) for t in tables)), np.int64)
    for i, t in enumerate(tables):
        table[i, : len(t)] = t
    lens = [len(s) for s in seqs]
    return StepInput(token_ids=np.asarray(ids, np.int64), positions=np.concatenate(pos),
                     query_start_loc=np.concatenate([[0], np.cumsum(lens)]).astype(np.int64),
                     seq_lens=np.asarray(lens, np.int64), block_tables=table, slot_mapping=np.concatenate(slots),
                     sample_rows=np.arange(sum(lens), dtype=np.int64), max_position=max(lens) - 1)


def logit_error(got: np.ndarray, ref: np.ndarray) -> dict:
    return {"max_abs_err_rel": float(np.abs(got - ref).max() / np.abs(ref).max()),
            "mean_abs_err": float(np.abs(got - ref).mean()),
            "top1_agreement": float((got.argmax(-1) == ref.argmax(-1)).mean())}


def decode_rate(llm: LLM, batch: int, prompt_len: int, steps: int, vocab: int, sampled: bool = False) -> dict:
    """Decode steps of `batch` running sequences, timed after every prompt is prefilled; greedy, or (sampled)
    seeded top-p sampling with a repetition penalty, all of it on the device."""
    eng = llm.engine
    params = SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True)
    if sampled:
        params = SamplingParams(temperature=0.8, top_p=0.9, repetition_penalty=1.1, seed=0, max_tokens=steps + 8,
                                ignore_eos=True)
    rids = [f"rate-{batch}-{i}" for i in range(batch)]
    for rid, s in zip(rids, forced_sequences(vocab, batch, prompt_len)):
        eng.add_request(rid, s, params)
    while any(not r.output_token_ids for g in eng.requests.values() for r in g):
        eng.step()
    ops = eng.runner.executor.ops
    ops.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        eng.step()
    ops.synchronize()
    dt = (time.perf_counter() - t0) / steps
    for rid in rids:
        eng.abort_request(rid)
    return {"batch": batch, "step_ms": dt * 1e3, "tok_s": batch / dt, "sampled": sampled}


def write_bench_checkpoint(out: Path, smoke: bool) -> tuple[Path, dict]:
    """The benchmark-size random checkpoint (a two-layer one for CPU smoke runs) under out/, written once."""
    config = SMOKE_CONFIG if smoke else CONFIGS["bench"]
    d = out / ("ckpt-smoke" if smoke else "ckpt-bench")
    if not (d / "config.json").exists():
        write_checkpoint(d, config, random_weights(config, seed=0))
    return d, config
