"""Bad input at the door, without a server: SamplingParams and the ensemble's request parsing refuse every
value that used to reach the engine and fail there (issue 16: NaN penalties, 10**20 top_k, int32
wrap-around, lone surrogates), with a message naming the field and its limit."""
from __future__ import annotations

import json

import numpy as np
import pytest

from ernie_serve import SamplingParams
from ernie_serve.serving.errors import InvalidInput
from ernie_serve.serving.request import parse_request

NAN, INF = float("nan"), float("inf")


def s(value: str) -> np.ndarray:
    return np.array([[value.encode("utf-8", "surrogatepass")]], dtype=np.object_)


def i32(value: int) -> np.ndarray:
    return np.array([[value]], dtype=np.int32)


def f32(value: float) -> np.ndarray:
    return np.array([[value]], dtype=np.float32)


# ------------------------------------------------------------------ SamplingParams
NOT_FINITE = [("temperature", NAN), ("temperature", INF), ("temperature", 1e39),  # 1e39: inf in float32
              ("repetition_penalty", NAN), ("repetition_penalty", INF), ("repetition_penalty", 1e29),
              ("repetition_penalty", 1e-30), ("top_p", NAN), ("min_p", NAN), ("presence_penalty", -INF),
              ("frequency_penalty", NAN)]


@pytest.mark.parametrize("name,value", NOT_FINITE, ids=[f"{n}={v}" for n, v in NOT_FINITE])
def test_nan_infinite_and_float32_overflowing_floats_are_refused(name, value):
    with pytest.raises(ValueError, match=rf"^{name} must be a finite number in [\[(]"):
        SamplingParams(**{name: value})


OUT_OF_RANGE_INTS = [("max_tokens", 2**31, r"\[1, 2147483647\]"), ("max_tokens", 4294967297, r"\[1, 2147483647\]"),
                     ("top_k", 3_000_000_000, r"\[0, 2147483647\]"), ("top_k", 10**20, r"\[0, 2147483647\]"),
                     ("min_tokens", 10**29, r"\[0, 2147483647\]"), ("n", 2**31, r"\[1, 2147483647\]"),
                     ("seed", -1, r"\[0, 18446744073709551615\]"), ("seed", 2**64, r"\[0, 18446744073709551615\]"),
                     ("logprobs", 21, r"\[0, 20\]")]


@pytest.mark.parametrize("name,value,limit", OUT_OF_RANGE_INTS, ids=[f"{n}={v}" for n, v, _ in OUT_OF_RANGE_INTS])
def test_integers_beyond_what_their_tensors_hold_are_refused_with_the_limit(name, value, limit):
    with pytest.raises(ValueError, match=rf"^{name} must be an integer in {limit}"):
        SamplingParams(**{name: value})


@pytest.mark.parametrize("ids,index", [([10**29], 0), ([1, 2, -1], 2), ([3, 2**31], 1), ([1, True], 1),
                                       ([1.5], 0), (["7"], 0)])
def test_each_stop_token_id_is_an_int32_token_id(ids, index):
    with pytest.raises(ValueError, match=rf"^stop_token_ids\[{index}\] must be an integer in \[0, 2147483647\]"):
        SamplingParams(stop_token_ids=ids)


@pytest.mark.parametrize("name,value", [("max_tokens", True), ("top_k", False), ("seed", True), ("logprobs", True),
                                        ("max_tokens", 2.5), ("min_tokens", "3"), ("top_k", "10"), ("seed", 1.5)])
def test_booleans_strings_and_fractions_are_not_integers(name, value):
    with pytest.raises(ValueError, match=rf"^{name} must be an integer"):
        SamplingParams(**{name: value})


@pytest.mark.parametrize("name,value", [("temperature", "hot"), ("top_p", None), ("temperature", True),
                                        ("repetition_penalty", [1.0]), ("temperature", 10**400)])
def test_floats_must_be_numbers(name, value):
    with pytest.raises(ValueError, match=rf"^{name} must be a finite number"):
        SamplingParams(**{name: value})


@pytest.mark.parametrize("name", ["ignore_eos", "include_stop_str_in_output", "skip_special_tokens"])
@pytest.mark.parametrize("value", ["yes", 1, None])
def test_flags_must_be_booleans(name, value):
    with pytest.raises(ValueError, match=rf"^{name} must be true or false"):
        SamplingParams(**{name: value})


@pytest.mark.parametrize("name,value,why", [
    ("stop", 5, "must be a list"), ("stop", ["ok", 3], "item 1"), ("stop", [""], "item 0"),
    ("stop", ["a\ud800"], "lone surrogate"), ("bad_words", "word", "must be a list"),
    ("bad_words", ["\udfff"], "lone surrogate"), ("stop_token_ids", "123", "must be a list"),
    ("stop_token_ids", {"a": 1}, "must be a list"),
])
def test_string_and_id_lists_refuse_other_types_and_lone_surrogates(name, value, why):
    with pytest.raises(ValueError, match=rf"^{name}") as info:
        SamplingParams(**{name: value})
    assert why in str(info.value)


