"""Render a model's own jinja chat template the way HF transformers does.

Chat templates are written against HF's rendering environment (sandboxed, trim_blocks and lstrip_blocks,
a `tojson` that keeps non-ASCII and does not sort keys, `raise_exception`, `strftime_now`), so a template
only renders byte-for-byte like the model expects when we provide exactly that environment.
"""
from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """Raised by a template's `raise_exception(...)` and for missing or unknown templates."""


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # jinja's built-in tojson sorts keys and HTML-escapes <, >, & and ': model templates expect neither.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _GenerationBlock(Extension):
    """`{% generation %}...{% endgeneration %}` (HF's assistant-mask marker): rendered as its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols, _GenerationBlock])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


@lru_cache(maxsize=32)
def _compile(template: str) -> jinja2.Template:
    return _environment().from_string(template)


def select_template(configured: str | list | dict | None, override: str | None) -> str:
    """Pick the template text: an explicit override (text or a configured name), else the default one.

    tokenizer_config.json stores `chat_template` either as a string or, in HF's multi-template form, as a
    list of {"name", "template"}; "default" is the one used when no name is given.
    """
    named: dict[str, str] = {}
    if isinstance(configured, str):
        named["default"] = configured
    elif isinstance(configured, list):
        named = {t["name"]: t["template"] for t in configured}
    elif isinstance(configured, dict):
        named = dict(configured)
    if override is not None:
        return named.get(override, override)
    if "default" in named:
        return named["default"]
    if named:
        raise ChatTemplateError(f"tokenizer_config.json has chat templates {sorted(named)} but none named "
                                "'default'; pass chat_template=<name or template text>")
    raise ChatTemplateError("this tokenizer has no chat template (no 'chat_template' in tokenizer_config.json); "
                            "pass chat_template=<template text> or use a model that ships one")


def render_chat_template(template: str, messages: list[dict], tools: list[dict] | None,
                         add_generation_prompt: bool, special_tokens: dict[str, str],
                         **template_vars: Any) -> str:
    """Render `template`; `special_tokens` supplies bos_token, eos_token, ... as HF does."""
    variables = dict(special_tokens)
    variables.update(template_vars)
    return _compile(template).render(messages=messages, tools=tools,
                                     add_generation_prompt=add_generation_prompt, **variables)
