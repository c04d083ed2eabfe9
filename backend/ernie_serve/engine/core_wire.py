"""The engine core's messages on the wire (core_process.py <-> core_client.py).

Nearly every output of a step is plain: a streaming (delta) request's new token ids, nothing else. Those travel
as columns: the request ids, and the counts and ids as int64 arrays; whatever else a step has (a final output,
logprobs, text, an error) travels as plain tuples. Pickling the RequestOutput objects themselves takes every
slotted dataclass apart through pickle's generic reduce path: at 256 outputs a step that cost the core more host
time than the step's own scheduling (`scripts/bench_core_wire.py` prints the ways side by side). The prompt ids
are left out: the front holds each request's. Within a step the outputs come back plain ones first (a step has
one output per request, so no request's order changes). tests/engine/test_core_wire.py round-trips every field
(a field added to outputs.py and not here fails it). Both ends are this package, started by the same user over a
private socket: pickle is safe here.
"""
from __future__ import annotations

import pickle
from typing import Any

import numpy as np

from ..outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput


def encode(message: tuple) -> bytes:
    return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)


def encode_step(outputs: list[RequestOutput], stats: dict) -> bytes:
    """("step", outputs, stats): the one message a step, the hot one."""
    ids, cached, counts, tokens, other = [], [], [], [], []
    for o in outputs:
        if _is_plain(o):
            delta = o.outputs[0].token_ids_delta
            ids.append(o.request_id)
            cached.append(o.num_cached_tokens)
            counts.append(len(delta))
            tokens += delta
        else:
            other.append(o)
    columns = (ids, _int64(cached), _int64(counts), _int64(tokens))
    return encode(("step", columns, pack_outputs(other), stats))


def decode(frame: bytes) -> tuple:
    """The message; a step's outputs as RequestOutputs again."""
    message = pickle.loads(frame)
    if message[0] != "step":
        return message
    _, (ids, cached, counts, tokens), other, stats = message
    outputs, start = [], 0
    tokens = np.frombuffer(tokens, np.int64).tolist()
    for rid, num_cached, n in zip(ids, np.frombuffer(cached, np.int64).tolist(),
                                  np.frombuffer(counts, np.int64).tolist()):
        delta = tokens[start:start + n]
        start += n
        outputs.append(RequestOutput(rid, None, [], [CompletionOutput(0, "", delta, token_ids_delta=delta)], False,
                                     num_cached))
    return "step", outputs + unpack_outputs(other), stats


def _int64(values: list) -> bytes:
    return np.asarray(values, dtype=np.int64).tobytes()


def _is_plain(o: RequestOutput) -> bool:
    """A delta output that carries new token ids and nothing else (output_processor's per-step DELTA output)."""
    if o.finished or o.error is not None or o.metrics is not None or o.prompt_logprobs is not None \
            or o.prompt is not None or len(o.outputs) != 1:
        return False
    c = o.outputs[0]
    return (c.index == 0 and c.token_ids is c.token_ids_delta and not c.text and not c.text_delta
            and c.finish_reason is None and c.stop_reason is None and c.logprobs is None
            and c.cumulative_logprob is None and c.reasoning_content is None and c.tool_calls is None
            and c.num_reasoning_tokens == 0)


def pack_outputs(outputs: list[RequestOutput]) -> list[tuple]:
    return [(o.request_id, o.prompt, o.finished, o.num_cached_tokens, o.error,
             None if o.metrics is None else _pack_metrics(o.metrics),
             None if o.prompt_logprobs is None else [_pack_logprobs(d) for d in o.prompt_logprobs],
             [_pack_completion(c) for c in o.outputs]) for o in outputs]


def unpack_outputs(packed: list[tuple]) -> list[RequestOutput]:
    """RequestOutputs with empty prompt_token_ids (the front puts the request's own back)."""
    out = []
    for request_id, prompt, finished, cached, error, metrics, prompt_logprobs, completions in packed:
        out.append(RequestOutput(request_id, prompt, [], [_unpack_completion(c) for c in completions], finished,
                                 cached, None if metrics is None else RequestMetrics(*metrics), error,
                                 None if prompt_logprobs is None else [_unpack_logprobs(d) for d in prompt_logprobs]))
    return out


def _pack_metrics(m: RequestMetrics) -> tuple:
    return (m.arrival_time, m.first_scheduled_time, m.first_token_time, m.finished_time, m.num_preemptions)


def _pack_completion(c: CompletionOutput) -> tuple:
    return (c.index, c.text, c.token_ids, c.finish_reason, c.stop_reason,
            None if c.logprobs is None else [_pack_logprobs(d) for d in c.logprobs], c.cumulative_logprob,
            c.text_delta, c.token_ids_delta, c.reasoning_content, c.tool_calls, c.num_reasoning_tokens)


def _unpack_completion(t: tuple) -> CompletionOutput:
    (index, text, token_ids, finish_reason, stop_reason, logprobs, cumulative, text_delta, ids_delta, reasoning,
     tool_calls, num_reasoning) = t
    return CompletionOutput(index, text, token_ids, finish_reason, stop_reason,
                            None if logprobs is None else [_unpack_logprobs(d) for d in logprobs], cumulative,
                            text_delta, ids_delta, reasoning, tool_calls, num_reasoning)


def _pack_logprobs(d: dict[int, Logprob] | None) -> dict[int, tuple] | None:
    return None if d is None else {t: (lp.logprob, lp.rank, lp.decoded_token) for t, lp in d.items()}


def _unpack_logprobs(d: dict[int, Any] | None) -> dict[int, Logprob] | None:
    return None if d is None else {t: Logprob(*v) for t, v in d.items()}
