"""Incremental JSON: consume one character at a time, emit `json.dumps(value, ensure_ascii=False)`.

Streamed tool-call arguments must concatenate to exactly what the non-streaming parser produces,
and that is the *re-serialized* JSON, not the model's raw text (`{"a":1}` -> `{"a": 1}`,
`"\\u00e9"` -> `"é"`, `1E2` -> `100.0`). So the streaming side re-serializes as it parses:
every output piece is final when emitted. Strings stream character by character; numbers and
literals are emitted when the next character ends them. Errors raise JsonStreamError where
json.loads would fail.
"""
from __future__ import annotations

import json
import re

WS = " \t\n\r"
_SCALAR_CHARS = frozenset("0123456789+-.abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
_LITERALS = frozenset(("true", "false", "null", "NaN", "Infinity", "-Infinity"))
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?\Z")
_SIMPLE_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
_HEX = frozenset("0123456789abcdefABCDEF")


class JsonStreamError(ValueError):
    pass


def _escape(ch: str) -> str:
    if ch == '"' or ch == "\\" or ch < " ":
        return json.dumps(ch)[1:-1]
    return ch


class JsonStream:
    """Parses one JSON value. `out` is the list of canonical pieces so far; `done` once complete.

    For the outermost object it also tracks the current member (`member_index`, `member_key`,
    and the span `out[member_start:member_end]` of its value), which is all the tool parser needs.
    """

    def __init__(self) -> None:
        self.out: list[str] = []
        self.done = False
        self._stack: list[str] = []   # "obj" / "arr"
        self._expect = "value"        # value | key_or_end | key | colon | comma_or_end | value_or_end
        self._str: list[str] | None = None   # decoded chars of the string being read
        self._str_is_key = False
        self._esc: str | None = None         # None, "" (after backslash) or "u" + hex digits
        self._high: int | None = None        # pending high surrogate from a \\u escape
        self._scalar: list[str] | None = None
        self.member_index = -1
        self.member_key: str | None = None
        self.member_start: int | None = None
        self.member_end: int | None = None

    def feed(self, ch: str) -> None:
        if self.done:
            if ch in WS:
                return
            raise JsonStreamError(f"extra data after the JSON value: {ch!r}")
        if self._str is not None:
            self._string_char(ch)
        elif self._scalar is not None:
            if ch in _SCALAR_CHARS:
                self._scalar.append(ch)
                return
            self._end_scalar()
            self.feed(ch)
        else:
            self._structural(ch)

    # -- structure ------------------------------------------------------------------------------
    def _structural(self, ch: str) -> None:
        if ch in WS:
            return
        e = self._expect
        if e in ("value", "value_or_end"):
            if e == "value_or_end" and ch == "]":
                self._close("arr", ch)
            elif ch == "{":
                self._open("obj", "{", "key_or_end")
            elif ch == "[":
                self._open("arr", "[", "value_or_end")
            elif ch == '"':
                self._start_string(is_key=False)
            elif ch in _SCALAR_CHARS:
                self._scalar = [ch]
            else:
                raise JsonStreamError(f"expected a JSON value, got {ch!r}")
        elif e in ("key_or_end", "key"):
            if e == "key_or_end" and ch == "}":
                self._close("obj", ch)
            elif ch == '"':
                self._start_string(is_key=True)
            else:
                raise JsonStreamError(f"expected an object key, got {ch!r}")
        elif e == "colon":
            if ch != ":":
                raise JsonStreamError(f"expected ':', got {ch!r}")
            self.out.append(": ")
            self._expect = "value"
            if len(self._stack) == 1:
                self.member_start = len(self.out)
        elif e == "comma_or_end":
            top = self._stack[-1]
            if ch == ",":
                self.out.append(", ")
                self._expect = "key" if top == "obj" else "value"
            elif ch == ("}" if top == "obj" else "]"):
                self._close(top, ch)
            else:
                raise JsonStreamError(f"expected ',' or the end of the {'object' if top == 'obj' else 'array'}, got {ch!r}")

    def _open(self, kind: str, ch: str, expect: str) -> None:
        self.out.append(ch)
        self._stack.append(kind)
        self._expect = expect

    def _close(self, kind: str, ch: str) -> None:
        self.out.append(ch)
        self._stack.pop()
        self._value_done()

    def _value_done(self) -> None:
        if not self._stack:
            self.done = True
            return
        self._expect = "comma_or_end"
        if len(self._stack) == 1 and self.member_start is not None and self.member_end is None:
            self.member_end = len(self.out)

    # -- strings --------------------------------------------------------------------------------
    def _start_string(self, is_key: bool) -> None:
        self._str, self._str_is_key = [], is_key
        self.out.append('"')

    def _emit(self, ch: str) -> None:
        assert self._str is not None
        self._str.append(ch)
        self.out.append(_escape(ch))

    def _flush_high(self) -> None:
        if self._high is not None:
            self._emit(chr(self._high))
            self._high = None

    def _string_char(self, ch: str) -> None:
        esc = self._esc
        if esc is None:
            if ch == '"':
                self._flush_high()
                self.out.append('"')
                decoded, self._str = "".join(self._str), None
                if self._str_is_key:
                    if len(self._stack) == 1:
                        self.member_index += 1
                        self.member_key, self.member_start, self.member_end = decoded, None, None
                    self._expect = "colon"
                else:
                    self._value_done()
            elif ch == "\\":
                self._esc = ""
            elif ch < " ":
                raise JsonStreamError(f"raw control character {ch!r} inside a JSON string")
            else:
                self._flush_high()
                self._emit(ch)
        elif esc == "":
            if ch == "u":
                self._esc = "u"
            elif ch in _SIMPLE_ESCAPES:
                self._esc = None
                self._flush_high()
                self._emit(_SIMPLE_ESCAPES[ch])
            else:
                raise JsonStreamError(f"invalid escape \\{ch} in a JSON string")
        else:
            if ch not in _HEX:
                raise JsonStreamError(f"invalid \\u escape in a JSON string: {esc[1:] + ch!r}")
            esc += ch
            if len(esc) < 5:
                self._esc = esc
                return
            self._esc = None
            cp = int(esc[1:], 16)
            if self._high is not None and 0xDC00 <= cp <= 0xDFFF:
                high, self._high = self._high, None
                self._emit(chr(0x10000 + ((high - 0xD800) << 10) + (cp - 0xDC00)))
                return
            self._flush_high()
            if 0xD800 <= cp <= 0xDBFF:
                self._high = cp  # json.loads pairs it with a following low-surrogate escape
            else:
                self._emit(chr(cp))

    # -- numbers and literals -------------------------------------------------------------------
    def _end_scalar(self) -> None:
        assert self._scalar is not None
        tok, self._scalar = "".join(self._scalar), None
        if tok not in _LITERALS and not _NUMBER.match(tok):
            raise JsonStreamError(f"invalid JSON number or literal {tok!r}")
        try:
            self.out.append(json.dumps(json.loads(tok)))
        except ValueError as e:  # e.g. an integer with too many digits
            raise JsonStreamError(str(e)) from e
        self._value_done()
