"""A stand-in for tritonclient.grpc.aio.InferenceServerClient, for unit tests of the shim's own logic.

It decodes the tensors the shim really builds and answers with a scripted word generator, so the
tests check the mapping, streaming, accumulation and error paths without a tritonserver. The
acceptance tests (test_openai_e2e.py) run against a real one.
"""
from __future__ import annotations

import asyncio
import json

import numpy as np
from tritonclient.utils import InferenceServerException, deserialize_bytes_tensor, triton_to_np_dtype

_IN = [("text_input", "TYPE_STRING", [1]), ("input_token_ids", "TYPE_INT32", [-1]), ("max_tokens", "TYPE_INT32", [1]),
       ("stream", "TYPE_BOOL", [1]),
       ("temperature", "TYPE_FP32", [1]), ("top_p", "TYPE_FP32", [1]), ("top_k", "TYPE_INT32", [1]),
       ("seed", "TYPE_UINT64", [1]), ("stop_words", "TYPE_STRING", [-1]), ("bad_words", "TYPE_STRING", [-1]),
       ("exclude_input_in_output", "TYPE_BOOL", [1]), ("return_num_input_tokens", "TYPE_BOOL", [1]),
       ("return_num_output_tokens", "TYPE_BOOL", [1]), ("sampling_parameters", "TYPE_STRING", [1]),
       ("messages", "TYPE_STRING", [1]), ("tools", "TYPE_STRING", [1]), ("chat_template_kwargs", "TYPE_STRING", [1]),
       ("skip_parsers", "TYPE_BOOL", [1])]


def ensemble_config(max_batch_size: int = 0, drop: tuple[str, ...] = (), outputs: tuple[str, ...] = (),
                    dtypes: dict[str, str] | None = None) -> dict:
    """The ensemble config as get_model_config(as_json=True) returns it; no `outputs`: none declared;
    `dtypes` overrides inputs' data types (an ensemble with narrower tensors)."""
    dtypes = dtypes or {}
    return {"config": {"name": "ernie", "max_batch_size": max_batch_size,
                       "input": [{"name": n, "data_type": dtypes.get(n, t), "dims": [str(d) for d in dims]}
                                 for n, t, dims in _IN if n not in drop],
                       "output": [{"name": n, "data_type": "TYPE_STRING", "dims": ["1"]} for n in outputs]}}


class FakeResult:
    def __init__(self, outputs: dict[str, np.ndarray]):
        self.outputs = outputs

    def as_numpy(self, name):
        return self.outputs.get(name)


def _decode(inp) -> np.ndarray:
    raw = inp._get_content()
    if inp.datatype() == "BYTES":
        arr = deserialize_bytes_tensor(raw)
    else:
        arr = np.frombuffer(raw, dtype=triton_to_np_dtype(inp.datatype()))
    return arr.reshape(inp.shape())


def _str(a: np.ndarray) -> str:
    return a.reshape(-1)[0].decode()


def _out(**kw) -> FakeResult:
    outs = {}
    for k, v in kw.items():
        if isinstance(v, str):
            outs[k] = np.array([v.encode()], dtype=np.object_)
        elif isinstance(v, list):
            outs[k] = np.array(v, dtype=np.int32)
        else:
            outs[k] = np.array([v], dtype=np.int32)
    return FakeResult(outs)


class FakeCall:
    def __init__(self, client: "FakeTritonClient", inputs_iterator):
        self.client = client
        self.requests = inputs_iterator
        self.cancelled = False
        self._steps = None
        self._done = False

    def _finish(self) -> None:
        if self._steps is not None and not self._done:
            self._done = True
            self.client.running -= 1

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.cancelled:
            raise asyncio.CancelledError()
        if self._steps is None:
            req = await self.requests.__anext__()
            tensors = {i.name(): _decode(i) for i in req["inputs"]}
            self.client.requests.append(tensors)
            self._steps = self.client.script(tensors)
            self.client.running += 1
            self.client.max_running = max(self.client.max_running, self.client.running)
        try:
            item = next(self._steps)
        except StopIteration:
            self._finish()
            raise StopAsyncIteration from None
        await asyncio.sleep(self.client.step_delay)
        if isinstance(item, Exception):
            self._finish()
            self._steps = iter(())
            return None, item
        if item.as_numpy("finish_reason") is not None:
            self._finish()
        return item, None

    def cancel(self):
        if self._steps is not None and not self._done:
            self.client.cancelled += 1  # cancelled while the "engine" still held the request
        elif self._done:
            # tritonserver 2.51 keeps the ensemble "live" after a cancel of an ended request (triton.py)
            self.client.cancelled_after_final += 1
        self._finish()
        self.cancelled = True
        return True


