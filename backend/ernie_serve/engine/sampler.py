"""Turns one step's logits into tokens: bias, penalties, masks, greedy / temperature / top-k / top-p / min-p.

The pipeline, per row (vectorized over the batch):
  logit_bias -> penalties (repetition, frequency, presence) -> bad words and min_tokens masks -> the guided-decoding
  grammar mask (engine/guided.py; eos only where the grammar is complete) -> greedy rows take
  the argmax -> temperature -> top_k -> top_p (on the top-k renormalized distribution) -> min_p
  (relative to the most probable token) -> one inverse-CDF draw from the row's own generator.

Membership is defined by probability values only, so ties are treated alike by both methods:
  top-k:  fewer than k tokens are strictly more probable;
  top-p:  the mass of the strictly more probable tokens is < top_p * (mass of the top-k set);
  min-p:  prob >= min_p * max prob.
Each is an "upper set" (if a token is in it, so is every more probable token), and so is their
intersection; that is what lets the rejection method find it without sorting.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from ..sampling_params import GREEDY_EPSILON, SamplingParams
from ..step_contract import LOGPROB_ROWS_AT_ONCE, ArgmaxLogits, DeviceLogits, LogitEdits, TopLogprobs
from .guided import GrammarRows, grammar_masks

if TYPE_CHECKING:
    import paddle

# FD_SAMPLING_CLASS values; FastDeploy's GPU-only variants of the exact sampler map to it here
SAMPLING_METHODS = {"base": "base", "base_non_truncated": "base", "air": "base", "rejection": "rejection"}
# the base method sorts a row's SORT_WINDOW most probable tokens instead of its whole vocabulary
# when they provably hold every token that survives its filters (a peaked distribution's usual case)
SORT_WINDOW = 1024
_NO_ROWS = np.zeros(0, dtype=np.int64)
NO_TOKEN_LEFT = ("no token left to sample: every logit is -inf or NaN after penalties, bad_words, the "
                 "min_tokens mask of eos/stop_token_ids and the guided-decoding grammar")


@dataclass
class SamplingBatch:
    """One row per sequence to sample this step; built by the model runner."""
    params: list[SamplingParams]
    generators: list[np.random.Generator]  # one per row, owned by the request (may be None for greedy rows)
    prompt_token_ids: list[Sequence[int]]  # prompt + output count as "seen" for repetition_penalty
    output_token_ids: list[Sequence[int]]  # presence/frequency penalties count these only
    eos_token_ids: list[int]  # per row; an entry may also be a list of ids (models with several eos)
    bad_words_ids: list[list[list[int]]]  # per row: token sequences that must not be produced
    grammars: list[GrammarRows] = field(default_factory=list)  # per guided request (not per row)
    # Rows that verify a draft sampled from a draft distribution q (MTP at temperature > 0): the draft
    # token and q, per row (None elsewhere): q is a host [V] array, or the [1, V] device row DeviceLogits.draft
    # left where it was drawn. See verify_sampled_drafts.
    draft_tokens: list[int | None] | None = None
    draft_probs: list[Any] | None = None

    @property
    def greedy_rows(self) -> np.ndarray:
        """[R] bool: the rows that take their argmax (temperature ~ 0)."""
        return np.array([p.temperature < GREEDY_EPSILON for p in self.params], dtype=bool)


@dataclass
class ArgmaxRows:
    """A step whose every row takes its argmax and nothing else (see takes_argmax_only): the runner hands this
    instead of a SamplingBatch, so such a step builds no per-row sampling metadata, and the sampler reads the
    logits once."""
    num_rows: int


def takes_argmax_only(p: SamplingParams, has_bad_words: bool, guided: bool) -> bool:
    """Whether a request's every token is its logits' argmax, untouched: greedy, and none of the edits, masks or
    logprobs the pipeline above applies (min_tokens masks eos while the output is short). Decided once per
    request (Request.takes_argmax)."""
    return (p.temperature < GREEDY_EPSILON and p.logprobs is None and not has_bad_words and not guided
            and p.min_tokens == 0 and not _biased_or_penalized(p))


def samples_without_history(p: SamplingParams, has_bad_words: bool, guided: bool) -> bool:
    """Whether a request's next token is drawn from its logits alone, whatever its output so far: what lets the
    engine schedule a step before the previous step's token is known (its row's input is filled in when it
    runs). Penalties, bad words, min_tokens and grammars read the output; logprobs, seeds and a logit bias do not."""
    return not has_bad_words and not guided and p.min_tokens == 0 and not _penalized(p)


def _penalized(p: SamplingParams) -> bool:
    """A repetition / frequency / presence penalty: an edit of the logits that reads the output so far."""
    return p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0


def _biased_or_penalized(p: SamplingParams) -> bool:
    """A logit bias or a penalty: edits logit_edits makes whatever the output."""
    return bool(p.logit_bias) or _penalized(p)


@dataclass
class SamplerOutput:
    token_ids: np.ndarray  # [R] int64
    # per row when params.logprobs is not None: {token_id: (logprob, rank)} for the sampled token and the
    # top-`logprobs` tokens, from the raw log-softmax; rank = 1 + number of tokens strictly more likely
    logprobs: list[dict[int, tuple[float, int]] | None]
    # rows that could not be sampled, with the reason; their token is meaningless and their request fails
    # alone (the other rows of the batch are sampled as usual)
    errors: dict[int, str] = field(default_factory=dict)


class Sampler:
    def __init__(self, method: str = "base"):
        if method not in SAMPLING_METHODS:
            raise ValueError(f"unknown sampling method {method!r} (FD_SAMPLING_CLASS); "
                             f"known: {', '.join(SAMPLING_METHODS)}")
        self.method = SAMPLING_METHODS[method]

    def __call__(self, logits: "np.ndarray | paddle.Tensor | DeviceLogits",
                 batch: SamplingBatch | ArgmaxRows) -> SamplerOutput:
        if type(batch) is ArgmaxRows:
            return _argmax_rows(logits, batch.num_rows)
        if isinstance(logits, ArgmaxLogits):
            raise TypeError("ArgmaxLogits can only be sampled as ArgmaxRows (the step was marked argmax_only)")
        if isinstance(logits, DeviceLogits):
            return _sample_on_device(logits, batch, self.method)
        raw = _as_float32_matrix(logits)
        _check_batch(raw, batch)
        edits = logit_edits(batch, raw.shape[1])
        work = raw.copy() if edits is not None or batch.grammars else raw  # raw stays as it came, for logprobs
        if edits is not None:
            edits.apply(work)
        apply_grammar_masks(work, batch)
        params = batch.params
        greedy = batch.greedy_rows
        argmax = None
        if greedy.all() and work.size:
            argmax, row_max = _argmax_and_max(work)
        else:
            row_max = work.max(axis=1) if work.size else np.zeros(0, np.float32)
        dead, errors = _dead_rows(row_max)
        if errors:
            work = work.copy() if work is raw else work
            work[dead] = 0.0  # sampled only to keep the batch's shape
            if argmax is not None:
                argmax[dead] = 0  # the argmax of a row of zeros

        if greedy.all():
            token_ids = argmax if argmax is not None else np.argmax(work, axis=1).astype(np.int64)
        else:
            token_ids = np.empty(len(params), dtype=np.int64)
            token_ids[greedy] = np.argmax(work[greedy], axis=1)
        rows = np.flatnonzero(~greedy)
        if rows.size:
            probs = _softmax(work[rows], np.array([params[r].temperature for r in rows], dtype=np.float32))
            gens = _generators(batch, rows)
            top_k, top_p, min_p = row_filters(params, rows, probs.shape[1])
            method = _sample_sorted if self.method == "base" else _sample_rejection
            token_ids[rows] = method(probs, top_k, top_p, min_p, gens)
            if batch.draft_probs is not None:
                verify_sampled_drafts(token_ids, rows, probs, top_k, top_p, min_p, gens, batch)
        rows, n = _logprob_rows(params, raw.shape[1])
        logprobs = _logprob_dicts(rows, params, token_ids, _top_logprobs(raw[rows], token_ids[rows], n)) \
            if rows.size else [None] * len(params)
        for r in errors:
            logprobs[r] = None
        return SamplerOutput(token_ids=token_ids, logprobs=logprobs, errors=errors)


def _argmax_rows(logits: "np.ndarray | paddle.Tensor | DeviceLogits", num_rows: int) -> SamplerOutput:
    """Every row's argmax, read in one pass over the logits (a row's max is the logit its argmax points at); a row
    with no finite logit fails alone, as in the full pipeline."""
    if isinstance(logits, (DeviceLogits, ArgmaxLogits)):
        token_ids, row_max = logits.argmax()
    else:
        raw = _as_float32_matrix(logits)
        if raw.shape[0] != num_rows or not raw.shape[1]:
            raise ValueError(f"logits of shape {list(raw.shape)} for {num_rows} argmax rows")
        token_ids, row_max = _argmax_and_max(raw)
    dead, errors = _dead_rows(row_max)
    token_ids = (np.where(dead, 0, token_ids) if errors else token_ids).astype(np.int64, copy=False)
    return SamplerOutput(token_ids=token_ids, logprobs=[None] * num_rows, errors=errors)


def _argmax_and_max(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each row's argmax (int64) and largest value in one pass over x: a row's max is the value its argmax points
    at."""
    argmax = np.argmax(x, axis=1).astype(np.int64)
    return argmax, x[np.arange(x.shape[0]), argmax]


