"""The shim's one connection to Triton: tritonclient's asyncio gRPC client, one stream per request.

The ensemble's own config decides tensor dtypes and shapes (read once, then cached), so the shim
follows whatever the repository declares: a field the ensemble has no input for is folded into
`sampling_parameters` when it can be, and is otherwise a 400 naming it.

A stream the shim abandons (its HTTP client left, --request-timeout) is ended in the engines when they are on this
host (`--engine-control auto` and a loopback --triton-url: LocalEngines) and the model is an ensemble (which passes
the request id to ernie_moe; ernie_bls does not, and sees its own cancellation): `abort-id <request id>` to each
engine instance's control socket (ernie_serve.serving.control), and the stream is then read to its end.
tritonserver 2.51 can deadlock when a gRPC cancellation of a stream meets an ensemble response on it
(docs/reliability.md), so call.cancel() is left for a remote Triton, other models, and a stream that does not end
in time after the abort.
"""
from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import re
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

import numpy as np

from ..triton_client import ResponseTensors
from .errors import OpenAIError

log = logging.getLogger(__name__)

_NP_TYPES = {
    "TYPE_STRING": np.object_, "TYPE_BOOL": np.bool_, "TYPE_INT32": np.int32, "TYPE_INT64": np.int64,
    "TYPE_UINT32": np.uint32, "TYPE_UINT64": np.uint64, "TYPE_FP32": np.float32, "TYPE_FP64": np.float64,
}
_JSON_INPUTS = ("messages", "tools", "chat_template_kwargs", "sampling_parameters")
# Dedicated-tensor fields and their SamplingParams name, for ensembles that lack the tensor.
_FOLDABLE = {"max_tokens": "max_tokens", "temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
             "seed": "seed", "stop_words": "stop", "bad_words": "bad_words"}
# Dropped when the ensemble lacks them (skip_parsers: an older ensemble parses completions too; the shim
# then rejoins reasoning and content, see responses.completion).
_OPTIONAL_FLAGS = ("stream", "exclude_input_in_output", "return_num_input_tokens", "return_num_output_tokens",
                   "skip_parsers")


@dataclass
class TokenLogprob:
    token_id: int
    token: str
    logprob: float | None  # None: a prompt's first token, which nothing predicts
    top: list[tuple[int, str, float]] = field(default_factory=list)  # best first
    bytes: list[int] | None = None  # the server's (exact for a byte-fallback piece); else token's UTF-8
    top_bytes: list[list[int] | None] = field(default_factory=list)
    rank: int | None = None  # 1 + the number of tokens more likely, where the server says


@dataclass
class StepOutput:
    """One streamed Triton response: what this engine step added, plus the running counters."""
    text: str = ""
    reasoning: str = ""
    tool_calls: list[dict] = field(default_factory=list)  # OpenAI delta tool_calls
    finish_reason: str | None = None
    token_ids: list[int] = field(default_factory=list)
    num_input_tokens: int | None = None
    num_output_tokens: int | None = None
    num_cached_tokens: int | None = None
    num_reasoning_tokens: int | None = None
    prompt_token_ids: list[int] | None = None
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob] | None = None  # one per prompt token, on a choice's first response


@dataclass
class EnsembleSpec:
    inputs: dict[str, tuple[Any, list[int]]]  # name -> (numpy dtype, dims)
    batched: bool
    outputs: frozenset[str] = frozenset()
    ensemble: bool = False  # an ensemble (platform "ensemble") passes the client's request id to each step

    @classmethod
    def from_config(cls, cfg: dict) -> "EnsembleSpec":
        cfg = cfg.get("config", cfg)
        inputs = {i["name"]: (_NP_TYPES.get(i.get("data_type", "TYPE_STRING"), np.object_),
                              [int(d) for d in i.get("dims", [])]) for i in cfg.get("input", [])}
        outputs = frozenset(o["name"] for o in cfg.get("output", []))
        return cls(inputs, int(cfg.get("max_batch_size", 0) or 0) > 0, outputs, cfg.get("platform") == "ensemble")


def _decoded_token(token_id: int, token: Any) -> str:
    # vLLM's convention when the server sends no text for a token.
    return token if isinstance(token, str) else f"token_id:{token_id}"


