"""Sampling on the kernels backend's device (kernels_backend/device_sampling.py) against the host sampler, on CPU
tensors of both frameworks: greedy batches give the host's tokens and dead rows exactly; sampled rows given the
same seeds draw the host's tokens (the same uniforms, the same base-method rule); batches that need the logits on
the host are copied and sampled there."""
from __future__ import annotations

import numpy as np
import pytest

from ernie_serve.engine.sampler import NO_TOKEN_LEFT, Sampler, SamplingBatch
from ernie_serve.kernels_backend.device_sampling import KernelLogits
from ernie_serve.kernels_backend.framework import make_tensor_ops
from ernie_serve.sampling_params import SamplingParams

NEG_INF = float("-inf")


def _batch(params: list[SamplingParams], seed: int = 0) -> SamplingBatch:
    n = len(params)
    return SamplingBatch(params=params, generators=[np.random.default_rng(seed + i) for i in range(n)],
                         prompt_token_ids=[[1]] * n, output_token_ids=[[2]] * n, eos_token_ids=[0] * n,
                         bad_words_ids=[[] for _ in range(n)])


class _Copies(KernelLogits):
    """KernelLogits that counts its copies to the host."""
    copies = 0

    def numpy(self):
        type(self).copies += 1
        return super().numpy()


def _both(framework: str, logits: np.ndarray, params: list[SamplingParams], seed: int = 0, method: str = "base"):
    ops = make_tensor_ops(framework)
    _Copies.copies = 0
    dev = Sampler(method)(_Copies(ops.tensor(logits), ops), _batch(params, seed))
    host = Sampler(method)(logits, _batch(params, seed))
    return dev, host


def test_a_greedy_batch_takes_the_hosts_tokens_ties_and_dead_rows_included(framework):
    rng = np.random.default_rng(3)
    logits = rng.standard_normal((5, 40)).astype(np.float32)
    logits[1, [4, 9]] = 5.0  # a tie: the first index
    logits[2] = NEG_INF
    logits[3, 7] = np.nan
    dev, host = _both(framework, logits, [SamplingParams(temperature=0.0)] * 5)
    assert dev.token_ids.tolist() == host.token_ids.tolist() and dev.token_ids[1] == 4
    assert dev.errors == host.errors == {2: NO_TOKEN_LEFT, 3: NO_TOKEN_LEFT}
    assert _Copies.copies == 0


@pytest.mark.parametrize("method", ["base", "rejection"])
@pytest.mark.parametrize("seed", range(4))
def test_sampled_rows_draw_the_hosts_tokens_from_the_same_seeds(framework, seed, method):
    """Either method (FD_SAMPLING_CLASS): rejection's rounds take their uniforms from the rows still rejecting,
    as the host's do, so the generators advance alike."""
    rng = np.random.default_rng(100 + seed)
    v = 300
    logits = (rng.standard_normal((12, v)) * 2.0).astype(np.float32)
    logits[0, :5] = 4.0  # a tie group at the top
    logits[1, 10:20] = 1.5  # a tie group across the top-k / top-p boundaries
    logits[2, 50:] = NEG_INF  # masked tokens
    params = [SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m, seed=1)
              for t, k, p, m in [(1.0, 3, 1.0, 0.0), (0.8, 12, 0.9, 0.0), (1.3, 0, 0.5, 0.0), (0.7, 0, 1.0, 0.2),
                                 (1.0, 0, 1.0, 0.0), (2.0, 50, 0.95, 0.05), (0.5, 1, 1.0, 0.0), (1.0, 400, 0.8, 0.0),
                                 (1.1, 7, 0.3, 0.1), (0.9, 0, 0.99, 0.0), (0.0, 0, 1.0, 0.0), (1.0, 2, 0.6, 0.5)]]
    draws_dev, draws_host = [], []
    for step in range(25):  # the generators advance together: 25 draws a row
        dev, host = _both(framework, logits, params, seed=seed * 1000 + step, method=method)
        draws_dev.append(dev.token_ids)
        draws_host.append(host.token_ids)
    assert np.array_equal(np.array(draws_dev), np.array(draws_host))
    assert _Copies.copies == 0 and not dev.errors


