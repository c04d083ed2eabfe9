"""Hypothesis strategies for model outputs: random marker soup and well-formed tool-call outputs."""
from __future__ import annotations

import json

from hypothesis import strategies as st

from parser_helpers import MARKERS

PIECES = MARKERS + ["<", "/", ">", "a", "b", " ", "\n", "\n\n", "中文", "{", "}", '"', ":", ",", "1", "true",
                    "<thi", "</th", "ink>", "<resp", "onse>", "</resp", "<tool", "_call>", "</tool_", "\\",
                    '"name"', '"arguments"', '{"name": "f", "arguments": {"x": 1}}', '{"name": "g"}',
                    '<tool_call>{"name": "f", "arguments": {"x": [1, true]}}</tool_call>',
                    '<tool_call>\n{"arguments": {}, "name": "g"}\n', '<tool_call>{"name": "h", "arguments": {"y": ']
soup = st.lists(st.sampled_from(PIECES), max_size=24).map("".join)

plain = st.lists(st.sampled_from(list("ab <>/\n中{}\"") + ["\n\n", "，"]), max_size=12).map("".join)
ws = st.sampled_from(["", "\n", " ", "\n\n", "\t"])

json_scalars = (st.none() | st.booleans() | st.integers(-10**20, 10**20)
                | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=6))
json_values = st.recursive(json_scalars, lambda c: st.lists(c, max_size=3)
                           | st.dictionaries(st.text(max_size=4), c, max_size=3), max_leaves=8)
arguments = st.dictionaries(st.text(max_size=5), json_values, max_size=3)
FORMATS = [dict(), dict(separators=(",", ":")), dict(indent=2), dict(ensure_ascii=False),
           dict(separators=(" , ", " : "), ensure_ascii=False)]


@st.composite
def call_object(draw, require_arguments: bool = False) -> str:
    """One tool-call JSON object as a model might write it (any key order and formatting)."""
    fmt = draw(st.sampled_from(FORMATS))
    name = draw(st.sampled_from(["get_weather", "搜索", "f"]) | st.text(max_size=6))
    members = [("name", name)]
    layouts = ["name_first", "args_first", "extra_key"] + ([] if require_arguments else ["no_args"])
    layout = draw(st.sampled_from(layouts))
    if layout != "no_args":
        members.append(("arguments", draw(arguments)))
    if layout == "args_first":
        members.reverse()
    if layout == "extra_key":
        members.insert(draw(st.integers(0, 2)), ("id", draw(json_values)))
    if fmt.get("indent"):
        return json.dumps(dict(members), **fmt)
    sep, colon = fmt.get("separators", (", ", ": "))
    return "{" + sep.join(json.dumps(k, **{k2: v for k2, v in fmt.items() if k2 == "ensure_ascii"}) + colon
                          + json.dumps(v, **{k2: v2 for k2, v2 in fmt.items() if k2 != "separators"})
                          for k, v in members) + "}"


@st.composite
def cut_off_block(draw, require_arguments: bool = False) -> str:
    """A block the output ends inside (max_tokens): its start tag and a proper prefix of a call object."""
    obj = draw(call_object(require_arguments))
    return "<tool_call>" + draw(ws) + obj[:draw(st.integers(0, len(obj) - 1))]


@st.composite
def tool_output(draw, require_arguments: bool = False) -> str:
    """reasoning? </think> ... <response>? ... tool-call blocks ... trailing text; the last block
    maybe left open after its JSON, cut inside its end tag, or cut inside its JSON."""
    parts = []
    if draw(st.booleans()):
        parts.append(draw(plain) + "</think>" + draw(ws))
    parts.append(draw(plain))
    if draw(st.booleans()):
        parts.append("<response>" + draw(plain) + "</response>" + draw(ws))
    blocks = [f"<tool_call>{draw(ws)}{draw(call_object(require_arguments))}{draw(ws)}</tool_call>"
              for _ in range(draw(st.integers(0, 3)))]
    tail = draw(st.sampled_from(["closed", "closed", "open", "cut_end_tag", "cut_json"])) if blocks else "closed"
    if tail == "cut_json":
        blocks[-1] = draw(cut_off_block(require_arguments))
    parts.append(draw(ws).join(blocks))
    if tail == "closed":
        parts.append(draw(plain))
    elif tail == "open":
        parts[-1] = parts[-1][:-len("</tool_call>")]
    elif tail == "cut_end_tag":
        parts[-1] = parts[-1][:-len("call>")]
    return "".join(parts)