def parse_logprobs(raw: Any, token_ids: list[int]) -> list[TokenLogprob]:
    """Accept one entry per new token, either OpenAI-like
    `{"token_id", "token", "logprob", "top_logprobs": [{"token_id", "token", "logprob"}]}` or vLLM's
    `{token_id: {"logprob", "rank", "decoded_token"}}` (the sampled id is then taken from output_ids)."""
    out = []
    for k, entry in enumerate(raw or []):
        if entry is None:  # vLLM's prompt_logprobs start so: the first prompt token has none
            tid = token_ids[k] if k < len(token_ids) else -1
            out.append(TokenLogprob(tid, _decoded_token(tid, None), None))
            continue
        if "logprob" in entry:
            tid = int(entry.get("token_id", token_ids[k] if k < len(token_ids) else -1))
            tops = entry.get("top_logprobs") or []
            top = [(int(t.get("token_id", -1)), _decoded_token(int(t.get("token_id", -1)), t.get("token")),
                    float(t["logprob"])) for t in tops]
            lp = entry["logprob"]
            out.append(TokenLogprob(tid, _decoded_token(tid, entry.get("token")), None if lp is None else float(lp),
                                    top, entry.get("bytes"), [t.get("bytes") for t in tops], entry.get("rank")))
            continue
        cands = {int(t): v for t, v in entry.items()}
        tid = token_ids[k] if k < len(token_ids) else min(cands, key=lambda t: cands[t].get("rank") or 0)
        ranked = sorted(cands.items(), key=lambda kv: -float(kv[1]["logprob"]))
        top = [(t, _decoded_token(t, v.get("decoded_token")), float(v["logprob"])) for t, v in ranked]
        sampled = cands.get(tid, {"logprob": float("nan")})
        out.append(TokenLogprob(tid, _decoded_token(tid, sampled.get("decoded_token")), float(sampled["logprob"]),
                                top))
    return out


def decode_response(result) -> StepOutput:
    """tritonclient InferResult -> StepOutput; every output is optional."""
    r = ResponseTensors(result)

    def as_json(name):
        s = r.text(name)
        if not s:
            return None
        try:
            return json.loads(s)
        except json.JSONDecodeError:
            log.warning("output %s is not JSON: %.200s", name, s)
            return None

    step = StepOutput(text=r.text("text_output"), reasoning=r.text("reasoning_content"),
                      finish_reason=r.text("finish_reason") or None, token_ids=r.ints("output_ids") or [],
                      num_input_tokens=r.one("num_input_tokens"), num_output_tokens=r.one("num_output_tokens"),
                      num_cached_tokens=r.one("num_cached_tokens"),
                      num_reasoning_tokens=r.one("num_reasoning_tokens"),
                      # the ensemble sends the prompt on the first response only (empty afterwards)
                      prompt_token_ids=(r.ints("prompt_token_ids") if r.array("prompt_token_ids") is not None
                                        else r.ints("input_ids")) or None)
    calls = as_json("tool_calls")
    step.tool_calls = calls if isinstance(calls, list) else []
    lp = as_json("logprobs")
    if lp:
        step.logprobs = parse_logprobs(lp, step.token_ids)
    lp = as_json("prompt_logprobs")
    if lp:
        step.prompt_logprobs = parse_logprobs(lp, step.prompt_token_ids or [])
    return step


def triton_error(exc: BaseException, model: str) -> OpenAIError:
    """A tritonclient / gRPC failure as the OpenAI status a client should see."""
    status = ""
    if hasattr(exc, "code") and callable(exc.code):  # grpc.aio.AioRpcError
        status = str(exc.code())
        msg = exc.details() if callable(getattr(exc, "details", None)) else str(exc)
    else:
        status = str(getattr(exc, "status", lambda: "")() or "")
        msg = exc.message() if callable(getattr(exc, "message", None)) else str(exc)
    msg = msg or str(exc)
    low = msg.lower()
    if "DEADLINE_EXCEEDED" in status:
        return OpenAIError(504, f"Triton did not answer in time: {msg}")
    if "overloaded" in low:  # the engine's queue is full (--max-waiting-requests): back off and retry
        return OpenAIError(429, f"the server is overloaded, retry later: {msg}", code="overloaded")
    if "UNAVAILABLE" in status or "failed to connect" in low or "connection refused" in low:
        return OpenAIError(503, f"Triton is unavailable: {msg}")
    if "NOT_FOUND" in status or ("unknown model" in low or "is not found" in low or "not ready" in low):
        return OpenAIError(503, f"Triton model {model!r} is not available: {msg}")
    if "unavailable" in low or "engine failed" in low or "not running" in low:
        return OpenAIError(503, msg)
    if "cancelled" in low:
        return OpenAIError(503, f"Triton cancelled the request: {msg}")
    if "INVALID_ARGUMENT" in status or not status:
        # Errors inside a stream carry no code; the Triton models only fail requests this way for
        # bad input (engine failures say "unavailable"/"engine failed", matched above).
        return OpenAIError(400, msg, param=_param_of(msg))
    return OpenAIError(500, f"Triton error: {msg}")