def _same_logprobs(got: list, want: list) -> None:
    """The same tokens and ranks, logprobs within float32 summation-order error."""
    assert [d is None for d in got] == [d is None for d in want]
    for g, w in zip(got, want):
        if w is not None:
            assert g.keys() == w.keys() and [g[t][1] for t in w] == [w[t][1] for t in w]
            np.testing.assert_allclose([g[t][0] for t in w], [w[t][0] for t in w], rtol=1e-5, atol=1e-5)


def test_logprobs_are_computed_on_the_device_from_the_unpenalized_logits(framework):
    rng = np.random.default_rng(5)
    logits = (rng.standard_normal((4, 60)) * 2).astype(np.float32)
    logits[2, 40:] = NEG_INF  # a masked vocabulary tail is never a top candidate
    logits[3, [7, 8]] = 6.0  # a tie at the top: both rank 1
    params = [SamplingParams(temperature=0.0, logprobs=3), SamplingParams(temperature=0.9, logprobs=0, seed=1),
              SamplingParams(temperature=1.0, logprobs=5, repetition_penalty=1.3, seed=2),
              SamplingParams(temperature=0.0, logprobs=2)]
    dev, host = _both(framework, logits, params)
    assert _Copies.copies == 0
    assert dev.token_ids.tolist() == host.token_ids.tolist()
    _same_logprobs(dev.logprobs, host.logprobs)
    assert dev.logprobs[3][7][1] == dev.logprobs[3][8][1] == 1 and len(dev.logprobs[1]) == 1


def _penalized_batch(seed: int) -> SamplingBatch:
    """Every penalty and mask: a logit bias (on seen, unseen and banned tokens), repetition over prompt + output,
    frequency / presence over output, a single-token bad word, a two-token bad word whose prefix ends the output,
    min_tokens masking eos and a stop id; greedy and sampled rows; one row left with no token."""
    params = [SamplingParams(temperature=0.0, repetition_penalty=1.5, logit_bias={4: 2.5, 30: 6.0, 9: -1.25}),
              SamplingParams(temperature=0.9, frequency_penalty=0.7, presence_penalty=0.3, seed=1,
                             logit_bias={6: 50.0, 17: -100.0}),
              SamplingParams(temperature=0.0, min_tokens=5, stop_token_ids=[7]),
              SamplingParams(temperature=1.2, top_k=5, repetition_penalty=0.8, presence_penalty=-0.5, seed=2),
              SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.0, min_tokens=3)]
    batch = _batch(params, seed)
    batch.prompt_token_ids = [[3, 4, 4, 9], [1], [2, 3], [10, 11, 12], [1], [1]]
    batch.output_token_ids = [[9, 5, 5], [6, 6, 6, 8, 13], [1], [12, 14], [20, 21], [1]]
    batch.bad_words_ids = [[], [[6]], [], [[14, 15]], [[21, 22], [30]], []]
    batch.eos_token_ids = [0, 0, 0, [0, 1], 0, 2]
    return batch


@pytest.mark.parametrize("seed", range(3))
def test_penalties_and_masks_are_applied_on_the_device_as_on_the_host(framework, seed):
    from ernie_serve.engine.sampler import logit_edits

    ops = make_tensor_ops(framework)
    logits = (np.random.default_rng(seed).standard_normal((6, 40)) * 3).astype(np.float32)
    logits[5, :] = NEG_INF
    logits[5, 2] = 1.0  # row 5's only token is its eos, masked by min_tokens: no token left
    edits = logit_edits(_penalized_batch(seed), 40)
    dev = KernelLogits(ops.tensor(logits), ops)
    dev.edit(edits)
    host = logits.copy()
    edits.apply(host)
    np.testing.assert_array_equal(dev.numpy(), host)  # the same float32 operations, bit for bit
    _Copies.copies = 0
    got = Sampler("base")(_Copies(ops.tensor(logits), ops), _penalized_batch(seed))
    want = Sampler("base")(logits, _penalized_batch(seed))
    assert _Copies.copies == 0
    assert got.token_ids[:5].tolist() == want.token_ids[:5].tolist() and got.errors == want.errors == {5: NO_TOKEN_LEFT}


def test_grammar_mask_rows_are_added_on_the_device(framework):
    ops = make_tensor_ops(framework)
    logits = np.random.default_rng(4).standard_normal((4, 20)).astype(np.float32)
    bias = np.zeros((2, 20), np.float32)
    bias[0, 5:] = NEG_INF
    bias[1, :19] = NEG_INF
    dev = KernelLogits(ops.tensor(logits), ops)
    dev.add_rows(np.array([3, 1]), bias)
    want = logits.copy()
    want[[3, 1]] += bias
    np.testing.assert_array_equal(dev.numpy(), want)
    assert dev.argmax()[0].tolist()[1] == 19 and dev.argmax()[0].tolist()[3] < 5


