"""Greedy outputs must not depend on what else runs: batching, chunking, caching, preemption."""
from __future__ import annotations

import numpy as np
import pytest

from engine_helpers import GREEDY, assert_no_leaks, make_engine, run


def _prompts(n: int = 32, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    shared = rng.integers(30, 4000, size=40).tolist()  # some prompts share a prefix, to exercise the cache
    out = []
    for i in range(n):
        own = rng.integers(30, 4000, size=int(rng.integers(3, 70))).tolist()
        out.append(shared + own if i % 3 == 0 else own)
    return out


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    """Each request alone in a fresh engine (no batching, no cache)."""
    eng = make_engine(tiny_model_dir, enable_prefix_caching=False)
    ref = {}
    for i, p in enumerate(_prompts()):
        ref[f"r{i}"] = run(eng, [(0, f"r{i}", p, GREEDY)])[f"r{i}"].outputs[0].token_ids
    assert_no_leaks(eng)
    return ref


SETTINGS = {
    "batched_prefix_cache_on": dict(),
    "batched_prefix_cache_off": dict(enable_prefix_caching=False),
    "chunked_budget_16": dict(max_num_batched_tokens=16),
    "chunk_threshold_8": dict(long_prefill_token_threshold=8),
    "tiny_pool_preemption": dict(num_gpu_blocks_override=40, max_model_len=128),
    "tiny_pool_preemption_cache_off": dict(num_gpu_blocks_override=40, max_model_len=128,
                                           enable_prefix_caching=False),
}


@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_greedy_outputs_identical_to_running_alone(setting, reference, tiny_model_dir):
    eng = make_engine(tiny_model_dir, **SETTINGS[setting])
    reqs = [(i // 2, f"r{i}", p, GREEDY) for i, p in enumerate(_prompts())]  # staggered arrivals
    done = run(eng, reqs)
    for rid, ids in reference.items():
        assert done[rid].outputs[0].token_ids == ids, f"{setting}: {rid} differs"
        assert done[rid].outputs[0].finish_reason == "length"
    if "preemption" in setting:
        assert eng.scheduler.num_preemptions > 0, "the small pool was meant to force preemption"
    assert_no_leaks(eng)


def test_preempted_request_keeps_its_output_so_far(tiny_model_dir, reference):
    eng = make_engine(tiny_model_dir, num_gpu_blocks_override=40, max_model_len=128)
    prompts = _prompts()
    done = run(eng, [(0, f"r{i}", p, GREEDY) for i, p in enumerate(prompts)])
    preempted = [o for o in done.values() if o.metrics.num_preemptions]
    assert preempted
    for o in preempted:
        assert o.outputs[0].token_ids == reference[o.request_id]
    assert_no_leaks(eng)


def test_argmax_only_steps_and_full_pipeline_steps_give_the_same_greedy_tokens(tiny_model_dir):
    """Greedy requests that ask for nothing else are sampled through ArgmaxRows, and the reference backend's lm_head
    then returns each row's argmax without the logits (ArgmaxLogits); one request asking for logprobs (or a
    penalty) in the same batch sends every row through the full pipeline. Same tokens either way, and the step's
    kind follows the batch."""
    from ernie_serve.engine.sampler import ArgmaxRows, SamplingBatch
    from ernie_serve.sampling_params import SamplingParams
    from ernie_serve.step_contract import ArgmaxLogits

    prompts = {f"p{i}": [5 + i, 17, 3 * i + 2, 40, 9] for i in range(4)}
    kinds, logits_kinds = [], set()

    def traced(engine):
        prepare, execute = engine.runner.prepare, engine.runner.executor.execute

        def spy(so):
            prepared = prepare(so)
            if prepared.batch is not None:  # a step that samples nothing has no batch
                kinds.append(type(prepared.batch))
            return prepared

        def spy_execute(step):
            hidden, logits = execute(step)
            logits_kinds.add(type(logits) is ArgmaxLogits)
            return hidden, logits
        engine.runner.prepare, engine.runner.executor.execute = spy, spy_execute
        return engine

    plain = run(traced(make_engine(tiny_model_dir)), [(0, rid, ids, GREEDY) for rid, ids in prompts.items()])
    assert set(kinds) == {ArgmaxRows} and logits_kinds == {True}
    kinds.clear()
    logits_kinds.clear()
    asking = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
    mixed = run(traced(make_engine(tiny_model_dir)),
                [(0, rid, ids, asking if rid == "p0" else GREEDY) for rid, ids in prompts.items()])
    assert set(kinds) == {SamplingBatch} and logits_kinds == {False}
    assert {r: o.outputs[0].token_ids for r, o in mixed.items()} == {r: o.outputs[0].token_ids
                                                                     for r, o in plain.items()}
    assert mixed["p0"].outputs[0].logprobs and plain["p0"].outputs[0].logprobs is None