def _dead_rows(row_max: np.ndarray) -> tuple[np.ndarray, dict[int, str]]:
    """The rows with no token left (largest logit -inf, or a NaN, which argmax and max both take) and their errors."""
    dead = ~np.isfinite(row_max)
    return dead, {int(r): NO_TOKEN_LEFT for r in np.flatnonzero(dead)}


def _sample_on_device(logits: DeviceLogits, batch: SamplingBatch, method: str) -> SamplerOutput:
    """A batch where its logits are: its penalties and masks, its grammar masks, then greedy rows' argmax and the
    others' draws by the method (one uniform each for "base", one a round for "rejection"), then the rows verifying
    a sampled draft the rejection rule from two more, each taken from the row's generator in the order the host
    takes them (so a seed reproduces)."""
    params = batch.params
    greedy = batch.greedy_rows
    edits = logit_edits(batch, logits.vocab_size)
    if edits is not None:
        logits.edit(edits)
    if batch.grammars:
        rows, bias = grammar_masks(batch.grammars, len(params), logits.vocab_size)
        if rows.size:
            logits.add_rows(rows, bias)
    if greedy.all():
        token_ids, row_max = logits.argmax()
    else:
        rows = np.flatnonzero(~greedy)
        gens = dict(zip(rows.tolist(), _generators(batch, rows)))
        temperature = np.array([1.0 if g else p.temperature for p, g in zip(params, greedy)], dtype=np.float32)
        top_k, top_p, min_p = row_filters(params, np.arange(len(params)), logits.vocab_size)
        verifying = np.zeros(len(params), dtype=bool)
        if batch.draft_probs is not None:
            verifying[rows] = [batch.draft_probs[r] is not None for r in rows]
        if method == "rejection":  # its rounds take uniforms for verifying rows too, as the host's do
            token_ids, row_max = logits.sample_rejection(greedy, temperature, top_k, top_p, min_p,
                                                         lambda live: np.array([gens[r].random() for r in live]))
        else:
            u = np.zeros(len(params))
            u[rows] = [gens[r].random() for r in rows]
            # verify replaces a verifying row's draw: its uniform is taken as on the host, its draw (a sort) skipped
            token_ids, row_max = logits.sample(greedy | verifying, temperature, top_k, top_p, min_p, u)
        if verifying.any():
            v = np.flatnonzero(verifying)
            u_accept, u_residual = _verify_uniforms(_generators(batch, v))
            token_ids[v] = logits.verify(v, temperature[v], top_k[v], top_p[v], min_p[v],
                                         np.array([batch.draft_tokens[r] for r in v], dtype=np.int64),
                                         [batch.draft_probs[r] for r in v], u_accept, u_residual)
    dead, errors = _dead_rows(row_max)
    token_ids = np.where(dead, 0, token_ids).astype(np.int64)
    rows, n = _logprob_rows(params, logits.vocab_size)
    logprobs = [None] * len(params)
    if rows.size:
        logprobs = _logprob_dicts(rows, params, token_ids, logits.top_logprobs(rows, token_ids[rows], n))
    for r in errors:
        logprobs[r] = None
    return SamplerOutput(token_ids=token_ids, logprobs=logprobs, errors=errors)


