"""Run the Triton requests of one OpenAI request and keep each choice's running state.

Every choice is its own Triton stream, consumed by its own task into one queue, so n choices stream
concurrently and one deadline covers them all. Closing a Generation cancels whatever is still running.
"""
from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field

from ernie_serve.chat import finish_reason_for  # the one finish_reason rule (parsers.md), shared with Triton

from .errors import OpenAIError
from .mapping import Job
from .triton import StepOutput, TokenLogprob, TritonBackend


def merge_tool_call_deltas(calls: dict[int, dict], deltas: list[dict]) -> None:
    """Fold OpenAI delta tool_calls into whole calls: the first delta of an index brings id, type and
    name; later ones append argument text."""
    for d in deltas:
        idx = int(d.get("index", len(calls)))
        call = calls.setdefault(idx, {"id": None, "type": "function", "function": {"name": "", "arguments": ""}})
        if d.get("id"):
            call["id"] = d["id"]
        if d.get("type"):
            call["type"] = d["type"]
        fn = d.get("function") or {}
        if fn.get("name"):
            call["function"]["name"] += fn["name"]
        if fn.get("arguments"):
            call["function"]["arguments"] += fn["arguments"]


@dataclass
class ChoiceState:
    index: int
    counts_prompt: bool = True      # False for choices 1..n-1 of a prompt: its tokens are counted once
    max_tokens: int | None = None
    text: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    tool_calls: dict[int, dict] = field(default_factory=dict)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] | None = None
    engine_finish_reason: str | None = None
    ended: bool = False
    num_input_tokens: int | None = None
    num_output_tokens: int | None = None
    num_cached_tokens: int | None = None
    num_reasoning_tokens: int | None = None
    reasoning_token_estimate: int = 0
    prompt_token_ids: list[int] | None = None

    def add(self, step: StepOutput) -> None:
        self.text.append(step.text)
        self.reasoning.append(step.reasoning)
        merge_tool_call_deltas(self.tool_calls, step.tool_calls)
        self.token_ids.extend(step.token_ids)
        if step.logprobs:
            self.logprobs.extend(step.logprobs)
        if step.prompt_logprobs:
            self.prompt_logprobs = step.prompt_logprobs
        for name in ("num_input_tokens", "num_output_tokens", "num_cached_tokens", "num_reasoning_tokens",
                     "prompt_token_ids"):
            if getattr(step, name) is not None:
                setattr(self, name, getattr(step, name))
        if step.reasoning and not step.text and not step.tool_calls:
            # Without a num_reasoning_tokens output: the tokens of a step that produced only reasoning.
            self.reasoning_token_estimate += len(step.token_ids) or 1
        if step.finish_reason is not None:
            self.engine_finish_reason = step.finish_reason
            self.ended = True

    @property
    def completion_tokens(self) -> int:
        return self.num_output_tokens if self.num_output_tokens is not None else len(self.token_ids)

    @property
    def reasoning_tokens(self) -> int:
        return self.num_reasoning_tokens if self.num_reasoning_tokens is not None else self.reasoning_token_estimate

    @property
    def finish_reason(self) -> str | None:
        """parsers.md: "length" at max_tokens (even over tool calls), else "tool_calls" if any, else the engine's."""
        if not self.ended:
            return None
        return finish_reason_for(self.completion_tokens, self.max_tokens, self.engine_finish_reason or "stop",
                                 bool(self.tool_calls))

    def full_tool_calls(self) -> list[dict]:
        return [self.tool_calls[i] for i in sorted(self.tool_calls)]


class Generation:
    """The merged, ordered-per-choice stream of (choice index, StepOutput) for one OpenAI request."""

    def __init__(self, backend: TritonBackend, jobs: list[Job], request_id: str, timeout: float | None):
        self.backend = backend
        self.jobs = jobs
        self.request_id = request_id
        self.started = time.monotonic()
        self.deadline = None if timeout is None else self.started + timeout
        self.timeout = timeout
        self._queue: asyncio.Queue = asyncio.Queue()
        self._tasks: list[asyncio.Task] = []
        self._open = len(jobs)

    def start(self) -> "Generation":
        self._tasks = [asyncio.create_task(self._run(job)) for job in self.jobs]
        return self

    async def _run(self, job: Job) -> None:
        try:
            gen = self.backend.generate(job.fields, f"{self.request_id}-{job.index}")
            async with contextlib.aclosing(gen):
                async for step in gen:
                    self._queue.put_nowait((job.index, step))
            self._queue.put_nowait((job.index, None))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - handed to the consumer, which answers with it
            self._queue.put_nowait((job.index, e))

    async def next(self) -> tuple[int, StepOutput | None] | None:
        """The next event, (index, None) when a choice's stream ended, or None when all have.
        Raises the OpenAIError of a failed choice, or 504 past the deadline."""
        if self._open == 0:
            return None
        wait = None if self.deadline is None else max(self.deadline - time.monotonic(), 0)
        try:
            index, item = await asyncio.wait_for(self._queue.get(), wait)
        except asyncio.TimeoutError:
            raise OpenAIError(504, f"the request did not finish within --request-timeout {self.timeout:g}s; "
                              "it was cancelled") from None
        if isinstance(item, OpenAIError):
            raise item
        if isinstance(item, Exception):
            raise OpenAIError(500, f"unexpected error talking to Triton: {item!r}") from item
        if item is None:
            self._open -= 1
        return index, item

    async def aclose(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
