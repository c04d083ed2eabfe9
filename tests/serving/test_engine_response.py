"""The ernie_moe -> detokenizer contract (serving/engine_response.py): three tensors, typed both ways."""
from __future__ import annotations

import numpy as np
import pytest

from ernie_serve.serving.engine_response import HEADER_SIZE, EngineResponse, Failure, RequestMeta
from ernie_serve.serving.errors import InvalidInput


def test_a_plain_step_is_three_numeric_tensors_with_no_extras():
    t = EngineResponse(2**62 + 5, 3, [7, 8], 10, 5, 2).to_tensors()
    assert set(t) == {"engine_header", "token_ids", "engine_extras"}
    assert t["engine_header"].dtype == np.int64 and t["engine_header"].shape == (1, HEADER_SIZE)
    assert t["token_ids"].dtype == np.int32 and t["token_ids"].tolist() == [[7, 8]]
    assert t["engine_extras"].dtype == np.uint8 and t["engine_extras"].shape == (1, 0)
    back = EngineResponse.from_tensors(t)
    assert (back.stream_id, back.index, back.token_ids, back.final, back.meta) == (2**62 + 5, 3, [7, 8], False, None)


def test_first_and_final_responses_round_trip_every_field():
    meta = RequestMeta(stream=True, reasoning_parser="ernie-x1", tools=[{"type": "function"}], max_tokens=9,
                       key="req-1", abort_address="@a", decode_ids=True, echo="你好")
    first = EngineResponse(1, 0, [], 4, 0, 1, meta=meta, prompt_ids=[1, 2, 3, 4],
                           prompt_logprobs=[{"token_id": 1, "logprob": None}], logprobs=[])
    back = EngineResponse.from_tensors(first.to_tensors())
    assert back.meta == meta and back.prompt_ids == [1, 2, 3, 4] and back.logprobs == []
    assert back.prompt_logprobs == [{"token_id": 1, "logprob": None}]
    last = EngineResponse(1, 4, [9], 4, 6, 1, final=True, finish_reason="length", text="stop here")
    back = EngineResponse.from_tensors(last.to_tensors())
    assert back.final and back.finish_reason == "length" and back.failure is None and back.text == "stop here"
    failed = EngineResponse(1, 5, [], 4, 6, 1, final=True, failure=Failure("UNAVAILABLE", "shut: down"))
    back = EngineResponse.from_tensors(failed.to_tensors())
    assert back.failure == Failure("UNAVAILABLE", "shut: down") and back.finish_reason is None


@pytest.mark.parametrize("inputs,field", [
    ({}, "engine_header"),
    ({"engine_header": np.zeros((1, 3), np.int64)}, "engine_header"),
    ({"engine_header": np.zeros((1, HEADER_SIZE), np.int64),
      "engine_extras": np.frombuffer(b"{not json", np.uint8).reshape(1, -1)}, "engine_extras"),
    ({"engine_header": np.zeros((1, HEADER_SIZE), np.int64),
      "engine_extras": np.frombuffer(b"[1]", np.uint8).reshape(1, -1)}, "engine_extras"),
])
def test_a_malformed_response_is_refused_naming_the_tensor(inputs, field):
    with pytest.raises(InvalidInput, match=field):
        EngineResponse.from_tensors(inputs)


def test_request_meta_refuses_a_field_it_does_not_know():
    assert RequestMeta.from_dict(None) == RequestMeta()
    with pytest.raises(InvalidInput, match="unknown field.*'colour'"):
        RequestMeta.from_dict({"max_tokens": 3, "colour": "red"})
    with pytest.raises(InvalidInput, match="meta must be an object"):
        RequestMeta.from_dict([1])
