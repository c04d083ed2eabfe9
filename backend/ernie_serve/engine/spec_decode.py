"""Speculative decoding proposers: guess the next tokens cheaply; the target model verifies them.

Verification is the engine's general "several tokens per step" path: a request with drafts computes
its last token plus the drafts in one forward, the sampler draws a token at every position, and drafts
are accepted while they equal the drawn token (FastDeploy's target_match). Every emitted token is a
real sample from the target model, so greedy outputs are exactly those of plain decoding.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .request import Request


@dataclass
class SpecStats:
    num_drafts: int = 0  # steps that carried drafts
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0


class NgramProposer:
    """Prompt-lookup drafting: find the latest earlier occurrence of the sequence's last n tokens
    (n from max_ngram down to min_ngram) and propose the tokens that followed it."""

    def __init__(self, num_speculative_tokens: int, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= num_speculative_tokens <= 5:
            raise ValueError(f"num_speculative_tokens must be in [1, 5], got {num_speculative_tokens}")
        self.k, self.max_ngram, self.min_ngram = num_speculative_tokens, max_ngram, min_ngram

    def propose(self, tokens: list[int], limit: int) -> list[int]:
        k = min(self.k, limit)
        if k <= 0:
            return []
        for n in range(min(self.max_ngram, len(tokens) - 1), self.min_ngram - 1, -1):
            suffix = tokens[-n:]
            for start in range(len(tokens) - n - 1, -1, -1):  # latest match first, never the suffix itself
                if tokens[start : start + n] == suffix:
                    return tokens[start + n : start + n + k]
        return []


def make_proposer(speculative_config: dict | None) -> NgramProposer | None:
    """The token-only proposer of an EngineConfig's (already validated) speculative_config; None for none
    and for "mtp", whose drafter needs the model runner's hidden states (engine/mtp_drafter.py)."""
    if not speculative_config or speculative_config.get("method") != "ngram":
        return None
    return NgramProposer(speculative_config.get("num_speculative_tokens", 1),
                         speculative_config.get("max_ngram", 3), speculative_config.get("min_ngram", 1))


def draft_limit(req: Request, max_model_len: int) -> int:
    """Drafts must leave room for the bonus token within max_tokens and max_model_len."""
    return min(req.max_tokens - req.num_output_tokens - 1, max_model_len - req.num_tokens - 1)


@dataclass
class StepRow:
    """Where one request's tokens sat in the step the runner just ran."""
    request: Request
    start: int  # first position computed in the step
    num_tokens: int
    offset: int  # its first row in the step's hidden states


@dataclass
class Drafts:
    token_ids: dict[Request, list[int]]
    probs: dict[Request, list[np.ndarray]]  # only for sampling requests: q of each draft
