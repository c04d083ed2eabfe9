"""The engine loop's own work (engine/llm_engine.py): where the model and its eos ids come from, a request checked off
the loop and queued on it, the loop's counters, aborts, and an idle step. What each part it wires does is tested
beside that part (test_input_processor.py, test_output_processor.py, test_model_runner.py, test_scheduler.py)."""
from __future__ import annotations

import json
import threading

import pytest

from engine_helpers import assert_no_leaks, make_engine
from ernie_serve.config import EngineConfig
from ernie_serve.engine.llm_engine import read_eos_token_ids, resolve_model_dir
from ernie_serve.model.config import ErnieModelConfig
from ernie_serve.outputs import RequestOutputKind
from ernie_serve.sampling_params import SamplingParams
from ernie_serve.tokenizer import ErnieTokenizer

GREEDY = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return make_engine(tiny_model_dir)


@pytest.fixture(autouse=True)
def _idle_engine_after_each_test(engine):
    yield
    for rid in list(engine.requests):
        engine.abort_request(rid)
    assert_no_leaks(engine)


def _finish(engine, max_steps: int = 100) -> dict:
    done = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return done
        done.update((o.request_id, o) for o in engine.step() if o.finished)
    raise AssertionError("the engine did not finish")


def _model_dir(tmp_path, tiny_model_dir, config_eos, generation_eos):
    """A copy of the tiny model's config (and tokenizer) with the given eos ids; no weights are read here."""
    for name in ("tokenizer.model", "tokenizer_config.json", "special_tokens_map.json"):
        (tmp_path / name).write_bytes((tiny_model_dir / name).read_bytes())
    config = json.loads((tiny_model_dir / "config.json").read_text())
    config["eos_token_id"] = config_eos
    (tmp_path / "config.json").write_text(json.dumps(config))
    if generation_eos is not None:
        (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": generation_eos}))
    return tmp_path


@pytest.mark.parametrize("config_eos, generation_eos, expected", [
    (2, None, [2]),  # the config's, and the tokenizer's (2 as well): once
    (7, None, [7, 2]),
    (7, 9, [9, 7, 2]),  # generation_config.json first
    (7, [9, 7, 11], [9, 7, 11, 2]),  # a list, deduplicated in order
    (None, 9, [9, 2]),
])
def test_eos_ids_come_from_generation_config_the_config_and_the_tokenizer_once_each(tmp_path, tiny_model_dir,
                                                                                    config_eos, generation_eos,
                                                                                    expected):
    model_dir = _model_dir(tmp_path, tiny_model_dir, config_eos, generation_eos)
    tokenizer = ErnieTokenizer.from_pretrained(model_dir)
    assert tokenizer.eos_token_id == 2
    assert read_eos_token_ids(model_dir, tokenizer, ErnieModelConfig.from_pretrained(model_dir)) == expected


def test_without_a_tokenizer_the_eos_ids_are_the_checkpoints(tmp_path, tiny_model_dir):
    model_dir = _model_dir(tmp_path, tiny_model_dir, 7, [9, 7])
    assert read_eos_token_ids(model_dir, None, ErnieModelConfig.from_pretrained(model_dir)) == [9, 7]


def test_no_model_means_the_embedded_tiny_model(tiny_model_dir, tmp_path):
    assert resolve_model_dir(EngineConfig()) == tiny_model_dir
    assert resolve_model_dir(EngineConfig(model=str(tmp_path))) == tmp_path


def test_a_request_group_is_built_off_the_loop_and_queued_only_when_added(engine):
    group = engine.make_request_group("later", [5, 6, 7], GREEDY)
    assert "later" not in engine.requests and not engine.scheduler.waiting and engine.step() == []
    prompt_tokens = engine.num_prompt_tokens
    engine.add_request_group(group)
    assert engine.requests["later"] == group.requests and engine.num_prompt_tokens == prompt_tokens + 3
    assert _finish(engine)["later"].outputs[0].token_ids and not engine.has_unfinished_requests()


def test_a_refused_request_leaves_nothing_behind(engine):
    prompt_tokens = engine.num_prompt_tokens
    with pytest.raises(ValueError, match="prompt is empty"):
        engine.add_request("bad", [], GREEDY)
    assert not engine.has_unfinished_requests() and engine.num_prompt_tokens == prompt_tokens


def test_an_idle_step_returns_nothing_and_counts_no_step(engine):
    steps = engine.num_steps
    assert engine.step() == [] and engine.num_steps == steps


def test_the_counters_follow_the_requests_steps_and_tokens(engine):
    before = engine.stats()
    engine.add_request("a", [5, 6, 7, 8], GREEDY)
    engine.add_request("b", [9, 10], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    running = engine.stats()
    assert running["num_waiting"] == 2 and running["prompt_tokens"] == before["prompt_tokens"] + 6
    _finish(engine)
    after = engine.stats()
    assert after["generation_tokens"] == before["generation_tokens"] + 5 + 3
    assert after["num_steps"] == before["num_steps"] + 5  # both prompts in the first step, then one token a step
    assert after["num_running"] == after["num_waiting"] == 0
    assert after["num_free_blocks"] == after["num_total_blocks"] and after["kv_cache_usage"] == 0


def test_an_abort_ends_the_request_with_its_final_output_and_an_unknown_id_gets_none(engine):
    engine.add_request("x", [5, 6, 7], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    engine.add_request("d", [5, 6, 7], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True,
                                                      output_kind=RequestOutputKind.DELTA))
    engine.step()
    engine.step()
    out = engine.abort_request("x")
    assert out.finished and out.outputs[0].finish_reason == "abort" and len(out.outputs[0].token_ids) == 2
    delta = engine.abort_request("d")  # a delta stream's last output adds nothing: it only ends the stream
    assert delta.finished and delta.outputs[0].finish_reason == "abort" and delta.outputs[0].token_ids == []
    assert not engine.has_unfinished_requests()
    assert engine.abort_request("x") is None and engine.abort_request("never-added") is None


def test_an_abort_of_n_sequences_ends_them_all_in_one_output(engine):
    engine.add_request("g", [5, 6, 7], SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=50))
    engine.step()
    out = engine.abort_request("g")
    assert out.finished and [c.finish_reason for c in out.outputs] == ["abort"] * 3


def test_close_stops_the_forward_thread_of_async_scheduling(tiny_model_dir):
    def forward_threads() -> set[threading.Thread]:  # this engine's (another test's engine may still hold one)
        return {t for t in threading.enumerate() if t.name.startswith("ernie-forward")} - others

    others: set[threading.Thread] = set()
    others = forward_threads()
    engine = make_engine(tiny_model_dir, async_scheduling=True)
    engine.add_request("a", [5, 6, 7], GREEDY)
    engine.step()  # a step is now in flight on the forward thread
    assert forward_threads()
    engine.close()
    assert not forward_threads()
