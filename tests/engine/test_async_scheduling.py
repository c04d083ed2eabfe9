"""async_scheduling: step n+1 is scheduled and started before step n's outputs are made; the tokens are the same."""
from __future__ import annotations

import numpy as np
import pytest

from ernie_serve.sampling_params import SamplingParams
from engine_helpers import assert_no_leaks, make_engine, run

PROMPTS = [np.random.default_rng(i).integers(30, 4000, size=n).tolist() for i, n in enumerate((23, 5, 140, 1, 77, 60))]
PARAMS = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2),
          SamplingParams(temperature=0.8, seed=3, max_tokens=20),
          SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=["e", " t"]),
          SamplingParams(temperature=1.0, seed=9, max_tokens=12, n=2, repetition_penalty=1.3)]
SETTINGS = {
    "default": {},
    "chunked_small_budget": dict(max_num_batched_tokens=16, max_num_seqs=4),
    "tiny_pool_preemption": dict(num_gpu_blocks_override=24, max_model_len=256),
    "prefix_cache_off": dict(enable_prefix_caching=False),
    "mtp": dict(speculative_config={"method": "mtp", "num_speculative_tokens": 2}),
    "ngram": dict(speculative_config={"method": "ngram", "num_speculative_tokens": 3}),
    # the forward thread drives the worker ranks' sockets, the engine thread the MTP head's mirrored calls
    "tp2_mtp": dict(tensor_parallel_size=2, speculative_config={"method": "mtp", "num_speculative_tokens": 1}),
}


def _requests():
    """Staggered arrivals, the same prompts twice (prefix-cache hits), every kind of params."""
    return [(2 * i, f"r{i}", PROMPTS[i % len(PROMPTS)], PARAMS[i % len(PARAMS)]) for i in range(2 * len(PROMPTS))]


def _summary(done):
    return {rid: [(c.token_ids, c.text, c.finish_reason, c.cumulative_logprob) for c in out.outputs]
            for rid, out in done.items()}


@pytest.mark.parametrize("setting", SETTINGS)
def test_the_same_outputs_with_and_without_async_scheduling(tiny_model_dir, setting):
    kw = SETTINGS[setting]
    results = {}
    for asynchronous in (False, True):
        eng = make_engine(tiny_model_dir, async_scheduling=asynchronous, **kw)
        try:
            results[asynchronous] = _summary(run(eng, _requests()))
            eng.wait_for_step()
            assert_no_leaks(eng)
            if setting == "tiny_pool_preemption":
                assert eng.scheduler.num_preemptions > 0, "the small pool was meant to force preemption"
        finally:
            eng.close()
    assert results[True] == results[False]


# Requests whose sampling reads nothing of their output so far: each step's next one is scheduled ahead of its tokens
AHEAD_PARAMS = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2),
                SamplingParams(temperature=0.8, seed=3, max_tokens=20),
                SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=["e", " t"]),
                SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[101, 202, 303], logit_bias={7: 2.0}),
                SamplingParams(temperature=1.0, seed=9, max_tokens=12, top_k=20, top_p=0.9)]


@pytest.mark.parametrize("setting", ["default", "chunked_small_budget", "tiny_pool_preemption", "prefix_cache_off"])
def test_steps_scheduled_ahead_give_the_synchronous_outputs(tiny_model_dir, setting):
    kw = SETTINGS[setting]
    requests = [(i, f"r{i}", PROMPTS[i % len(PROMPTS)], AHEAD_PARAMS[i % len(AHEAD_PARAMS)]) for i in range(14)]
    results = {}
    for asynchronous in (False, True):
        eng = make_engine(tiny_model_dir, async_scheduling=asynchronous, **kw)
        try:
            results[asynchronous] = _summary(run(eng, requests))
            eng.wait_for_step()
            assert_no_leaks(eng)
            if asynchronous:  # nearly every step after the first was planned while the one before it ran
                assert eng.num_steps_ahead > 0.7 * eng.num_steps, (eng.num_steps_ahead, eng.num_steps)
        finally:
            eng.close()
    assert results[True] == results[False]


