"""A generation request's life on the shim, and the two endpoints built on it (vLLM's OpenAIServing* split).

OpenAIServing.serve takes a concurrency slot, starts one Triton stream a choice (Generation), answers with JSON or,
after Triton's first response, with SSE, and releases the slot and records the metrics exactly once however the
request ends (done, refused, timed out, client gone). OpenAIServingChat and OpenAIServingCompletion turn their
request into jobs, per-choice states and the chunk stream of their endpoint.
"""
from __future__ import annotations

import asyncio
import time
import uuid
from typing import TYPE_CHECKING, Any, AsyncIterator, Awaitable, Callable

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from . import responses as R
from .admission import ConcurrencySlots
from .errors import OpenAIError
from .generation import ChoiceState, Generation
from .mapping import Job, chat_jobs, completion_jobs
from .metrics import Metrics
from .protocol import ChatCompletionRequest, CompletionRequest
from .request_body import parse_body
from .sse import SSEResponse
from .triton import TritonBackend

if TYPE_CHECKING:
    from .app import ServerConfig


class OpenAIServing:
    def __init__(self, config: "ServerConfig", backend: TritonBackend, metrics: Metrics, slots: ConcurrencySlots):
        self.config, self.backend, self.metrics, self.slots = config, backend, metrics, slots

    def check_model(self, name: str | None) -> None:
        config = self.config
        if name not in (None, "", config.public_name, config.model_name):
            raise OpenAIError(404, f"the model {name!r} does not exist; this server serves {config.public_name!r}",
                              param="model", code="model_not_found")

    async def serve(self, request: Request, endpoint: str, jobs: list[Job], states: list[ChoiceState], stream: bool,
                    finish: Callable[[], dict], events: Callable[[Generation, Any], AsyncIterator[str]]) -> Response:
        """A slot, the Generation, the answer; slot, metrics and streams released exactly once however it ends. A
        failure after the stream started goes out as an OpenAI error event (_with_error_event)."""
        config, backend, metrics, slots = self.config, self.backend, self.metrics, self.slots
        await slots.acquire()
        started = time.monotonic()
        gen = Generation(backend, jobs, f"{endpoint.rsplit('/', 1)[-1]}-{uuid.uuid4().hex}",
                         config.request_timeout).start()
        metrics.in_flight.inc()
        closed = False

        async def close(disconnected: bool = False, status: str = "200") -> None:
            nonlocal closed
            if closed:
                return
            closed = True
            await gen.aclose()
            slots.release()
            metrics.in_flight.dec()
            metrics.requests.labels(endpoint, status).inc()
            metrics.e2e.labels(endpoint).observe(time.monotonic() - started)
            if disconnected:
                metrics.disconnects.inc()
            for s in states:
                metrics.generation_tokens.inc(s.completion_tokens)
                if s.counts_prompt:
                    metrics.prompt_tokens.inc(s.num_input_tokens or 0)
                    metrics.cached_tokens.inc(s.num_cached_tokens or 0)

        try:
            if not stream:
                await _unless_disconnected(request, _collect(gen, states, endpoint, metrics, started))
                body = finish()
                await close()
                return JSONResponse(body)
            # Wait for Triton's first answer before sending headers, so a refused request (bad input,
            # Triton down, timeout) still gets its real status instead of an error inside a 200 stream.
            first = await _unless_disconnected(request, gen.next())
        except OpenAIError as e:
            if e.status == 504:
                metrics.timeouts.inc()
            await close(status=str(e.status))
            return e.response()
        except ClientGone:
            await close(disconnected=True, status="499")
            return Response(status_code=499)
        except BaseException:
            await close(status="500")
            raise
        return SSEResponse(_with_error_event(events(gen, first)), lambda disconnected: close(disconnected))



class OpenAIServingChat:
    """POST /v1/chat/completions."""

    def __init__(self, serving: OpenAIServing):
        self.serving = serving

    async def create(self, request: Request) -> Response:
        config, metrics = self.serving.config, self.serving.metrics
        req: ChatCompletionRequest = await parse_body(request, ChatCompletionRequest)
        self.serving.check_model(req.model)
        jobs = chat_jobs(req)
        states = [ChoiceState(j.index, counts_prompt=j.index == 0, max_tokens=req.generation_limit) for j in jobs]
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        k = req.num_logprobs

        def chunk(choices: list[dict]) -> str:
            obj = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": config.public_name,
                   "choices": choices}
            if req.include_usage:
                obj["usage"] = R.usage(states) if req.continuous_usage else None
            return R.sse(obj)

        async def events(gen: Generation, first) -> AsyncIterator[str]:
            started = set()
            async for i, step in _steps(gen, first, states, "/v1/chat/completions", metrics, gen.started):
                s = states[i]
                if i not in started:
                    started.add(i)
                    delta = {"role": "assistant", "content": ""}
                    if req.return_token_ids:
                        delta["prompt_token_ids"] = s.prompt_token_ids
                    yield chunk([{"index": i, "delta": delta, "logprobs": None, "finish_reason": None}])
                delta: dict[str, Any] = {}
                if step is not None:
                    if step.reasoning:
                        delta["reasoning_content"] = step.reasoning
                    if step.text:
                        delta["content"] = step.text
                    if step.tool_calls:
                        delta["tool_calls"] = step.tool_calls
                    if req.return_token_ids and step.token_ids:
                        delta["completion_token_ids"] = step.token_ids
                lp = R.chat_logprobs(step.logprobs, k) if (k is not None and step and step.logprobs) else None
                if delta or lp or s.ended:
                    yield chunk([{"index": i, "delta": delta, "logprobs": lp, "finish_reason": s.finish_reason}])
            if req.include_usage:
                yield R.sse({"id": rid, "object": "chat.completion.chunk", "created": created,
                             "model": config.public_name, "choices": [], "usage": R.usage(states)})
            yield R.SSE_DONE

        finish = lambda: R.chat_completion(rid, created, config.public_name, states, k,  # noqa: E731
                                           req.return_token_ids, req.prompt_logprobs)
        return await self.serving.serve(request, "/v1/chat/completions", jobs, states, req.stream, finish, events)