# ernie_tokenizer's field names -> the OpenAI request's
_PARAM_NAMES = {"text_input": "prompt", "input_token_ids": "prompt", "stop_words": "stop", "bad_words": "bad_words",
                "random_seed": "seed", "min_length": "min_tokens", "sampling_parameters": None, "request_key": None,
                "stop": "stop"}


def _param_of(message: str) -> str | None:
    """The field an ernie_serve error names: its messages start with `field: ...` or `field must ...`
    (`stop_token_ids[2] must ...` names stop_token_ids)."""
    message = re.sub(r"^in ensemble '[^']*', ", "", message)  # Triton's prefix for a failed ensemble step
    head = message.split(":", 1)[0].split(" ", 1)[0].split("[", 1)[0].strip()
    if not head.isidentifier():
        return None
    return _PARAM_NAMES.get(head, head) if (":" in message or " must " in message) else None


ENGINE_CONTROL_MODES = ("off", "auto")
ABANDON_TIMEOUT = 10.0  # seconds an abandoned stream may take to end after its abort, before call.cancel()
# An abort-id reaches nothing while the request is still before ernie_moe (the tokenizer, Triton's queue), so it is
# sent again, at these growing intervals, until the stream ends.
ABORT_RESEND_FIRST = 0.05
ABORT_RESEND_MAX = 1.0


class LocalEngines:
    """The control sockets of the engine instances behind a Triton on this host, for ending an abandoned stream with
    `abort-id` instead of a gRPC cancellation. Found again every `refresh` seconds, and at once when no instance took
    a message (a restarted tritonserver has new ones)."""

    def __init__(self, find: Callable[[], list[str]], send: Callable[[str, str], bool | None], refresh: float = 5.0):
        self._find = find
        self._send = send
        self.refresh = refresh
        self._addresses: list[str] = []
        self._found_at: float | None = None

    def addresses(self, again: bool = False) -> list[str]:
        now = time.monotonic()
        if again or self._found_at is None or now - self._found_at > self.refresh:
            try:
                self._addresses = list(self._find())
            except Exception:  # noqa: BLE001 - no engines found is the answer, then gRPC cancellation
                log.exception("finding the local engines' control sockets failed")
                self._addresses = []
            self._found_at = now
        return self._addresses

    def abort(self, request_id: str) -> bool:
        """Send `abort-id request_id` to every instance; False when none is there to take it (then cancel over gRPC).
        An instance whose queue is full for now counts as there: the abort is sent again until the stream ends."""
        if self._sent(self.addresses(), request_id):
            return True
        if self._found_at is not None and time.monotonic() - self._found_at > 0.2:
            return self._sent(self.addresses(again=True), request_id)
        return False

    def _sent(self, addresses: list[str], request_id: str) -> bool:
        return sum(self._send(address, request_id) is not False for address in addresses) > 0


def local_engines(url: str, mode: str = "off") -> LocalEngines | None:
    """`--engine-control`: "off", or "auto": the engines of the tritonserver listening on --triton-url's port, when
    that URL is this host's (loopback, or the unspecified address) and ernie_serve is importable; else None (a
    remote Triton: gRPC cancellation)."""
    if mode not in ENGINE_CONTROL_MODES:
        raise ValueError(f"--engine-control must be one of {', '.join(ENGINE_CONTROL_MODES)}, got {mode!r}")
    if mode == "off":
        return None
    host, _, port = url.rpartition("/")[2].rpartition(":")
    if not _is_local_host(host) or not port.isdigit():
        log.info("--engine-control auto: Triton at %s is not on this host; abandoned streams are cancelled over gRPC",
                 url)
        return None
    try:
        from ernie_serve.serving import control  # import-light: no Paddle
    except ImportError as e:
        log.warning("--engine-control auto: ernie_serve is not importable (%s); abandoned streams are cancelled over "
                    "gRPC", e)
        return None
    log.info("--engine-control auto: abandoned streams are ended by the engines of the Triton on port %s", port)
    return LocalEngines(lambda: control.engine_addresses(int(port)), control.send_abort_id)


