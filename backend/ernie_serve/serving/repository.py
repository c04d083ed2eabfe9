"""Render FastDeploy-named settings into a copy of model_repository/ (the source is never modified).

config.pbtxt files hold real default values (so the repository serves as is); rendering replaces the
value of each `parameters` key a model declares, and appends engine flags that ernie_moe does not list.
"""
from __future__ import annotations

import re
import shutil
from dataclasses import fields
from pathlib import Path

from ..config import EngineConfig

ENGINE_MODEL = "ernie_moe"
ENSEMBLE = "ernie"


def _param_re(key: str) -> re.Pattern:
    return re.compile(r'(\{\s*key:\s*"' + re.escape(key) + r'"\s*value:\s*\{\s*string_value:\s*")((?:[^"\\]|\\.)*)(")')


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"')


def get_parameter(text: str, key: str) -> str | None:
    m = _param_re(key).search(text)
    return None if m is None else m.group(2).replace('\\"', '"').replace("\\\\", "\\")


def set_parameter(text: str, key: str, value: str) -> tuple[str, bool]:
    pattern = _param_re(key)
    if not pattern.search(text):
        return text, False
    return pattern.sub(lambda m: m.group(1) + _escape(value) + m.group(3), text, count=1), True


def add_parameter(text: str, key: str, value: str) -> str:
    start = text.find("parameters [")
    if start < 0:
        return text.rstrip("\n") + f'\n\nparameters [\n  {{ key: "{key}" value: {{ string_value: "{_escape(value)}" }} }}\n]\n'
    end = text.find("\n]", start)
    entry = f',\n  {{ key: "{key}" value: {{ string_value: "{_escape(value)}" }} }}'
    return text[:end] + entry + text[end:]


def set_instance_count(text: str, count: int) -> str:
    return re.sub(r"(instance_group\s*\[\s*\{\s*count:\s*)\d+", lambda m: m.group(1) + str(count), text, count=1)


def set_max_inflight(text: str, n: int) -> str:
    if re.search(r"max_inflight_requests:\s*\d+", text):
        return re.sub(r"(max_inflight_requests:\s*)\d+", lambda m: m.group(1) + str(n), text, count=1)
    return re.sub(r"(ensemble_scheduling\s*\{\n)", lambda m: m.group(1) + f"  max_inflight_requests: {n}\n", text,
                  count=1)


def render_repository(src: Path, dst: Path, settings: dict[str, str], engine_instances: int | None = None,
                      max_inflight_requests: int | None = None) -> Path:
    """Copy src to dst and write `settings` ({flag_name: value}, '-' or '_') into the configs."""
    src, dst = Path(src), Path(dst)
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__"))
    engine_fields = {f.name for f in fields(EngineConfig)}
    configs = {p.parent.name: p for p in dst.glob("*/config.pbtxt")}
    texts = {name: p.read_text() for name, p in configs.items()}
    for raw_key, value in settings.items():
        key = raw_key.replace("-", "_")
        placed = False
        for name in texts:
            texts[name], hit = set_parameter(texts[name], key, str(value))
            placed |= hit
        if ENGINE_MODEL in texts and key in engine_fields and get_parameter(texts[ENGINE_MODEL], key) is None:
            texts[ENGINE_MODEL] = add_parameter(texts[ENGINE_MODEL], key, str(value))
            placed = True
        if not placed:
            known = sorted(engine_fields | {"state_ttl_seconds"})
            raise ValueError(f"unknown setting {raw_key!r}; known: {', '.join(known)}")
    if engine_instances is not None and ENGINE_MODEL in texts:
        texts[ENGINE_MODEL] = set_instance_count(texts[ENGINE_MODEL], engine_instances)
    if max_inflight_requests is not None and ENSEMBLE in texts:
        texts[ENSEMBLE] = set_max_inflight(texts[ENSEMBLE], max_inflight_requests)
    for name, p in configs.items():
        p.write_text(texts[name])
    return dst
