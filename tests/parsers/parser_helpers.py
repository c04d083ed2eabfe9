"""Fake tokenizer and delta-splitting helpers shared by the parser tests."""
from __future__ import annotations

from dataclasses import dataclass, field

MARKERS = ["<think>", "</think>", "<response>", "</response>", "<tool_call>", "</tool_call>"]
CHAR_ID_BASE = 1000


class FakeTokenizer:
    def __init__(self, markers: list[str] | None = None):
        self.vocab = {m: i for i, m in enumerate(MARKERS if markers is None else markers)}

    def get_vocab(self) -> dict[str, int]:
        return dict(self.vocab)

    def tokenize(self, text: str) -> list[tuple[str, int]]:
        """Greedy: a marker string is its one id, any other character is its own id."""
        out, i = [], 0
        markers = sorted(self.vocab, key=len, reverse=True)
        while i < len(text):
            for m in markers:
                if text.startswith(m, i):
                    out.append((m, self.vocab[m]))
                    i += len(m)
                    break
            else:
                out.append((text[i], CHAR_ID_BASE + ord(text[i])))
                i += 1
        return out

    def encode(self, text: str) -> list[int]:
        return [tid for _, tid in self.tokenize(text)]


def token_deltas(tok: FakeTokenizer, text: str, cuts: list[int]) -> list[tuple[str, list[int]]]:
    """Group the tokens of text into deltas; cuts are token positions (any ints, folded into range)."""
    toks = tok.tokenize(text)
    points = sorted({c % (len(toks) + 1) for c in cuts} | {0, len(toks)})
    return [("".join(t for t, _ in toks[a:b]), [i for _, i in toks[a:b]]) for a, b in zip(points, points[1:])]


def char_deltas(tok: FakeTokenizer, text: str, cuts: list[int]) -> list[tuple[str, list[int]]]:
    """Cut text at arbitrary characters (markers may be split); a token's id goes with the delta
    holding its last character."""
    ends, pos = [], 0
    for t, tid in tok.tokenize(text):
        pos += len(t)
        ends.append((pos, tid))
    points = sorted({c % (len(text) + 1) for c in cuts} | {0, len(text)})
    return [(text[a:b], [tid for e, tid in ends if a < e <= b]) for a, b in zip(points, points[1:])]


@dataclass
class Streamed:
    reasoning: str = ""
    content: str = ""
    names: dict[int, str] = field(default_factory=dict)
    ids: dict[int, str] = field(default_factory=dict)
    args: dict[int, str] = field(default_factory=dict)
    messages: list = field(default_factory=list)

    def add(self, msg) -> None:
        if msg is None:
            return
        assert not msg.is_empty(), "an empty DeltaMessage should have been None"
        self.messages.append(msg)
        self.reasoning += msg.reasoning_content or ""
        self.content += msg.content or ""
        for d in msg.tool_calls:
            if d.id is not None:
                assert d.index not in self.ids, f"call {d.index} got a second header"
                assert d.id.startswith("chatcmpl-tool-") and len(d.id) == len("chatcmpl-tool-") + 32
                assert d.type == "function" and d.function and d.function.name is not None
                self.ids[d.index] = d.id
                self.names[d.index] = d.function.name
            else:
                assert d.index in self.ids, "argument fragment before the call's header"
            if d.function and d.function.arguments is not None:
                self.args[d.index] = self.args.get(d.index, "") + d.function.arguments
