"""The engine core's wire (engine/core_wire.py): every field of a step's outputs survives the trip, whichever
format carries it."""
from __future__ import annotations

import dataclasses

import numpy as np

from ernie_serve.engine.core_wire import decode, encode, encode_step
from ernie_serve.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from ernie_serve.sampling_params import SamplingParams


def _filled(cls, **special):
    """An instance of a dataclass with every field set to a value of its own (so a dropped field shows)."""
    values = {}
    for i, f in enumerate(dataclasses.fields(cls)):
        values[f.name] = special.get(f.name, f"{f.name}-{i}")
    return cls(**values)


def _output() -> RequestOutput:
    lp = {7: Logprob(-0.25, 1, "a"), 9: Logprob(-2.5, 2, None)}
    completion = _filled(CompletionOutput, index=1, token_ids=[1, 2], logprobs=[lp, None], cumulative_logprob=-1.5,
                         token_ids_delta=[2], tool_calls=[{"name": "f", "arguments": "{}"}], num_reasoning_tokens=3,
                         stop_reason=42)
    metrics = _filled(RequestMetrics, arrival_time=1.0, first_scheduled_time=2.0, first_token_time=3.0,
                      finished_time=None, num_preemptions=4)
    return _filled(RequestOutput, prompt_token_ids=[], outputs=[completion, _filled(CompletionOutput, index=0,
                                                                                        token_ids=[], logprobs=None)],
                   finished=True, num_cached_tokens=16, metrics=metrics, prompt_logprobs=[None, lp])


def _plain(rid: str, ids: list) -> RequestOutput:
    """What output_processor makes for a streaming request each step: its new ids, nothing else."""
    return RequestOutput(rid, None, [], [CompletionOutput(0, "", ids, token_ids_delta=ids)], False, 5)


def test_a_step_of_plain_and_other_outputs_comes_back_equal():
    outs = [_plain("a", [1, 2]), _output(), _plain("b", [3]), _plain("c", [])]
    kind, got, stats = decode(encode_step(outs, {"num_running": 3, "simulated_target": "h200"}))
    assert kind == "step" and stats == {"num_running": 3, "simulated_target": "h200"}
    by_id = {o.request_id: o for o in got}
    assert len(got) == 4 and all(by_id[o.request_id] == o for o in outs)
    plain = by_id["a"].outputs[0]
    assert plain.token_ids is plain.token_ids_delta  # as the output processor shares them


def test_numpy_token_ids_and_stats_come_back_as_their_values():
    ids = [np.int64(7), np.int32(9)]
    kind, got, stats = decode(encode_step([_plain("a", ids)], {"kv_cache_usage": np.float32(0.5)}))
    assert got[0].outputs[0].token_ids_delta == [7, 9] and all(type(t) is int for t in got[0].outputs[0].token_ids)
    assert stats["kv_cache_usage"] == np.float32(0.5)


def test_an_output_with_anything_beyond_new_ids_keeps_it():
    """Each field that makes an output more than plain, set alone, survives the trip."""
    changes = {"text": "x", "text_delta": "x", "finish_reason": "stop", "stop_reason": 3, "cumulative_logprob": -1.0,
               "logprobs": [{1: Logprob(-0.5, 1, "t")}], "reasoning_content": "r", "tool_calls": [{"name": "f"}],
               "num_reasoning_tokens": 2, "index": 1}
    for name, value in changes.items():
        out = _plain("a", [1])
        setattr(out.outputs[0], name, value)
        assert decode(encode_step([out], {}))[1] == [out], name
    for name, value in {"finished": True, "error": "e", "prompt": "p", "prompt_logprobs": [None],
                        "metrics": RequestMetrics(1.0)}.items():
        out = _plain("a", [1])
        setattr(out, name, value)
        assert decode(encode_step([out], {}))[1] == [out], name


def test_other_messages_are_pickled_whole():
    params = SamplingParams(temperature=0.5, max_tokens=7, stop=["x"])
    kind, rid, ids, got = decode(encode(("add", "r", [1, 2], params)))
    assert (kind, rid, ids) == ("add", "r", [1, 2]) and got == params
