"""A request as the engine tracks it: tokens, how many of them have KV computed, its blocks.

As in vLLM v1 there is no separate prefill/decode state: `num_computed_tokens` says how far the KV
cache covers `all_token_ids`, and each step computes some more of them (a prefill chunk, one
decode token, or a token plus speculative drafts).
"""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from itertools import count
from typing import TYPE_CHECKING

import numpy as np

from ..sampling_params import SamplingParams
from .sampler import samples_without_history, takes_argmax_only

if TYPE_CHECKING:
    from .guided import GuidedState
    from .reasoning_budget import ReasoningBudget


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    WAITING_FOR_FORK = "waiting_for_fork"  # n > 1 siblings wait for the first one's prompt KV
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"  # this request alone failed (Request.error says why); the engine goes on

    @property
    def finished(self) -> bool:
        return self._value_ in _FINISHED  # by value: an Enum member's own hash is Python code, read every step


_FINISHED = frozenset({"stop", "length", "abort", "error"})
_row_keys = count()  # process-wide, so two live requests (n > 1 siblings included) never share one


@dataclass(eq=False, slots=True)  # slots: its fields are read for every running request every step
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: list[int]
    max_tokens: int  # already clamped to max_model_len - prompt length
    parent_id: str | None = None  # set for the n > 1 siblings: the id the caller knows
    index: int = 0  # position among the parent's n outputs
    arrival_time: float = field(default_factory=time.monotonic)
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prefix-cache hit at first scheduling; -1 until scheduled
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # chained hashes of this request's full blocks
    spec_token_ids: list[int] = field(default_factory=list)  # drafts to verify next step
    spec_token_probs: list | None = None  # the draft distribution q of each draft, when drafts were sampled
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    forks: list["Request"] = field(default_factory=list)
    generator: np.random.Generator | None = None
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    logprobs: list[dict] = field(default_factory=list)
    bad_words_ids: list[list[int]] = field(default_factory=list)
    hold_kv: bool = False  # keep blocks after finishing until export_kv (prefill role)
    num_computed_tokens_total: int = 0  # all tokens this request ever ran through the model (counts recompute)
    error: str | None = None  # why it ended with FINISHED_ERROR
    guided: "GuidedState | None" = None  # guided decoding: where the output is in its grammar
    reasoning: "ReasoningBudget | None" = None  # reasoning_max_tokens: what the reasoning may still take
    # SamplingParams.prompt_logprobs, on the sequence that computes the prompt (the first of n): one
    # {token: (logprob, rank)} per prompt token after the first, filled as its prefill chunks run.
    prompt_logprobs: list[dict] | None = None
    # prompt + output as one list, appended in place: the KV manager and the model runner read it every
    # step, so rebuilding it per call would make each step's Python work grow with the sequence length.
    all_token_ids: list[int] = field(init=False, repr=False)
    output_token_ids: list[int] = field(init=False, default_factory=list)  # append via append_output
    # An int naming this request in a StepInput's row_keys: request_id is a string of any length, and
    # tensor-parallel workers keep each request's block table under this key (tensor_parallel/persistent_batch.py).
    row_key: int = field(init=False, repr=False, default_factory=lambda: next(_row_keys))
    # Every token is its logits' argmax and nothing else (sampler.takes_argmax_only), decided once: a step of
    # such rows builds no per-row sampling metadata.
    takes_argmax: bool = field(init=False, repr=False)
    # Whether the step after one this request samples in may be scheduled before that token is known
    # (LLMEngine's scheduling ahead): nothing in its sampling reads its output so far (no penalties, bad words,
    # min_tokens, grammar, reasoning budget). Decided once; forks and drafts are checked per step.
    schedules_ahead: bool = field(init=False, repr=False)
    # While a step runs with this request in it and the next one is scheduled ahead (Scheduler.expect): the
    # num_computed_tokens before the step, and whether the token it samples there (a PLACEHOLDER at the end of
    # all_token_ids) is its last for sure (the length limit), so the step ahead leaves it out. None / False otherwise.
    ahead_computed: int | None = field(init=False, repr=False, default=None)
    ends_ahead: bool = field(init=False, repr=False, default=False)
    # The token-level stop rules as the scheduler checks each appended token: the ids that end the request (eos
    # unless ignore_eos, and stop_token_ids) and the sequence length it ends at (max_tokens, max_model_len).
    stop_ids: frozenset[int] = field(init=False, repr=False)
    length_limit: int = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)
        p = self.sampling_params
        self.takes_argmax = takes_argmax_only(p, bool(self.bad_words_ids), self.guided is not None)
        self.schedules_ahead = samples_without_history(p, bool(self.bad_words_ids), self.guided is not None) \
            and self.reasoning is None
        self.stop_ids = frozenset(p.stop_token_ids).union(() if p.ignore_eos else self.eos_token_ids)
        self.length_limit = len(self.prompt_token_ids) + self.max_tokens

    def append_output(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    @property
    def external_id(self) -> str:
        return self.parent_id if self.parent_id is not None else self.request_id

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Prompt logprobs asked for and not all computed yet: the prompt must run through the model, so its
        prefix is not taken from the cache (vLLM's rule too)."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_token_ids) - 1

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.status.finished else None