def _is_local_host(host: str) -> bool:
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False
    return ip.is_loopback or ip.is_unspecified


class TritonBackend:
    def __init__(self, url: str, model_name: str, client_factory: Callable[[str], Any] | None = None,
                 api_key: str | None = None, engines: LocalEngines | None = None):
        """`api_key`: sent to Triton as the Bearer token that `ernie-serve --api-key` makes it require.
        `engines`: the local engines, which end an abandoned stream without a gRPC cancellation (local_engines)."""
        self.url = url
        self.engines = engines
        # how abandoned streams ended: aborted in the engines, cancelled over gRPC at once (no local engine took the
        # abort, or none are known), cancelled over gRPC after an abort that did not end the stream in time
        self.abandoned = {"aborted": 0, "cancelled": 0, "cancelled_after_abort": 0}
        self.model_name = model_name
        self._auth = {"headers": {"triton-grpc-protocol-authorization": f"Bearer {api_key}"}} if api_key else {}
        self._client_factory = client_factory or _grpc_aio_client
        self._client = None
        self._spec: EnsembleSpec | None = None
        self._spec_lock = asyncio.Lock()
        self._closing: set[asyncio.Task] = set()  # finished streams being closed by the server
        self._readers: set[asyncio.Future] = set()  # one per open stream; a cancelled one ends by call.cancel()

    def _get_client(self):
        if self._client is None:
            self._client = self._client_factory(self.url)
        return self._client

    async def close(self) -> None:
        for task in list(self._closing):
            task.cancel()
        if self._client is not None:
            await self._client.close()
            self._client = None

    async def ready(self) -> bool:
        try:
            client = self._get_client()
            return bool(await client.is_server_ready(client_timeout=2, **self._auth)
                        and await client.is_model_ready(self.model_name, client_timeout=2, **self._auth))
        except Exception:  # noqa: BLE001 - any failure means "not ready"
            return False

    async def spec(self) -> EnsembleSpec:
        if self._spec is None:
            async with self._spec_lock:
                if self._spec is None:
                    try:
                        cfg = await self._get_client().get_model_config(self.model_name, as_json=True,
                                                                        client_timeout=5, **self._auth)
                    except Exception as e:  # noqa: BLE001
                        raise triton_error(e, self.model_name) from e
                    self._spec = EnsembleSpec.from_config(cfg)
        return self._spec

    async def model_config(self, model: str) -> dict:
        """Any model's config as Triton serves it (get_model_config's JSON), e.g. the engine step's parameters."""
        return await self._get_client().get_model_config(model, as_json=True, client_timeout=5, **self._auth)

    async def requested_outputs(self, fields: dict[str, Any]) -> list | None:
        """The outputs this request reads (None: all). Every output tritonserver returns is serialized on each
        response, so logprobs outputs are asked for only by a request that wants them."""
        from tritonclient.grpc import InferRequestedOutput

        spec = await self.spec()
        if not spec.outputs:
            return None
        sp = {**(fields.get("sampling_parameters") or {}), **{k: v for k, v in fields.items() if k in _FOLDABLE}}
        skip = {name for name in ("logprobs", "prompt_logprobs") if sp.get(name) is None}
        return [InferRequestedOutput(name) for name in sorted(spec.outputs - skip)]

    async def encode(self, fields: dict[str, Any]) -> list:
        from tritonclient.grpc import InferInput

        spec = await self.spec()
        fields = dict(fields)
        sp = dict(fields.pop("sampling_parameters", None) or {})
        for name in list(fields):
            if name in spec.inputs:
                continue
            value = fields.pop(name)
            if name in _FOLDABLE and "sampling_parameters" in spec.inputs:
                sp[_FOLDABLE[name]] = value
            elif name not in _OPTIONAL_FLAGS:
                raise OpenAIError(400, f"the Triton model {self.model_name!r} has no input for {name!r}", name)
        for name in ("logprobs", "prompt_logprobs"):
            if sp.get(name) is not None and spec.outputs and name not in spec.outputs:
                raise OpenAIError(400, f"{name} are not available: the Triton model {self.model_name!r} has no "
                                  f"{name!r} output", name)
        if sp:
            if "sampling_parameters" not in spec.inputs:
                raise OpenAIError(400, f"the Triton model {self.model_name!r} takes no sampling_parameters; "
                                  f"unsupported field(s): {', '.join(sorted(sp))}", sorted(sp)[0])
            fields["sampling_parameters"] = sp
        inputs = []
        for name, value in fields.items():
            dtype, dims = spec.inputs[name]
            if name in _JSON_INPUTS:
                value = json.dumps(value, ensure_ascii=False)
            values = value if isinstance(value, list) else [value]
            if not values:
                continue
            if dtype is np.object_:
                arr = np.array([v.encode("utf-8") if isinstance(v, str) else v for v in values], dtype=np.object_)
            else:
                _check_fits(name, values, dtype)
                arr = np.array(values, dtype=dtype)
            shape = [len(values)] if (dims and dims[-1] == -1) or len(values) > 1 else [1] * max(len(dims), 1)
            if spec.batched:
                shape = [1] + shape
            arr = arr.reshape(shape)
            inp = InferInput(name, list(arr.shape), "BYTES" if dtype is np.object_ else _triton_dtype(arr))
            inp.set_data_from_numpy(arr)
            inputs.append(inp)
        return inputs

    async def generate(self, fields: dict[str, Any], request_id: str) -> AsyncIterator[StepOutput]:
        """Stream one request's outputs; leaving early (break, cancel, close) cancels it in Triton."""
        inputs = await self.encode(fields)
        outputs = await self.requested_outputs(fields)
        done = asyncio.Event()

        async def requests():
            yield {"model_name": self.model_name, "inputs": inputs, "outputs": outputs, "request_id": request_id}
            # Keep the request side open until the final response: half-closing a stream is not a
            # cancellation, but some servers end the stream early on it.
            await done.wait()

        try:
            call = self._get_client().stream_infer(requests(), **self._auth)
        except Exception as e:  # noqa: BLE001
            raise triton_error(e, self.model_name) from e
        # One reader task per stream, never cancelled: a cancellation of this request (the HTTP client left) must
        # not land inside grpc.aio's pending read, whose core operation then completes into a buffer nothing frees
        # (grpcio's execute_batch skips its cleanup when cancelled: a response's size of native memory per
        # disconnect). The read ends instead through call.cancel() below, or with the stream.
        responses: asyncio.Queue = asyncio.Queue()
        reader = asyncio.ensure_future(_read_into(call, responses))
        self._readers.add(reader)
        reader.add_done_callback(self._readers.discard)
        finished = False
        try:
            while True:
                item = await responses.get()
                if item is _END:
                    break
                if isinstance(item, BaseException):
                    if isinstance(item, asyncio.CancelledError):
                        raise item
                    raise triton_error(item, self.model_name) from item
                result, error = item
                if error is not None:
                    # An error ends the ensemble's request (it is its final response): cancelling it now
                    # would be the cancel-after-finish below that holds tritonserver's shutdown.
                    finished = True
                    raise triton_error(error, self.model_name)
                step = decode_response(result)
                if step.finish_reason is not None:
                    finished = True
                yield step
                if finished:
                    break
        finally:
            done.set()  # ends the request side, so a finished stream closes by itself
            # an ensemble passes the request id on to ernie_moe, which then takes `abort-id` for it
            aborts_locally = self.engines is not None and self._spec is not None and self._spec.ensemble
            if finished or _holds_final(responses):
                # Not cancelled: in tritonserver 2.51 a cancel that reaches a finished request leaves the
                # ensemble referenced ("1 live model") and holds shutdown for the whole exit timeout.
                task = asyncio.ensure_future(_close_when_done(call, reader=reader))
                self._closing.add(task)
                task.add_done_callback(self._closing.discard)
            elif aborts_locally and self.engines.abort(request_id):
                # The engine aborts the request (its KV blocks are freed) and ends it with its final response; the
                # stream then closes as a finished one does. No gRPC cancellation (the module docstring says why).
                self.abandoned["aborted"] += 1
                task = asyncio.ensure_future(_close_when_done(
                    call, ABANDON_TIMEOUT, reader=reader, nudge=lambda: self.engines.abort(request_id),
                    on_cancel=self._cancelled_after_abort))
                self._closing.add(task)
                task.add_done_callback(self._closing.discard)
            else:
                # The gRPC cancel reaches Triton, which cancels the request in the engine (its KV blocks
                # are freed), and ends the reader's pending read.
                self.abandoned["cancelled"] += 1
                if aborts_locally:
                    log.warning("no local engine took the abort of an abandoned stream; cancelled over gRPC")
                call.cancel()

    def _cancelled_after_abort(self) -> None:
        self.abandoned["cancelled_after_abort"] += 1
        log.warning("an abandoned stream did not end within %.0fs of its engine abort; cancelled over gRPC",
                    ABANDON_TIMEOUT)