def _draft_batch(seed: int, q: np.ndarray, drafts: list[int]) -> SamplingBatch:
    """Eight sampled rows, five verifying a draft from q: two of one request (its generator shared, as a request's
    rows are in a verification step), a draft outside the row's filtered set, and a row whose q is its target p."""
    params = [SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m, seed=1)
              for t, k, p, m in [(0.8, 0, 1.0, 0.0), (0.8, 0, 1.0, 0.0), (1.2, 6, 0.9, 0.0), (0.7, 0, 0.8, 0.1),
                                 (1.0, 3, 1.0, 0.0), (0.0, 0, 1.0, 0.0), (1.0, 0, 1.0, 0.0), (0.9, 10, 0.95, 0.05)]]
    batch = _batch(params, seed)
    batch.generators[1] = batch.generators[0]
    batch.draft_tokens = [drafts[0], drafts[1], None, drafts[2], drafts[3], None, drafts[4], None]
    batch.draft_probs = [q[0], q[1], None, q[2], q[3], None, q[4], None]
    return batch


@pytest.mark.parametrize("seed", range(3))
def test_sampled_drafts_are_verified_on_the_device_as_on_the_host(framework, seed):
    from ernie_serve.engine.sampler import sampling_distribution

    ops = make_tensor_ops(framework)
    rng = np.random.default_rng(seed)
    v = 40
    logits = (rng.standard_normal((8, v)) * 2).astype(np.float32)
    q = rng.dirichlet(np.full(v, 0.5), size=5).astype(np.float32)
    q[4] = sampling_distribution(logits[6:7], [SamplingParams(temperature=1.0)])[0]  # q == p: residual ~0
    host_batch = _draft_batch(seed, q, [0, 0, 0, 0, 0])
    kept = [sampling_distribution(logits[[0, 1, 3, 4, 6]], [host_batch.params[r] for r in (0, 1, 3, 4, 6)])]
    rejected = int(np.flatnonzero(kept[0][3] == 0)[0])  # outside row 4's top-3: never kept
    draws_dev, draws_host = [], []
    for step in range(25):
        drafts = [int(rng.integers(v)), int(rng.integers(v)), int(rng.integers(v)), rejected, int(rng.integers(v))]
        _Copies.copies = 0
        # q crosses as device rows, as DeviceLogits.draft leaves it
        on_device = [ops.tensor(row.reshape(1, -1)) for row in q]
        dev = Sampler("base")(_Copies(ops.tensor(logits), ops), _draft_batch(seed * 100 + step, on_device, drafts))
        host = Sampler("base")(logits, _draft_batch(seed * 100 + step, q, drafts))
        assert _Copies.copies == 0
        draws_dev.append(dev.token_ids)
        draws_host.append(host.token_ids)
    draws_dev, draws_host = np.array(draws_dev), np.array(draws_host)
    assert np.array_equal(draws_dev, draws_host)
    assert (draws_dev[:, 4] != rejected).all()  # a draft outside the set is always replaced


def test_drafts_drawn_on_the_device_are_the_hosts_and_their_q_stays_there(framework):
    from ernie_serve.engine.sampler import draw, row_filters, sampling_distribution

    ops = make_tensor_ops(framework)
    rng = np.random.default_rng(9)
    logits = (rng.standard_normal((4, 50)) * 2).astype(np.float32)
    logits[1, 30:] = NEG_INF
    params = [SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m)
              for t, k, p, m in [(1.0, 0, 1.0, 0.0), (0.6, 5, 1.0, 0.0), (1.5, 0, 0.7, 0.0), (0.9, 8, 0.9, 0.1)]]
    want_q = sampling_distribution(logits, params)
    for trial in range(20):
        u = rng.random(4)
        rows = np.arange(4)
        tokens, qs = KernelLogits(ops.tensor(logits), ops).draft(
            rows, np.array([p.temperature for p in params], np.float32), *row_filters(params, rows, 50), u)
        assert tokens.tolist() == [draw(q, ui) for q, ui in zip(want_q, u)]
    assert all(not isinstance(q, np.ndarray) and tuple(q.shape) == (1, 50) for q in qs)
    np.testing.assert_allclose(np.concatenate([ops.to_host(q) for q in qs]), want_q, rtol=1e-5, atol=1e-7)


