"""Guided decoding on llguidance: the tokenizer in its form, compiled grammars, each request's matcher,
and the grammar masks of a sampling batch.

Why llguidance and not xgrammar: docs/structured-outputs.md (scripts/bench_guided.py --part mask --engines
llguidance,xgrammar re-checks it).

A grammar is compiled once (on the caller's thread, in make_request_group) and kept as a pristine
matcher; each request gets a deep copy, far cheaper than compiling (compile times: `.venv/bin/python
scripts/bench_guided.py --part mask`). The request's GuidedState advances as tokens are appended
(Scheduler.append_tokens), never by a draft: at verification the masks of the draft positions come from
llguidance's executor, which follows the drafts and rolls them back. A draft the grammar forbids is
forbidden in the mask of its own position, so the token sampled there differs from it and it is rejected;
the positions after it are left unconstrained (they are never accepted).
"""
from __future__ import annotations

import os
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
from llguidance import LLExecutor, LLMatcher, LLTokenizer, TokenizerWrapper
from llguidance.numpy import fill_next_token_bitmask_par, fill_next_token_bitmask_par_with_draft_tokens

from ..sampling_params import GuidedDecodingParams
from .guided_grammar import GrammarError, llguidance_grammar

if TYPE_CHECKING:
    from ..tokenizer import ErnieTokenizer

SPECIAL_TOKEN_PREFIX = b"\xff"  # llguidance's mark on a special token's bytes (never valid UTF-8)
GRAMMAR_CACHE_SIZE = 256


def token_bytes(tokenizer: "ErnieTokenizer") -> list[bytes]:
    """Each id's bytes as the detokenizer writes them. Literal tokens (added, special, control:
    `<think>`, `</s>`) become llguidance special tokens: a grammar names them as `<think>`, and no
    JSON string or regex can produce one by accident."""
    return [SPECIAL_TOKEN_PREFIX + tokenizer.id_to_token(i).encode("utf-8") if tokenizer.is_literal(i)
            else tokenizer.piece_bytes(i) for i in range(len(tokenizer))]


def build_lltokenizer(tokenizer: "ErnieTokenizer", vocab_size: int, eos_token_ids: list[int]) -> LLTokenizer:
    """The tokenizer as llguidance sees it; eos_token_ids are the ids a mask allows once the grammar is complete."""
    if not eos_token_ids:
        raise ValueError("guided decoding needs an eos token to end the output; the model has none")

    class _Vocab:  # what llguidance's TokenizerWrapper reads
        eos_token_id = eos_token_ids[0]
        bos_token_id = tokenizer.bos_token_id
        tokens = token_bytes(tokenizer)
        special_token_ids = [i for i in range(len(tokenizer)) if tokenizer.is_literal(i)]

        def __call__(self, text: str | bytes) -> list[int]:
            return tokenizer.encode(text.decode("utf-8", "replace") if isinstance(text, bytes) else text)

    return LLTokenizer(TokenizerWrapper(_Vocab()), n_vocab=vocab_size, eos_token=list(eos_token_ids))


class GuidedState:
    """One request's place in its grammar. With start_after_token_id the output is free until that token
    has been generated (except that it cannot end: eos is allowed only where the grammar is complete);
    every token after it advances the matcher."""

    def __init__(self, matcher: LLMatcher, eos_token_ids: list[int], start_after_token_id: int | None = None):
        self.matcher = matcher
        self.eos_token_ids = list(eos_token_ids)
        self.waiting_for = start_after_token_id

    def accept(self, token_id: int) -> bool:
        """Advance by one generated token; False if the grammar rejects it (the request cannot go on)."""
        if self.waiting_for is not None:
            if token_id == self.waiting_for:
                self.waiting_for = None
            return token_id not in self.eos_token_ids
        return self.matcher.consume_token(int(token_id))

    @property
    def error(self) -> str:
        if self.waiting_for is not None:
            return "the output ended before the constrained part began"
        return self.matcher.get_error() or "the grammar rejected the token"

    def plan(self, first_row: int, drafts: list[int]) -> tuple[range, tuple[LLMatcher, int, list[int]] | None]:
        """Where this request's masks go: (free rows, entry). Free rows come before the grammar starts (any
        token but eos); entry = (matcher, first constrained row, the drafts its next rows follow), or None.

        Row first_row + j samples after drafts[:j]. Only the drafts the grammar accepts are followed, so the
        row after the last of them forbids the next draft, and the rows beyond stay unconstrained.
        """
        free = range(first_row, first_row)
        if self.waiting_for is not None:
            if self.waiting_for not in drafts:
                return range(first_row, first_row + len(drafts) + 1), None
            start = drafts.index(self.waiting_for) + 1  # rows up to the one that samples it are free
            free = range(first_row, first_row + start)
            first_row, drafts = first_row + start, drafts[start:]
        valid = self.matcher.validate_tokens(drafts) if drafts else 0
        return free, (self.matcher, first_row, drafts[:valid])


