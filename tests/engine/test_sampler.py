"""Sampler: both methods draw exactly the filtered distribution; penalties, masks and logprobs as vLLM."""
from __future__ import annotations

import re
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import chisquare

try:
    import ernie_serve  # noqa: F401
except ImportError:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "backend"))

from ernie_serve.engine import sampler as sampler_module  # noqa: E402
from ernie_serve.engine.sampler import (  # noqa: E402
    Sampler, SamplingBatch, logit_edits)
from ernie_serve.sampling_params import SamplingParams  # noqa: E402

METHODS = ["base", "rejection"]
# "base" with a sort window of 8 of the 24 tokens: rows whose filtered set provably fits sort only
# those 8, the others fall back to a full sort; both must stay exact
ALL_PATHS = ["base", "base_window8", "rejection"]
NEG_INF = float("-inf")

# 24 tokens: a tie at ranks 5/6 (1.3), another at ranks 12/13 (0.2), two masked (-inf) entries
LOGITS = np.array([0.1, 2.2, -1.0, 1.3, 0.4, 2.9, 1.3, -0.6, 0.2, 1.8, NEG_INF, -2.0,
                   0.7, 0.2, -0.3, 1.0, -1.5, NEG_INF, 0.9, -0.8, 0.0, 1.6, -2.5, 0.5], dtype=np.float32)


def make_batch(params: list[SamplingParams], generators=None, prompts=None, outputs=None, eos=None,
               bad_words=None) -> SamplingBatch:
    R = len(params)
    return SamplingBatch(
        params=params,
        generators=generators if generators is not None else [np.random.default_rng(i) for i in range(R)],
        prompt_token_ids=prompts if prompts is not None else [[] for _ in range(R)],
        output_token_ids=outputs if outputs is not None else [[] for _ in range(R)],
        eos_token_ids=eos if eos is not None else [0] * R,
        bad_words_ids=bad_words if bad_words is not None else [[] for _ in range(R)],
    )


def reference_distribution(logits: np.ndarray, temperature: float, top_k: int, top_p: float,
                           min_p: float) -> np.ndarray:
    """The definition, token by token: top-k, then top-p on the top-k renormalized mass, then min-p."""
    x = logits.astype(np.float64) / temperature
    p = np.exp(x - x.max())
    p /= p.sum()
    V = len(p)
    in_k = [top_k == 0 or sum(p[j] > p[i] for j in range(V)) < top_k for i in range(V)]
    z_k = sum(p[i] for i in range(V) if in_k[i])
    above = [sum(p[j] for j in range(V) if p[j] > p[i]) for i in range(V)]
    in_p = [top_p >= 1 or above[i] < top_p * z_k for i in range(V)]
    if top_p < 1:  # the test is meaningless if float rounding could move a token across the edge
        assert min(abs(a - top_p * z_k) for a in above) > 1e-4, "pick a top_p away from a boundary"
    keep = np.array([in_k[i] and in_p[i] and p[i] >= min_p * p.max() for i in range(V)])
    w = np.where(keep, p, 0.0)
    return w / w.sum()


@pytest.fixture
def sampler_for(monkeypatch: pytest.MonkeyPatch):
    def make(path: str) -> Sampler:
        if path == "base_window8":
            monkeypatch.setattr(sampler_module, "SORT_WINDOW", 8)
            return Sampler("base")
        return Sampler(path)
    return make


def draw_many(sampler: Sampler, logits: np.ndarray, params: SamplingParams, n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)  # one generator shared by every row: the draws follow row order
    batch = make_batch([params] * n, generators=[rng] * n)
    return sampler(np.tile(logits, (n, 1)), batch).token_ids


def assert_fits(tokens: np.ndarray, dist: np.ndarray, what: str) -> None:
    counts = np.bincount(tokens, minlength=len(dist))
    support = dist > 0
    assert counts[~support].sum() == 0, f"{what}: drew tokens outside the filtered set {np.flatnonzero(counts * ~support)}"
    if support.sum() > 1:
        p = chisquare(counts[support], dist[support] * len(tokens)).pvalue
        assert p > 1e-3, f"{what}: chi-square p={p:.2e}, counts {counts[support]} vs {dist[support] * len(tokens)}"


