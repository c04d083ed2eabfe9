"""What a router in front of several replicas asks each one: sglang-router's (smg's) HTTP worker protocol.

The router discovers a worker with GET /server_info and /model_info (it falls back to the deprecated /get_server_info
and /get_model_info after a 404, logging a warning), takes the worker's model id from `served_model_name` and the
tokenizer it loads for its own /v1/tokenize and gRPC pipeline from `model_path`; its health checker GETs /health
and takes any non-2xx answer as a failure; its power-of-two policy reads GET /get_load and sums `num_tokens` over
the entries. So:

- /server_info, /model_info: the served name, the tokenizer directory the router can load (router_tokenizer.py),
  the engine's parallelism and role read from Triton's `ernie_moe` config;
- /get_load: one entry per replica, the shim's admission (requests in flight and waiting for a slot) and, when the
  shim knows Triton's metrics port, the KV tokens the engines hold and their running / waiting requests;
- /health: 503 while the replica drains (SIGTERM: the port stays open until in-flight requests end, so the router
  sees why instead of a refused connection) or while every --max-concurrency slot is taken, so the router stops
  sending there until it recovers; new generation requests while draining get 503, which the router retries on
  another worker.

With --workers N the shim is still one replica: /get_load and /health's overload count every worker's requests
(the metrics' multiprocess files), and each worker drains on the signal its supervisor forwards.
"""
from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import httpx
from fastapi import APIRouter, Depends

from .admission import ConcurrencySlots
from .errors import OpenAIError
from .router_tokenizer import RouterTokenizerError, router_tokenizer_dir

if TYPE_CHECKING:
    from .app import ServerConfig
    from .triton import TritonBackend

log = logging.getLogger(__name__)

ENGINE_MODEL = "ernie_moe"  # the ensemble step that owns the engines; its parameters are the engine's flags
# FastDeploy's --splitwise-role against sglang's disaggregation_mode ("null": a plain server).
_DISAGGREGATION = {"mixed": "null", "prefill": "prefill", "decode": "decode"}
_ENGINE_GAUGES = ("ernie:num_requests_running", "ernie:num_requests_waiting", "ernie:kv_cache_total_blocks",
                  "ernie:kv_cache_free_blocks")


def engine_samples(metrics_text: str) -> dict[str, float]:
    """The engine gauges in a Prometheus page, summed over label sets (one per engine instance)."""
    out: dict[str, float] = {}
    for m in re.finditer(r"^(ernie:[\w:]+)(?:\{[^}]*\})?\s+(\S+)$", metrics_text, re.M):
        if m.group(1) in _ENGINE_GAUGES:
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
    return out


