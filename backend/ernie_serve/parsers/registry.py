"""Name -> parser class registries, one for reasoning parsers and one for tool parsers.

Names are stored with `-` (`ernie-x1`); lookups lower-case and map `_` to `-`, because FastDeploy's
flags accept both spellings. `load_parser_plugin` backs `--tool-parser-plugin file.py`.
"""
from __future__ import annotations

import hashlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Callable, Iterable, TypeVar

from .base import ReasoningParser, ToolParser

T = TypeVar("T", bound=type)


def normalize_name(name: str) -> str:
    if not isinstance(name, str):
        raise TypeError(f"parser names are strings, got {type(name).__name__}")
    norm = name.strip().lower().replace("_", "-")
    if not norm:
        raise ValueError("parser name must not be empty")
    return norm


class ParserRegistry:
    def __init__(self, kind: str, base: type):
        self.kind = kind
        self.base = base
        self._classes: dict[str, type] = {}

    def register(self, names: str | Iterable[str], force: bool = False) -> Callable[[T], T]:
        names = [names] if isinstance(names, str) else list(names)
        if not names:
            raise ValueError(f"register a {self.kind} parser under at least one name")
        keys = [normalize_name(n) for n in names]

        def decorator(cls: T) -> T:
            if not (isinstance(cls, type) and issubclass(cls, self.base)):
                raise TypeError(f"{cls!r} is not a {self.kind} parser: subclass "
                                f"ernie_serve.parsers.{self.base.__name__}")
            for key in keys:
                old = self._classes.get(key)
                if old is not None and old is not cls and not force:
                    raise ValueError(f"{self.kind} parser {key!r} is already registered "
                                     f"({old.__module__}.{old.__qualname__}); pass force=True to replace it")
            for key in keys:
                self._classes[key] = cls
            return cls
        return decorator

    def get(self, name: str) -> type:
        key = normalize_name(name)
        cls = self._classes.get(key)
        if cls is None:
            raise ValueError(f"unknown {self.kind} parser {name!r}; known: {', '.join(self.names())}")
        return cls

    def names(self) -> list[str]:
        return sorted(self._classes)


REASONING_PARSERS = ParserRegistry("reasoning", ReasoningParser)
TOOL_PARSERS = ParserRegistry("tool", ToolParser)


def register_reasoning_parser(name_or_names: str | Iterable[str], force: bool = False) -> Callable[[T], T]:
    return REASONING_PARSERS.register(name_or_names, force)


def register_tool_parser(name_or_names: str | Iterable[str], force: bool = False) -> Callable[[T], T]:
    return TOOL_PARSERS.register(name_or_names, force)


def get_reasoning_parser(name: str) -> type[ReasoningParser]:
    return REASONING_PARSERS.get(name)


def get_tool_parser(name: str) -> type[ToolParser]:
    return TOOL_PARSERS.get(name)


def list_reasoning_parsers() -> list[str]:
    return REASONING_PARSERS.names()


def list_tool_parsers() -> list[str]:
    return TOOL_PARSERS.names()


def load_parser_plugin(path: str | Path) -> ModuleType:
    """Import a .py file whose decorators register extra parsers; loading the same file twice is a no-op."""
    p = Path(path).expanduser().resolve()
    if not p.is_file():
        raise FileNotFoundError(f"parser plugin {str(path)!r} does not exist or is not a file")
    if p.suffix != ".py":
        raise ValueError(f"parser plugin must be a .py file, got {str(path)!r}")
    mod_name = f"ernie_serve_parser_plugin_{p.stem}_{hashlib.sha1(str(p).encode()).hexdigest()[:8]}"
    if mod_name in sys.modules:
        return sys.modules[mod_name]
    spec = importlib.util.spec_from_file_location(mod_name, p)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import parser plugin {str(p)!r}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[mod_name]
        raise
    return module