FILTERS = {  # name: (temperature, top_k, top_p, min_p)
    "plain": (1.0, 0, 1.0, 0.0),
    "top_p": (1.0, 0, 0.7, 0.0),
    "top_p_tie_edge": (1.0, 0, 0.64, 0.0),  # the cut lands inside the tied pair at ranks 5/6: both kept
    "top_k": (1.0, 6, 1.0, 0.0),
    "top_k_tie_edge": (1.0, 5, 1.0, 0.0),  # 5th and 6th tie: both are kept
    "min_p": (1.0, 0, 1.0, 0.08),
    "top_k_top_p": (0.8, 8, 0.8, 0.0),
    "all_three_hot": (1.7, 10, 0.9, 0.05),
    "top_p_min_p_cold": (0.5, 0, 0.95, 0.02),
}


@pytest.mark.parametrize("method", ALL_PATHS)
@pytest.mark.parametrize("name", list(FILTERS))
def test_draws_fit_the_exact_filtered_distribution(sampler_for, method: str, name: str) -> None:
    temperature, top_k, top_p, min_p = FILTERS[name]
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    tokens = draw_many(sampler_for(method), LOGITS, params, 30_000, seed=2024)
    assert_fits(tokens, reference_distribution(LOGITS, temperature, top_k, top_p, min_p), f"{method}/{name}")


@pytest.mark.parametrize("method", ALL_PATHS)
def test_rows_with_different_filters_in_one_batch_each_fit_their_own(sampler_for, method: str) -> None:
    names = ["top_k", "top_p", "all_three_hot", "plain"]
    params = [SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m)
              for t, k, p, m in (FILTERS[n] for n in names)]
    n = 20_000
    rng = np.random.default_rng(7)
    batch = make_batch(params * n, generators=[rng] * (len(names) * n))
    tokens = sampler_for(method)(np.tile(LOGITS, (len(names) * n, 1)), batch).token_ids
    for i, name in enumerate(names):
        assert_fits(tokens[i::len(names)], reference_distribution(LOGITS, *FILTERS[name]), f"{method}/{name} mixed")


def _run_steps(method: str, logits_by_row: list[np.ndarray], params: list[SamplingParams], seeds: list[int],
               steps: int = 6) -> list[list[int]]:
    gens = [np.random.default_rng(s) for s in seeds]
    outputs: list[list[int]] = [[] for _ in params]
    sampler = Sampler(method)
    for _ in range(steps):
        batch = make_batch(params, generators=gens, prompts=[[1, 2, 3]] * len(params), outputs=outputs)
        toks = sampler(np.stack(logits_by_row), batch).token_ids
        for out, t in zip(outputs, toks):
            out.append(int(t))
    return outputs


@pytest.mark.parametrize("method", METHODS)
def test_seeded_row_reproduces_alone_in_a_batch_and_in_any_row_order(method: str) -> None:
    rng = np.random.default_rng(0)
    V = 64
    mine = rng.normal(0, 2, V).astype(np.float32)
    my_params = SamplingParams(temperature=0.9, top_k=20, top_p=0.9, presence_penalty=0.3, seed=123)
    others = [(rng.normal(0, 2, V).astype(np.float32), p, s) for p, s in [
        (SamplingParams(temperature=0.0), 5),
        (SamplingParams(temperature=1.5, top_p=0.5), 6),
        (SamplingParams(temperature=1.0, top_k=3, min_p=0.1), 7),
    ]]
    alone = _run_steps(method, [mine], [my_params], [123])[0]
    rows = [(mine, my_params, 123)] + others
    together = _run_steps(method, *map(list, zip(*rows)))[0]
    reordered = _run_steps(method, *map(list, zip(*rows[::-1])))[-1]
    assert alone == together == reordered
    assert len(set(alone)) > 1  # it really sampled
    assert _run_steps(method, [mine], [my_params], [124])[0] != alone


@pytest.mark.parametrize("method", METHODS)
def test_greedy_rows_take_the_argmax_and_draw_nothing(method: str) -> None:
    logits = np.random.default_rng(3).normal(0, 1, (8, 30)).astype(np.float32)
    logits[:, 20:] = NEG_INF
    params = [SamplingParams(temperature=t, top_k=3, top_p=0.2, min_p=0.5) for t in (0.0, 1e-6) * 4]
    gens = [np.random.default_rng(9) if r % 2 else None for r in range(8)]
    state = [g.bit_generator.state if g else None for g in gens]
    out = Sampler(method)(logits, make_batch(params, generators=gens))
    assert out.token_ids.dtype == np.int64
    np.testing.assert_array_equal(out.token_ids, logits.argmax(axis=1))
    assert [g.bit_generator.state if g else None for g in gens] == state


