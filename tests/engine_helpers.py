"""Drive an LLMEngine by hand: staggered arrivals, leak checks."""
from __future__ import annotations

import pytest

from ernie_serve.config import EngineConfig
from ernie_serve.engine.llm_engine import LLMEngine
from ernie_serve.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def make_engine(model_dir, **kw) -> LLMEngine:
    opts = dict(model=str(model_dir), max_model_len=512, block_size=16, max_num_seqs=32,
                disable_progress_bar=True)
    opts.update(kw)
    return LLMEngine(EngineConfig(**opts))


def run(engine: LLMEngine, requests: list[tuple[int, str, list[int], SamplingParams]], max_steps: int = 5000):
    """requests: (arrival step, id, prompt ids, params). Returns {id: final RequestOutput}."""
    pending = sorted(requests, key=lambda r: r[0])
    done, step = {}, 0
    while (pending or engine.has_unfinished_requests()) and step < max_steps:
        while pending and pending[0][0] <= step:
            _, rid, ids, p = pending.pop(0)
            engine.add_request(rid, ids, p)
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        step += 1
    assert not pending and not engine.has_unfinished_requests(), "engine did not finish in max_steps"
    return done


def assert_no_leaks(engine: LLMEngine) -> None:
    pool = engine.kv.pool
    assert pool.num_free == pool.num_blocks, f"{pool.num_blocks - pool.num_free} KV blocks leaked"
    assert all(c == 0 for c in pool.ref_cnt)


@pytest.fixture(scope="module")
def shared_engine(tiny_model_dir):
    """One engine for a module's tests (import it with no_leaks_after_each_test, which checks it after each)."""
    return make_engine(tiny_model_dir)


@pytest.fixture(autouse=True)
def no_leaks_after_each_test(shared_engine):
    yield
    assert not shared_engine.has_unfinished_requests()
    assert_no_leaks(shared_engine)
