"""The engine core in a process of its own (engine/core_client.py, core_process.py): the same tokens and the same
front contract as the in-process AsyncEngine (test_async_engine.py runs its tests on both), answered at once for bad
input, one final output for every accepted request whatever happens to the core."""
from __future__ import annotations

import os
import shutil
import signal
import threading

import pytest

from ernie_serve.config import EngineConfig
from ernie_serve.engine.async_engine import AsyncEngine, EngineDeadError
from ernie_serve.engine.core_client import EngineCoreClient
from ernie_serve.llm import LLM
from ernie_serve.sampling_params import GuidedDecodingParams, SamplingParams
from polling import wait_for as wait_until

BASE = dict(max_model_len=256, block_size=16, disable_progress_bar=True, max_waiting_requests=64)
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
LONG = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)


@pytest.fixture(scope="module")
def client(tiny_model_dir):
    c = EngineCoreClient(EngineConfig(model=str(tiny_model_dir), **BASE))
    yield c
    c.shutdown()


def _tokens(outs) -> list[int]:
    return [t for o in outs for t in o.outputs[0].token_ids_delta]


def _no_blocks_held(front) -> bool:
    s = front.stats()
    return s["num_running"] == 0 and s["num_free_blocks"] == s["num_total_blocks"]


def test_concurrent_streams_give_the_in_process_engines_tokens_with_one_final_each(client, tiny_model_dir):
    prompts = {f"c{i}": [40 + i, 50, 60 + i] for i in range(8)}
    results, errors = {}, []

    def run(rid: str) -> None:
        try:
            results[rid] = list(client.stream(rid, prompts[rid], GREEDY))
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=run, args=(rid,)) for rid in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors and len(results) == len(prompts)
    local = AsyncEngine(EngineConfig(model=str(tiny_model_dir), **BASE))
    try:
        for rid, outs in results.items():
            assert sum(o.finished for o in outs) == 1 and outs[-1].finished
            assert outs[-1].prompt_token_ids == prompts[rid]  # restored by the front: prompts cross once
            assert _tokens(outs) == _tokens(list(local.stream(rid, prompts[rid], GREEDY)))
    finally:
        local.shutdown()
    assert _no_blocks_held(client)


def test_bad_input_is_refused_on_the_callers_thread_naming_the_field(client):
    with pytest.raises(ValueError, match="max_model_len"):
        client.add_request("big", list(range(300)), GREEDY, lambda o, e: None)
    with pytest.raises(ValueError, match="prompt_token_ids"):
        client.add_request("vocab", [10 ** 6], GREEDY, lambda o, e: None)
    bad_grammar = SamplingParams(max_tokens=4, guided_decoding=GuidedDecodingParams(grammar="start: ((("))
    with pytest.raises(ValueError, match="guided_decoding"):
        client.add_request("grammar", [40, 41], bad_grammar, lambda o, e: None)
    ok = list(client.stream("dup-check", [40, 41], GREEDY))
    assert ok[-1].finished and client.is_healthy


def test_a_request_id_in_use_is_refused(client):
    finals = []
    client.add_request("same", [40, 41], LONG, lambda o, e: finals.append(o) if o.finished else None)
    try:
        with pytest.raises(ValueError, match="already in use"):
            client.add_request("same", [40, 41], GREEDY, lambda o, e: None)
    finally:
        client.abort("same")
    wait_until(lambda: finals, timeout=60, what="the aborted request's final output")
    assert finals[0].outputs[0].finish_reason == "abort"


def test_an_abort_ends_the_request_and_frees_its_blocks(client):
    it = client.stream("early", list(range(30, 90)), LONG)
    next(it)
    it.close()  # aborts and waits for the final output
    wait_until(lambda: _no_blocks_held(client), timeout=30, what="the aborted request's blocks back in the pool")


def test_each_step_reaches_the_output_sink_in_one_call_and_the_listeners_with_stats(tiny_model_dir):
    c = EngineCoreClient(EngineConfig(model=str(tiny_model_dir), **BASE))
    calls, stats = [], []
    c.output_sink = lambda items: calls.append(items)
    c.step_listeners.append(stats.append)
    try:
        for i in range(3):
            c.add_request(f"s{i}", [40 + i, 41], GREEDY, lambda o, e: None)
        wait_until(lambda: sum(out.finished for items in calls for _, out, _ in items) == 3, timeout=60,
                   what="three finals through the sink")
    finally:
        c.shutdown()
    # one call a step, each step's outputs of every running request together
    assert max(len(items) for items in calls) == 3
    assert all(err is None for items in calls for _, _, err in items)
    assert stats and all("num_free_blocks" in s for s in stats)


