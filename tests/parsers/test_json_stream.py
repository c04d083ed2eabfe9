"""JsonStream re-serializes while parsing: its pieces join to json.dumps(json.loads(text))."""
from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ernie_serve.parsers.json_stream import JsonStream, JsonStreamError
from strategies import FORMATS, json_values


def canon(text: str) -> str | None:
    js = JsonStream()
    try:
        for ch in text:
            js.feed(ch)
    except JsonStreamError:
        return None
    return "".join(js.out) if js.done else None


@settings(max_examples=200, deadline=None)
@given(value=st.dictionaries(st.text(max_size=5), json_values, max_size=4) | st.lists(json_values, max_size=4),
       fmt=st.sampled_from(FORMATS))
def test_matches_json_dumps(value, fmt):
    assert canon(json.dumps(value, **fmt)) == json.dumps(value, ensure_ascii=False)


@settings(max_examples=300, deadline=None)
@given(opening=st.sampled_from(["{", "[", " {"]),
       body=st.lists(st.sampled_from(list('{}[],:" \n\\u0aeE.-+1tfn') + ["true", "null", "NaN", "\\ud83d",
                                                                         "\\ude00", '"k"']), max_size=20)
       .map("".join))
def test_accepts_exactly_what_json_loads_accepts(opening, body):
    text = opening + body
    try:
        expected = json.dumps(json.loads(text), ensure_ascii=False)
    except ValueError:
        expected = None
    assert canon(text) == expected


@pytest.mark.parametrize("raw, out", [
    ('{"a":1}', '{"a": 1}'),
    ('{"a": 1.50, "b": 1E2, "c": -0}', '{"a": 1.5, "b": 100.0, "c": 0}'),
    ('{"s": "\\u00e9\\ud83d\\ude00\\n"}', '{"s": "é😀\\n"}'),
    ('{"x": [true, false, null, {}]}', '{"x": [true, false, null, {}]}'),
    ('{}', '{}'),
])
def test_examples(raw, out):
    assert canon(raw) == out


def test_strings_stream_character_by_character():
    js = JsonStream()
    for ch in '{"k": "abc':
        js.feed(ch)
    assert "".join(js.out) == '{"k": "abc'