def _generators(batch: SamplingBatch, rows: np.ndarray) -> list[np.random.Generator]:
    """The sampled rows' generators (a row without one cannot draw)."""
    gens = [batch.generators[r] for r in rows]
    missing = [int(r) for r, g in zip(rows, gens) if g is None]
    if missing:
        raise ValueError(f"rows {missing} sample (temperature > 0) but have no generator")
    return gens


def row_filters(params: list[SamplingParams], rows: np.ndarray,
             vocab: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The rows' top_k, top_p, min_p as the draws take them: top_k 0 (off) when <= 0 or covering the vocabulary,
    top_p at most 1 (1 = off)."""
    top_k = np.array([params[r].top_k for r in rows], dtype=np.int64)
    top_p = np.array([params[r].top_p for r in rows], dtype=np.float64)
    min_p = np.array([params[r].min_p for r in rows], dtype=np.float64)
    top_k[(top_k <= 0) | (top_k >= vocab)] = 0
    top_p[top_p >= 1.0] = 1.0
    return top_k, top_p, min_p


def logit_edits(batch: SamplingBatch, vocab: int) -> LogitEdits | None:
    """The batch's logit bias, penalties and masks (None when it has none); raises ValueError for a prompt, output or
    bias id outside the vocabulary of a penalized or biased row."""
    bias_keys, bias_vals, rep_keys, rep_vals, out_keys, mask_keys = [], [], [], [], [], []
    outputs, bad_words = batch.output_token_ids, batch.bad_words_ids
    for r, p in enumerate(batch.params):
        if not (bad_words[r] or len(outputs[r]) < p.min_tokens or _biased_or_penalized(p)):
            continue  # the usual row: nothing to edit (checked here, before any array is made for it)
        if p.logit_bias:
            ids = np.fromiter(p.logit_bias, dtype=np.int64, count=len(p.logit_bias))
            bias_keys.append(r * vocab + _checked_ids(ids, vocab, "logit_bias"))
            bias_vals.append(np.fromiter(p.logit_bias.values(), dtype=np.float32, count=len(p.logit_bias)))
        if p.repetition_penalty != 1.0:
            seen = np.unique(np.concatenate([np.asarray(batch.prompt_token_ids[r], dtype=np.int64).ravel(),
                                             np.asarray(batch.output_token_ids[r], dtype=np.int64).ravel()]))
            rep_keys.append(r * vocab + _checked_ids(seen, vocab, "prompt/output"))
            rep_vals.append(np.full(seen.size, p.repetition_penalty, dtype=np.float32))
        if p.frequency_penalty != 0.0 or p.presence_penalty != 0.0:
            out = np.asarray(batch.output_token_ids[r], dtype=np.int64).ravel()
            out_keys.append(r * vocab + _checked_ids(out, vocab, "output"))
        masked = _masked_tokens(batch, r, p, vocab)
        if masked.size:
            mask_keys.append(r * vocab + masked)
    cat = lambda parts, dtype: np.concatenate(parts).astype(dtype) if parts else np.zeros(0, dtype)  # noqa: E731
    bias_k, rep_k = cat(bias_keys, np.int64), cat(rep_keys, np.int64)
    out_k, mask_k = cat(out_keys, np.int64), cat(mask_keys, np.int64)
    if not (bias_k.size or rep_k.size or out_k.size or mask_k.size):
        return None
    keys, inverse = np.unique(np.concatenate([bias_k, rep_k, out_k, mask_k]), return_inverse=True)
    n_bias, n_rep, n_out = bias_k.size, rep_k.size, out_k.size
    bias = np.zeros(keys.size, dtype=np.float32)
    bias[inverse[:n_bias]] = cat(bias_vals, np.float32)
    inverse = inverse[n_bias:]
    repetition = np.ones(keys.size, dtype=np.float32)
    repetition[inverse[:n_rep]] = cat(rep_vals, np.float32)
    counts = np.bincount(inverse[n_rep:n_rep + n_out], minlength=keys.size).astype(np.float32)
    rows = keys // vocab
    freq = np.array([p.frequency_penalty for p in batch.params], dtype=np.float32)[rows]
    pres = np.array([p.presence_penalty for p in batch.params], dtype=np.float32)[rows]
    subtract = np.where(counts > 0, freq * counts + pres, np.float32(0)).astype(np.float32)
    masked = np.zeros(keys.size, dtype=bool)
    masked[inverse[n_rep + n_out:]] = True
    return LogitEdits(rows, keys % vocab, bias, repetition, subtract, masked)


def _masked_tokens(batch: SamplingBatch, r: int, p: SamplingParams, vocab: int) -> np.ndarray:
    """Row r's -inf tokens: bad words (a multi-token word's last token only once the output ends with the rest of
    it) and, while the output is shorter than min_tokens, the eos and stop token ids."""
    out = batch.output_token_ids[r]
    toks = []
    for word in batch.bad_words_ids[r]:
        m = len(word) - 1
        if m < 0 or len(out) < m:
            continue
        if m == 0 or [int(t) for t in out[len(out) - m:]] == [int(t) for t in word[:-1]]:
            toks.append(int(word[-1]))
    if len(out) < p.min_tokens:
        toks.extend(p.stop_token_ids)
        eos = batch.eos_token_ids[r]
        if not p.ignore_eos and eos is not None:  # with ignore_eos, eos is an ordinary token (vLLM)
            toks.extend(np.atleast_1d(np.asarray(eos, dtype=np.int64)).tolist())
    ids = np.asarray(toks, dtype=np.int64)
    return ids[(ids >= 0) & (ids < vocab)]  # ids beyond this vocab can never be produced anyway


def apply_grammar_masks(logits: np.ndarray, batch: SamplingBatch) -> None:
    """In place: -inf for every token a guided row's grammar does not allow next."""
    if not batch.grammars:
        return
    rows, bias = grammar_masks(batch.grammars, logits.shape[0], logits.shape[1])
    if rows.size:
        logits[rows] += bias


