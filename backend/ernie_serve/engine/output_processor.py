"""Per-request text state: incremental detokenization and stop strings.

Stop strings are matched on text, so the engine must detokenize to stop on time. Text that could
still become the start of a stop string is held back from the stream until it is decided, so a
client never receives half of a stop string (and with include_stop_str_in_output, receives it whole).
A request whose outputs are final-only and that has no stop string needs no text before it ends: it is
decoded once, when it finishes (`deferred`).
"""
from __future__ import annotations

from ..outputs import Logprob, RequestOutputKind
from ..tokenizer import IncrementalDetokenizer
from .request import Request


class TextState:
    def __init__(self, tokenizer, req: Request):
        p = req.sampling_params
        self.stops = p.stop
        self.include_stop = p.include_stop_str_in_output
        self.detok = None if tokenizer is None or not p.detokenize else IncrementalDetokenizer(
            tokenizer, prompt_ids=req.prompt_token_ids[-8:], skip_special_tokens=p.skip_special_tokens)
        self._text: list[str] = []  # decided text, as returned to the user, in pieces (joined when read)
        self._pending = ""  # decoded but possibly the start of a stop string
        self._hold = max((len(s) for s in self.stops), default=1) - 1
        self._logprobs: list[dict[int, Logprob]] = []  # the request's logprobs as outputs carry them
        self._cumulative = 0.0
        self._prompt_logprobs: list[dict[int, Logprob] | None] | None = None  # converted once, when complete
        self.deferred = self.detok is not None and not self.stops and p.output_kind is RequestOutputKind.FINAL_ONLY

    @property
    def text(self) -> str:
        """The decided text so far (a streamed request's state would otherwise copy it whole every step)."""
        if len(self._text) > 1:
            self._text = ["".join(self._text)]
        return self._text[0] if self._text else ""

    def new_logprobs(self, req: Request) -> list[dict[int, Logprob]]:
        """The logprobs added since the last call, converted (a streamed request would otherwise convert its
        whole history every step); logprobs_so_far() has them all and their sum."""
        start = len(self._logprobs)
        for k in range(start, len(req.logprobs)):
            d = req.logprobs[k]
            self._logprobs.append({t: Logprob(v, r) for t, (v, r) in d.items()})
            tok = req.output_token_ids[k]
            if tok in d:
                self._cumulative += d[tok][0]
        return self._logprobs[start:]

    def prompt_logprobs(self, req: Request, delta: bool) -> list[dict[int, Logprob] | None] | None:
        """RequestOutput.prompt_logprobs once all are computed (None before; a delta stream gets them once)."""
        if self._prompt_logprobs is None:
            if req.prompt_logprobs is None or req.needs_prompt_logprobs:
                return None
            self._prompt_logprobs = [None] + [{t: Logprob(v, r) for t, (v, r) in d.items()}
                                              for d in req.prompt_logprobs]
            return self._prompt_logprobs
        return None if delta else self._prompt_logprobs

    def logprobs_so_far(self, req: Request) -> tuple[list[dict[int, Logprob]], float]:
        """Every output token's logprobs and their sum."""
        self.new_logprobs(req)
        return list(self._logprobs), self._cumulative

    @property
    def cumulative_logprob(self) -> float:
        return self._cumulative

    def finish_deferred(self, req: Request) -> str:
        """A deferred request's whole text, decoded once now that it has finished ("" if not deferred)."""
        if not self.deferred:
            return ""
        self.deferred = False
        return self.append(req.output_token_ids, final=True)[0]

    def append(self, token_ids: list[int], final: bool, check_stops: bool = True) -> tuple[str, str | None]:
        """Feed new tokens; returns (new decided text, matched stop string or None)."""
        if self.detok is None:  # skip_tokenizer_init: ids only
            return "", None
        if not self.stops:  # nothing is ever held back
            delta = self.detok.step(token_ids)
            if final:
                delta += self.detok.flush()
            if delta:
                self._text.append(delta)
            return delta, None
        self._pending += self.detok.step(token_ids)
        if final:
            self._pending += self.detok.flush()
        if self.stops and check_stops:
            hit = self._find_stop()
            if hit is not None:
                stop, at = hit
                end = at + (len(stop) if self.include_stop else 0)
                delta = self._pending[:end]
                self._text.append(delta)
                self._pending = ""
                return delta, stop
        cut = len(self._pending) if final or not self.stops else self._safe_cut()
        delta, self._pending = self._pending[:cut], self._pending[cut:]
        if delta:
            self._text.append(delta)
        return delta, None

    def _find_stop(self) -> tuple[str, int] | None:
        # Search the held tail plus new text; the earliest stop wins.
        best = None
        for s in self.stops:
            at = self._pending.find(s)
            if at >= 0 and (best is None or at < best[1]):
                best = (s, at)
        return best

    def _safe_cut(self) -> int:
        """Emit everything except a suffix that is a prefix of some stop string."""
        text = self._pending
        for k in range(min(self._hold, len(text)), 0, -1):
            tail = text[-k:]
            if any(s.startswith(tail) for s in self.stops):
                return len(text) - k
        return len(text)
