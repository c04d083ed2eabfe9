"""Prompt logprobs (SamplingParams.prompt_logprobs) against transformers' log-softmax over the prompt, on
checkpoints transformers made itself, through every way a prompt reaches the model: chunked prefill, batching with
other prompts and decodes, a prefix the cache holds, preemption and recompute, n > 1, delta outputs."""
from __future__ import annotations

import shutil

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from engine_helpers import assert_no_leaks, make_engine, run  # noqa: E402
from hf_models import VOCAB, hf_model  # noqa: E402

from ernie_serve.outputs import RequestOutputKind  # noqa: E402
from ernie_serve.sampling_params import SamplingParams  # noqa: E402

TOP = 3
CONFIGS = ["moe_one_kv_head", "dense_one_kv_head_headdim"]  # unseen shapes: one KV head, head_dim 24


@pytest.fixture(scope="module", params=CONFIGS)
def checkpoint(request, tmp_path_factory, tiny_model_dir):
    d = tmp_path_factory.mktemp(request.param)
    model = hf_model(request.param)
    model.save_pretrained(d)
    for f in ("tokenizer.model", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(tiny_model_dir / f, d / f)
    return d, model


def _prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, VOCAB, size=n).tolist() for n in lengths]


def _hf_logprobs(model, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        logits = model(torch.tensor(ids)[None]).logits[0].double()
    return torch.log_softmax(logits, dim=-1).numpy()


def _check(out, model, ids: list[int], top: int = TOP) -> None:
    """out.prompt_logprobs: None first, then each prompt token's logprob and rank and the top tokens, as the
    oracle's log-softmax over the prompt gives them."""
    got = out.prompt_logprobs
    assert got is not None and len(got) == len(ids) and got[0] is None
    ref = _hf_logprobs(model, ids)
    for i in range(1, len(ids)):
        row, entry = ref[i - 1], got[i]
        tok = ids[i]
        assert abs(entry[tok].logprob - row[tok]) <= 2e-4 * max(1.0, abs(row[tok])), (i, entry[tok], row[tok])
        assert entry[tok].rank == int((row > row[tok] + 1e-5).sum()) + 1 or \
            abs(np.sort(row)[::-1][entry[tok].rank - 1] - row[tok]) < 1e-4
        best = np.argsort(-row)[:top]
        others = {t: lp for t, lp in entry.items() if t != tok or tok in best}
        assert len(others) == top, (i, sorted(others), best)
        for t, lp in others.items():
            assert abs(lp.logprob - row[t]) <= 2e-4 * max(1.0, abs(row[t]))
            assert row[t] >= row[best[-1]] - 1e-4  # one of the top ones (ties aside)


def _params(**kw) -> SamplingParams:
    return SamplingParams(**dict(dict(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=TOP), **kw))


@pytest.mark.parametrize("budget", [16, 3])
def test_prompt_logprobs_match_transformers_chunked_and_batched(checkpoint, budget):
    """Prompts of 1 to 90 tokens arriving while others decode, in chunks of what the step's token budget leaves:
    up to 15 tokens, or (budget 3, two decoding) a single token a step."""
    d, model = checkpoint
    eng = make_engine(d, max_model_len=256, max_num_batched_tokens=budget, enable_logprob=True)
    prompts = _prompts(0, [1, 2, 17, 33, 90, 5] if budget > 3 else [2, 17, 9])
    plain = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    reqs = [(0, "busy", _prompts(1, [1])[0], plain), (0, "busy2", _prompts(5, [1])[0], plain)]
    reqs += [(1 + i, f"p{i}", p, _params()) for i, p in enumerate(prompts)]
    done = run(eng, reqs)
    assert done["busy"].prompt_logprobs is None and done["busy2"].prompt_logprobs is None
    for i, p in enumerate(prompts):
        _check(done[f"p{i}"], model, p)
    assert_no_leaks(eng)


def test_cached_prefix_is_recomputed_for_prompt_logprobs(checkpoint):
    """A prompt whose prefix the cache holds is computed whole when it asks for prompt logprobs (nothing reported
    cached); a request that does not ask still takes the hit."""
    d, model = checkpoint
    eng = make_engine(d, max_model_len=256, enable_logprob=True)
    shared = _prompts(2, [48])[0]
    first = shared + [7, 8, 9]
    second = shared + [10, 11, 12, 13]
    run(eng, [(0, "warm", first, SamplingParams(temperature=0, max_tokens=2))])
    done = run(eng, [(0, "asks", second, _params())])
    assert done["asks"].num_cached_tokens == 0
    _check(done["asks"], model, second)
    hit = run(eng, [(0, "plain", second, SamplingParams(temperature=0, max_tokens=2))])
    assert hit["plain"].num_cached_tokens > 0
    assert_no_leaks(eng)


def test_prompt_logprobs_survive_preemption(checkpoint):
    """A pool too small for everyone: preempted prompts are recomputed, their logprobs neither lost nor doubled."""
    d, model = checkpoint
    eng = make_engine(d, max_model_len=128, num_gpu_blocks_override=12, max_num_batched_tokens=32,
                      enable_logprob=True)
    prompts = _prompts(3, [60, 45, 70, 30])
    done = run(eng, [(0, f"p{i}", p, _params(max_tokens=40)) for i, p in enumerate(prompts)])
    assert eng.scheduler.num_preemptions > 0, "the small pool was meant to force preemption"
    for i, p in enumerate(prompts):
        _check(done[f"p{i}"], model, p)
    assert_no_leaks(eng)


def test_prompt_logprobs_with_n_and_delta_outputs(checkpoint):
    """n > 1: the group's output carries the prompt's logprobs once computed; a delta stream carries them on
    one output only; top 0 gives each prompt token's own logprob alone."""
    d, model = checkpoint
    eng = make_engine(d, max_model_len=256, enable_logprob=True)
    (p,) = _prompts(4, [25])
    eng.add_request("n2", p, _params(n=2, temperature=0.8, seed=1))
    eng.add_request("delta", p, _params(output_kind=RequestOutputKind.DELTA))
    eng.add_request("zero", p, _params(prompt_logprobs=0))
    seen, final = {}, {}
    for _ in range(100):
        for out in eng.step():
            if out.prompt_logprobs is not None:
                seen[out.request_id] = seen.get(out.request_id, 0) + 1
            if out.finished:
                final[out.request_id] = out
        if not eng.has_unfinished_requests():
            break
    _check(final["n2"], model, p)
    assert seen["delta"] == 1 and final["delta"].prompt_logprobs is None
    _check(final["zero"], model, p, top=0)
    assert all(len(e) == 1 for e in final["zero"].prompt_logprobs[1:])
    assert_no_leaks(eng)


def test_prompt_logprobs_are_refused_where_they_cannot_be_given(tiny_model_dir):
    eng = make_engine(tiny_model_dir, enable_logprob=False)
    with pytest.raises(ValueError, match="prompt_logprobs: logprobs are off"):
        eng.add_request("a", [5, 6, 7], _params())
    eng = make_engine(tiny_model_dir, enable_logprob=True, max_logprobs=5)
    with pytest.raises(ValueError, match="prompt_logprobs must be <= 5"):
        eng.add_request("b", [5, 6, 7], _params(prompt_logprobs=6))
    for bad in (-1, 21, 2.5, "3", True):
        with pytest.raises(ValueError, match="prompt_logprobs must be an integer"):
            SamplingParams(prompt_logprobs=bad)