def _sample_sorted(probs: np.ndarray, top_k: np.ndarray, top_p: np.ndarray, min_p: np.ndarray,
                   gens: list[np.random.Generator]) -> np.ndarray:
    """Exact filtering on a descending sort; rows with neither top_k nor top_p skip the sort.

    A row sorts only its SORT_WINDOW most probable tokens when that provably holds the whole
    filtered set (see _window_suffices), the whole vocabulary otherwise.
    """
    R, V = probs.shape
    u = np.array([g.random() for g in gens])
    tokens = np.empty(R, dtype=np.int64)
    needs_sort = (top_k > 0) | (top_p < 1.0)

    plain = np.flatnonzero(~needs_sort)
    if plain.size:
        p = probs[plain]
        p = np.where(p >= (min_p[plain] * p.max(axis=1))[:, None], p, 0.0)
        tokens[plain] = _inverse_cdf(p, u[plain])

    srt = np.flatnonzero(needs_sort)
    if not srt.size:
        return tokens
    p = probs[srt]
    total = p.sum(axis=1, dtype=np.float64)
    full = np.ones(srt.size, dtype=bool)
    if SORT_WINDOW < V:
        window = np.argpartition(p, V - SORT_WINDOW, axis=1)[:, V - SORT_WINDOW:]
        pw = np.take_along_axis(p, window, axis=1)
        fits = _window_suffices(pw, top_k[srt], top_p[srt], total)
        full = ~fits
        if fits.any():
            i = np.flatnonzero(fits)
            order = np.take_along_axis(window[i], np.argsort(pw[i], axis=1)[:, ::-1], axis=1)
            tokens[srt[i]] = _draw_sorted(p[i], order, top_k[srt[i]], top_p[srt[i]], min_p[srt[i]], total[i], u[srt[i]])
    if full.any():
        i = np.flatnonzero(full)
        order = np.argsort(p[i], axis=1)[:, ::-1]  # descending; the order among ties does not matter
        tokens[srt[i]] = _draw_sorted(p[i], order, top_k[srt[i]], top_p[srt[i]], min_p[srt[i]], total[i], u[srt[i]])
    return tokens