def test_penalties_match_a_hand_computed_reference() -> None:
    logits = np.array([[2.0, -1.0, 0.5, -0.5, 1.5, 0.0, 3.0, -2.0]] * 3, dtype=np.float32)
    params = [SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25),
              SamplingParams(repetition_penalty=1.5),  # prompt tokens count as seen
              SamplingParams()]
    batch = make_batch(params, prompts=[[0, 1], [6, 7, 6], [0, 1]], outputs=[[1, 2, 2, 4], [3], [1, 2]])
    logit_edits(batch, logits.shape[1]).apply(logits)
    # row 0: repetition over {0, 1, 2, 4}: 2/2, -1*2, .5/2, 1.5/2; then -.25*count - .5 over output {1:1, 2:2, 4:1}
    expected = np.array([[1.0, -2.75, -0.75, -0.5, 0.0, 0.0, 3.0, -2.0],
                         [2.0, -1.0, 0.5, -0.75, 1.5, 0.0, 2.0, -3.0],
                         [2.0, -1.0, 0.5, -0.5, 1.5, 0.0, 3.0, -2.0]], dtype=np.float32)
    np.testing.assert_allclose(logits, expected, rtol=1e-6)


def test_a_repetition_penalty_changes_the_greedy_choice() -> None:
    logits = np.array([[3.0, 2.9, NEG_INF]], dtype=np.float32)
    out = Sampler()(logits, make_batch([SamplingParams(temperature=0, repetition_penalty=1.2)], outputs=[[0]]))
    assert out.token_ids.tolist() == [1]


def test_logit_bias_is_added_before_the_penalties_as_in_vllm() -> None:
    logits = np.array([[2.0, -1.0, 0.5, -0.5, 1.5, 0.0]] * 2, dtype=np.float32)
    params = [SamplingParams(logit_bias={"0": -3.0, 2: 1.5, 5: 0.25}, repetition_penalty=2.0, presence_penalty=0.5),
              SamplingParams(logit_bias={1: 100.0})]
    batch = make_batch(params, prompts=[[0], []], outputs=[[2, 3], []], bad_words=[[[5]], []])
    logit_edits(batch, logits.shape[1]).apply(logits)
    # row 0: 0: (2-3)*2 = -2 (seen, biased negative); 2: (0.5+1.5)/2 - .5 = .5; 3: -.5*2 - .5 = -1.5;
    # 5: biased, then banned by bad_words (the mask wins)
    expected = np.array([[-2.0, -1.0, 0.5, -1.5, 1.5, NEG_INF],
                         [2.0, 99.0, 0.5, -0.5, 1.5, 0.0]], dtype=np.float32)
    np.testing.assert_allclose(logits, expected, rtol=1e-6)


@pytest.mark.parametrize("method", METHODS)
def test_logit_bias_moves_greedy_and_sampled_choices(method: str) -> None:
    logits = np.tile(np.array([3.0, 2.0, 1.0, 0.0], dtype=np.float32), (400, 1))
    params = [SamplingParams(temperature=0, logit_bias={3: 3.5})] * 200 + \
             [SamplingParams(temperature=1.0, logit_bias={0: -100, 1: -100})] * 200
    toks = Sampler(method)(logits, make_batch(params)).token_ids
    assert (toks[:200] == 3).all()  # 0 + 3.5 beats 3.0
    assert set(toks[200:].tolist()) <= {2, 3} and len(set(toks[200:].tolist())) == 2  # -100 all but bans


def test_logit_bias_is_checked_when_the_params_are_built() -> None:
    assert SamplingParams(logit_bias={"7": 1, 3: -2.5}).logit_bias == {7: 1.0, 3: -2.5}
    for bad, words in [({"x": 1}, "logit_bias key"), ({-1: 1}, "logit_bias key"), ({1: 100.5}, "logit_bias[1]"),
                       ({1: float("nan")}, "logit_bias[1]"), ([1, 2], "logit_bias must be an object")]:
        with pytest.raises(ValueError, match=re.escape(words)):
            SamplingParams(logit_bias=bad)


