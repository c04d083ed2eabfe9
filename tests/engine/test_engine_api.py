"""Engine behaviours beyond batching: n > 1, stops, limits, aborts, several tokens per step, KV transfer."""
from __future__ import annotations

import numpy as np
import pytest

from ernie_serve.sampling_params import SamplingParams
from engine_helpers import no_leaks_after_each_test, shared_engine  # noqa: F401 (fixtures)
from engine_helpers import GREEDY, assert_no_leaks, make_engine, run


def _ids(seed: int, n: int = 20) -> list[int]:
    return np.random.default_rng(seed).integers(30, 4000, size=n).tolist()


@pytest.fixture(scope="module")
def engine(shared_engine):
    return shared_engine


def test_seeded_sampling_reproduces_regardless_of_batch(engine):
    p = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=16)
    alone = run(engine, [(0, "x", _ids(1), p)])["x"].outputs[0].token_ids
    others = [(0, f"o{i}", _ids(10 + i), SamplingParams(temperature=1.0, max_tokens=10)) for i in range(5)]
    batched = run(engine, others + [(2, "x", _ids(1), p)])["x"].outputs[0].token_ids
    assert alone == batched


def test_n_samples_share_the_prompt_blocks_and_differ(engine):
    p = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=12)
    out = run(engine, [(0, "n", _ids(2, 40), p)])["n"]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) == 3
    assert all(len(c.token_ids) == 12 for c in out.outputs)
    # the same request again reproduces all three samples
    again = run(engine, [(0, "n2", _ids(2, 40), p)])["n2"]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]


def test_n_greedy_samples_equal_single(engine):
    single = run(engine, [(0, "s", _ids(3), GREEDY)])["s"].outputs[0].token_ids
    multi = run(engine, [(0, "m", _ids(3), SamplingParams(n=2, temperature=0, max_tokens=12, ignore_eos=True))])["m"]
    assert [c.token_ids for c in multi.outputs] == [single, single]


def test_stop_token_ids_and_max_tokens(engine):
    ref = run(engine, [(0, "r", _ids(4), GREEDY)])["r"].outputs[0]
    stop_tok = ref.token_ids[5]
    first = ref.token_ids.index(stop_tok)
    out = run(engine, [(0, "s", _ids(4), SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                       stop_token_ids=[stop_tok]))])["s"].outputs[0]
    assert out.token_ids == ref.token_ids[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_tok
    assert ref.finish_reason == "length" and len(ref.token_ids) == 12


def test_stop_string_truncates_and_is_never_split_across_deltas(engine):
    ref = run(engine, [(0, "r", _ids(5), SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))])["r"]
    text = ref.outputs[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert len(stop) == 3
    for include in (False, True):
        p = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop], include_stop_str_in_output=include)
        engine.add_request("s", _ids(5), p)
        deltas, final = [], None
        while engine.has_unfinished_requests():
            for o in engine.step():
                deltas.append(o.outputs[0].text_delta)
                final = o
        cut = text.index(stop) + (len(stop) if include else 0)
        # What was streamed can't be taken back: equal to the reference cut means no part of the
        # stop string was ever sent (or, with include, it went out whole).
        assert final.outputs[0].text == text[:cut] == "".join(deltas)
        assert final.outputs[0].finish_reason == "stop" and final.outputs[0].stop_reason == stop


def test_logit_bias_steers_greedy_decoding_and_its_ids_are_checked_against_the_vocabulary(engine):
    ref = run(engine, [(0, "r", _ids(7), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))])["r"]
    first = ref.outputs[0].token_ids[0]
    forced, banned = 1234, {t: -100.0 for t in ref.outputs[0].token_ids}
    out = run(engine, [(0, "f", _ids(7), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True,
                                                       logit_bias={str(forced): 100.0})),
                       (0, "b", _ids(7), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                                       logit_bias=banned))])
    assert out["f"].outputs[0].token_ids == [forced] * 4
    assert first not in out["b"].outputs[0].token_ids and not set(out["b"].outputs[0].token_ids) & set(banned)
    vocab = engine.model_config.vocab_size
    with pytest.raises(ValueError, match=rf"logit_bias keys must be token ids in \[0, {vocab}\)"):
        engine.add_request("oov", _ids(7), SamplingParams(logit_bias={vocab: 1.0}))


def test_min_tokens_suppresses_eos(engine):
    eos = engine.eos_token_ids[0]
    p = SamplingParams(temperature=0, max_tokens=10, min_tokens=10, bad_words=[], seed=0)
    out = run(engine, [(0, "m", _ids(6), p)])["m"].outputs[0]
    assert len(out.token_ids) == 10 and eos not in out.token_ids