def _window_suffices(pw: np.ndarray, top_k: np.ndarray, top_p: np.ndarray, total: np.ndarray) -> np.ndarray:
    """Rows whose filtered set lies inside the window (the row's W most probable tokens).

    Every token outside the window is at most as probable as the window's smallest, `floor`, so it
    has at least as many tokens (and as much mass) strictly above it as `floor` does. If that is
    already >= k, or the mass >= top_p * total on a row without top_k, no such token survives; and
    the top-k mass, needed for top_p, then lies in the window too.
    """
    floor = pw.min(axis=1)
    above = pw > floor[:, None]
    kept_by_k = (top_k > 0) & (above.sum(axis=1) >= top_k)
    kept_by_p = (top_k == 0) & (np.where(above, pw, 0.0).sum(axis=1, dtype=np.float64) >= top_p * total)
    return kept_by_k | kept_by_p


def _draw_sorted(p: np.ndarray, order: np.ndarray, top_k: np.ndarray, top_p: np.ndarray, min_p: np.ndarray,
                 total: np.ndarray, u: np.ndarray) -> np.ndarray:
    """Filter and draw on `order` (the row's tokens, or its most probable ones, most probable first)."""
    q = np.take_along_axis(p, order, axis=1)
    pos = _inverse_cdf(np.where(_kept_sorted(q, top_k, top_p, min_p, total), q, 0.0), u)
    return order[np.arange(order.shape[0]), pos]


def filtered_distribution(probs: np.ndarray, top_k: np.ndarray, top_p: np.ndarray,
                          min_p: np.ndarray) -> np.ndarray:
    """The distribution the sampler draws from, dense: probs restricted to the top-k / top-p / min-p set
    and renormalized (top_k 0 and top_p 1 mean off)."""
    order = np.argsort(probs, axis=1)[:, ::-1]
    q = np.take_along_axis(probs, order, axis=1)
    kept = np.where(_kept_sorted(q, top_k, top_p, min_p, probs.sum(axis=1, dtype=np.float64)), q, 0.0)
    out = np.zeros_like(probs)
    np.put_along_axis(out, order, kept, axis=1)
    return out / out.sum(axis=1, keepdims=True)