@pytest.mark.parametrize("method", METHODS)
def test_min_tokens_suppresses_eos_and_stop_ids_until_reached(method: str) -> None:
    V, eos, stop = 10, 9, 8
    logits = np.zeros(V, dtype=np.float32)
    logits[[eos, stop]] = [10.0, 9.0]
    sampler = Sampler(method)
    for n_out in range(5):
        params = [SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[stop]),
                  SamplingParams(temperature=1.0, min_tokens=3, stop_token_ids=[stop])] * 100
        batch = make_batch(params, outputs=[[1] * n_out] * 200, eos=[eos] * 200)
        toks = sampler(np.tile(logits, (200, 1)), batch).token_ids
        if n_out < 3:
            assert not np.isin(toks, [eos, stop]).any()
        else:
            assert (toks[0::2] == eos).all()


def test_min_tokens_with_several_eos_ids_and_with_ignore_eos() -> None:
    logits = np.zeros((2, 6), dtype=np.float32)
    params = [SamplingParams(min_tokens=2, stop_token_ids=[1]),
              SamplingParams(min_tokens=2, stop_token_ids=[1], ignore_eos=True)]
    logit_edits(make_batch(params, outputs=[[3], [3]], eos=[[4, 5], 5]), 6).apply(logits)
    assert np.isneginf(logits[0, [1, 4, 5]]).all() and np.isfinite(logits[0, [0, 2, 3]]).all()
    assert np.isneginf(logits[1, 1]) and np.isfinite(logits[1, [0, 2, 3, 4, 5]]).all()


def test_bad_words_single_token_always_and_multi_token_after_its_prefix() -> None:
    V = 8
    words = [[5], [3, 6], [1, 2, 7]]
    outputs = [[], [0, 3], [3, 0], [0, 1, 2], [2], [0, 1, 2, 3]]
    logits = np.zeros((len(outputs), V), dtype=np.float32)
    params = [SamplingParams()] * len(outputs)
    logit_edits(make_batch(params, outputs=outputs, bad_words=[words] * len(outputs)), V).apply(logits)
    masked = [set(np.flatnonzero(np.isneginf(row)).tolist()) for row in logits]
    assert masked == [{5}, {5, 6}, {5}, {5, 7}, {5}, {5, 6}]


@pytest.mark.parametrize("method", METHODS)
def test_bad_words_are_never_sampled(method: str) -> None:
    logits = np.tile(np.array([0.0, 0.0, 0.0, 5.0, 5.0], dtype=np.float32), (500, 1))
    params = [SamplingParams(temperature=1.0, top_p=0.9)] * 500
    batch = make_batch(params, outputs=[[2]] * 500, bad_words=[[[3], [2, 4]]] * 500)
    toks = Sampler(method)(logits, batch).token_ids
    assert not np.isin(toks, [3, 4]).any()


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x[np.isfinite(x)].max()
    return x - m - np.log(np.exp(x - m).sum())


@pytest.mark.parametrize("method", METHODS)
def test_logprobs_are_the_raw_log_softmax_with_ranks(method: str) -> None:
    rng = np.random.default_rng(11)
    logits = rng.normal(0, 2, (4, 30)).astype(np.float32)
    logits[:, 25:] = NEG_INF
    logits[3, 5:] = NEG_INF  # only 5 real tokens, 8 asked for
    params = [SamplingParams(temperature=1.0, logprobs=5, repetition_penalty=1.8, frequency_penalty=1.0),
              SamplingParams(temperature=0.0, logprobs=0),
              SamplingParams(temperature=1.0),
              SamplingParams(temperature=0.7, logprobs=8)]
    out = Sampler(method)(logits, make_batch(params, outputs=[[0, 1, 2]] * 4))
    assert out.logprobs[2] is None
    assert list(out.logprobs[1]) == [int(out.token_ids[1])]
    for r, n in [(0, 5), (1, 0), (3, 5)]:
        ref = log_softmax(logits[r])
        got = out.logprobs[r]
        top = [int(t) for t in np.argsort(-ref, kind="stable")[:n]]
        assert set(got) == set(top) | {int(out.token_ids[r])}
        for t, (lp, rank) in got.items():
            assert lp == pytest.approx(ref[t], abs=1e-5)
            assert rank == 1 + int((ref > ref[t]).sum())
        assert sorted(got[t][1] for t in top) == list(range(1, n + 1))


