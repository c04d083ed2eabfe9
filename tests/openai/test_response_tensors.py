"""ResponseTensors reads a gRPC result's outputs from its protobuf once; the values equal tritonclient's as_numpy."""
from __future__ import annotations

import json

import numpy as np
import pytest
from tritonclient.grpc import InferResult, service_pb2
from tritonclient.utils import serialize_byte_tensor

from ernie_client.openai.triton import decode_response
from ernie_client.triton_client import ResponseTensors, parse_result


def _result(outputs: dict[str, np.ndarray]) -> InferResult:
    response = service_pb2.ModelInferResponse(model_name="ernie", id="x")
    for name, arr in outputs.items():
        out = response.outputs.add(name=name, shape=list(arr.shape))
        if arr.dtype == np.object_:
            out.datatype = "BYTES"
            response.raw_output_contents.append(serialize_byte_tensor(arr).item() if arr.size else b"")
        else:
            out.datatype = {np.dtype(np.int32): "INT32", np.dtype(np.int64): "INT64",
                            np.dtype(np.float32): "FP32"}[arr.dtype]
            response.raw_output_contents.append(arr.tobytes())
    return InferResult(response)


def _s(*values: str) -> np.ndarray:
    return np.array([[v.encode("utf-8") for v in values]], dtype=np.object_)


OUTPUTS = {
    "text_output": _s("h\u00e9llo \u4e16"),
    "reasoning_content": _s(""),
    "tool_calls": _s(json.dumps([{"index": 0, "function": {"name": "f", "arguments": "{}"}}])),
    "finish_reason": _s("stop"),
    "num_input_tokens": np.array([[7]], np.int32),
    "num_output_tokens": np.array([[3]], np.int32),
    "num_cached_tokens": np.array([[0]], np.int32),
    "num_reasoning_tokens": np.array([[0]], np.int32),
    "output_ids": np.array([[5, 6, 7]], np.int32),
    "prompt_token_ids": np.zeros((1, 0), np.int32),
    "logprobs": _s(""),
    "prompt_logprobs": _s(""),
    "several": _s("a", "", "bc"),
    "wide": np.array([[2**40, -1]], np.int64),
    "floats": np.array([[0.5, -2.0]], np.float32),
}


@pytest.mark.parametrize("name", sorted(OUTPUTS) + ["missing"])
def test_every_output_reads_as_tritonclient_reads_it(name):
    result = _result(OUTPUTS)
    fast = ResponseTensors(result)
    expected = result.as_numpy(name)
    got = fast.array(name)
    if expected is None:
        assert got is None and fast.text(name) == "" and fast.ints(name) is None
        return
    assert got.shape == expected.shape and got.dtype == expected.dtype and got.tolist() == expected.tolist()
    joined = "".join(x.decode("utf-8", "replace") if isinstance(x, bytes) else str(x) for x in expected.reshape(-1))
    assert fast.text(name) == joined


def test_a_result_without_raw_contents_goes_through_as_numpy():
    class HttpLike:  # tritonclient.http's InferResult: get_response() is a JSON dict
        def get_response(self):
            return {"outputs": []}

        def as_numpy(self, name):
            return np.array([b"hi"], dtype=np.object_) if name == "text_output" else None

    r = ResponseTensors(HttpLike())
    assert r.text("text_output") == "hi" and r.ints("output_ids") is None


def test_the_shim_and_the_client_helpers_decode_a_response():
    result = _result(OUTPUTS)
    step = decode_response(result)
    assert (step.text, step.finish_reason, step.token_ids, step.num_input_tokens) == ("h\u00e9llo \u4e16", "stop",
                                                                                       [5, 6, 7], 7)
    assert step.tool_calls[0]["function"]["name"] == "f" and step.prompt_token_ids is None
    delta = parse_result(result, final=True)
    assert delta.text == "h\u00e9llo \u4e16" and delta.output_ids == [5, 6, 7] and delta.num_output_tokens == 3
