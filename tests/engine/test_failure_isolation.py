"""One request must never kill the engine, and callers never wait for a step.

Real engine on the tiny model throughout; the slow step is the real step, held at the model runner
by an event so that "while a step runs" is a state the test controls, not a timing guess.
"""
from __future__ import annotations

import threading

import pytest

from ernie_serve.config import EngineConfig
from ernie_serve.engine.async_engine import AsyncEngine, EngineOverloadedError, RequestFailedError
from ernie_serve.sampling_params import SamplingParams
from engine_helpers import assert_no_leaks, make_engine

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def _unsampleable(engine) -> SamplingParams:
    """min_tokens=2 with every token either a stop token (banned below min_tokens) or a bad word: the
    first step has nothing to sample. Not decidable from the params alone, so the door lets it in."""
    tok = engine.tokenizer
    words = []
    for t in range(len(tok) - 1, 0, -1):  # a few tokens that are their own single-token encoding
        text = tok.decode([t])
        if text.strip() and tok.encode(text) == [t]:
            words.append((t, text))
        if len(words) == 3:
            break
    kept = {t for t, _ in words}
    stops = [t for t in range(len(tok)) if t not in kept]
    return SamplingParams(max_tokens=8, min_tokens=2, stop_token_ids=stops, bad_words=[w for _, w in words])


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return make_engine(tiny_model_dir)


def test_a_request_with_nothing_to_sample_fails_alone_and_the_batch_goes_on(engine):
    engine.add_request("ok", [40, 41, 42], GREEDY)
    engine.add_request("bad", [40, 41, 43], _unsampleable(engine))
    finals = {}
    for _ in range(50):
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
        if not engine.has_unfinished_requests():
            break
    assert finals["bad"].outputs[0].finish_reason == "error" and "no token left" in finals["bad"].error
    assert finals["ok"].outputs[0].finish_reason == "length" and len(finals["ok"].outputs[0].token_ids) == 6
    assert finals["ok"].error is None
    assert_no_leaks(engine)


def test_stop_token_ids_covering_the_vocabulary_with_min_tokens_are_refused_at_the_door(engine):
    everything = list(range(len(engine.tokenizer)))
    with pytest.raises(ValueError, match="min_tokens=2 with stop_token_ids covering every one"):
        engine.add_request("x", [40, 41], SamplingParams(max_tokens=8, min_tokens=2, stop_token_ids=everything))
    with pytest.raises(ValueError, match=r"stop_token_ids must be token ids in \[0, "):
        engine.add_request("y", [40, 41], SamplingParams(stop_token_ids=[engine.model_config.vocab_size]))
    assert not engine.has_unfinished_requests()


@pytest.fixture()
def held_front(tiny_model_dir):
    """An AsyncEngine whose next step blocks inside the model runner until `release` is set."""
    front = AsyncEngine(EngineConfig(model=str(tiny_model_dir), max_model_len=256, block_size=16,
                                     disable_progress_bar=True))
    entered, release = threading.Event(), threading.Event()
    execute = front.engine.runner.execute

    def held_execute(so):
        entered.set()
        release.wait(60)
        return execute(so)

    front.engine.runner.execute = held_execute
    yield front, entered, release
    release.set()
    front.shutdown(drain=False)


def test_submit_abort_and_stats_do_not_wait_for_a_running_step(held_front):
    front, entered, release = held_front
    finals = {}
    done = threading.Event()

    def record(out, err):
        if out.finished:
            finals[out.request_id] = (out, err)
            if len(finals) == 2:
                done.set()

    front.add_request("first", [40, 41, 42], GREEDY, record)
    assert entered.wait(30), "the first step never started"
    calls = threading.Event()

    def caller():
        front.add_request("second", [50, 51], GREEDY, record)
        front.stats()
        front.abort("first")
        calls.set()

    threading.Thread(target=caller, daemon=True).start()
    # The step is still held: these calls can only complete if none of them waits for it.
    assert calls.wait(10), "add_request / stats / abort blocked on the running step"
    assert not release.is_set()
    release.set()
    assert done.wait(60)
    assert finals["first"][0].outputs[0].finish_reason == "abort"
    assert finals["second"][0].outputs[0].finish_reason == "length" and finals["second"][1] is None


def test_async_front_delivers_request_failed_error_and_stays_healthy(tiny_model_dir):
    front = AsyncEngine(EngineConfig(model=str(tiny_model_dir), max_model_len=256, block_size=16,
                                     disable_progress_bar=True))
    try:
        got = {}
        both = threading.Event()

        def record(out, err):
            if out.finished:
                got[out.request_id] = err
                if len(got) == 2:
                    both.set()

        front.add_request("bad", [40, 41], _unsampleable(front.engine), record)
        front.add_request("good", [40, 42], GREEDY, record)
        assert both.wait(60)
        assert isinstance(got["bad"], RequestFailedError) and "no token left" in str(got["bad"])
        assert got["good"] is None
        assert front.is_healthy
        outs = list(front.stream("after", [40, 43], GREEDY))  # the engine still serves
        assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 6
    finally:
        front.shutdown()
    assert_no_leaks(front.engine)


def test_the_waiting_bound_counts_requests_handed_over_while_a_step_runs(tiny_model_dir):
    """Requests the loop took from the inbox but that no stats snapshot shows yet still count as waiting:
    otherwise, for the length of a step, the bound would let twice as many in."""
    front = AsyncEngine(EngineConfig(model=str(tiny_model_dir), max_model_len=256, block_size=16, max_num_seqs=1,
                                     disable_progress_bar=True, max_waiting_requests=2))
    steps = threading.Semaphore(0)
    entered = threading.Semaphore(0)
    execute = front.engine.runner.execute

    def one_step_at_a_time(so):
        entered.release()
        assert steps.acquire(timeout=60)
        return execute(so)

    front.engine.runner.execute = one_step_at_a_time
    long = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    accepted, refused = [], []

    def submit(rid):
        try:
            front.add_request(rid, [40, 41], long, lambda o, e: None)
            accepted.append(rid)
        except EngineOverloadedError:
            refused.append(rid)

    try:
        submit("running")
        assert entered.acquire(timeout=30)  # its first step is held
        submit("w1")
        submit("w2")
        steps.release()  # the loop finishes the step, drains w1/w2 into the scheduler, holds the next step
        assert entered.acquire(timeout=30)
        submit("w3")  # two are waiting (max_num_seqs=1): this one must be refused
        assert refused == ["w3"] and accepted == ["running", "w1", "w2"]
    finally:
        for _ in range(500):
            steps.release()
        front.shutdown(drain=False)