def test_tied_logprobs_share_a_rank() -> None:
    logits = np.array([[1.0, 2.0, 2.0, 0.5]], dtype=np.float32)
    out = Sampler()(logits, make_batch([SamplingParams(temperature=0, logprobs=3)]))
    assert out.logprobs[0] == {1: pytest.approx((float(log_softmax(logits[0])[1]), 1)),
                               2: pytest.approx((float(log_softmax(logits[0])[2]), 1)),
                               0: pytest.approx((float(log_softmax(logits[0])[0]), 3))}


@pytest.mark.parametrize("method", METHODS)
def test_masked_vocabulary_tail_is_never_sampled_and_nothing_is_nan(method: str) -> None:
    n, V = 4000, 40
    logits = np.random.default_rng(5).normal(0, 1, (n, V)).astype(np.float32)
    logits[:, 10:] = NEG_INF
    logits[0, 1:] = NEG_INF  # a row with a single live token
    params = [SamplingParams(temperature=t, top_p=p, top_k=k, logprobs=3)
              for t, p, k in [(5.0, 0.99, 0), (1.0, 1.0, 0), (0.3, 0.5, 30), (2.0, 1.0, 0)]] * (n // 4)
    with np.errstate(invalid="raise", divide="raise", over="raise"):
        out = Sampler(method)(logits, make_batch(params, outputs=[[1]] * n, bad_words=[[[2]]] * n))
    assert out.token_ids[0] == 0
    assert (out.token_ids < 10).all()
    assert all(np.isfinite(lp) for d in out.logprobs for lp, _ in d.values())


class _TopOfUnitInterval:
    """A generator stand-in that always returns the largest double below 1."""
    def random(self) -> float:
        return 1.0 - 2.0 ** -53


@pytest.mark.parametrize("method", METHODS)
def test_a_uniform_at_the_top_of_the_interval_stays_on_live_tokens(method: str) -> None:
    logits = np.array([[2.0, 1.0, 3.0, NEG_INF, NEG_INF]] * 3, dtype=np.float32)
    params = [SamplingParams(), SamplingParams(top_p=0.5), SamplingParams(top_k=2, min_p=0.1)]
    out = Sampler(method)(logits, make_batch(params, generators=[_TopOfUnitInterval()] * 3))
    allowed = [{0, 1, 2}, {2}, {0, 2}]  # which one depends on the method's draw order
    assert all(int(t) in a for t, a in zip(out.token_ids, allowed))


def test_paddle_tensor_logits_are_accepted() -> None:
    paddle = pytest.importorskip("paddle")
    logits = np.random.default_rng(1).normal(0, 1, (3, 16)).astype(np.float32)
    out = Sampler()(paddle.to_tensor(logits), make_batch([SamplingParams(temperature=0)] * 3))
    np.testing.assert_array_equal(out.token_ids, logits.argmax(axis=1))


def test_method_names() -> None:
    for alias in ("base", "base_non_truncated", "air", "rejection"):
        Sampler(alias)
    with pytest.raises(ValueError, match="known: base, base_non_truncated, air, rejection"):
        Sampler("topk_topp")


def test_a_row_whose_every_token_is_masked_fails_alone() -> None:
    logits = np.array([[1.0, NEG_INF], [1.0, 3.0], [np.nan, np.nan]], dtype=np.float32)
    params = [SamplingParams(logprobs=1), SamplingParams(temperature=0, logprobs=1), SamplingParams()]
    out = Sampler()(logits, make_batch(params, bad_words=[[[0]], [], []]))
    assert sorted(out.errors) == [0, 2] and "no token left" in out.errors[0]
    assert out.token_ids[1] == 1 and out.logprobs[1] is not None
    assert out.logprobs[0] is None


def test_batch_lists_must_match_the_logits_rows() -> None:
    batch = make_batch([SamplingParams()] * 2)
    batch.eos_token_ids = [0]
    with pytest.raises(ValueError, match="eos_token_ids has 1 rows, logits have 2"):
        Sampler()(np.zeros((2, 4), dtype=np.float32), batch)


_values = st.sampled_from([NEG_INF, -3.0, -1.0, 0.0, 0.0, 0.5, 1.0, 2.0, 2.0, 4.0])


@st.composite
def _rows(draw):
    V = draw(st.integers(2, 14))
    logits = draw(st.lists(_values, min_size=V, max_size=V))
    logits[draw(st.integers(0, V - 1))] = draw(st.sampled_from([0.0, 1.0, 4.0]))  # at least one live token
    params = SamplingParams(temperature=draw(st.sampled_from([0.0, 0.5, 1.0, 2.0])),
                            top_k=draw(st.integers(0, V + 1)),
                            top_p=draw(st.sampled_from([0.05, 0.3, 0.77, 1.0])),
                            min_p=draw(st.sampled_from([0.0, 0.2, 0.9])))
    return np.array(logits, dtype=np.float32), params


@settings(max_examples=60, deadline=None)
@given(rows=st.lists(_rows(), min_size=1, max_size=4), seed=st.integers(0, 2**32 - 1))
def test_both_methods_only_draw_from_the_filtered_set(rows, seed: int) -> None:
    V = max(len(lg) for lg, _ in rows)
    logits = np.full((len(rows), V), NEG_INF, dtype=np.float32)
    for r, (lg, _) in enumerate(rows):
        logits[r, :len(lg)] = lg
    params = [p for _, p in rows]
    for method in METHODS:
        gens = [np.random.default_rng([seed, r]) for r in range(len(rows))]
        with np.errstate(invalid="raise"):
            toks = Sampler(method)(logits, make_batch(params, generators=gens)).token_ids
        for r, p in enumerate(params):
            if p.greedy:
                assert toks[r] == logits[r].argmax()
                continue
            x = logits[r].astype(np.float64) / p.temperature
            probs = np.exp(x - x.max())
            probs /= probs.sum()
            # the drawn token and everything more probable pass all three filters
            above = probs > probs[toks[r]]
            assert probs[toks[r]] > 0
            assert p.top_k == 0 or p.top_k >= V or above.sum() < p.top_k
            kth = np.sort(probs)[::-1][min(p.top_k, V) - 1] if 0 < p.top_k < V else 0.0
            z_k = probs[probs >= kth].sum()
            assert p.top_p >= 1 or probs[above].sum() < p.top_p * z_k + 1e-9
            assert probs[toks[r]] >= p.min_p * probs.max() - 1e-9


def test_argmax_rows_give_the_full_pipelines_greedy_tokens_and_failures():
    """ArgmaxRows (a step whose every row takes its argmax alone) against the whole pipeline on the same logits:
    same tokens, ties to the first index, and a row with no finite logit (all -inf, or a NaN) failing alone."""
    from ernie_serve.engine.sampler import ArgmaxRows

    rng = np.random.default_rng(0)
    x = rng.standard_normal((7, 50)).astype(np.float32)
    x[1, [3, 9]] = 9.0  # a tie
    x[2] = NEG_INF
    x[4, 5] = np.nan
    x[5, :49] = NEG_INF
    greedy = SamplingParams(temperature=0, max_tokens=4)
    full = Sampler()(x, make_batch([greedy] * 7, generators=[None] * 7))
    fast = Sampler()(x, ArgmaxRows(7))
    assert fast.token_ids.tolist() == full.token_ids.tolist()
    assert fast.token_ids[1] == 3 and fast.token_ids[5] == 49
    assert fast.errors == full.errors and set(fast.errors) == {2, 4}
    assert fast.logprobs == [None] * 7 and fast.token_ids.dtype == np.int64
    with pytest.raises(ValueError, match="3 argmax rows"):
        Sampler()(x, ArgmaxRows(3))


@pytest.mark.parametrize("change, plain", [
    ({}, True), ({"temperature": 0.7}, False), ({"logprobs": 0}, False), ({"logit_bias": {3: 1.0}}, False),
    ({"min_tokens": 2}, False), ({"repetition_penalty": 1.1}, False), ({"frequency_penalty": 0.5}, False),
    ({"presence_penalty": -0.5}, False)])
def test_a_request_takes_argmax_only_without_any_edit_mask_or_logprobs(change, plain):
    from ernie_serve.engine.sampler import takes_argmax_only

    p = SamplingParams(**{"temperature": 0, "max_tokens": 4, **change})
    assert takes_argmax_only(p, has_bad_words=False, guided=False) is plain
    assert not takes_argmax_only(p, has_bad_words=True, guided=False)
    assert not takes_argmax_only(p, has_bad_words=False, guided=True)