class FakeTritonClient:
    def __init__(self, config: dict | None = None, available: bool = True, step_delay: float = 0.0,
                 num_reasoning_tokens: int | None = None):
        self.config = config or ensemble_config()
        self.num_reasoning_tokens = num_reasoning_tokens  # sent as that output when set
        self.available = available
        self.step_delay = step_delay
        self.requests: list[dict[str, np.ndarray]] = []
        self.cancelled = 0
        self.cancelled_after_final = 0
        self.running = 0
        self.max_running = 0  # the most requests running at once
        self.seen_prompts: set[str] = set()

    def _check(self):
        if not self.available:
            raise InferenceServerException("failed to connect to all addresses", status="StatusCode.UNAVAILABLE")

    async def is_server_ready(self, client_timeout=None):
        self._check()
        return True

    async def is_model_ready(self, name, client_timeout=None):
        self._check()
        return True

    async def get_model_config(self, name, as_json=False, client_timeout=None):
        self._check()
        return self.config

    def stream_infer(self, inputs_iterator, stream_timeout=None):
        self._check()
        return FakeCall(self, inputs_iterator)

    async def close(self):
        pass

    # ---------------------------------------------------------------- the scripted model
    def script(self, t: dict[str, np.ndarray]):
        """Word i is `w<(seed + 7 i) % 50>` (seed 0 by default): greedy-like and seed-reproducible."""
        sp = json.loads(_str(t["sampling_parameters"])) if "sampling_parameters" in t else {}
        if "messages" in t:
            messages = json.loads(_str(t["messages"]))
            prompt = " ".join(str(m.get("content") or "") for m in messages)
        elif "input_token_ids" in t:
            prompt = " ".join(f"t{i}" for i in t["input_token_ids"].reshape(-1))
        else:
            prompt = _str(t["text_input"])
        max_tokens = int(t["max_tokens"].reshape(-1)[0]) if "max_tokens" in t else sp.get("max_tokens", 16) or 40
        seed = int(t["seed"].reshape(-1)[0]) if "seed" in t else 0
        stops = [s.decode() for s in t["stop_words"].reshape(-1)] if "stop_words" in t else []
        tools = json.loads(_str(t["tools"])) if "tools" in t else None
        n_in = len(prompt.split())
        cached = 8 if prompt in self.seen_prompts else 0
        self.seen_prompts.add(prompt)
        counts = dict(num_input_tokens=n_in, num_cached_tokens=cached)
        if self.num_reasoning_tokens is not None:
            counts["num_reasoning_tokens"] = self.num_reasoning_tokens
        raw = "skip_parsers" in t and bool(t["skip_parsers"].reshape(-1)[0])
        if "invalid" in prompt:
            yield InferenceServerException("max_tokens must be an integer >= 1, got 0")
            return
        if "overloaded" in prompt:  # what ernie_moe answers past --max-waiting-requests, through the ensemble
            yield InferenceServerException("in ensemble 'ernie', overloaded: 2 requests already waiting "
                                           "(max_waiting_requests=2)")
            return
        first = {"prompt_token_ids": list(range(1, n_in + 1))}  # the ensemble sends the prompt once
        if sp.get("prompt_logprobs") is not None:  # prompt token j is " p<j>", at -0.25, ranked 2nd after " y"
            k = sp["prompt_logprobs"]
            first["prompt_logprobs"] = json.dumps(
                [{"token_id": 1, "token": " p1", "logprob": None, "rank": None, "top_logprobs": []}]
                + [{"token_id": j, "token": f" p{j}", "logprob": -0.25, "rank": 2,
                    "top_logprobs": [{"token_id": 77, "token": " y", "logprob": -0.1},
                                     {"token_id": j, "token": f" p{j}", "logprob": -0.25}][:k]}
                   for j in range(2, n_in + 1)])
        if "think" in prompt:
            step = dict(text_output="let me think</think>") if raw else dict(text_output="",
                                                                             reasoning_content="let me think")
            yield _out(**step, output_ids=[900, 901], num_output_tokens=2, **counts, **first)
            first = {}
        if tools and "weather" in prompt:
            yield _out(text_output="", tool_calls=json.dumps([{"index": 0, "id": "chatcmpl-tool-1", "type": "function",
                                                                "function": {"name": "get_weather"}}]),
                       output_ids=[910], num_output_tokens=1, **counts)
            yield _out(text_output="", tool_calls=json.dumps([{"index": 0, "function": {"arguments": '{"city": '}}]),
                       output_ids=[911], num_output_tokens=2, **counts)
            yield _out(text_output="", tool_calls=json.dumps([{"index": 0, "function": {"arguments": '"Paris"}'}}]),
                       output_ids=[912], num_output_tokens=3, finish_reason="stop", **counts)
            return
        text = ""
        base = 2 if "think" in prompt else 0
        for i in range(max_tokens - base):
            tid = (seed + 7 * i) % 50
            piece = f" w{tid}"
            text += piece
            stop = next((s for s in stops if s in text), None)
            if stop:
                yield _out(text_output="", output_ids=[tid], num_output_tokens=base + i + 1, finish_reason="stop",
                           **counts)
                return
            extra = {}
            if sp.get("logprobs") is not None:
                extra["logprobs"] = json.dumps([{"token_id": tid, "token": piece, "logprob": -0.5,
                                                 "top_logprobs": [{"token_id": tid, "token": piece, "logprob": -0.5},
                                                                  {"token_id": 99, "token": " x", "logprob": -1.5}]
                                                 [:max(sp["logprobs"], 0)]}])
            last = i == max_tokens - base - 1
            yield _out(text_output=piece, output_ids=[tid], num_output_tokens=base + i + 1,
                       **({"finish_reason": "length"} if last else {}), **counts, **extra, **first)
            first = {}
