"""Errors the serving layer raises, each mapped to one Triton error code."""
from __future__ import annotations


class ServingError(Exception):
    code = "INTERNAL"


class InvalidInput(ServingError, ValueError):
    """A bad request; the message names the field (answered INVALID_ARG)."""

    code = "INVALID_ARG"

    def __init__(self, field: str, why: str):
        super().__init__(why if why.startswith(field) else f"{field}: {why}")
        self.field = field


class Unavailable(ServingError):
    """Overloaded or a dead engine (answered UNAVAILABLE)."""

    code = "UNAVAILABLE"


class Cancelled(ServingError):
    code = "CANCELLED"


def error_code(exc: BaseException) -> str:
    """The Triton error code name for an exception from the serving layer or the engine."""
    from ..engine.async_engine import EngineDeadError, EngineOverloadedError

    if isinstance(exc, ServingError):
        return exc.code
    if isinstance(exc, (EngineOverloadedError, EngineDeadError)):
        return "UNAVAILABLE"
    if isinstance(exc, ValueError):  # the engine and SamplingParams name the field in their messages
        return "INVALID_ARG"
    return "INTERNAL"


IN_BAND_ERROR_PREFIX = "error:"


class InBandError(ServingError):
    """An error ernie_moe sent inside its FINAL response (engine_model's docstring says why)."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


def in_band_error(code: str, message: str) -> str:
    """The engine_finish_reason that carries an error to the detokenizer: "error:<CODE>:<message>"."""
    return f"{IN_BAND_ERROR_PREFIX}{code}:{message}"


def raise_in_band_error(finish_reason: str) -> None:
    """Raise the error an engine_finish_reason carries; a normal finish reason passes."""
    if finish_reason.startswith(IN_BAND_ERROR_PREFIX):
        code, _, message = finish_reason[len(IN_BAND_ERROR_PREFIX):].partition(":")
        raise InBandError(code or "INTERNAL", message)