def sampling_distribution(logits: np.ndarray, params: list[SamplingParams]) -> np.ndarray:
    """Each row's temperature / top-k / top-p / min-p distribution over raw logits (no penalties or
    masks): what a draft model samples its drafts from (temperature > 0 rows only)."""
    probs = _softmax(np.asarray(logits, dtype=np.float32), np.array([p.temperature for p in params], np.float32))
    return filtered_distribution(probs, *row_filters(params, np.arange(len(params)), probs.shape[1]))


def draw(weights: np.ndarray, u: float) -> int:
    """One token from a row of non-negative weights at a uniform u (the request's generator's), in token order."""
    return int(_inverse_cdf(weights[None, :], np.array([u]))[0])


def verify_sampled_drafts(token_ids: np.ndarray, rows: np.ndarray, probs: np.ndarray, top_k: np.ndarray,
                          top_p: np.ndarray, min_p: np.ndarray, gens: list, batch: SamplingBatch) -> None:
    """The speculative-sampling rule for drafts drawn from q: keep draft d with probability min(1, p(d)/q(d)),
    else draw from max(0, p - q) renormalized. The emitted token is then distributed exactly as the target p
    (the filtered distribution this row samples from). In place on token_ids, in the encoding the scheduler
    verifies: a kept draft is returned as itself, a rejection as a token != d (the residual is 0 at d).
    Rows of the batch `rows` index into (the sampled, temperature > 0 rows)."""
    mine = [i for i, r in enumerate(rows) if batch.draft_probs[r] is not None]
    if not mine:
        return
    i = np.asarray(mine)
    target = filtered_distribution(probs[i], top_k[i], top_p[i], min_p[i])
    u_accept, u_residual = _verify_uniforms([gens[j] for j in i])
    for row_p, j, ua, ur in zip(target, i, u_accept, u_residual):
        r = rows[j]
        d, q = batch.draft_tokens[r], np.asarray(batch.draft_probs[r], dtype=np.float32).reshape(-1)
        if ua * q[d] < row_p[d]:  # u < p(d) / q(d), without dividing by a tiny q(d)
            token_ids[r] = d
            continue
        residual = np.maximum(row_p - q, 0.0)
        if residual.sum() <= 0:  # p == q up to rounding: rejection has probability ~0; stay exact on p
            residual = row_p
        token_ids[r] = draw(residual, ur)


def _verify_uniforms(gens: list[np.random.Generator]) -> tuple[np.ndarray, np.ndarray]:
    """Each verifying row's two uniforms (accept, residual draw), row by row: both are always drawn, so the host
    and a device, which decides acceptance where the logits are, advance the generators alike."""
    u = np.array([(g.random(), g.random()) for g in gens]).reshape(-1, 2)
    return u[:, 0], u[:, 1]


def _kept_sorted(q: np.ndarray, top_k: np.ndarray, top_p: np.ndarray, min_p: np.ndarray,
                 total: np.ndarray) -> np.ndarray:
    """Which of the descending-ordered probabilities q survive top-k, top-p (on the top-k mass) and min-p."""
    # position of the first token of each tie group = number of tokens strictly more probable
    starts = np.ones(q.shape, dtype=bool)
    starts[:, 1:] = q[:, 1:] != q[:, :-1]
    n_greater = np.maximum.accumulate(np.where(starts, np.arange(q.shape[1], dtype=np.int32), 0), axis=1)
    excl = np.zeros(q.shape, dtype=np.float64)
    np.cumsum(q[:, :-1], axis=1, dtype=np.float64, out=excl[:, 1:])
    mass_greater = np.take_along_axis(excl, n_greater, axis=1)

    in_k = (top_k[:, None] == 0) | (n_greater < top_k[:, None])
    z_k = np.where(top_k > 0, np.where(in_k, q, 0.0).sum(axis=1, dtype=np.float64), total)
    in_p = (top_p[:, None] >= 1.0) | (mass_greater < (top_p * z_k)[:, None])
    in_min = q >= (min_p * q[:, 0])[:, None]
    return in_k & in_p & in_min