class OpenAIServingCompletion:
    """POST /v1/completions."""

    def __init__(self, serving: OpenAIServing, decode: Callable[[list[int]], str] | None = None):
        """`decode`: the served tokenizer's, to echo a token-id prompt as text."""
        self.serving = serving
        self.decode = decode

    async def create(self, request: Request) -> Response:
        config, metrics = self.serving.config, self.serving.metrics
        req: CompletionRequest = await parse_body(request, CompletionRequest)
        self.serving.check_model(req.model)
        jobs = completion_jobs(req, self.decode)
        states = [ChoiceState(j.index, counts_prompt=j.index % req.n == 0, max_tokens=req.generation_limit)
                  for j in jobs]
        echo = {j.index: j.prompt_text for j in jobs} if req.echo else {}
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        k = req.num_logprobs

        def chunk(choice: dict) -> str:
            obj = {"id": rid, "object": "text_completion", "created": created, "model": config.public_name,
                   "choices": [choice]}
            if req.include_usage:
                obj["usage"] = R.usage(states) if req.continuous_usage else None
            return R.sse(obj)

        async def events(gen: Generation, first) -> AsyncIterator[str]:
            started, ids_started = set(), set()
            offsets = {j.index: len(echo.get(j.index, "")) for j in jobs}
            async for i, step in _steps(gen, first, states, "/v1/completions", metrics, gen.started):
                s = states[i]
                text, entries = "", (step.logprobs or []) if step is not None else []
                if i not in started:
                    started.add(i)
                    text = echo.get(i, "")
                    if req.echo_logprobs and s.prompt_logprobs is not None:  # the prompt's entries come first
                        entries, offsets[i] = s.prompt_logprobs + entries, 0
                if step is not None:
                    text += step.reasoning + step.text
                lp = None
                if k is not None and entries:
                    lp = R.completion_logprobs(entries, k, offsets[i])
                    offsets[i] += sum(len(e.token) for e in entries)
                if text or lp or s.ended:
                    c = {"index": i, "text": text, "logprobs": lp, "finish_reason": s.finish_reason}
                    if req.return_token_ids:
                        if i not in ids_started:  # the choice's first chunk
                            ids_started.add(i)
                            c["prompt_token_ids"] = s.prompt_token_ids
                        if step is not None:
                            c["completion_token_ids"] = step.token_ids
                    yield chunk(c)
            if req.include_usage:
                yield R.sse({"id": rid, "object": "text_completion", "created": created,
                             "model": config.public_name, "choices": [], "usage": R.usage(states)})
            yield R.SSE_DONE

        finish = lambda: R.completion(rid, created, config.public_name, states, echo, k,  # noqa: E731
                                      req.return_token_ids, req.prompt_logprobs)
        return await self.serving.serve(request, "/v1/completions", jobs, states, req.stream, finish, events)


class ClientGone(Exception):
    """The client disconnected before its answer was ready; nobody is left to answer."""


async def _unless_disconnected(request: Request, work: Awaitable[Any]) -> Any:
    """Await `work`, cancelling it if the client goes away first (then raise ClientGone)."""
    async def watch():
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task, watcher = asyncio.ensure_future(work), asyncio.ensure_future(watch())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        raise ClientGone()
    finally:
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


async def _steps(gen: Generation, first, states: list[ChoiceState], endpoint: str, metrics: Metrics,
                 started: float):
    """(index, step) for every Triton response, folded into its choice's state first; a choice whose
    stream closed without a finish reason is closed as "stop" (yielded once with step None)."""
    seen_output = False
    event = first
    while event is not None:
        i, step = event
        s = states[i]
        if step is None:
            if not s.ended:
                s.ended = True
                yield i, None
        elif not s.ended:
            s.add(step)
            if not seen_output and (step.text or step.reasoning or step.tool_calls or step.token_ids):
                seen_output = True
                metrics.ttft.labels(endpoint).observe(time.monotonic() - started)
            yield i, step
        event = await gen.next()


async def _collect(gen: Generation, states: list[ChoiceState], endpoint: str, metrics: Metrics,
                   started: float) -> None:
    async for _ in _steps(gen, await gen.next(), states, endpoint, metrics, started):
        pass


async def _with_error_event(events: AsyncIterator[str]) -> AsyncIterator[str]:
    """A failure after the stream started goes out as an OpenAI error event, then [DONE]."""
    try:
        async for e in events:
            yield e
    except OpenAIError as e:
        yield R.sse(e.body())
        yield R.SSE_DONE
    finally:
        await events.aclose()
