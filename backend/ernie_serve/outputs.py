"""What generation returns: RequestOutput / CompletionOutput / Logprob, shaped like vLLM's."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any


class RequestOutputKind(str, enum.Enum):
    """What each RequestOutput of a request carries (vLLM's names). The front that consumes outputs picks it:

    cumulative: everything so far (text, token_ids, logprobs), every step; the default.
    delta: only what this step added (text, token_ids and logprobs are the deltas), every step; a streaming
        server's front, which would otherwise be handed an O(length) copy per request per step.
    final_only: one output, when the request finishes, with everything; the offline LLM. A request with no stop
        strings is then detokenized once at the end instead of every step.
    """
    CUMULATIVE = "cumulative"
    DELTA = "delta"
    FINAL_ONLY = "final_only"


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass(slots=True)  # made per request per step: slots make that cheaper
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" | "tool_calls" (chat)
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    # Streaming: what this step added (the engine front sends these; offline users read the totals).
    text_delta: str = ""
    token_ids_delta: list[int] = field(default_factory=list)
    # Filled by the chat parsers (LLM.chat, the Triton detokenizer, the OpenAI shim).
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    num_reasoning_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    error: str | None = None  # set when the request failed alone (finish_reason "error")
    # SamplingParams.prompt_logprobs (vLLM's shape): None for the first prompt token, then each token's
    # {token_id: Logprob}, its own and the most likely ones; set once all are computed (a delta stream: on that
    # output only)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
