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


class InBandError(ServingError):
    """An error ernie_moe sent inside its final response (engine_response.Failure; docs/serving.md says why)."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code