def test_prompt_logprobs_over_chunks_give_the_synchronous_outputs(tiny_model_dir):
    """A prompt computing its logprobs chunk by chunk is not planned ahead of its running chunk (the next chunk's
    rows follow the logprobs the running one appends); the requests beside it are."""
    requests = [(0, "plp", PROMPTS[2], SamplingParams(temperature=0, max_tokens=8, prompt_logprobs=2)),
                (0, "g", PROMPTS[4], AHEAD_PARAMS[0]), (3, "s", PROMPTS[5], AHEAD_PARAMS[1])]
    results = {}
    for asynchronous in (False, True):
        eng = make_engine(tiny_model_dir, async_scheduling=asynchronous, **SETTINGS["chunked_small_budget"])
        try:
            done = run(eng, requests)
            results[asynchronous] = (_summary(done), done["plp"].prompt_logprobs)
            eng.wait_for_step()
            assert_no_leaks(eng)
            if asynchronous:
                assert eng.num_steps_ahead > 0
        finally:
            eng.close()
    assert results[True] == results[False]


def test_a_request_that_reads_its_output_stops_scheduling_ahead_while_it_samples(tiny_model_dir):
    eng = make_engine(tiny_model_dir, async_scheduling=True)
    try:
        penalized = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, repetition_penalty=1.3)
        run(eng, [(0, "p", PROMPTS[0], penalized)])
        assert eng.num_steps_ahead == 0
    finally:
        eng.close()


def test_requests_aborted_while_a_step_runs_free_their_blocks_and_the_others_go_on(tiny_model_dir):
    eng = make_engine(tiny_model_dir, async_scheduling=True)
    ref = make_engine(tiny_model_dir)
    try:
        greedy = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
        want = run(ref, [(0, "keep", PROMPTS[2], greedy)])["keep"].outputs[0].token_ids
        for rid, prompt in (("keep", PROMPTS[2]), ("drop1", PROMPTS[0]), ("drop2", PROMPTS[4])):
            eng.add_request(rid, prompt, greedy)
        finals = {}
        for step in range(200):
            if step == 5:
                assert eng._inflight  # a step is running while the aborts come in
                for rid in ("drop1", "drop2"):
                    out = eng.abort_request(rid)
                    assert out.finished and out.outputs[0].finish_reason == "abort"
            for out in eng.step():
                if out.finished:
                    finals[out.request_id] = out
            if not eng.has_unfinished_requests():
                break
        assert set(finals) == {"keep"} and finals["keep"].outputs[0].token_ids == want
        eng.wait_for_step()
        assert_no_leaks(eng)
    finally:
        eng.close()
        ref.close()


def test_async_scheduling_is_a_flag_of_the_server():
    from ernie_serve.cli.serve import build_parser

    assert "--async-scheduling" in build_parser().format_help()


def test_async_scheduling_defaults_on_only_where_the_model_runs_off_the_host(tiny_model_dir):
    """The CPU reference backend's forward needs the cores the overlap would take: off there unless asked."""
    eng = make_engine(tiny_model_dir)
    try:
        assert not eng.async_scheduling and eng._forward is None
    finally:
        eng.close()
    from ernie_serve.config import EngineConfig
    from ernie_serve.engine.llm_engine import LLMEngine

    sim = dict(model=str(tiny_model_dir), execution_backend="simulated", simulated_gpu="h200",
               simulated_model="ernie-4.5-21b-a3b", disable_progress_bar=True)
    eng = LLMEngine(EngineConfig(**sim))
    try:
        assert eng.async_scheduling and eng._ahead_possible
    finally:
        eng.close()
    eng = LLMEngine(EngineConfig(**sim, async_scheduling=False))
    try:
        assert not eng.async_scheduling and eng._forward is None
    finally:
        eng.close()


def test_an_async_engine_dropped_without_close_is_freed_and_its_forward_thread_ends(tiny_model_dir):
    """The forward thread holds nothing of its engine, so an engine nobody closed goes as a synchronous one does
    (collected when the next one starts, test_engine_api.py) and its thread ends: a test suite that drops engines
    would otherwise keep every one of them, weights and KV pool, for the rest of the run."""
    import threading
    import weakref

    first = make_engine(tiny_model_dir, async_scheduling=True)
    run(first, [(0, "a", PROMPTS[0], AHEAD_PARAMS[0])])
    gone = weakref.ref(first)
    before = {t for t in threading.enumerate() if t.name.startswith("ernie-forward")}
    del first
    second = make_engine(tiny_model_dir)
    try:
        assert gone() is None
        for t in before:
            t.join(timeout=10)
            assert not t.is_alive()
    finally:
        second.close()