def test_verification_on_the_device_emits_the_target_distribution(framework):
    """Drafts from a deliberately different q, verified against p with top-k / top-p filters; 20k trials."""
    from scipy.stats import chisquare

    from ernie_serve.engine.sampler import filtered_distribution

    ops = make_tensor_ops(framework)
    rng = np.random.default_rng(0)
    v, rows = 12, 1000
    logits = rng.normal(0, 1.5, v).astype(np.float32)
    params = SamplingParams(temperature=0.8, top_k=8, top_p=0.9, seed=1)
    probs = np.exp(logits / 0.8 - (logits / 0.8).max())
    target = filtered_distribution((probs / probs.sum())[None], np.array([8]), np.array([0.9]), np.array([0.0]))[0]
    q = rng.dirichlet(np.ones(v) * 0.7).astype(np.float32)
    q_row = ops.tensor(q.reshape(1, -1))
    gen = np.random.default_rng(5)
    counts = np.zeros(v)
    for _ in range(20):
        d = gen.choice(v, size=rows, p=q / q.sum())
        batch = SamplingBatch(params=[params] * rows, generators=[gen] * rows, prompt_token_ids=[[]] * rows,
                              output_token_ids=[[]] * rows, eos_token_ids=[None] * rows, bad_words_ids=[[]] * rows,
                              draft_tokens=d.tolist(), draft_probs=[q_row] * rows)
        counts += np.bincount(Sampler()(KernelLogits(ops.tensor(np.tile(logits, (rows, 1))), ops), batch).token_ids,
                              minlength=v)
    keep = target > 0
    assert counts[~keep].sum() == 0
    expected = target[keep].astype(np.float64)
    _, p_value = chisquare(counts[keep], expected / expected.sum() * counts.sum())
    assert p_value > 1e-3, (counts, target * counts.sum())


@pytest.mark.parametrize("method", ["base", "rejection"])
def test_a_sampled_row_with_no_token_left_fails_alone(framework, method):
    logits = np.random.default_rng(2).standard_normal((3, 30)).astype(np.float32)
    logits[1] = NEG_INF
    params = [SamplingParams(temperature=0.9, top_p=0.5, seed=1)] * 3
    dev, host = _both(framework, logits, params, method=method)
    assert dev.errors == host.errors == {1: NO_TOKEN_LEFT}
    assert dev.token_ids[[0, 2]].tolist() == host.token_ids[[0, 2]].tolist()


def test_a_batch_without_top_k_or_top_p_sorts_nothing(framework, monkeypatch):
    ops = make_tensor_ops(framework)
    sorts = []
    sort = ops.sort_rows_desc
    monkeypatch.setattr(ops, "sort_rows_desc", lambda t: (sorts.append(1), sort(t))[1])
    logits = (np.random.default_rng(6).standard_normal((4, 50)) * 2).astype(np.float32)
    params = [SamplingParams(temperature=0.9, min_p=0.1, seed=1), SamplingParams(temperature=0.0, top_k=5),
              SamplingParams(temperature=1.3, seed=2), SamplingParams(temperature=0.6, seed=3)]
    dev = Sampler("base")(KernelLogits(ops.tensor(logits), ops), _batch(params))
    assert dev.token_ids.tolist() == Sampler("base")(logits, _batch(params)).token_ids.tolist() and not sorts


def test_prompt_rows_are_split_off_and_reduced_on_the_device_as_on_the_host(framework):
    """A step's logits: its sampled rows, then the rows computed for prompt logprobs. Split on the device, each
    part gives the host's figures, and nothing crosses whole."""
    from ernie_serve.engine.sampler import prompt_logprobs, split_logits

    rng = np.random.default_rng(9)
    logits = rng.standard_normal((5, 60)).astype(np.float32)
    targets, counts = np.array([3, 59, 0], dtype=np.int64), [2, 0, 4]
    ops = make_tensor_ops(framework)
    _Copies.copies = 0
    dev_sampled, dev_prompt = split_logits(_Copies(ops.tensor(logits), ops), 2, 3)
    host_sampled, host_prompt = split_logits(logits, 2, 3)
    params = [SamplingParams(temperature=0.0)] * 2
    assert Sampler()(dev_sampled, _batch(params)).token_ids.tolist() == \
        Sampler()(host_sampled, _batch(params)).token_ids.tolist()
    dev, host = prompt_logprobs(dev_prompt, targets, counts), prompt_logprobs(host_prompt, targets, counts)
    assert [sorted(d) for d in dev] == [sorted(h) for h in host]
    for d, h in zip(dev, host):
        for t in h:
            assert d[t][1] == h[t][1] and abs(d[t][0] - h[t][0]) < 1e-5
    for row, t, k, h in zip(logits[2:], targets, counts, host):  # the target and the top k
        top = set(np.argsort(-row)[:k].tolist())
        assert set(h) == top | {int(t)}
    assert _Copies.copies == 0