def test_values_are_stored_in_their_canonical_python_types():
    p = SamplingParams(max_tokens=8.0, top_k=np.int32(5), seed=np.uint64(2**64 - 1), temperature=np.float32(0.5),
                       repetition_penalty=2, ignore_eos=np.bool_(True), stop="x", stop_token_ids=(np.int64(3),))
    assert (p.max_tokens, p.top_k, p.seed, p.temperature, p.repetition_penalty) == (8, 5, 2**64 - 1, 0.5, 2.0)
    assert type(p.max_tokens) is int and type(p.top_k) is int and type(p.seed) is int
    assert type(p.temperature) is float and p.ignore_eos is True
    assert p.stop == ["x"] and p.stop_token_ids == [3] and type(p.stop_token_ids[0]) is int
    json.dumps(p.__dict__)  # plain JSON types: the request travels to ernie_moe as JSON


def test_the_limits_themselves_are_accepted():
    p = SamplingParams(max_tokens=2**31 - 1, min_tokens=2**31 - 1, top_k=2**31 - 1, seed=2**64 - 1,
                       stop_token_ids=[0, 2**31 - 1], repetition_penalty=1e6, temperature=3.4e38)
    assert p.top_k == 2**31 - 1 and p.seed == 2**64 - 1
    assert SamplingParams(top_k=-1).top_k == 0 and SamplingParams(max_tokens=None).max_tokens is None


def test_a_huge_integer_gets_a_short_message_not_a_crash():
    # Python refuses to print an int of more than 4300 digits; the message must still be built.
    with pytest.raises(ValueError, match=r"^top_k must be an integer in \[0, 2147483647\].*got an integer of \d+ bits"):
        SamplingParams(top_k=10**5000)


# ------------------------------------------------------------------ the ensemble's request parsing
SAMPLING_JSON = [
    ('{"repetition_penalty": NaN}', "repetition_penalty"),  # killed the engine (issue 16, item 1)
    ('{"temperature": Infinity}', "temperature"),
    ('{"top_k": 100000000000000000000}', "top_k"),           # killed the engine over gRPC
    ('{"stop_token_ids": [1, 100000000000000000000000000000]}', "stop_token_ids"),
    ('{"temperature": "hot"}', "temperature"),              # was "sampling_parameters: '<' not supported ..."
    ('{"ignore_eos": "yes"}', "ignore_eos"),
    ('{"seed": -1}', "seed"),
]


@pytest.mark.parametrize("text,field", SAMPLING_JSON, ids=[t for t, _ in SAMPLING_JSON])
def test_sampling_parameters_errors_name_the_key(text, field):
    with pytest.raises(InvalidInput) as info:
        parse_request({"text_input": s("hi"), "sampling_parameters": s(text)})
    assert info.value.field == field and str(info.value).startswith(field), info.value


@pytest.mark.parametrize("name,tensor,limit", [
    ("max_tokens", i32(-2**31), "[1, 2147483647]"),     # what Triton's HTTP parser makes of 2147483648
    ("top_k", i32(-1294967296), "[0, 2147483647]"),     # ... and of top_k 3000000000
    ("min_tokens", i32(-5), "[0, 2147483647]"),
    ("temperature", f32(NAN), "finite"),                # Triton's HTTP parser reads a NaN literal
    ("repetition_penalty", f32(INF), "finite"),
])
def test_wrapped_or_non_finite_tensors_are_refused_naming_the_field_and_limit(name, tensor, limit):
    with pytest.raises(InvalidInput) as info:
        parse_request({"text_input": s("hi"), name: tensor})
    assert info.value.field == name and limit in str(info.value)


@pytest.mark.parametrize("name", ["messages", "tools", "chat_template_kwargs", "sampling_parameters"])
def test_json_inputs_with_a_lone_surrogate_escape_are_refused(name):
    chat = '[{"role": "user", "content": "hi"}]'
    inputs = {"messages": s(chat)}
    inputs[name] = s({"messages": '[{"role": "user", "content": "a\\ud800"}]',
                      "tools": '[{"type": "function", "function": {"name": "f\\udc00"}}]',
                      "chat_template_kwargs": '{"\\ud800": true}',
                      "sampling_parameters": '{"bad_words": ["\\udfff"]}'}[name])
    with pytest.raises(InvalidInput) as info:
        parse_request(inputs)
    # the whole input is named: an unknown key holding the surrogate could not even be quoted back
    assert info.value.field == name and "surrogate" in str(info.value)


def test_a_json_input_python_cannot_read_is_invalid_input_not_internal():
    with pytest.raises(InvalidInput) as info:  # int() refuses literals past 4300 digits with a ValueError
        parse_request({"text_input": s("hi"), "sampling_parameters": s('{"top_k": %s}' % ("9" * 5000))})
    assert info.value.field == "sampling_parameters"
