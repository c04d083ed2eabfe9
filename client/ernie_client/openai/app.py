"""The FastAPI app: OpenAI's chat / completions / models endpoints and vLLM's tokenizer endpoints over the `ernie`
Triton ensemble. This module wires them; serving.py holds a generation request's life, tokenization.py the
tokenizer's endpoints."""
from __future__ import annotations

import math
import os
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response

from .admission import ConcurrencySlots
from .errors import OpenAIError
from .metrics import Metrics
from .replica import ReplicaState, replica_router
from .request_body import validation_error
from .serving import OpenAIServing, OpenAIServingChat, OpenAIServingCompletion
from .tokenization import Tokenization, tokenization_router
from .triton import TritonBackend, local_engines


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
    triton_metrics_url: str | None = None   # Triton's /metrics, for the engines' load in /get_load
    # worker processes of this shim (--workers): each admits its share of max_concurrency, and with more than one
    # the metrics live in the supervisor's PROMETHEUS_MULTIPROC_DIR
    workers: int = 1
    # how an abandoned stream ends: "off" (gRPC cancellation), "auto" (an abort in the engines when Triton is on
    # this host, see triton.LocalEngines)
    engine_control: str = "off"

    @property
    def public_name(self) -> str:
        return self.served_model_name or self.model_name

    @property
    def worker_concurrency(self) -> int:
        """One worker's share of max_concurrency: ceil(max_concurrency / workers). The total stays a bound (each
        worker admits its share of the connections the kernel gave it, so one may refuse while another has room)."""
        return math.ceil(self.max_concurrency / self.workers)


def create_app(config: ServerConfig, backend: TritonBackend | None = None) -> FastAPI:
    backend = backend or TritonBackend(config.triton_url, config.model_name, api_key=config.api_key,
                                       engines=local_engines(config.triton_url, config.engine_control))
    multiprocess_dir = os.environ.get("PROMETHEUS_MULTIPROC_DIR") if config.workers > 1 else None
    metrics = Metrics(multiprocess_dir)
    bound = None if config.workers == 1 else (f"--max-concurrency {config.max_concurrency} over "
                                              f"{config.workers} workers: {config.worker_concurrency} each")
    slots = ConcurrencySlots(config.worker_concurrency, metrics, config.max_waiting_time, bound)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        await backend.close()

    app = FastAPI(title="ERNIE OpenAI-compatible server", lifespan=lifespan)
    app.state.config, app.state.backend, app.state.metrics, app.state.slots = config, backend, metrics, slots
    replica = app.state.replica = ReplicaState(config, backend, slots)

    @app.exception_handler(OpenAIError)
    async def _openai_error(request: Request, e: OpenAIError):
        metrics.requests.labels(request.url.path, str(e.status)).inc()
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def _request_validation(request: Request, e: RequestValidationError):
        return await _openai_error(request, validation_error(e))

    async def check_auth(request: Request) -> None:
        if config.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or token.strip() != config.api_key:
            raise OpenAIError(401, "invalid or missing API key: send 'Authorization: Bearer <key>'",
                              code="invalid_api_key")

    serving = OpenAIServing(config, backend, metrics, slots)
    tokenization = (Tokenization(config.tokenizer, config.max_model_len, config.chat_template)
                    if config.tokenizer else None)
    chat = OpenAIServingChat(serving)
    completion = OpenAIServingCompletion(serving, tokenization.decode_prompt if tokenization is not None else None)

    # ------------------------------------------------------------------ plain endpoints
    app.include_router(replica_router(replica, check_auth))  # /health and what routers discover

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models", dependencies=[Depends(check_auth)])
    async def models():
        metrics.requests.labels("/v1/models", "200").inc()
        return {"object": "list", "data": [{"id": config.public_name, "object": "model", "created": 0,
                                            "owned_by": "ernie-triton", "root": config.model_name}]}

    app.include_router(tokenization_router(tokenization, check_auth, serving.check_model))

    @app.post("/v1/chat/completions", dependencies=[Depends(check_auth), Depends(replica.refuse_when_draining)])
    async def chat_completions(request: Request) -> Response:
        return await chat.create(request)

    @app.post("/v1/completions", dependencies=[Depends(check_auth), Depends(replica.refuse_when_draining)])
    async def completions(request: Request) -> Response:
        return await completion.create(request)

    return app
