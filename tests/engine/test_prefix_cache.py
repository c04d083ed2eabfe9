"""Prefix caching: hits are reported, skip prefill work, survive eviction to and from the CPU tier."""
from __future__ import annotations

import numpy as np

from engine_helpers import GREEDY, assert_no_leaks, make_engine, run


def _ids(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(30, 4000, size=n).tolist()


def test_shared_three_block_prefix_is_reported_and_not_recomputed(tiny_model_dir):
    eng = make_engine(tiny_model_dir)
    prefix = _ids(0, 48)  # three 16-token blocks
    first = run(eng, [(0, "a", prefix + _ids(1, 5), GREEDY)])["a"]
    computed_before = eng.kv.stats.hit_tokens
    second_prompt = prefix + _ids(2, 7)
    reqs = {}
    eng.add_request("b", second_prompt, GREEDY)
    req = eng.scheduler.waiting[0]
    reqs["b"] = req
    done = run(eng, [])
    assert first.num_cached_tokens == 0
    assert done["b"].num_cached_tokens == 48
    assert eng.kv.stats.hit_tokens - computed_before == 48
    # Work actually done: only the 7 new prompt tokens plus the decode steps went through the model.
    assert req.num_computed_tokens_total == len(second_prompt) - 48 + GREEDY.max_tokens - 1
    assert_no_leaks(eng)


def test_full_prompt_hit_still_computes_the_last_token(tiny_model_dir):
    eng = make_engine(tiny_model_dir)
    prompt = _ids(3, 32)  # exactly two blocks
    a = run(eng, [(0, "a", prompt, GREEDY)])["a"]
    b = run(eng, [(0, "b", prompt, GREEDY)])["b"]
    assert b.num_cached_tokens == 16  # the last block is recomputed so its logits exist
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    assert_no_leaks(eng)


def test_cached_outputs_equal_uncached(tiny_model_dir):
    prompts = [_ids(4, 40) + _ids(10 + i, 9) for i in range(6)]
    cold = make_engine(tiny_model_dir, enable_prefix_caching=False)
    warm = make_engine(tiny_model_dir)
    ref = run(cold, [(0, f"r{i}", p, GREEDY) for i, p in enumerate(prompts)])
    got = run(warm, [(i, f"r{i}", p, GREEDY) for i, p in enumerate(prompts)])
    assert all(got[k].outputs[0].token_ids == ref[k].outputs[0].token_ids for k in ref)
    assert warm.kv.stats.hits >= 4
    assert_no_leaks(warm)


def test_eviction_to_cpu_tier_and_reload_keeps_outputs(tiny_model_dir):
    # 8 device blocks: each request needs 4, so later requests evict earlier prefixes to the CPU tier.
    eng = make_engine(tiny_model_dir, num_gpu_blocks_override=8, max_model_len=128, swap_space=0.01)
    assert eng.kv.pool.num_host_blocks > 0
    ref_eng = make_engine(tiny_model_dir, enable_prefix_caching=False, max_model_len=128)
    a, b, c = _ids(5, 50), _ids(6, 50), _ids(7, 50)
    order = [("a1", a), ("b1", b), ("c1", c), ("a2", a + [77]), ("b2", b + [78])]
    got = {}
    for rid, p in order:
        got.update(run(eng, [(0, rid, p, GREEDY)]))
    assert eng.kv.stats.host_hit_tokens > 0, "expected prefix hits served from the CPU tier"
    for rid, p in order:
        ref = run(ref_eng, [(0, rid, p, GREEDY)])[rid]
        assert got[rid].outputs[0].token_ids == ref.outputs[0].token_ids, rid
    assert got["a2"].num_cached_tokens == 48
    assert_no_leaks(eng)
