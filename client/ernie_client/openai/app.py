"""The FastAPI app: OpenAI's chat/completions/models endpoints over the `ernie` Triton ensemble."""
from __future__ import annotations

import asyncio
import collections
import json
import logging
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError

from . import responses as R
from .errors import OpenAIError, bad_request
from .generation import ChoiceState, Generation
from .mapping import Job, chat_jobs, completion_jobs
from .metrics import Metrics
from .protocol import ChatCompletionRequest, CompletionRequest, lone_surrogate_path
from .sse import SSEResponse
from .tokenization import Tokenization, tokenization_router
from .triton import TritonBackend

log = logging.getLogger(__name__)
_PYDANTIC_TAGS = {"str", "int", "float", "bool", "list", "dict", "literal", "function-after", "function-before",
                  "function-wrap", "union", "none"}


@dataclass
class ServerConfig:
    triton_url: str = "localhost:8001"
    model_name: str = "ernie"               # the Triton ensemble
    served_model_name: str | None = None    # what clients put in "model" (default: model_name)
    api_key: str | None = None
    max_concurrency: int = 512
    request_timeout: float | None = None    # seconds, whole request; None = no limit
    max_waiting_time: float | None = None   # seconds over max_concurrency waits for a slot; None: 429 at once
    # the served model's tokenizer directory, its --max-model-len and --chat-template, for /tokenize & co
    tokenizer: str | None = None
    max_model_len: int | None = None
    chat_template: str | None = None

    @property
    def public_name(self) -> str:
        return self.served_model_name or self.model_name


class _Slots:
    """At most `limit` generation requests at once. The next one is refused at once (429), or, with
    `max_wait` (FastDeploy's --max-waiting-time), waits its turn for a slot that many seconds (-1: without
    limit) and is refused with 408 if none comes. Waiters are served first come, first served."""

    def __init__(self, limit: int, metrics: Metrics, max_wait: float | None = None):
        self.limit, self.max_wait, self.metrics = limit, max_wait, metrics
        self.active = 0
        self._queue: collections.deque[asyncio.Future] = collections.deque()

    async def acquire(self) -> None:
        if self.active < self.limit and not self._queue:
            self.active += 1
            return
        if self.max_wait is None:
            self.metrics.rejected.labels("429").inc()
            raise OpenAIError(429, f"too many concurrent requests: {self.active} in flight "
                              f"(--max-concurrency {self.limit}); retry later", code="rate_limit_exceeded")
        turn = asyncio.get_running_loop().create_future()
        self._queue.append(turn)
        self.metrics.waiting.inc()
        try:
            await asyncio.wait_for(asyncio.shield(turn), None if self.max_wait < 0 else self.max_wait)
        except asyncio.TimeoutError:
            if not turn.done():  # (done: a slot came in the same instant, and is kept)
                self._queue.remove(turn)
                self.metrics.rejected.labels("408").inc()
                raise OpenAIError(408, f"no slot came free within --max-waiting-time {self.max_wait:g} s "
                                  f"({self.active} requests in flight, --max-concurrency {self.limit}); retry later",
                                  code="request_timeout") from None
        except asyncio.CancelledError:
            if turn.done():
                self.release()  # handed a slot as it was cancelled: pass it on
            else:
                self._queue.remove(turn)
            raise
        finally:
            self.metrics.waiting.dec()

    def release(self) -> None:
        """Hand the slot to the longest waiter (every future in the queue is still waiting), else free it."""
        if self._queue:
            self._queue.popleft().set_result(None)  # the slot passes on: `active` stays
        else:
            self.active -= 1


def _param_from_loc(loc: tuple) -> str | None:
    parts = []
    for p in loc:
        if isinstance(p, int):
            parts.append(f"[{p}]")
        elif p not in _PYDANTIC_TAGS and "[" not in str(p) and "(" not in str(p):
            parts.append(("." if parts else "") + str(p))
    return "".join(parts) or None


def _validation_error(e: ValidationError | RequestValidationError) -> OpenAIError:
    err = e.errors()[0]
    param = _param_from_loc(tuple(x for x in err.get("loc", ()) if x != "body"))
    return bad_request(f"{param or 'request'}: {err.get('msg', 'invalid value')}", param)