_END = object()  # the stream's end, in a reader's queue


def _holds_final(responses: asyncio.Queue) -> bool:
    """Whether the reader already received the request's final response (its consumer left before seeing it)."""
    while not responses.empty():
        item = responses.get_nowait()
        if item is _END:
            return True
        if isinstance(item, tuple):
            result, error = item
            if error is not None or ResponseTensors(result).text("finish_reason"):
                return True
    return False


async def _read_into(call, responses: asyncio.Queue) -> bool:
    """Read a stream into `responses`: each (result, error), then _END or the exception that ended it.
    True when the stream ended by itself."""
    try:
        while True:
            responses.put_nowait(await call.__anext__())
    except StopAsyncIteration:
        responses.put_nowait(_END)
        return True
    except asyncio.CancelledError as e:  # grpc.aio's way of ending a read of a cancelled call
        responses.put_nowait(e)
        raise
    except Exception as e:  # noqa: BLE001 - handed to the consumer
        responses.put_nowait(e)
        return False


async def _close_when_done(call, timeout: float = 10.0, reader: asyncio.Future | None = None,
                           nudge: Callable[[], object] | None = None,
                           on_cancel: Callable[[], None] | None = None) -> None:
    """Read a finished (or engine-aborted) stream to its end (Triton closes it once the request side has ended).

    `reader`: the stream's reader task, else one is started. It is never cancelled, for the same reason as
    generate's: a stream that does not end in time, or a close() of the backend, cancels the call, which ends it.
    `nudge`: called at growing intervals while the stream is open (the engine abort, sent again); `on_cancel`: called
    when the stream did not end within `timeout` and was cancelled."""
    if reader is None:
        reader = asyncio.ensure_future(_read_into(call, asyncio.Queue()))
    deadline = time.monotonic() + timeout
    # without a nudge, one wait for the whole timeout; with one, waits growing from ABORT_RESEND_FIRST, a nudge after each
    pause = timeout if nudge is None else ABORT_RESEND_FIRST
    try:
        while not reader.done() and time.monotonic() < deadline:
            await asyncio.wait((reader,), timeout=min(pause, max(deadline - time.monotonic(), 0)))
            if nudge is not None and not reader.done() and time.monotonic() < deadline:
                nudge()
            pause = min(pause * 2, ABORT_RESEND_MAX)
    finally:
        if not reader.done() or reader.cancelled() or not reader.result():
            timed_out = not reader.done() and time.monotonic() >= deadline
            call.cancel()  # a timeout, a broken stream or shutdown: cancel it after all
            if timed_out and on_cancel is not None:
                on_cancel()


def _check_fits(name: str, values: list, dtype) -> None:
    """Refuse (400) an integer the ensemble's tensor type cannot hold, instead of letting numpy wrap it
    (top_k 3000000000 would reach Triton as -1294967296) or overflow."""
    if not np.issubdtype(dtype, np.integer):
        return
    info = np.iinfo(dtype)
    for v in values:
        if not info.min <= v <= info.max:
            param = _PARAM_NAMES.get(name, name)
            raise OpenAIError(400, f"{param} must be in [{info.min}, {info.max}] (the Triton model's "
                              f"{np.dtype(dtype).name} input {name!r}), got {v}", param)


def _triton_dtype(arr: np.ndarray) -> str:
    from tritonclient.utils import np_to_triton_dtype

    return np_to_triton_dtype(arr.dtype)


def _grpc_aio_client(url: str):
    import tritonclient.grpc.aio as grpcclient

    return grpcclient.InferenceServerClient(url)