class _RowLimitedOps:
    """TensorOps that fail when an op returns more than `limit` rows of vocabulary-wide values: a reduction that
    is not chunked would hold [rows, vocab] temporaries for a whole prompt at once."""

    def __init__(self, ops, vocab: int, limit: int):
        self._ops, self._vocab, self._limit = ops, vocab, limit

    def __getattr__(self, name):
        attr = getattr(self._ops, name)
        if not callable(attr):
            return attr

        def checked(*args, **kwargs):
            out = attr(*args, **kwargs)
            for t in out if isinstance(out, tuple) else (out,):
                shape = tuple(getattr(t, "shape", ()))
                assert not (len(shape) == 2 and shape[1] == self._vocab and shape[0] > self._limit), \
                    f"{name} made a [{shape[0]}, {shape[1]}] tensor; at most {self._limit} rows at once"
            return out

        return checked


def test_long_prompt_logprobs_are_reduced_a_chunk_of_rows_at_a_time(framework, monkeypatch):
    """Rows past the chunk are reduced in separate chunks (taking the prompt rows is a view, not a copy), and the
    figures are the host's: tokens, ranks (a tie in the top counts once), logprobs, a masked tail left out."""
    from ernie_serve import step_contract
    from ernie_serve.engine.sampler import prompt_logprobs, split_logits

    monkeypatch.setattr(step_contract, "LOGPROB_ROWS_AT_ONCE", 16)
    rng = np.random.default_rng(11)
    sampled, prompt, v = 2, 40, 50
    logits = (rng.standard_normal((sampled + prompt, v)) * 2).astype(np.float32)
    logits[5, [3, 9]] = 7.0  # a tie at the top, inside the top n
    logits[20, 30:] = NEG_INF
    targets = rng.integers(0, v, prompt)
    counts = [int(c) for c in rng.integers(0, 6, prompt)]
    counts[5 - sampled] = 3
    ops = make_tensor_ops(framework)
    spy = _RowLimitedOps(ops, v, 16)
    _, dev_prompt = split_logits(KernelLogits(ops.tensor(logits), spy), sampled, prompt)
    dev = prompt_logprobs(dev_prompt, targets, counts)
    host = prompt_logprobs(split_logits(logits, sampled, prompt)[1], targets, counts)
    assert [sorted(d) for d in dev] == [sorted(h) for h in host]
    for d, h in zip(dev, host):
        for t in h:
            assert d[t][1] == h[t][1] and abs(d[t][0] - h[t][0]) < 1e-5
    assert dev[5 - sampled][3][1] == dev[5 - sampled][9][1] == 1


def test_top_logprobs_of_no_top_tokens_sorts_nothing(framework, monkeypatch):
    """logprobs=0 asks only for the sampled token's figures: no top-k and no sort of the vocabulary."""
    ops = make_tensor_ops(framework)
    for name in ("sort_rows_desc", "topk_rows"):
        monkeypatch.setattr(ops, name, lambda *a, _name=name: pytest.fail(f"{_name} called for n=0"))
    logits = np.random.default_rng(4).standard_normal((3, 20)).astype(np.float32)
    got = KernelLogits(ops.tensor(logits), ops).top_logprobs(np.arange(3), np.array([1, 2, 3]), 0)
    assert got.top_ids.shape == got.top.shape == (3, 0)
    lp = logits - np.log(np.exp(logits).sum(1, keepdims=True))
    np.testing.assert_allclose(got.sampled, lp[[0, 1, 2], [1, 2, 3]], rtol=1e-5, atol=1e-5)
    assert got.sampled_rank.tolist() == [int((lp[i] > lp[i, i + 1]).sum()) + 1 for i in range(3)]