async def _parse(request: Request, model: type[BaseModel]):
    raw = await request.body()
    try:
        data = json.loads(raw or b"null")
    except (ValueError, RecursionError) as e:  # bad JSON or UTF-8, a 4300+ digit number, deep nesting
        raise bad_request(f"the request body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise bad_request("the request body must be a JSON object")
    where = lone_surrogate_path(data)
    if where is not None:
        raise bad_request(f"{where}: holds a lone UTF-16 surrogate (a \\uD800-\\uDFFF escape without its "
                          "pair); send valid Unicode text", where)
    try:
        parsed = model.model_validate(data)
    except ValidationError as e:
        raise _validation_error(e) from None
    ignored = sorted(set(data) - set(model.model_fields))
    if ignored:  # as vLLM: unknown fields do not fail a request, but an operator can see them
        log.warning("%s: ignored request field(s) %s", request.url.path, ", ".join(ignored))
    return parsed


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


def create_app(config: ServerConfig, backend: TritonBackend | None = None) -> FastAPI:
    backend = backend or TritonBackend(config.triton_url, config.model_name, api_key=config.api_key)
    metrics = Metrics()
    slots = _Slots(config.max_concurrency, metrics, config.max_waiting_time)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        await backend.close()

    app = FastAPI(title="ERNIE OpenAI-compatible server", lifespan=lifespan)
    app.state.config, app.state.backend, app.state.metrics, app.state.slots = config, backend, metrics, slots

    @app.exception_handler(OpenAIError)
    async def _openai_error(request: Request, e: OpenAIError):
        metrics.requests.labels(request.url.path, str(e.status)).inc()
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def _request_validation(request: Request, e: RequestValidationError):
        return await _openai_error(request, _validation_error(e))

    async def check_auth(request: Request) -> None:
        if config.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or token.strip() != config.api_key:
            raise OpenAIError(401, "invalid or missing API key: send 'Authorization: Bearer <key>'",
                              code="invalid_api_key")

    def check_model(name: str | None) -> None:
        if name not in (None, "", config.public_name, config.model_name):
            raise OpenAIError(404, f"the model {name!r} does not exist; this server serves {config.public_name!r}",
                              param="model", code="model_not_found")

    # ------------------------------------------------------------------ plain endpoints
    @app.get("/health")
    async def health():
        if await backend.ready():
            return {"status": "ok"}
        raise OpenAIError(503, f"Triton at {config.triton_url} or its model {config.model_name!r} is not ready")

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models", dependencies=[Depends(check_auth)])
    async def models():
        metrics.requests.labels("/v1/models", "200").inc()
        return {"object": "list", "data": [{"id": config.public_name, "object": "model", "created": 0,
                                            "owned_by": "ernie-triton", "root": config.model_name}]}

    tokenization = (Tokenization(config.tokenizer, config.max_model_len, config.chat_template)
                    if config.tokenizer else None)
    app.include_router(tokenization_router(tokenization, check_auth, check_model))

    # ------------------------------------------------------------------ generation
    async def serve(request: Request, endpoint: str, jobs: list[Job], states: list[ChoiceState], stream: bool,
                    finish: Callable[[], dict], events: Callable[[Generation, Any], AsyncIterator[str]]):
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
        return SSEResponse(events(gen, first), lambda disconnected: close(disconnected))

    @app.post("/v1/chat/completions", dependencies=[Depends(check_auth)])
    async def chat_completions(request: Request):
        req: ChatCompletionRequest = await _parse(request, ChatCompletionRequest)
        check_model(req.model)
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

        return await serve(request, "/v1/chat/completions", jobs, states, req.stream,
                           lambda: R.chat_completion(rid, created, config.public_name, states, k,
                                                     req.return_token_ids),
                           lambda gen, first: _with_error_event(events(gen, first)))

    @app.post("/v1/completions", dependencies=[Depends(check_auth)])
    async def completions(request: Request):
        req: CompletionRequest = await _parse(request, CompletionRequest)
        check_model(req.model)
        jobs = completion_jobs(req)
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
                text = ""
                if i not in started:
                    started.add(i)
                    text = echo.get(i, "")
                if step is not None:
                    text += step.reasoning + step.text
                lp = None
                if k is not None and step is not None and step.logprobs:
                    lp = R.completion_logprobs(step.logprobs, k, offsets[i])
                    offsets[i] += sum(len(e.token) for e in step.logprobs)
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

        return await serve(request, "/v1/completions", jobs, states, req.stream,
                           lambda: R.completion(rid, created, config.public_name, states, echo, k,
                                                req.return_token_ids),
                           lambda gen, first: _with_error_event(events(gen, first)))

    return app


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