@dataclass
class GrammarRows:
    """A guided request's rows in a sampling batch: its state, its first row, the drafts its next rows follow."""
    state: GuidedState
    first_row: int
    drafts: list[int]


_EXECUTOR: LLExecutor | None = None
_EXECUTOR_LOCK = threading.Lock()


def _executor() -> LLExecutor:
    """The mask threads, one pool per process; the sampler runs between forward passes, so all cores are free."""
    global _EXECUTOR
    with _EXECUTOR_LOCK:
        if _EXECUTOR is None:
            _EXECUTOR = LLExecutor(num_threads=max(1, os.cpu_count() or 1))
        return _EXECUTOR


# byte value -> its 8 bits as additive logit masks (0: allowed, -inf: not), least significant bit first
_BIAS_OF_BYTE = np.where(np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1, bitorder="little") > 0,
                         np.float32(0.0), np.float32(-np.inf))


def grammar_masks(grammars: list[GrammarRows], num_rows: int, vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(rows, bias): the batch rows guided decoding constrains and, per such row, an additive mask over
    vocab_size tokens (float32, 0 where the token is allowed, -inf where not)."""
    bitmask = np.full((num_rows, (vocab_size + 31) // 32), -1, dtype=np.int32)
    constrained: list[np.ndarray] = []
    free_rows: list[int] = []
    no_eos: list[list[int]] = []
    plain, speculative = [], []
    for g in grammars:
        free, entry = g.state.plan(g.first_row, g.drafts)
        free_rows.extend(free)
        no_eos.extend([g.state.eos_token_ids] * len(free))
        if entry is None:
            continue
        matcher, first, drafts = entry
        if drafts:
            speculative.append(entry)
        else:
            plain.append((matcher, first))
        constrained.append(np.arange(first, first + len(drafts) + 1))
    if plain:
        fill_next_token_bitmask_par(_executor(), plain, bitmask)
    if speculative:  # llguidance's draft variant refuses an empty draft list
        fill_next_token_bitmask_par_with_draft_tokens(_executor(), speculative, bitmask)
    rows = np.concatenate(constrained + [np.asarray(free_rows, dtype=np.int64)]).astype(np.int64)
    # one table lookup per mask byte: faster than unpackbits + where
    bias = _BIAS_OF_BYTE[bitmask[rows].astype("<i4").view(np.uint8)].reshape(len(rows), -1)[:, :vocab_size]
    for k, eos in enumerate(no_eos, start=len(rows) - len(free_rows)):  # free rows' bitmask is all ones
        bias[k, [e for e in eos if e < vocab_size]] = -np.inf
    return rows, bias


class GrammarCompiler:
    """One per engine (and per ernie_tokenizer instance, to check requests at the door): the tokenizer in
    llguidance's form and the compiled grammars, kept by grammar text (least recently used dropped)."""

    def __init__(self, tokenizer: "ErnieTokenizer", vocab_size: int, eos_token_ids: list[int],
                 cache_size: int = GRAMMAR_CACHE_SIZE):
        self.lltokenizer = build_lltokenizer(tokenizer, vocab_size, eos_token_ids)
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.cache_size = cache_size
        self._compiled: OrderedDict[str, LLMatcher] = OrderedDict()
        self._lock = threading.Lock()  # requests are built on the callers' threads

    def check(self, params: GuidedDecodingParams) -> None:
        """Raise GrammarError (naming guided_decoding.<kind>) if the constraint cannot run on this tokenizer."""
        self._check_start_token(params)
        self._compile(params)

    def new_state(self, params: GuidedDecodingParams) -> GuidedState:
        """A fresh matcher for one request (n > 1: one per sequence)."""
        self._check_start_token(params)
        return GuidedState(self._compile(params).deep_copy(), self.eos_token_ids, params.start_after_token_id)

    def _check_start_token(self, params: GuidedDecodingParams) -> None:
        token = params.start_after_token_id
        if token is not None and token >= self.vocab_size:
            raise ValueError(f"guided_decoding.start_after_token_id must be a token id in [0, {self.vocab_size}), "
                             f"got {token}")

    def _compile(self, params: GuidedDecodingParams) -> LLMatcher:
        grammar = llguidance_grammar(params)
        with self._lock:
            matcher = self._compiled.get(grammar)
            if matcher is not None:
                self._compiled.move_to_end(grammar)
                return matcher
        matcher = LLMatcher(self.lltokenizer, grammar, log_level=0)  # never raises: errors are its state
        if matcher.is_error():
            raise GrammarError(f"guided_decoding.{params.kind}", f"does not compile: {matcher.get_error()}")
        with self._lock:
            self._compiled[grammar] = matcher
            while len(self._compiled) > self.cache_size:
                self._compiled.popitem(last=False)
        return matcher