def _sample_rejection(probs: np.ndarray, top_k: np.ndarray, top_p: np.ndarray, min_p: np.ndarray,
                      gens: list[np.random.Generator]) -> np.ndarray:
    """Sort-free: draw among the candidates, accept if in the top-k and top-p sets, otherwise keep only
    tokens more probable than the rejected one and draw again.

    Exact: the accepted set S is an upper set, so a rejected candidate x has every token with
    prob <= prob(x) outside S as well; the candidates always contain S, and a draw from them that
    lands in S is distributed as probs restricted to S. The candidates shrink each round and the
    most probable token is always accepted, so the loop ends.
    """
    R, V = probs.shape
    candidates = probs >= (min_p * probs.max(axis=1))[:, None]  # min_p is a threshold: no search needed
    # top-p is measured on the top-k renormalized distribution, so it needs the top-k mass: a
    # selection (np.partition, linear time) finds each row's k-th largest prob; the top-k set is
    # every token at least that probable (ties included: fewer than k are strictly more probable)
    z_k = probs.sum(axis=1, dtype=np.float64)
    with_k = np.flatnonzero(top_k > 0)
    if with_k.size:
        ks = top_k[with_k]
        part = -np.partition(-probs[with_k], np.unique(ks) - 1, axis=1)
        kth = part[np.arange(with_k.size), ks - 1]
        z_k[with_k] = np.where(probs[with_k] >= kth[:, None], probs[with_k], 0.0).sum(axis=1, dtype=np.float64)
    limit = top_p * z_k

    tokens = np.empty(R, dtype=np.int64)
    active = np.arange(R)
    for _ in range(V + 1):
        if not active.size:
            return tokens
        u = np.array([gens[r].random() for r in active])
        p = probs[active]
        x = _inverse_cdf(np.where(candidates[active], p, 0.0), u)
        px = p[np.arange(active.size), x]
        greater = p > px[:, None]
        k = top_k[active]
        ok = (k == 0) | (greater.sum(axis=1) < k)
        ok &= (top_p[active] >= 1.0) | (np.where(greater, p, 0.0).sum(axis=1, dtype=np.float64) < limit[active])
        tokens[active[ok]] = x[ok]
        rejected = active[~ok]
        candidates[rejected] &= probs[rejected] > px[~ok][:, None]
        active = rejected
    raise RuntimeError(f"rejection sampling did not converge for rows {active.tolist()}")


def _inverse_cdf(weights: np.ndarray, u: np.ndarray) -> np.ndarray:
    """Index i with cdf[i-1] <= u * total < cdf[i] per row; zero-weight entries are never chosen."""
    cdf = np.cumsum(weights, axis=1, dtype=np.float64)
    idx = (cdf <= (u * cdf[:, -1])[:, None]).sum(axis=1)
    # u * total can round up to total; fall back to the last entry with weight
    last = weights.shape[1] - 1 - np.argmax(weights[:, ::-1] > 0, axis=1)
    return np.minimum(idx, last)


def _softmax(logits: np.ndarray, temperature: np.ndarray) -> np.ndarray:
    x = logits / temperature[:, None]
    x -= x.max(axis=1, keepdims=True)  # rows have a finite max (checked), so -inf stays -inf, never NaN
    np.exp(x, out=x)
    x /= x.sum(axis=1, keepdims=True)
    return x


def _logprob_rows(params: list[SamplingParams], vocab: int) -> tuple[np.ndarray, int]:
    """The rows that asked for logprobs, and how many top tokens the batch needs (the most any row asked for)."""
    asking = [r for r, p in enumerate(params) if p.logprobs is not None]
    if not asking:
        return _NO_ROWS, 0
    return np.array(asking, dtype=np.int64), min(max(params[r].logprobs for r in asking), vocab)


def _top_logprobs(raw: np.ndarray, token_ids: np.ndarray, n: int) -> TopLogprobs:
    """Host TopLogprobs of raw logits [R', V] whose sampled tokens are token_ids."""
    m = raw.max(axis=1, keepdims=True)
    m[~np.isfinite(m)] = 0.0
    lp = raw - m
    lp -= np.log(np.exp(lp).sum(axis=1, keepdims=True))
    sampled = lp[np.arange(lp.shape[0]), token_ids]
    rank = (lp > sampled[:, None]).sum(axis=1) + 1
    top = np.argpartition(-lp, n - 1, axis=1)[:, :n] if n > 0 else np.zeros((lp.shape[0], 0), dtype=np.int64)
    top_lp = np.take_along_axis(lp, top, axis=1)
    order = np.argsort(-top_lp, axis=1, kind="stable")
    return TopLogprobs(sampled, rank, np.take_along_axis(top, order, axis=1), np.take_along_axis(top_lp, order, axis=1))


def _logprob_dicts(rows: np.ndarray, params: list[SamplingParams], token_ids: np.ndarray,
                   t: TopLogprobs) -> list[dict[int, tuple[float, int]] | None]:
    """SamplerOutput.logprobs: per asking row {token: (logprob, rank)} for its sampled token and its top tokens."""
    out: list[dict[int, tuple[float, int]] | None] = [None] * len(params)
    for r, d in zip(rows.tolist(), _as_dicts(t, token_ids[rows], [params[r].logprobs for r in rows])):
        out[r] = d
    return out


