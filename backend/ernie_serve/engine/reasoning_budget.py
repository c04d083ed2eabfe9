"""reasoning_max_tokens (FastDeploy's): a thinking model's reasoning bounded per request.

The front that knows the reasoning parser (the ensemble's tokenizer step, LLM.chat and LLM.generate) resolves the
budget against the prompt: an output that starts inside the reasoning gets the parser's end-of-thinking token
(`</think>`) as SamplingParams.reasoning_end_token_id; one that does not (thinking off) has no reasoning to bound and
drops the budget. The engine counts the output's tokens while the reasoning is open and, once reasoning_max_tokens
of them are out, appends the end token in place of the next sampled one (FastDeploy forces its think-end id the same
way): the model reads it as its own, the answer follows, and the parsers see a well-formed stream. Speculative drafts
after a forced token are dropped: they were drawn after the token it replaced. The forced token's logprob is 0.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from ..sampling_params import SamplingParams


@dataclass(slots=True)
class ReasoningBudget:
    """One sequence's budget: reasoning tokens it may still write, and the token that closes the reasoning."""

    left: int
    end_id: int
    open: bool = True

    def take(self, token: int) -> int:
        """The token to append for a sampled `token`: itself, or end_id once the budget is spent."""
        if not self.open:
            return token
        if token == self.end_id:  # the model closed its reasoning itself
            self.open = False
            return token
        if self.left == 0:
            self.open = False
            return self.end_id
        self.left -= 1
        return token


def resolve_reasoning_budget(params: SamplingParams, end_token_id: int | None,
                             starts_in_reasoning: bool) -> SamplingParams:
    """params with the budget placed for this prompt (see the module doc); end_token_id: the configured reasoning
    parser's end-of-thinking token, None when no reasoning parser is configured."""
    if params.reasoning_max_tokens is None:
        return params
    if end_token_id is None:
        raise ValueError("reasoning_max_tokens needs a reasoning parser to know where the reasoning ends: start the "
                         "server (or LLM) with --reasoning-parser ernie-x1")
    if not starts_in_reasoning:  # thinking is off for this prompt: no reasoning to bound
        return replace(params, reasoning_max_tokens=None, reasoning_end_token_id=None)
    return replace(params, reasoning_end_token_id=end_token_id)


def budget_for(params: SamplingParams) -> ReasoningBudget | None:
    """A new sequence's budget (each of n sequences has its own)."""
    if params.reasoning_max_tokens is None:
        return None
    if params.reasoning_end_token_id is None:
        raise ValueError("reasoning_max_tokens needs reasoning_end_token_id, the token that closes the reasoning: "
                         "the OpenAI shim, the ensemble and LLM.chat set it from --reasoning-parser; a direct caller "
                         "of the engine sets both")
    return ReasoningBudget(params.reasoning_max_tokens, params.reasoning_end_token_id)