def test_a_killed_core_fails_every_pending_request_once_and_refuses_new_work(tiny_model_dir):
    c = EngineCoreClient(EngineConfig(model=str(tiny_model_dir), **BASE))
    finals: dict[str, list] = {}
    lock = threading.Lock()

    def record(out, err):
        if out.finished:
            with lock:
                finals.setdefault(out.request_id, []).append(err)

    try:
        for i in range(4):
            c.add_request(f"k{i}", [40 + i, 41], LONG, record)
        os.kill(c.proc.pid, signal.SIGKILL)
        wait_until(lambda: len(finals) == 4, timeout=30, what="a final output for each of the 4 requests")
        assert all(len(errs) == 1 and isinstance(errs[0], EngineDeadError) for errs in finals.values())
        assert not c.is_healthy
        with pytest.raises(EngineDeadError):
            c.add_request("after", [40, 41], GREEDY, record)
    finally:
        c.shutdown()


def test_shutdown_without_drain_aborts_what_runs_each_with_its_final(tiny_model_dir):
    c = EngineCoreClient(EngineConfig(model=str(tiny_model_dir), **BASE))
    finals = []
    for i in range(3):
        c.add_request(f"d{i}", [40 + i, 41], LONG, lambda o, e: finals.append((o, e)) if o.finished else None)
    c.shutdown(drain=False)
    assert sorted(o.request_id for o, _ in finals) == ["d0", "d1", "d2"]
    assert all(o.outputs[0].finish_reason in ("abort", "length") or isinstance(e, EngineDeadError)
               for o, e in finals)
    assert c.proc.poll() is not None


def test_a_core_that_cannot_load_fails_the_start_with_its_reason(tiny_model_dir, tmp_path):
    broken = tmp_path / "no-weights"
    shutil.copytree(tiny_model_dir, broken)
    for f in broken.glob("*.safetensors*"):
        f.unlink()
    with pytest.raises(RuntimeError) as info:
        EngineCoreClient(EngineConfig(model=str(broken), **BASE))
    assert "safetensors" in str(info.value) or "weights" in str(info.value)


def test_the_setting_is_refused_where_it_cannot_apply(tiny_model_dir):
    with pytest.raises(ValueError, match="engine_core_process=True is not supported with splitwise_role"):
        EngineConfig(model=str(tiny_model_dir), splitwise_role="prefill", engine_worker_queue_port=40001,
                     engine_core_process=True)
    with pytest.raises(ValueError, match="engine_core_process=True is a server's setting"):
        LLM(model=str(tiny_model_dir), engine_core_process=True)



def test_the_core_is_found_as_its_stubs_child(client):
    """What the soak and the benchmarks measure the core's memory and CPU by (serving/health.engine_cores)."""
    from ernie_serve.serving.health import Stub, engine_cores

    assert engine_cores([Stub("ernie_moe_0_0", "ernie_moe", os.getpid())]) == {"ernie_moe_0_0": client.proc.pid}
    assert engine_cores([Stub("other", "ernie_moe", client.proc.pid)]) == {}


def test_a_message_the_front_cannot_read_fails_every_pending_request_and_stops_the_core(tiny_model_dir, monkeypatch):
    import ernie_serve.engine.core_client as core_client

    c = EngineCoreClient(EngineConfig(model=str(tiny_model_dir), **BASE))
    finals = []
    try:
        def unreadable(frame):
            raise ValueError("garbled frame")
        monkeypatch.setattr(core_client, "decode", unreadable)
        c.add_request("g", [40, 41], LONG, lambda o, e: finals.append(e) if o.finished else None)
        wait_until(lambda: finals, timeout=30, what="the request's final output")
        assert isinstance(finals[0], EngineDeadError) and "garbled frame" in str(finals[0])
        wait_until(lambda: c.proc.poll() is not None, timeout=30, what="the core killed")
        assert not c.is_healthy
    finally:
        c.shutdown()
