"""Streaming detokenization that never loses a SentencePiece space or splits a UTF-8 character.

Decoding each chunk of ids alone drops the leading space SentencePiece keeps on a piece's `▁` (for
models that strip it at the start of a decode) and turns a character spread over several byte-fallback
pieces into U+FFFD. So, as vLLM does, every step decodes a short window: a few already-emitted ids
(`prefix`) followed by the unemitted ones, and emits only the text past the window's already-emitted
part. The ids of a character still incomplete at the end (its text would end in U+FFFD) are held back
until it completes (or `flush()`).

Only the window is kept, so each step costs O(window + new ids), and the state can be rebuilt from a
tail of ids: construct with `prompt_ids=<the last few emitted ids>`. Most steps cost less: when nothing
is held back and the new ids continue a run of plain pieces, their text is their pieces' text (the
tokenizer's `continuation_text`, checked once per id against SentencePiece) and nothing is decoded.
"""
from __future__ import annotations

from typing import Protocol, Sequence

_REPLACEMENT = "\ufffd"
# Already-emitted ids kept in front of new ones; enough for a leading space and any multi-byte char.
CONTEXT_IDS = 5
_MAX_INCOMPLETE_IDS = 3


class _Decoder(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str: ...


class IncrementalDetokenizer:
    """Per-request detokenizer: `step(new_ids)` returns just the new text."""

    def __init__(self, tokenizer: _Decoder, prompt_ids: Sequence[int] = (),
                 skip_special_tokens: bool = False) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = [int(i) for i in list(prompt_ids)[-CONTEXT_IDS:]]
        self._read = len(self._ids)  # ids before this index have been emitted
        self._parts: list[str] = []
        self._continuation = getattr(tokenizer, "continuation_text", None)

    @property
    def text(self) -> str:
        """Everything emitted so far (not including held-back text)."""
        if len(self._parts) > 1:
            self._parts = ["".join(self._parts)]
        return self._parts[0] if self._parts else ""

    @property
    def context_ids(self) -> list[int]:
        """The ids this state depends on: emitted context followed by `num_pending` unemitted ones."""
        return list(self._ids)

    @property
    def num_pending(self) -> int:
        """Ids received but not yet emitted as text (an incomplete character)."""
        return len(self._ids) - self._read

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip)

    def _advance(self, force: bool) -> str:
        emitted = self._decode(self._ids[:self._read])
        end = len(self._ids)
        full = self._decode(self._ids)
        if not force:
            # Emit up to the last complete character: an incomplete UTF-8 tail spans at most 3 ids.
            for _ in range(_MAX_INCOMPLETE_IDS):
                if not full.endswith(_REPLACEMENT) or end - 1 <= self._read:
                    break
                end -= 1
                full = self._decode(self._ids[:end])
            if full.endswith(_REPLACEMENT):
                return ""
        # The window decodes the same emitted ids first, so `emitted` is a prefix of `full`.
        delta = full[len(emitted):]
        self._read = end
        drop = max(0, self._read - CONTEXT_IDS)
        del self._ids[:drop]
        self._read -= drop
        if delta:
            self._parts.append(delta)
        return delta

    def step(self, new_ids: Sequence[int]) -> str:
        """Append `new_ids`; return the text they complete (possibly "" while a character is held)."""
        if not new_ids:
            return ""
        fast = self._continued(new_ids)
        self._ids.extend(int(i) for i in new_ids)
        if fast is None:
            return self._advance(force=False)
        if len(self._ids) > CONTEXT_IDS:
            del self._ids[:len(self._ids) - CONTEXT_IDS]
        self._read = len(self._ids)
        if fast:
            self._parts.append(fast)
        return fast

    def _continued(self, new_ids: Sequence[int]) -> str | None:
        """The new ids' text without decoding, when nothing is held and they extend a run of plain pieces."""
        cont = self._continuation
        if cont is None or self._read != len(self._ids) or not self._ids or cont(self._ids[-1]) is None:
            return None
        texts = [cont(int(i)) for i in new_ids]
        return None if None in texts else "".join(texts)

    def flush(self) -> str:
        """Emit whatever is still held back (an incomplete character becomes U+FFFD)."""
        if self.num_pending == 0:
            return ""
        return self._advance(force=True)
