"""Base classes for reasoning and tool parsers, and the small text helpers they share.

Every parser is written twice on purpose: a non-streaming function over the whole text (plain
str.find / json) and a streaming state machine that holds back text until it is unambiguous. The
property tests check that the two agree for every way of cutting the text into deltas.
"""
from __future__ import annotations

import weakref
from abc import ABC, abstractmethod
from typing import Any, Protocol, Sequence

from .protocol import DeltaMessage, ExtractedToolCallInformation

_VOCAB_CACHE: "weakref.WeakKeyDictionary[Any, dict[str, int | None]]" = weakref.WeakKeyDictionary()


class TokenizerLike(Protocol):
    def get_vocab(self) -> dict[str, int]: ...


def marker_ids(tokenizer: TokenizerLike, tokens: Sequence[str], parser_name: str) -> dict[str, int]:
    """Ids of the parser's marker tokens; a clear error at construction if any is not one token.

    get_vocab() can build a dict of the whole vocabulary, so lookups are cached per tokenizer.
    """
    try:
        cache = _VOCAB_CACHE.setdefault(tokenizer, {})
    except TypeError:  # not weak-referenceable: no cache
        cache = {}
    if any(t not in cache for t in tokens):
        vocab = tokenizer.get_vocab()
        for t in tokens:
            cache[t] = vocab.get(t)
    missing = [t for t in tokens if cache[t] is None]
    if missing:
        raise ValueError(
            f"the {parser_name!r} parser needs {', '.join(missing)} as single tokens in the tokenizer "
            f"vocabulary, but the tokenizer lacks them; use the model's own tokenizer (with its added "
            f"special tokens) or pick a parser that matches this model")
    return {t: cache[t] for t in tokens}  # type: ignore[misc]


def held_len(text: str, *markers: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of one of the markers.

    That suffix may still become a marker, so streaming code must not emit it yet.
    """
    best = 0
    for m in markers:
        for k in range(min(len(m) - 1, len(text)), best, -1):
            if text.endswith(m[:k]):
                best = k
                break
    return best


class Splitter(Protocol):
    """Streaming half of a reasoning parser: text in, (reasoning, rest) out."""
    in_reasoning: bool | None  # None while undecided

    def push(self, text: str) -> tuple[str, str]: ...
    def flush(self) -> tuple[str, str]: ...


class ContentFilter(Protocol):
    """Streaming: non-reasoning, non-tool text in, the user-visible content out."""
    def push(self, text: str) -> str: ...
    def flush(self) -> str: ...


class PassThrough:
    def push(self, text: str) -> str:
        return text

    def flush(self) -> str:
        return ""


class ReasoningParser(ABC):
    """Splits model output into reasoning and the rest.

    Two steps, so the output parser can put the tool parser between them:
    split(output) -> (reasoning, rest), then content_from_rest(rest) -> content.
    """
    name = "reasoning"
    # True: the chat template renders enable_thinking into the prompt and the status is read from
    # the prompt ids alone; False: an explicit enable_thinking flag overrides the prompt.
    status_from_prompt_only = False

    def __init__(self, tokenizer: TokenizerLike):
        self.tokenizer = tokenizer
        self._stream: _ReasoningStream | None = None

    @abstractmethod
    def get_model_status(self, prompt_token_ids: Sequence[int]) -> str: ...

    @abstractmethod
    def split(self, model_output: str, model_status: str) -> tuple[str, str]: ...

    @abstractmethod
    def new_splitter(self, model_status: str) -> Splitter: ...

    def content_from_rest(self, rest: str, model_status: str) -> str:
        return rest

    def new_content_filter(self, model_status: str) -> ContentFilter:
        return PassThrough()

    def extract_reasoning_content(self, model_output: str, model_status: str) -> tuple[str, str]:
        reasoning, rest = self.split(model_output, model_status)
        return reasoning, self.content_from_rest(rest, model_status)

    def extract_reasoning_content_streaming(
            self, previous_text: str, current_text: str, delta_text: str,
            previous_token_ids: Sequence[int], current_token_ids: Sequence[int],
            delta_token_ids: Sequence[int], model_status: str) -> DeltaMessage | None:
        """One delta. Works from the texts, so it is right even when one parser serves many requests
        (the state is rebuilt from previous_text when it is not the text this parser last saw)."""
        st = self._stream
        if st is None or st.status != model_status or not _same_text(st.seen, previous_text):
            st = self._stream = _ReasoningStream(self, model_status)
            st.push(previous_text)
        delta = current_text[len(previous_text):] if current_text.startswith(previous_text) else delta_text
        reasoning, content = st.push(delta)
        st.seen = current_text if current_text.startswith(previous_text) else previous_text + delta_text
        if not reasoning and not content:
            return None
        return DeltaMessage(content=content or None, reasoning_content=reasoning or None)


def _same_text(a: str, b: str) -> bool:
    return a is b or (len(a) == len(b) and a == b)


class _ReasoningStream:
    def __init__(self, parser: ReasoningParser, status: str):
        self.status = status
        self.seen = ""
        self.splitter = parser.new_splitter(status)
        self.filter = parser.new_content_filter(status)

    def push(self, text: str) -> tuple[str, str]:
        reasoning, rest = self.splitter.push(text)
        return reasoning, self.filter.push(rest)


class ToolCallStreamLike(Protocol):
    tools_called: bool
    cut_off_index: int | None  # after flush(): a call whose header went out but whose block never ended

    def push(self, text: str) -> tuple[str, list]: ...
    def flush(self) -> tuple[str, list]: ...


class ToolParser(ABC):
    """Finds tool calls in the non-reasoning text; everything else is content."""
    name = "tool"

    def __init__(self, tokenizer: TokenizerLike):
        self.tokenizer = tokenizer
        self._stream: ToolCallStreamLike | None = None
        self._seen = ""

    @abstractmethod
    def extract_tool_calls(self, model_output: str, request: Any = None) -> ExtractedToolCallInformation: ...

    @abstractmethod
    def new_stream(self) -> ToolCallStreamLike: ...

    def extract_tool_calls_streaming(
            self, previous_text: str, current_text: str, delta_text: str,
            previous_token_ids: Sequence[int], current_token_ids: Sequence[int],
            delta_token_ids: Sequence[int], request: Any = None) -> DeltaMessage | None:
        """One delta; the state is rebuilt from previous_text when it is not what this parser saw."""
        if self._stream is None or not _same_text(self._seen, previous_text):
            self._stream = self.new_stream()
            self._stream.push(previous_text)
        delta = current_text[len(previous_text):] if current_text.startswith(previous_text) else delta_text
        self._seen = current_text if current_text.startswith(previous_text) else previous_text + delta_text
        content, calls = self._stream.push(delta)
        if not content and not calls:
            return None
        return DeltaMessage(content=content or None, tool_calls=calls)
