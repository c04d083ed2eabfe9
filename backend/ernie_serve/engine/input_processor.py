"""Requests in: a client's prompt and SamplingParams checked against this engine and turned into its sequences.

vLLM v1's input processor. It reads the engine's configuration and its model's vocabulary but no engine state, so a
server front builds (and refuses) a request on its own thread while the engine steps; LLMEngine.add_request_group
then queues it.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from ..config import EngineConfig
from ..sampling_params import SamplingParams
from .guided import GrammarCompiler
from .output_processor import TextState
from .reasoning_budget import budget_for
from .request import Request


@dataclass
class RequestGroup:
    """A validated request, ready to queue: its n sequences and their text states. Built without touching
    engine state, so a server front can build it (and refuse bad input) off the step thread."""
    request_id: str
    requests: list[Request]
    texts: list[TextState]


class InputProcessor:
    def __init__(self, config: EngineConfig, vocab_size: int, num_output_ids: int, tokenizer,
                 eos_token_ids: list[int], grammars: GrammarCompiler | None):
        self.config = config
        self.vocab_size = vocab_size
        self.num_output_ids = num_output_ids
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.grammars = grammars
        self._seed_counter = itertools.count()  # unseeded requests: distinct, reproducible streams

    def check(self, prompt_token_ids: list[int], sampling_params: SamplingParams, hold_kv: bool = False) -> list[int]:
        """Refuse what this engine cannot run (ValueError naming the field), building no sequence: a front whose
        engine core runs in another process (core_client.py) answers bad input at once with this. Returns the
        prompt ids as plain ints."""
        ids = self._checked(prompt_token_ids, sampling_params, hold_kv)[0]
        if sampling_params.guided_decoding is not None:
            self.grammars.check(sampling_params.guided_decoding)
        return ids

    def make_group(self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams,
                   hold_kv: bool = False) -> RequestGroup:
        """Validate a request against the engine and build its n sequences; raises ValueError naming the field."""
        ids, bad_words, max_tokens = self._checked(prompt_token_ids, sampling_params, hold_kv)
        p, group = sampling_params, []
        for i in range(p.n):
            rid = request_id if p.n == 1 else f"{request_id}#{i}"
            stream = [p.seed, i] if p.seed is not None else [self.config.seed, next(self._seed_counter), 1]
            rng = np.random.default_rng(stream)
            guided = self.grammars.new_state(p.guided_decoding) if p.guided_decoding is not None else None
            group.append(Request(rid, list(ids), p, self.eos_token_ids, max_tokens,
                                 parent_id=request_id if p.n > 1 else None, index=i, generator=rng,
                                 bad_words_ids=bad_words, hold_kv=hold_kv, guided=guided, reasoning=budget_for(p),
                                 prompt_logprobs=[] if p.prompt_logprobs is not None and i == 0 else None))
        return RequestGroup(request_id, group, [TextState(self.tokenizer, r) for r in group])

    def _checked(self, prompt_token_ids: list[int], sampling_params: SamplingParams,
                 hold_kv: bool) -> tuple[list[int], list[list[int]], int]:
        """The prompt ids, the bad words' ids and the max_tokens a valid request runs with."""
        ids = [int(t) for t in prompt_token_ids]
        if not ids:
            raise ValueError("prompt is empty: give at least one token")
        vocab = self.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            raise ValueError(f"prompt_token_ids must be in [0, {vocab}), got {min(ids)}..{max(ids)}")
        limit = self.config.max_model_len
        if len(ids) >= limit:
            raise ValueError(f"prompt has {len(ids)} tokens but max_model_len is {limit}: "
                             f"it must leave room for at least one generated token")
        p = sampling_params
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(p, name)
            if k is not None and not self.config.enable_logprob:
                raise ValueError(f"{name}: logprobs are off on this server: start it with --enable-logprob")
            if k is not None and k > self.config.max_logprobs:
                raise ValueError(f"{name} must be <= {self.config.max_logprobs}, got {k}")
        if p.prompt_logprobs is not None and (hold_kv or self.config.splitwise_role != "mixed"):
            raise ValueError("prompt_logprobs are not computed in a prefill/decode disaggregated deployment "
                             f"(splitwise_role={self.config.splitwise_role!r}): serve such requests from a mixed one")
        bad_stop = [t for t in p.stop_token_ids if not 0 <= t < vocab]
        if bad_stop:
            raise ValueError(f"stop_token_ids must be token ids in [0, {vocab}), got {bad_stop[:3]}")
        bad_bias = [t for t in p.logit_bias or () if t >= vocab]
        if bad_bias:
            raise ValueError(f"logit_bias keys must be token ids in [0, {vocab}), got {bad_bias[:3]}")
        banned_early = set(p.stop_token_ids) | (set() if p.ignore_eos else set(self.eos_token_ids))
        if p.min_tokens > 0 and len(banned_early) >= self.num_output_ids and \
                banned_early >= set(range(self.num_output_ids)):
            raise ValueError(f"min_tokens={p.min_tokens} with stop_token_ids covering every one of the "
                             f"{self.num_output_ids} tokens leaves nothing to generate")
        if self.tokenizer is None and (p.stop or p.bad_words):
            raise ValueError("stop and bad_words need text: this engine runs with skip_tokenizer_init")
        bad_words = [w for w in (self.tokenizer.encode(w) for w in p.bad_words) if w] if p.bad_words else []
        if p.guided_decoding is not None and self.config.guided_decoding_backend == "off":
            raise ValueError("guided_decoding is off on this server (guided_decoding_backend='off'): start it with "
                             "--guided-decoding-backend auto for structured outputs and tool_choice 'required'")
        if p.guided_decoding is not None and self.grammars is None:
            raise ValueError("guided_decoding needs the tokenizer and an eos token: this engine runs with "
                             "skip_tokenizer_init or its model has no eos_token_id")
        if p.reasoning_end_token_id is not None and p.reasoning_end_token_id >= vocab:
            raise ValueError(f"reasoning_end_token_id must be a token id in [0, {vocab}), got "
                             f"{p.reasoning_end_token_id}")
        budget_for(p)  # refuses a budget without the token that ends the reasoning
        return ids, bad_words, min(p.max_tokens or limit, limit - len(ids))
