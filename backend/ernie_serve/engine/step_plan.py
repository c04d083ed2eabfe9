"""The types one engine step passes between the scheduler, the model runner and the engine loop (as vLLM's
core/sched/output.py and outputs.py): what the scheduler planned, what the runner sampled, what each request got.
Here so the scheduler and the model runner import this module rather than each other."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..step_contract import KVOp
from .request import Request


# In a Request's all_token_ids while the step after the running one is scheduled ahead: the token the running step
# samples (Scheduler.expect puts it there, the runner fills that row's input from the running step's output).
PLACEHOLDER = -1


# slots: these two are made for every running request every step
@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    num_tokens: int  # tokens computed this step (including speculative drafts)
    num_spec_tokens: int = 0

    @property
    def samples(self) -> bool:
        """Whether this step reaches the end of the request's known tokens, so it produces a token."""
        r = self.request
        return r.num_computed_tokens + self.num_tokens - self.num_spec_tokens == r.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    kv_ops: list[KVOp] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(slots=True)
class RequestUpdate:
    """What one step added to a request that sampled: its new tokens (their logprobs are on the request)."""
    request: Request
    new_token_ids: list[int]


@dataclass
class ModelRunnerOutput:
    # Per request id: the sampled token for each sampling position (1, or 1 + drafts when verifying).
    sampled: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[dict | None]] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)  # requests that failed alone this step, and why
    # Per request id: the logprobs of the prompt tokens this step's chunk predicted, in prompt order.
    prompt_logprobs: dict[str, list[dict]] = field(default_factory=dict)
