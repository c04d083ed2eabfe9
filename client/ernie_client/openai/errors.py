"""OpenAI error objects: `{"error": {"message", "type", "param", "code"}}` with the matching HTTP status."""
from __future__ import annotations

from fastapi.responses import JSONResponse

RETRY_AFTER_SECONDS = 1

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    408: "timeout_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    503: "service_unavailable",
    504: "timeout_error",
}


class OpenAIError(Exception):
    """Raised anywhere in the shim; the app turns it into the error body and status."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": _TYPES.get(self.status, "api_error"),
                          "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = None
        if self.status == 401:
            headers = {"WWW-Authenticate": "Bearer"}
        elif self.status == 429:  # a full queue drains in about a request's time, never retry at once
            headers = {"Retry-After": str(RETRY_AFTER_SECONDS)}
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def bad_request(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param=param)