def test_prompt_longer_than_max_model_len_is_rejected(engine):
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request("long", list(range(30, 30 + 512)), GREEDY)
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("empty", [], GREEDY)
    with pytest.raises(ValueError, match="prompt_token_ids"):
        engine.add_request("bad", [10**7], GREEDY)


def test_max_tokens_clamped_to_max_model_len(engine):
    out = run(engine, [(0, "c", list(range(30, 30 + 505)), SamplingParams(temperature=0, max_tokens=100,
                                                                          ignore_eos=True))])["c"]
    assert len(out.outputs[0].token_ids) == 7 and out.outputs[0].finish_reason == "length"


def test_abort_at_any_point_frees_every_block(engine):
    for steps_before_abort in (0, 1, 3):
        engine.add_request("a", _ids(7, 70), SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
        engine.add_request("b", _ids(8, 30), SamplingParams(n=2, temperature=1, max_tokens=50))
        for _ in range(steps_before_abort):
            engine.step()
        out = engine.abort_request("a")
        assert out.finished and out.outputs[0].finish_reason == "abort"
        engine.abort_request("b")
    assert engine.abort_request("unknown") is None


def test_logprobs_are_returned_per_token(engine):
    out = run(engine, [(0, "l", _ids(9), SamplingParams(temperature=0, max_tokens=5, logprobs=3,
                                                       ignore_eos=True))])["l"].outputs[0]
    assert len(out.logprobs) == 5
    for tok, d in zip(out.token_ids, out.logprobs):
        assert tok in d and d[tok].rank == 1 and len(d) == 3
        assert all(v.logprob <= 0 for v in d.values())


def test_several_tokens_per_step_verify_drafts(engine):
    """Speculative verification path: right drafts are accepted, wrong ones rejected, output unchanged."""
    ref = run(engine, [(0, "r", _ids(11), GREEDY)])["r"].outputs[0].token_ids
    engine.add_request("s", _ids(11), GREEDY)
    req = engine.requests["s"][0]
    steps = 0
    while engine.has_unfinished_requests():
        if req.output_token_ids and not req.is_finished:
            k = len(req.output_token_ids)
            good = ref[k : k + 2]
            req.spec_token_ids = good + [4095] if steps % 2 == 0 else [4094]
        engine.step()
        steps += 1
    assert req.output_token_ids == ref
    assert steps < len(ref)  # accepted drafts saved steps


def test_kv_transfer_prefill_to_decode_engine(tiny_model_dir, engine):
    ref = run(engine, [(0, "r", _ids(12, 45), GREEDY)])["r"].outputs[0].token_ids
    prefill = make_engine(tiny_model_dir)
    decode = make_engine(tiny_model_dir, enable_prefix_caching=False)
    prefill.add_request("t", _ids(12, 45), SamplingParams(temperature=0, max_tokens=1, ignore_eos=True), hold_kv=True)
    run(prefill, [])
    from ernie_serve.engine.kv_transfer import KVTransfer

    transfer = KVTransfer.from_frames(prefill.export_kv("t").to_frames())
    assert_no_leaks(prefill)
    decode.add_prefilled_request(transfer, GREEDY)
    out = run(decode, [])["t"].outputs[0].token_ids
    assert out == ref
    assert_no_leaks(decode)


def test_kv_transfer_that_already_finishes_returns_its_final_output(tiny_model_dir, engine):
    prefill = make_engine(tiny_model_dir)
    decode = make_engine(tiny_model_dir, enable_prefix_caching=False)
    prefill.add_request("one", _ids(13, 30), SamplingParams(temperature=0, max_tokens=1, ignore_eos=True), hold_kv=True)
    first = run(prefill, [])["one"].outputs[0].token_ids
    out = decode.add_prefilled_request(prefill.export_kv("one"), SamplingParams(temperature=0, max_tokens=1))
    assert out is not None and out.finished and out.outputs[0].token_ids == first
    assert not decode.has_unfinished_requests()
    assert_no_leaks(decode)
    assert_no_leaks(prefill)


def test_an_engine_dropped_without_close_is_freed_when_the_next_one_starts(tiny_model_dir):
    """Start-up freezes what is alive for the collector (gc.freeze); an engine nobody closed is a frozen cycle (a
    tensor-parallel one: its executor and its view of the KV pool refer to each other), so the next engine's
    start-up unfreezes and collects first: the dropped one goes, and its worker process with it."""
    import gc
    import os
    import weakref

    first = make_engine(tiny_model_dir, tensor_parallel_size=2)
    gone, (worker,) = weakref.ref(first), first.runner.executor.worker_pids
    del first
    second = make_engine(tiny_model_dir)
    try:
        assert gone() is None
        with pytest.raises(ProcessLookupError):
            os.kill(worker, 0)
        assert gc.get_freeze_count() > 0  # the second engine's objects are frozen again
    finally:
        second.close()