class ReplicaState:
    """The replica as a router sees it: draining or not, full or not, what it serves and how loaded it is."""

    def __init__(self, config: "ServerConfig", backend: "TritonBackend", slots: ConcurrencySlots):
        self.config, self.backend, self.slots = config, backend, slots
        self.draining = False
        self._engine: dict[str, Any] | None = None
        self._engine_lock = asyncio.Lock()
        self._engine_warned = False
        self._tokenizer_dir: str | None = None
        self._tokenizer_done = False
        self._tokenizer_lock = asyncio.Lock()

    # ---- draining and overload ---------------------------------------------------------------------------
    def begin_drain(self) -> None:
        """From now on /health is 503 and new generation requests are refused; running ones go on."""
        self.draining = True

    def idle(self) -> bool:
        """No request in flight; with --workers, in the whole shim: every worker drains until all are done, so the
        port answers 503 meanwhile instead of an idle worker's exit closing connections under their clients."""
        return self.admission()[0] == 0

    def admission(self) -> tuple[int, int, int]:
        """(requests in flight, waiting for a slot, slots) of the whole shim: this process's own, or with --workers
        the sum over the workers (read from the metrics' multiprocess files), since a router sees one replica."""
        totals = self.slots.metrics.shim_totals()
        if totals is None:
            return self.slots.active, self.slots.waiting, self.slots.limit
        return totals[0], totals[1], self.slots.limit * self.config.workers

    def unavailable(self) -> str | None:
        """Why a router should not send work here now, or None."""
        if self.draining:
            return "draining: this replica is shutting down and takes no new requests"
        active, waiting, limit = self.admission()
        if active >= limit:
            return f"overloaded: all {limit} --max-concurrency slots are in use ({waiting} requests waiting)"
        return None

    async def refuse_when_draining(self) -> None:
        """Dependency of the generation endpoints: 503 (retried elsewhere by a router) once draining."""
        if self.draining:
            raise OpenAIError(503, "this replica is draining (shutting down); send the request to another one",
                              code="draining")

    # ---- what the router discovers --------------------------------------------------------------------------
    async def tokenizer_dir(self) -> str | None:
        """The directory with a tokenizer.json for the router, made once, off the event loop (None: no tokenizer
        given, or one that cannot be translated, logged once)."""
        async with self._tokenizer_lock:
            if not self._tokenizer_done:
                self._tokenizer_done = True
                if self.config.tokenizer:
                    try:
                        self._tokenizer_dir = str(await asyncio.to_thread(router_tokenizer_dir, self.config.tokenizer))
                    except (RouterTokenizerError, OSError) as e:
                        log.warning("no tokenizer for routers: %s", e)
        return self._tokenizer_dir

    async def engine(self) -> dict[str, Any]:
        """`ernie_moe`'s parameters and instance count from Triton, fetched once ({} when Triton cannot say)."""
        if self._engine is None:
            async with self._engine_lock:
                if self._engine is None:
                    try:
                        cfg = (await self.backend.model_config(ENGINE_MODEL)).get("config", {})
                    except Exception as e:  # noqa: BLE001 - discovery goes on with what the shim knows
                        if not self._engine_warned:
                            self._engine_warned = True
                            log.warning("cannot read %s's config from Triton (asked again on the next call): %s",
                                        ENGINE_MODEL, e)
                        return {}
                    params = {k: v.get("string_value", "") for k, v in (cfg.get("parameters") or {}).items()}
                    groups = cfg.get("instance_group") or [{}]
                    params["instances"] = sum(int(g.get("count", 1)) for g in groups)
                    self._engine = params
        return self._engine

    async def server_info(self) -> dict[str, Any]:
        engine = await self.engine()
        tp = int(engine.get("tensor_parallel_size") or 1)
        seqs = int(engine.get("max_num_seqs") or 0) * int(engine.get("instances") or 1)
        info: dict[str, Any] = {
            "served_model_name": self.config.public_name,
            "model_path": await self.tokenizer_dir(),
            "tp_size": tp,
            "disaggregation_mode": _DISAGGREGATION.get(engine.get("splitwise_role") or "mixed", "null"),
            "max_running_requests": seqs or None,
            "context_length": self.config.max_model_len,
            "version": _version(),
            "engine_instances": engine.get("instances"),
            "max_concurrency": self.config.max_concurrency,  # the whole shim's (a worker admits its share)
            "api_server_workers": self.config.workers if self.config.workers > 1 else None,
        }
        return {k: v for k, v in info.items() if v is not None}

    async def model_info(self) -> dict[str, Any]:
        tokenizer = await self.tokenizer_dir()
        hf = _read_json(Path(self.config.tokenizer) / "config.json") if self.config.tokenizer else {}
        info = {"model_path": tokenizer, "tokenizer_path": tokenizer, "is_generation": True,
                "served_model_name": self.config.public_name, "model_type": hf.get("model_type"),
                "architectures": hf.get("architectures"), "max_context_length": self.config.max_model_len}
        return {k: v for k, v in info.items() if v is not None}

    async def load(self) -> list[dict[str, Any]]:
        active, waiting, _ = self.admission()
        entry: dict[str, Any] = {"dp_rank": 0, "num_reqs": active, "num_waiting_reqs": waiting, "num_tokens": 0}
        url = self.config.triton_metrics_url
        if url:
            try:
                async with httpx.AsyncClient(timeout=2) as client:
                    samples = engine_samples((await client.get(url)).text)
                block = int((await self.engine()).get("block_size") or 0)
                used = samples.get("ernie:kv_cache_total_blocks", 0) - samples.get("ernie:kv_cache_free_blocks", 0)
                entry.update(num_tokens=int(used) * block,
                             engine_running=int(samples.get("ernie:num_requests_running", 0)),
                             engine_waiting=int(samples.get("ernie:num_requests_waiting", 0)))
            except (httpx.HTTPError, ValueError) as e:
                log.debug("engine load unavailable from %s: %s", url, e)
        return [entry]


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


def _version() -> str | None:
    try:
        return metadata.version("ernie-triton")
    except metadata.PackageNotFoundError:
        return None


def replica_router(state: ReplicaState, check_auth: Callable) -> APIRouter:
    """GET /health, /server_info, /model_info (+ the deprecated /get_ names), /get_load."""
    router = APIRouter()

    @router.get("/health")
    async def health():
        why = state.unavailable()
        if why is not None:
            raise OpenAIError(503, why, code="draining" if state.draining else "overloaded")
        if await state.backend.ready():
            return {"status": "ok"}
        raise OpenAIError(503, f"Triton at {state.config.triton_url} or its model {state.config.model_name!r} "
                          "is not ready")

    auth = [Depends(check_auth)]
    for path in ("/server_info", "/get_server_info"):
        router.add_api_route(path, state.server_info, methods=["GET"], dependencies=auth)
    for path in ("/model_info", "/get_model_info"):
        router.add_api_route(path, state.model_info, methods=["GET"], dependencies=auth)
    router.add_api_route("/get_load", state.load, methods=["GET"], dependencies=auth)
    return router


def draining_server(config):
    """A uvicorn.Server for `config` (a uvicorn.Config of an app from create_app) whose first SIGTERM / Ctrl-C
    drains (see the module doc) before uvicorn's own graceful shutdown: the port stays open and /health says 503
    until no request is in flight or `timeout_graceful_shutdown` has passed. A second signal stops it as uvicorn
    does."""
    import uvicorn

    class DrainingServer(uvicorn.Server):
        drain_deadline: float | None = None

        def handle_exit(self, sig, frame) -> None:
            if self.drain_deadline is None and not self.should_exit:
                self._captured_signals.append(sig)  # re-raised after shutdown, as uvicorn does
                self.config.app.state.replica.begin_drain()
                self.drain_deadline = time.monotonic() + (self.config.timeout_graceful_shutdown or 0.0)
                return
            super().handle_exit(sig, frame)

        async def on_tick(self, counter: int) -> bool:
            if self.drain_deadline is not None and not self.should_exit and (
                    self.config.app.state.replica.idle() or time.monotonic() >= self.drain_deadline):
                self.should_exit = True
            return await super().on_tick(counter)

    return DrainingServer(config)
