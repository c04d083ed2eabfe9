"""A request's JSON body, validated against its pydantic model, every failure a 400 that names the field."""
from __future__ import annotations

import json
import logging

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from .errors import OpenAIError, bad_request
from .protocol import lone_surrogate_path

log = logging.getLogger(__name__)
_PYDANTIC_TAGS = {"str", "int", "float", "bool", "list", "dict", "literal", "function-after", "function-before",
                  "function-wrap", "union", "none"}


def _param_from_loc(loc: tuple) -> str | None:
    parts = []
    for p in loc:
        if isinstance(p, int):
            parts.append(f"[{p}]")
        elif p not in _PYDANTIC_TAGS and "[" not in str(p) and "(" not in str(p):
            parts.append(("." if parts else "") + str(p))
    return "".join(parts) or None


def validation_error(e: ValidationError | RequestValidationError) -> OpenAIError:
    err = e.errors()[0]
    param = _param_from_loc(tuple(x for x in err.get("loc", ()) if x != "body"))
    return bad_request(f"{param or 'request'}: {err.get('msg', 'invalid value')}", param)


async def parse_body(request: Request, model: type[BaseModel]):
    """The request's JSON body as `model`, every failure a 400 naming the field."""
    raw = await request.body()
    try:
        data = json.loads(raw or b"null")
    except (ValueError, RecursionError) as e:  # bad JSON or UTF-8, a 4300+ digit number, deep nesting
        raise bad_request(f"the request body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise bad_request("the request body must be a JSON object")
    where = lone_surrogate_path(data)
    if where is not None:
        raise bad_request(f"{where}: holds a lone UTF-16 surrogate (a \\uD800-\\uDFFF escape without its "
                          "pair); send valid Unicode text", where)
    try:
        parsed = model.model_validate(data)
    except ValidationError as e:
        raise validation_error(e) from None
    ignored = sorted(set(data) - set(model.model_fields))
    if ignored:  # as vLLM: unknown fields do not fail a request, but an operator can see them
        log.warning("%s: ignored request field(s) %s", request.url.path, ", ".join(ignored))
    return parsed
