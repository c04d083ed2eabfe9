"""The thread-safe fronts: concurrent submitters, streaming, abort, one final output each. Every test runs on both
fronts a server may drive: the engine on a thread in this process (AsyncEngine) and its core in a process of its
own (EngineCoreClient)."""
from __future__ import annotations

import threading

import pytest

from ernie_serve.config import EngineConfig
from ernie_serve.engine.async_engine import AsyncEngine, EngineOverloadedError
from ernie_serve.engine.core_client import EngineCoreClient
from ernie_serve.sampling_params import SamplingParams
from engine_helpers import assert_no_leaks


FRONTS = {"in process": AsyncEngine, "core process": EngineCoreClient}


def assert_all_blocks_free(front) -> None:
    if isinstance(front, AsyncEngine):
        assert_no_leaks(front.engine)
    else:  # the core's pool, as its last step left it
        s = front.stats()
        assert s["num_free_blocks"] == s["num_total_blocks"], f"{s['num_total_blocks'] - s['num_free_blocks']} leaked"


@pytest.fixture(scope="module", params=list(FRONTS))
def front_kind(request):
    return FRONTS[request.param]


@pytest.fixture(scope="module")
def front(tiny_model_dir, front_kind):
    f = front_kind(EngineConfig(model=str(tiny_model_dir), max_model_len=256, block_size=16,
                                disable_progress_bar=True, max_waiting_requests=64))
    yield f
    f.shutdown()


def test_concurrent_streams_each_get_one_final(front):
    results, errors = {}, []

    def client(i: int):
        try:
            outs = list(front.stream(f"c{i}", [40 + i, 50, 60 + i], SamplingParams(temperature=0, max_tokens=8,
                                                                                   ignore_eos=True)))
            results[i] = outs
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    for i, outs in results.items():
        assert sum(o.finished for o in outs) == 1 and outs[-1].finished
        assert [t for o in outs for t in o.outputs[0].token_ids_delta] == outs[-1].outputs[0].token_ids
    assert len(results) == 12
    assert_all_blocks_free(front)


def test_closing_a_stream_early_aborts_and_frees_blocks(front):
    it = front.stream("early", list(range(30, 90)), SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
    next(it)
    it.close()
    assert front.stats()["num_running"] == 0
    assert_all_blocks_free(front)


def test_bad_request_is_refused_synchronously(front):
    with pytest.raises(ValueError, match="max_model_len"):
        front.add_request("big", list(range(300)), SamplingParams(), lambda o, e: None)
    assert front.is_healthy


def test_waiting_queue_is_bounded(tiny_model_dir, front_kind):
    f = front_kind(EngineConfig(model=str(tiny_model_dir), max_model_len=256, block_size=16, max_num_seqs=1,
                                 disable_progress_bar=True, max_waiting_requests=2))
    finals = []
    long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    accepted, refused = [], []
    try:
        # One runs (max_num_seqs=1, 200 steps), two may wait: a fourth can never be accepted.
        for i in range(4):
            try:
                f.add_request(f"w{i}", [40, 41], long, lambda o, e: finals.append(o) if o.finished else None)
                accepted.append(i)
            except EngineOverloadedError as e:
                assert "max_waiting_requests=2" in str(e)
                refused.append(i)
        assert refused and len(accepted) <= 3
    finally:
        f.shutdown(drain=False)
    assert sorted(o.request_id for o in finals) == [f"w{i}" for i in accepted]  # every accepted one ended
    assert_all_blocks_free(f)