def _as_dicts(t: TopLogprobs, token_ids: np.ndarray, counts: list[int]) -> list[dict[int, tuple[float, int]]]:
    """Per row of t: {token: (logprob, rank)} for its token (token_ids) and its counts[i] most likely tokens."""
    n = t.top.shape[1]
    # every token more likely than a top-n token is in the top n, so its rank is the position of the first
    # token with the same logprob
    starts = np.ones(t.top.shape, dtype=bool)
    starts[:, 1:] = t.top[:, 1:] != t.top[:, :-1]
    top_rank = np.maximum.accumulate(np.where(starts, np.arange(n), 0), axis=1) + 1
    out = []
    for i, (tok, k) in enumerate(zip(token_ids.tolist(), counts)):
        d = {tok: (float(t.sampled[i]), int(t.sampled_rank[i]))}
        for j in range(min(k, n)):
            if np.isfinite(t.top[i, j]):  # masked vocabulary tail is not a candidate
                d.setdefault(int(t.top_ids[i, j]), (float(t.top[i, j]), int(top_rank[i, j])))
        out.append(d)
    return out


def split_logits(logits: "np.ndarray | paddle.Tensor | DeviceLogits", num_sampled: int,
                 num_prompt: int) -> tuple[Any, Any]:
    """A step's logits as (its first num_sampled rows, the num_prompt rows after them): the sampled rows and the
    rows computed for prompt logprobs (None where there are none)."""
    sampled = np.arange(num_sampled)
    prompt = np.arange(num_sampled, num_sampled + num_prompt)
    if isinstance(logits, DeviceLogits):
        return (logits.take(sampled) if num_sampled else None), logits.take(prompt)
    raw = _as_float32_matrix(logits)
    if raw.shape[0] != num_sampled + num_prompt:
        raise ValueError(f"logits of shape {list(raw.shape)} for {num_sampled} sampled and {num_prompt} prompt rows")
    return (raw[:num_sampled] if num_sampled else None), raw[num_sampled:]


# rows of a prompt's logits reduced at once on the host (a device chunks its own reduction by the same figure)
PROMPT_ROWS_AT_ONCE = LOGPROB_ROWS_AT_ONCE


def prompt_logprobs(logits: "np.ndarray | paddle.Tensor | DeviceLogits", targets: np.ndarray,
                    counts: list[int]) -> list[dict[int, tuple[float, int]]]:
    """Per row: the logprob and rank of its target (the prompt token its position predicts) and its counts[i]
    most likely tokens, from the raw log-softmax: the figures a sampled token's logprobs have."""
    if not len(targets):
        return []
    if isinstance(logits, DeviceLogits):
        n = min(max(counts), logits.vocab_size)
        return _as_dicts(logits.top_logprobs(np.arange(len(targets)), targets, n), targets, counts)
    raw = _as_float32_matrix(logits)
    if raw.shape[0] != len(targets):
        raise ValueError(f"logits of shape {list(raw.shape)} for {len(targets)} prompt rows")
    n = min(max(counts), raw.shape[1])
    out = []
    for lo in range(0, len(targets), PROMPT_ROWS_AT_ONCE):
        hi = lo + PROMPT_ROWS_AT_ONCE
        out += _as_dicts(_top_logprobs(raw[lo:hi], targets[lo:hi], n), targets[lo:hi], counts[lo:hi])
    return out


def _as_float32_matrix(logits: "np.ndarray | paddle.Tensor") -> np.ndarray:
    """The logits as a NumPy matrix; a CPU tensor's own memory where DLPack gives it (the sampler never writes to
    it): a copy of [256, 32000] float32 logits (33 MB) every step is host time for nothing."""
    if not isinstance(logits, np.ndarray) and hasattr(logits, "numpy"):
        try:
            logits = np.from_dlpack(logits)
        except (TypeError, RuntimeError, BufferError, AttributeError, ValueError):
            logits = logits.numpy()
    arr = np.asarray(logits, dtype=np.float32)
    if arr.ndim != 2:
        raise ValueError(f"logits must be [rows, vocab], got shape {arr.shape}")
    return arr


def _check_batch(logits: np.ndarray, batch: SamplingBatch) -> None:
    R = logits.shape[0]
    for name in ("params", "generators", "prompt_token_ids", "output_token_ids", "eos_token_ids",
                 "bad_words_ids"):
        if len(getattr(batch, name)) != R:
            raise ValueError(f"SamplingBatch.{name} has {len(getattr(batch, name))} rows, logits have {R}")


def _checked_ids(ids: np.ndarray, vocab: int, what: str) -> np.ndarray:
    if ids.size and (ids.min() < 0 or ids.max() >= vocab):
        raise ValueError(f"{what} token ids must be in [0, {vocab}), got {ids.min()}..{ids.max()}")
    return ids
