"""Per-request generation settings, named and defaulted as in vLLM / FastDeploy.

Every field is checked here, once, for type and range, so nothing a client sends can fail later in the
engine: the limits keep each value inside the type it is narrowed to downstream (the ensemble's INT32 /
UINT64 tensors, the sampler's int64 top-k and float32 arithmetic).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields
from numbers import Integral, Real
from typing import Any

import numpy as np

from .outputs import RequestOutputKind

MAX_LOGPROBS = 20
MAX_STOP_SEQUENCES = 5  # FD_MAX_STOP_SEQS_NUM
GREEDY_EPSILON = 1e-5
INT32_MAX = 2**31 - 1   # max_tokens / top_k / min_tokens / token-id tensors are INT32
UINT64_MAX = 2**64 - 1  # the seed tensor is UINT64
FLOAT32_MAX = 3.4028234663852886e38  # the sampler divides logits by temperature in float32
# Wide enough for any real use, narrow enough that a float32 logit times or over it stays finite.
REPETITION_PENALTY_RANGE = (1e-6, 1e6)
LOGIT_BIAS_RANGE = (-100.0, 100.0)  # OpenAI's; -100 bans a token, 100 all but forces it
GUIDED_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass
class GuidedDecodingParams:
    """Constrain the output to a grammar, as vLLM's GuidedDecodingParams: exactly one of

    json: a JSON schema (an object, or its JSON text); regex; choice: one of these strings;
    grammar: Lark (llguidance's dialect), GBNF, or an llguidance grammar object as JSON text;
    json_object: any JSON object.

    start_after_token_id: the constraint begins after this token is generated, and the tokens up to it
    are free (a thinking model's `</think>`: the reasoning is not constrained). None: from the first token.
    """
    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    start_after_token_id: int | None = None

    def __post_init__(self) -> None:
        self.validate()

    @property
    def kind(self) -> str:
        return next(k for k in GUIDED_KINDS if getattr(self, k) not in (None, False))

    def validate(self, where: str = "guided_decoding") -> None:
        """Types and the one-constraint rule; whether the grammar compiles is the engine's check."""
        self.json_object = _flag(f"{where}.json_object", self.json_object)
        given = [k for k in GUIDED_KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"{where} must set exactly one of {', '.join(GUIDED_KINDS)}, got "
                             f"{', '.join(given) if given else 'none'}")
        if self.json is not None:
            self.json = _json_schema(f"{where}.json", self.json)
        for name in ("regex", "grammar"):
            if getattr(self, name) is not None:
                setattr(self, name, _text(f"{where}.{name}", getattr(self, name)))
        if self.choice is not None:
            self.choice = _strings(f"{where}.choice", self.choice)
            if not self.choice:
                raise ValueError(f"{where}.choice must be a non-empty list of strings")
        if self.start_after_token_id is not None:
            self.start_after_token_id = _integer(f"{where}.start_after_token_id", self.start_after_token_id,
                                                 0, INT32_MAX)

    @classmethod
    def from_value(cls, value: Any, where: str = "guided_decoding") -> "GuidedDecodingParams":
        """From itself or a JSON object (SamplingParams arrives as JSON in the Triton pipeline)."""
        if isinstance(value, cls):
            value.validate(where)
            return value
        if not isinstance(value, dict):
            raise ValueError(f"{where} must be an object with one of {', '.join(GUIDED_KINDS)}, got {_show(value)}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"{where} has unknown field(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        return cls(**value)


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None
    # vLLM's: the prompt's own logprobs, each prompt token's and its `prompt_logprobs` most likely alternatives
    # (RequestOutput.prompt_logprobs; the first token has none). Such a request does not read the prefix cache.
    prompt_logprobs: int | None = None
    bad_words: list[str] = field(default_factory=list)
    skip_special_tokens: bool = True
    guided_decoding: GuidedDecodingParams | None = None
    # token id -> added to its logit before the penalties (vLLM's order); JSON's string keys are accepted
    logit_bias: dict[int, float] | None = None
    # FastDeploy's: at most this many tokens of reasoning; a thinking output that reaches it gets the reasoning
    # parser's end-of-thinking token (`</think>`) next, and the answer follows (None: unbounded)
    reasoning_max_tokens: int | None = None
    # the token that closes the reasoning (`</think>`), which the engine appends when the budget is spent; set by
    # the front from its reasoning parser (engine/reasoning_budget.py), or by a direct caller of the engine
    reasoning_end_token_id: int | None = None
    # what each RequestOutput carries (outputs.RequestOutputKind); set by the front that reads the outputs
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # whether the engine's outputs carry text (vLLM's): a front that decodes the ids itself turns it off, and the
    # engine's step thread then does no detokenizing for the request; stop strings need it (matched on the text)
    detokenize: bool = True

    def __post_init__(self) -> None:
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPSILON

    def validate(self) -> None:
        """Check every field and store it in its canonical Python type (int, float, bool, list).

        Raises ValueError whose message starts with the field's name and states the limit, so servers
        can answer 400 / INVALID_ARG with it.
        """
        self.n = _integer("n", self.n, 1, INT32_MAX)
        self.temperature = _real("temperature", self.temperature, 0.0, FLOAT32_MAX)
        self.top_p = _real("top_p", self.top_p, 0.0, 1.0, low_open=True)
        self.top_k = _integer("top_k", 0 if self.top_k in (-1, None) else self.top_k, 0, INT32_MAX,
                              hint=" (0 or -1 disables it)")
        self.min_p = _real("min_p", self.min_p, 0.0, 1.0)
        self.repetition_penalty = _real("repetition_penalty", self.repetition_penalty, *REPETITION_PENALTY_RANGE)
        self.presence_penalty = _real("presence_penalty", self.presence_penalty, -2.0, 2.0)
        self.frequency_penalty = _real("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        if self.seed is not None:
            self.seed = _integer("seed", self.seed, 0, UINT64_MAX)
        if self.max_tokens is not None:
            self.max_tokens = _integer("max_tokens", self.max_tokens, 1, INT32_MAX,
                                       hint=" (or null: up to max_model_len)")
        self.min_tokens = _integer("min_tokens", self.min_tokens, 0, INT32_MAX)
        if self.reasoning_max_tokens is not None:
            self.reasoning_max_tokens = _integer("reasoning_max_tokens", self.reasoning_max_tokens, 1, INT32_MAX,
                                                 hint=" (or null: unbounded)")
        if self.reasoning_end_token_id is not None:
            if self.reasoning_max_tokens is None:
                raise ValueError("reasoning_end_token_id is only used with reasoning_max_tokens")
            self.reasoning_end_token_id = _integer("reasoning_end_token_id", self.reasoning_end_token_id, 0, INT32_MAX)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        if self.logprobs is not None:
            self.logprobs = _integer("logprobs", self.logprobs, 0, MAX_LOGPROBS)
        if self.prompt_logprobs is not None:
            self.prompt_logprobs = _integer("prompt_logprobs", self.prompt_logprobs, 0, MAX_LOGPROBS)
        self.stop = _strings("stop", [self.stop] if isinstance(self.stop, str) else self.stop)
        if len(self.stop) > MAX_STOP_SEQUENCES:
            raise ValueError(f"stop may hold at most {MAX_STOP_SEQUENCES} strings, got {len(self.stop)}")
        self.bad_words = _strings("bad_words", self.bad_words)
        self.stop_token_ids = _integers("stop_token_ids", self.stop_token_ids, 0, INT32_MAX)
        if self.logit_bias is not None:
            self.logit_bias = _logit_bias(self.logit_bias)
        for name in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens", "detokenize"):
            setattr(self, name, _flag(name, getattr(self, name)))
        if self.stop and not self.detokenize:
            raise ValueError("stop strings need detokenize=True: they are matched on the output's text")
        try:
            self.output_kind = RequestOutputKind(self.output_kind)
        except ValueError:
            raise ValueError(f"output_kind must be one of {', '.join(k.value for k in RequestOutputKind)}, "
                             f"got {_show(self.output_kind)}") from None
        if self.guided_decoding is not None:
            self.guided_decoding = GuidedDecodingParams.from_value(self.guided_decoding)
            if self.ignore_eos:
                raise ValueError("ignore_eos cannot be combined with guided_decoding: the grammar decides where "
                                 "the output ends, with eos")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "SamplingParams":
        """Build from a JSON object; unknown fields are an error naming them (never silently ignored)."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown sampling field(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        return cls(**d)


def _show(value: Any) -> str:
    """A value for an error message: short, and never a 10**5000-digit int (Python refuses to print it)."""
    if isinstance(value, Integral) and not isinstance(value, bool) and abs(int(value)).bit_length() > 256:
        return f"an integer of {abs(int(value)).bit_length()} bits"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _integer(name: str, value: Any, low: int, high: int, hint: str = "") -> int:
    """An exact integer in [low, high]: no bools, no strings, floats only when integral."""
    if isinstance(value, Real) and not isinstance(value, (bool, Integral)) and math.isfinite(value) \
            and float(value).is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, Integral) or not low <= value <= high:
        raise ValueError(f"{name} must be an integer in [{low}, {high}]{hint}, got {_show(value)}")
    return int(value)


def _real(name: str, value: Any, low: float, high: float, low_open: bool = False) -> float:
    """A finite number in [low, high] ((low, high] with low_open); NaN and infinities are refused."""
    ok = isinstance(value, Real) and not isinstance(value, bool)
    if ok:
        try:
            number = float(value)
        except OverflowError:  # an int too large for a float
            ok = False
        else:
            ok = math.isfinite(number) and (low < number if low_open else low <= number) and number <= high
    if not ok:
        bounds = f"{'(' if low_open else '['}{low:g}, {high:g}]"
        raise ValueError(f"{name} must be a finite number in {bounds}, got {_show(value)}")
    return number


def _flag(name: str, value: Any) -> bool:
    if not isinstance(value, (bool, np.bool_)):  # np.bool_: a value from a BOOL tensor
        raise ValueError(f"{name} must be true or false, got {_show(value)}")
    return bool(value)


def _items(name: str, value: Any, what: str) -> list:
    if value is None:
        return []
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"{name} must be a list of {what}, got {_show(value)}")
    return list(value)


def _strings(name: str, value: Any) -> list[str]:
    """Non-empty strings that are valid Unicode (a JSON "\\ud800" escape decodes to a lone surrogate,
    which no tokenizer or UTF-8 encoder accepts)."""
    items = _items(name, value, "non-empty strings")
    for i, s in enumerate(items):
        if not isinstance(s, str) or not s:
            raise ValueError(f"{name} must be a list of non-empty strings, item {i} is {_show(s)}")
        try:
            s.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(f"{name} item {i} is not valid Unicode text: a lone surrogate at index {e.start}") \
                from None
    return items


def _text(name: str, value: Any) -> str:
    """A non-empty string of valid Unicode."""
    if not isinstance(value, str) or not value:
        raise ValueError(f"{name} must be a non-empty string, got {_show(value)}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{name} is not valid Unicode text: a lone surrogate at index {e.start}") from None
    return value


def _json_schema(name: str, value: Any) -> dict:
    """A JSON schema object; given as text, it is parsed here so a typo is named at the door."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise ValueError(f"{name} is not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a JSON schema object, got {_show(value)}")
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except (TypeError, ValueError, UnicodeEncodeError) as e:
        raise ValueError(f"{name} must be plain JSON of valid Unicode text ({type(e).__name__}: {e})") from None
    return value


def _logit_bias(value: Any) -> dict[int, float]:
    """{token id: bias}; ids may be JSON's strings ("123"), as OpenAI clients send them."""
    if not isinstance(value, dict):
        raise ValueError(f"logit_bias must be an object of token id -> bias, got {_show(value)}")
    out = {}
    for key, bias in value.items():
        token = key
        if isinstance(key, str):
            try:
                token = int(key)
            except ValueError:  # not an integer, or one past Python's conversion limit: named below
                pass
        token = _integer("logit_bias key", token, 0, INT32_MAX, hint=" (a token id)")
        out[token] = _real(f"logit_bias[{token}]", bias, *LOGIT_BIAS_RANGE)
    return out


def _integers(name: str, value: Any, low: int, high: int) -> list[int]:
    return [_integer(f"{name}[{i}]", v, low, high) for i, v in enumerate(_items(name, value, "integers"))]
