"""The issue-16 probe's bad-input classes against the real stack (tritonserver + ensemble + OpenAI shim):
each is refused at the door with 400 / INVALID_ARG naming the field, and a good request succeeds after it
(before the fix, several of these failed inside the engine's step and left it dead for good)."""
from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from ernie_client.triton_client import generate

pytestmark = pytest.mark.e2e
CHAT = [{"role": "user", "content": "hi"}]


def post(url: str, body: dict | bytes) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def assert_engine_alive(served) -> None:
    status, body = post(f"http://{served.http_url}/v2/models/ernie/generate",
                        {"text_input": "hi", "max_tokens": 2, "temperature": 0,
                         "sampling_parameters": json.dumps({"ignore_eos": True})})
    assert status == 200 and body["num_output_tokens"] == 2, body


# ------------------------------------------------------------------ Triton HTTP /generate: values our code sees
HTTP_BAD = [
    ({"sampling_parameters": '{"repetition_penalty": NaN}'}, "repetition_penalty", "finite"),
    ({"sampling_parameters": '{"top_k": 100000000000000000000}'}, "top_k", "2147483647"),
    ({"sampling_parameters": '{"stop_token_ids": [100000000000000000000000000000]}'}, "stop_token_ids", "2147483647"),
    ({"sampling_parameters": '{"temperature": "hot"}'}, "temperature", "finite number"),
    # Triton's JSON parser narrows an INT32 tensor itself (4294967297 arrives as 1); inside
    # sampling_parameters the value reaches our check whole
    ({"sampling_parameters": '{"max_tokens": 4294967297}'}, "max_tokens", "2147483647"),
    ({"sampling_parameters": '{"top_k": %s}' % ("9" * 5000)}, "sampling_parameters", "not valid JSON"),
    ({"max_tokens": 2147483648}, "max_tokens", "[1, 2147483647]"),  # arrives wrapped: -2147483648
    ({"top_k": 3000000000}, "top_k", "[0, 2147483647]"),            # arrives wrapped: -1294967296
    ({"messages": '[{"role": "user", "content": "a\\ud800"}]', "text_input": None}, "messages", "surrogate"),
]


@pytest.mark.parametrize("fields,field,why", HTTP_BAD, ids=[f"{f}-{w}" for _, f, w in HTTP_BAD])
def test_http_generate_bad_values_are_400_naming_the_field(served, fields, field, why):
    body = {k: v for k, v in {"text_input": "hi", **fields}.items() if v is not None}
    status, err = post(f"http://{served.http_url}/v2/models/ernie/generate", body)
    assert status == 400, err
    assert field in err["error"] and why in err["error"], err
    assert_engine_alive(served)


def test_http_generate_nan_literal_in_a_float_tensor_is_400(served):
    # Triton's JSON parser accepts the NaN literal for an FP32 input; before, it sampled from NaNs (HTTP 200).
    status, err = post(f"http://{served.http_url}/v2/models/ernie/generate",
                       b'{"text_input": "hi", "max_tokens": 4, "temperature": NaN}')
    assert status == 400 and "temperature" in err["error"], err
    assert_engine_alive(served)


# ------------------------------------------------------------------ gRPC
@pytest.mark.parametrize("sampling,field", [({"top_k": 10**20}, "top_k"),
                                            ({"repetition_penalty": float("nan")}, "repetition_penalty"),
                                            ({"stop_token_ids": [10**29]}, "stop_token_ids")])
def test_grpc_bad_sampling_parameters_are_invalid_argument(served, sampling, field):
    with pytest.raises(Exception) as info:
        generate(served.grpc_url, text="hi", max_tokens=4, sampling_parameters=sampling)
    assert field in str(info.value) and "must be" in str(info.value), info.value
    assert generate(served.grpc_url, text="hi", max_tokens=2, temperature=0,
                    sampling_parameters={"ignore_eos": True}).num_output_tokens == 2


# ------------------------------------------------------------------ the OpenAI shim
SHIM_BAD = [
    ({"max_tokens": 4294967297}, "max_tokens"),  # was 200 with one token (wrapped to 1)
    ({"max_tokens": 2147483648}, "max_tokens"),
    ({"top_k": 3000000000}, "top_k"),
    ({"top_k": 10**29}, "top_k"),                # was 500 (OverflowError)
    ({"stop_token_ids": [10**29]}, "stop_token_ids[0]"),  # killed the engine
    ({"repetition_penalty": 10**29}, "repetition_penalty"),  # killed the engine
    ({"min_tokens": 10**29}, "min_tokens"),
]


@pytest.mark.parametrize("fields,param", SHIM_BAD, ids=[f"{p}={next(iter(f.values()))}"[:32] for f, p in SHIM_BAD])
def test_shim_out_of_range_values_are_400_naming_the_field(served, openai_url, fields, param):
    status, err = post(f"{openai_url}/v1/chat/completions", {"messages": CHAT, **fields})
    assert status == 400 and err["error"]["param"] == param, err
    assert_engine_alive(served)


@pytest.mark.parametrize("path,raw,param", [
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "a\\ud800"}], "max_tokens": 2}',
     "messages[0].content"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "stop": ["\\udc00"]}', "stop[0]"),
    ("/v1/completions", b'{"prompt": "a\\ud800", "max_tokens": 2}', "prompt"),
], ids=["content", "stop", "completions-prompt"])
def test_shim_lone_surrogates_are_400_not_500(served, openai_url, path, raw, param):
    status, err = post(openai_url + path, raw)
    assert status == 400 and err["error"]["param"] == param and "surrogate" in err["error"]["message"], err
    status, body = post(f"{openai_url}/v1/chat/completions", {"messages": CHAT, "max_tokens": 2, "temperature": 0})
    assert status == 200, body


# ------------------------------------------------------------------ what Triton's own parser refuses
TRITON_PARSER = [
    (b'{"text_input": "hi", ', "malformed JSON"),
    (b'[1, 2]', "body not an object"),
    (b'{"text_input": "hi", "max_tokens": "abc"}', "string for INT32"),
    (b'{"text_input": "hi", "max_tokens": 2.5}', "fraction for INT32"),
    (b'{"text_input": "hi", "max_tokens": 100000000000000000000000000000}', "past int64"),
    (b'{"messages": [{"role": "user", "content": "hi"}]}', "array for a JSON-string input"),
    (b'{"text_input": 5}', "number for STRING"),
    (b'{"text_input": "hi", "seed": -1}', "negative UINT64"),
    (b'{"text_input": "hi", "stream": "yes"}', "string for BOOL"),
    (b'{"text_input": "a\\ud800"}', "lone surrogate escape"),
]


@pytest.mark.parametrize("raw,case", TRITON_PARSER, ids=[c for _, c in TRITON_PARSER])
def test_triton_json_parser_refuses_these_before_the_ensemble_runs(served, raw, case):
    """tritonserver 2.51 answers these itself, with HTTP 500 and its own message (docs/reliability.md,
    "Bad input"); nothing reaches the models, so the engine cannot be hurt."""
    status, err = post(f"http://{served.http_url}/v2/models/ernie/generate", raw)
    assert status in (400, 500) and err["error"] and "in ensemble" not in err["error"], (case, err)
    assert_engine_alive(served)
