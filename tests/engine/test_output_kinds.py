"""RequestOutputKind: cumulative, delta and final-only outputs carry the same request, each as its front reads it."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from ernie_serve.outputs import RequestOutputKind
from ernie_serve.sampling_params import SamplingParams
from engine_helpers import no_leaks_after_each_test, shared_engine  # noqa: F401 (fixtures)

KINDS = list(RequestOutputKind)


@pytest.fixture(scope="module")
def engine(shared_engine):
    return shared_engine


def _prompt(seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(30, 4000, size=12).tolist()


def _stream(engine, params: SamplingParams, seeds=(0, 1, 2), abort_after: int | None = None) -> dict[str, list]:
    """Every output of each request, in order; with abort_after, the requests are aborted after that many steps."""
    seen: dict[str, list] = {}
    for s in seeds:
        engine.add_request(f"r{s}", _prompt(s), params)
        seen[f"r{s}"] = []
    steps = 0
    while engine.has_unfinished_requests():
        if abort_after is not None and steps == abort_after:
            for rid in list(seen):
                out = engine.abort_request(rid)
                if out is not None:
                    seen[rid].append(out)
            break
        for out in engine.step():
            seen[out.request_id].append(out)
        steps += 1
    return seen


def _joined(comps: list, kind: RequestOutputKind) -> tuple[list[int], str, list, float | None]:
    """What one sequence's CompletionOutputs (one per output, in order) add up to: every token, the text, the
    logprobs and the cumulative logprob."""
    if kind is RequestOutputKind.DELTA:
        logprobs = [d for c in comps for d in (c.logprobs or [])]
        return [t for c in comps for t in c.token_ids], "".join(c.text for c in comps), logprobs, \
            comps[-1].cumulative_logprob
    last = comps[-1]
    return last.token_ids, last.text, last.logprobs or [], last.cumulative_logprob


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2),
    SamplingParams(temperature=0.8, seed=5, max_tokens=24),
    SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[" the", "e"]),
    SamplingParams(temperature=1.0, seed=3, max_tokens=16, n=2),
], ids=["greedy_logprobs", "sampled", "stop_strings", "n2"])
def test_every_kind_adds_up_to_the_cumulative_output(engine, params):
    runs = {k: _stream(engine, replace(params, output_kind=k)) for k in KINDS}
    for rid, cumulative in runs[RequestOutputKind.CUMULATIVE].items():
        final = cumulative[-1]
        assert final.finished
        for kind in KINDS:
            outs = runs[kind][rid]
            assert outs[-1].finished and all(not o.finished for o in outs[:-1])
            if kind is RequestOutputKind.FINAL_ONLY:
                assert len(outs) == 1
            else:
                assert len(outs) == len(cumulative)
            for i, comp in enumerate(final.outputs):
                got = _joined([o.outputs[i] for o in outs], kind)
                assert got == (comp.token_ids, comp.text, comp.logprobs or [], comp.cumulative_logprob), (kind, i)
                assert outs[-1].outputs[i].finish_reason == comp.finish_reason


def test_delta_outputs_carry_only_the_step_and_metrics_at_the_end(engine):
    outs = _stream(engine, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True,
                                          output_kind=RequestOutputKind.DELTA), seeds=(4,))["r4"]
    assert [len(o.outputs[0].token_ids) for o in outs] == [1] * 10
    assert all(o.outputs[0].token_ids == o.outputs[0].token_ids_delta for o in outs)
    assert all(o.outputs[0].text == o.outputs[0].text_delta for o in outs)
    assert all(o.metrics is None for o in outs[:-1])
    m = outs[-1].metrics
    assert m.finished_time is not None and m.first_token_time is not None and m.first_token_time >= m.arrival_time


def test_final_only_defers_the_text_yet_stop_strings_still_stop_on_time(engine):
    base = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    full = _stream(engine, base, seeds=(6,))["r6"][-1].outputs[0]
    stop = full.text[len(full.text) // 2: len(full.text) // 2 + 3]
    assert stop.strip()
    for kind in (RequestOutputKind.CUMULATIVE, RequestOutputKind.FINAL_ONLY):
        params = replace(base, stop=[stop], output_kind=kind)
        engine.add_request("s", _prompt(6), params)
        assert not engine.output.texts["s"].deferred  # a stop string needs the text every step
        outs = []
        while engine.has_unfinished_requests():
            outs += engine.step()
        comp = outs[-1].outputs[0]
        assert comp.finish_reason == "stop" and comp.stop_reason == stop
        assert full.text.startswith(comp.text) and stop not in comp.text, kind
    engine.add_request("d", _prompt(6), replace(base, output_kind=RequestOutputKind.FINAL_ONLY))
    assert engine.output.texts["d"].deferred
    while engine.has_unfinished_requests():
        engine.step()


@pytest.mark.parametrize("kind", KINDS)
def test_an_aborted_request_ends_with_its_text_in_every_kind(engine, kind):
    cumulative = _stream(engine, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True), seeds=(7,),
                         abort_after=6)["r7"]
    outs = _stream(engine, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, output_kind=kind),
                   seeds=(7,), abort_after=6)["r7"]
    want = cumulative[-1].outputs[0]
    assert want.finish_reason == "abort" and want.token_ids
    tokens, text, _, _ = _joined([o.outputs[0] for o in outs], kind)
    assert (tokens, text) == (want.token_ids, want.text)
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"


def test_output_kind_is_checked_and_travels_as_json_text():
    assert SamplingParams(output_kind="delta").output_kind is RequestOutputKind.DELTA
    with pytest.raises(ValueError, match="output_kind must be one of cumulative, delta, final_only, got 'partial'"):
        SamplingParams(output_kind="partial")
    import json
    from dataclasses import asdict
    d = json.loads(json.dumps(asdict(SamplingParams(output_kind=RequestOutputKind.FINAL_ONLY))))
    assert SamplingParams.from_dict(d).output_kind is RequestOutputKind.FINAL_ONLY
